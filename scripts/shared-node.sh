#!/bin/bash
# One node for several suites in a row, as the test runner's lab lanes use
# it (docs/src/testing/runner.md): each suite starting its own node cost a
# lab machine's boot, the node's start and its base template's build, all
# emulated. Runs SUITE against the node scripts/node.sh's start_node
# started with LOGDIR DIR, starting it first (with suite_serve_args) when
# none answers there; a node that stopped answering is stopped and started
# afresh. The running sandboxes an earlier suite left behind are killed
# first, and named, so that every suite starts on an idle node.
#
# Usage: scripts/shared-node.sh DIR -- SUITE [ARG...]   (SUITE gets --node DIR)
#        scripts/shared-node.sh --stop DIR
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/node.sh

if [[ ${1:-} == --stop ]]; then
    node_dir=${2:?usage: scripts/shared-node.sh --stop DIR}
    stop_node
    exit 0
fi
dir=${1:?usage: scripts/shared-node.sh DIR -- SUITE [ARG...]}
[[ ${2:-} == -- && -n ${3:-} ]] || die "usage: scripts/shared-node.sh DIR -- SUITE [ARG...]"
shift 2

answers() {
    [[ -s $dir/node.pid && -s $dir/node.url ]] &&
        kill -0 "$(cat "$dir/node.pid")" 2>/dev/null &&
        healthy "$(cat "$dir/node.url")"
}

# Kills the running sandboxes the node lists; prints their ids.
kill_leftovers() {
    python3 - "$(cat "$dir/node.url")" "$(cat "$dir/node.key")" <<'PY'
import json, sys, urllib.request
url, key = sys.argv[1:]
def call(method: str, path: str) -> bytes:
    req = urllib.request.Request(url + path, method=method, headers={"X-API-Key": key})
    with urllib.request.urlopen(req, timeout=120) as answer:
        return answer.read()
ids = [s["sandboxID"] for s in json.loads(call("GET", "/sandboxes"))]
for sandbox in ids:
    call("DELETE", f"/sandboxes/{sandbox}")
print(" ".join(ids))
PY
}

if answers; then
    left=$(kill_leftovers) || die "could not list or kill the node's sandboxes (log: $dir/serve.log)"
    [[ -z $left ]] || log "killed the sandboxes an earlier suite left running: $left"
else
    if [[ -s $dir/node.pid ]]; then
        log "the node of $dir does not answer: starting it afresh"
        node_dir=$dir
        stop_node
    fi
    mkdir -p "$dir"
    built 0
    # the credentials file the SDK suite's image tests write (suite_serve_args)
    SANDFORK_REGISTRY_AUTH=$(realpath "$dir")/registry-auth.json
    export SANDFORK_REGISTRY_AUTH
    rm -f "$SANDFORK_REGISTRY_AUTH"
    start_node target/debug/sandfork "$dir" "${suite_serve_args[@]}"
fi
exec "$@" --node "$dir"

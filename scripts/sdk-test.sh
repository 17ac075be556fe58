#!/bin/bash
# The unmodified E2B SDKs against `sandfork serve`: builds everything
# (scripts/build.sh), installs the pinned Python and JavaScript SDKs into
# caches outside the repository, starts the server on a free local port with a
# fresh API key, runs tests/sdk/python (pytest) and then tests/sdk/js
# (node --test), stops the server, and exits non-zero if anything failed.
#
# Usage: scripts/sdk-test.sh [--only-basic] [--suite python|js] [--no-build]
#                            [--server URL]
#   --only-basic  skip the `lifecycle` tests (pause/connect, fork, snapshots)
#   --suite S     run only one SDK's suite
#   --no-build    do not run scripts/build.sh (target/sandfork.env must exist)
#   --server URL  test a server that is already running at URL (its key in
#                 E2B_API_KEY) instead of starting one
# Env: SANDFORK_CACHE (default /var/cache/sandfork): the SDK caches live in
#      $SANDFORK_CACHE/sdk/, keyed by the hash of requirements.txt and of the
#      npm lockfile. SDK_PYTEST_ARGS: extra pytest arguments (e.g. "-k files").
#      SDK_TEST_TEMPLATE: template the suites create sandboxes from (base).
#      SDK_SERVE_ARGS: extra `sandfork serve` arguments (e.g. "--pool-size 2").
# Out: the server's log in target/sdk-test/serve.log, its store in
#      target/sdk-test/data (fresh each run).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

only_basic=0 suite=all build=1 server=''

log() { echo "sdk-test: $*" >&2; }
die() { log "error: $*"; exit 1; }

while (($#)); do
    case $1 in
        --only-basic) only_basic=1; shift ;;
        --suite) suite=${2:?--suite needs python or js}; shift 2 ;;
        --no-build) build=0; shift ;;
        --server) server=${2:?--server needs a URL}; shift 2 ;;
        -h | --help) sed -n '2,/^set -e/p' "${BASH_SOURCE[0]}" | sed -n 's/^# \{0,1\}//p'; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
case $suite in all | python | js) ;; *) die "--suite must be python or js" ;; esac

# the SDK installs (setup_python, setup_node), shared with `sandfork bench`
. scripts/sdk-setup.sh

# --- the server ------------------------------------------------------------
serve_pid=''
stop_server() {
    [[ -n $serve_pid ]] || return 0
    log "stopping the server (pid $serve_pid)"
    kill -TERM -- "-$serve_pid" 2>/dev/null || true
    for _ in $(seq 60); do
        kill -0 "$serve_pid" 2>/dev/null || break
        sleep 0.5
    done
    kill -KILL -- "-$serve_pid" 2>/dev/null || true
    wait "$serve_pid" 2>/dev/null || true
    serve_pid=''
}
trap stop_server EXIT

start_server() {
    local port key lab=target/debug/sandfork-lab logdir=target/sdk-test
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    key=e2b_$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
    # a fresh store each run: no sandboxes or keys from earlier runs
    rm -rf "$logdir/data"
    mkdir -p "$logdir/data"
    # shellcheck disable=SC2206 # SDK_SERVE_ARGS is a list of words
    local cmd=(target/debug/sandfork serve --listen "127.0.0.1:$port" --data-dir "$logdir/data" ${SDK_SERVE_ARGS:-})
    # serve re-execs itself into the KVM lab when /dev/kvm cannot boot Linux:
    # one lab at a time on the machine, so hold its lock while it runs.
    # (SANDFORK_LAB_LOCKED: the caller, scripts/test.sh, holds it already.)
    if [[ -z ${SANDFORK_LAB_LOCKED:-} && $("$lab" detect | sed -n 1p) != hardware* ]]; then
        log "no hardware KVM: the server runs in the lab; waiting for the lab lock"
        cmd=(flock /tmp/sandfork-lab.lock "${cmd[@]}")
    fi
    log "starting: ${cmd[*]} (log: $logdir/serve.log)"
    # its own process group, so that stopping it reaches the lab it started
    SANDFORK_API_KEY=$key setsid "${cmd[@]}" >"$logdir/serve.log" 2>&1 &
    serve_pid=$!
    export E2B_API_URL=http://127.0.0.1:$port E2B_SANDBOX_URL=http://127.0.0.1:$port E2B_API_KEY=$key
    local deadline=$((SECONDS + 900))
    until python3 - "$E2B_API_URL/health" <<'PY' 2>/dev/null; do
import sys, urllib.request
sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=5).status < 300 else 1)
PY
        kill -0 "$serve_pid" 2>/dev/null || { tail -n 40 "$logdir/serve.log" >&2; die "the server exited"; }
        ((SECONDS < deadline)) || { tail -n 40 "$logdir/serve.log" >&2; die "no /health after 900 s"; }
        sleep 1
    done
    log "server up at $E2B_API_URL"
}

# --- run -------------------------------------------------------------------
if ((build)); then
    scripts/build.sh
fi
if [[ -z $server ]]; then
    [[ -f target/sandfork.env ]] || die "target/sandfork.env missing (run scripts/build.sh)"
    set -a
    . target/sandfork.env
    set +a
fi

[[ $suite == js ]] || setup_python
[[ $suite == python ]] || setup_node

if [[ -n $server ]]; then
    [[ -n ${E2B_API_KEY:-} ]] || die "--server needs E2B_API_KEY"
    export E2B_API_URL=$server E2B_SANDBOX_URL=$server
else
    start_server
fi

failed=()
run() {
    local name=$1; shift
    log "== $name"
    if "$@"; then log "== $name: passed"; else failed+=("$name"); log "== $name: FAILED"; fi
}
# shellcheck disable=SC2086 # SDK_PYTEST_ARGS is a list of words
pytest() { "$venv/bin/python" -m pytest tests/sdk/python -p no:cacheprovider ${SDK_PYTEST_ARGS:-} "$@"; }
# node 22 takes globs, node 20 directories: name the files
nodetest() { (cd tests/sdk/js && "$node" --test --test-concurrency=1 "$1"/*.test.mjs); }

if [[ $suite != js ]]; then
    run "python basic" pytest -m "not lifecycle"
    ((only_basic)) || run "python lifecycle" pytest -m lifecycle
fi
if [[ $suite != python ]]; then
    run "js basic" nodetest basic
    ((only_basic)) || run "js lifecycle" nodetest lifecycle
fi

stop_server
if ((${#failed[@]})); then
    log "failed: ${failed[*]}"
    exit 1
fi
log "all SDK suites passed"

#!/bin/bash
# Restarts the node scripts/node.sh's start_node started with LOGDIR,
# keeping its store, port and API key: for the tests of what a node keeps
# across a restart (tests/sdk). SIGTERM to its process group (the node
# leaves its sandboxes running for the next start to adopt), SIGKILL after
# 30 s, then the same command again; returns once /health answers.
#
# Usage: scripts/node-restart.sh LOGDIR
set -euo pipefail
dir=${1:?usage: scripts/node-restart.sh LOGDIR}
for f in cmd pid url key; do
    [[ -s $dir/node.$f ]] || { echo "node-restart: $dir/node.$f missing (start_node writes it)" >&2; exit 1; }
done
pid=$(cat "$dir/node.pid")

# The node and all it started (in the lab: sandfork-lab and QEMU, which holds
# the node's forwarded port a little after the node itself exits) gone, or
# zombies not reaped yet: until then the new start cannot take the port.
gone() {
    ! ps -e -o pgid=,stat= | awk -v g="$pid" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'
}
kill -TERM -- "-$pid" 2>/dev/null || true
for _ in $(seq 60); do
    gone && break
    sleep 0.5
done
gone || kill -KILL -- "-$pid" 2>/dev/null || true
for _ in $(seq 20); do
    gone && break
    sleep 0.5
done

echo "node-restart: starting again: $(cat "$dir/node.cmd")" >&2
# shellcheck disable=SC2016 # the inner shell expands it
SANDFORK_API_KEY=$(cat "$dir/node.key") setsid bash -c 'eval "exec $0"' "$(cat "$dir/node.cmd")" >>"$dir/serve.log" 2>&1 &
echo $! >"$dir/node.pid"
url=$(cat "$dir/node.url")
for _ in $(seq 600); do
    if python3 - "$url/health" <<'PY' 2>/dev/null; then
import sys, urllib.request
sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=5).status < 300 else 1)
PY
        echo "node-restart: up again at $url" >&2
        exit 0
    fi
    kill -0 "$(cat "$dir/node.pid")" 2>/dev/null || { tail -n 40 "$dir/serve.log" >&2; echo "node-restart: the node exited" >&2; exit 1; }
    sleep 1
done
echo "node-restart: no /health 600 s after the restart" >&2
exit 1

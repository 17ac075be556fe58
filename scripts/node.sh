# shellcheck shell=bash
# Sourced by the scripts that test against a real node (sdk-test.sh,
# cli-test.sh, rl-test.sh, harbor-test.sh, frameworks-test.sh, soak-test.sh),
# before they read their options: start_node starts `sandfork
# serve` on a free local port with a fresh API key and data dir and waits for
# /health; stop_node stops it (and
# the lab it runs in). It sets root (the checkout, the caller's directory)
# and defines log and die, which name the calling script.
#
#   start_node BINARY LOGDIR [SERVE-ARG...]
#     sets node_url, node_key and node_pid; the log is LOGDIR/serve.log, the
#     store NODE_DATA if set, else LOGDIR/data (emptied first). Where /dev/kvm cannot boot Linux,
#     serve re-runs itself in the KVM lab: one lab at a time on the machine,
#     so the lab lock is held while it runs (unless SANDFORK_LAB_LOCKED says
#     the caller, scripts/test.sh, holds it already).
#   stop_node
#     SIGTERM to the node's process group, SIGKILL after 30 s.
#   use_node SERVER BUILD LOGDIR [BINARY [SERVE-ARG...]]
#     points E2B_API_URL, E2B_SANDBOX_URL (and E2B_API_KEY) at the node a
#     suite runs against: SERVER when given (its key already in
#     E2B_API_KEY), else one started here by start_node from BINARY
#     (default target/debug/sandfork) with the SERVE-ARGs (after
#     scripts/build.sh when BUILD is 1), logging to LOGDIR and stopped when
#     the script exits.
#   A node is restarted (its store, port and key kept) from another process
#   by scripts/node-restart.sh LOGDIR, which reads the LOGDIR/node.* files
#   start_node writes; stop_node then stops the restarted one.
#   built BUILD
#     scripts/build.sh when BUILD is 1, then target/sandfork.env's variables
#     exported (the kernel, images and lab that build.sh made).
#   suite_options ARG...
#     the options every suite entry takes: --no-build (build=0, else 1),
#     --server URL (server=URL, else empty), --node DIR (the node start_node
#     started with LOGDIR DIR, which scripts/shared-node.sh shares between
#     suites: server and E2B_API_KEY read from there, shared_node=DIR),
#     -h/--help (prints the calling script's header comment and exits); the
#     other words are left, in order, in suite_rest for the script's own
#     options.
#   suite_serve_args
#     what a node the suites share is started with, the SDK suite's own too:
#     creates by image read metadata key $suite_image_metadata_key, and the
#     webhook tests' receiver is on loopback (not a public address). Its
#     registry credentials file is LOGDIR/registry-auth.json.
#   healthy URL
#     whether URL/health answers 2xx within 5 s.

# shellcheck disable=SC2034 # the caller's
root=$PWD
suite_name=${0##*/}
log() { echo "${suite_name%.sh}: $*" >&2; }
die() { log "error: $*"; exit 1; }

node_pid='' node_dir=''

stop_node() {
    # restarted meanwhile by scripts/node-restart.sh: that one
    [[ -z $node_dir || ! -s $node_dir/node.pid ]] || node_pid=$(cat "$node_dir/node.pid")
    [[ -n $node_pid ]] || return 0
    log "stopping the node (pid $node_pid)"
    kill -TERM -- "-$node_pid" 2>/dev/null || true
    for _ in $(seq 60); do
        kill -0 "$node_pid" 2>/dev/null || break
        sleep 0.5
    done
    kill -KILL -- "-$node_pid" 2>/dev/null || true
    wait "$node_pid" 2>/dev/null || true
    node_pid=''
    [[ -z $node_dir ]] || rm -f "$node_dir/node.pid"
}

start_node() {
    local binary=$1 logdir=$2
    shift 2
    local port lab data=${NODE_DATA:-$logdir/data}
    lab=$(dirname "$binary")/sandfork-lab
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    node_key=e2b_$(od -An -N20 -tx1 /dev/urandom | tr -d ' \n')
    rm -rf "$data"
    mkdir -p "$data"
    local cmd=("$binary" serve --listen "127.0.0.1:$port" --data-dir "$data" "$@")
    local locked=$logdir/lab-locked
    rm -f "$locked"
    if [[ -z ${SANDFORK_LAB_LOCKED:-} && $("$lab" detect | sed -n 1p) != hardware* ]]; then
        log "no hardware KVM: the node runs in the lab; waiting for the lab lock"
        # The marker tells the wait below when the lock is held: the start-up
        # deadline counts from then, not from the wait for another lab user.
        # shellcheck disable=SC2016 # the inner shell expands them
        cmd=(flock /tmp/sandfork-lab.lock sh -c 'touch "$0" && exec "$@"' "$locked" "${cmd[@]}")
    else
        touch "$locked"
    fi
    log "starting: ${cmd[*]} (log: $logdir/serve.log)"
    # its own process group, so that stopping it reaches the lab it started
    SANDFORK_API_KEY=$node_key setsid "${cmd[@]}" >"$logdir/serve.log" 2>&1 &
    node_pid=$!
    node_url=http://127.0.0.1:$port
    # what scripts/node-restart.sh needs to start it again
    node_dir=$logdir
    printf '%q ' "${cmd[@]}" >"$logdir/node.cmd"
    echo "$node_pid" >"$logdir/node.pid"
    echo "$node_url" >"$logdir/node.url"
    echo "$node_key" >"$logdir/node.key"
    local deadline=''
    until healthy "$node_url"; do
        kill -0 "$node_pid" 2>/dev/null || { tail -n 40 "$logdir/serve.log" >&2; die "the node exited"; }
        if [[ -z $deadline && -e $locked ]]; then
            deadline=$((SECONDS + 900))
        fi
        [[ -z $deadline ]] || ((SECONDS < deadline)) || {
            tail -n 40 "$logdir/serve.log" >&2
            die "no /health 900 s after the node started"
        }
        sleep 1
    done
    log "node up at $node_url"
}

healthy() {
    python3 - "$1/health" <<'PY' 2>/dev/null
import sys, urllib.request
sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=5).status < 300 else 1)
PY
}

suite_image_metadata_key=sdk-test.image
suite_serve_args=(--image-metadata-key "$suite_image_metadata_key" --webhook-allow-net 127.0.0.0/8)

built() {
    if (($1)); then scripts/build.sh; fi
    [[ -f target/sandfork.env ]] || die "target/sandfork.env missing (run scripts/build.sh)"
    set -a
    # shellcheck source=/dev/null  # written by scripts/build.sh
    . target/sandfork.env
    set +a
}

suite_options() {
    build=1 server='' shared_node='' suite_rest=()
    while (($#)); do
        case $1 in
            --no-build) build=0; shift ;;
            --server) server=${2:?--server needs a URL}; shift 2 ;;
            --node) shared_node=${2:?--node needs a directory}; shift 2 ;;
            -h | --help) sed -n '2,/^set -e/p' "$0" | sed -n 's/^# \{0,1\}//p'; exit 0 ;;
            *) suite_rest+=("$1"); shift ;;
        esac
    done
    if [[ -n $shared_node ]]; then
        [[ -s $shared_node/node.url && -s $shared_node/node.key ]] ||
            die "--node $shared_node: no node.url and node.key there (scripts/shared-node.sh starts one)"
        server=$(cat "$shared_node/node.url")
        E2B_API_KEY=$(cat "$shared_node/node.key")
        export E2B_API_KEY
    fi
}

use_node() {
    local server=$1 build=$2 logdir=$3
    shift 3
    local binary=${1:-target/debug/sandfork}
    shift $(($# ? 1 : 0))
    if [[ -n $server ]]; then
        [[ -n ${E2B_API_KEY:-} ]] || die "--server needs E2B_API_KEY"
        export E2B_API_URL=$server E2B_SANDBOX_URL=$server
        return 0
    fi
    built "$build"
    trap stop_node EXIT
    start_node "$binary" "$logdir" "$@"
    export E2B_API_URL=$node_url E2B_SANDBOX_URL=$node_url E2B_API_KEY=$node_key
}

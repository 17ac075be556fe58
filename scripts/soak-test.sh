#!/bin/bash
# A soak of a real node (README, "Soak"): starts `sandfork serve` on a fresh
# data dir and key and runs `sandfork soak` beside it, so that the soak reads
# the server's and its VMMs' memory from /proc; then stops the node. Where
# /dev/kvm cannot boot Linux, node and soak run in one KVM lab machine (under
# the lab lock unless SANDFORK_LAB_LOCKED says the caller holds it): a node
# the lab serves through a port forward is out of the host's /proc.
#
# Usage: scripts/soak-test.sh [--no-build] [SOAK-ARG...]
#   --no-build  do not run scripts/build.sh (target/sandfork.env must exist)
#   SOAK-ARG    `sandfork soak` arguments [default: the CI bounds, --sandboxes 4
#               --workers 8 --commands 300 --files 100 --duration 3m]
# Env: CARGO_TARGET_DIR (default target: its binaries are the ones run),
#      SOAK_SERVE_ARGS (extra `sandfork serve` arguments), SOAK_LAB_MEMORY
#      (MiB, default 6144), SOAK_LAB_TIMEOUT (seconds, default 1800),
#      SANDFORK_LAB_LOCKED (the caller holds the lab lock).
# Out: the soak's JSON in $target/soak-test/soak.json, its summary on stderr,
#      the node's log in $target/soak-test/serve.log; exit status the soak's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/node.sh

soak_data=''

# scripts/node.sh's stop_node, then the VMMs the node left running (a
# stopped node leaves its sandboxes for the next start to adopt: those the
# soak could not kill would stay) and its store.
stop_soak_node() {
    local vmms=''
    [[ -z $node_pid ]] || vmms=$(pgrep -P "$node_pid" || true)
    stop_node
    # shellcheck disable=SC2086 # a list of pids
    [[ -z $vmms ]] || kill -KILL $vmms 2>/dev/null || true
    [[ -z $soak_data ]] || rm -rf "$soak_data"
}

# The node (scripts/node.sh's start_node) and the soak, side by side: where
# microVMs boot (the lab machine, or this host on hardware KVM). Arguments:
# where (lab or here), the log directory, the sandfork binary, the soak's
# arguments.
beside_node() {
    local where=$1 logdir=$2 sandfork=$3
    shift 3
    local serve_args=() status=0
    [[ $where == lab ]] && serve_args+=(--in-lab)
    # shellcheck disable=SC2206 # SOAK_SERVE_ARGS is a list of words
    serve_args+=(${SOAK_SERVE_ARGS:-})
    . scripts/node.sh
    # In the lab /tmp is the machine's own tmpfs: no 9p under the node's disks.
    soak_data=$(mktemp -d /tmp/sandfork-soak.XXXXXX)
    trap stop_soak_node EXIT
    # the node runs here, beside the soak (in the lab: in its machine, which
    # the caller locked)
    SANDFORK_LAB_LOCKED=1 NODE_DATA=$soak_data start_node "$sandfork" "$logdir" "${serve_args[@]}"
    SANDFORK_API_URL=$node_url SANDFORK_API_KEY=$node_key \
        "$sandfork" soak --server-pid "$node_pid" "$@" >"$logdir/soak.json" || status=$?
    if ((status)); then
        grep -E ' (WARN|ERROR) ' "$logdir/serve.log" | tail -n 20 >&2 || true
    fi
    return "$status"
}

if [[ ${1:-} == --beside-node ]]; then
    shift
    beside_node "$@"
    exit
fi

build=1
if [[ ${1:-} == --no-build ]]; then
    build=0
    shift
fi
case ${1:-} in
    -h | --help) sed -n '2,/^set -e/p' "${BASH_SOURCE[0]}" | sed -n 's/^# \{0,1\}//p'; exit 0 ;;
esac
soak_args=("$@")
if ((${#soak_args[@]} == 0)); then
    soak_args=(--sandboxes 4 --workers 8 --commands 300 --files 100 --duration 3m)
fi

built "$build"
target=${CARGO_TARGET_DIR:-$root/target}
sandfork=$target/debug/sandfork
[[ -x $sandfork ]] || die "$sandfork is not built"
logdir=$target/soak-test
mkdir -p "$logdir"
rm -f "$logdir/soak.json" "$logdir/serve.log"

lab=$target/debug/sandfork-lab
status=0
if [[ $("$lab" detect | sed -n 1p) == hardware* ]]; then
    "$0" --beside-node here "$logdir" "$sandfork" "${soak_args[@]}" || status=$?
else
    run=("$lab" run --cpus 1 --memory "${SOAK_LAB_MEMORY:-6144}" --timeout "${SOAK_LAB_TIMEOUT:-1800}"
        --env "SOAK_SERVE_ARGS=${SOAK_SERVE_ARGS:-}" --rw "$logdir"
        -- "$root/scripts/soak-test.sh" --beside-node lab "$logdir" "$sandfork" "${soak_args[@]}")
    if [[ -z ${SANDFORK_LAB_LOCKED:-} ]]; then
        log "no hardware KVM: node and soak run in the lab; waiting for the lab lock"
        run=(flock /tmp/sandfork-lab.lock "${run[@]}")
    fi
    log "running in the lab: ${soak_args[*]}"
    "${run[@]}" || status=$?
fi
if [[ -s $logdir/soak.json ]]; then
    log "report: $logdir/soak.json"
fi
((status == 0)) || die "the soak failed (exit $status; node log: $logdir/serve.log)"
log "soak passed"

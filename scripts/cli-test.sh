#!/bin/bash
# The sandfork CLI against a real node: builds the CLI's node tests, starts
# `sandfork serve` on a free local port with a fresh API key and data dir
# (in the KVM lab, under the lab lock, where /dev/kvm cannot boot Linux),
# runs crates/cli/tests/cli_node.rs (its `lab:` tests, one node for all)
# with SANDFORK_API_URL and SANDFORK_API_KEY, and stops the node.
#
# Usage: scripts/cli-test.sh [--no-build] [TEST-FILTER...]
#   --no-build  do not run scripts/build.sh (target/sandfork.env must exist)
# Env: CARGO_TARGET_DIR (default target), CLI_SERVE_ARGS (extra `sandfork
#      serve` arguments), SANDFORK_LAB_LOCKED (the caller holds the lab lock),
#      CLI_NODE_TEST_BIN (the cli_node test binary, already built: scripts/
#      test.sh passes the one its workspace test build made).
# Out: the node's log in $target/cli-test/serve.log.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/node.sh

build=1
filters=()
while (($#)); do
    case $1 in
        --no-build) build=0; shift ;;
        -h | --help) sed -n '2,/^set -e/p' "${BASH_SOURCE[0]}" | sed -n 's/^# \{0,1\}//p'; exit 0 ;;
        *) filters+=("$1"); shift ;;
    esac
done

built "$build"
target=${CARGO_TARGET_DIR:-$root/target}
# The interactive shell tests drive a terminal with tmux (scripts/deps.sh).
command -v tmux >/dev/null || die "tmux is missing: run scripts/deps.sh"

# The CLI and the lab come from scripts/build.sh (the caller's, under
# --no-build). The node tests are built before the node starts (the lab
# takes a CPU of its own), for the whole workspace as scripts/test.sh builds
# them: naming the package with -p would resolve features for it alone and
# compile its dependencies again.
test_bin=${CLI_NODE_TEST_BIN:-}
if [[ -z $test_bin ]]; then
    log "building the CLI's node tests"
    # the runner's reading of cargo's JSON (tests/runner/sandfork_runner/cargo.py)
    test_bin=$(cargo test --workspace --test cli_node --no-run --message-format=json 2>/dev/null |
        PYTHONPATH=tests/runner python3 -m sandfork_runner.cargo cli_node)
fi
[[ -x $test_bin ]] || die "the cli_node test binary was not built"

trap stop_node EXIT
logdir=$target/cli-test
rm -rf "$logdir/scratch"
# shellcheck disable=SC2086 # CLI_SERVE_ARGS is a list of words
start_node "$target/debug/sandfork" "$logdir" ${CLI_SERVE_ARGS:-}

status=0
# Files the node reads by path (OCI layouts) go where the lab sees them.
SANDFORK_API_URL=$node_url SANDFORK_API_KEY=$node_key CLI_TEST_SCRATCH=$logdir/scratch \
    "$test_bin" --ignored --test-threads=1 "${filters[@]}" || status=$?
stop_node
if ((status)); then
    tail -n 40 "$logdir/serve.log" >&2
    die "CLI node tests failed"
fi
log "CLI node tests passed"

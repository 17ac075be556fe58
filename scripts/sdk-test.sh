#!/bin/bash
# The unmodified E2B SDKs against `sandfork serve`: builds everything
# (scripts/build.sh), installs the pinned Python and JavaScript SDKs into
# caches outside the repository, starts the server on a free local port with a
# fresh API key (scripts/node.sh's use_node), runs tests/sdk/python
# (pytest), then tests/sdk/js (node --test), then the E2B CLI's suite
# tests/e2b-cli (pytest driving the pinned @e2b/cli, on the same node),
# stops the server, and exits non-zero if anything failed.
#
# Usage: scripts/sdk-test.sh [--only-basic] [--suite python|js|cli] [--no-build]
#                            [--server URL | --node DIR]
#   --only-basic  skip the `lifecycle` tests (pause/connect, fork, snapshots)
#                 and the E2B CLI
#   --suite S     run only one SDK's suite (or the CLI's)
#   --no-build    do not run scripts/build.sh (target/sandfork.env must exist)
#   --server URL  test a server that is already running at URL (its key in
#                 E2B_API_KEY) instead of starting one
#   --node DIR    test the node scripts/shared-node.sh runs with DIR (its
#                 restart tests too)
# Env: SANDFORK_CACHE (default /var/cache/sandfork): the SDK caches live in
#      $SANDFORK_CACHE/sdk/, keyed by the hash of requirements.txt and of the
#      npm lockfile. SDK_PYTEST_ARGS: extra pytest arguments (e.g. "-k files").
#      SDK_TEST_TEMPLATE: template the SDK suites create sandboxes from (base).
#      E2B_CLI_PYTEST_ARGS: extra pytest arguments for the E2B CLI's suite.
#      SDK_SERVE_ARGS: extra `sandfork serve` arguments (e.g. "--pool-size 2").
#      SDK_TEST_BINARY: the `sandfork` to serve (target/debug/sandfork), e.g.
#      an older build, to see a new test fail without the change it tests.
#      SDK_TEST_OUT: where the server's log and store go (target/sdk-test),
#      so that two runs from one checkout can run side by side.
# Tests: SDK_NODE_DIR names the node's LOGDIR, for scripts/node-restart.sh
#      (unset with --server: a test that restarts the node skips).
#      SANDFORK_REGISTRY_AUTH: the node's registry credentials file, which
#      the image tests write (their registry starts after the node); the
#      node started here reads image names from metadata key
#      SDK_IMAGE_METADATA_KEY (test_create_image.py).
# Out: the server's log in $SDK_TEST_OUT/serve.log, its store in
#      $SDK_TEST_OUT/data (fresh each run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/node.sh

suite_options "$@"
only_basic=0 suite=all
set -- "${suite_rest[@]}"
while (($#)); do
    case $1 in
        --only-basic) only_basic=1; shift ;;
        --suite) suite=${2:?--suite needs python, js or cli}; shift 2 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
case $suite in all | python | js | cli) ;; *) die "--suite must be python, js or cli" ;; esac

# the SDK installs (setup_python, setup_node), shared with `sandfork bench`
. scripts/sdk-setup.sh

cli_suite=0
if [[ $suite == all || $suite == cli ]] && ! ((only_basic)); then
    cli_suite=1
    # its interactive shell runs in a tmux terminal
    command -v tmux >/dev/null || die "tmux is missing: run scripts/deps.sh"
fi
# the Python SDK suite's venv runs the E2B CLI's pytest suite too
[[ $suite == js ]] || setup_python
# the web console's test (test_console.py) drives Debian's Chromium
if [[ $suite != js ]] && ! command -v chromium >/dev/null; then
    apt_install chromium
fi
[[ $suite == python ]] || setup_node
((cli_suite == 0)) || setup_e2b_cli

# --- the server ------------------------------------------------------------
out=${SDK_TEST_OUT:-target/sdk-test}
mkdir -p "$out"
# The node's own registry credentials (for creates that name an image), a
# file the image tests write; absolute: the node may run in the lab (which
# sees the host's root).
SANDFORK_REGISTRY_AUTH=$(realpath "${shared_node:-$out}")/registry-auth.json
rm -f "$SANDFORK_REGISTRY_AUTH"
export SANDFORK_REGISTRY_AUTH SDK_IMAGE_METADATA_KEY=$suite_image_metadata_key
# shellcheck disable=SC2086 # SDK_SERVE_ARGS is a list of words
use_node "$server" "$build" "$out" "${SDK_TEST_BINARY:-target/debug/sandfork}" \
    "${suite_serve_args[@]}" ${SDK_SERVE_ARGS:-}
# the tests of what survives a restart run scripts/node-restart.sh on it
if [[ -z $server || -n $shared_node ]]; then
    SDK_NODE_DIR=$(realpath "${shared_node:-$node_dir}")
    export SDK_NODE_DIR
fi

failed=()
run() {
    local name=$1; shift
    log "== $name"
    if "$@"; then log "== $name: passed"; else failed+=("$name"); log "== $name: FAILED"; fi
}
# SDK_PYTEST_ARGS is split as a shell would (quotes kept: -k 'a or b'); a
# selection that leaves one of the two runs without tests is not a failure.
pytest_args=()
if [[ -n ${SDK_PYTEST_ARGS:-} ]]; then
    mapfile -t pytest_args < <(python3 -c 'import shlex, sys; print(*shlex.split(sys.argv[1]), sep="\n")' "$SDK_PYTEST_ARGS")
fi
# A test that fails runs again once, in place (the runner's retry rule,
# docs/src/testing/runner.md); -rR names it in the log for the runner.
rerun=(--reruns 1 -rfER)
pytest() {
    local rc=0
    "$venv/bin/python" -m pytest tests/sdk/python -p no:cacheprovider --durations=12 "${rerun[@]}" "${pytest_args[@]}" "$@" || rc=$?
    ((rc == 5 && ${#pytest_args[@]})) && { log "no test selected by SDK_PYTEST_ARGS here"; rc=0; }
    return "$rc"
}
# node 22 takes globs, node 20 directories: name the files
nodetest() { (cd tests/sdk/js && "$node" --test --test-concurrency=1 "$1"/*.test.mjs); }

# The E2B CLI run by the Node.js and from the cache setup_node and
# setup_e2b_cli made.
e2b_cli_tests() {
    # shellcheck disable=SC2086 # E2B_CLI_PYTEST_ARGS is a list of words
    E2B_CLI_NODE=$node E2B_CLI_ENTRY=$e2b_cli "$venv/bin/python" -m pytest tests/e2b-cli "${rerun[@]}" ${E2B_CLI_PYTEST_ARGS:-}
}
if [[ $suite == all || $suite == python ]]; then
    # the tests' and the bench's Python
    run "python lint" python_lint "$venv" tests/sdk/python tests/cluster tests/support crates/cli/src/bench
    run "console test types" python_typed "$venv" tests/sdk/python/test_console.py
    run "python basic" pytest -m "not lifecycle"
    ((only_basic)) || run "python lifecycle" pytest -m lifecycle
fi
if [[ $suite == all || $suite == js ]]; then
    run "js basic" nodetest basic
    ((only_basic)) || run "js lifecycle" nodetest lifecycle
fi
if ((cli_suite)); then
    run "e2b cli lint" python_typed "$venv" tests/e2b-cli
    run "e2b cli" e2b_cli_tests
fi

stop_node
if ((${#failed[@]})); then
    log "failed: ${failed[*]}"
    exit 1
fi
log "all SDK suites passed"

#!/bin/bash
# The sandfork Python package (python/): ruff format and lint, mypy, the tests that
# need no node, then the tests against `sandfork serve` on real microVMs
# (inside the lab here): Sandbox/AsyncSandbox forks and checkpoints (forks of
# paused sandboxes and of snapshots), the environments and Gymnasium's
# checker, the branching runner, the adapters with mini-swe-agent and
# skyrl-gym.
#
# Usage: scripts/rl-test.sh [--no-build] [--host-only] [--server URL | --node DIR]
#   --no-build    do not run scripts/build.sh (target/sandfork.env must exist)
#   --host-only   lint and the tests without a node only
#   --server URL  test a server already running at URL (key in E2B_API_KEY)
#   --node DIR    test the node scripts/shared-node.sh runs with DIR
# Env: SANDFORK_CACHE (default /var/cache/sandfork): the venv is
#      $SANDFORK_CACHE/sdk/python-rl-<hash of tests/sdk/python/requirements.txt,
#      python/requirements-test.txt, python/requirements-nodeps.txt and the
#      interpreter> (the adapters' frameworks included); the package goes
#      into it again whenever python/'s content hash changes.
#      RL_PYTEST_ARGS: extra pytest arguments (e.g. "-k runner").
# Out: the server's log in target/rl-test/serve.log.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/node.sh

suite_options "$@"
host_only=0
for arg in "${suite_rest[@]}"; do
    case $arg in
        --host-only) host_only=1 ;;
        *) die "unknown argument: $arg (see --help)" ;;
    esac
done

# cached_dir and apt_install, shared with the SDK suites
. scripts/sdk-setup.sh

# --- the venv: the SDK set plus the package's test set, then the package ----
command -v python3 >/dev/null || apt_install python3
python3 -c 'import venv, ensurepip' 2>/dev/null || apt_install python3-venv
sdk_req=tests/sdk/python/requirements.txt rl_req=python/requirements-test.txt
nodeps_req=python/requirements-nodeps.txt
key=$({ cat "$sdk_req" "$rl_req" "$nodeps_req"; python3 -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
venv=$sdk_cache/python-rl-$key
# shellcheck disable=SC2317  # called by cached_dir
make_venv() {
    log "creating the package's test venv ($1)"
    python3 -m venv "$1" &&
        "$1/bin/pip" install -q --disable-pip-version-check -r "$root/$sdk_req" -r "$root/$rl_req" >&2 &&
        "$1/bin/pip" install -q --disable-pip-version-check --no-deps -r "$root/$nodeps_req" >&2
}
cached_dir "$venv" make_venv
if ! "$venv/bin/python" -c 'import e2b, gymnasium, pytest, skyrl_gym, importlib.metadata as m; m.version("mini-swe-agent")' 2>/dev/null; then
    rm -rf "$venv"
    cached_dir "$venv" make_venv
fi
# The package itself, keyed by the content of python/ (not by the venv):
# reinstalled, offline and without build isolation, whenever it changes.
pkg=$(git ls-files -co --exclude-standard python | grep -v '^python/tests/' | sort | xargs sha256sum | sha256sum | cut -c1-16)
(
    flock 8
    if [[ $(cat "$venv/.sandfork-pkg" 2>/dev/null) != "$pkg" ]]; then
        log "installing python/ ($pkg) into $venv"
        build_dir=$(mktemp -d)
        cp -r python/. "$build_dir/"
        "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-index \
            --no-build-isolation --force-reinstall "$build_dir" >&2
        rm -rf "$build_dir"
        echo "$pkg" >"$venv/.sandfork-pkg"
    fi
) 8>"$venv.lock"

# --- lint and the tests without a node -------------------------------------
log "== ruff and mypy"
# and the code interpreter's guest server (its own pyproject.toml)
python_lint "$venv" python images/code-interpreter
(cd python && "$venv/bin/python" -m mypy)
# from the tests' directory, so that `sandfork` is the installed package
# shellcheck disable=SC2086 # RL_PYTEST_ARGS is a list of words
pytest() { (cd python && "$venv/bin/python" -m pytest tests -p no:cacheprovider ${RL_PYTEST_ARGS:-} "$@"); }
log "== tests without a node"
# A selection (RL_PYTEST_ARGS) that leaves this run without tests is no failure.
rc=0
(unset E2B_API_URL E2B_SANDBOX_URL E2B_API_KEY; pytest -m 'not node') || rc=$?
((rc == 0)) || { ((rc == 5)) && [[ -n ${RL_PYTEST_ARGS:-} ]]; } || exit "$rc"
((host_only)) && { log "host-only: done"; exit 0; }

# --- against a node ----------------------------------------------------------
use_node "$server" "$build" target/rl-test
log "== tests against $E2B_API_URL"
started=$SECONDS
# A test that fails runs again once, in place (the runner's retry rule,
# docs/src/testing/runner.md); -rR names it in the log for the runner.
rc=0
pytest -m node --reruns 1 -rfER || rc=$?
((rc == 0)) || die "node tests failed"
log "node tests took $((SECONDS - started)) s"
[[ -n $server ]] || stop_node
log "passed"

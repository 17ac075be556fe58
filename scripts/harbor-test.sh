#!/bin/bash
# Harbor, the real package from PyPI, against `sandfork serve` (inside the
# lab here): ruff and mypy on tests/harbor, then tests/harbor/test_harbor.py,
# which runs `harbor run --env e2b -a oracle` on the tasks in
# tests/harbor/tasks at concurrency 4 (and 1 with SANDFORK_TEST_TIER=long)
# with the E2B variables alone and fails unless every trial ran and scored 1.0.
#
# Usage: scripts/harbor-test.sh [--no-build] [--server URL | --node DIR]
#   --no-build    do not run scripts/build.sh (target/sandfork.env must exist)
#   --server URL  test a server already running at URL (key in E2B_API_KEY)
#   --node DIR    test the node scripts/shared-node.sh runs with DIR
# Env: SANDFORK_CACHE (default /var/cache/sandfork): the venv is
#      $SANDFORK_CACHE/sdk/harbor-<hash of tests/harbor/requirements.txt and
#      the interpreter>. Harbor needs Python 3.12 or later: the newest found
#      on PATH or in pyenv's versions (scripts/sdk-setup.sh's newest_python).
#      HARBOR_PYTEST_ARGS: extra pytest arguments (e.g. "-k n1").
# Out: the server's log in target/harbor-test/serve.log, Harbor's jobs and
#      logs in target/harbor-test/harbor/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/node.sh

suite_options "$@"
((${#suite_rest[@]} == 0)) || die "unknown argument: ${suite_rest[0]} (see --help)"
# the venvs' cache, shared with the SDK suites
. scripts/sdk-setup.sh

# --- a Python new enough for Harbor, the newest found; the venv of the pins --
found=$(need_python 3.12.0 Harbor) || exit
read -r python _ <<<"$found"
pinned_venv harbor "$python" tests/harbor/requirements.txt 'import harbor.cli.main, e2b, pytest'
log "harbor $("$venv/bin/python" -m harbor.cli.main --version) in $venv"

log "== ruff and mypy"
python_lint "$venv" tests/harbor
python_typed "$venv" tests/harbor/test_harbor.py

# --- against a node ----------------------------------------------------------
out=target/harbor-test
use_node "$server" "$build" "$out"
rm -rf "$out/harbor"
export HARBOR_TEST_OUT=$out/harbor
log "== harbor against $E2B_API_URL"
started=$SECONDS
# shellcheck disable=SC2086 # HARBOR_PYTEST_ARGS is a list of words
"$venv/bin/python" -m pytest tests/harbor/test_harbor.py -p no:cacheprovider -s -v ${HARBOR_PYTEST_ARGS:-}
log "harbor tests took $((SECONDS - started)) s"
[[ -n $server ]] || stop_node
log "passed"

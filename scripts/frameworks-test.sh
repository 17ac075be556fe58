#!/bin/bash
# The RL frameworks' own E2B paths, each with its real package from PyPI,
# against `sandfork serve` (inside the lab here): ruff and mypy on
# tests/frameworks, then its pytest suite (NeMo Gym's `e2b` provider:
# tests/frameworks/test_nemo_gym.py), configured by the E2B variables alone.
#
# Usage: scripts/frameworks-test.sh [--no-build] [--server URL | --node DIR]
#   --no-build    do not run scripts/build.sh (target/sandfork.env must exist)
#   --server URL  test a server already running at URL (key in E2B_API_KEY)
#   --node DIR    test the node scripts/shared-node.sh runs with DIR
# Env: SANDFORK_CACHE (default /var/cache/sandfork): the venv is
#      $SANDFORK_CACHE/sdk/frameworks-<hash of tests/frameworks/requirements.txt
#      and the interpreter>. NeMo Gym 0.7.0 declares Python 3.13.14 or later:
#      the newest python3.13+ on PATH or in pyenv's versions; one older than
#      3.13.14 (pyenv's 3.13.0 here) installs with --ignore-requires-python.
#      FRAMEWORKS_PYTEST_ARGS: extra pytest arguments (e.g. "-k group").
# Out: the server's log in target/frameworks-test/serve.log.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/node.sh

suite_options "$@"
((${#suite_rest[@]} == 0)) || die "unknown argument: ${suite_rest[0]} (see --help)"
# the venvs' cache, shared with the SDK suites
. scripts/sdk-setup.sh

# --- a Python 3.13 or later, the newest found; the venv of the pins ----------
found=$(need_python 3.13.0 "NeMo Gym") || exit
read -r python python_version <<<"$found"
pip_args=()
if [[ $(printf '%s\n' 3.13.14 "$python_version" | sort -V | head -n1) != 3.13.14 ]]; then
    # nemo-gym 0.7.0 says >=3.13.14; nothing newer than 3.13.0 is on the machine
    pip_args+=(--ignore-requires-python)
fi
pinned_venv frameworks "$python" tests/frameworks/requirements.txt \
    'import nemo_gym.sandbox.providers.e2b.provider, e2b, pytest' "${pip_args[@]}"
log "nemo-gym $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("nemo-gym"))') in $venv"

log "== ruff and mypy"
python_typed "$venv" tests/frameworks

# --- against a node ----------------------------------------------------------
out=target/frameworks-test
use_node "$server" "$build" "$out"
log "== the frameworks against $E2B_API_URL"
started=$SECONDS
# shellcheck disable=SC2086 # FRAMEWORKS_PYTEST_ARGS is a list of words
"$venv/bin/python" -m pytest tests/frameworks -p no:cacheprovider -s -v ${FRAMEWORKS_PYTEST_ARGS:-}
log "framework tests took $((SECONDS - started)) s"
[[ -n $server ]] || stop_node
log "passed"

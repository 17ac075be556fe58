#!/bin/bash
# The RL frameworks' own E2B paths, each with its real package from PyPI,
# against `sandfork serve` (inside the lab here): ruff and mypy on
# tests/frameworks, then its pytest suite (NeMo Gym's `e2b` provider:
# tests/frameworks/test_nemo_gym.py), configured by the E2B variables alone.
#
# Usage: scripts/frameworks-test.sh [--no-build] [--server URL]
#   --no-build    do not run scripts/build.sh (target/sandfork.env must exist)
#   --server URL  test a server already running at URL (key in E2B_API_KEY)
# Env: SANDFORK_CACHE (default /var/cache/sandfork): the venv is
#      $SANDFORK_CACHE/sdk/frameworks-<hash of tests/frameworks/requirements.txt
#      and the interpreter>. NeMo Gym 0.7.0 declares Python 3.13.14 or later:
#      the newest python3.13+ on PATH or in pyenv's versions; one older than
#      3.13.14 (pyenv's 3.13.0 here) installs with --ignore-requires-python.
#      FRAMEWORKS_PYTEST_ARGS: extra pytest arguments (e.g. "-k group").
# Out: the server's log in target/frameworks-test/serve.log.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

build=1 server=''
log() { echo "frameworks-test: $*" >&2; }
die() { log "error: $*"; exit 1; }

while (($#)); do
    case $1 in
        --no-build) build=0; shift ;;
        --server) server=${2:?--server needs a URL}; shift 2 ;;
        -h | --help) sed -n '2,/^set -e/p' "${BASH_SOURCE[0]}" | sed -n 's/^# \{0,1\}//p'; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done

# cached_dir, shared with the SDK suites
. scripts/sdk-setup.sh

# --- a Python 3.13 or later, the newest found ---------------------------------
version_of() { "$1" -c 'import sys, venv, ensurepip; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null; }
find_python() {
    local c v best='' best_v=0.0.0
    local candidates=(python3 python3.14 python3.13)
    candidates+=("${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.*/bin/python3)
    for c in "${candidates[@]}"; do
        command -v "$c" >/dev/null || continue
        v=$(version_of "$c") || continue
        [[ $(printf '%s\n' 3.13.0 "$v" | sort -V | head -n1) == 3.13.0 ]] || continue
        [[ $(printf '%s\n' "$best_v" "$v" | sort -V | tail -n1) == "$v" && $v != "$best_v" ]] || continue
        best=$(command -v "$c") best_v=$v
    done
    [[ -n $best ]] && echo "$best $best_v"
}
read -r python python_version < <(find_python) ||
    die "NeMo Gym needs Python 3.13 or later: none on PATH nor in pyenv's versions"
pip_args=()
if [[ $(printf '%s\n' 3.13.14 "$python_version" | sort -V | head -n1) != 3.13.14 ]]; then
    # nemo-gym 0.7.0 says >=3.13.14; nothing newer than 3.13.0 is on the machine
    pip_args+=(--ignore-requires-python)
fi

# --- the venv: the pinned frameworks and the test's tools ---------------------
req=tests/frameworks/requirements.txt
key=$({ cat "$req"; "$python" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
venv=$sdk_cache/frameworks-$key
# shellcheck disable=SC2317  # called by cached_dir
make_venv() {
    log "creating the frameworks' venv with $python $python_version ($1) ${pip_args[*]}"
    "$python" -m venv "$1" &&
        "$1/bin/pip" install -q --disable-pip-version-check "${pip_args[@]}" -r "$root/$req" >&2
}
cached_dir "$venv" make_venv
# a venv records its own path: rebuilt where it now lives
check='import nemo_gym.sandbox.providers.e2b.provider, e2b, pytest'
if ! "$venv/bin/python" -c "$check" 2>/dev/null; then
    rm -rf "$venv"
    cached_dir "$venv" make_venv
fi
log "nemo-gym $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("nemo-gym"))') in $venv"

log "== ruff and mypy"
"$venv/bin/python" -m ruff format --check tests/frameworks
"$venv/bin/python" -m ruff check tests/frameworks
"$venv/bin/python" -m mypy --strict tests/frameworks

# --- against a node ----------------------------------------------------------
out=target/frameworks-test
. scripts/node.sh
use_node "$server" "$build" "$out"
log "== the frameworks against $E2B_API_URL"
started=$SECONDS
# shellcheck disable=SC2086 # FRAMEWORKS_PYTEST_ARGS is a list of words
"$venv/bin/python" -m pytest tests/frameworks -p no:cacheprovider -s -v ${FRAMEWORKS_PYTEST_ARGS:-}
log "framework tests took $((SECONDS - started)) s"
[[ -n $server ]] || stop_node
log "passed"

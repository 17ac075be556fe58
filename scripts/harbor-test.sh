#!/bin/bash
# Harbor, the real package from PyPI, against `sandfork serve` (inside the
# lab here): ruff and mypy on tests/harbor, then tests/harbor/test_harbor.py,
# which runs `harbor run --env e2b -a oracle` on the tasks in
# tests/harbor/tasks at concurrency 4 and 1 with the E2B variables alone and
# fails unless every trial ran and scored 1.0.
#
# Usage: scripts/harbor-test.sh [--no-build] [--server URL]
#   --no-build    do not run scripts/build.sh (target/sandfork.env must exist)
#   --server URL  test a server already running at URL (key in E2B_API_KEY)
# Env: SANDFORK_CACHE (default /var/cache/sandfork): the venv is
#      $SANDFORK_CACHE/sdk/harbor-<hash of tests/harbor/requirements.txt and
#      the interpreter>. Harbor needs Python 3.12 or later: python3 if new
#      enough, else the newest python3.1N found on PATH or in pyenv's versions.
#      HARBOR_PYTEST_ARGS: extra pytest arguments (e.g. "-k n1").
# Out: the server's log in target/harbor-test/serve.log, Harbor's jobs and
#      logs in target/harbor-test/harbor/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

build=1 server=''
log() { echo "harbor-test: $*" >&2; }
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

# --- a Python new enough for Harbor ------------------------------------------
new_enough() { "$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }
find_python() {
    local c
    for c in python3 python3.14 python3.13 python3.12; do
        command -v "$c" >/dev/null && new_enough "$c" && { command -v "$c"; return; }
    done
    local versions
    mapfile -t versions < <(printf '%s\n' "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.* | sort -rV)
    for c in "${versions[@]}"; do
        new_enough "$c/bin/python3" && { echo "$c/bin/python3"; return; }
    done
    return 1
}
python=$(find_python) || die "Harbor needs Python 3.12 or later: none on PATH nor in pyenv's versions"

# --- the venv: the pinned Harbor and the test's tools -----------------------
req=tests/harbor/requirements.txt
key=$({ cat "$req"; "$python" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
venv=$sdk_cache/harbor-$key
# shellcheck disable=SC2317  # called by cached_dir
make_venv() {
    log "creating Harbor's venv with $python ($1)"
    "$python" -m venv "$1" &&
        "$1/bin/pip" install -q --disable-pip-version-check -r "$root/$req" >&2
}
cached_dir "$venv" make_venv
# a venv records its own path: rebuilt where it now lives
if ! "$venv/bin/python" -c 'import harbor.cli.main, e2b, pytest' 2>/dev/null; then
    rm -rf "$venv"
    cached_dir "$venv" make_venv
fi
log "harbor $("$venv/bin/python" -m harbor.cli.main --version) in $venv"

log "== ruff and mypy"
"$venv/bin/python" -m ruff format --check tests/harbor
"$venv/bin/python" -m ruff check tests/harbor
"$venv/bin/python" -m mypy --strict tests/harbor/test_harbor.py

# --- against a node ----------------------------------------------------------
out=target/harbor-test
. scripts/node.sh
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

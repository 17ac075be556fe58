#!/bin/bash
# Checks the dependency tree against deny.toml with cargo-deny: every crate's
# licence is one we allow (the project is MIT and links no GPL code), no
# banned or duplicate-by-mistake crates, and every crate comes from the
# crates registry. Works offline once the crates are fetched. cargo-deny itself is
# built once per version into ${SANDFORK_CACHE:-/var/cache/sandfork}/tools/.
#
# Usage: scripts/deny.sh [--advisories]
#   --advisories  also check the RustSec advisory database (downloads it:
#                 needs the network, so it is not part of scripts/test.sh)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

version=0.20.2
tools=${SANDFORK_CACHE:-/var/cache/sandfork}/tools
dir=$tools/cargo-deny-$version

log() { echo "deny: $*" >&2; }

# Built into DIR.tmp.* and renamed, under a lock, so the cache entry exists
# whole or not at all and concurrent runs build it once.
if [[ ! -x $dir/bin/cargo-deny ]]; then
    mkdir -p "$tools"
    exec 8>"$dir.lock"
    flock 8
    if [[ ! -x $dir/bin/cargo-deny ]]; then
        log "building cargo-deny $version (once)"
        rm -rf "$dir".tmp.*
        tmp=$(mktemp -d "$dir.tmp.XXXXXX")
        # Its own target dir, so the build neither reuses nor grows ours.
        if ! CARGO_TARGET_DIR=$tmp/target cargo install --quiet --locked \
            --root "$tmp" cargo-deny --version "$version"; then
            rm -rf "$tmp"
            log "building cargo-deny failed"
            exit 1
        fi
        rm -rf "$tmp/target"
        rm -rf "$dir"
        mv -T "$tmp" "$dir"
    fi
    exec 8>&-
fi

checks=(licenses bans sources)
if [[ ${1:-} == --advisories ]]; then
    checks+=(advisories)
    "$dir/bin/cargo-deny" --all-features check "${checks[@]}"
else
    "$dir/bin/cargo-deny" --all-features --offline check "${checks[@]}"
fi

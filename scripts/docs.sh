#!/bin/bash
# The book: docs/ built with mdBook into target/book, its links checked by
# linkchecker (internal ones, anchors included; no address outside is
# fetched), and the README's links by the runner's doclinks. mdBook is
# installed with cargo once per version under $SANDFORK_CACHE/tools.
#
# Usage: scripts/docs.sh [--open]   (--open: print the built book's path)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

mdbook_version=0.5.4
tools=${SANDFORK_CACHE:-/var/cache/sandfork}/tools
mdbook=$tools/mdbook-$mdbook_version/bin/mdbook
if [[ ! -x $mdbook ]]; then
    echo "docs: installing mdBook $mdbook_version into $tools" >&2
    mkdir -p "$tools"
    # whole or not at all: a concurrent or killed install leaves no half tool
    part=$(mktemp -d "$tools/mdbook-$mdbook_version.part.XXXXXX")
    trap 'rm -rf "$part"' EXIT
    cargo install --quiet --locked --no-default-features --features search \
        --root "$part" mdbook --version "$mdbook_version"
    mv -T "$part" "$tools/mdbook-$mdbook_version" 2>/dev/null || rm -rf "$part"
    trap - EXIT
fi
command -v linkchecker >/dev/null || scripts/deps.sh

book=$root/target/book
rm -rf "$book"
# mdBook's warnings (an unclosed HTML tag: text like `<id>` that vanishes
# from the page) fail the check as broken links do
log=$("$mdbook" build docs --dest-dir "$book" 2>&1) || { echo "$log" >&2; exit 1; }
if grep -q ' WARN ' <<<"$log"; then
    grep ' WARN ' <<<"$log" >&2
    echo "docs: mdBook warned (above)" >&2
    exit 1
fi
# linkchecker drops root's privileges to `nobody`: the book must be readable
chmod -R a+rX "$book"
linkchecker --config docs/linkcheckerrc --no-status "file://$book/index.html"
PYTHONPATH=tests/runner python3 -m sandfork_runner.doclinks README.md python/README.md
[[ ${1:-} == --open ]] && echo "$book/index.html"
exit 0

#!/bin/bash
# Recipe of the sandfork base root filesystem: Debian bookworm from
# debootstrap --variant=minbase plus packages.txt, with the accounts every
# sandbox has. Called by build.sh, which caches the result by the hash of
# this file and packages.txt; not meant to be run on its own.
#
# Usage: base.sh OUTDIR    (creates OUTDIR/tree, manifest.txt, debootstrap.log)
# Env:   SANDFORK_DEBIAN_MIRROR (default: from this machine's apt sources)
#        SANDFORK_DEB_CACHE     (optional debootstrap --cache-dir)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:?usage: base.sh OUTDIR}
suite=bookworm
arch=$(dpkg --print-architecture)

log() { echo "rootfs: $*" >&2; }
die() { log "error: $*"; exit 1; }

# The first Debian archive this machine's apt uses (one-line or deb822
# sources, security archives skipped), so images come from where the host's
# packages come from. Empty means debootstrap's own default.
apt_mirror() {
    local f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -r $f ]] || continue
        awk '$1 == "deb" {
            inopt = 0
            for (i = 2; i <= NF; i++) {
                if ($i ~ /^\[/) inopt = 1
                if (!inopt) { print $i; break }
                if ($i ~ /\]$/) inopt = 0
            }
        }' "$f"
    done
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -r $f ]] || continue
        awk 'tolower($1) == "uris:" { print $2 }' "$f"
    done
}
mirror=${SANDFORK_DEBIAN_MIRROR:-$(apt_mirror | grep -v -- '-security' | head -n1 || true)}
packages=$(grep -v -e '^#' -e '^[[:space:]]*$' "$here/packages.txt" | sort -u | paste -sd, -)

t=$out/tree
log "debootstrap $suite ($arch) minbase + packages.txt${mirror:+ from $mirror}"
cache_args=()
if [[ -n ${SANDFORK_DEB_CACHE:-} ]]; then
    mkdir -p "$SANDFORK_DEB_CACHE"
    cache_args=(--cache-dir="$SANDFORK_DEB_CACHE")
fi
if ! debootstrap --variant=minbase --arch="$arch" --include="$packages" "${cache_args[@]}" \
    "$suite" "$t" ${mirror:+"$mirror"} >"$out/debootstrap.log" 2>&1; then
    tail -n 30 "$out/debootstrap.log" >&2
    die "debootstrap failed (log above)"
fi

# Accounts as in E2B sandboxes: root without a password, and `user`
# (uid 1000, /home/user, bash) with passwordless sudo.
chroot "$t" passwd -d root >/dev/null
chroot "$t" useradd --create-home --uid 1000 --user-group --shell /bin/bash user
echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' >"$t/etc/sudoers.d/user"
chmod 0440 "$t/etc/sudoers.d/user"

# Build leftovers have no use inside a sandbox (apt lists come back with
# `apt-get update`).
chroot "$t" apt-get clean
rm -rf "$t"/var/lib/apt/lists/* "$t"/var/log/*.log "$t"/var/log/apt/* \
    "$t"/var/cache/debconf/*-old "$t"/root/.cache
chroot "$t" dpkg-query -W -f='${Package} ${Version}\n' >"$out/manifest.txt"

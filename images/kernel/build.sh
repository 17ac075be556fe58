#!/bin/bash
# Build the sandfork guest kernel (an uncompressed vmlinux ELF) from Debian's
# linux-source-6.1 and images/kernel/guest.config, cached by content hash.
#
# Usage: images/kernel/build.sh
# Env:   SANDFORK_CACHE (default /var/cache/sandfork), JOBS (default nproc)
# Out:   the absolute path of vmlinux on the last stdout line; progress on
#        stderr; the full build log is kept next to the cached vmlinux.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fragment=$here/guest.config
tarball=/usr/src/linux-source-6.1.tar.xz
cache=${SANDFORK_CACHE:-/var/cache/sandfork}/kernel
jobs=${JOBS:-$(nproc)}

log() { echo "kernel: $*" >&2; }
die() { log "error: $*"; exit 1; }

[[ -r $tarball ]] || die "$tarball missing (run scripts/deps.sh)"
srcver=$(dpkg-query -W -f='${Version}' linux-source-6.1) \
    || die "linux-source-6.1 is not installed (run scripts/deps.sh)"

# The key covers everything that changes the output: our fragment and this
# script, the kernel source package and the compiler.
key=$( {
    echo "linux-source-6.1 $srcver"
    gcc --version | head -n1
    sha256sum <"$fragment"
    sha256sum <"${BASH_SOURCE[0]}"
} | sha256sum | cut -c1-16)
entry=$cache/$key

if [[ -f $entry/vmlinux ]]; then
    log "cached $entry"
    echo "$entry/vmlinux"
    exit 0
fi

mkdir -p "$cache"
# One builder per key; a second caller waits and then finds the entry.
exec 9>"$cache/.$key.lock"
flock 9
if [[ -f $entry/vmlinux ]]; then
    echo "$entry/vmlinux"
    exit 0
fi

# Build inside the cache filesystem so the final rename is atomic; a killed
# build leaves only a .tmp directory, which the next run removes.
rm -rf "$cache/.tmp-$key".*
tmp=$(mktemp -d "$cache/.tmp-$key.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
buildlog=$tmp/out/build.log
mkdir -p "$tmp/out"

run() {
    if ! "$@" >>"$buildlog" 2>&1; then
        tail -n 40 "$buildlog" >&2
        die "failed: $* (log above)"
    fi
}

start=$(date +%s)
log "building $key (linux-source-6.1 $srcver, $jobs jobs)"
log "unpacking $tarball"
tar -xJf "$tarball" -C "$tmp"
src=$tmp/linux-source-6.1
# Reproducible identity strings instead of this host's name and clock.
export KBUILD_BUILD_USER=sandfork KBUILD_BUILD_HOST=sandfork
export KBUILD_BUILD_TIMESTAMP="linux-source-6.1 $srcver"

log "configuring (tinyconfig + guest.config)"
run make -C "$src" tinyconfig
run env -C "$src" scripts/kconfig/merge_config.sh -m .config "$fragment"
run make -C "$src" olddefconfig

# olddefconfig silently drops options whose dependencies are unmet: demand
# that every line of the fragment is in the final .config.
missing=0
while IFS= read -r line; do
    if [[ $line =~ ^(CONFIG_[A-Za-z0-9_]+)=(.*)$ ]]; then
        grep -qxF -- "$line" "$src/.config" || {
            log "dropped: $line (got: $(grep -E "^(# )?${BASH_REMATCH[1]}[= ]" "$src/.config" || echo absent))"
            missing=1
        }
    elif [[ $line =~ ^#\ (CONFIG_[A-Za-z0-9_]+)\ is\ not\ set$ ]]; then
        if grep -qE "^${BASH_REMATCH[1]}=" "$src/.config"; then
            log "forced on: ${BASH_REMATCH[1]} (fragment wants it off)"
            missing=1
        fi
    fi
done <"$fragment"
((missing == 0)) || die "the fragment does not apply cleanly; fix images/kernel/guest.config"

log "compiling vmlinux (log: $buildlog while running)"
run make -C "$src" -j"$jobs" vmlinux

cp "$src/vmlinux" "$src/.config" "$src/System.map" "$tmp/out/"
mv "$tmp/out/.config" "$tmp/out/config"
# Publish: the directory appears complete or not at all.
mv -T "$tmp/out" "$entry"
log "built $entry in $(($(date +%s) - start)) s"
echo "$entry/vmlinux"

#!/bin/bash
# Build a sandfork guest root filesystem: Debian bookworm (debootstrap
# minbase + images/rootfs/packages.txt) with the guest agent as /sbin/init,
# as a sparse ext4 image. Two cache levels, both content-addressed:
#   $SANDFORK_CACHE/rootfs-base/<key>/tree.tar    debootstrapped tree, as a tar
#   $SANDFORK_CACHE/rootfs/<key>/rootfs.ext4      final image with the agent
# The base is kept as a tarball, not a directory, so that a cache which cannot
# hold device nodes (a 9p share, as in the KVM lab) can still hold it, and it
# is read in one sequential stream there. Trees are unpacked and worked on in a
# scratch directory (SANDFORK_BUILD_SCRATCH) that must be a local filesystem.
#
# Usage: images/rootfs/build.sh --agent PATH [--out PATH] [--size SIZE]
#   --agent  static guest agent binary, installed as /usr/local/sbin/sandfork-agent
#   --out    also copy the image there (sparse); that path is then printed
#   --size   image size for truncate(1), default 2G (sparse: free space for the
#            sandbox, no host disk until written)
#   --base-only  only make sure the debootstrapped base tree is built and
#            print its cache directory, holding tree.tar (used by
#            crates/template-build)
# Env: SANDFORK_CACHE (default /var/cache/sandfork),
#      SANDFORK_BUILD_SCRATCH (where trees are made; default: next to the
#        cache entries), SANDFORK_DEBIAN_MIRROR (default: from this machine's
#        apt sources)
# Out: the absolute path of the image on the last stdout line; progress on
#      stderr.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
self=$here/build.sh
cache=${SANDFORK_CACHE:-/var/cache/sandfork}
scratch=${SANDFORK_BUILD_SCRATCH:-}
agent='' out='' size=2G base_only=0

log() { echo "rootfs: $*" >&2; }
die() { log "error: $*"; exit 1; }

while (($#)); do
    case $1 in
        --agent) agent=${2:?--agent needs a path}; shift 2 ;;
        --out) out=${2:?--out needs a path}; shift 2 ;;
        --size) size=${2:?--size needs a size}; shift 2 ;;
        --base-only) base_only=1; shift ;;
        -h | --help) sed -n '2,/^set -e/p' "$self" | sed -n 's/^# \{0,1\}//p'; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
if ((!base_only)); then
    [[ -n $agent ]] || die "--agent PATH is required"
    [[ -f $agent && -x $agent ]] || die "agent $agent is not an executable file"
fi
((EUID == 0)) || die "must run as root (debootstrap, file ownership)"
command -v debootstrap mkfs.ext4 flock >/dev/null || die "missing tools (run scripts/deps.sh)"

# Hold the per-key lock KEY under DIR (fd 9) until released or exit.
lock() {
    mkdir -p "$1"
    exec 9>"$1/.$2.lock"
    flock 9
}

# --- base tree -------------------------------------------------------------
# The base depends only on its recipe (base.sh, packages.txt) and the
# architecture, so changes to this script's final stage do not rebuild it.
base_key=$( {
    dpkg --print-architecture
    sha256sum <"$here/base.sh"
    grep -v -e '^#' -e '^[[:space:]]*$' "$here/packages.txt" | sort -u
} | sha256sum | cut -c1-16)
base=$cache/rootfs-base/$base_key

# A fresh scratch directory for KEY's tree (removed at exit).
scratch_dir() {
    local dir=${scratch:-$1}
    mkdir -p "$dir"
    rm -rf "$dir/.tree-$2".*
    mktemp -d "$dir/.tree-$2.XXXXXX"
}

# The options that keep owners (numerically), modes, xattrs (file
# capabilities) and hard links, both ways.
tar_opts=(--numeric-owner --xattrs --xattrs-include='*')

# Pack the tree DIR into the base entry: tree.tar, and the files in FILES_DIR.
store_base() {
    local tree=$1 files=$2 dir=$cache/rootfs-base tmp
    rm -rf "$dir/.tmp-$base_key".*
    tmp=$(mktemp -d "$dir/.tmp-$base_key.XXXXXX")
    tar --create --file="$tmp/tree.tar" "${tar_opts[@]}" -C "$tree" .
    cp "$files"/manifest.txt "$files"/debootstrap.log "$tmp/"
    chmod 0755 "$tmp"
    # An entry with a tree/ but no tree.tar was made by an earlier version of
    # this script: add the tarball and leave the tree for whoever still uses it.
    if [[ -d $base ]]; then
        mv "$tmp/tree.tar" "$base/tree.tar"
        rm -rf "$tmp"
    else
        mv -T "$tmp" "$base"
    fi
}

build_base() {
    local start work
    start=$(date +%s)
    work=$(scratch_dir "$cache/rootfs-base" "$base_key")
    # shellcheck disable=SC2064 # expand $work now
    trap "rm -rf '$work'" EXIT
    SANDFORK_DEB_CACHE=$cache/debootstrap-debs "$here/base.sh" "$work"
    chmod 0755 "$work/tree"
    store_base "$work/tree" "$work"
    rm -rf "$work"
    trap - EXIT
    log "base $base_key built in $(($(date +%s) - start)) s"
}

if [[ ! -f $base/tree.tar ]]; then
    lock "$cache/rootfs-base" "$base_key"
    if [[ -f $base/tree.tar ]]; then
        :
    elif [[ -d $base/tree && -f $base/manifest.txt ]]; then
        log "packing the base tree $base/tree into tree.tar"
        store_base "$base/tree" "$base"
    else
        build_base
    fi
    exec 9>&-
else
    log "base cached: $base"
fi
if ((base_only)); then
    echo "$base"
    exit 0
fi

# --- final image -------------------------------------------------------------
agent_sum=$(sha256sum <"$agent" | cut -d' ' -f1)
key=$( {
    echo "base $base_key"
    echo "agent $agent_sum"
    echo "size $size"
    sha256sum <"$self"
    sha256sum <"$here/finish.sh"
} | sha256sum | cut -c1-16)
entry=$cache/rootfs/$key
image=$entry/rootfs.ext4

build_image() {
    local dir=$cache/rootfs tmp start
    start=$(date +%s)
    rm -rf "$dir/.tmp-$key".*
    tmp=$(mktemp -d "$dir/.tmp-$key.XXXXXX")
    local t
    t=$(scratch_dir "$cache/rootfs" "$key")
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp' '$t'" EXIT
    tar --extract --file="$base/tree.tar" "${tar_opts[@]}" -C "$t"
    # E2B's base lets `pip install x` install where it is run (the system's
    # site-packages as root, ~/.local as a user); Debian's PEP 668 marker
    # refuses it, and every E2B snippet that installs a package would break.
    rm -f "$t/etc/pip.conf"
    printf '[global]\nbreak-system-packages = true\n' >"$t/etc/pip.conf"
    "$here/finish.sh" --agent "$agent" --tree "$t" --image "$tmp/rootfs.ext4" --size "$size" --key "$key"
    rm -rf "$t"
    chmod 0755 "$tmp"
    mv -T "$tmp" "$entry"
    trap - EXIT
    log "image $key built in $(($(date +%s) - start)) s"
}

if [[ ! -f $image ]]; then
    lock "$cache/rootfs" "$key"
    [[ -f $image ]] || build_image
    exec 9>&-
else
    log "image cached: $entry"
fi

if [[ -n $out ]]; then
    out=$(realpath -m "$out")
    cp --sparse=always "$image" "$out.tmp.$$"
    mv -f "$out.tmp.$$" "$out"
    echo "$out"
else
    echo "$image"
fi

#!/bin/bash
# Build a sandfork guest root filesystem: Debian bookworm (debootstrap
# minbase + images/rootfs/packages.txt) with the guest agent as /sbin/init,
# as a sparse ext4 image. Two cache levels, both content-addressed:
#   $SANDFORK_CACHE/rootfs-base/<key>/tree/       debootstrapped tree
#   $SANDFORK_CACHE/rootfs/<key>/rootfs.ext4      final image with the agent
#
# Usage: images/rootfs/build.sh --agent PATH [--out PATH] [--size SIZE]
#   --agent  static guest agent binary, installed as /usr/local/sbin/sandfork-agent
#   --out    also copy the image there (sparse); that path is then printed
#   --size   image size for truncate(1), default 2G (sparse: free space for the
#            sandbox, no host disk until written)
#   --base-only  only make sure the debootstrapped base tree is built and
#            print its cache directory (used by crates/template-build)
# Env: SANDFORK_CACHE (default /var/cache/sandfork),
#      SANDFORK_DEBIAN_MIRROR (default: from this machine's apt sources)
# Out: the absolute path of the image on the last stdout line; progress on
#      stderr.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
self=$here/build.sh
cache=${SANDFORK_CACHE:-/var/cache/sandfork}
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

build_base() {
    local dir=$cache/rootfs-base tmp start
    start=$(date +%s)
    rm -rf "$dir/.tmp-$base_key".*
    tmp=$(mktemp -d "$dir/.tmp-$base_key.XXXXXX")
    # shellcheck disable=SC2064 # expand $tmp now
    trap "rm -rf '$tmp'" EXIT
    SANDFORK_DEB_CACHE=$cache/debootstrap-debs "$here/base.sh" "$tmp"
    chmod 0755 "$tmp"
    mv -T "$tmp" "$base"
    trap - EXIT
    log "base $base_key built in $(($(date +%s) - start)) s"
}

if [[ ! -d $base/tree ]]; then
    lock "$cache/rootfs-base" "$base_key"
    [[ -d $base/tree ]] || build_base
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
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" EXIT
    local t=$tmp/tree
    # Hard links, not a copy: the base stays untouched because finish.sh
    # replaces every file it changes (rm, then written), never edits in place.
    cp -al "$base/tree" "$t"
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

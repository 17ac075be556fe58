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
# Env: SANDFORK_CACHE (default /var/cache/sandfork),
#      SANDFORK_DEBIAN_MIRROR (default: from this machine's apt sources)
# Out: the absolute path of the image on the last stdout line; progress on
#      stderr.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
self=$here/build.sh
pkgfile=$here/packages.txt
cache=${SANDFORK_CACHE:-/var/cache/sandfork}
suite=bookworm
agent='' out='' size=2G

log() { echo "rootfs: $*" >&2; }
die() { log "error: $*"; exit 1; }

while (($#)); do
    case $1 in
        --agent) agent=${2:?--agent needs a path}; shift 2 ;;
        --out) out=${2:?--out needs a path}; shift 2 ;;
        --size) size=${2:?--size needs a size}; shift 2 ;;
        -h | --help) sed -n '2,19p' "$self" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
[[ -n $agent ]] || die "--agent PATH is required"
[[ -f $agent && -x $agent ]] || die "agent $agent is not an executable file"
((EUID == 0)) || die "must run as root (debootstrap, file ownership)"
command -v debootstrap mkfs.ext4 flock >/dev/null || die "missing tools (run scripts/deps.sh)"

# The first Debian archive URI this machine's apt uses (one-line or deb822
# sources), so images come from the same place as the host's packages.
# Empty means debootstrap's own default.
apt_mirror() {
    local f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -r $f ]] || continue
        awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i !~ /\]$/) { print $i; exit } }' "$f" |
            grep -v -- '-security' | head -n1
    done | head -n1
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -r $f ]] || continue
        awk 'tolower($1) == "uris:" { print $2 }' "$f" | grep -v -- '-security' | head -n1
    done | head -n1
}
mirror=${SANDFORK_DEBIAN_MIRROR:-$(apt_mirror | head -n1)}

packages=$(grep -v -e '^#' -e '^[[:space:]]*$' "$pkgfile" | sort -u | paste -sd, -)
arch=$(dpkg --print-architecture)

# Lock KEY under DIR and return whether the entry still has to be built.
lock() {
    mkdir -p "$1"
    exec 9>"$1/.$2.lock"
    flock 9
}

# --- base tree -------------------------------------------------------------
base_key=$( {
    echo "$suite $arch"
    sha256sum <"$self"
    grep -v -e '^#' -e '^[[:space:]]*$' "$pkgfile" | sort -u
} | sha256sum | cut -c1-16)
base=$cache/rootfs-base/$base_key

build_base() {
    local dir=$cache/rootfs-base tmp start
    start=$(date +%s)
    rm -rf "$dir/.tmp-$base_key".*
    tmp=$(mktemp -d "$dir/.tmp-$base_key.XXXXXX")
    # shellcheck disable=SC2064 # expand $tmp now
    trap "rm -rf '$tmp'" EXIT
    log "debootstrap $suite ($arch) minbase + packages.txt${mirror:+ from $mirror}"
    mkdir -p "$cache/debootstrap-debs"
    if ! debootstrap --variant=minbase --arch="$arch" --include="$packages" \
        --cache-dir="$cache/debootstrap-debs" \
        "$suite" "$tmp/tree" ${mirror:+"$mirror"} >"$tmp/debootstrap.log" 2>&1; then
        tail -n 30 "$tmp/debootstrap.log" >&2
        die "debootstrap failed (log above)"
    fi
    local t=$tmp/tree
    # Accounts as in E2B sandboxes: root without a password, and `user`
    # (uid 1000) with passwordless sudo.
    chroot "$t" passwd -d root >/dev/null
    chroot "$t" useradd --create-home --uid 1000 --user-group --shell /bin/bash user
    echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' >"$t/etc/sudoers.d/user"
    chmod 0440 "$t/etc/sudoers.d/user"
    # Nothing inside runs the apt/dpkg caches or logs of the build.
    chroot "$t" apt-get clean
    rm -rf "$t"/var/lib/apt/lists/* "$t"/var/log/*.log "$t"/var/log/apt/* \
        "$t"/var/cache/debconf/*-old "$t"/root/.cache
    chroot "$t" dpkg-query -W -f='${Package} ${Version}\n' >"$tmp/manifest.txt"
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

# --- final image -------------------------------------------------------------
agent_sum=$(sha256sum <"$agent" | cut -d' ' -f1)
key=$( {
    echo "base $base_key"
    echo "agent $agent_sum"
    echo "size $size"
    sha256sum <"$self"
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
    # Hard links, not a copy: the base stays untouched because every file
    # changed below is replaced (rm, then written), never edited in place.
    cp -al "$base/tree" "$t"
    install -D -m 0755 "$agent" "$t/usr/local/sbin/sandfork-agent"
    rm -f "$t/sbin/init"
    ln -s /usr/local/sbin/sandfork-agent "$t/sbin/init"
    rm -f "$t/etc/hostname" "$t/etc/hosts" "$t/etc/resolv.conf"
    echo sandbox >"$t/etc/hostname"
    cat >"$t/etc/hosts" <<'HOSTS'
127.0.0.1	localhost
127.0.1.1	sandbox
::1	localhost ip6-localhost ip6-loopback
ff02::1	ip6-allnodes
ff02::2	ip6-allrouters
HOSTS
    echo '# written by the sandfork agent when the sandbox gets a network' >"$t/etc/resolv.conf"

    truncate -s "$size" "$tmp/rootfs.ext4"
    # -d copies the tree with owners, modes, xattrs and hard links, no mount
    # needed. The filesystem UUID follows the cache key, so equal inputs give
    # equal identities.
    local uuid
    uuid=$(echo "$key" | sha256sum | sed -E 's/^(.{8})(.{4}).(.{3}).(.{3})(.{12}).*/\1-\2-4\3-8\4-\5/')
    if ! mkfs.ext4 -q -F -L sandfork-root -U "$uuid" -d "$t" "$tmp/rootfs.ext4" >"$tmp/mkfs.log" 2>&1; then
        cat "$tmp/mkfs.log" >&2
        die "mkfs.ext4 failed"
    fi
    rm -rf "$t" "$tmp/mkfs.log"
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

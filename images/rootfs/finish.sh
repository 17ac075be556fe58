#!/bin/bash
# Turn a root filesystem tree into a sandfork guest image: the guest agent as
# /sbin/init, the sandbox's host name and resolver placeholder, then a sparse
# ext4 image made from the tree with `mkfs.ext4 -d` (owners, modes, xattrs and
# hard links kept, no mount). Shared by build.sh (the base image) and the
# template builder (crates/template-build), so every image is finished alike.
#
# Usage: finish.sh --agent PATH --tree DIR [--image PATH --size SIZE] --key KEY
#   --tree  changed in place; files are replaced (rm, then written), never
#           edited, so a tree of hard links to a cached base stays safe
#   --image without it, only the tree is finished (the template builder's
#           image layers: the tree is their filesystem, mounted)
#   --key   content key of the result: the filesystem UUID follows it, so equal
#           inputs give equal identities
set -euo pipefail

agent='' tree='' image='' size='' key=''
log() { echo "rootfs: $*" >&2; }
die() { log "error: $*"; exit 1; }
while (($#)); do
    case $1 in
        --agent) agent=${2:?}; shift 2 ;;
        --tree) tree=${2:?}; shift 2 ;;
        --image) image=${2:?}; shift 2 ;;
        --size) size=${2:?}; shift 2 ;;
        --key) key=${2:?}; shift 2 ;;
        *) die "unknown argument: $1" ;;
    esac
done
[[ -n $agent && -n $tree && -n $key && ( -z $image || -n $size ) ]] ||
    die "usage: finish.sh --agent PATH --tree DIR [--image PATH --size SIZE] --key KEY"
[[ -d $tree ]] || die "tree $tree is not a directory"

t=$(realpath "$tree")
# Every path written below must stay inside the tree: an image may hold
# symlinks, and one pointing out would make this script write on the host.
for d in usr/local/sbin sbin etc; do
    r=$(realpath -m "$t/$d")
    [[ $r == "$t"/* ]] || die "$d in the tree resolves outside it ($r)"
done
rm -f "$t/usr/local/sbin/sandfork-agent"
install -D -m 0755 "$agent" "$t/usr/local/sbin/sandfork-agent"
mkdir -p "$t/sbin" "$t/etc"
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

[[ -n $image ]] || exit 0

rm -f "$image"
truncate -s "$size" "$image"
uuid=$(echo "$key" | sha256sum | sed -E 's/^(.{8})(.{4}).(.{3}).(.{3})(.{12}).*/\1-\2-4\3-8\4-\5/')
if ! out=$(mkfs.ext4 -q -F -L sandfork-root -U "$uuid" -d "$t" "$image" 2>&1); then
    echo "$out" >&2
    die "mkfs.ext4 failed"
fi

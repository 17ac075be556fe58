#!/bin/bash
# Installs what the project needs and builds everything: the Rust workspace,
# the static guest agent, the guest kernel and the base image. Slow builds are
# cached by content hash under ${SANDFORK_CACHE:-/var/cache/sandfork}; a second
# run is quick. Writes the artefact paths to target/sandfork.env.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

log() { echo "build: $*" >&2; }

scripts/deps.sh
. scripts/sccache.sh

log "building the workspace"
cargo build --workspace --bins --quiet

log "building the static guest agent"
CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --quiet --release -p sandfork-agent --target x86_64-unknown-linux-gnu
agent=$root/target/x86_64-unknown-linux-gnu/release/sandfork-agent

log "guest kernel"
kernel=$(images/kernel/build.sh | tail -n1)
log "base image"
rootfs=$(images/rootfs/build.sh --agent "$agent" | tail -n1)

cat >target/sandfork.env <<ENV
SANDFORK_KERNEL=$kernel
SANDFORK_ROOTFS=$rootfs
SANDFORK_VMM=$root/target/debug/sandfork-vmm
SANDFORK_AGENT=$agent
ENV
log "kernel $kernel"
log "rootfs $rootfs"

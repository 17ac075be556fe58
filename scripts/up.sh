#!/bin/bash
# The main job: builds everything and boots a microVM to its guest agent
# (inside the KVM lab when this host's /dev/kvm cannot boot Linux).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/build.sh
set -a
. target/sandfork.env
set +a
exec target/debug/sandfork up "$@"

#!/bin/bash
# The main job: builds everything, then runs a sandfork node: `sandfork serve`
# on ${SANDFORK_LISTEN:-127.0.0.1:3000} with the `base` template, reachable by
# the unmodified E2B SDKs (inside the KVM lab, with the port forwarded, when
# this host's /dev/kvm cannot boot Linux), building the `code-interpreter`
# template in the background at its first start. Extra arguments go to `serve`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/build.sh
set -a
# shellcheck source=/dev/null  # written by scripts/build.sh
. target/sandfork.env
set +a
exec target/debug/sandfork serve --listen "${SANDFORK_LISTEN:-127.0.0.1:3000}" \
    --build-code-interpreter "$@"

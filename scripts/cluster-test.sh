#!/bin/bash
# The cluster test (README, "A cluster of nodes"): three sandfork nodes and
# two gateways on a real etcd of three members and SeaweedFS's S3 server, the
# nodes' sandboxes real microVMs, all in one KVM lab machine. The test is
# tests/cluster (pytest, run by the SDK venv's Python inside the lab): its
# sections, in order, are test_*.py there.
#
# Usage: scripts/cluster-test.sh [--no-build] [PYTEST-ARG...]
# Env: CARGO_TARGET_DIR (default target), SANDFORK_LAB_LOCKED (the caller
#      holds the lab lock), SANDFORK_CLUSTER_SDK=all (the SDK's four files
#      whole, not the tests that go through the gateways differently),
#      SANDFORK_TEST_TIER=long (that, the long tier's sections and TLS
#      between the parts), SANDFORK_CLUSTER_TLS=1 or 0 (TLS on or off in
#      any tier).
# Out: the logs, bench.json and junit.xml in
#      /var/cache/sandfork/lab-rw/cluster-test.XXXXXX (removed at a run a
#      day later); the bench line at the end. The lab writes there and in
#      the build cache (the nodes' pulled images and converted ones).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/node.sh
target=${CARGO_TARGET_DIR:-$root/target}
rw=/var/cache/sandfork/lab-rw

# Every binary used comes from scripts/build.sh (the caller's, under --no-build).
suite_options "$@"
[[ -z $server ]] || die "--server: the cluster test starts its own nodes"
built "$build"
# The SDK venv (pytest, ruff and mypy pinned there): the lab cannot write it.
. scripts/sdk-setup.sh
setup_python
# Lint and types first: seconds, before minutes in the lab.
python_typed "$venv" tests/cluster
python=$venv/bin/python
mkdir -p "$rw"
# an earlier run's logs stay for a look, for a day
find "$rw" -maxdepth 1 -name 'cluster-test.*' -mmin +1440 -exec rm -rf {} +
work=$(mktemp -d "$rw/cluster-test.XXXXXX")
# TLS between the parts (the long tier) about doubles the suite in the lab:
# one such run outlived the plain bound of 40 min.
lab_timeout=2400
if [[ ${SANDFORK_TEST_TIER:-} == long || ${SANDFORK_CLUSTER_TLS:-} == 1 ]]; then
    lab_timeout=5400
fi
# The nodes pull and convert images into the build cache, as `serve` in the
# lab does (crates/cli/src/serve.rs): shared read-write too (the lab mounts
# only the cache when the work dir is under it).
cache=${SANDFORK_CACHE:-/var/cache/sandfork}
lab=("$target/debug/sandfork-lab" run --cpus 1 --timeout "$lab_timeout" --rw "$rw" --rw "$cache" --
    env "CARGO_TARGET_DIR=$target" "SANDFORK_KERNEL=$SANDFORK_KERNEL" "SANDFORK_ROOTFS=$SANDFORK_ROOTFS"
    "SANDFORK_VMM=${SANDFORK_VMM:-$target/debug/sandfork-vmm}" "SANDFORK_CLUSTER_SDK=${SANDFORK_CLUSTER_SDK:-}"
    "SANDFORK_TEST_TIER=${SANDFORK_TEST_TIER:-}" "SANDFORK_CLUSTER_TLS=${SANDFORK_CLUSTER_TLS:-}"
    "SANDFORK_CLUSTER_WORK=$work" PYTHONDONTWRITEBYTECODE=1
    "$python" -m pytest tests/cluster -p no:cacheprovider --junitxml="$work/junit.xml" "${suite_rest[@]}")
if [[ -z ${SANDFORK_LAB_LOCKED:-} ]]; then
    lab=(flock /tmp/sandfork-lab.lock "${lab[@]}")
fi
exec "${lab[@]}"

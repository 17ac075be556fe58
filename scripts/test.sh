#!/bin/bash
# The whole test suite, from a fresh machine: builds everything (scripts/build.sh),
# checks formatting and lints, runs the fast tests on the host, then the
# microVM tests on real KVM: directly on a host with hardware KVM, otherwise
# inside the KVM lab (QEMU with emulated SVM, see crates/lab).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

scripts/build.sh
set -a
. target/sandfork.env
set +a

echo "== format and lints" >&2
cargo fmt --all --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

echo "== fast tests" >&2
cargo test --workspace --quiet

echo "== microVM tests" >&2
# Test binaries holding lab tests (marked #[ignore = "lab: ..."]).
mapfile -t lab_tests < <(cargo test -p sandfork-vmm --test microvm --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])')
[[ ${#lab_tests[@]} -gt 0 ]] || { echo "no lab test binaries found" >&2; exit 1; }

lab=target/debug/sandfork-lab
# The lab tooling's own tests boot QEMU on this host.
cargo test -p sandfork-lab --quiet -- --ignored --test-threads=1

if [[ $("$lab" detect | head -n1) == hardware* ]]; then
    for t in "${lab_tests[@]}"; do "$t" --ignored --test-threads=1; done
else
    for t in "${lab_tests[@]}"; do
        "$lab" run --timeout 2400 -- "$t" --ignored --test-threads=1
    done
fi

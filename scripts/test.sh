#!/bin/bash
# The whole test suite, from a fresh machine: builds everything (scripts/build.sh),
# checks formatting, shell scripts and licences, then runs side by side: the
# client suites against real nodes (as soon as the binaries are built), the
# microVM test binaries (once the tests are built), and on the host clippy,
# the fast tests and the fuzz targets. MicroVMs run on real KVM: directly on
# a host with hardware KVM, otherwise inside the KVM lab (QEMU with emulated
# SVM, see crates/lab), one lab machine per lane.
#
# Usage: scripts/test.sh [--lab-only]
#   --lab-only  only the microVM tests and the client suites (after the
#               build), e.g. to check a change to them by hand
set -euo pipefail
lab_only=0
[[ ${1:-} == --lab-only ]] && lab_only=1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

# Each stage's start with the time into the run, so a CI log shows where the
# minutes go (the whole run must stay under an hour on a 2-core machine).
stage() { printf '== %s (at %d:%02d)\n' "$*" $((SECONDS / 60)) $((SECONDS % 60)) >&2; }

scripts/deps.sh
. scripts/sccache.sh
if [[ ${RUSTC_WRAPPER:-} == sccache ]]; then
    # One cache server for the whole run, started before the lab lock's
    # descriptor below exists: a server a later cargo started would inherit
    # it and hold the lab lock after the run. Stopped when the run ends.
    export SCCACHE_IDLE_TIMEOUT=0
    sccache --start-server >/dev/null 2>&1 || true
    trap 'sccache --stop-server >/dev/null 2>&1 || true' EXIT
fi
scripts/build.sh
set -a
# shellcheck source=/dev/null  # written by scripts/build.sh
. target/sandfork.env
set +a

if ((lab_only == 0)); then
    stage "format, shell scripts and licences"
    cargo fmt --all --check
    # The fuzz crate is outside the workspace.
    cargo fmt --check --manifest-path fuzz/Cargo.toml
    # Every shell script, including the lab's init, through shellcheck (which
    # scripts/deps.sh installs). A script hashed into a cache key keeps its
    # directives in a .shellcheckrc beside it, so they rebuild nothing.
    shellcheck scripts/*.sh images/*/*.sh crates/lab/src/init.sh
    # Dependency licences, bans and sources against deny.toml, offline; the
    # advisory database needs a download: `scripts/deny.sh --advisories`.
    scripts/deny.sh
fi

lab=target/debug/sandfork-lab
# A directory shared read-write with the lab over 9p, as `sandfork serve`'s
# cache and data dir are there (lab tests that need such a share use it).
export SANDFORK_LAB_RW_DIR=${SANDFORK_CACHE:-/var/cache/sandfork}/lab-rw
mkdir -p "$SANDFORK_LAB_RW_DIR"

# Runs one lab test binary (directly on hardware KVM, else inside the lab).
run_lab_tests() {
    if [[ $("$lab" detect | head -n1) == hardware* ]]; then
        "$@"
    else
        # One lab CPU, QEMU's default multi-threaded TCG: guests are lost
        # early in boot with two CPUs (either TCG mode) and with
        # single-threaded TCG (README, "Hangs").
        "$lab" run --cpus 1 --timeout 1800 --rw "$SANDFORK_LAB_RW_DIR" -- "$@"
    fi
}

# The names of the tests a cargo test log says failed. A lab's own messages
# can split "test NAME ... FAILED" over lines, so the "---- NAME stdout ----"
# headers and the closing list count too.
failed_tests() {
    sed -n -e 's/^test \([A-Za-z0-9_:]*\) \.\.\. FAILED$/\1/p' \
        -e 's/^---- \([A-Za-z0-9_:]*\) stdout ----$/\1/p' \
        -e '/^failures:$/,/^test result:/s/^    \([A-Za-z0-9_:]*\)$/\1/p' "$1" | sort -u
}

# The lab tool's own tests, the VMM's and the node's lab test binaries,
# sandfork's CLI against a node.
vmm_lane() {
    # The lab tooling's own tests boot QEMU on this host.
    "$lab_tool_tests" --ignored --test-threads=1 -q

    # Lab guests used to be lost now and then (4 of 26 `sandfork stress`
    # trials, 4 of 13 two-VM ones, on a loaded host): the guest ticked from
    # the PIT, broadcast each tick by IPI, and on a slow lab its vCPU 0 did
    # nothing but timer interrupts (README, "Hangs"). With the TSC-deadline
    # timer offered and lost PIT ticks dropped, 0 of 35. Until CI has shown a
    # run of clean lab runs, the rule below stays.
    # A test that loses its guest fails or overruns with diagnostics; re-run
    # the tests that failed, once: a real defect fails twice and still fails
    # the suite. A run that ended without naming failures (a lab timeout, the
    # watchdog) is re-run whole. A re-run during which the lab machine itself
    # stood still (its kernel's livelock, README "Hangs") earns one more.
    local t log failed try
    log=$(mktemp)
    for t in "${lab_tests[@]}"; do
        stage "lab tests: ${t##*/}"
        if run_lab_tests "$t" --ignored --test-threads=1 2>&1 | tee "$log"; [[ ${PIPESTATUS[0]} -eq 0 ]]; then
            continue
        fi
        for try in 1 2; do
            mapfile -t failed < <(failed_tests "$log")
            stage "re-running failed lab tests ($try): ${failed[*]:-all}"
            if run_lab_tests "$t" --ignored --test-threads=1 ${failed[@]:+--exact "${failed[@]}"} 2>&1 | tee "$log"; [[ ${PIPESTATUS[0]} -eq 0 ]]; then
                break
            fi
            if ((try == 2)) || ! grep -q '^sandfork-lab: the machine stood still' "$log"; then
                return 1
            fi
        done
    done
    rm -f "$log"

    stage "the sandfork CLI against sandfork serve"
    # Every client command through the real binary against one real node,
    # the interactive shell through tmux; its test binary from the build above.
    CLI_NODE_TEST_BIN=$cli_node_tests scripts/cli-test.sh --no-build
}

# The real clients against real nodes (the E2B SDKs and CLI, the Python
# package), then the stress and the cluster: all of them need only the
# binaries scripts/build.sh made, so this lane starts before the tests are
# compiled.
clients_lane() {
    stage "E2B SDK suites against sandfork serve"
    # The real e2b Python and JS SDKs against a real server on real microVMs
    # (inside the lab here): the basic suites, then pause, fork and snapshots.
    scripts/sdk-test.sh --no-build

    stage "the sandfork Python package against sandfork serve"
    # ruff, the pure tests, then forks, environments, Gymnasium's checker and
    # the branching runner on real microVMs.
    scripts/rl-test.sh --no-build

    stage "stress: boots, restores, forks and two-VM runs, each bounded"
    # The short version of `sandfork stress` (README, "Hangs"): a hang or a
    # failure, with the VMs' diagnostics, fails the suite unless a second
    # run is clean (the same rule as for the lab tests, for the same reason).
    stress() { target/debug/sandfork stress --boots 2 --restores 2 --forks 2 --two-vm 1 >/dev/null; }
    stress || { stage "re-running the stress once"; stress; }

    stage "the cluster: two nodes and a gateway on a real etcd and S3 (a pause resumed on the other node)"
    # Membership, placement and routing through the gateway, with the nodes'
    # sandboxes real microVMs (one lab machine for all three processes).
    scripts/cluster-test.sh --no-build
}

# The test binaries (the fast tests and the lab's), with their diagnostics on
# stderr; sets lab_tool_tests, lab_tests and cli_node_tests. From the whole
# workspace's test build: naming packages with -p would resolve features for
# them alone and compile their dependencies again (6 min of a CI run).
build_tests() {
    stage "building the tests"
    local found
    mapfile -t found < <(cargo test --workspace --no-run --quiet --message-format=json-render-diagnostics |
        python3 -c 'import json,sys
order = ["lab_run", "cli_node", "snapshot", "microvm", "network", "lab_serve", "lab_restart", "lab_network"]
found = {}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        found[m["target"]["name"]] = m["executable"]
print(*(found[name] for name in order if name in found), sep="\n")')
    [[ ${#found[@]} -eq 8 ]] || { echo "lab test binaries: found ${#found[@]} of 8" >&2; return 1; }
    lab_tool_tests=${found[0]}
    cli_node_tests=${found[1]}
    lab_tests=("${found[@]:2}")
}

# What runs on the host alone: lints of every target, the fast tests, the
# fuzz targets.
host_checks() {
    stage "clippy"
    cargo clippy --workspace --all-targets --quiet -- -D warnings
    stage "fast tests"
    cargo test --workspace --quiet
    stage "fuzz targets: corpora replayed, then each fuzzed briefly"
    # Every parser a guest or client reaches (README, "Fuzzing"), with the
    # fuzz crate's build cached under SANDFORK_CACHE.
    scripts/fuzz.sh
}

# Two lab machines at once, one per lane, each with its own lock (the lab
# uses one host CPU at a time, this host has two): the client suites start
# as soon as the binaries are built, the lab test binaries once the tests
# are; the host's own checks run beside them. SANDFORK_LAB_LANES=1 runs it
# all one after the other under the one lock. The client lane's lines are
# prefixed with "clients|", the host checks' with "host|".
export SANDFORK_LAB_LOCKED=1
exec 9>/tmp/sandfork-lab.lock
stage "waiting for the lab lock"
flock 9
if [[ ${SANDFORK_LAB_LANES:-2} -lt 2 ]]; then
    build_tests
    ((lab_only)) || host_checks
    vmm_lane
    clients_lane
    stage "all passed"
    exit 0
fi
exec 8>/tmp/sandfork-lab2.lock
stage "waiting for the second lab lock"
flock 8
# Each job in the background and waited for: in a subshell whose status an
# `||` tests, bash would ignore `set -e`.
stage "the client suites' lane (clients|)"
clients_lane > >(sed -u 's/^/clients| /') 2>&1 &
clients_pid=$!
clients_rc=0 vmm_rc=0 host_rc=0
if build_tests; then
    stage "the lab test binaries' lane"
    vmm_lane &
    vmm_pid=$!
    if ((lab_only == 0)); then
        host_checks > >(sed -u 's/^/host| /') 2>&1 &
        wait "$!" || host_rc=$?
    fi
    wait "$vmm_pid" || vmm_rc=$?
else
    vmm_rc=1
fi
wait "$clients_pid" || clients_rc=$?
stage "done: host checks exit $host_rc, lab tests exit $vmm_rc, client suites exit $clients_rc"
((host_rc == 0 && vmm_rc == 0 && clients_rc == 0)) || exit 1
stage "all passed"

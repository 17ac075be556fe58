#!/bin/bash
# Builds the coverage-guided fuzz targets in fuzz/ (libFuzzer, on stable Rust)
# and runs each for a bounded time: first the committed seeds, the inputs that
# once failed and the saved corpus are replayed (a regression test of
# everything found before), then new inputs are searched for. A crash, a
# timeout or runaway memory fails the run and leaves the input under
# $SANDFORK_CACHE/fuzz/artifacts/<target>/.
#
# Usage: scripts/fuzz.sh [--time SECONDS] [--jobs N] [--build-only] [--seeds] [TARGET...]
#   --time     seconds of fuzzing per target (default 10: the short CI run;
#              README, "Fuzzing", has the longer one)
#   --jobs     targets fuzzed at once (default: the number of CPUs)
#   --seeds    rewrite fuzz/seeds/ from real messages (fuzz/src/bin/make_seeds.rs)
#   TARGET...  only these (default: every target in fuzz/fuzz_targets/)
#
# The build is cached by a hash of every source it compiles (fuzz/, crates/,
# the lock files, the toolchain): a second run with nothing changed does not
# invoke cargo at all.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

log() { echo "fuzz: $*" >&2; }

time_per_target=10
jobs=$(nproc)
build_only=0
seeds=0
targets=()
while (($#)); do
    case $1 in
    --time) time_per_target=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --build-only) build_only=1; shift ;;
    --seeds) seeds=1; shift ;;
    -h | --help) sed -n '2,18s/^# \{0,1\}//p' "$0"; exit 0 ;;
    -*) echo "fuzz: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
    esac
done
if ((${#targets[@]} == 0)); then
    for f in fuzz/fuzz_targets/*.rs; do
        targets+=("$(basename "$f" .rs)")
    done
fi

cache=${SANDFORK_CACHE:-/var/cache/sandfork}/fuzz
mkdir -p "$cache"

# What cargo-fuzz adds for `-s none` (libfuzzer-sys's coverage hooks,
# compare tracing for magic values, `cfg(fuzzing)`), all stable rustc flags;
# debug assertions and overflow checks on, so arithmetic bugs crash too.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
export CARGO_TARGET_DIR=$cache/target
export CARGO_INCREMENTAL=0
triple=x86_64-unknown-linux-gnu
out=$CARGO_TARGET_DIR/$triple/release

hash=$({
    rustc -vV
    echo "$RUSTFLAGS"
    git ls-files -s -- fuzz crates Cargo.lock
    git diff HEAD -- fuzz crates Cargo.lock
    git ls-files --others --exclude-standard -- fuzz crates | xargs -r cat
} | sha256sum | cut -c1-16)
stamp=$cache/built-$hash
start=$(date +%s)
if [[ -e $stamp ]]; then
    log "targets up to date ($hash)"
else
    log "building the targets (cold: several minutes)"
    # -j1 only if asked: the build is most of a cold run's time.
    cargo build --quiet --release --manifest-path fuzz/Cargo.toml --target "$triple" \
        ${CARGO_BUILD_JOBS:+-j "$CARGO_BUILD_JOBS"}
    rm -f "$cache"/built-*
    touch "$stamp"
fi
log "build: $(($(date +%s) - start)) s"

# The targets' (and make_seeds') scratch files (images, sockets, a store),
# in memory when /dev/shm is there; the processes exit without cleaning up,
# this does.
scratch=$(mktemp -d /dev/shm/sandfork-fuzz.XXXXXX 2>/dev/null || mktemp -d)
export SANDFORK_FUZZ_TMP=$scratch
results=$scratch/results
trap 'rm -rf "$scratch"' EXIT

if ((seeds)); then
    rm -rf fuzz/seeds.new
    "$out/make_seeds" fuzz/seeds.new
    rm -rf fuzz/seeds
    mv fuzz/seeds.new fuzz/seeds
    log "seeds rewritten in fuzz/seeds; rebuild (disk_layer embeds one) and commit them"
    exit 0
fi
((build_only)) && exit 0

# One target: replay, then fuzz. Its log goes to $cache/logs/<target>.log.
run_one() {
    local t=$1 corpus=$cache/corpus/$1 artifacts=$cache/artifacts/$1 log=$cache/logs/$1.log
    mkdir -p "$corpus" "$artifacts" "$cache/logs"
    # Each input is small and fast; 10 s on one is a hang. A fuzzed length or
    # count the code trusts shows as memory, hence the RSS limit.
    local common=(-timeout=10 -rss_limit_mb=2048
        -artifact_prefix="$artifacts/" -print_final_stats=1)
    # Inputs that once failed (fuzz/regressions/<target>/, each fixed with a
    # unit test beside the code) are replayed with the seeds.
    local replay=("fuzz/seeds/$t")
    [[ -d fuzz/regressions/$t ]] && replay+=("fuzz/regressions/$t")
    # libFuzzer runs every input of the directories first (the replay), then
    # mutates; new finds go to the first directory, the saved corpus.
    if ! "$out/$t" "${common[@]}" -max_total_time="$time_per_target" \
        "$corpus" "${replay[@]}" >"$log" 2>&1; then
        echo "FAIL $t"
        return
    fi
    echo "ok $t $(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1) runs"
}

log "fuzzing ${#targets[@]} targets, ${time_per_target} s each, $jobs at a time"
start=$(date +%s)
running=0
for t in "${targets[@]}"; do
    [[ -x $out/$t ]] || { echo "fuzz: no target $t" >&2; exit 2; }
    run_one "$t" >>"$results" &
    running=$((running + 1))
    if ((running >= jobs)); then
        wait -n
        running=$((running - 1))
    fi
done
wait

sed 's/^/fuzz: /' "$results" >&2
failed=$(sed -n 's/^FAIL //p' "$results")
log "fuzzing: $(($(date +%s) - start)) s"
if [[ -n $failed ]]; then
    for t in $failed; do
        echo "== fuzz target $t failed; its log ends:" >&2
        tail -n 40 "$cache/logs/$t.log" >&2
        echo "== inputs kept in $cache/artifacts/$t/ (replay: $out/$t <file>)" >&2
    done
    exit 1
fi
passed=$(grep -c '^ok ' "$results")
echo "fuzz: $passed passed, 0 failed"

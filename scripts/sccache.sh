# shellcheck shell=bash
# Sourced by build.sh and test.sh: compiles Rust through sccache (deps.sh
# installs Debian's) with its cache under SANDFORK_CACHE, so a fresh checkout,
# as CI's is, reuses the compiled dependencies of the last build instead of
# compiling them again (about 11 min of a cold workspace build on 2 cores).
# Proc-macro crates and crates whose build script names a path in the target
# dir still compile. A RUSTC_WRAPPER already set is kept; SANDFORK_SCCACHE=0
# turns it off. Incremental builds (a developer's default) pass through
# uncached: .ci/run sets CARGO_INCREMENTAL=0.
if [[ ${SANDFORK_SCCACHE:-1} != 0 && -z ${RUSTC_WRAPPER:-} ]] && command -v sccache >/dev/null; then
    export RUSTC_WRAPPER=sccache
    export SCCACHE_DIR=${SCCACHE_DIR:-${SANDFORK_CACHE:-/var/cache/sandfork}/sccache}
    export SCCACHE_CACHE_SIZE=${SCCACHE_CACHE_SIZE:-12G}
fi

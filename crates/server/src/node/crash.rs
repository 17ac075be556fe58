//! Crash points, for the crash tests: in a debug build, a node started with
//! `SANDFORK_CRASH_AT=<point>` aborts when it reaches that point, leaving
//! everything as a `kill -9` there would (no destructor runs, its VMMs live
//! on). Release builds have no crash points.
//!
//! The points, each where a crash leaves two records of one change
//! disagreeing (what the next start must settle):
//! - `pause.written`: a pause's snapshot is on disk, the record still says
//!   running (its VMM paused);
//! - `pause.committed`: the record says paused, its VMM still runs;
//! - `fork.frozen`: the VMM forked (the parent continues on a new disk
//!   layer), nothing of it is recorded yet;
//! - `snapshot.frozen`: the same for a snapshot (its memory, which the
//!   guest runs on now, in a `templates/` directory without a record);
//! - `template.snapshotted`: an E2B build's template is recorded (by its
//!   snapshot), its build is still `building` and its sandbox still runs;
//! - `template.written`: a build's template files are in place (an E2B
//!   build's recorded without its tags, an image build's not at all), the
//!   build still `building`;
//! - `gc.removing`: the collector removed a deleted template's record, not
//!   yet its files.

/// Aborts the process if `SANDFORK_CRASH_AT` names `point` (debug builds).
pub fn point(point: &str) {
    #[cfg(debug_assertions)]
    {
        static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        let at = AT.get_or_init(|| std::env::var("SANDFORK_CRASH_AT").ok());
        if at.as_deref() == Some(point) {
            eprintln!("sandfork: crash point {point}: aborting");
            std::process::abort();
        }
    }
    #[cfg(not(debug_assertions))]
    let _ = point;
}

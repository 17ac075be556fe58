//! Log lines a guest can cause, capped, so a guest cannot fill `vmm.log`: a
//! driver that hands the device bad buffers in a loop would otherwise write
//! a warning per request.
//!
//! [`warn_limited!`] and [`error_limited!`] log through `tracing` like
//! `warn!` and `error!`, at most [`LINES_PER_WINDOW`] times per
//! [`WINDOW`] at each call site; the first line after a window in which
//! lines were dropped says how many (`suppressed=N`). Lines a guest cannot
//! repeat at will (start-up, a device's worker failing once) stay plain
//! `tracing` calls.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How many lines one call site may log per window.
pub const LINES_PER_WINDOW: u32 = 10;
/// The length of a window.
pub const WINDOW: Duration = Duration::from_secs(60);

/// One call site's budget.
#[derive(Debug)]
pub struct RateLimit {
    window: Mutex<Window>,
}

#[derive(Debug)]
struct Window {
    start: Option<Instant>,
    logged: u32,
    suppressed: u64,
}

impl RateLimit {
    pub const fn new() -> Self {
        RateLimit {
            window: Mutex::new(Window {
                start: None,
                logged: 0,
                suppressed: 0,
            }),
        }
    }

    /// Whether a line may be logged now: `Some(n)` with the number of lines
    /// dropped since the last one logged, or `None` to drop this one.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> Option<u64> {
        // A poisoned lock only means a logger panicked; the counts are plain data.
        let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
        let expired = w
            .start
            .is_none_or(|start| now.saturating_duration_since(start) >= WINDOW);
        if expired {
            w.start = Some(now);
            w.logged = 0;
        }
        if w.logged >= LINES_PER_WINDOW {
            w.suppressed = w.suppressed.saturating_add(1);
            return None;
        }
        w.logged += 1;
        Some(std::mem::take(&mut w.suppressed))
    }
}

impl Default for RateLimit {
    fn default() -> Self {
        Self::new()
    }
}

/// Logs at `level` through the call site's own [`RateLimit`].
#[macro_export]
#[doc(hidden)]
macro_rules! __log_limited {
    ($level:expr, $($arg:tt)+) => {{
        static LIMIT: $crate::rate_limited::RateLimit = $crate::rate_limited::RateLimit::new();
        match LIMIT.admit() {
            Some(0) => ::tracing::event!($level, $($arg)+),
            Some(suppressed) => ::tracing::event!($level, suppressed, $($arg)+),
            None => {}
        }
    }};
}

/// `tracing::warn!`, capped per call site (see the module).
#[macro_export]
macro_rules! warn_limited {
    ($($arg:tt)+) => { $crate::__log_limited!(::tracing::Level::WARN, $($arg)+) };
}

/// `tracing::error!`, capped per call site (see the module).
#[macro_export]
macro_rules! error_limited {
    ($($arg:tt)+) => { $crate::__log_limited!(::tracing::Level::ERROR, $($arg)+) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_admits_its_lines_then_counts_the_rest() {
        let limit = RateLimit::new();
        let t0 = Instant::now();
        for _ in 0..LINES_PER_WINDOW {
            assert_eq!(limit.admit_at(t0), Some(0));
        }
        for _ in 0..5 {
            assert_eq!(limit.admit_at(t0 + WINDOW / 2), None);
        }
        // The next window's first line reports what was dropped, once.
        assert_eq!(limit.admit_at(t0 + WINDOW), Some(5));
        assert_eq!(limit.admit_at(t0 + WINDOW), Some(0));
    }

    #[test]
    fn the_macros_log_and_drop() {
        for i in 0..(LINES_PER_WINDOW * 2) {
            crate::warn_limited!("line {i}");
            crate::error_limited!(device = "test", "line {i}");
        }
    }
}

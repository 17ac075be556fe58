//! Host memory pressure: when the host's memory runs short, the node pauses
//! its least recently used idle sandboxes (to disk, as an API pause does)
//! rather than let the kernel's OOM killer end a VMM or the node.
//!
//! Admission charges sandboxes what they really use plus a headroom
//! ([`crate::node::capacity`]); guests that then grow (a build filling its tmpfs,
//! an interpreter loading a data set) can together want more than the host
//! has. The monitor ([`crate::node::sandbox::Manager::start_pressure_monitor`])
//! reads the host every [`CHECK_EVERY`]:
//!
//! - `MemAvailable` (`/proc/meminfo`) below `min_available_percent` of the
//!   node's memory ceiling (at most `MemTotal`), or
//! - the kernel's memory pressure (PSI, `/proc/pressure/memory`): `full`
//!   `avg10` above `max_full_avg10` percent while tasks are stalling now
//!   (the total grew since the last reading; `avg10` lags by seconds and
//!   would go on pausing after the stall ended).
//!
//! Under pressure it pauses one sandbox at a time, each pause written out
//! and its VMM gone before the host is read again, until `MemAvailable` is
//! back above [`RELIEF_FACTOR`] times its floor and PSI is quiet, or no idle
//! sandbox is left; at most `max_pauses_per_minute`. Candidates are running
//! sandboxes with no proxied request under way and none for `idle`;
//! auto-pause ones (their owner already accepts a pause) first, then the
//! least recently used. A sandbox paused this way is `paused` in E2B's API
//! with `pauseReason: "memoryPressure"` in its detail, and resumes by
//! itself on its next envd request (or `connect`, or `resume`) with the
//! timeout it had left.

use std::collections::VecDeque;
use std::time::Duration;

use host_mem::pressure::Pressure;
use serde::Serialize;

/// How often the monitor reads the host when nothing is paused.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);
/// Once pausing, pressure is relieved only when `MemAvailable` is this many
/// times its floor (so one pause that barely clears the floor is not
/// followed by another pressure episode a second later).
pub const RELIEF_FACTOR: f64 = 1.5;
/// Pauses remembered for `GET /v1/node`.
const RECENT_PAUSES: usize = 16;

pub const DEFAULT_MIN_AVAILABLE_PERCENT: f64 = 5.0;
pub const DEFAULT_MAX_FULL_AVG10: f64 = 20.0;
pub const DEFAULT_IDLE: Duration = Duration::from_secs(10);
pub const DEFAULT_MAX_PAUSES_PER_MINUTE: u32 = 30;

/// The `serve` flags of the monitor.
#[derive(Debug, Clone, PartialEq)]
pub struct PressureConfig {
    /// Pause while `MemAvailable` is below this percent of the node's
    /// memory ceiling.
    pub min_available_percent: f64,
    /// Pause while PSI memory `full` avg10 is above this percent (and
    /// tasks are stalling now).
    pub max_full_avg10: f64,
    /// A sandbox is idle once no proxied request has reached it for this long.
    pub idle: Duration,
    pub max_pauses_per_minute: u32,
}

impl Default for PressureConfig {
    fn default() -> PressureConfig {
        PressureConfig {
            min_available_percent: DEFAULT_MIN_AVAILABLE_PERCENT,
            max_full_avg10: DEFAULT_MAX_FULL_AVG10,
            idle: DEFAULT_IDLE,
            max_pauses_per_minute: DEFAULT_MAX_PAUSES_PER_MINUTE,
        }
    }
}

impl PressureConfig {
    /// The `MemAvailable` floor in MiB for a node whose ceiling is
    /// `ceiling_mib` on a host of `total_mib`.
    pub fn floor_mib(&self, ceiling_mib: u64, total_mib: u64) -> u64 {
        let base = ceiling_mib.min(total_mib) as f64;
        (base * self.min_available_percent.max(0.0) / 100.0) as u64
    }
}

/// One reading of the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Reading {
    #[serde(rename = "availableMB")]
    pub available_mib: u64,
    /// `None`: the kernel does not track pressure (or it is disabled).
    #[serde(skip)]
    pub psi: Option<Pressure>,
    pub at_ms: u64,
}

impl Reading {
    /// The host now.
    pub fn now() -> std::io::Result<Reading> {
        let available_mib = host_mem::mem_available_mib()?;
        // PSI is a refinement: a host without it is judged by MemAvailable.
        let psi = Pressure::memory().unwrap_or_else(|e| {
            tracing::debug!("reading {}: {e}", host_mem::pressure::HOST_MEMORY);
            None
        });
        Ok(Reading {
            available_mib,
            psi,
            at_ms: crate::node::clock::now_ms(),
        })
    }

    pub fn full_avg10(&self) -> Option<f64> {
        self.psi.map(|p| p.full.avg10)
    }

    pub fn some_avg10(&self) -> Option<f64> {
        self.psi.map(|p| p.some.avg10)
    }
}

/// Why the host is under pressure (for the log), or `None`.
///
/// `pausing`: an episode is under way, so `MemAvailable` must be back
/// above [`RELIEF_FACTOR`] times the floor to end it. `last`: the reading
/// before, to tell a stall going on now from `avg10`'s memory of one.
pub fn pressured(
    config: &PressureConfig,
    floor_mib: u64,
    now: &Reading,
    last: Option<&Reading>,
    pausing: bool,
) -> Option<String> {
    let floor = match pausing {
        true => (floor_mib as f64 * RELIEF_FACTOR) as u64,
        false => floor_mib,
    };
    if now.available_mib < floor {
        return Some(format!(
            "MemAvailable {} MiB is below {floor} MiB",
            now.available_mib
        ));
    }
    let (Some(psi), Some(before)) = (now.psi, last.and_then(|l| l.psi)) else {
        return None;
    };
    let stalling = psi.full.total_us > before.full.total_us;
    (psi.full.avg10 > config.max_full_avg10 && stalling).then(|| {
        format!(
            "memory pressure (PSI full avg10) {:.2} % is above {:.2} %",
            psi.full.avg10, config.max_full_avg10
        )
    })
}

/// A sandbox the monitor may pause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub id: String,
    pub auto_pause: bool,
    /// When a proxied request last reached it (or it started).
    pub last_used_ms: u64,
}

/// The one to pause first: auto-pause sandboxes before others, then the
/// least recently used.
pub fn choose(candidates: &[Candidate]) -> Option<&Candidate> {
    candidates
        .iter()
        .min_by_key(|c| (!c.auto_pause, c.last_used_ms, c.id.as_str()))
}

/// One pause the monitor made.
#[derive(Debug, Clone, PartialEq)]
pub struct PressurePause {
    pub id: String,
    pub at_ms: u64,
    pub reason: String,
    pub available_before_mib: u64,
    pub available_after_mib: u64,
    /// Its VMM's real use (Pss) just before.
    pub vmm_mib: Option<u64>,
    pub psi_full_avg10: Option<f64>,
    pub took_ms: u64,
}

/// The monitor's figures as `GET /v1/node` shows them (its settings beside
/// what it has seen and done).
#[derive(Debug, Clone, PartialEq)]
pub struct PressureReport {
    pub last: Option<Reading>,
    /// The `MemAvailable` floor it keeps, in MiB.
    pub floor_mib: u64,
    pub max_full_avg10: f64,
    /// How long a sandbox is idle before it may be paused.
    pub idle: Duration,
    pub pausing: bool,
    pub paused_total: u64,
    /// Sandboxes paused for pressure now.
    pub paused_now: usize,
    pub failed_total: u64,
    pub nothing_to_pause_total: u64,
    pub recent: Vec<PressurePause>,
}

/// What the monitor has seen and done, for `GET /v1/node`.
#[derive(Debug, Default)]
pub struct PressureStats {
    pub last: Option<Reading>,
    /// An episode of pressure is under way.
    pub pausing: bool,
    pub paused_total: u64,
    /// Pauses that failed (the sandbox was left running).
    pub failed_total: u64,
    /// Under pressure with nothing idle to pause.
    pub nothing_to_pause_total: u64,
    pub recent: VecDeque<PressurePause>,
    /// When the pauses of the last minute were made (the rate bound).
    pub minute: VecDeque<u64>,
}

impl PressureStats {
    pub fn record(&mut self, pause: PressurePause) {
        self.paused_total += 1;
        self.minute.push_back(pause.at_ms);
        if self.recent.len() == RECENT_PAUSES {
            self.recent.pop_front();
        }
        self.recent.push_back(pause);
    }

    /// Whether another pause at `now_ms` stays within `per_minute`.
    pub fn may_pause(&mut self, now_ms: u64, per_minute: u32) -> bool {
        while self
            .minute
            .front()
            .is_some_and(|t| now_ms.saturating_sub(*t) >= 60_000)
        {
            self.minute.pop_front();
        }
        self.minute.len() < per_minute as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use host_mem::pressure::Stall;

    fn reading(available_mib: u64, full_avg10: f64, full_total_us: u64) -> Reading {
        Reading {
            available_mib,
            psi: Some(Pressure {
                some: Stall::default(),
                full: Stall {
                    avg10: full_avg10,
                    total_us: full_total_us,
                    ..Stall::default()
                },
            }),
            at_ms: 0,
        }
    }

    #[test]
    fn the_floor_is_a_share_of_the_ceiling_at_most_the_host() {
        let c = PressureConfig::default();
        assert_eq!(c.floor_mib(20_000, 24_000), 1000);
        // A ceiling above the host's memory (or unlimited) counts the host.
        assert_eq!(c.floor_mib(u64::MAX, 4000), 200);
        let off = PressureConfig {
            min_available_percent: 0.0,
            ..c
        };
        assert_eq!(off.floor_mib(20_000, 24_000), 0);
    }

    #[test]
    fn low_available_memory_is_pressure_until_relieved_with_a_margin() {
        let c = PressureConfig::default();
        assert!(pressured(&c, 600, &reading(599, 0.0, 0), None, false).is_some());
        assert_eq!(pressured(&c, 600, &reading(600, 0.0, 0), None, false), None);
        // Pausing: 850 MiB is not relief yet, 900 is.
        let why = pressured(&c, 600, &reading(850, 0.0, 0), None, true).unwrap();
        assert_eq!(why, "MemAvailable 850 MiB is below 900 MiB");
        assert_eq!(pressured(&c, 600, &reading(900, 0.0, 0), None, true), None);
    }

    #[test]
    fn psi_counts_only_while_tasks_stall_now() {
        let c = PressureConfig::default();
        let before = reading(5000, 30.0, 1_000);
        // avg10 high and the total growing: pressure.
        let why = pressured(&c, 600, &reading(5000, 30.0, 2_000), Some(&before), false);
        assert_eq!(
            why.as_deref(),
            Some("memory pressure (PSI full avg10) 30.00 % is above 20.00 %")
        );
        // avg10 still remembers a stall that ended: none.
        assert_eq!(
            pressured(&c, 600, &reading(5000, 30.0, 1_000), Some(&before), false),
            None
        );
        // Stalling a little: under the threshold.
        assert_eq!(
            pressured(&c, 600, &reading(5000, 5.0, 9_000), Some(&before), false),
            None
        );
        // No earlier reading, or no PSI: MemAvailable alone decides.
        assert_eq!(
            pressured(&c, 600, &reading(5000, 90.0, 9_000), None, false),
            None
        );
        let no_psi = Reading {
            available_mib: 5000,
            psi: None,
            at_ms: 0,
        };
        assert_eq!(pressured(&c, 600, &no_psi, Some(&before), false), None);
    }

    #[test]
    fn auto_pause_sandboxes_go_first_then_the_least_recently_used() {
        let c = |id: &str, auto_pause, last_used_ms| Candidate {
            id: id.into(),
            auto_pause,
            last_used_ms,
        };
        let all = [c("a", false, 100), c("b", true, 900), c("c", false, 50)];
        assert_eq!(choose(&all).unwrap().id, "b");
        assert_eq!(choose(&all[..1]).unwrap().id, "a");
        assert_eq!(choose(&[all[0].clone(), all[2].clone()]).unwrap().id, "c");
        assert_eq!(choose(&[]), None);
    }

    #[test]
    fn pauses_are_bounded_per_minute() {
        let mut s = PressureStats::default();
        let pause = |at_ms| PressurePause {
            id: "x".into(),
            at_ms,
            reason: String::new(),
            available_before_mib: 0,
            available_after_mib: 0,
            vmm_mib: None,
            psi_full_avg10: None,
            took_ms: 0,
        };
        assert!(s.may_pause(1_000, 2));
        s.record(pause(1_000));
        s.record(pause(2_000));
        assert!(!s.may_pause(30_000, 2));
        assert!(s.may_pause(61_000, 2));
        for i in 0..20 {
            s.record(pause(100_000 + i));
        }
        assert_eq!((s.paused_total, s.recent.len()), (22, RECENT_PAUSES));
    }
}

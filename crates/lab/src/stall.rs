//! Telling a lab machine that stood still from a slow one, and waking it.
//!
//! Init writes a heartbeat line to the status port every 2 s. Now and then
//! the whole machine stops: its one CPU halted with interrupts enabled and
//! its local APIC's timer interrupt pending in the IRR, never delivered
//! (QEMU's `info lapic` and `info registers` during one: `IRR 236`, `HLT=1`,
//! `IF` set, the emulator idle), so nothing inside the machine runs again.
//! `stop`/`cont` on QEMU's monitor and an NMI leave it so (tried, see
//! docs/src/testing/hangs.md); an interrupt from a device does not: QEMU
//! delivers the keyboard's and, with it, the pending timer's. So when the
//! beats stop, the host sends the machine a key press (`sendkey shift`: an
//! i8042 interrupt, no character), again every few seconds while it lasts.
//! Each stall is reported with its length and whether a nudge ended it.

use std::time::{Duration, Instant};

/// The heartbeat line on the status port.
pub const BEAT: &str = "SANDFORK-BEAT";
/// QEMU monitor commands that raise a device interrupt in the machine.
pub const NUDGE: &[&str] = &["sendkey shift"];
/// No beat for this long is a stall: a busy lab stretches a 2 s sleep to
/// 3 s, and a nudge sent to a machine that was only slow costs nothing.
const STALL_AFTER: Duration = Duration::from_secs(8);
/// How long a nudge gets before the next one.
const NUDGE_EVERY: Duration = Duration::from_secs(4);

/// Something worth a line on the runner's stderr.
#[derive(Debug, Clone, PartialEq)]
pub enum StallEvent {
    /// No beat for `silent`; `nudged`: a nudge is sent now.
    Stalled { silent: Duration, nudged: bool },
    /// Beats again after `lasted`, `nudges` having been sent meanwhile.
    Resumed { lasted: Duration, nudges: u32 },
}

impl std::fmt::Display for StallEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StallEvent::Stalled { silent, nudged } => {
                write!(
                    f,
                    "sandfork-lab: no heartbeat from the machine for {:.1} s",
                    silent.as_secs_f64()
                )?;
                if *nudged {
                    write!(f, ": a key press sent (a device interrupt)")
                } else {
                    write!(f, " (not nudging)")
                }
            }
            StallEvent::Resumed { lasted, nudges } => write!(
                f,
                "sandfork-lab: the machine beats again after {:.1} s, {nudges} nudge(s) sent",
                lasted.as_secs_f64()
            ),
        }
    }
}

/// Heartbeat bookkeeping for one machine: fed beats and the time, says
/// when to nudge.
#[derive(Debug)]
pub struct StallWatch {
    nudge: bool,
    last_beat: Option<Instant>,
    /// Nudges sent in the current stall, and when the last one was.
    nudges: u32,
    nudged_at: Option<Instant>,
    stalled: bool,
    /// Stalls seen, and those that ended after a nudge.
    pub stalls: u32,
    pub ended_by_nudge: u32,
}

impl StallWatch {
    /// `nudge`: false only watches and reports.
    pub fn new(nudge: bool) -> StallWatch {
        StallWatch {
            nudge,
            last_beat: None,
            nudges: 0,
            nudged_at: None,
            stalled: false,
            stalls: 0,
            ended_by_nudge: 0,
        }
    }

    pub fn beat(&mut self, now: Instant) -> Option<StallEvent> {
        let previous = self.last_beat.replace(now);
        if !self.stalled {
            return None;
        }
        self.stalled = false;
        let nudges = std::mem::take(&mut self.nudges);
        self.nudged_at = None;
        if nudges > 0 {
            self.ended_by_nudge += 1;
        }
        Some(StallEvent::Resumed {
            lasted: previous.map_or(Duration::ZERO, |p| now.duration_since(p)),
            nudges,
        })
    }

    /// What to do now: nothing until the first beat (the machine is still
    /// booting), then a nudge at the start of a stall and every
    /// `NUDGE_EVERY` while it lasts.
    pub fn poll(&mut self, now: Instant) -> Option<StallEvent> {
        let silent = now.duration_since(self.last_beat?);
        if silent < STALL_AFTER {
            return None;
        }
        if !self.stalled {
            self.stalled = true;
            self.stalls += 1;
        } else if !self.nudge
            || self
                .nudged_at
                .is_some_and(|at| now.duration_since(at) < NUDGE_EVERY)
        {
            return None;
        }
        if self.nudge {
            self.nudges += 1;
            self.nudged_at = Some(now);
        }
        Some(StallEvent::Stalled {
            silent,
            nudged: self.nudge,
        })
    }

    /// One line for the end of the run, or None when nothing stood still.
    pub fn summary(&self) -> Option<String> {
        (self.stalls > 0).then(|| {
            format!(
                "sandfork-lab: the machine stood still {} time(s); {} ended after a nudge",
                self.stalls, self.ended_by_nudge
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn init_beats_the_line_watched_for() {
        assert!(include_str!("init.sh").contains(&format!("echo {BEAT} >&3")));
    }

    #[test]
    fn nothing_happens_before_the_first_beat_or_while_beats_come() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(true);
        assert_eq!(w.poll(t0 + secs(100)), None);
        w.beat(t0 + secs(100));
        for s in (102..200).step_by(3) {
            assert_eq!(w.beat(t0 + secs(s)), None);
            assert_eq!(w.poll(t0 + secs(s + 2)), None);
        }
        assert_eq!(w.summary(), None);
    }

    #[test]
    fn a_stall_is_nudged_while_it_lasts_and_its_end_counted() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(true);
        w.beat(t0);
        assert_eq!(w.poll(t0 + secs(7)), None);
        let nudged = |silent| {
            Some(StallEvent::Stalled {
                silent: secs(silent),
                nudged: true,
            })
        };
        assert_eq!(w.poll(t0 + secs(8)), nudged(8));
        assert_eq!(w.poll(t0 + secs(10)), None);
        assert_eq!(w.poll(t0 + secs(12)), nudged(12));
        assert_eq!(w.poll(t0 + secs(13)), None);
        assert_eq!(w.poll(t0 + secs(16)), nudged(16));
        assert_eq!(
            w.beat(t0 + secs(17)),
            Some(StallEvent::Resumed {
                lasted: secs(17),
                nudges: 3
            })
        );
        assert_eq!((w.stalls, w.ended_by_nudge), (1, 1));
        // A second stall: the count of nudges starts again.
        assert_eq!(w.poll(t0 + secs(25)), nudged(8));
        assert_eq!(
            w.beat(t0 + secs(26)),
            Some(StallEvent::Resumed {
                lasted: secs(9),
                nudges: 1
            })
        );
        assert_eq!((w.stalls, w.ended_by_nudge), (2, 2));
        let summary = w.summary().unwrap();
        assert!(summary.contains("stood still 2 time(s)"), "{summary}");
    }

    #[test]
    fn watching_only_reports_once_without_nudging() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(false);
        w.beat(t0);
        assert_eq!(
            w.poll(t0 + secs(20)),
            Some(StallEvent::Stalled {
                silent: secs(20),
                nudged: false
            })
        );
        assert_eq!(w.poll(t0 + secs(60)), None);
        assert_eq!(
            w.beat(t0 + secs(70)),
            Some(StallEvent::Resumed {
                lasted: secs(70),
                nudges: 0
            })
        );
        assert_eq!((w.stalls, w.ended_by_nudge), (1, 0));
    }
}

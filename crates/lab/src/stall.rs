//! Telling a lab machine that stood still from a slow one, and nudging it.
//!
//! Init writes a heartbeat line to the status port every 2 s. Now
//! and then the whole machine stops for minutes (its one CPU inside a nested
//! guest with its own timer interrupt pending, see the README); nothing
//! inside the machine can end that, so the host watches the beats and, when
//! they stop, nudges the emulator from outside: first `stop` and `cont` on
//! QEMU's monitor (the vCPU threads leave and re-enter their execution loop
//! and re-check pending interrupts), then an NMI (taken where a maskable
//! interrupt is not). Each stall is reported with its length and what ended it.
//! The nudges are off by default: in the first livelock they met, the lab's
//! kernel took both NMIs ("NMI received for unknown reason") and went on
//! standing still, and two stop/cont did not end it either.

use std::time::{Duration, Instant};

/// The heartbeat line on the status port.
pub const BEAT: &str = "SANDFORK-BEAT";
/// No beat for this long is a stall: a busy lab stretches a 2 s sleep to 3 s.
const STALL_AFTER: Duration = Duration::from_secs(15);
/// How long a nudge gets before the next one.
const KICK_GRACE: Duration = Duration::from_secs(5);
const NMI_GRACE: Duration = Duration::from_secs(30);

/// What to do to a machine that stands still.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nudge {
    /// `stop` and `cont`: the emulator re-enters its vCPU loops.
    Kick,
    /// A non-maskable interrupt to every CPU of the machine.
    Nmi,
}

impl Nudge {
    pub fn monitor_commands(self) -> &'static [&'static str] {
        match self {
            Nudge::Kick => &["stop", "cont"],
            Nudge::Nmi => &["nmi"],
        }
    }

    fn name(self) -> &'static str {
        match self {
            Nudge::Kick => "stop/cont",
            Nudge::Nmi => "NMI",
        }
    }
}

/// Something worth a line on the runner's stderr.
#[derive(Debug, Clone, PartialEq)]
pub enum StallEvent {
    /// No beat for `silent`; `nudge` is sent now (None: only watching).
    Stalled {
        silent: Duration,
        nudge: Option<Nudge>,
    },
    /// Beats again after `lasted`, the last nudge before it being `after`.
    Resumed {
        lasted: Duration,
        after: Option<Nudge>,
    },
}

impl std::fmt::Display for StallEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StallEvent::Stalled { silent, nudge } => {
                write!(
                    f,
                    "sandfork-lab: no heartbeat from the machine for {:.1} s",
                    silent.as_secs_f64()
                )?;
                match nudge {
                    Some(n) => write!(f, ": nudging the emulator ({})", n.name()),
                    None => write!(f, " (not nudging)"),
                }
            }
            StallEvent::Resumed { lasted, after } => {
                write!(
                    f,
                    "sandfork-lab: the machine beats again after {:.1} s",
                    lasted.as_secs_f64()
                )?;
                match after {
                    Some(n) => write!(f, ", {} before it", n.name()),
                    None => write!(f, ", without a nudge"),
                }
            }
        }
    }
}

/// Heartbeat bookkeeping for one machine: fed beats and the time, says
/// when to nudge.
#[derive(Debug)]
pub struct StallWatch {
    nudge: bool,
    last_beat: Option<Instant>,
    /// The last nudge sent in the current stall, and when.
    sent: Option<(Nudge, Instant)>,
    stalled: bool,
    /// Stalls seen, and those that ended after a kick or after an NMI.
    pub stalls: u32,
    pub ended_by_kick: u32,
    pub ended_by_nmi: u32,
}

impl StallWatch {
    /// `nudge`: false only watches and reports.
    pub fn new(nudge: bool) -> StallWatch {
        StallWatch {
            nudge,
            last_beat: None,
            sent: None,
            stalled: false,
            stalls: 0,
            ended_by_kick: 0,
            ended_by_nmi: 0,
        }
    }

    pub fn beat(&mut self, now: Instant) -> Option<StallEvent> {
        let previous = self.last_beat.replace(now);
        if !self.stalled {
            return None;
        }
        self.stalled = false;
        let after = self.sent.take().map(|(n, _)| n);
        match after {
            Some(Nudge::Kick) => self.ended_by_kick += 1,
            Some(Nudge::Nmi) => self.ended_by_nmi += 1,
            None => {}
        }
        Some(StallEvent::Resumed {
            lasted: previous.map_or(Duration::ZERO, |p| now.duration_since(p)),
            after,
        })
    }

    /// What to do now: nothing until the first beat (the machine is still
    /// booting), then a nudge at the start of a stall and further ones
    /// while it lasts.
    pub fn poll(&mut self, now: Instant) -> Option<StallEvent> {
        let silent = now.duration_since(self.last_beat?);
        if silent < STALL_AFTER {
            return None;
        }
        if !self.stalled {
            self.stalled = true;
            self.stalls += 1;
            let nudge = self.nudge.then_some(Nudge::Kick);
            self.sent = nudge.map(|n| (n, now));
            return Some(StallEvent::Stalled { silent, nudge });
        }
        let (last, at) = self.sent?;
        let next = match last {
            Nudge::Kick if now.duration_since(at) >= KICK_GRACE => Nudge::Nmi,
            Nudge::Nmi if now.duration_since(at) >= NMI_GRACE => Nudge::Kick,
            _ => return None,
        };
        self.sent = Some((next, now));
        Some(StallEvent::Stalled {
            silent,
            nudge: Some(next),
        })
    }

    /// One line for the end of the run, or None when nothing stood still.
    pub fn summary(&self) -> Option<String> {
        (self.stalls > 0).then(|| {
            format!(
                "sandfork-lab: the machine stood still {} time(s); beats resumed after stop/cont {}, after an NMI {}",
                self.stalls, self.ended_by_kick, self.ended_by_nmi
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
        for s in (102..200).step_by(2) {
            assert_eq!(w.beat(t0 + secs(s)), None);
            assert_eq!(w.poll(t0 + secs(s + 1)), None);
        }
        assert_eq!(w.summary(), None);
    }

    #[test]
    fn a_stall_is_kicked_then_given_an_nmi_and_its_end_is_counted() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(true);
        w.beat(t0);
        assert_eq!(w.poll(t0 + secs(14)), None);
        assert_eq!(
            w.poll(t0 + secs(15)),
            Some(StallEvent::Stalled {
                silent: secs(15),
                nudge: Some(Nudge::Kick)
            })
        );
        assert_eq!(w.poll(t0 + secs(16)), None);
        assert_eq!(
            w.poll(t0 + secs(20)),
            Some(StallEvent::Stalled {
                silent: secs(20),
                nudge: Some(Nudge::Nmi)
            })
        );
        assert_eq!(w.poll(t0 + secs(30)), None);
        assert_eq!(
            w.beat(t0 + secs(31)),
            Some(StallEvent::Resumed {
                lasted: secs(31),
                after: Some(Nudge::Nmi)
            })
        );
        assert_eq!((w.stalls, w.ended_by_kick, w.ended_by_nmi), (1, 0, 1));
        // A second stall, ended by the kick.
        w.poll(t0 + secs(50));
        w.beat(t0 + secs(51));
        assert_eq!((w.stalls, w.ended_by_kick, w.ended_by_nmi), (2, 1, 1));
        assert!(w.summary().unwrap().contains("2 time(s)"));
    }

    #[test]
    fn a_long_stall_gets_kicks_and_nmis_in_turn() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(true);
        w.beat(t0);
        let nudges: Vec<Nudge> = (15..120)
            .filter_map(|s| match w.poll(t0 + secs(s)) {
                Some(StallEvent::Stalled { nudge, .. }) => nudge,
                _ => None,
            })
            .collect();
        assert_eq!(
            nudges,
            [
                Nudge::Kick,
                Nudge::Nmi,
                Nudge::Kick,
                Nudge::Nmi,
                Nudge::Kick,
                Nudge::Nmi
            ]
        );
    }

    #[test]
    fn watching_only_reports_without_nudging() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(false);
        w.beat(t0);
        assert_eq!(
            w.poll(t0 + secs(20)),
            Some(StallEvent::Stalled {
                silent: secs(20),
                nudge: None
            })
        );
        assert_eq!(w.poll(t0 + secs(60)), None);
        assert_eq!(
            w.beat(t0 + secs(70)),
            Some(StallEvent::Resumed {
                lasted: secs(70),
                after: None
            })
        );
        assert_eq!((w.stalls, w.ended_by_kick, w.ended_by_nmi), (1, 0, 0));
    }
}

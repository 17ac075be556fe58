//! What the node watches of each sandbox: metrics sampled from its agent's
//! `GET /metrics` and its guest console (kernel lines and the agent's log,
//! `sandfork-agent: ...`), stamped with the time the node read them. Kept in
//! memory, bounded, for `GET /sandboxes/{id}/metrics` and the logs routes,
//! and written through to the sandbox's [`History`] on disk, which a
//! restarted node reads back (see [`super::history`]).

use std::collections::VecDeque;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use vmm_driver::agent_client::AgentMetrics;

use super::Manager;
use super::history::{ConsolePosition, History};
use super::live::Sandbox;
use crate::node::clock::now_ms;

/// How often running sandboxes are sampled.
const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// An agent that does not answer this fast is skipped this round.
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(3);
/// Samples kept per sandbox (an hour at [`SAMPLE_EVERY`]).
const MAX_SAMPLES: usize = 720;
const MAX_LINES: usize = 10_000;
/// Longer console lines are cut.
const MAX_LINE: usize = 4096;
/// Console bytes read per look, so a flood cannot stall the node.
const MAX_READ: u64 = 1 << 20;
const AGENT_PREFIX: &str = "sandfork-agent:";
/// A guest whose agent has answered none of this many probes in a row,
/// over at least [`STUCK_AFTER`], is unresponsive (a slow guest, such as
/// one of many in the emulated lab, still answers within that).
const STUCK_PROBES: u32 = 4;
pub const STUCK_AFTER: Duration = Duration::from_secs(60);
/// A probe the agent missed counts as answered when the guest answered a
/// proxied request (or sent a part of one's answer) this recently.
const HEARD_RECENTLY: Duration = Duration::from_secs(15);

#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub at_ms: u64,
    pub metrics: AgentMetrics,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Debug => "debug",
            Level::Info => "info",
            Level::Warn => "warn",
            Level::Error => "error",
        }
    }

    pub fn parse(s: &str) -> Option<Level> {
        Some(match s {
            "debug" => Level::Debug,
            "info" => Level::Info,
            "warn" => Level::Warn,
            "error" => Level::Error,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    pub at_ms: u64,
    pub level: Level,
    /// `agent` for the guest agent's own log, `console` for the rest.
    pub source: &'static str,
    pub message: String,
}

/// Classifies one console line: the agent's log lines carry its prefix and,
/// below info, their level (see the agent's `console_log`).
pub fn classify(line: &str, at_ms: u64) -> LogLine {
    let Some(rest) = line.strip_prefix(AGENT_PREFIX) else {
        return LogLine {
            at_ms,
            level: Level::Info,
            source: "console",
            message: line.to_owned(),
        };
    };
    let rest = rest.trim_start();
    let (level, message) = [
        ("error: ", Level::Error),
        ("warn: ", Level::Warn),
        ("debug: ", Level::Debug),
        ("trace: ", Level::Debug),
    ]
    .iter()
    .find_map(|(p, l)| rest.strip_prefix(p).map(|m| (*l, m)))
    .unwrap_or((Level::Info, rest));
    LogLine {
        at_ms,
        level,
        source: "agent",
        message: message.to_owned(),
    }
}

/// One sandbox's history.
#[derive(Debug, Default)]
pub struct Observed {
    pub samples: VecDeque<Sample>,
    pub lines: VecDeque<LogLine>,
    /// The console file being followed (a resume starts a new one) and how
    /// far it was read; an unfinished last line waits in `partial`.
    console: Option<PathBuf>,
    offset: u64,
    partial: Vec<u8>,
    /// Probes of its agent that failed in a row, since the first of them.
    failures: u32,
    failing_since_ms: Option<u64>,
    stuck: bool,
    /// Where what is observed is written through; None before
    /// [`Observed::open`] and after [`Observed::close`].
    history: Option<History>,
    opened: bool,
    closed: bool,
    /// The last write to the history failed (said once until one works).
    write_failed: bool,
}

/// What one probe of a guest's agent changed.
#[derive(Debug, PartialEq, Eq)]
pub enum HealthChange {
    Same,
    /// It has not answered for `silent_ms`: now unresponsive.
    Stuck {
        silent_ms: u64,
    },
    /// Unresponsive until this answer.
    Recovered,
}

impl Observed {
    /// Counts one probe of the agent at `at_ms`.
    pub fn probed(&mut self, answered: bool, at_ms: u64) -> HealthChange {
        if answered {
            self.failures = 0;
            self.failing_since_ms = None;
            return match std::mem::take(&mut self.stuck) {
                true => HealthChange::Recovered,
                false => HealthChange::Same,
            };
        }
        let since = *self.failing_since_ms.get_or_insert(at_ms);
        self.failures += 1;
        let silent_ms = at_ms.saturating_sub(since);
        if !self.stuck
            && self.failures >= STUCK_PROBES
            && silent_ms >= STUCK_AFTER.as_millis() as u64
        {
            self.stuck = true;
            return HealthChange::Stuck { silent_ms };
        }
        HealthChange::Same
    }

    /// Reads what `history` kept (once) and writes through to it from now
    /// on; nothing once closed.
    pub fn open(&mut self, history: impl FnOnce() -> History) {
        if self.opened || self.closed {
            return;
        }
        self.opened = true;
        let history = history();
        let loaded = history.load();
        // Whatever was observed before the open is newer than the history.
        let samples: Vec<Sample> = std::mem::take(&mut self.samples).into();
        let lines: Vec<LogLine> = std::mem::take(&mut self.lines).into();
        for s in loaded.samples.into_iter().chain(samples.iter().cloned()) {
            self.keep_sample(s);
        }
        for l in loaded.lines.into_iter().chain(lines.iter().cloned()) {
            self.keep_line(l);
        }
        if self.console.is_none()
            && let Some(pos) = loaded.console
        {
            self.console = Some(pos.path);
            self.offset = pos.offset;
        }
        self.history = Some(history);
        self.persist(|h| {
            h.append_samples(&samples)?;
            h.append_lines(&lines)
        });
    }

    /// Stops writing through, for good (the sandbox is gone and its
    /// history's directory with it).
    pub fn close(&mut self) {
        self.closed = true;
        self.history = None;
    }

    /// Writes through with `write`; a failure is logged once until a write
    /// works again.
    fn persist(&mut self, write: impl FnOnce(&History) -> std::io::Result<()>) {
        let Some(history) = &self.history else {
            return;
        };
        match write(history) {
            Ok(()) if self.write_failed => {
                self.write_failed = false;
                tracing::info!("{}: writing works again", history.dir().display());
            }
            Ok(()) => {}
            Err(e) if !self.write_failed => {
                self.write_failed = true;
                tracing::warn!(
                    "{}: {e}; this sandbox's logs and metrics are kept in memory only \
                     until a write works",
                    history.dir().display()
                );
            }
            Err(_) => {}
        }
    }

    fn keep_sample(&mut self, sample: Sample) {
        if self.samples.len() == MAX_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
    }

    fn keep_line(&mut self, line: LogLine) {
        if self.lines.len() == MAX_LINES {
            self.lines.pop_front();
        }
        self.lines.push_back(line);
    }

    pub fn push_sample(&mut self, sample: Sample) {
        self.persist(|h| h.append_samples(std::slice::from_ref(&sample)));
        self.keep_sample(sample);
    }

    /// One console line, cut to [`MAX_LINE`]; None for an empty one.
    fn line_of(bytes: &[u8], at_ms: u64) -> Option<LogLine> {
        let mut text = String::from_utf8_lossy(bytes).into_owned();
        if text.ends_with('\r') {
            text.pop();
        }
        if text.is_empty() {
            return None;
        }
        if text.len() > MAX_LINE {
            let mut cut = MAX_LINE;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
        }
        Some(classify(&text, at_ms))
    }

    /// Reads what `console` gained since the last look.
    pub fn follow(&mut self, console: &Path, at_ms: u64) {
        if self.console.as_deref() != Some(console) {
            self.console = Some(console.to_owned());
            self.offset = 0;
            self.partial.clear();
        }
        let Ok(mut file) = std::fs::File::open(console) else {
            return;
        };
        if file.seek(SeekFrom::Start(self.offset)).is_err() {
            return;
        }
        let mut buf = Vec::new();
        let Ok(n) = file.take(MAX_READ).read_to_end(&mut buf) else {
            return;
        };
        if n == 0 {
            return;
        }
        self.offset += n as u64;
        self.partial.extend_from_slice(&buf);
        let mut start = 0;
        let pending = std::mem::take(&mut self.partial);
        let mut new = Vec::new();
        for (i, b) in pending.iter().enumerate() {
            if *b == b'\n' {
                new.extend(Self::line_of(&pending[start..i], at_ms));
                start = i + 1;
            }
        }
        let rest = &pending[start..];
        if rest.len() >= MAX_LINE {
            new.extend(Self::line_of(rest, at_ms));
        } else {
            self.partial = rest.to_vec();
        }
        // The unfinished line is read again after a restart.
        let position = ConsolePosition {
            path: console.to_owned(),
            offset: self.offset - self.partial.len() as u64,
        };
        self.persist(|h| {
            h.append_lines(&new)?;
            h.save_console(&position)
        });
        for l in new {
            self.keep_line(l);
        }
    }
}

impl Manager {
    /// Samples every running sandbox every [`SAMPLE_EVERY`].
    pub fn start_observer(self: Arc<Self>) {
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(SAMPLE_EVERY).await;
                let serving: Vec<String> = self
                    .registry()
                    .all()
                    .into_iter()
                    .filter(|s| s.phase().serves())
                    .map(|s| s.id.clone())
                    .collect();
                for id in serving {
                    self.observe(&id).await;
                }
            }
        });
    }

    /// What the node observed of `sandbox`, its history read from disk the
    /// first time.
    pub(super) fn observed<'a>(&self, sandbox: &'a Sandbox) -> std::sync::MutexGuard<'a, Observed> {
        let mut observed = sandbox.observed();
        observed.open(|| History::new(self.config.observe_dir().join(&sandbox.id)));
        observed
    }

    /// Reads a running sandbox's new console lines and one metrics sample.
    pub async fn observe(&self, id: &str) {
        let Some(sandbox) = self.registry().get(id) else {
            return;
        };
        let Some(vmm) = sandbox.probe() else {
            return;
        };
        self.observed(&sandbox)
            .follow(&vmm.console_path(), now_ms());
        let agent = vmm
            .agent()
            .with_access_token(sandbox.token.as_deref())
            .with_timeout(SAMPLE_TIMEOUT);
        // The sample is the health probe too.
        let (answered, why) = match agent.metrics().await {
            Ok(metrics) => {
                self.observed(&sandbox).push_sample(Sample {
                    at_ms: now_ms(),
                    metrics,
                });
                (true, String::new())
            }
            Err(e) => {
                tracing::debug!("sandbox {id}: metrics: {e}");
                (false, e.to_string())
            }
        };
        // A change under way (a pause, a kill) may have stopped the guest.
        if !sandbox.phase().serves() {
            return;
        }
        // A guest busy answering proxied requests (its first commands on a
        // loaded node) may miss the probe's bound while it answers them.
        let now = now_ms();
        let heard =
            now.saturating_sub(sandbox.last_heard_ms()) <= HEARD_RECENTLY.as_millis() as u64;
        let change = sandbox.observed().probed(answered || heard, now);
        match change {
            HealthChange::Same => {}
            HealthChange::Stuck { silent_ms } => {
                tracing::warn!(
                    "sandbox {id}: its guest agent has not answered for {} s ({why}): \
                     unresponsive; requests to it fail until it answers again \
                     (GET /v1/sandboxes/{id}/diagnostics shows its VMM)",
                    silent_ms / 1000
                );
                sandbox.set_unresponsive(true);
            }
            HealthChange::Recovered => {
                tracing::info!("sandbox {id}: its guest agent answers again");
                sandbox.set_unresponsive(false);
            }
        }
    }

    /// Whether sandbox `id`'s guest has stopped answering (see [`STUCK_AFTER`]).
    pub fn unresponsive(&self, id: &str) -> bool {
        self.registry().get(id).is_some_and(|s| s.unresponsive())
    }

    /// Follows whether sandbox `id`'s guest has stopped answering.
    pub fn unresponsive_watch(&self, id: &str) -> Option<tokio::sync::watch::Receiver<bool>> {
        Some(self.registry().get(id)?.unresponsive_watch())
    }

    /// What a running sandbox's VMM looks like now (console and VMM log
    /// tails, vCPUs, threads, the host kernel's messages), for a sandbox
    /// that stopped answering; None when no VMM of it runs here.
    pub async fn diagnostics(&self, id: &str) -> Option<String> {
        let vmm = self.registry().get(id)?.probe()?;
        Some(vmm.diagnostics().await)
    }

    /// Samples taken from `from_ms` to `to_ms`, oldest first.
    pub fn samples(&self, id: &str, from_ms: u64, to_ms: u64) -> Vec<Sample> {
        self.sandbox(id).map_or_else(
            |_| Vec::new(),
            |s| {
                self.observed(&s)
                    .samples
                    .iter()
                    .filter(|s| (from_ms..=to_ms).contains(&s.at_ms))
                    .cloned()
                    .collect()
            },
        )
    }

    /// The console lines kept for `id`, oldest first.
    pub fn log_lines(&self, id: &str) -> Vec<LogLine> {
        self.sandbox(id).map_or_else(
            |_| Vec::new(),
            |s| self.observed(&s).lines.iter().cloned().collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_lines_are_told_from_console_lines_with_their_level() {
        let l = classify("sandfork-agent: warn: disk almost full", 5);
        assert_eq!(
            (l.level, l.source, l.message.as_str(), l.at_ms),
            (Level::Warn, "agent", "disk almost full", 5)
        );
        let l = classify("sandfork-agent: serving envd", 5);
        assert_eq!((l.level, l.source), (Level::Info, "agent"));
        assert_eq!(l.message, "serving envd");
        let l = classify("[    0.1] Linux version 6.1", 5);
        assert_eq!((l.level, l.source), (Level::Info, "console"));
        assert_eq!(Level::parse("error"), Some(Level::Error));
        assert_eq!(Level::parse("loud"), None);
        assert!(Level::Warn > Level::Info);
    }

    #[test]
    fn the_console_is_followed_line_by_line_across_files() {
        let dir = tempfile::tempdir().unwrap();
        let first = dir.path().join("a.log");
        std::fs::write(&first, "one\ntw").unwrap();
        let mut o = Observed::default();
        o.follow(&first, 1);
        assert_eq!(o.lines.len(), 1);
        std::fs::write(&first, "one\ntwo\r\n\nthree\n").unwrap();
        o.follow(&first, 2);
        let got: Vec<(&str, u64)> = o
            .lines
            .iter()
            .map(|l| (l.message.as_str(), l.at_ms))
            .collect();
        assert_eq!(got, [("one", 1), ("two", 2), ("three", 2)]);
        // A resumed sandbox writes a new console from its start.
        let second = dir.path().join("b.log");
        std::fs::write(&second, "four\n").unwrap();
        o.follow(&second, 3);
        assert_eq!(o.lines.back().unwrap().message, "four");
        assert_eq!(o.lines.len(), 4);
        o.follow(&dir.path().join("missing.log"), 4);
        assert_eq!(o.lines.len(), 4);
    }

    #[test]
    fn what_was_observed_is_read_back_by_the_next_process_and_not_read_twice() {
        let dir = tempfile::tempdir().unwrap();
        let console = dir.path().join("console.log");
        let history = || History::new(dir.path().join("observe/sb"));
        let sample = |at_ms| Sample {
            at_ms,
            metrics: AgentMetrics {
                cpu_count: 1,
                mem_total: 100,
                ..Default::default()
            },
        };
        std::fs::write(&console, "boot\nsandfork-agent: warn: low\nhalf").unwrap();
        let mut before = Observed::default();
        before.push_sample(sample(1));
        before.open(history);
        before.follow(&console, 2);
        before.push_sample(sample(3));
        assert_eq!(before.lines.len(), 2);

        // The next process: the same history, the console grown meanwhile.
        std::fs::write(
            &console,
            "boot\nsandfork-agent: warn: low\nhalf a line\nafter\n",
        )
        .unwrap();
        let mut after = Observed::default();
        after.open(history);
        after.open(|| panic!("opened once"));
        assert_eq!(
            after.samples.iter().map(|s| s.at_ms).collect::<Vec<_>>(),
            [1, 3]
        );
        after.follow(&console, 4);
        let got: Vec<(&str, &str, Level, u64)> = after
            .lines
            .iter()
            .map(|l| (l.message.as_str(), l.source, l.level, l.at_ms))
            .collect();
        assert_eq!(
            got,
            [
                ("boot", "console", Level::Info, 2),
                ("low", "agent", Level::Warn, 2),
                ("half a line", "console", Level::Info, 4),
                ("after", "console", Level::Info, 4),
            ]
        );
        // Closed: nothing more is written, and it is not opened again.
        after.close();
        after.push_sample(sample(5));
        let mut again = Observed::default();
        again.open(history);
        assert_eq!(again.samples.len(), 2);
        again.close();
        again.open(|| panic!("closed"));
    }

    #[test]
    fn a_guest_is_unresponsive_after_probes_fail_long_enough() {
        let mut o = Observed::default();
        let after = STUCK_AFTER.as_millis() as u64;
        assert_eq!(o.probed(true, 0), HealthChange::Same);
        // Many failures in a short time: slow, not stuck.
        for t in 0..10 {
            assert_eq!(o.probed(false, 1000 + t), HealthChange::Same);
        }
        // A long silence of few probes: not yet.
        let mut o = Observed::default();
        assert_eq!(o.probed(false, 0), HealthChange::Same);
        assert_eq!(o.probed(false, after), HealthChange::Same);
        assert_eq!(o.probed(false, after + 1), HealthChange::Same);
        assert_eq!(
            o.probed(false, after + 2),
            HealthChange::Stuck {
                silent_ms: after + 2
            }
        );
        // Said once; then its first answer clears it, and counting restarts.
        assert_eq!(o.probed(false, after * 3), HealthChange::Same);
        assert_eq!(o.probed(true, after * 3), HealthChange::Recovered);
        assert_eq!(o.probed(true, after * 3), HealthChange::Same);
        for t in 0..u64::from(STUCK_PROBES) {
            assert_eq!(o.probed(false, after * 4 + t), HealthChange::Same);
        }
    }

    #[test]
    fn history_is_bounded() {
        let mut o = Observed::default();
        for i in 0..MAX_SAMPLES + 5 {
            o.push_sample(Sample {
                at_ms: i as u64,
                metrics: AgentMetrics::default(),
            });
        }
        assert_eq!(o.samples.len(), MAX_SAMPLES);
        assert_eq!(o.samples.front().unwrap().at_ms, 5);
        let long = "x".repeat(MAX_LINE * 2);
        let cut = Observed::line_of(long.as_bytes(), 0).unwrap();
        assert_eq!(cut.message.len(), MAX_LINE);
        assert_eq!(Observed::line_of(b"\r", 0), None);
        for i in 0..MAX_LINES + 3 {
            o.keep_line(classify("l", i as u64));
        }
        assert_eq!(o.lines.len(), MAX_LINES);
        assert_eq!(o.lines.front().unwrap().at_ms, 3);
    }
}

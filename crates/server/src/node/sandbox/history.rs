//! What the node observed of a sandbox, on disk, so that a restart of the
//! node keeps it: `<data dir>/observe/<id>/` holds `metrics.jsonl` and
//! `logs.jsonl` (one JSON object a line, appended as the observer reads
//! them) and `console.json` (which console file was being followed and how
//! far, so an adopted sandbox's console is not read twice).
//!
//! Bounded: each of the two streams is a current segment and the one
//! before it (`*.jsonl.1`); a segment that reaches its size
//! ([`LOG_SEGMENT`], [`METRICS_SEGMENT`]) becomes the one before, dropping
//! the older. So a sandbox holds at most 2 × (1 MiB + 128 KiB) plus one
//! record of each (a log line is at most 4 KiB) and the position file:
//! about 2.3 MiB. The directory goes with the sandbox's record (a kill, a
//! sandbox whose VMM died; the garbage collector removes any left by a
//! crash).
//!
//! Not synced: what the host's page cache holds survives a crash of the
//! node; a host crash may lose the last seconds, and a torn last record is
//! cut off when the stream is next read.

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vmm_driver::agent_client::AgentMetrics;

use super::observe::{Level, LogLine, Sample};

/// Bytes of log lines in one segment (two are kept).
pub const LOG_SEGMENT: u64 = 1 << 20;
/// Bytes of metrics samples in one segment (two are kept): each is about
/// 200 bytes, so a segment holds over 600 samples, 50 minutes at the
/// observer's pace, and the two more than the hour kept in memory.
pub const METRICS_SEGMENT: u64 = 128 << 10;

const METRICS: &str = "metrics.jsonl";
const LOGS: &str = "logs.jsonl";
const CONSOLE: &str = "console.json";

/// One sample as stored.
#[derive(Debug, Serialize, Deserialize)]
struct StoredSample {
    at_ms: u64,
    ts: i64,
    cpu_count: u32,
    cpu_used_pct: f32,
    mem_total: u64,
    mem_used: u64,
    mem_cache: u64,
    disk_used: u64,
    disk_total: u64,
}

impl From<&Sample> for StoredSample {
    fn from(s: &Sample) -> Self {
        let m = &s.metrics;
        StoredSample {
            at_ms: s.at_ms,
            ts: m.ts,
            cpu_count: m.cpu_count,
            cpu_used_pct: m.cpu_used_pct,
            mem_total: m.mem_total,
            mem_used: m.mem_used,
            mem_cache: m.mem_cache,
            disk_used: m.disk_used,
            disk_total: m.disk_total,
        }
    }
}

impl From<StoredSample> for Sample {
    fn from(s: StoredSample) -> Self {
        Sample {
            at_ms: s.at_ms,
            metrics: AgentMetrics {
                ts: s.ts,
                cpu_count: s.cpu_count,
                cpu_used_pct: s.cpu_used_pct,
                mem_total: s.mem_total,
                mem_used: s.mem_used,
                mem_cache: s.mem_cache,
                disk_used: s.disk_used,
                disk_total: s.disk_total,
            },
        }
    }
}

/// One log line as stored.
#[derive(Debug, Serialize, Deserialize)]
struct StoredLine {
    at_ms: u64,
    level: String,
    source: String,
    message: String,
}

impl From<&LogLine> for StoredLine {
    fn from(l: &LogLine) -> Self {
        StoredLine {
            at_ms: l.at_ms,
            level: l.level.as_str().to_owned(),
            source: l.source.to_owned(),
            message: l.message.clone(),
        }
    }
}

impl StoredLine {
    fn into_line(self) -> Option<LogLine> {
        Some(LogLine {
            at_ms: self.at_ms,
            level: Level::parse(&self.level)?,
            source: if self.source == "agent" {
                "agent"
            } else {
                "console"
            },
            message: self.message,
        })
    }
}

/// The console file followed and the offset of the first byte not yet
/// taken as a whole line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsolePosition {
    pub path: PathBuf,
    pub offset: u64,
}

/// What [`History::load`] found.
#[derive(Debug, Default)]
pub struct Loaded {
    pub samples: Vec<Sample>,
    pub lines: Vec<LogLine>,
    pub console: Option<ConsolePosition>,
}

/// One sandbox's directory of history.
#[derive(Debug, Clone)]
pub struct History {
    dir: PathBuf,
}

impl History {
    pub fn new(dir: PathBuf) -> History {
        History { dir }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Everything kept, oldest first; a torn last record (a crash in the
    /// middle of a write) is cut off so that later appends start clean.
    pub fn load(&self) -> Loaded {
        Loaded {
            samples: self
                .read(METRICS)
                .filter_map(|l| serde_json::from_str::<StoredSample>(&l).ok())
                .map(Sample::from)
                .collect(),
            lines: self
                .read(LOGS)
                .filter_map(|l| serde_json::from_str::<StoredLine>(&l).ok())
                .filter_map(StoredLine::into_line)
                .collect(),
            console: std::fs::read(self.dir.join(CONSOLE))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok()),
        }
    }

    /// The lines of a stream's older segment, then of its current one.
    fn read(&self, stream: &str) -> impl Iterator<Item = String> {
        let current = self.dir.join(stream);
        cut_torn_tail(&current);
        [older(&current), current]
            .into_iter()
            .filter_map(|p| File::open(p).ok())
            .flat_map(|f| BufReader::new(f).lines().map_while(Result::ok))
    }

    pub fn append_samples(&self, samples: &[Sample]) -> io::Result<()> {
        let records = samples.iter().map(StoredSample::from);
        self.append(METRICS, METRICS_SEGMENT, records)
    }

    pub fn append_lines(&self, lines: &[LogLine]) -> io::Result<()> {
        let records = lines.iter().map(StoredLine::from);
        self.append(LOGS, LOG_SEGMENT, records)
    }

    /// Records `position` (replacing the last one whole).
    pub fn save_console(&self, position: &ConsolePosition) -> io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let tmp = self.dir.join(format!("{CONSOLE}.tmp"));
        std::fs::write(&tmp, serde_json::to_vec(position)?)?;
        std::fs::rename(&tmp, self.dir.join(CONSOLE))
    }

    /// Appends `records` to `stream`, first making its current segment the
    /// older one when it has reached `segment` bytes.
    fn append<T: Serialize>(
        &self,
        stream: &str,
        segment: u64,
        records: impl Iterator<Item = T>,
    ) -> io::Result<()> {
        let mut buf = Vec::new();
        for r in records {
            serde_json::to_writer(&mut buf, &r)?;
            buf.push(b'\n');
        }
        if buf.is_empty() {
            return Ok(());
        }
        std::fs::create_dir_all(&self.dir)?;
        let current = self.dir.join(stream);
        if std::fs::metadata(&current).is_ok_and(|m| m.len() >= segment) {
            std::fs::rename(&current, older(&current))?;
        }
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&current)?
            .write_all(&buf)
    }
}

fn older(current: &Path) -> PathBuf {
    let mut name = current.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// Truncates `path` after its last newline (nothing when it ends with one
/// or does not exist).
fn cut_torn_tail(path: &Path) {
    let Ok(bytes) = std::fs::read(path) else {
        return;
    };
    if bytes.last().is_none_or(|b| *b == b'\n') {
        return;
    }
    let keep = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    if let Ok(f) = OpenOptions::new().write(true).open(path) {
        let _ = f.set_len(keep as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at_ms: u64) -> Sample {
        Sample {
            at_ms,
            metrics: AgentMetrics {
                ts: 7,
                cpu_count: 2,
                cpu_used_pct: 12.5,
                mem_total: 1 << 30,
                mem_used: 1 << 20,
                mem_cache: 3,
                disk_used: 4,
                disk_total: 5,
            },
        }
    }

    fn line(at_ms: u64, message: &str) -> LogLine {
        LogLine {
            at_ms,
            level: Level::Warn,
            source: "agent",
            message: message.into(),
        }
    }

    fn size(dir: &Path) -> u64 {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.metadata().unwrap().len())
            .sum()
    }

    #[test]
    fn what_is_appended_is_loaded_back_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let h = History::new(dir.path().join("sb"));
        let empty = h.load();
        assert!(empty.samples.is_empty() && empty.lines.is_empty() && empty.console.is_none());
        h.append_samples(&[sample(1), sample(2)]).unwrap();
        h.append_samples(&[sample(3)]).unwrap();
        h.append_lines(&[line(1, "a"), line(2, "b \"quoted\"\nwith a newline")])
            .unwrap();
        h.append_lines(&[]).unwrap();
        let pos = ConsolePosition {
            path: "/run/x/console.log".into(),
            offset: 42,
        };
        h.save_console(&pos).unwrap();
        let got = h.load();
        assert_eq!(got.samples, [sample(1), sample(2), sample(3)]);
        assert_eq!(
            got.lines,
            [line(1, "a"), line(2, "b \"quoted\"\nwith a newline")]
        );
        assert_eq!(got.console, Some(pos));
    }

    #[test]
    fn a_torn_last_record_is_cut_and_later_ones_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let h = History::new(dir.path().to_owned());
        h.append_lines(&[line(1, "whole")]).unwrap();
        let mut f = OpenOptions::new()
            .append(true)
            .open(dir.path().join(LOGS))
            .unwrap();
        f.write_all(br#"{"at_ms":2,"level":"in"#).unwrap();
        std::fs::write(dir.path().join(CONSOLE), "{not json").unwrap();
        let got = h.load();
        assert_eq!(got.lines, [line(1, "whole")]);
        assert_eq!(got.console, None);
        h.append_lines(&[line(3, "after")]).unwrap();
        assert_eq!(h.load().lines, [line(1, "whole"), line(3, "after")]);
        // A level this version does not know is skipped, not an error.
        std::fs::write(
            dir.path().join(LOGS),
            "{\"at_ms\":1,\"level\":\"loud\",\"source\":\"x\",\"message\":\"m\"}\n",
        )
        .unwrap();
        assert!(h.load().lines.is_empty());
    }

    #[test]
    fn each_stream_keeps_two_segments_at_most() {
        let dir = tempfile::tempdir().unwrap();
        let h = History::new(dir.path().to_owned());
        let big = "x".repeat(4000);
        let per_segment = LOG_SEGMENT as usize / 4000;
        let total = per_segment * 5;
        for i in 0..total {
            h.append_lines(&[line(i as u64, &big)]).unwrap();
        }
        for i in 0..per_segment * 20 {
            h.append_samples(&[sample(i as u64)]).unwrap();
        }
        let got = h.load();
        // The newest are kept, in order, and at least one whole segment.
        assert_eq!(got.lines.last().unwrap().at_ms, total as u64 - 1);
        assert!(got.lines.len() > per_segment && got.lines.len() <= 2 * per_segment + 2);
        assert!(got.lines.windows(2).all(|w| w[0].at_ms + 1 == w[1].at_ms));
        assert!(got.samples.len() > 600, "{}", got.samples.len());
        let bound = 2 * (LOG_SEGMENT + METRICS_SEGMENT) + 2 * 4200;
        assert!(size(dir.path()) <= bound, "{} > {bound}", size(dir.path()));
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().into_string().unwrap())
            .collect();
        assert_eq!(names.len(), 4, "{names:?}");
    }
}

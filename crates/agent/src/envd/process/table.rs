//! The processes the service started: running ones by pid (and tag), and
//! recently exited ones, kept so that a late `Connect` still gets their end.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envd_proto::ConnectError;
use envd_proto::process::{EndEvent, ProcessConfig, ProcessInfo, ProcessSelector};
use tokio::net::unix::pipe;
use tokio::sync::watch;

use super::output::Fanout;
use super::pty::Master;

/// How long, and how many, exited processes are kept.
pub const EXITED_TTL: Duration = Duration::from_secs(60);
pub const EXITED_MAX: usize = 128;

/// One started process.
pub struct Proc {
    pub pid: u32,
    pub tag: Option<String>,
    /// As the request gave it (List reports it back).
    pub config: ProcessConfig,
    pub output: Fanout,
    /// Set once, when the process has exited and its output is drained.
    pub end: watch::Sender<Option<EndEvent>>,
    /// The stdin pipe; None without one or after CloseStdin.
    pub stdin: tokio::sync::Mutex<Option<pipe::Sender>>,
    /// Whether the process was started with a stdin pipe.
    pub has_stdin: bool,
    pub pty: Option<Master>,
    /// The `connect-timeout-ms` lifetime of `Start` ran out and killed it.
    pub killed_by_deadline: AtomicBool,
    /// The process has exited (its output may still be draining): List no
    /// longer shows it, as envd does not.
    pub exited: AtomicBool,
}

impl Proc {
    pub fn new(
        pid: u32,
        tag: Option<String>,
        config: ProcessConfig,
        stdin: Option<pipe::Sender>,
        pty: Option<Master>,
    ) -> Self {
        Self {
            pid,
            tag,
            config,
            output: Fanout::new(pid),
            end: watch::channel(None).0,
            has_stdin: stdin.is_some(),
            stdin: tokio::sync::Mutex::new(stdin),
            pty,
            killed_by_deadline: AtomicBool::new(false),
            exited: AtomicBool::new(false),
        }
    }

    pub fn info(&self) -> ProcessInfo {
        ProcessInfo {
            config: self.config.clone(),
            pid: self.pid,
            tag: self.tag.clone(),
        }
    }

    pub fn has_exited(&self) -> bool {
        self.end.borrow().is_some()
    }
}

#[derive(Default)]
struct Tables {
    live: HashMap<u32, Arc<Proc>>,
    exited: VecDeque<(Instant, Arc<Proc>)>,
}

#[derive(Default)]
pub struct ProcessTable {
    inner: Mutex<Tables>,
}

fn not_found(sel: &ProcessSelector) -> ConnectError {
    ConnectError::not_found(format!("{sel} not found"))
}

fn matches(p: &Proc, sel: &ProcessSelector) -> bool {
    match sel {
        ProcessSelector::Pid(pid) => p.pid == *pid,
        ProcessSelector::Tag(tag) => p.tag.as_deref() == Some(tag.as_str()),
    }
}

impl ProcessTable {
    fn lock(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn insert(&self, proc: Arc<Proc>) {
        let mut t = self.lock();
        // A reused pid replaces its exited predecessor.
        t.exited.retain(|(_, p)| p.pid != proc.pid);
        t.live.insert(proc.pid, proc);
    }

    /// Moves a process from the running to the recently exited ones.
    pub fn mark_exited(&self, pid: u32) {
        let mut t = self.lock();
        if let Some(p) = t.live.remove(&pid) {
            t.exited.push_back((Instant::now(), p));
        }
        prune(&mut t);
    }

    /// A running process.
    pub fn find_live(&self, sel: &ProcessSelector) -> Result<Arc<Proc>, ConnectError> {
        let t = self.lock();
        match sel {
            ProcessSelector::Pid(pid) => t.live.get(pid).cloned(),
            ProcessSelector::Tag(_) => t.live.values().find(|p| matches(p, sel)).cloned(),
        }
        .ok_or_else(|| not_found(sel))
    }

    /// A running or recently exited process (running ones first; among
    /// exited ones the latest).
    pub fn find_any(&self, sel: &ProcessSelector) -> Result<Arc<Proc>, ConnectError> {
        if let Ok(p) = self.find_live(sel) {
            return Ok(p);
        }
        let mut t = self.lock();
        prune(&mut t);
        t.exited
            .iter()
            .rev()
            .find(|(_, p)| matches(p, sel))
            .map(|(_, p)| p.clone())
            .ok_or_else(|| not_found(sel))
    }

    /// Running processes, by pid.
    pub fn list(&self) -> Vec<ProcessInfo> {
        let t = self.lock();
        let mut out: Vec<ProcessInfo> = t
            .live
            .values()
            .filter(|p| !p.exited.load(std::sync::atomic::Ordering::Relaxed))
            .map(|p| p.info())
            .collect();
        out.sort_by_key(|p| p.pid);
        out
    }
}

fn prune(t: &mut Tables) {
    let now = Instant::now();
    while let Some((when, _)) = t.exited.front() {
        if now.duration_since(*when) > EXITED_TTL || t.exited.len() > EXITED_MAX {
            t.exited.pop_front();
        } else {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proc(pid: u32, tag: Option<&str>) -> Arc<Proc> {
        Arc::new(Proc::new(
            pid,
            tag.map(String::from),
            ProcessConfig {
                cmd: "x".into(),
                ..Default::default()
            },
            None,
            None,
        ))
    }

    #[test]
    fn live_and_exited_lookup() {
        let t = ProcessTable::default();
        t.insert(proc(10, Some("a")));
        t.insert(proc(11, None));
        assert_eq!(t.list().iter().map(|p| p.pid).collect::<Vec<_>>(), [10, 11]);
        assert_eq!(
            t.find_live(&ProcessSelector::Tag("a".into())).unwrap().pid,
            10
        );
        t.mark_exited(10);
        assert_eq!(t.list().len(), 1);
        let e = t.find_live(&ProcessSelector::Pid(10)).err().unwrap();
        assert_eq!(e.code, envd_proto::Code::NotFound);
        assert_eq!(e.message, "process with pid 10 not found");
        assert_eq!(t.find_any(&ProcessSelector::Pid(10)).unwrap().pid, 10);
        assert_eq!(
            t.find_any(&ProcessSelector::Tag("a".into())).unwrap().pid,
            10
        );
        assert!(t.find_any(&ProcessSelector::Tag("b".into())).is_err());
        // Pid reuse replaces the exited entry.
        t.insert(proc(10, None));
        assert!(t.find_any(&ProcessSelector::Tag("a".into())).is_err());
    }

    #[test]
    fn exited_entries_are_bounded() {
        let t = ProcessTable::default();
        for pid in 0..(EXITED_MAX as u32 + 10) {
            t.insert(proc(pid, None));
            t.mark_exited(pid);
        }
        assert!(t.find_any(&ProcessSelector::Pid(0)).is_err());
        assert!(
            t.find_any(&ProcessSelector::Pid(EXITED_MAX as u32 + 9))
                .is_ok()
        );
        assert_eq!(t.lock().exited.len(), EXITED_MAX);
    }
}

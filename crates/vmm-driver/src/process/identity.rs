//! Who a VMM process is, written next to its sockets so that a later server
//! can find it again: its pid and the kernel's start time for that pid, which
//! together name one process even after the pid is reused.

use std::ffi::OsStr;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::process::{Pid, PidfdFlags, Signal, pidfd_open, pidfd_send_signal};

const FILE: &str = "vmm.pid";

/// One process, named so that a reused pid does not match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessIdentity {
    pub pid: u32,
    /// Field 22 of `/proc/<pid>/stat`: clock ticks after boot.
    pub start_ticks: u64,
}

impl ProcessIdentity {
    /// The identity of `pid` as the kernel sees it now (None when it is gone
    /// or a zombie: a zombie runs nothing and answers nothing).
    pub fn of(pid: u32) -> Option<ProcessIdentity> {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        parse_stat(&stat).and_then(|(state, start_ticks)| {
            (state != 'Z' && state != 'X').then_some(ProcessIdentity { pid, start_ticks })
        })
    }

    /// Whether this very process still runs.
    pub fn is_alive(&self) -> bool {
        ProcessIdentity::of(self.pid) == Some(*self)
    }

    /// SIGKILLs this process if it still runs (never a process that reused its pid).
    pub fn kill(&self) {
        let Some(pid) = i32::try_from(self.pid).ok().and_then(Pid::from_raw) else {
            return;
        };
        // The pidfd names whichever process has the pid now; if that one has
        // our start time after the open, it is ours (a reused pid cannot
        // carry an older start time), and the signal goes to it even if it
        // exits meanwhile and the pid is reused again.
        let Ok(pidfd) = pidfd_open(pid, PidfdFlags::empty()) else {
            return;
        };
        if self.is_alive() {
            let _ = pidfd_send_signal(&pidfd, Signal::KILL);
        }
    }

    /// The live processes started with `arg` among their arguments: a VMM
    /// started with `--api-sock <dir>/api.sock` whose starter crashed before
    /// recording its identity is still found by its socket path.
    pub fn started_with_arg(arg: &OsStr) -> Vec<ProcessIdentity> {
        let Ok(entries) = fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|cmdline| cmdline.split(|b| *b == 0).any(|a| a == arg.as_bytes()))
            })
            .filter_map(ProcessIdentity::of)
            .collect()
    }

    pub(crate) fn write(&self, dir: &Path) -> io::Result<()> {
        let tmp = dir.join(format!("{FILE}.tmp"));
        fs::write(&tmp, format!("{} {}\n", self.pid, self.start_ticks))?;
        fs::rename(tmp, dir.join(FILE))
    }

    /// The identity recorded in `dir`, if any.
    pub fn read(dir: &Path) -> Option<ProcessIdentity> {
        let text = fs::read_to_string(dir.join(FILE)).ok()?;
        let mut words = text.split_whitespace();
        let pid = words.next()?.parse().ok()?;
        let start_ticks = words.next()?.parse().ok()?;
        Some(ProcessIdentity { pid, start_ticks })
    }
}

/// The state letter and start time from a `/proc/<pid>/stat` line. The
/// command name (field 2) may hold spaces and parentheses, so fields are
/// counted from its last `)`.
fn parse_stat(stat: &str) -> Option<(char, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // After the state (field 3) the start time is field 22: 18 more on.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_lines_with_awkward_command_names() {
        let line = "4242 (a) b) (c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 200 18446744073709551615";
        assert_eq!(parse_stat(line), Some(('S', 987654)));
        assert_eq!(parse_stat("4242 (x) Z"), None);
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn names_this_process_and_not_a_reused_pid() {
        let me = ProcessIdentity::of(std::process::id()).expect("this process is alive");
        assert!(me.is_alive());
        let other = ProcessIdentity {
            start_ticks: me.start_ticks + 1,
            ..me
        };
        assert!(!other.is_alive());
    }

    #[test]
    fn round_trips_through_its_file() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(ProcessIdentity::read(dir.path()), None);
        let id = ProcessIdentity {
            pid: 17,
            start_ticks: 99,
        };
        id.write(dir.path()).unwrap();
        assert_eq!(ProcessIdentity::read(dir.path()), Some(id));
        fs::write(dir.path().join(FILE), "17").unwrap();
        assert_eq!(ProcessIdentity::read(dir.path()), None);
    }

    #[test]
    fn finds_a_process_by_an_argument() {
        let marker = format!("/nonexistent/sandfork-test-{}", std::process::id());
        // `$0` is the marker. The shell waits on a pipe by itself: a child it
        // forked (say, `sleep`) would carry the marker too until its exec.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "read -r _", &marker])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let child_id = ProcessIdentity::of(child.id()).unwrap();
        // Until the exec the child's arguments are still this test's.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let found = loop {
            let found = ProcessIdentity::started_with_arg(OsStr::new(&marker));
            if !found.is_empty() || std::time::Instant::now() > deadline {
                break found;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(found, vec![child_id]);
        assert!(
            ProcessIdentity::started_with_arg(OsStr::new("/nonexistent/never-an-argument"))
                .is_empty()
        );
    }

    #[test]
    fn a_killed_child_is_no_longer_alive() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let id = ProcessIdentity::of(child.id()).unwrap();
        id.kill();
        child.wait().unwrap();
        assert!(!id.is_alive());
    }
}

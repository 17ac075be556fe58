//! One sandbox's group: its limits, its member process, its usage, and its
//! removal once the VMM is gone.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::{Error, Limits, Result, io_err};

/// A group under the node's parent. Dropping it does nothing: the owner
/// removes it with [`Group::remove`] once its VMM has exited (a group with
/// a process in it cannot be removed).
#[derive(Debug)]
pub struct Group {
    path: PathBuf,
}

/// What a group's processes use now, as the kernel counts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub memory_bytes: u64,
    pub cpu_usec: u64,
    pub pids: u64,
    /// Times its memory limit had the kernel kill in it (`memory.events`).
    pub oom_kills: u64,
}

impl Group {
    pub(crate) fn new(path: PathBuf) -> Group {
        Group { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its name under the parent.
    pub fn name(&self) -> &str {
        self.path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
    }

    pub(crate) fn set_limits(&self, limits: &Limits, io: bool) -> Result<()> {
        for (file, value) in limits.files(io) {
            let path = self.path.join(file);
            std::fs::write(&path, value).map_err(io_err("writing", &path))?;
        }
        Ok(())
    }

    /// Moves process `pid`, with all its threads, into the group.
    pub fn add_process(&self, pid: u32) -> Result<()> {
        let path = self.path.join("cgroup.procs");
        std::fs::write(&path, pid.to_string()).map_err(io_err("writing", &path))
    }

    /// The processes in it.
    pub fn processes(&self) -> Result<Vec<u32>> {
        let path = self.path.join("cgroup.procs");
        let text = std::fs::read_to_string(&path).map_err(io_err("reading", &path))?;
        Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
    }

    pub fn usage(&self) -> Result<Usage> {
        let read = |file: &str| {
            let path = self.path.join(file);
            std::fs::read_to_string(&path).map_err(io_err("reading", &path))
        };
        let number = |text: String| text.trim().parse::<u64>().unwrap_or(0);
        Ok(Usage {
            memory_bytes: number(read("memory.current")?),
            cpu_usec: keyed(&read("cpu.stat")?, "usage_usec"),
            pids: number(read("pids.current")?),
            oom_kills: keyed(&read("memory.events")?, "oom_kill"),
        })
    }

    /// Removes the group once its processes are gone: the kernel empties a
    /// group a moment after its last process is reaped, so an `EBUSY` is
    /// retried for up to `wait`. Already removed is fine.
    pub fn remove(&self, wait: Duration) -> Result<()> {
        let started = Instant::now();
        loop {
            match std::fs::remove_dir(&self.path) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && started.elapsed() < wait => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => {
                    return Err(Error::Io {
                        what: "removing",
                        path: self.path.clone(),
                        source: e,
                    });
                }
            }
        }
    }
}

/// The value of `key` in a flat-keyed file (`key value` per line).
fn keyed(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == key).then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_keyed_files_are_read_by_key() {
        let stat = "usage_usec 123456\nuser_usec 100000\nsystem_usec 23456\n";
        assert_eq!(keyed(stat, "usage_usec"), 123_456);
        assert_eq!(keyed(stat, "nr_throttled"), 0);
        assert_eq!(
            keyed("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n", "oom_kill"),
            1
        );
        assert_eq!(keyed("oom_kill x\n", "oom_kill"), 0);
    }

    #[test]
    fn removing_a_group_that_is_gone_is_fine() {
        let dir = tempfile::tempdir().unwrap();
        let g = Group::new(dir.path().join("vmm-1"));
        std::fs::create_dir(g.path()).unwrap();
        g.remove(Duration::ZERO).unwrap();
        g.remove(Duration::ZERO).unwrap();
        assert_eq!(g.name(), "vmm-1");
    }
}

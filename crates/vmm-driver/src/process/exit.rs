//! Notice of a VMM process's end, for whoever must not poll for it: a pidfd
//! (readable once the process has exited) on the async reactor.

use std::io;
use std::os::fd::OwnedFd;

use rustix::process::{Pid, PidfdFlags, pidfd_open};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use super::ProcessIdentity;

/// Resolves once one VMM process has ended (see [`super::VmmProcess::exit_watch`]).
#[derive(Debug)]
pub struct ExitWatch(Watched);

#[derive(Debug)]
enum Watched {
    Process(AsyncFd<OwnedFd>),
    /// It had ended before the watch began.
    Gone,
}

impl ExitWatch {
    /// A watch of process `pid`. With `identity`, a pid that names another
    /// process by now (the one watched ended and its pid was reused) counts
    /// as ended; without it the caller vouches for the pid (its own child,
    /// not reaped yet, so not reusable). Needs a Tokio runtime.
    pub(crate) fn of(pid: u32, identity: Option<ProcessIdentity>) -> io::Result<ExitWatch> {
        let raw = i32::try_from(pid)
            .ok()
            .and_then(Pid::from_raw)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("pid {pid}")))?;
        let fd = match pidfd_open(raw, PidfdFlags::empty()) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::SRCH) => return Ok(ExitWatch(Watched::Gone)),
            Err(e) => return Err(e.into()),
        };
        // Checked after the open: if it is ours now, the fd names it.
        if identity.is_some_and(|id| !id.is_alive()) {
            return Ok(ExitWatch(Watched::Gone));
        }
        // SAFETY: the AsyncFd owns the OwnedFd, which stays open and the same
        // descriptor until the AsyncFd drops it.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(io::Error::from)?;
        Ok(ExitWatch(Watched::Process(fd)))
    }

    /// Waits until the process has exited (a zombie counts: it runs nothing).
    pub async fn exited(self) -> io::Result<()> {
        match self.0 {
            Watched::Gone => Ok(()),
            Watched::Process(fd) => fd.readable().await.map(drop),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_killed_child_is_noticed_and_a_live_one_is_not() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let watch = ExitWatch::of(child.id(), None).unwrap();
        let waiting = tokio::spawn(watch.exited());
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiting.is_finished(), "a running process counted as ended");
        child.kill().unwrap();
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("the exit was not noticed")
            .unwrap()
            .unwrap();
        child.wait().unwrap();
        // A pid that is gone is ended at once.
        let gone = ExitWatch::of(child.id(), ProcessIdentity::of(child.id()));
        if let Ok(w) = gone {
            tokio::time::timeout(Duration::from_secs(1), w.exited())
                .await
                .expect("a gone process was waited for")
                .unwrap();
        }
    }
}

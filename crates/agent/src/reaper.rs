//! The one place that waits for children.
//!
//! As PID 1 the agent inherits every orphan in the guest, so it must wait for
//! any child (`waitpid(-1)`), which would steal the statuses of the processes
//! the process service started from any other waiter. So nothing else waits:
//! the service registers each pid it spawns with [`watch`], and this reaper
//! hands the status over when it reaps that pid. Children nobody registered
//! (orphans) are simply reaped.
//!
//! Why not `waitid(P_ALL, WNOWAIT)` plus per-child waits: it needs a loop that
//! peeks, skips registered pids and reaps the rest, which cannot skip past one
//! registered zombie to see the next child. Reaping everything here is simpler
//! and also correct outside PID 1 (host mode, tests), where our children are
//! exactly the processes we spawned.
//!
//! Registration races with reaping only if a child exits before `watch` is
//! called. The agent's runtime is single-threaded and the process service
//! registers right after `fork` without yielding, so the reaper task cannot run
//! in between; still, unclaimed statuses are kept briefly (bounded) so that a
//! later `watch` gets them rather than waiting forever.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::oneshot;

/// How long a status nobody registered for is kept, and how many.
const UNCLAIMED_TTL: Duration = Duration::from_secs(10);
const UNCLAIMED_MAX: usize = 256;

#[derive(Default)]
struct Registry {
    waiting: HashMap<i32, oneshot::Sender<WaitStatus>>,
    unclaimed: Vec<(Instant, i32, WaitStatus)>,
}

static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

fn with_registry<R>(f: impl FnOnce(&mut Registry) -> R) -> R {
    let mut guard = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    f(guard.get_or_insert_with(Registry::default))
}

/// Asks for the exit status of child `pid`, which the reaper delivers once it
/// has reaped it (immediately if it already has).
pub fn watch(pid: i32) -> oneshot::Receiver<WaitStatus> {
    let (tx, rx) = oneshot::channel();
    with_registry(|r| {
        if let Some(i) = r.unclaimed.iter().position(|(_, p, _)| *p == pid) {
            let (_, _, status) = r.unclaimed.remove(i);
            let _ = tx.send(status);
        } else {
            r.waiting.insert(pid, tx);
        }
    });
    rx
}

/// Hands `status` to whoever registered its pid.
fn deliver(status: WaitStatus) {
    let Some(pid) = status.pid() else { return };
    let pid = pid.as_raw();
    with_registry(|r| match r.waiting.remove(&pid) {
        Some(tx) => {
            let _ = tx.send(status);
        }
        None => {
            let now = Instant::now();
            r.unclaimed
                .retain(|(t, _, _)| now.duration_since(*t) < UNCLAIMED_TTL);
            if r.unclaimed.len() >= UNCLAIMED_MAX {
                r.unclaimed.remove(0);
            }
            r.unclaimed.push((now, pid, status));
        }
    });
}

/// What one pass of `reap_exited` saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reaped {
    pub count: usize,
    /// Whether children remain (alive, or stopped).
    pub children_left: bool,
}

/// Reaps every child that has exited, without blocking, delivering statuses.
pub fn reap_exited() -> Reaped {
    let mut count = 0;
    // __WALL: also children whose exit signal is not SIGCHLD (clone without it).
    let flags = WaitPidFlag::WNOHANG | WaitPidFlag::__WALL;
    loop {
        match waitpid(None, Some(flags)) {
            Ok(WaitStatus::StillAlive) => {
                return Reaped {
                    count,
                    children_left: true,
                };
            }
            Ok(status @ (WaitStatus::Exited(..) | WaitStatus::Signaled(..))) => {
                count += 1;
                log::debug!("reaped {status:?}");
                deliver(status);
            }
            // Stopped/continued reports (we do not ask for them) are not exits.
            Ok(_) => {}
            Err(Errno::EINTR) => {}
            Err(Errno::ECHILD) => {
                return Reaped {
                    count,
                    children_left: false,
                };
            }
            Err(e) => {
                log::warn!("waitpid: {e}");
                return Reaped {
                    count,
                    children_left: true,
                };
            }
        }
    }
}

/// Reaps on every SIGCHLD, forever. Also reaps once up front: zombies may have
/// been inherited before the handler existed (e.g. from a shell that exec'd us).
pub async fn run() {
    let mut sigchld = match signal(SignalKind::child()) {
        Ok(s) => Some(s),
        Err(e) => {
            log::error!("cannot watch SIGCHLD ({e}); polling for zombies instead");
            None
        }
    };
    loop {
        reap_exited();
        match sigchld.as_mut() {
            // SIGCHLDs coalesce; one wakeup may stand for many exits, which the
            // loop in reap_exited covers.
            Some(s) => {
                s.recv().await;
            }
            None => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    }
}

/// Last resort when the async runtime is gone: block in waitpid forever so PID 1
/// never exits (that would panic the kernel).
pub fn reap_forever_blocking() -> ! {
    loop {
        match waitpid(None, Some(WaitPidFlag::__WALL)) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(_) => std::thread::sleep(Duration::from_secs(1)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// Spawns a child and never waits for it with std: the reaper does.
    #[allow(clippy::zombie_processes)]
    fn spawn(script: &str) -> i32 {
        let child = Command::new("/bin/sh")
            .args(["-c", script])
            .spawn()
            .unwrap();
        child.id() as i32
    }

    #[tokio::test]
    async fn delivers_statuses_of_watched_children() {
        let reaper = tokio::spawn(run());
        let a = spawn("exit 3");
        let rx_a = watch(a);
        let b = spawn("kill -KILL $$");
        let rx_b = watch(b);
        let sa = tokio::time::timeout(Duration::from_secs(10), rx_a)
            .await
            .unwrap()
            .unwrap();
        let sb = tokio::time::timeout(Duration::from_secs(10), rx_b)
            .await
            .unwrap()
            .unwrap();
        assert!(
            matches!(sa, WaitStatus::Exited(p, 3) if p.as_raw() == a),
            "{sa:?}"
        );
        assert!(
            matches!(sb, WaitStatus::Signaled(p, nix::sys::signal::Signal::SIGKILL, _) if p.as_raw() == b),
            "{sb:?}"
        );

        // A child that exits and is reaped before anyone watches it.
        let c = spawn("exit 5");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !with_registry(|r| r.unclaimed.iter().any(|(_, p, _)| *p == c)) {
            assert!(Instant::now() < deadline, "child {c} not reaped");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let sc = watch(c).await.unwrap();
        assert!(matches!(sc, WaitStatus::Exited(_, 5)), "{sc:?}");
        reaper.abort();
    }
}

//! Zombie reaping. As PID 1 the agent inherits every orphan in the guest, so it
//! must wait for any child, not only the ones it spawned.
//!
//! Later, when the agent spawns processes itself (envd's process service), their
//! exit statuses must be handed from here to whoever waits for them, since a
//! `waitpid(-1)` here would otherwise steal them from tokio::process.

use nix::errno::Errno;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use tokio::signal::unix::{SignalKind, signal};

/// What one pass of `reap_exited` saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reaped {
    pub count: usize,
    /// Whether children remain (alive, or stopped).
    pub children_left: bool,
}

/// Reaps every child that has exited, without blocking.
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
            Ok(status) => {
                count += 1;
                log::debug!("reaped {status:?}");
            }
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
            None => tokio::time::sleep(std::time::Duration::from_secs(1)).await,
        }
    }
}

/// Last resort when the async runtime is gone: block in waitpid forever so PID 1
/// never exits (that would panic the kernel).
pub fn reap_forever_blocking() -> ! {
    loop {
        match waitpid(None, Some(WaitPidFlag::__WALL)) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(_) => std::thread::sleep(std::time::Duration::from_secs(1)),
        }
    }
}

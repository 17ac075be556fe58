//! Clean shutdown of the guest, run by PID 1 on SIGINT (ctrl-alt-del) or SIGTERM.
//!
//! Ends in reboot(RB_AUTOBOOT): a Firecracker-style VMM exits when its guest
//! reboots, and without ACPI a power-off could not end the VM.

use std::time::{Duration, Instant};

use nix::sys::reboot::{RebootMode, reboot};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::pid1::Pid1Kind;
use crate::{mounts, reaper};

/// How long processes get to exit after SIGTERM before SIGKILL.
pub const TERM_GRACE: Duration = Duration::from_secs(3);
/// How long to wait for SIGKILLed processes to be reaped.
pub const KILL_GRACE: Duration = Duration::from_secs(2);

/// Stops everything and reboots. Blocking on purpose: nothing else should run now.
pub fn run(kind: Pid1Kind, reason: &str) -> ! {
    log::info!("{reason}: shutting down");
    if !signal_all_and_wait(Signal::SIGTERM, TERM_GRACE) {
        log::warn!("processes left after {TERM_GRACE:?}; sending SIGKILL");
        if !signal_all_and_wait(Signal::SIGKILL, KILL_GRACE) {
            log::warn!("processes survived SIGKILL for {KILL_GRACE:?}");
        }
    }
    nix::unistd::sync();
    match kind {
        Pid1Kind::Machine => mounts::unmount_all(),
        Pid1Kind::Container => log::info!("container mode: leaving filesystems mounted"),
    }
    log::info!("rebooting");
    // In a child PID namespace the kernel ends the namespace instead (its init
    // dies as if by SIGHUP), which is the container's equivalent.
    let Err(e) = reboot(RebootMode::RB_AUTOBOOT);
    log::error!("reboot: {e}; exiting");
    std::process::exit(1)
}

/// Sends `sig` to every process but us, then reaps until none is left or
/// `grace` passes. Returns whether all are gone.
fn signal_all_and_wait(sig: Signal, grace: Duration) -> bool {
    // pid -1 from PID 1: every process we may signal except ourselves. ESRCH just
    // means there is nobody left.
    if let Err(e) = kill(Pid::from_raw(-1), sig)
        && e != nix::errno::Errno::ESRCH
    {
        log::warn!("kill(-1, {sig}): {e}");
    }
    let deadline = Instant::now() + grace;
    loop {
        if !reaper::reap_exited().children_left {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

//! The `end` event from a wait status, worded like Go's `ProcessState`
//! (which is what envd reports): "exit status 1", "signal: killed".

use envd_proto::process::EndEvent;
use nix::sys::signal::Signal;
use nix::sys::wait::WaitStatus;

/// Go's names for signals (syscall.Signal.String on Linux).
fn signal_name(sig: Signal) -> String {
    let name = match sig {
        Signal::SIGHUP => "hangup",
        Signal::SIGINT => "interrupt",
        Signal::SIGQUIT => "quit",
        Signal::SIGILL => "illegal instruction",
        Signal::SIGTRAP => "trace/breakpoint trap",
        Signal::SIGABRT => "aborted",
        Signal::SIGBUS => "bus error",
        Signal::SIGFPE => "floating point exception",
        Signal::SIGKILL => "killed",
        Signal::SIGUSR1 => "user defined signal 1",
        Signal::SIGSEGV => "segmentation fault",
        Signal::SIGUSR2 => "user defined signal 2",
        Signal::SIGPIPE => "broken pipe",
        Signal::SIGALRM => "alarm clock",
        Signal::SIGTERM => "terminated",
        Signal::SIGXCPU => "CPU time limit exceeded",
        Signal::SIGXFSZ => "file size limit exceeded",
        Signal::SIGSYS => "bad system call",
        other => return format!("signal {}", other as i32),
    };
    name.to_string()
}

/// The end event: exit code (-1 when killed by a signal), `exited`, the
/// status text, and `error` (the status text) unless it exited with 0.
pub fn end_event(status: Option<WaitStatus>) -> EndEvent {
    let (exit_code, exited, text) = match status {
        Some(WaitStatus::Exited(_, code)) => (code, true, format!("exit status {code}")),
        Some(WaitStatus::Signaled(_, sig, core)) => {
            let core = if core { " (core dumped)" } else { "" };
            (-1, false, format!("signal: {}{core}", signal_name(sig)))
        }
        _ => (-1, false, "exit status unknown".to_string()),
    };
    EndEvent {
        exit_code,
        exited,
        error: (!(exited && exit_code == 0)).then(|| text.clone()),
        status: text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::unistd::Pid;

    #[test]
    fn worded_like_go() {
        let p = Pid::from_raw(5);
        let ok = end_event(Some(WaitStatus::Exited(p, 0)));
        assert_eq!((ok.exit_code, ok.exited), (0, true));
        assert_eq!((ok.status.as_str(), ok.error), ("exit status 0", None));
        let fail = end_event(Some(WaitStatus::Exited(p, 1)));
        assert_eq!(fail.status, "exit status 1");
        assert_eq!(fail.error.as_deref(), Some("exit status 1"));
        let killed = end_event(Some(WaitStatus::Signaled(p, Signal::SIGKILL, false)));
        assert_eq!((killed.exit_code, killed.exited), (-1, false));
        assert_eq!(killed.status, "signal: killed");
        assert_eq!(killed.error.as_deref(), Some("signal: killed"));
        let segv = end_event(Some(WaitStatus::Signaled(p, Signal::SIGSEGV, true)));
        assert_eq!(segv.status, "signal: segmentation fault (core dumped)");
        assert_eq!(end_event(None).exit_code, -1);
    }
}

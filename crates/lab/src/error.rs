//! The lab's typed errors.

use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong while preparing or running the lab.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{program} not found: install it with `apt-get install -y {package}` (scripts/deps.sh lists it)"
    )]
    ToolMissing {
        program: String,
        package: &'static str,
    },
    #[error("{command} failed ({status}): {stderr}")]
    ToolFailed {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("cannot find the lab kernel package: {0}")]
    KernelPackage(String),
    #[error("{path} is not a statically linked busybox (install busybox-static)")]
    BusyboxNotStatic { path: PathBuf },
    #[error("kernel module {name} is neither built in nor under {dir}")]
    ModuleNotFound { name: String, dir: PathBuf },
    #[error("kernel module {path}: {reason}")]
    BadModule { path: PathBuf, reason: String },
    #[error("invalid port forward {spec:?}: expected [ADDR:]HOSTPORT:GUESTPORT")]
    BadForward { spec: String },
    #[error(
        "invalid environment variable {spec:?}: expected NAME=VALUE with NAME of [A-Za-z_][A-Za-z0-9_]*"
    )]
    BadEnv { spec: String },
    #[error("cannot share {path} read-write: {reason}")]
    BadRwDir { path: PathBuf, reason: String },
    #[error("no command given")]
    EmptyCommand,
    #[error("{0}")]
    BadConfig(String),
    #[error("{program}: command not found inside the lab")]
    CommandNotFound { program: String },
    #[error(
        "working directory {cwd} does not exist inside the lab (the host root is shared read-only as it is; /tmp and /run are fresh unless shared read-write)"
    )]
    NoWorkingDir { cwd: PathBuf },
    #[error("the lab timed out after {:.1} s and was killed{}", .after.as_secs_f64(), describe_timeout(.diagnostics, .console_tail))]
    Timeout {
        after: Duration,
        /// What the machine's init reported just before (kernel messages, threads).
        diagnostics: String,
        console_tail: String,
    },
    #[error("the lab was killed before the command finished")]
    Killed,
    #[error("the lab's init failed: {0}")]
    Guest(String),
    #[error("the lab stopped without reporting an exit status (qemu: {qemu_status}){}", describe_logs(.qemu_stderr, .console_tail))]
    NoExitStatus {
        qemu_status: String,
        qemu_stderr: String,
        console_tail: String,
    },
}

fn describe_logs(qemu_stderr: &str, console_tail: &str) -> String {
    let mut s = String::new();
    if !qemu_stderr.trim().is_empty() {
        s.push_str("\nqemu said:\n");
        s.push_str(qemu_stderr.trim_end());
    }
    if !console_tail.trim().is_empty() {
        s.push_str("\nlast console lines:\n");
        s.push_str(console_tail.trim_end());
    }
    s
}

fn describe_timeout(diagnostics: &str, console_tail: &str) -> String {
    let mut s = String::new();
    if !diagnostics.trim().is_empty() {
        s.push_str("\nthe lab's state just before:\n");
        s.push_str(diagnostics.trim_end());
    }
    s + &describe_logs("", console_tail)
}

impl LabError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        LabError::Io {
            what: what.into(),
            source,
        }
    }
}

pub type Result<T, E = LabError> = std::result::Result<T, E>;

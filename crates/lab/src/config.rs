//! How one lab run is set up: machine size, ports, environment, shares.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use crate::error::LabError;

/// Host variables passed into the lab unless `inherit_env` is off, besides
/// every `SANDFORK_*` and `CARGO_*` one.
pub const PASSED_HOST_VARS: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LC_ALL",
    "TERM",
    "TZ",
    "NO_COLOR",
    "RUST_LOG",
    "RUST_BACKTRACE",
    "RUST_LIB_BACKTRACE",
    "RUST_TEST_THREADS",
    "RUST_MIN_STACK",
];
const PASSED_HOST_PREFIXES: &[&str] = &["SANDFORK_", "CARGO_"];

/// A TCP port of the lab reachable from the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortForward {
    /// The host address to listen on; 127.0.0.1 unless given.
    pub host_addr: Ipv4Addr,
    pub host_port: u16,
    pub guest_port: u16,
}

impl FromStr for PortForward {
    type Err = LabError;

    /// `[ADDR:]HOSTPORT:GUESTPORT`, e.g. `8080:80` or `0.0.0.0:8080:80`.
    fn from_str(spec: &str) -> Result<Self, LabError> {
        let bad = || LabError::BadForward {
            spec: spec.to_string(),
        };
        let parts: Vec<&str> = spec.split(':').collect();
        let (addr, host, guest) = match parts[..] {
            [h, g] => (Ipv4Addr::LOCALHOST, h, g),
            [a, h, g] => (a.parse().map_err(|_| bad())?, h, g),
            _ => return Err(bad()),
        };
        let port = |s: &str| s.parse::<u16>().ok().filter(|&p| p != 0).ok_or_else(bad);
        Ok(PortForward {
            host_addr: addr,
            host_port: port(host)?,
            guest_port: port(guest)?,
        })
    }
}

/// Where the command's stdout and stderr go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputMode {
    /// Streamed to this process's stdout and stderr as they arrive.
    #[default]
    Inherit,
    /// Collected and returned in [`crate::LabOutput`].
    Capture,
}

/// How the host root's read-only share is cached inside the lab.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RootCache {
    /// Page cache and metadata cache (9p `cache=loose`): fast program start,
    /// repeated reads and big sequential reads; host changes made during the
    /// run may not be seen.
    #[default]
    Loose,
    /// Every read goes to the host (9p `cache=none`): coherent; reads of 1 MiB
    /// and more are fastest, small reads and metadata are slow.
    None,
}

impl RootCache {
    pub(crate) fn as_9p(self) -> &'static str {
        match self {
            RootCache::Loose => "loose",
            RootCache::None => "none",
        }
    }
}

/// How QEMU's TCG runs the machine's vCPUs (`-accel tcg,thread=...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TcgThreads {
    /// Every vCPU on one host thread, in turn.
    Single,
    /// One host thread per vCPU (QEMU's default for x86 on x86).
    #[default]
    Multi,
}

impl TcgThreads {
    pub(crate) fn as_qemu(self) -> &'static str {
        match self {
            TcgThreads::Single => "single",
            TcgThreads::Multi => "multi",
        }
    }
}

/// One run's settings. `Default` gives 4096 MiB, 2 vCPUs, no forwards, the
/// host's selected variables, the current directory, no time limit.
#[derive(Debug, Clone)]
pub struct LabConfig {
    pub memory_mib: u32,
    pub cpus: u32,
    pub tcg_threads: TcgThreads,
    /// QEMU's instruction counting (`-icount shift=auto`): the machine's
    /// clocks follow the instructions it ran, and its timers are served
    /// by the vCPU thread itself (needs [`TcgThreads::Single`]).
    pub icount: bool,
    /// Added to the machine's kernel command line; `MODULE.PARAM=VALUE`
    /// ones are also given to that module when init loads it.
    pub kernel_args: Vec<String>,
    pub forwards: Vec<PortForward>,
    /// Set inside the lab after the inherited ones, so they win.
    pub env: Vec<(String, String)>,
    /// Pass PATH, HOME, RUST_LOG, ... and all SANDFORK_* and CARGO_* from the host.
    pub inherit_env: bool,
    /// Host directories shared read-write at the same path.
    pub rw_dirs: Vec<PathBuf>,
    /// Killed and reported as [`LabError::Timeout`] after this long.
    pub timeout: Option<Duration>,
    /// Working directory inside the lab; the current one when None.
    pub cwd: Option<PathBuf>,
    pub output: OutputMode,
    pub root_cache: RootCache,
    /// Keep the machine's serial console (kernel and init messages) here.
    pub console_log: Option<PathBuf>,
    /// Have the kernel SIGKILL QEMU when the *thread* that spawned it exits
    /// (PR_SET_PDEATHSIG), so a killed caller leaves no machine behind. Only
    /// for callers that spawn from a thread outliving the run, e.g. `main`.
    pub die_with_parent: bool,
    /// Send the machine a device interrupt when its heartbeat stops (see
    /// `stall.rs`): it delivers the timer interrupt the emulator left
    /// pending. False only reports the stalls.
    pub nudge_stalls: bool,
}

impl Default for LabConfig {
    fn default() -> Self {
        LabConfig {
            memory_mib: 4096,
            cpus: 2,
            tcg_threads: TcgThreads::default(),
            icount: false,
            kernel_args: Vec::new(),
            forwards: Vec::new(),
            env: Vec::new(),
            inherit_env: true,
            rw_dirs: Vec::new(),
            timeout: None,
            cwd: None,
            output: OutputMode::Inherit,
            root_cache: RootCache::Loose,
            console_log: None,
            die_with_parent: false,
            nudge_stalls: true,
        }
    }
}

/// Parses `NAME=VALUE`, checking NAME is a shell variable name.
pub fn parse_env(spec: &str) -> Result<(String, String), LabError> {
    let bad = || LabError::BadEnv {
        spec: spec.to_string(),
    };
    let (k, v) = spec.split_once('=').ok_or_else(bad)?;
    if !is_var_name(k) {
        return Err(bad());
    }
    Ok((k.to_string(), v.to_string()))
}

fn is_var_name(k: &str) -> bool {
    let mut chars = k.chars();
    matches!(chars.next(), Some(c) if c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

/// The environment the command gets: selected host variables (from `host`),
/// then the explicit ones, later entries replacing earlier ones.
pub fn effective_env(
    config: &LabConfig,
    host: impl IntoIterator<Item = (String, String)>,
) -> Result<Vec<(String, String)>, LabError> {
    let mut out: Vec<(String, String)> = Vec::new();
    let mut set = |k: String, v: String| {
        out.retain(|(ok, _)| *ok != k);
        out.push((k, v));
    };
    if config.inherit_env {
        let mut inherited: Vec<(String, String)> = host
            .into_iter()
            .filter(|(k, _)| {
                is_var_name(k)
                    && (PASSED_HOST_VARS.contains(&k.as_str())
                        || PASSED_HOST_PREFIXES.iter().any(|p| k.starts_with(p)))
            })
            .collect();
        inherited.sort();
        for (k, v) in inherited {
            set(k, v);
        }
    }
    for (k, v) in &config.env {
        if !is_var_name(k) {
            return Err(LabError::BadEnv {
                spec: format!("{k}={v}"),
            });
        }
        set(k.clone(), v.clone());
    }
    Ok(out)
}

/// Checks a read-write share: an existing absolute directory that the lab's
/// own mounts would not hide, and that QEMU's option syntax and init can carry.
pub fn check_rw_dir(dir: &Path) -> Result<PathBuf, LabError> {
    let bad = |reason: &str| LabError::BadRwDir {
        path: dir.to_path_buf(),
        reason: reason.to_string(),
    };
    let dir = std::fs::canonicalize(dir).map_err(|e| bad(&e.to_string()))?;
    if !dir.is_dir() {
        return Err(bad("not a directory"));
    }
    let s = dir.to_str().ok_or_else(|| bad("path is not UTF-8"))?;
    if s.contains(['\n', '\r']) || s != s.trim() {
        return Err(bad("path has a newline or surrounding blanks"));
    }
    if dir == Path::new("/") {
        return Err(bad("the root is shared read-only; share a subdirectory"));
    }
    for special in ["/proc", "/sys", "/dev"] {
        if dir.starts_with(special) {
            return Err(bad("the lab mounts its own /proc, /sys and /dev"));
        }
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwards_parse() {
        let f: PortForward = "8080:80".parse().unwrap();
        assert_eq!(f.host_addr, Ipv4Addr::LOCALHOST);
        assert_eq!((f.host_port, f.guest_port), (8080, 80));
        let f: PortForward = "0.0.0.0:2222:22".parse().unwrap();
        assert_eq!(f.host_addr, Ipv4Addr::UNSPECIFIED);
        assert_eq!((f.host_port, f.guest_port), (2222, 22));
        for bad in ["", "80", "a:80", "1:2:3:4", "0:80", "70000:80", "host:1:2"] {
            assert!(bad.parse::<PortForward>().is_err(), "{bad}");
        }
    }

    #[test]
    fn env_specs_parse() {
        assert_eq!(
            parse_env("A_1=x=y").unwrap(),
            ("A_1".to_string(), "x=y".to_string())
        );
        assert_eq!(parse_env("E=").unwrap().1, "");
        for bad in ["noequals", "=v", "1A=v", "A-B=v", "A B=v"] {
            assert!(parse_env(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn env_selection_and_override() {
        let host = [
            ("PATH", "/usr/bin"),
            ("SECRET_TOKEN", "x"),
            ("SANDFORK_CACHE", "/c"),
            ("CARGO_TARGET_DIR", "/t"),
            ("RUST_LOG", "info"),
            ("BAD-NAME", "x"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let config = LabConfig {
            env: vec![
                ("RUST_LOG".into(), "debug".into()),
                ("X".into(), "1".into()),
            ],
            ..LabConfig::default()
        };
        let env = effective_env(&config, host.clone()).unwrap();
        let get = |k: &str| env.iter().find(|(ek, _)| ek == k).map(|(_, v)| v.as_str());
        assert_eq!(get("PATH"), Some("/usr/bin"));
        assert_eq!(get("SANDFORK_CACHE"), Some("/c"));
        assert_eq!(get("CARGO_TARGET_DIR"), Some("/t"));
        assert_eq!(get("RUST_LOG"), Some("debug"));
        assert_eq!(get("X"), Some("1"));
        assert_eq!(get("SECRET_TOKEN"), None);
        assert_eq!(get("BAD-NAME"), None);
        assert_eq!(env.iter().filter(|(k, _)| k == "RUST_LOG").count(), 1);

        let clean = LabConfig {
            inherit_env: false,
            ..LabConfig::default()
        };
        assert!(effective_env(&clean, host).unwrap().is_empty());
    }

    #[test]
    fn rw_dirs_are_checked() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(
            check_rw_dir(d.path()).unwrap(),
            d.path().canonicalize().unwrap()
        );
        assert!(check_rw_dir(Path::new("/")).is_err());
        assert!(check_rw_dir(Path::new("/proc/self")).is_err());
        assert!(check_rw_dir(&d.path().join("missing")).is_err());
        let f = d.path().join("file");
        std::fs::write(&f, "").unwrap();
        assert!(check_rw_dir(&f).is_err());
    }
}

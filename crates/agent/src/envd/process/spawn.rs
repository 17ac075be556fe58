//! Starting a process as the request's user: environment, working directory,
//! stdin, pty, and the switch of credentials between fork and exec.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use envd_proto::ConnectError;

use super::pty;
use crate::envd::user::User;

/// PATH for children when the agent itself has none (as PID 1 it usually
/// does not).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Everything needed to start one process.
#[derive(Debug, Clone)]
pub struct SpawnSpec {
    pub cmd: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: PathBuf,
    pub user: User,
    /// A stdin pipe (true) or /dev/null (false). Ignored with a pty.
    pub stdin: bool,
    /// (cols, rows) of a pty to run on.
    pub pty: Option<(u32, u32)>,
}

/// The parent's ends of a started process. The child is not waited for here:
/// the reaper delivers its status.
pub struct Spawned {
    pub pid: i32,
    pub stdin: Option<OwnedFd>,
    pub stdout: Option<OwnedFd>,
    pub stderr: Option<OwnedFd>,
    pub pty_master: Option<OwnedFd>,
}

/// The child's environment, in envd's order (later entries win): PATH, HOME,
/// USER, LOGNAME; then the sandbox-wide variables; then the request's.
pub fn build_env(
    user: &User,
    sandbox: &BTreeMap<String, String>,
    request: &BTreeMap<String, String>,
) -> Vec<(String, String)> {
    let path = std::env::var("PATH")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| DEFAULT_PATH.to_string());
    let mut env = vec![
        ("PATH".to_string(), path),
        ("HOME".to_string(), user.home.to_string_lossy().into_owned()),
        ("USER".to_string(), user.name.clone()),
        ("LOGNAME".to_string(), user.name.clone()),
    ];
    for (k, v) in sandbox.iter().chain(request) {
        match env.iter_mut().find(|(ek, _)| ek == k) {
            Some(slot) => slot.1 = v.clone(),
            None => env.push((k.clone(), v.clone())),
        }
    }
    env
}

/// The working directory: the request's (relative to the user's home), else
/// `/init`'s default workdir, else the home. A requested directory must
/// exist; a default that does not falls back to `/`.
pub fn resolve_cwd(
    user: &User,
    requested: Option<&str>,
    default_workdir: Option<&str>,
) -> Result<PathBuf, ConnectError> {
    if let Some(dir) = requested.filter(|d| !d.is_empty()) {
        let path = user.resolve_path(dir);
        return match std::fs::metadata(&path) {
            Ok(m) if m.is_dir() => Ok(path),
            Ok(_) => Err(ConnectError::invalid_argument(format!(
                "cwd '{}' is not a directory",
                path.display()
            ))),
            Err(e) => Err(ConnectError::invalid_argument(format!(
                "cwd '{}': {e}",
                path.display()
            ))),
        };
    }
    let fallback = default_workdir
        .filter(|d| !d.is_empty())
        .map(|d| user.resolve_path(d))
        .unwrap_or_else(|| user.home.clone());
    if fallback.is_dir() {
        Ok(fallback)
    } else {
        Ok(PathBuf::from("/"))
    }
}

/// Whether this process may run children as `user`.
fn check_can_switch(user: &User) -> Result<bool, ConnectError> {
    let euid = nix::unistd::geteuid().as_raw();
    if euid == 0 {
        Ok(user.uid != 0 || user.gid != 0 || user.groups != [0])
    } else if euid == user.uid {
        Ok(false)
    } else {
        Err(ConnectError::new(
            envd_proto::Code::PermissionDenied,
            format!(
                "cannot run as {}: the agent runs as uid {euid}, not root",
                user.name
            ),
        ))
    }
}

/// Starts the process. Must be called on the runtime thread without yielding
/// until the pid is registered with the reaper (see `reaper`).
pub fn spawn(spec: &SpawnSpec) -> Result<Spawned, ConnectError> {
    let switch = check_can_switch(&spec.user)?;
    let mut cmd = Command::new(&spec.cmd);
    cmd.args(&spec.args)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&spec.cwd);

    let mut master = None;
    let pty_child = spec.pty.is_some();
    if let Some((cols, rows)) = spec.pty {
        let (m, slave) =
            pty::open(cols, rows).map_err(|e| ConnectError::internal(format!("openpty: {e}")))?;
        let dup = |fd: &OwnedFd| {
            fd.try_clone()
                .map_err(|e| ConnectError::internal(format!("dup: {e}")))
        };
        cmd.stdin(Stdio::from(dup(&slave)?))
            .stdout(Stdio::from(dup(&slave)?))
            .stderr(Stdio::from(slave));
        master = Some(m);
    } else {
        cmd.stdin(if spec.stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    }

    // Prepared before fork: the closure below must not allocate.
    let groups: Vec<libc::gid_t> = spec.user.groups.clone();
    let (uid, gid) = (spec.user.uid, spec.user.gid);
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls on memory prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            // Its own session: signals for the agent's terminal (host mode)
            // do not reach it, and a pty can become its controlling terminal.
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            if pty_child && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            if switch
                && (libc::setgroups(groups.len(), groups.as_ptr()) < 0
                    || libc::setgid(gid) < 0
                    || libc::setuid(uid) < 0)
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }

    let mut child = cmd.spawn().map_err(|e| {
        ConnectError::invalid_argument(format!("failed to start {:?}: {e}", spec.cmd))
    })?;
    // Dropping `cmd` closes our copies of the pty slave, so the master sees
    // EOF once the child side is gone.
    drop(cmd);
    Ok(Spawned {
        pid: child.id() as i32,
        stdin: child.stdin.take().map(OwnedFd::from),
        stdout: child.stdout.take().map(OwnedFd::from),
        stderr: child.stderr.take().map(OwnedFd::from),
        pty_master: master,
    })
    // `child` is dropped without waiting: std never waits on drop.
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(home: &str) -> User {
        User {
            name: "u".into(),
            uid: 1000,
            gid: 1000,
            home: home.into(),
            shell: "/bin/sh".into(),
            groups: vec![1000],
        }
    }

    #[test]
    fn env_order_and_overrides() {
        let u = user("/home/u");
        let sandbox = BTreeMap::from([("A".into(), "1".into()), ("HOME".into(), "/x".into())]);
        let request = BTreeMap::from([("A".into(), "2".into()), ("B".into(), "3".into())]);
        let env = build_env(&u, &sandbox, &request);
        let keys: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["PATH", "HOME", "USER", "LOGNAME", "A", "B"]);
        let get = |k: &str| env.iter().find(|(ek, _)| ek == k).unwrap().1.clone();
        assert_eq!(get("HOME"), "/x");
        assert_eq!(get("A"), "2");
        assert_eq!(get("USER"), "u");
        assert!(!get("PATH").is_empty());
    }

    #[test]
    fn cwd_rules() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().to_str().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("file"), b"").unwrap();
        let u = user(home);
        assert_eq!(resolve_cwd(&u, None, None).unwrap(), dir.path());
        assert_eq!(resolve_cwd(&u, Some(""), None).unwrap(), dir.path());
        assert_eq!(
            resolve_cwd(&u, Some("sub"), None).unwrap(),
            dir.path().join("sub")
        );
        assert_eq!(
            resolve_cwd(&u, Some("/tmp"), Some("sub")).unwrap(),
            PathBuf::from("/tmp")
        );
        assert_eq!(
            resolve_cwd(&u, None, Some("sub")).unwrap(),
            dir.path().join("sub")
        );
        assert_eq!(
            resolve_cwd(&u, None, Some("/nonexistent-dir")).unwrap(),
            PathBuf::from("/")
        );
        for bad in ["missing", "file", "/nonexistent-dir"] {
            let e = resolve_cwd(&u, Some(bad), None).unwrap_err();
            assert_eq!(e.code, envd_proto::Code::InvalidArgument, "{bad}");
        }
        let homeless = user("/nonexistent-home");
        assert_eq!(
            resolve_cwd(&homeless, None, None).unwrap(),
            PathBuf::from("/")
        );
    }
}

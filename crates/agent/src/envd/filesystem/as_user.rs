//! Filesystem work done with a user's credentials.
//!
//! Chosen approach: the I/O runs on a blocking-pool thread that has switched its
//! *filesystem* ids (setfsuid/setfsgid) and supplementary groups to the user's.
//! All three are per-thread in the kernel (we call the raw setgroups syscall: the
//! glibc wrapper would change every thread of the process). With a non-zero fsuid
//! the kernel also drops the thread's filesystem capabilities (DAC override,
//! chown, fowner), so every access check is exactly the user's, and what the
//! thread creates is owned by the user without a chown race. The ids are restored
//! before the thread goes back to the pool.
//!
//! Not root (host-mode development runs): no switch is possible, so the work runs
//! with the agent's own credentials.

use std::io;

/// Credentials of the user an operation runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Creds {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (the primary gid may or may not be among them).
    pub groups: Vec<u32>,
}

#[cfg(test)]
impl Creds {
    pub fn root() -> Self {
        Self {
            uid: 0,
            gid: 0,
            groups: vec![0],
        }
    }
}

impl From<&crate::envd::user::User> for Creds {
    fn from(u: &crate::envd::user::User) -> Self {
        Self {
            uid: u.uid,
            gid: u.gid,
            groups: u.groups.clone(),
        }
    }
}

/// Runs `f` on a blocking thread with the user's filesystem credentials.
pub async fn run_as<T, E, F>(creds: &Creds, f: F) -> Result<T, E>
where
    F: FnOnce() -> Result<T, E> + Send + 'static,
    T: Send + 'static,
    E: From<io::Error> + Send + 'static,
{
    let creds = creds.clone();
    tokio::task::spawn_blocking(move || {
        let _guard = ThreadCreds::enter(&creds)?;
        f()
    })
    .await
    .map_err(|e| io::Error::other(format!("filesystem task failed: {e}")))?
}

/// While alive, the current thread has `creds` as its filesystem credentials.
pub struct ThreadCreds {
    saved_groups: Option<Vec<libc::gid_t>>,
}

impl ThreadCreds {
    pub fn enter(creds: &Creds) -> io::Result<Self> {
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        if euid != 0 || (creds.uid == 0 && creds.gid == 0) {
            return Ok(Self { saved_groups: None });
        }
        let saved = thread_groups()?;
        set_thread_groups(&creds.groups)?;
        let guard = Self {
            saved_groups: Some(saved),
        };
        // SAFETY: setfsgid/setfsuid only change this thread's filesystem ids.
        unsafe {
            libc::setfsgid(creds.gid);
            libc::setfsuid(creds.uid);
        }
        // The calls report the previous value, never failure: read them back.
        // SAFETY: an invalid id (-1) changes nothing and returns the current one.
        let (fsuid, fsgid) = unsafe { (libc::setfsuid(u32::MAX), libc::setfsgid(u32::MAX)) };
        if fsuid as u32 != creds.uid || fsgid as u32 != creds.gid {
            return Err(io::Error::other(format!(
                "cannot switch to uid {} gid {}",
                creds.uid, creds.gid
            )));
        }
        Ok(guard)
    }
}

impl Drop for ThreadCreds {
    fn drop(&mut self) {
        let Some(groups) = self.saved_groups.take() else {
            return;
        };
        // SAFETY: back to root's filesystem ids on this thread only; fsuid 0
        // restores the filesystem capabilities dropped on entry.
        unsafe {
            libc::setfsuid(0);
            libc::setfsgid(0);
        }
        if let Err(e) = set_thread_groups(&groups) {
            // A pool thread left with a user's groups would be wrong for the
            // next task, and only root's groups are at stake: stop the thread.
            log::error!("cannot restore supplementary groups: {e}");
            std::process::abort();
        }
    }
}

fn thread_groups() -> io::Result<Vec<libc::gid_t>> {
    // SAFETY: a zero size asks only for the count.
    let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut groups = vec![0; n as usize];
    // SAFETY: the buffer holds `n` gids.
    let n = unsafe { libc::getgroups(n, groups.as_mut_ptr()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    groups.truncate(n as usize);
    Ok(groups)
}

/// setgroups(2) for the calling thread only (the raw syscall, not glibc's
/// process-wide wrapper).
fn set_thread_groups(groups: &[u32]) -> io::Result<()> {
    // SAFETY: the pointer and length describe a live slice of gid_t (u32).
    let r = unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    /// The thread's fsuid as /proc reports it (4th field of `Uid:`).
    fn fsuid_of_this_thread() -> u32 {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
        let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
        line.split_whitespace().nth(4).unwrap().parse().unwrap()
    }

    #[tokio::test]
    async fn files_are_created_by_the_user_and_ids_are_restored() {
        if !is_root() {
            eprintln!("SKIPPED: needs root to switch filesystem ids");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        let nobody = Creds {
            uid: 65534,
            gid: 65534,
            groups: vec![65534],
        };
        let p = dir.path().join("f");
        let (uid_inside, md) = run_as(&nobody, move || -> io::Result<_> {
            std::fs::write(&p, b"x")?;
            Ok((fsuid_of_this_thread(), std::fs::metadata(&p)?))
        })
        .await
        .unwrap();
        assert_eq!(uid_inside, 65534);
        assert_eq!((md.uid(), md.gid()), (65534, 65534));
        // The calling thread never changed.
        assert_eq!(fsuid_of_this_thread(), 0);
        // Root-only file: nobody is refused, root is not.
        let secret = dir.path().join("secret");
        std::fs::write(&secret, b"s").unwrap();
        std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let s = secret.clone();
        let err = run_as(&nobody, move || std::fs::read(&s))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        // Pool threads come back as root: the same read now works.
        for _ in 0..4 {
            let s = secret.clone();
            let (data, fsuid) = run_as(&Creds::root(), move || -> io::Result<_> {
                Ok((std::fs::read(&s)?, fsuid_of_this_thread()))
            })
            .await
            .unwrap();
            assert_eq!((data, fsuid), (b"s".to_vec(), 0));
        }
    }
}

//! What the agent does at boot only when it is PID 1: console, filesystems, device
//! symlinks, hostname, loopback, the network interface, and turning ctrl-alt-del
//! into SIGINT.

use std::path::Path;

use nix::errno::Errno;

use crate::{guest_net, loopback, mounts};

/// Where PID 1 runs. A PID 1 in a child PID namespace (a container, or the
/// `unshare` tests) must leave the host's filesystems alone at shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pid1Kind {
    /// The init of a whole (virtual) machine: the initial PID namespace.
    Machine,
    /// The init of a child PID namespace.
    Container,
}

/// Symlinks a Linux userland expects in /dev that devtmpfs does not create.
pub const DEV_SYMLINKS: &[(&str, &str)] = &[
    ("/dev/ptmx", "pts/ptmx"),
    ("/dev/fd", "/proc/self/fd"),
    ("/dev/stdin", "/proc/self/fd/0"),
    ("/dev/stdout", "/proc/self/fd/1"),
    ("/dev/stderr", "/proc/self/fd/2"),
];

/// Runs the boot duties; every step logs its failure and carries on.
pub fn setup() -> Pid1Kind {
    ensure_console();
    let kind = disable_ctrl_alt_del();
    mounts::mount_boot_filesystems();
    // devtmpfs may only now provide /dev/console.
    ensure_console();
    create_dev_symlinks();
    set_hostname();
    match loopback::bring_up() {
        Ok(true) => log::debug!("loopback already up"),
        Ok(false) => log::info!("loopback up"),
        Err(e) => log::warn!("bringing up loopback: {e}"),
    }
    match guest_net::configure() {
        Ok(guest_net::Outcome::NoInterface) => log::debug!("no network interface"),
        Ok(guest_net::Outcome::Configured) => log::info!(
            "{} up: {}/30 via {}",
            guest_net::IFACE,
            guest_net::GUEST_IP,
            guest_net::GATEWAY
        ),
        Err(e) => log::warn!("configuring the network: {e}"),
    }
    kind
}

/// With ctrl-alt-del disabled, the kernel sends SIGINT to PID 1 instead of
/// rebooting: that is how the VMM's SendCtrlAltDel asks for a clean shutdown.
/// The same call tells whether we are in the initial PID namespace: in any other
/// one the kernel refuses it with EINVAL.
fn disable_ctrl_alt_del() -> Pid1Kind {
    match nix::sys::reboot::set_cad_enabled(false) {
        Ok(()) => Pid1Kind::Machine,
        Err(Errno::EINVAL) => {
            log::info!("PID 1 of a child PID namespace: container mode");
            Pid1Kind::Container
        }
        Err(e) => {
            // Without CAP_SYS_BOOT we cannot shut a machine down either; treat the
            // host's filesystems as not ours.
            log::warn!("disabling ctrl-alt-del: {e}; container mode");
            Pid1Kind::Container
        }
    }
}

/// Points fds 0-2 at /dev/console when the kernel could not (no /dev/console in
/// the root filesystem at boot), so logs and children's stdio go somewhere.
fn ensure_console() {
    // SAFETY: F_GETFD only queries the descriptor table.
    let closed: Vec<i32> = (0..=2)
        .filter(|&fd| unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0)
        .collect();
    if closed.is_empty() {
        return;
    }
    let Ok(console) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/console")
    else {
        return;
    };
    // The lowest free number: one of the closed slots, or above 2.
    let raw = std::os::fd::IntoRawFd::into_raw_fd(console);
    for &fd in closed.iter().filter(|&&fd| fd != raw) {
        // SAFETY: fd is a closed slot, so dup2 takes no descriptor from anyone.
        unsafe { libc::dup2(raw, fd) };
    }
    if raw > 2 {
        // SAFETY: raw came from into_raw_fd above and is not used afterwards.
        unsafe { libc::close(raw) };
    }
}

fn create_dev_symlinks() {
    for (link, target) in DEV_SYMLINKS {
        // symlink_metadata: a dangling or existing link counts as present.
        if Path::new(link).symlink_metadata().is_ok() {
            continue;
        }
        if let Err(e) = std::os::unix::fs::symlink(target, link) {
            log::warn!("symlink {link} -> {target}: {e}");
        }
    }
}

fn set_hostname() {
    let text = match std::fs::read_to_string("/etc/hostname") {
        Ok(t) => t,
        Err(e) => {
            log::debug!("no /etc/hostname: {e}");
            return;
        }
    };
    let Some(name) = parse_hostname(&text) else {
        log::warn!("/etc/hostname holds no usable name");
        return;
    };
    match nix::unistd::sethostname(name) {
        Ok(()) => log::info!("hostname {name}"),
        Err(e) => log::warn!("sethostname {name}: {e}"),
    }
}

/// The host name in an /etc/hostname text: its first non-blank, non-comment line,
/// if it fits the kernel's 64-byte limit.
pub fn parse_hostname(text: &str) -> Option<&str> {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .filter(|l| l.len() <= 64 && !l.contains(char::is_whitespace))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostname_is_first_real_line() {
        assert_eq!(parse_hostname("sandbox-1\n"), Some("sandbox-1"));
        assert_eq!(parse_hostname("# comment\n\n  box  \nother\n"), Some("box"));
        assert_eq!(parse_hostname("\n\n"), None);
        assert_eq!(parse_hostname("two words\n"), None);
        assert_eq!(parse_hostname(&"x".repeat(65)), None);
        assert_eq!(
            parse_hostname(&"x".repeat(64)),
            Some("x".repeat(64).as_str())
        );
    }

    #[test]
    fn dev_symlinks_are_the_usual_set() {
        let links: Vec<_> = DEV_SYMLINKS.iter().map(|(l, _)| *l).collect();
        assert_eq!(
            links,
            [
                "/dev/ptmx",
                "/dev/fd",
                "/dev/stdin",
                "/dev/stdout",
                "/dev/stderr"
            ]
        );
        // ptmx must be relative so it resolves inside the devpts instance at /dev/pts.
        assert_eq!(DEV_SYMLINKS[0].1, "pts/ptmx");
    }
}

//! The slot's tap: made persistent with the flags the VMM opens it with, so the VMM (or the
//! server on its behalf) attaches to it by name inside the slot namespace.

use std::fs::OpenOptions;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;

use crate::error::{Error, Result};

/// The flags every open of a slot tap uses (the VMM's too): Ethernet frames, no packet-info
/// prefix, a virtio-net header on every frame (offloads are set later on the open fd).
pub const TAP_FLAGS: libc::c_int = libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR;

fn ifreq(name: &str, flags: libc::c_int) -> Result<libc::ifreq> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(Error::sys(
            format!("tap name {name:?}"),
            std::io::Error::from_raw_os_error(libc::EINVAL),
        ));
    }
    // SAFETY: ifreq is plain old data; all-zero is a valid value (empty name, zero union).
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = flags as libc::c_short;
    Ok(req)
}

/// Opens (creating it if absent) tap `name` in the calling thread's network namespace.
pub fn open_tap(name: &str) -> Result<OwnedFd> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open("/dev/net/tun")
        .map_err(|e| Error::sys("open /dev/net/tun", e))?;
    let mut req = ifreq(name, TAP_FLAGS)?;
    // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is and outlives the call.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) };
    if rc < 0 {
        return Err(Error::sys(
            format!("TUNSETIFF {name}"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(file.into())
}

/// Creates tap `name`, persistent: it stays when this fd closes, until the namespace goes.
pub fn create_persistent_tap(name: &str) -> Result<()> {
    let fd = open_tap(name)?;
    // SAFETY: TUNSETPERSIST takes an integer argument, no memory.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETPERSIST, 1 as libc::c_ulong) };
    if rc < 0 {
        return Err(Error::sys(
            format!("TUNSETPERSIST {name}"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

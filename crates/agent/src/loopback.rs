//! Brings up the loopback interface with SIOCSIFFLAGS, as `ip link set lo up` would.
//! The kernel adds 127.0.0.1/8 and ::1 by itself when `lo` goes up.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Sets IFF_UP (and IFF_RUNNING) on `lo`. Returns whether it was already up.
pub fn bring_up() -> io::Result<bool> {
    // SAFETY: socket(2) with constant arguments; the result is checked below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };

    // SAFETY: ifreq is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the name and writes the flags member of the ifreq we
    // own, which outlives the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFFLAGS succeeded, so the union holds ifru_flags.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    let up = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    if flags & libc::IFF_UP as libc::c_short != 0 {
        return Ok(true);
    }
    req.ifr_ifru.ifru_flags = flags | up;
    // SAFETY: as above; SIOCSIFFLAGS only reads the ifreq.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(false)
}

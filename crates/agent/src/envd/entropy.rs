//! Reseeding the kernel RNG with entropy from the host: after a snapshot is
//! restored or a VM forked, every copy starts from the same RNG state, so the
//! host hands each one fresh bytes through `/init` before it serves anything.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;

/// `RNDADDENTROPY`: `_IOW('R', 0x03, int[2])`.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `RNDRESEEDCRNG`: `_IO('R', 0x07)`.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
/// More than this is no more random; it only costs time.
const MAX_BYTES: usize = 512;

/// Mixes `bytes` into the kernel's pool, credited as entropy, then reseeds
/// the CRNG so that the next read of `/dev/urandom` already depends on them.
pub fn reseed(bytes: &[u8]) -> std::io::Result<()> {
    let bytes = &bytes[..bytes.len().min(MAX_BYTES)];
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + bytes.len());
    info.extend_from_slice(&((bytes.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(bytes.len() as i32).to_ne_bytes());
    info.extend_from_slice(bytes);
    let random = OpenOptions::new().write(true).open("/dev/random")?;
    // SAFETY: `info` is a rand_pool_info whose buf_size matches the bytes that
    // follow the two ints; the kernel only reads it.
    if unsafe { libc::ioctl(random.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: an argument-less ioctl on a descriptor we own.
    if unsafe { libc::ioctl(random.as_raw_fd(), RNDRESEEDCRNG) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn reseeding_works_for_root_and_is_refused_otherwise() {
        let result = super::reseed(&[0x5a; 64]);
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            result.unwrap();
        } else {
            assert!(result.is_err());
        }
    }
}

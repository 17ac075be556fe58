//! A Linux tap device as the frame backend: `/dev/net/tun` attached to a named
//! interface with `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`, non-blocking.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use super::VNET_HDR_LEN;
use super::backend::FrameBackend;

const TUN_PATH: &str = "/dev/net/tun";

/// Interface names are at most 15 bytes plus the NUL (`IFNAMSIZ`).
pub const MAX_IFNAME_LEN: usize = libc::IFNAMSIZ - 1;

#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error(
        "tap name {0:?} is invalid: 1 to {MAX_IFNAME_LEN} bytes, no '/', whitespace, ':' or '%'"
    )]
    InvalidName(String),
    #[error("cannot open {TUN_PATH}: {0}")]
    OpenTun(#[source] io::Error),
    #[error("cannot attach to tap {name} (TUNSETIFF): {source}")]
    Attach {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot set the virtio-net header size on tap {name}: {source}")]
    VnetHdr {
        name: String,
        #[source]
        source: io::Error,
    },
}

/// The tap offloads (`TUN_F_*`) matching what the guest driver accepted: the tap
/// may then hand the device partially checksummed and segmentation-offloaded
/// frames, which only a driver that acked the `GUEST_*` features can take. What
/// the guest sends (the `HOST_*` features) a tap with a vnet header always takes.
pub fn offloads_for(acked_features: u64) -> libc::c_uint {
    use virtio_bindings::virtio_net::{
        VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_ECN, VIRTIO_NET_F_GUEST_TSO4,
        VIRTIO_NET_F_GUEST_TSO6, VIRTIO_NET_F_GUEST_UFO,
    };
    let has = |bit: u32| acked_features & (1 << bit) != 0;
    // Every segmentation offload needs checksum offload under it (the kernel
    // refuses TSO without TUN_F_CSUM).
    if !has(VIRTIO_NET_F_GUEST_CSUM) {
        return 0;
    }
    let mut flags = libc::TUN_F_CSUM;
    for (bit, flag) in [
        (VIRTIO_NET_F_GUEST_TSO4, libc::TUN_F_TSO4),
        (VIRTIO_NET_F_GUEST_TSO6, libc::TUN_F_TSO6),
        (VIRTIO_NET_F_GUEST_ECN, libc::TUN_F_TSO_ECN),
        (VIRTIO_NET_F_GUEST_UFO, libc::TUN_F_UFO),
    ] {
        if has(bit) {
            flags |= flag;
        }
    }
    flags
}

/// `struct ifreq` as TUNSETIFF reads it: the name, then the flags in the union.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _rest: [u8; 22],
}

/// An open tap device; the interface stays attached while this lives.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

/// Whether `name` can name a network interface (the kernel's `dev_valid_name`, and no
/// `%`, which TUNSETIFF would expand into a new name).
pub fn valid_ifname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_IFNAME_LEN
        && name != "."
        && name != ".."
        && !name
            .bytes()
            .any(|b| b == b'/' || b == b':' || b == b'%' || b == 0 || b.is_ascii_whitespace())
}

impl Tap {
    /// Attaches to the tap called `name`, creating it (non-persistent) if no interface
    /// has that name; fails for an interface that is not a tap or is already in use.
    pub fn open(name: &str) -> Result<Tap, TapError> {
        if !valid_ifname(name) {
            return Err(TapError::InvalidName(name.to_owned()));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(TUN_PATH)
            .map_err(TapError::OpenTun)?;

        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            // The flags fit in a short (the kernel's ifr_flags).
            flags: (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short,
            _rest: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: `file` is an open /dev/net/tun descriptor and `req` is a live,
        // ifreq-sized and -shaped buffer the kernel reads and writes for TUNSETIFF.
        let ret = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) };
        if ret < 0 {
            return Err(TapError::Attach {
                name: name.to_owned(),
                source: io::Error::last_os_error(),
            });
        }

        let hdr_len = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer, which points
        // at a live local.
        let ret = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &hdr_len) };
        if ret < 0 {
            return Err(TapError::VnetHdr {
                name: name.to_owned(),
                source: io::Error::last_os_error(),
            });
        }
        Ok(Tap {
            file,
            name: name.to_owned(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

impl FrameBackend for Tap {
    fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // A tap returns exactly one frame per read.
        self.file.read(buf)
    }

    fn write_frame(&mut self, frame: &[u8]) -> io::Result<()> {
        // A tap takes one frame per write, whole or not at all.
        let n = self.file.write(frame)?;
        if n != frame.len() {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "short tap write"));
        }
        Ok(())
    }

    fn set_offloads(&mut self, tun_flags: libc::c_uint) -> io::Result<()> {
        // SAFETY: TUNSETOFFLOAD takes its argument by value; the descriptor is an
        // attached tap.
        let ret = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                libc::TUNSETOFFLOAD,
                libc::c_ulong::from(tun_flags),
            )
        };
        if ret < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offloads_follow_the_guest_features() {
        use virtio_bindings::virtio_net::*;
        let bit = |b: u32| 1u64 << b;
        assert_eq!(offloads_for(0), 0);
        // Segmentation without checksum offload is not a valid tap setting.
        assert_eq!(offloads_for(bit(VIRTIO_NET_F_GUEST_TSO4)), 0);
        assert_eq!(offloads_for(bit(VIRTIO_NET_F_GUEST_CSUM)), libc::TUN_F_CSUM);
        let all = bit(VIRTIO_NET_F_GUEST_CSUM)
            | bit(VIRTIO_NET_F_GUEST_TSO4)
            | bit(VIRTIO_NET_F_GUEST_TSO6)
            | bit(VIRTIO_NET_F_GUEST_UFO)
            // Host-side features say nothing about what the tap may send.
            | bit(VIRTIO_NET_F_HOST_TSO4)
            | bit(VIRTIO_NET_F_CSUM);
        assert_eq!(
            offloads_for(all),
            libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6 | libc::TUN_F_UFO
        );
    }

    #[test]
    fn interface_names() {
        assert!(valid_ifname("tap0"));
        assert!(valid_ifname("a23456789012345"));
        for bad in [
            "",
            "a234567890123456",
            "a/b",
            "a b",
            "eth0:1",
            "tap%d",
            ".",
            "..",
        ] {
            assert!(!valid_ifname(bad), "{bad:?}");
            assert!(matches!(Tap::open(bad), Err(TapError::InvalidName(_))));
        }
    }

    /// Needs root and /dev/net/tun, as the VMM itself does to use a tap.
    #[test]
    fn opens_a_tap_and_refuses_other_interfaces() {
        let name = format!("sfkt{}", std::process::id() % 100_000);
        let tap = Tap::open(&name).unwrap();
        assert_eq!(tap.name(), name);
        assert!(
            std::path::Path::new("/sys/class/net").join(&name).exists(),
            "the tap interface exists while open"
        );
        // A non-multiqueue tap takes one user at a time.
        assert!(matches!(Tap::open(&name), Err(TapError::Attach { .. })));
        // A nothing-to-read tap is non-blocking.
        let mut tap = tap;
        let mut buf = [0u8; 64];
        assert_eq!(
            tap.read_frame(&mut buf).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        // The offloads a driver with every GUEST_* feature gets, and back to none.
        tap.set_offloads(libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6 | libc::TUN_F_UFO)
            .unwrap();
        tap.set_offloads(0).unwrap();
        drop(tap);
        // Not a tap.
        let err = Tap::open("lo").unwrap_err();
        assert!(matches!(err, TapError::Attach { .. }), "{err}");
        assert!(err.to_string().contains("tap lo"), "{err}");
    }
}

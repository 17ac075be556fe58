//! The guest's network interface, configured by PID 1 with the fixed addressing
//! every sandbox has (a snapshot ABI: a template carries it, restores and fork
//! children run in other network namespaces behind a tap of the same name, and
//! nothing in the guest changes).
//!
//! In process with ioctls (no `ip` in the image is assumed), once at boot: a
//! restored guest keeps its interface as it was. Without `eth0` it does nothing.
//! The MTU is left as the virtio-net driver set it (the device's
//! `VIRTIO_NET_F_MTU` when it offers one, 1500 otherwise).

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// The interface, its address and the gateway (the tap `tap0` in the VMM's
/// namespace), which is also the resolver.
pub const IFACE: &str = "eth0";
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 21);
pub const NETMASK: Ipv4Addr = Ipv4Addr::new(255, 255, 255, 252);
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 22);
pub const NAMESERVER: Ipv4Addr = GATEWAY;

const RESOLV_CONF: &str = "/etc/resolv.conf";
/// Where the file goes when the root is read-only, bind-mounted over the original.
const RESOLV_CONF_RUN: &str = "/run/sandfork/resolv.conf";

#[derive(Debug, thiserror::Error)]
pub enum GuestNetError {
    #[error("{step} on {IFACE}: {source}")]
    Ioctl {
        step: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("socket for interface configuration: {0}")]
    Socket(#[source] io::Error),
    #[error("writing {RESOLV_CONF}: {0}")]
    ResolvConf(#[source] io::Error),
}

/// What [`configure`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The guest has no `eth0`.
    NoInterface,
    Configured,
}

/// Brings `eth0` up with the fixed address, a default route via the gateway, IPv6
/// off and the resolver in /etc/resolv.conf. Steps already done are no error.
pub fn configure() -> Result<Outcome, GuestNetError> {
    if !Path::new("/sys/class/net").join(IFACE).exists() {
        return Ok(Outcome::NoInterface);
    }
    // Before the link goes up, so it never gets an IPv6 link-local address or
    // sends router solicitations: the slot has no IPv6.
    disable_ipv6();
    let sock = socket()?;
    set_addr(&sock, libc::SIOCSIFADDR, GUEST_IP, "SIOCSIFADDR")?;
    set_addr(&sock, libc::SIOCSIFNETMASK, NETMASK, "SIOCSIFNETMASK")?;
    set_up(&sock)?;
    add_default_route(&sock)?;
    write_resolv_conf().map_err(GuestNetError::ResolvConf)?;
    Ok(Outcome::Configured)
}

fn disable_ipv6() {
    let knob = format!("/proc/sys/net/ipv6/conf/{IFACE}/disable_ipv6");
    if let Err(e) = std::fs::write(&knob, "1") {
        // A kernel without IPv6 has no knob, and no IPv6 to turn off.
        log::debug!("{knob}: {e}");
    }
}

fn socket() -> Result<OwnedFd, GuestNetError> {
    // SAFETY: socket(2) with constant arguments; the result is checked below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(GuestNetError::Socket(io::Error::last_os_error()));
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn ifreq() -> libc::ifreq {
    // SAFETY: ifreq is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(IFACE.as_bytes()) {
        *dst = *src as libc::c_char;
    }
    req
}

fn sockaddr_in(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr are both 16 bytes of plain data; the kernel
    // reads an AF_INET sockaddr as a sockaddr_in.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn ioctl_err(step: &'static str) -> GuestNetError {
    GuestNetError::Ioctl {
        step,
        source: io::Error::last_os_error(),
    }
}

fn set_addr(
    sock: &OwnedFd,
    request: libc::c_ulong,
    addr: Ipv4Addr,
    step: &'static str,
) -> Result<(), GuestNetError> {
    let mut req = ifreq();
    req.ifr_ifru.ifru_addr = sockaddr_in(addr);
    // SAFETY: SIOCSIFADDR/SIOCSIFNETMASK only read the ifreq we own, which
    // outlives the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), request as _, &req) } < 0 {
        return Err(ioctl_err(step));
    }
    Ok(())
}

fn set_up(sock: &OwnedFd) -> Result<(), GuestNetError> {
    let mut req = ifreq();
    // SAFETY: SIOCGIFFLAGS reads the name and writes the flags of our ifreq.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(ioctl_err("SIOCGIFFLAGS"));
    }
    // SAFETY: SIOCGIFFLAGS succeeded, so the union holds ifru_flags.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    req.ifr_ifru.ifru_flags = flags | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    // SAFETY: as above; SIOCSIFFLAGS only reads the ifreq.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(ioctl_err("SIOCSIFFLAGS"));
    }
    Ok(())
}

/// The kernel's `struct rtentry` (`include/uapi/linux/route.h`), which the libc
/// crate defines only for some C libraries.
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_pad4: *mut libc::c_void,
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

fn add_default_route(sock: &OwnedFd) -> Result<(), GuestNetError> {
    let mut dev = *b"eth0\0";
    let route = RtEntry {
        rt_pad1: 0,
        rt_dst: sockaddr_in(Ipv4Addr::UNSPECIFIED),
        rt_gateway: sockaddr_in(GATEWAY),
        rt_genmask: sockaddr_in(Ipv4Addr::UNSPECIFIED),
        rt_flags: libc::RTF_UP | libc::RTF_GATEWAY,
        rt_pad2: 0,
        rt_pad3: 0,
        rt_pad4: std::ptr::null_mut(),
        rt_metric: 0,
        rt_dev: dev.as_mut_ptr().cast(),
        rt_mtu: 0,
        rt_window: 0,
        rt_irtt: 0,
    };
    // SAFETY: SIOCADDRT reads a struct rtentry, laid out as the kernel's, and the
    // NUL-terminated device name it points to; both outlive the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCADDRT, &route) } < 0 {
        let source = io::Error::last_os_error();
        if source.raw_os_error() == Some(libc::EEXIST) {
            return Ok(());
        }
        return Err(GuestNetError::Ioctl {
            step: "SIOCADDRT (default route)",
            source,
        });
    }
    Ok(())
}

/// The resolver file's text.
pub fn resolv_conf() -> String {
    format!("nameserver {NAMESERVER}\n")
}

/// Writes /etc/resolv.conf; on a read-only root, bind-mounts a copy in /run over
/// it (which needs the file to exist to mount on).
fn write_resolv_conf() -> io::Result<()> {
    let text = resolv_conf();
    if std::fs::read_to_string(RESOLV_CONF).is_ok_and(|t| t == text) {
        return Ok(());
    }
    match std::fs::write(RESOLV_CONF, &text) {
        Ok(()) => return Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EROFS) => {}
        Err(e) => return Err(e),
    }
    if let Some(dir) = Path::new(RESOLV_CONF_RUN).parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(RESOLV_CONF_RUN, &text)?;
    nix::mount::mount(
        Some(RESOLV_CONF_RUN),
        RESOLV_CONF,
        None::<&str>,
        nix::mount::MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fixed_addresses_share_one_slash_30() {
        let net = |a: Ipv4Addr| u32::from(a) & u32::from(NETMASK);
        assert_eq!(net(GUEST_IP), net(GATEWAY));
        assert_eq!(resolv_conf(), "nameserver 169.254.0.22\n");
    }

    #[test]
    fn sockaddr_holds_the_address_in_network_order() {
        let sa = sockaddr_in(GATEWAY);
        assert_eq!(sa.sa_family, libc::AF_INET as libc::sa_family_t);
        // sin_port (2 bytes), then sin_addr.
        let bytes: Vec<u8> = sa.sa_data[2..6].iter().map(|&b| b as u8).collect();
        assert_eq!(bytes, [169, 254, 0, 22]);
    }

    #[test]
    fn rtentry_is_the_kernels_size() {
        // x86_64 and aarch64: 120 bytes.
        assert_eq!(std::mem::size_of::<RtEntry>(), 120);
    }
}

//! What the net worker moves frames through: a tap on the host, a socket in tests.

use std::io;
use std::os::fd::AsRawFd;

/// A non-blocking, frame-preserving host endpoint. Every frame starts with the
/// 12-byte virtio-net header ([`super::VNET_HDR_LEN`]).
pub trait FrameBackend: AsRawFd + Send {
    /// Reads one whole frame into `buf`; `WouldBlock` when none is waiting. A frame
    /// longer than `buf` may be cut short, so pass [`super::MAX_FRAME_LEN`] bytes.
    fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize>;

    /// Writes one whole frame.
    fn write_frame(&mut self, frame: &[u8]) -> io::Result<()>;

    /// Which offloaded frames (`TUN_F_*`) the backend may hand the device, from
    /// what the driver accepted ([`super::tap::offloads_for`]). Backends that
    /// only pass frames on as they are need nothing.
    fn set_offloads(&mut self, _tun_flags: libc::c_uint) -> io::Result<()> {
        Ok(())
    }
}

/// A datagram socket works as a backend (message boundaries are kept): the other end
/// of a `UnixDatagram::pair` plays the host network in tests.
impl FrameBackend for std::os::unix::net::UnixDatagram {
    fn read_frame(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.recv(buf)
    }

    fn write_frame(&mut self, frame: &[u8]) -> io::Result<()> {
        let n = self.send(frame)?;
        if n != frame.len() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "short datagram write",
            ));
        }
        Ok(())
    }
}

//! AF_VSOCK listener and stream for tokio, on `socket2` (already in tokio's tree)
//! rather than a vsock crate that would pull a second `nix` and `futures`.

use std::io::{self, Read, Write};
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use socket2::{Domain, SockAddr, Socket, Type};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Accept connections from any CID: the host (CID 2) in a microVM.
pub const VMADDR_CID_ANY: u32 = libc::VMADDR_CID_ANY;

pub struct VsockListener {
    fd: AsyncFd<Socket>,
    port: u32,
}

impl VsockListener {
    /// Binds `port` on every CID. Fails with EAFNOSUPPORT when the kernel has no vsock.
    pub fn bind(port: u32) -> io::Result<Self> {
        let sock = Socket::new(Domain::VSOCK, Type::STREAM.nonblocking().cloexec(), None)?;
        sock.bind(&SockAddr::vsock(VMADDR_CID_ANY, port))?;
        sock.listen(128)?;
        Ok(Self {
            fd: register(sock)?,
            port,
        })
    }

    pub fn port(&self) -> u32 {
        self.port
    }

    /// Accepts one connection, returning the peer's (CID, port).
    pub async fn accept(&self) -> io::Result<(VsockStream, (u32, u32))> {
        loop {
            let mut guard = self.fd.readable().await?;
            match guard.try_io(|fd| fd.get_ref().accept()) {
                Ok(Ok((sock, addr))) => {
                    sock.set_nonblocking(true)?;
                    let peer = addr.as_vsock_address().unwrap_or((0, 0));
                    return Ok((
                        VsockStream {
                            fd: register(sock)?,
                        },
                        peer,
                    ));
                }
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }
}

impl axum::serve::Listener for VsockListener {
    type Io = VsockStream;
    type Addr = (u32, u32);

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match VsockListener::accept(self).await {
                Ok(conn) => return conn,
                Err(e) if is_per_connection(&e) => {}
                Err(e) => {
                    // EMFILE and the like: wait for descriptors to be freed.
                    log::warn!("vsock accept: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok((VMADDR_CID_ANY, self.port))
    }
}

/// Registers a socket with tokio's reactor.
fn register(sock: Socket) -> io::Result<AsyncFd<Socket>> {
    // SAFETY: a `Socket` owns its descriptor: it stays open, and `as_raw_fd`
    // returns the same number, until the `Socket` (here, the AsyncFd) is dropped.
    Ok(unsafe { AsyncFd::register(sock) }?)
}

fn is_per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::Interrupted
    )
}

/// A connected vsock stream, readable and writable as plain bytes.
pub struct VsockStream {
    fd: AsyncFd<Socket>,
}

impl AsyncRead for VsockStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|fd| fd.get_ref().read(unfilled)) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for VsockStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            match guard.try_io(|fd| fd.get_ref().write(data)) {
                Ok(result) => return Poll::Ready(result),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.fd.get_ref().shutdown(std::net::Shutdown::Write))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Binding needs only the AF_VSOCK socket family, not a transport; where the
    /// kernel has none at all, the error must be the one main() treats as "skip".
    #[tokio::test]
    async fn bind_works_or_reports_missing_family() {
        match VsockListener::bind(0xFFFF_0000 + std::process::id() % 0xFFFF) {
            Ok(l) => {
                use axum::serve::Listener;
                assert_eq!(l.local_addr().unwrap().0, VMADDR_CID_ANY);
            }
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EAFNOSUPPORT), "{e}"),
        }
    }
}

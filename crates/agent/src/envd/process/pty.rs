//! Pseudo-terminals for `Start` with `pty`: open with a size, resize, and async
//! reads and writes on the master side.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::fcntl::{FcntlArg, FdFlag, OFlag, fcntl};
use nix::pty::{Winsize, openpty};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// The rows and columns a terminal gets when the request gives 0.
const DEFAULT_COLS: u16 = 80;
const DEFAULT_ROWS: u16 = 24;

fn winsize(cols: u32, rows: u32) -> Winsize {
    let clamp = |v: u32, default: u16| match v {
        0 => default,
        v => u16::try_from(v).unwrap_or(u16::MAX),
    };
    Winsize {
        ws_row: clamp(rows, DEFAULT_ROWS),
        ws_col: clamp(cols, DEFAULT_COLS),
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

fn set_cloexec(fd: &OwnedFd) -> io::Result<()> {
    fcntl(fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
    Ok(())
}

/// Opens a pty pair of the given size. Both ends are close-on-exec (openpty
/// does not set it), so no later child inherits them by accident; the child
/// that should gets the slave through dup2, which clears the flag.
pub fn open(cols: u32, rows: u32) -> io::Result<(OwnedFd, OwnedFd)> {
    let ws = winsize(cols, rows);
    let pair = openpty(Some(&ws), None)?;
    set_cloexec(&pair.master)?;
    set_cloexec(&pair.slave)?;
    Ok((pair.master, pair.slave))
}

nix::ioctl_write_ptr_bad!(tiocswinsz, libc::TIOCSWINSZ, Winsize);

/// The master side, readable and writable from async code.
pub struct Master {
    fd: AsyncFd<OwnedFd>,
}

impl Master {
    pub fn new(fd: OwnedFd) -> io::Result<Self> {
        let flags = OFlag::from_bits_truncate(fcntl(&fd, FcntlArg::F_GETFL)?);
        fcntl(&fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
        // SAFETY: an OwnedFd is open and keeps referring to the same file
        // until it is dropped, which is when the AsyncFd is dropped.
        let fd =
            unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE | Interest::WRITABLE) }
                .map_err(io::Error::from)?;
        Ok(Self { fd })
    }

    /// Sets the terminal size (the kernel sends SIGWINCH to the foreground
    /// process group).
    pub fn resize(&self, cols: u32, rows: u32) -> io::Result<()> {
        let ws = winsize(cols, rows);
        // SAFETY: TIOCSWINSZ reads one Winsize from the pointer, which is valid
        // for the duration of the call; the fd is our open pty master.
        unsafe { tiocswinsz(self.fd.get_ref().as_raw_fd(), &ws) }?;
        Ok(())
    }

    /// Reads what the terminal printed. Ok(0) once every slave end is closed
    /// (Linux reports that as EIO on the master).
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.fd.readable().await?;
            match guard.try_io(|fd| Ok(nix::unistd::read(fd.get_ref().as_fd(), buf)?)) {
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Ok(result) => return result,
                Err(_would_block) => continue,
            }
        }
    }

    /// Writes all of `data` as terminal input.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.fd.writable().await?;
            match guard.try_io(|fd| Ok(nix::unistd::write(fd.get_ref(), data)?)) {
                Ok(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::termios::tcgetattr;

    #[test]
    fn sizes_default_and_clamp() {
        let w = winsize(0, 0);
        assert_eq!((w.ws_col, w.ws_row), (80, 24));
        let w = winsize(100_000, 50);
        assert_eq!((w.ws_col, w.ws_row), (u16::MAX, 50));
    }

    #[tokio::test]
    async fn master_and_slave_talk_and_resize() {
        let (master, slave) = open(120, 40).unwrap();
        assert!(tcgetattr(&slave).is_ok(), "slave is a terminal");
        let m = Master::new(master).unwrap();
        m.resize(132, 43).unwrap();
        let mut ws = winsize(0, 0);
        // SAFETY: TIOCGWINSZ writes one Winsize into the valid pointer.
        let rc = unsafe { libc::ioctl(slave.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) };
        assert_eq!(rc, 0);
        assert_eq!((ws.ws_col, ws.ws_row), (132, 43));

        // Written on the slave, read on the master (with ONLCR: \n -> \r\n).
        nix::unistd::write(&slave, b"hi\n").unwrap();
        let mut buf = [0u8; 64];
        let n = m.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"hi\r\n");
        // Closing the slave ends the master's reads.
        drop(slave);
        assert_eq!(m.read(&mut buf).await.unwrap(), 0);
    }
}

//! A writer for the "newc" cpio format the kernel unpacks as an initramfs.
//! Fixed owners and times keep the archive a pure function of its contents.

use std::io::{self, Write};

pub struct CpioWriter<W: Write> {
    out: W,
    next_ino: u32,
}

impl<W: Write> CpioWriter<W> {
    pub fn new(out: W) -> Self {
        CpioWriter { out, next_ino: 1 }
    }

    pub fn dir(&mut self, name: &str) -> io::Result<()> {
        self.entry(name, 0o040_755, 2, (0, 0), &[])
    }

    pub fn file(&mut self, name: &str, mode: u32, data: &[u8]) -> io::Result<()> {
        self.entry(name, 0o100_000 | (mode & 0o7777), 1, (0, 0), data)
    }

    pub fn char_dev(&mut self, name: &str, mode: u32, major: u32, minor: u32) -> io::Result<()> {
        self.entry(name, 0o020_000 | (mode & 0o7777), 1, (major, minor), &[])
    }

    /// Writes the trailer and hands back the output.
    pub fn finish(mut self) -> io::Result<W> {
        self.entry("TRAILER!!!", 0, 1, (0, 0), &[])?;
        Ok(self.out)
    }

    fn entry(
        &mut self,
        name: &str,
        mode: u32,
        nlink: u32,
        rdev: (u32, u32),
        data: &[u8],
    ) -> io::Result<()> {
        let size = u32::try_from(data.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "cpio entry over 4 GiB"))?;
        let name_len = u32::try_from(name.len() + 1)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "cpio name too long"))?;
        let ino = if name == "TRAILER!!!" {
            0
        } else {
            self.next_ino
        };
        self.next_ino += 1;
        let fields = [
            ino, mode, 0, 0, nlink, 0, size, 0, 0, rdev.0, rdev.1, name_len, 0,
        ];
        let mut header = String::with_capacity(110);
        header.push_str("070701");
        for f in fields {
            header.push_str(&format!("{f:08x}"));
        }
        self.out.write_all(header.as_bytes())?;
        self.out.write_all(name.as_bytes())?;
        self.out.write_all(&[0])?;
        self.pad(110 + name.len() + 1)?;
        self.out.write_all(data)?;
        self.pad(data.len())
    }

    fn pad(&mut self, len: usize) -> io::Result<()> {
        let n = (4 - len % 4) % 4;
        self.out.write_all(&[0u8; 3][..n])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_aligned_and_terminated() {
        let mut w = CpioWriter::new(Vec::new());
        w.dir("bin").unwrap();
        w.file("init", 0o755, b"#!/bin/sh\n").unwrap();
        w.char_dev("dev/console", 0o600, 5, 1).unwrap();
        let out = w.finish().unwrap();
        assert_eq!(out.len() % 4, 0);
        assert!(out.starts_with(b"070701"));
        // Header of "bin": inode 1, directory mode, name length 4.
        let h = std::str::from_utf8(&out[..110]).unwrap();
        assert_eq!(&h[6..14], "00000001");
        assert_eq!(&h[14..22], "000041ed");
        assert_eq!(&h[94..102], "00000004");
        // The file's data starts 4-aligned after its header and name.
        let init_at = out.windows(5).position(|w| w == b"init\0").unwrap();
        let data_at = (init_at + 5).next_multiple_of(4);
        assert_eq!(&out[data_at..data_at + 10], b"#!/bin/sh\n");
        let trailer = out.windows(10).rposition(|w| w == b"TRAILER!!!").unwrap();
        assert!(trailer > data_at);
    }

    #[test]
    fn the_host_cpio_tool_reads_it_back() {
        // Cross-check against GNU cpio where the host has it.
        let Ok(status) = std::process::Command::new("cpio")
            .arg("--version")
            .stdout(std::process::Stdio::null())
            .status()
        else {
            eprintln!("cpio not installed; skipped the cross-check");
            return;
        };
        assert!(status.success());
        let mut w = CpioWriter::new(Vec::new());
        w.dir("d").unwrap();
        w.file("d/f", 0o644, b"hello").unwrap();
        let archive = w.finish().unwrap();
        let mut child = std::process::Command::new("cpio")
            .args(["-t", "--quiet"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(&archive).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        assert_eq!(String::from_utf8(out.stdout).unwrap(), "d\nd/f\n");
    }
}

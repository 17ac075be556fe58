//! A cap on what the guest's serial console may write to the host: its
//! output goes to a file (often on a tmpfs), and a guest printing without
//! end must not fill the host's memory or disk.

use std::io::{self, Write};

const TRUNCATED: &[u8] = b"\n[sandfork-vmm: console output limit reached; the rest is dropped]\n";

/// Passes at most `budget` bytes to `inner`, then one notice; the rest is
/// accepted and dropped (a guest blocked on its console would hang).
#[derive(Debug)]
pub struct ConsoleBudget<W> {
    inner: W,
    left: u64,
    noticed: bool,
}

impl<W: Write> ConsoleBudget<W> {
    pub fn new(inner: W, budget: u64) -> Self {
        ConsoleBudget {
            inner,
            left: budget,
            noticed: false,
        }
    }
}

impl<W: Write> Write for ConsoleBudget<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.left == 0 {
            if !self.noticed {
                self.noticed = true;
                self.inner.write_all(TRUNCATED)?;
                self.inner.flush()?;
            }
            return Ok(buf.len());
        }
        let take = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let written = self.inner.write(&buf[..take])?;
        self.left -= written as u64;
        Ok(written)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_the_budget_then_one_notice_then_nothing() {
        let mut out = ConsoleBudget::new(Vec::new(), 10);
        out.write_all(b"0123456").unwrap();
        out.write_all(b"789abc").unwrap();
        for _ in 0..1000 {
            out.write_all(b"more and more").unwrap();
        }
        out.flush().unwrap();
        let mut expected = b"0123456789".to_vec();
        expected.extend_from_slice(TRUNCATED);
        assert_eq!(out.inner, expected);
    }

    #[test]
    fn a_zero_budget_writes_only_the_notice() {
        let mut out = ConsoleBudget::new(Vec::new(), 0);
        out.write_all(b"x").unwrap();
        assert_eq!(out.inner, TRUNCATED);
    }
}

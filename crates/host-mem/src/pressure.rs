//! The kernel's pressure stall information for memory
//! (`/proc/pressure/memory`, or a cgroup's `memory.pressure`): the share of
//! time some (`some`) or all (`full`) non-idle tasks waited for memory,
//! averaged over 10, 60 and 300 s, and the total stall time.
//!
//! ```text
//! some avg10=0.00 avg60=0.00 avg300=0.00 total=0
//! full avg10=0.00 avg60=0.00 avg300=0.00 total=0
//! ```
//!
//! A kernel built without PSI has no such file; one built with it disabled
//! by default (Debian's, until booted with `psi=1`) answers `EOPNOTSUPP`.

use std::io;
use std::path::Path;

/// One line of a pressure file.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stall {
    /// Percent of the last 10 s.
    pub avg10: f64,
    pub avg60: f64,
    pub avg300: f64,
    /// Stall time since boot, in microseconds.
    pub total_us: u64,
}

/// A pressure file: `some` and `full` stalls.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pressure {
    pub some: Stall,
    pub full: Stall,
}

/// `EOPNOTSUPP` on Linux: the errno of a pressure file PSI is disabled for.
const EOPNOTSUPP: i32 = 95;

pub const HOST_MEMORY: &str = "/proc/pressure/memory";

impl Pressure {
    /// The host's memory pressure; `None` when the kernel does not track it.
    pub fn memory() -> io::Result<Option<Pressure>> {
        Pressure::read(Path::new(HOST_MEMORY))
    }

    /// The pressure file `path`; `None` when it is absent or not supported.
    pub fn read(path: &Path) -> io::Result<Option<Pressure>> {
        match std::fs::read_to_string(path) {
            Ok(text) => Pressure::parse(&text).map(Some).ok_or_else(|| {
                io::Error::other(format!("{}: not a pressure file", path.display()))
            }),
            Err(e)
                if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(EOPNOTSUPP) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// From a pressure file's text; `None` without its `some` line. Kernels
    /// before 5.13 had no `full` line for CPU; for memory it is always there
    /// (absent: zero).
    pub fn parse(text: &str) -> Option<Pressure> {
        let mut some = None;
        let mut full = None;
        for line in text.lines() {
            let mut words = line.split_whitespace();
            let slot = match words.next() {
                Some("some") => &mut some,
                Some("full") => &mut full,
                _ => continue,
            };
            *slot = Some(parse_stall(words)?);
        }
        Some(Pressure {
            some: some?,
            full: full.unwrap_or_default(),
        })
    }
}

fn parse_stall<'a>(words: impl Iterator<Item = &'a str>) -> Option<Stall> {
    let mut stall = Stall::default();
    let mut seen = 0;
    for word in words {
        let (key, value) = word.split_once('=')?;
        match key {
            "avg10" => stall.avg10 = value.parse().ok()?,
            "avg60" => stall.avg60 = value.parse().ok()?,
            "avg300" => stall.avg300 = value.parse().ok()?,
            "total" => stall.total_us = value.parse().ok()?,
            _ => continue,
        }
        seen += 1;
    }
    (seen == 4).then_some(stall)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_lines_are_parsed() {
        let text = "some avg10=1.50 avg60=0.79 avg300=0.48 total=2169208\n\
                    full avg10=12.25 avg60=0.34 avg300=0.20 total=1058094\n";
        let p = Pressure::parse(text).unwrap();
        assert_eq!(
            p.some,
            Stall {
                avg10: 1.5,
                avg60: 0.79,
                avg300: 0.48,
                total_us: 2_169_208
            }
        );
        assert_eq!((p.full.avg10, p.full.total_us), (12.25, 1_058_094));
        // Only `some` (an old kernel's CPU file): `full` is zero.
        let p = Pressure::parse("some avg10=0.00 avg60=0.00 avg300=0.00 total=7\n").unwrap();
        assert_eq!((p.some.total_us, p.full), (7, Stall::default()));
        for bad in [
            "",
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
            "some avg10=x avg60=0.00 avg300=0.00 total=0\n",
            "some avg10=0.00 total=0\n",
        ] {
            assert_eq!(Pressure::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_missing_file_is_no_pressure_information() {
        let dir = std::env::temp_dir().join(format!("no-psi-{}", std::process::id()));
        assert_eq!(Pressure::read(&dir.join("memory")).unwrap(), None);
        // This host's file, when it has one, parses.
        if let Ok(text) = std::fs::read_to_string(HOST_MEMORY) {
            assert!(Pressure::parse(&text).is_some(), "{text}");
            assert!(Pressure::memory().unwrap().is_some());
        }
    }
}

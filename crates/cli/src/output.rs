//! How commands print: aligned tables for people on a terminal, JSON for
//! programs (when stdout is not a terminal, or with `--json`).

use std::io::{IsTerminal, Write};
use std::time::{Duration, SystemTime};

use serde_json::Value;

/// Lets SIGPIPE end the program, as it does other Unix tools: a client
/// command piped into `head` stops quietly instead of failing on a write.
pub fn default_sigpipe() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    // SAFETY: installs the default disposition, no handler code runs.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
}

/// Whether to print JSON: asked for, or stdout is a pipe or file.
pub fn wants_json(flag: bool) -> bool {
    flag || !std::io::stdout().is_terminal()
}

/// Prints `value` as one JSON document on stdout.
pub fn print_json(value: &Value) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value)?;
    writeln!(out)?;
    Ok(())
}

/// Columns padded to their widest cell, two spaces apart.
pub fn print_table(header: &[&str], rows: &[Vec<String>]) -> anyhow::Result<()> {
    std::io::stdout()
        .lock()
        .write_all(table(header, rows).as_bytes())?;
    Ok(())
}

pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (cell, w) in cells.iter().zip(&widths) {
            s.push_str(&format!("{cell:<w$}  "));
        }
        s.trim_end().to_owned() + "\n"
    };
    let mut out = line(header.to_vec());
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

/// A string field, "" when absent.
pub fn field<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

/// An RFC 3339 time as "3m ago" / "in 4m" from now.
pub fn relative(rfc3339: &str) -> String {
    let Ok(t) = humantime::parse_rfc3339_weak(rfc3339) else {
        return rfc3339.to_owned();
    };
    let now = SystemTime::now();
    match t.duration_since(now) {
        Ok(ahead) => format!("in {}", short(ahead)),
        Err(e) => format!("{} ago", short(e.duration())),
    }
}

/// A duration in its largest whole unit: 45s, 3m, 2h, 5d.
pub fn short(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_columns() {
        let rows = vec![
            vec!["abc".to_owned(), "running".to_owned(), String::new()],
            vec!["d".to_owned(), "paused".to_owned(), "k=v".to_owned()],
        ];
        assert_eq!(
            table(&["ID", "STATE", "METADATA"], &rows),
            "ID   STATE    METADATA\nabc  running\nd    paused   k=v\n"
        );
    }

    #[test]
    fn durations_are_short() {
        assert_eq!(short(Duration::from_secs(5)), "5s");
        assert_eq!(short(Duration::from_secs(125)), "2m");
        assert_eq!(short(Duration::from_secs(7300)), "2h");
        assert_eq!(short(Duration::from_secs(200_000)), "2d");
        assert_eq!(relative("not a time"), "not a time");
        let later = humantime::format_rfc3339(SystemTime::now() + Duration::from_secs(600));
        assert!(
            relative(&later.to_string()).starts_with("in 9m")
                || relative(&later.to_string()).starts_with("in 10m")
        );
    }
}

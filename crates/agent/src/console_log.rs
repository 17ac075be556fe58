//! A `log` backend writing kmsg-style lines (`sandfork-agent: ...`) to stderr.
//!
//! The kernel starts init with fds 0-2 on /dev/console, so stderr *is* the console
//! in a microVM; `pid1::ensure_console` reopens it when the kernel could not. Each
//! line is written with one `write(2)` so lines from different tasks never interleave.

use std::io::Write;

use log::{Level, LevelFilter, Log, Metadata, Record};

pub const PREFIX: &str = "sandfork-agent:";

/// Environment variable choosing the log level (error, warn, info, debug, trace).
pub const LEVEL_ENV: &str = "SANDFORK_AGENT_LOG";

struct ConsoleLog;

static LOGGER: ConsoleLog = ConsoleLog;

/// Installs the logger. The level comes from `SANDFORK_AGENT_LOG`, default info.
pub fn init() {
    let level = std::env::var(LEVEL_ENV)
        .ok()
        .and_then(|v| v.parse::<LevelFilter>().ok())
        .unwrap_or(LevelFilter::Info);
    // Only fails when a logger is already set, which leaves logging working.
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(level);
}

/// Formats one log line, newline included.
pub fn format_line(level: Level, message: &std::fmt::Arguments<'_>) -> String {
    match level {
        Level::Info => format!("{PREFIX} {message}\n"),
        other => format!("{PREFIX} {}: {message}\n", other.as_str().to_lowercase()),
    }
}

impl Log for ConsoleLog {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let line = format_line(record.level(), record.args());
        // Nowhere to report a failed log write; dropping the line is all we can do.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn flush(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_carry_the_prefix_and_non_info_levels() {
        assert_eq!(
            format_line(Level::Info, &format_args!("up in {} ms", 3)),
            "sandfork-agent: up in 3 ms\n"
        );
        assert_eq!(
            format_line(Level::Warn, &format_args!("no vsock")),
            "sandfork-agent: warn: no vsock\n"
        );
    }
}

//! Progress of long CLI work (template builds, image conversions, forks of
//! many) on stderr, drawn by indicatif on a terminal only: piped or in CI
//! the command prints what it does once, and its output stays parseable.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A spinner with the elapsed time, under which log lines are printed.
pub struct Spinner {
    bar: ProgressBar,
}

impl Spinner {
    /// Starts one for `what`; without a terminal, nothing is drawn.
    pub fn start(what: &str) -> Spinner {
        let bar = match std::io::stderr().is_terminal() {
            true => ProgressBar::new_spinner(),
            false => ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden()),
        };
        // A constant template: it always parses.
        if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} ({elapsed})") {
            bar.set_style(style);
        }
        bar.set_message(what.to_owned());
        // Its ticker thread only where something is drawn.
        if !bar.is_hidden() {
            bar.enable_steady_tick(Duration::from_millis(120));
        }
        Spinner { bar }
    }

    /// As [`Spinner::start`], and without a terminal `what` is printed once
    /// (for work whose log follows it).
    pub fn announced(what: &str) -> Spinner {
        let spinner = Spinner::start(what);
        if spinner.bar.is_hidden() {
            eprintln!("{what}");
        }
        spinner
    }

    /// `line` on stderr above the spinner.
    pub fn log(&self, line: &str) {
        match self.bar.is_hidden() {
            true => eprintln!("{line}"),
            false => self.bar.println(line),
        }
    }

    /// How long since the start.
    pub fn elapsed(&self) -> Duration {
        self.bar.elapsed()
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

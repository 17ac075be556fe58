//! Runs a build step as a child process, streaming its merged stdout and
//! stderr to the build log line by line and keeping the tail for errors.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use crate::error::{BuildError, Result};

const TAIL_LINES: usize = 30;

/// What a finished step printed: its last lines, for error messages and for
/// recognising failures such as a missing package.
pub(crate) struct Output {
    pub tail: VecDeque<String>,
    pub success: bool,
    pub status: String,
}

impl Output {
    pub fn tail_text(&self) -> String {
        Vec::from(self.tail.clone()).join("\n")
    }

    pub fn mentions_no_space(&self) -> bool {
        self.tail
            .iter()
            .any(|l| l.contains("No space left on device"))
    }
}

/// `sh -c script` in a mount namespace of its own whose mounts do not
/// propagate back, so the `proc` and `dev` mounts a script makes in a tree
/// vanish with it. The script's `$0` is `sh`; the caller adds its arguments.
pub(crate) fn in_private_mounts(script: &str) -> Command {
    let mut cmd = Command::new("unshare");
    cmd.args([
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        script,
        "sh",
    ]);
    cmd
}

/// Runs `cmd`, sending each output line to `log`. Fails only if it cannot be
/// started; the caller judges the exit status with what it knows.
pub(crate) fn run(what: &str, cmd: &mut Command, log: &mut dyn FnMut(&str)) -> Result<Output> {
    let (reader, writer) =
        nix::unistd::pipe().map_err(|e| BuildError::io(format!("pipe for {what}"), e.into()))?;
    let writer2 = writer
        .try_clone()
        .map_err(|e| BuildError::io(format!("pipe for {what}"), e))?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(writer))
        .stderr(Stdio::from(writer2));
    let mut child = cmd
        .spawn()
        .map_err(|e| BuildError::io(format!("starting {what}"), e))?;
    // The Command keeps the write ends open: replace them so EOF arrives
    // when the child (and anything it left running) closes its copies.
    cmd.stdout(Stdio::null()).stderr(Stdio::null());

    let mut tail = VecDeque::with_capacity(TAIL_LINES);
    let mut lines = BufReader::new(File::from(reader));
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match lines.read_until(b'\n', &mut buf) {
            Ok(0) => break,
            Ok(_) => {
                let line = String::from_utf8_lossy(&buf);
                let line = line.trim_end_matches(['\n', '\r']);
                log(line);
                if tail.len() == TAIL_LINES {
                    tail.pop_front();
                }
                tail.push_back(line.to_owned());
            }
            Err(e) => return Err(BuildError::io(format!("reading output of {what}"), e)),
        }
    }
    let status = child
        .wait()
        .map_err(|e| BuildError::io(format!("waiting for {what}"), e))?;
    Ok(Output {
        tail,
        success: status.success(),
        status: status.to_string(),
    })
}

/// Runs `cmd` and turns a failure into an error (no space if it says so).
pub(crate) fn run_ok(what: &str, cmd: &mut Command, log: &mut dyn FnMut(&str)) -> Result<Output> {
    let out = run(what, cmd, log)?;
    if out.success {
        return Ok(out);
    }
    if out.mentions_no_space() {
        return Err(BuildError::NoSpace(what.to_owned()));
    }
    Err(BuildError::Command {
        what: what.to_owned(),
        status: out.status.clone(),
        tail: out.tail_text(),
    })
}

//! A process in a sandbox wired to this terminal: envd `Start` with a pty,
//! keys through `SendInput`, the terminal's size through `Update` on
//! SIGWINCH, and its exit code as this program's. Used by `run` (a new
//! sandbox's shell) and `exec -t` (a command in an existing one).

use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsFd;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Result, bail};
use bytes::Bytes;
use envd_proto::json::B64;
use envd_proto::process::{
    DataEvent, PATH_SEND_INPUT, PATH_UPDATE, ProcessConfig, ProcessEvent, ProcessInput,
    ProcessSelector, Pty, PtySize, SendInputRequest, SendInputResponse, StartRequest,
    UpdateRequest, UpdateResponse,
};
use nix::sys::termios::{self, SetArg, Termios};
use tokio::sync::mpsc;

use crate::client::envd::Sandbox;

/// The process's exit code as this program's: 0-255 as is, 255 otherwise
/// (ended by a signal).
pub fn exit_code(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(255))
}

pub fn need_terminal() -> Result<()> {
    if !std::io::stdin().is_terminal() || !std::io::stdout().is_terminal() {
        bail!(
            "a shell needs a terminal; without one use `sandfork create` and `sandfork exec ID -- CMD`"
        );
    }
    Ok(())
}

/// The local terminal's size.
fn terminal_size() -> PtySize {
    let mut ws = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one winsize into the struct we own.
    let ok = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) } == 0;
    if ok && ws.ws_row > 0 && ws.ws_col > 0 {
        PtySize {
            rows: ws.ws_row.into(),
            cols: ws.ws_col.into(),
        }
    } else {
        PtySize { rows: 24, cols: 80 }
    }
}

/// Raw mode on stdin while alive; the saved mode comes back on drop.
struct RawMode(Termios);

impl RawMode {
    fn enter() -> Result<RawMode> {
        let stdin = std::io::stdin();
        let saved = termios::tcgetattr(stdin.as_fd())?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw)?;
        Ok(RawMode(saved))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSANOW, &self.0);
    }
}

/// Runs `process` on a pty in `sandbox`, wired to this terminal, until it
/// ends; its exit code is returned.
pub async fn attach(sandbox: Sandbox, mut process: ProcessConfig) -> Result<ExitCode> {
    need_terminal()?;
    let term = std::env::var("TERM").unwrap_or_else(|_| "xterm-256color".into());
    process.envs.entry("TERM".into()).or_insert(term);
    let start = StartRequest {
        process,
        pty: Some(Pty {
            size: Some(terminal_size()),
        }),
        ..Default::default()
    };
    let mut stream = sandbox.start(&start).await?;
    let raw = RawMode::enter()?;
    let sandbox = Arc::new(sandbox);
    let mut input_task = None;
    let code = loop {
        let Some(event) = stream.next().await? else {
            break None;
        };
        match event {
            ProcessEvent::Start(s) => {
                input_task = Some(tokio::spawn(forward_input(sandbox.clone(), s.pid)));
            }
            ProcessEvent::Data(DataEvent::Pty(b) | DataEvent::Stdout(b) | DataEvent::Stderr(b)) => {
                let mut out = std::io::stdout().lock();
                out.write_all(&b.0)?;
                out.flush()?;
            }
            ProcessEvent::End(end) => break Some(if end.exited { end.exit_code } else { -1 }),
            ProcessEvent::Keepalive(_) => {}
        }
    };
    drop(raw);
    if let Some(task) = input_task {
        task.abort();
    }
    match code {
        Some(c) => Ok(exit_code(c)),
        None => bail!("the shell's stream ended without its exit status"),
    }
}

/// Sends keys as they are typed and the terminal's size when it changes.
async fn forward_input(sandbox: Arc<Sandbox>, pid: u32) -> Result<()> {
    let (tx, mut rx) = mpsc::channel::<Bytes>(64);
    // Blocking reads on a thread of their own; it ends with the program.
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = [0u8; 4096];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.blocking_send(Bytes::copy_from_slice(&buf[..n])).is_err() {
                        return;
                    }
                }
            }
        }
    });
    let mut winch = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())?;
    let mut conn = sandbox.connect().await?;
    let selector = ProcessSelector::Pid(pid);
    loop {
        tokio::select! {
            keys = rx.recv() => {
                let Some(mut keys) = keys else { return Ok(()) };
                // Whatever else was typed meanwhile goes in the same request.
                while let Ok(more) = rx.try_recv() {
                    let mut joined = keys.to_vec();
                    joined.extend_from_slice(&more);
                    keys = joined.into();
                }
                let req = SendInputRequest {
                    process: selector.clone(),
                    input: Some(ProcessInput::Pty(B64(keys))),
                };
                let _: SendInputResponse = match sandbox.unary(&mut conn, PATH_SEND_INPUT, &req).await {
                    Ok(r) => r,
                    // A dropped keep-alive connection: once more on a new one.
                    Err(_) => {
                        conn = sandbox.connect().await?;
                        sandbox.unary(&mut conn, PATH_SEND_INPUT, &req).await?
                    }
                };
            }
            _ = winch.recv() => {
                let req = UpdateRequest {
                    process: selector.clone(),
                    pty: Some(Pty { size: Some(terminal_size()) }),
                };
                let _: UpdateResponse = match sandbox.unary(&mut conn, PATH_UPDATE, &req).await {
                    Ok(r) => r,
                    Err(_) => {
                        conn = sandbox.connect().await?;
                        sandbox.unary(&mut conn, PATH_UPDATE, &req).await?
                    }
                };
            }
        }
    }
}

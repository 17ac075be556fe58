//! `sandfork run [TEMPLATE]`: a new sandbox with an interactive shell on a
//! pseudo-terminal (envd `Start` with a pty; keys through `SendInput`,
//! terminal size through `Update` on SIGWINCH). `exec -t` attaches the same
//! way to an existing sandbox.

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

use crate::client::Node;
use crate::client::envd::Sandbox;
use crate::exec::exit_code;
use crate::sandboxes::{create_body, create_sandbox, key_value};

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  sandfork run                 # a shell in a new sandbox from the base template\n  sandfork run mytemplate --rm # removed when the shell exits\n  sandfork exec -t $id -- bash # a shell in an existing sandbox\n\nThe sandbox keeps running after the shell exits unless --rm is given."
)]
pub struct RunArgs {
    /// Template id or name [default: base].
    template: Option<String>,
    /// Kill the sandbox when the shell exits.
    #[arg(long)]
    rm: bool,
    /// Seconds the sandbox may run.
    #[arg(long, default_value_t = 3600)]
    timeout: u64,
    #[arg(long, value_name = "KEY=VALUE", value_parser = key_value)]
    metadata: Vec<(String, String)>,
    #[arg(long, short, value_name = "KEY=VALUE", value_parser = key_value)]
    env: Vec<(String, String)>,
    /// The guest user of the shell [default: the sandbox's default user].
    #[arg(long, short)]
    user: Option<String>,
}

/// The shell: bash when the image has it.
const SHELL: &str = "if [ -x /bin/bash ]; then exec /bin/bash -l; else exec /bin/sh -l; fi";

pub async fn run(args: RunArgs) -> Result<ExitCode> {
    need_terminal()?;
    let node = Node::from_config()?;
    let body = create_body(
        args.template.as_deref(),
        args.timeout,
        &args.metadata,
        &args.env,
        false,
    );
    let created = create_sandbox(&node, &body).await?;
    let id = created["sandboxID"].as_str().unwrap_or_default().to_owned();
    if args.rm {
        eprintln!("sandbox {id} (removed when the shell exits)");
    } else {
        eprintln!("sandbox {id} (it keeps running after the shell exits: `sandfork rm {id}`)");
    }
    let result = async {
        let sandbox = Sandbox::open(&node, &id, args.user.clone()).await?;
        attach(
            sandbox,
            ProcessConfig {
                cmd: "/bin/sh".into(),
                args: vec!["-c".into(), SHELL.into()],
                ..Default::default()
            },
        )
        .await
    }
    .await;
    if args.rm
        && let Err(e) = node
            .sandbox_call(&id, "DELETE", &format!("/sandboxes/{id}"), None)
            .await
    {
        eprintln!("sandfork: error: removing sandbox {id}: {e}");
    }
    result
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

//! `sandfork exec ID -- CMD...`: runs a command in a sandbox, streams its
//! output as it comes and exits with its exit code.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;

use anyhow::Result;
use bytes::Bytes;
use envd_proto::json::B64;
use envd_proto::process::{
    CloseStdinRequest, CloseStdinResponse, DataEvent, PATH_CLOSE_STDIN, PATH_SEND_INPUT,
    PATH_SEND_SIGNAL, ProcessConfig, ProcessEvent, ProcessInput, ProcessSelector, SendInputRequest,
    SendInputResponse, SendSignalRequest, SendSignalResponse, Signal, StartRequest,
};

use crate::client::Node;
use crate::client::envd::Sandbox;
use crate::sandboxes::key_value;
use crate::session::exit_code;

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  sandfork exec $id -- uname -a\n  sandfork exec $id --cwd /tmp -e DEBUG=1 -- sh -c 'ls | wc -l'\n  sandfork exec $id --user root -- apt-get install -y jq\n  tar c src | sandfork exec -i $id -- tar x -C /tmp\n  sandfork exec -t $id -- bash\n\nThe exit code is the command's (255 when a signal ended it)."
)]
pub struct ExecArgs {
    id: String,
    /// The program and its arguments (no shell: use `sh -c '...'` for one).
    #[arg(required = true, last = true, value_name = "CMD")]
    cmd: Vec<String>,
    /// The guest user to run as [default: the sandbox's default user].
    #[arg(long, short)]
    user: Option<String>,
    /// Working directory in the sandbox.
    #[arg(long, short = 'w')]
    cwd: Option<String>,
    /// Environment variables (repeatable).
    #[arg(long, short, value_name = "KEY=VALUE", value_parser = key_value)]
    env: Vec<(String, String)>,
    /// Pass this program's standard input to the command (until EOF).
    #[arg(long, short = 'i')]
    interactive: bool,
    /// Attach this terminal over a pseudo-terminal (for shells and
    /// full-screen programs; input is passed too).
    #[arg(long, short = 't')]
    tty: bool,
}

pub async fn run(args: ExecArgs) -> Result<ExitCode> {
    let node = Node::from_config()?;
    let sandbox = Sandbox::open(&node, &args.id, args.user.clone()).await?;
    let mut cmd = args.cmd.into_iter();
    let process = ProcessConfig {
        cmd: cmd.next().unwrap_or_default(),
        args: cmd.collect(),
        envs: args.env.into_iter().collect::<BTreeMap<_, _>>(),
        cwd: args.cwd,
    };
    if args.tty {
        return crate::session::attach(sandbox, process).await;
    }
    let start = StartRequest {
        process,
        stdin: Some(args.interactive),
        ..Default::default()
    };
    let mut stream = sandbox.start(&start).await?;
    let mut pid = None;
    let mut interrupted = false;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        let event = tokio::select! {
            e = stream.next() => e?,
            _ = &mut ctrl_c, if !interrupted => {
                // First Ctrl+C: ask the process to stop and keep reading its
                // output to the end; a second one kills this program.
                interrupted = true;
                if let Some(pid) = pid {
                    let mut conn = sandbox.connect().await?;
                    let _: SendSignalResponse = sandbox
                        .unary(&mut conn, PATH_SEND_SIGNAL, &SendSignalRequest {
                            process: ProcessSelector::Pid(pid),
                            signal: Signal::Sigterm,
                        })
                        .await?;
                }
                continue;
            }
        };
        let Some(event) = event else {
            anyhow::bail!("the process stream ended without the command's exit status");
        };
        match event {
            ProcessEvent::Start(s) => {
                pid = Some(s.pid);
                if args.interactive {
                    tokio::spawn(forward_stdin(sandbox.clone(), s.pid));
                }
            }
            ProcessEvent::Data(DataEvent::Stdout(b) | DataEvent::Pty(b)) => {
                let mut out = std::io::stdout().lock();
                out.write_all(&b.0)?;
                out.flush()?;
            }
            ProcessEvent::Data(DataEvent::Stderr(b)) => {
                let mut err = std::io::stderr().lock();
                err.write_all(&b.0)?;
                err.flush()?;
            }
            ProcessEvent::End(end) => {
                if !end.exited {
                    eprintln!("sandfork: the command ended: {}", end.status);
                }
                return Ok(exit_code(if end.exited { end.exit_code } else { -1 }));
            }
            ProcessEvent::Keepalive(_) => {}
        }
    }
}

/// Sends standard input to the process as it is read, then closes its
/// stdin at EOF. A failure ends the forwarding with a message; the process
/// still runs to its end.
async fn forward_stdin(sandbox: Sandbox, pid: u32) {
    if let Err(e) = try_forward_stdin(&sandbox, pid).await {
        eprintln!("sandfork: error: passing input: {e}");
    }
}

async fn try_forward_stdin(sandbox: &Sandbox, pid: u32) -> Result<()> {
    use tokio::io::AsyncReadExt;
    let mut stdin = tokio::io::stdin();
    let mut conn = sandbox.connect().await?;
    let process = ProcessSelector::Pid(pid);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = stdin.read(&mut buf).await?;
        if n == 0 {
            let _: CloseStdinResponse = sandbox
                .unary(&mut conn, PATH_CLOSE_STDIN, &CloseStdinRequest { process })
                .await?;
            return Ok(());
        }
        let req = SendInputRequest {
            process: process.clone(),
            input: Some(ProcessInput::Stdin(B64(Bytes::copy_from_slice(&buf[..n])))),
        };
        let _: SendInputResponse = sandbox.unary(&mut conn, PATH_SEND_INPUT, &req).await?;
    }
}

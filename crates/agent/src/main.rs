//! sandfork-agent: PID 1 and envd-protocol server of every sandfork microVM.
//!
//! Run as PID 1 it prepares the guest, reaps zombies and shuts the VM down on
//! SIGINT/SIGTERM; in every mode it serves HTTP on vsock (and on TCP when asked).
//! As PID 1 it must never exit except through `shutdown::run`.

mod args;
mod console_log;
mod envd;
mod guest_net;
mod loopback;
mod mounts;
mod pid1;
mod reaper;
mod server;
mod shutdown;
mod tcp_forward;
mod vsock;

use std::panic::AssertUnwindSafe;
use std::process::ExitCode;

use tokio::signal::unix::{Signal, SignalKind, signal};

use args::Args;
use pid1::Pid1Kind;

fn main() -> ExitCode {
    console_log::init();
    let is_pid1 = std::process::id() == 1;
    // args_os: std::env::args panics on non-UTF-8, and as PID 1 our arguments are
    // whatever the kernel command line held.
    let words = std::env::args_os()
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned());
    let args = match Args::parse(words) {
        Ok(a) => a,
        Err(e) if is_pid1 => {
            log::error!("{e}; using defaults");
            Args::default()
        }
        Err(e) => {
            eprintln!("sandfork-agent: {e}\n{}", args::USAGE);
            return ExitCode::from(2);
        }
    };
    if args.help && !is_pid1 {
        println!("{}", args::USAGE);
        return ExitCode::SUCCESS;
    }
    for word in &args.ignored {
        log::warn!("ignoring argument {word:?}");
    }

    if !is_pid1 {
        return match runtime().and_then(|rt| rt.block_on(run(args, None))) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                log::error!("{e:#}");
                ExitCode::FAILURE
            }
        };
    }

    let kind = pid1::setup();
    // Whatever goes wrong below, PID 1 keeps reaping rather than exiting.
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
        runtime().and_then(|rt| rt.block_on(run(args, Some(kind))))
    }));
    match outcome {
        Ok(Ok(())) => log::error!("main loop ended"),
        Ok(Err(e)) => log::error!("{e:#}"),
        Err(_) => log::error!("main loop panicked"),
    }
    log::error!("no server any more; only reaping zombies");
    reaper::reap_forever_blocking()
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// Serves until SIGINT/SIGTERM. As PID 1 (`pid1` is Some) it then shuts the
/// guest down and never returns; otherwise it returns Ok for a clean exit.
async fn run(args: Args, pid1: Option<Pid1Kind>) -> anyhow::Result<()> {
    let mut sigterm = watch(SignalKind::terminate());
    let mut sigint = watch(SignalKind::interrupt());

    // Always, not only as PID 1: the reaper is the one waiter for the
    // children the process service starts.
    tokio::spawn(reaper::run());

    let router = envd::router(envd::Envd::new(pid1.is_some()));
    let mut serving = false;
    if let Some(addr) = args.listen_tcp {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => {
                let local = listener.local_addr()?;
                log::info!("listening on tcp {local}");
                tokio::spawn(server::serve(
                    listener,
                    format!("tcp {local}"),
                    router.clone(),
                ));
                serving = true;
            }
            Err(e) if pid1.is_some() => log::error!("tcp {addr}: {e}"),
            Err(e) => return Err(anyhow::anyhow!("cannot listen on tcp {addr}: {e}")),
        }
    }
    if let Some(port) = args.vsock_port {
        match vsock::VsockListener::bind(port) {
            Ok(listener) => {
                log::info!("listening on vsock port {}", listener.port());
                tokio::spawn(server::serve(
                    listener,
                    format!("vsock port {port}"),
                    router.clone(),
                ));
                serving = true;
            }
            Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
                log::warn!("no AF_VSOCK in this kernel; not listening on vsock")
            }
            Err(e) => log::error!("vsock port {port}: {e}"),
        }
        // The host's way to servers in the guest (`<port>-<id>.<domain>`).
        let forward_port = envd_proto::tcp_forward::VSOCK_PORT;
        match vsock::VsockListener::bind(forward_port) {
            Ok(listener) => {
                log::info!("forwarding TCP from vsock port {forward_port}");
                tokio::spawn(tcp_forward::serve(listener));
            }
            Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {}
            Err(e) => log::error!("vsock port {forward_port}: {e}"),
        }
    }
    if !serving {
        log::warn!("serving nothing");
    }

    let reason = tokio::select! {
        _ = recv(&mut sigterm) => "SIGTERM",
        _ = recv(&mut sigint) => "SIGINT",
    };
    match pid1 {
        Some(kind) => shutdown::run(kind, reason),
        None => {
            log::info!("{reason}: exiting");
            Ok(())
        }
    }
}

fn watch(kind: SignalKind) -> Option<Signal> {
    signal(kind)
        .inspect_err(|e| log::error!("cannot watch signal {kind:?}: {e}"))
        .ok()
}

/// Waits for the signal; forever if it could not be watched.
async fn recv(sig: &mut Option<Signal>) {
    match sig {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending().await,
    }
}

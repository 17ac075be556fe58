//! `sandfork-vmm`: one microVM per process, driven through a Firecracker-
//! compatible API on a Unix socket, or booted straight from a config file.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::mpsc;

use clap::Parser;
use vmm::controller::{Controller, ControllerEvent, Reply};
use vmm::devices::legacy::console_budget::ConsoleBudget;

#[derive(Parser)]
#[command(version, about)]
struct Args {
    /// Path of the API socket.
    #[arg(long, default_value = "/run/sandfork-vmm.socket")]
    api_sock: PathBuf,
    /// Boot at once from this Firecracker-style JSON config file.
    #[arg(long)]
    config_file: Option<PathBuf>,
    /// Serve no API (requires --config-file).
    #[arg(long, requires = "config_file")]
    no_api: bool,
    /// An identifier for this microVM, reported by `GET /`.
    #[arg(long, default_value = "anonymous-instance")]
    id: String,
    /// The most guest console output passed to standard output, in MiB;
    /// the rest is dropped (0: none passes).
    #[arg(long, default_value_t = 64)]
    console_limit_mib: u64,
    /// Run without seccomp filters (for debugging); they are on by default.
    #[arg(long)]
    no_seccomp: bool,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    // With transparent huge pages a thread's first touch of its stack can
    // take a whole 2 MiB page: measured in the lab, about half an idle
    // sandbox's private memory. A restored guest's memory is a private file
    // mapping, which THP does not back anyway.
    if let Err(e) = nix::sys::prctl::set_thp_disable(true) {
        tracing::warn!("cannot turn transparent huge pages off: {e}");
    }
    match run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sandfork-vmm: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(args: Args) -> anyhow::Result<ExitCode> {
    use anyhow::Context;

    if !args.no_seccomp {
        vmm::seccomp::enable().context("turning seccomp on")?;
        // Debug builds only: the test hook that proves a forbidden call
        // ends the VMM (crates/vmm/tests/microvm.rs).
        #[cfg(debug_assertions)]
        if let Ok(kind) = std::env::var("SANDFORK_VMM_SECCOMP_SELF_TEST") {
            let kind = vmm::seccomp::ThreadKind::ALL
                .into_iter()
                .find(|k| k.name() == kind)
                .with_context(|| format!("no thread kind {kind:?}"))?;
            vmm::seccomp::arm_self_test(kind);
        }
        // Debug builds only: log calls outside the lists rather than trap
        // them, to check the lists against a test suite (see the module).
        #[cfg(debug_assertions)]
        if std::env::var_os("SANDFORK_VMM_SECCOMP_LOG").is_some_and(|v| v == "1") {
            vmm::seccomp::set_log_only();
        }
        vmm::seccomp::precompile().context("compiling the seccomp filters")?;
    }
    let (events_tx, events_rx) = mpsc::channel();
    let console = ConsoleBudget::new(std::io::stdout(), args.console_limit_mib << 20);
    let mut controller = Controller::new(args.id, events_tx.clone(), Box::new(console));

    let api = if args.no_api {
        None
    } else {
        // API calls go straight into the controller's queue from the API
        // thread: no bridge thread in between, one wake-up less per call.
        let events = events_tx.clone();
        let closed = events_tx.clone();
        let sender = vmm::api_server::ApiRequestSender::forwarding(
            move |request| {
                let vmm::api_server::ApiRequest { action, reply } = request;
                let reply: Reply = Box::new(move |result| {
                    let _ = reply.send(result);
                });
                // A controller that is gone drops the reply: the client gets a 500.
                let _ = events.send(ControllerEvent::Action(action, reply));
            },
            move || {
                let _ = closed.send(ControllerEvent::ApiClosed);
            },
        );
        let handle = vmm::api_server::spawn_api_server_with_sender(&args.api_sock, sender)
            .context("starting the API server")?;
        Some(handle)
    };
    // While the first request is on its way (or the VMM waits in a pool).
    controller.prepare_vm();

    if let Some(path) = &args.config_file {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let config = vmm_api::VmConfig::from_json(&text)
            .with_context(|| format!("parsing {}", path.display()))?;
        controller
            .apply_config(config)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| format!("booting from {}", path.display()))?;
    }
    drop(events_tx);

    let exit = controller.run(&events_rx);
    if let Some(api) = api
        && let Err(e) = api.shutdown()
    {
        eprintln!("sandfork-vmm: stopping the API server: {e}");
    }
    match exit {
        Some(exit) => {
            eprintln!("sandfork-vmm: {}", exit.message());
            Ok(ExitCode::from(exit.exit_code() as u8))
        }
        None => Ok(ExitCode::SUCCESS),
    }
}

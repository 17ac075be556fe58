//! `sandfork serve`: the node server on one port. Where this host's KVM
//! cannot boot Linux it re-runs itself inside the KVM lab, with the port
//! forwarded and the data dir shared read-write.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use sandfork_lab::Environment;
use server::config::{Config, DEFAULT_DATA_DIR};

use crate::{ImageArgs, sibling_binary};

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Address and port of the API (and of the envd proxy).
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// Store, API key, templates and sandboxes.
    #[arg(long, env = "SANDFORK_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
    /// VMM processes kept started for the next creates.
    #[arg(long, default_value_t = 4)]
    pool_size: usize,
    /// Running sandboxes at most (creates beyond answer 429).
    #[arg(long, default_value_t = 64)]
    max_sandboxes: usize,
    /// The static guest agent that template builds install as init
    /// (without it `POST /templates` answers 503 for image sources).
    #[arg(long, env = "SANDFORK_AGENT")]
    agent: Option<PathBuf>,
    /// Memory of the KVM lab machine in MiB, when one is needed.
    #[arg(long, default_value_t = 4096)]
    lab_memory: u32,
    #[command(flatten)]
    image: ImageArgs,
}

pub fn run(args: ServeArgs) -> Result<ExitCode> {
    if !args.image.in_lab && sandfork_lab::detect().environment != Environment::Hardware {
        return run_in_lab(&args);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(serve(args))?;
    Ok(ExitCode::SUCCESS)
}

async fn serve(args: ServeArgs) -> Result<()> {
    let mut config = Config::new(
        args.listen,
        args.image.kernel.clone(),
        args.image.rootfs.clone(),
        args.image.vmm()?,
    );
    config.data_dir = args.data_dir.clone();
    config.pool_size = args.pool_size;
    config.max_sandboxes = args.max_sandboxes;
    config.vcpus = args.image.vcpus;
    config.mem_mib = args.image.mem_mib;
    config.agent = args.agent.clone();
    // Bind first: a taken port fails before the template is built.
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    eprintln!("sandfork serve: preparing the base template (the first start boots a microVM)");
    let node = server::Server::start(config).await?;
    match &node.api_key_file {
        Some(path) => println!("sandfork serve: API key in {}", path.display()),
        None => println!("sandfork serve: API key from SANDFORK_API_KEY"),
    }
    println!(
        "sandfork serve: listening on http://{0} (E2B_API_URL=http://{0} E2B_SANDBOX_URL=http://{0})",
        args.listen
    );
    node.serve(listener, shutdown_signal()).await?;
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Runs this same `serve` inside the lab: listening on all of the lab's
/// addresses, reached through a forward of the same port on the host.
fn run_in_lab(args: &ServeArgs) -> Result<ExitCode> {
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating {}", args.data_dir.display()))?;
    let data_dir = std::fs::canonicalize(&args.data_dir)?;
    let port = args.listen.port();
    let inside = SocketAddr::from(([0, 0, 0, 0], port));
    let image = &args.image;
    let mut cmd = std::process::Command::new(sibling_binary("sandfork-lab")?);
    // One lab vCPU: steadier under nested emulation (see scripts/test.sh).
    cmd.args(["run", "--cpus", "1", "--memory"])
        .arg(args.lab_memory.to_string())
        .arg("--forward")
        .arg(format!("{}:{port}:{port}", args.listen.ip()))
        .arg("--rw")
        .arg(&data_dir);
    // Template builds write their cache (the base tree, built root
    // filesystems) there; the lab's host root is read-only.
    let cache = std::env::var_os("SANDFORK_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/sandfork"));
    if let Ok(cache) = std::fs::canonicalize(&cache)
        && !data_dir.starts_with(&cache)
    {
        cmd.arg("--rw").arg(cache);
    }
    cmd.arg("--")
        .arg(std::env::current_exe()?)
        .arg("serve")
        .arg("--listen")
        .arg(inside.to_string())
        .arg("--data-dir")
        .arg(&data_dir)
        .arg("--pool-size")
        .arg(args.pool_size.to_string())
        .arg("--max-sandboxes")
        .arg(args.max_sandboxes.to_string())
        .arg("--kernel")
        .arg(&image.kernel)
        .arg("--rootfs")
        .arg(&image.rootfs)
        .arg("--vmm")
        .arg(image.vmm()?)
        .arg("--vcpus")
        .arg(image.vcpus.to_string())
        .arg("--mem-mib")
        .arg(image.mem_mib.to_string())
        .arg("--in-lab");
    if let Some(agent) = &args.agent {
        cmd.arg("--agent").arg(agent);
    }
    eprintln!(
        "sandfork serve: this host's KVM cannot boot Linux; running in the KVM lab (emulated, slow), \
         reachable at http://{} (the lab's own address below is forwarded there)",
        args.listen
    );
    let status = cmd.status().context("running the KVM lab")?;
    Ok(ExitCode::from(status.code().unwrap_or(1) as u8))
}

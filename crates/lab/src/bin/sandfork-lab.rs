//! `sandfork-lab`: detect, prepare and run commands in the KVM lab.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use sandfork_lab::{
    Lab, LabConfig, LabError, PortForward, RootCache, TcgThreads, detect, parse_env,
};

/// Exit codes of `run` when the command itself gave none (as timeout(1) and env(1)).
const EXIT_LAB_FAILED: u8 = 125;
const EXIT_NO_CWD: u8 = 126;
const EXIT_NOT_FOUND: u8 = 127;
const EXIT_TIMEOUT: u8 = 124;

#[derive(Parser)]
#[command(
    name = "sandfork-lab",
    version,
    about = "Real KVM in an emulated machine (QEMU TCG with SVM)"
)]
struct Cli {
    /// Cache root; the lab lives in <DIR>/lab/.
    #[arg(
        long,
        env = "SANDFORK_CACHE",
        default_value = "/var/cache/sandfork",
        global = true
    )]
    cache_dir: PathBuf,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print `hardware` or `lab`, and why.
    Detect,
    /// Build or find the lab kernel and initramfs (asking apt for the current
    /// kernel package); print their paths.
    Prepare,
    /// Run a command in a fresh lab machine and exit with its exit code.
    Run(RunArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum CacheArg {
    Loose,
    None,
}

#[derive(Clone, Copy, ValueEnum)]
enum TcgThreadsArg {
    Single,
    Multi,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Memory of the lab machine in MiB.
    #[arg(long, default_value_t = 4096)]
    memory: u32,
    /// vCPUs of the lab machine (TCG uses one host core each).
    #[arg(long, default_value_t = 2)]
    cpus: u32,
    /// How QEMU runs the vCPUs: all on one host thread, or one thread each.
    #[arg(long, value_enum, default_value = "multi")]
    tcg_threads: TcgThreadsArg,
    /// Count instructions (QEMU -icount shift=auto): clocks follow the
    /// instructions run, timers are served by the vCPU thread (needs
    /// --tcg-threads single).
    #[arg(long)]
    icount: bool,
    /// When the machine's heartbeat stops, only report it: send no key
    /// press (the device interrupt that wakes a machine whose timer
    /// interrupt was left pending).
    #[arg(long)]
    no_nudge: bool,
    /// Add to the lab kernel's command line (repeatable); MODULE.PARAM=VALUE
    /// ones also go to that module when it is loaded (e.g. kvm_amd.vgif=0).
    #[arg(long = "kernel-arg", value_name = "ARG")]
    kernel_args: Vec<String>,
    /// Forward a host TCP port into the lab: [ADDR:]HOSTPORT:GUESTPORT (ADDR defaults to 127.0.0.1).
    #[arg(long = "forward", value_name = "[ADDR:]HOSTPORT:GUESTPORT")]
    forwards: Vec<PortForward>,
    /// Set a variable inside the lab (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE", value_parser = parse_env)]
    env: Vec<(String, String)>,
    /// Do not pass PATH, HOME, RUST_LOG, SANDFORK_*, CARGO_*, ... from the host.
    #[arg(long)]
    clean_env: bool,
    /// Share a host directory read-write at the same path (repeatable).
    #[arg(long = "rw", value_name = "DIR")]
    rw_dirs: Vec<PathBuf>,
    /// Kill the lab after this many seconds.
    #[arg(long, value_name = "SECS")]
    timeout: Option<f64>,
    /// Working directory inside the lab (default: the current one).
    #[arg(long)]
    cwd: Option<PathBuf>,
    /// Caching of the read-only host root inside the lab.
    #[arg(long, value_enum, default_value = "loose")]
    root_cache: CacheArg,
    /// Keep the lab's serial console (kernel and init messages) in this file.
    #[arg(long, value_name = "PATH")]
    console_log: Option<PathBuf>,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    argv: Vec<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match real_main(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sandfork-lab: {e:#}");
            ExitCode::from(EXIT_LAB_FAILED)
        }
    }
}

fn real_main(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Cmd::Detect => {
            let d = detect();
            // A reader that stops early (`| head -n1`) is fine: no panic on EPIPE.
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{}", d.environment).and_then(|()| writeln!(out, "{}", d.reason));
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Prepare => {
            let lab = Lab::prepare_refresh(&cli.cache_dir).context("preparing the lab")?;
            let p = lab.paths();
            println!("dir={}", p.dir.display());
            println!("kernel={}", p.kernel.display());
            println!("initramfs={}", p.initramfs.display());
            println!("manifest={}", p.manifest.display());
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Run(args) => run(&cli.cache_dir, args),
    }
}

fn run(cache_dir: &std::path::Path, args: RunArgs) -> anyhow::Result<ExitCode> {
    let timeout = match args.timeout {
        Some(s) if s.is_finite() && s > 0.0 => Some(Duration::from_secs_f64(s)),
        Some(s) => anyhow::bail!("--timeout must be a positive number of seconds, not {s}"),
        None => None,
    };
    let config = LabConfig {
        memory_mib: args.memory,
        cpus: args.cpus,
        tcg_threads: match args.tcg_threads {
            TcgThreadsArg::Single => TcgThreads::Single,
            TcgThreadsArg::Multi => TcgThreads::Multi,
        },
        kernel_args: args.kernel_args,
        icount: args.icount,
        nudge_stalls: !args.no_nudge,
        forwards: args.forwards,
        env: args.env,
        inherit_env: !args.clean_env,
        rw_dirs: args.rw_dirs,
        timeout,
        cwd: args.cwd,
        root_cache: match args.root_cache {
            CacheArg::Loose => RootCache::Loose,
            CacheArg::None => RootCache::None,
        },
        console_log: args.console_log,
        // The machine is spawned and waited for on this (the main) thread.
        die_with_parent: true,
        ..LabConfig::default()
    };
    let lab = Lab::prepare(cache_dir).context("preparing the lab")?;
    match lab.run(&config, &args.argv) {
        Ok(out) => Ok(ExitCode::from(
            u8::try_from(out.code).unwrap_or(EXIT_LAB_FAILED),
        )),
        Err(e) => {
            eprintln!("sandfork-lab: {e}");
            Ok(ExitCode::from(match e {
                LabError::Timeout { .. } => EXIT_TIMEOUT,
                LabError::CommandNotFound { .. } => EXIT_NOT_FOUND,
                LabError::NoWorkingDir { .. } => EXIT_NO_CWD,
                _ => EXIT_LAB_FAILED,
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("sandfork-lab").chain(args.iter().copied()))
    }

    #[test]
    fn run_parses_options_and_the_command() {
        let cli = parse(&[
            "run",
            "--memory",
            "2048",
            "--cpus",
            "1",
            "--forward",
            "8080:80",
            "--forward",
            "0.0.0.0:2222:22",
            "--env",
            "A=b=c",
            "--rw",
            "/work/results",
            "--timeout",
            "2.5",
            "--",
            "sh",
            "-c",
            "exit 7",
        ])
        .unwrap();
        let Cmd::Run(r) = cli.command else {
            panic!("not run")
        };
        assert_eq!((r.memory, r.cpus), (2048, 1));
        assert_eq!(r.forwards.len(), 2);
        assert_eq!(r.forwards[1].host_port, 2222);
        assert_eq!(r.env, vec![("A".to_string(), "b=c".to_string())]);
        assert_eq!(r.rw_dirs, vec![PathBuf::from("/work/results")]);
        assert_eq!(r.timeout, Some(2.5));
        assert_eq!(r.argv, ["sh", "-c", "exit 7"]);
    }

    #[test]
    fn defaults_and_errors() {
        let Cmd::Run(r) = parse(&["run", "--", "true"]).unwrap().command else {
            panic!("not run")
        };
        assert_eq!((r.memory, r.cpus, r.timeout), (4096, 2, None));
        // Flags after `--` belong to the command.
        let Cmd::Run(r) = parse(&["run", "--", "ls", "--cpus"]).unwrap().command else {
            panic!("not run")
        };
        assert_eq!(r.argv, ["ls", "--cpus"]);
        assert!(parse(&["run"]).is_err());
        assert!(parse(&["run", "--forward", "nope", "--", "true"]).is_err());
        assert!(parse(&["run", "--env", "1X=y", "--", "true"]).is_err());
        assert!(matches!(parse(&["detect"]).unwrap().command, Cmd::Detect));
    }
}

//! `sandfork`: the command line of a sandfork node.

mod auth;
mod bench;
mod client;
mod cluster;
mod completions;
mod cp;
mod exec;
mod launcher;
mod logs;
mod nodes;
mod output;
mod progress;
mod run;
mod sandboxes;
mod serve;
mod session;
mod soak;
mod status;
mod stress;
mod teams;
mod template;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{CommandFactory, Parser, Subcommand};

use launcher::GuestImage;
use sandfork_lab::Environment;

#[derive(Parser)]
#[command(
    version,
    about = "sandfork: branching agent sandboxes on KVM microVMs",
    after_help = "Quick start:\n  sandfork serve &                       # a node on 127.0.0.1:3000\n  sandfork auth login --key $(cat /var/lib/sandfork/api-key)\n  sandfork run                           # a shell in a new sandbox\n  id=$(sandfork create)\n  sandfork exec $id -- uname -a\n  sandfork fork $id -n 3\n  sandfork ls\n\nThe node and key come from SANDFORK_API_URL and SANDFORK_API_KEY, else the\nconfig file `sandfork auth login` writes, else E2B_API_URL and E2B_API_KEY."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone)]
struct ImageArgs {
    /// Guest kernel (uncompressed vmlinux).
    #[arg(long, env = "SANDFORK_KERNEL")]
    kernel: PathBuf,
    /// Guest root filesystem image (ext4).
    #[arg(long, env = "SANDFORK_ROOTFS")]
    rootfs: PathBuf,
    /// The VMM binary [default: sandfork-vmm next to this program].
    #[arg(long, env = "SANDFORK_VMM")]
    vmm: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    #[arg(long, default_value_t = 256)]
    mem_mib: u64,
    /// Run here even when this host's KVM cannot boot Linux (used inside the lab).
    #[arg(long, hide = true)]
    in_lab: bool,
}

// Parsed once per process: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Boot a microVM to its guest agent, report the time, then shut it down.
    ///
    /// Example: sandfork up --kernel vmlinux --rootfs rootfs.ext4
    Up {
        #[command(flatten)]
        image: ImageArgs,
        /// Print the guest's console (its kernel's boot log) on stderr after.
        #[arg(long)]
        console: bool,
        /// A shell command to run in the guest before it shuts down; its
        /// output is printed.
        #[arg(long, value_name = "COMMAND")]
        run: Option<String>,
    },
    /// Print benchmark figures as one JSON object: the VMM's (boot, pause,
    /// snapshot, restore, fork) and the node's through the E2B Python SDK.
    ///
    /// Example: SANDFORK_FIRECRACKER=/opt/fc/firecracker sandfork bench --runs 5
    #[command(subcommand_negates_reqs = true, args_conflicts_with_subcommands = true)]
    Bench {
        #[command(subcommand)]
        action: Option<bench::BenchCommand>,
        /// None only with a subcommand (clap requires the kernel and rootfs
        /// otherwise).
        #[command(flatten)]
        image: Option<ImageArgs>,
        /// Also write the JSON to FILE, and beside it a Markdown report of
        /// every figure with SVG plots of the samples (`out/bench.json`:
        /// `out/bench.md`, `out/bench-plots/`).
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Boots to measure (the median is reported).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// A Firecracker binary to measure on the same kernel and image.
        #[arg(long, env = "SANDFORK_FIRECRACKER")]
        firecracker: Option<PathBuf>,
        /// Measure only one part: `vmm` (the VMM's figures), `sdk` (the
        /// node's, through the E2B SDK against `sandfork serve`), `rl`
        /// (branching a stateful episode N ways at step k: fork vs snapshot
        /// and creates vs creates and a replay; the `rl` JSON object),
        /// `images` (task images of 1-4 GiB pulled and converted, and the
        /// disk images sharing a base take; no guest, so on this host) or
        /// `cluster-scale` (etcd and gateways with many node records and
        /// routes, on this host: no lab, no sandbox).
        #[arg(long, value_enum)]
        only: Option<bench::Part>,
        /// Leave out the E2B SDK figures.
        #[arg(long, conflicts_with = "only")]
        no_sdk: bool,
        /// Sequential creates timed to their first command result.
        #[arg(long, default_value_t = 10)]
        sdk_runs: usize,
        /// A python with the e2b package [default: the venv scripts/sdk-setup.sh
        /// creates].
        #[arg(long, env = "SANDFORK_SDK_PYTHON")]
        sdk_python: Option<PathBuf>,
        /// Memory of the KVM lab machine in MiB, when the bench runs in one:
        /// its /tmp (half of it, a tmpfs) holds the bench node's data
        /// [default: the host's MemTotal less the larger of 2 GiB and 15 %].
        #[arg(long, value_name = "MIB")]
        lab_memory: Option<u32>,
        /// Each SDK sample (a create to its first command result, a fork to
        /// every child's) at most this long; one that overruns is recorded
        /// as failed and the bench goes on.
        #[arg(long, value_name = "SECS", default_value_t = 600)]
        sample_timeout: u64,
        /// `density_idle_sandboxes`: SDK creates until the node refuses or
        /// this many (0: not measured).
        #[arg(long, value_name = "N", default_value_t = 500)]
        density_max: usize,
        /// Only these SDK phases, comma-separated: create_to_first_command,
        /// fork16, fork100, fork_phases (where forks of 1, 16 and 100 spend
        /// their time, and the parent's pause against a snapshot's), guest_tcp,
        /// creates_concurrent, creates_concurrent16,
        /// idle, rl, rl_group, rollback, density, create_no_network (the creates again on
        /// a second node started with --no-network), images (creates by
        /// image of the task images: first, warm, 8 concurrent; only when
        /// named) [default: all; `--only sdk` all but rl, rl_group and
        /// rollback].
        #[arg(long, value_name = "LIST")]
        sdk_phases: Option<String>,
        /// The rl part: children per branch (N), comma-separated.
        #[arg(long, value_name = "LIST", default_value = "4,16")]
        rl_counts: String,
        /// The rl part: the steps of the episode to branch at (k),
        /// comma-separated.
        #[arg(long, value_name = "LIST", default_value = "1,8,32")]
        rl_steps: String,
        /// The rl part: start no new (N, k) case after this long; the cases
        /// left are listed as not measured [default: 0, no bound].
        #[arg(long, value_name = "SECS", default_value_t = 0)]
        rl_budget: u64,
        /// The rl part's fork per group: rollout group sizes (N),
        /// comma-separated, each set up once and forked against set up per
        /// child (`group_setup_fork_ms`, `group_setup_each_ms`).
        #[arg(long, value_name = "LIST", default_value = "8,16")]
        rl_groups: String,
        /// The whole bench at most this long: a part still running then is
        /// abandoned and the report printed with what was measured.
        #[arg(long, value_name = "SECS", default_value_t = 10_800)]
        timeout: u64,
        /// Keep the SDK bench nodes' server logs in this directory
        /// (`serve.log`; `serve-no-network.log` for the node without
        /// networking); set RUST_LOG=debug for each launch's timings.
        #[arg(long, value_name = "DIR")]
        keep_logs: Option<PathBuf>,
        /// Only these parts of the VMM figures, comma-separated (for the
        /// reference too, where it has them) [default: all].
        #[arg(long, value_enum, value_delimiter = ',', value_name = "LIST")]
        vmm_parts: Vec<bench::VmmPart>,
        /// `--only cluster-scale`: node records registered.
        #[arg(long, value_name = "N", default_value_t = 100)]
        scale_nodes: usize,
        /// `--only cluster-scale`: route counts to measure at, ascending,
        /// comma-separated.
        #[arg(long, value_name = "LIST", default_value = "10000,50000,100000")]
        scale_routes: String,
        /// `--only images`: the task images' cache entry [default: the one
        /// tests/support/task_images.py makes or finds].
        #[arg(long, env = "SANDFORK_TASK_IMAGES", value_name = "DIR")]
        task_images: Option<PathBuf>,
        /// `--only images`: the guest agent the conversions install.
        #[arg(long, env = "SANDFORK_AGENT", value_name = "PATH")]
        agent: Option<PathBuf>,
        /// `--only images`: where the cold caches are made (a local
        /// filesystem with about 12 GB free while the 4 GiB image converts).
        #[arg(long, value_name = "DIR", default_value = "/var/tmp")]
        images_scratch: PathBuf,
    },
    /// Boot, restore, fork and run two VMs at once, many times, each bounded;
    /// count failures and hangs, with diagnostics for each. One JSON object
    /// on stdout; exits 1 when any trial failed or hung.
    ///
    /// Example: sandfork stress --boots 20 --restores 20 --forks 20 --two-vm 20
    Stress {
        #[command(flatten)]
        image: ImageArgs,
        #[command(flatten)]
        args: stress::StressArgs,
    },
    /// Many sandboxes kept busy through the node's envd proxy (commands and
    /// file round trips, every answer checked) until a count or a duration;
    /// errors and the node's memory before and after. One JSON object on
    /// stdout; exits 1 on any error or when the server's RSS grew too much.
    ///
    /// Example: sandfork soak --sandboxes 16 --commands 2000 --files 500 --duration 10m
    Soak(soak::SoakArgs),
    /// Serve the E2B-compatible API and the envd proxy on one port.
    ///
    /// Example: sandfork serve --listen 127.0.0.1:3000
    Serve(Box<serve::ServeArgs>),
    /// Save or show the node's URL and API key.
    #[command(subcommand)]
    Auth(auth::AuthCommand),
    /// The node's capacity and how many sandboxes run.
    Status(status::StatusArgs),
    /// A cluster's nodes and where its sandboxes are (read from etcd).
    Nodes(nodes::NodesArgs),
    /// Helpers for running a cluster: its TLS certificates.
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// List sandboxes (a table on a terminal, JSON otherwise).
    Ls(sandboxes::LsArgs),
    /// Create a sandbox and print its id.
    Create(sandboxes::CreateArgs),
    /// Create a sandbox and open a shell in it.
    Run(run::RunArgs),
    /// Run a command in a sandbox; exits with its exit code.
    Exec(exec::ExecArgs),
    /// Pause sandboxes (memory and disk kept; they use no CPU or memory).
    Pause(sandboxes::PauseArgs),
    /// Resume paused sandboxes.
    Resume(sandboxes::ResumeArgs),
    /// Fork a running sandbox into N children; prints their ids.
    Fork(sandboxes::ForkArgs),
    /// Snapshot a running sandbox; prints the snapshot's id.
    Snapshot(sandboxes::SnapshotArgs),
    /// Set how long from now a sandbox may run.
    Timeout(sandboxes::TimeoutArgs),
    /// Kill and remove sandboxes.
    Rm(sandboxes::IdsArgs),
    /// Print a sandbox's log (console and agent).
    Logs(logs::LogsArgs),
    /// Copy a file to or from a sandbox (ID:/path on one side).
    Cp(cp::CpArgs),
    /// Build, list and remove templates.
    #[command(subcommand)]
    Template(template::TemplateCommand),
    /// Make and list teams and set their limits (the node's own key only).
    #[command(subcommand)]
    Team(teams::TeamCommand),
    /// Make, list and revoke teams' API keys (the node's own key only).
    #[command(subcommand)]
    Key(teams::KeyCommand),
    /// Print a shell completion script.
    Completions(completions::CompletionsArgs),
}

pub(crate) fn sibling_binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating this program")?;
    let path = exe.with_file_name(name);
    if !path.exists() {
        bail!(
            "{} not found next to {}; build the workspace first",
            name,
            exe.display()
        );
    }
    Ok(path)
}

impl ImageArgs {
    fn guest(&self) -> GuestImage {
        GuestImage {
            kernel: self.kernel.clone(),
            rootfs: self.rootfs.clone(),
            vcpus: self.vcpus,
            mem_mib: self.mem_mib,
        }
    }

    fn vmm(&self) -> Result<PathBuf> {
        match &self.vmm {
            Some(path) => Ok(path.clone()),
            None => sibling_binary("sandfork-vmm"),
        }
    }
}

/// How long `up` and `bench` may run in the lab.
const LAB_TIMEOUT: Duration = Duration::from_secs(3600);
/// The lab's start and stop around a bench that ends at its own `--timeout`.
const LAB_MARGIN: Duration = Duration::from_secs(600);

/// Re-runs this very command inside the KVM lab when the host cannot boot
/// Linux guests, with `envs` added; returns None when the command should run
/// here.
fn run_in_lab_if_needed(
    image: &ImageArgs,
    envs: &[(&str, &std::ffi::OsStr)],
    lab_args: &[&str],
    timeout: Duration,
) -> Result<Option<ExitCode>> {
    if image.in_lab || environment(image) == Environment::Hardware {
        return Ok(None);
    }
    let lab = sibling_binary("sandfork-lab")?;
    let mut cmd = std::process::Command::new(lab);
    // One lab vCPU: steadier under nested emulation (see scripts/test.sh).
    cmd.arg("run")
        .arg("--cpus")
        .arg("1")
        .arg("--timeout")
        .arg(timeout.as_secs().to_string());
    cmd.args(lab_args);
    cmd.arg("--").arg(std::env::current_exe()?);
    cmd.args(std::env::args_os().skip(1));
    cmd.arg("--in-lab");
    cmd.env("SANDFORK_KERNEL", &image.kernel)
        .env("SANDFORK_ROOTFS", &image.rootfs)
        .envs(envs.iter().copied());
    let status = cmd.status().context("running the KVM lab")?;
    Ok(Some(ExitCode::from(status.code().unwrap_or(1) as u8)))
}

/// Where this command's microVMs run: in the lab when it was re-run there,
/// otherwise wherever this host's KVM allows.
fn environment(image: &ImageArgs) -> Environment {
    if image.in_lab {
        Environment::Lab
    } else {
        sandfork_lab::detect().environment
    }
}

async fn up(image: &ImageArgs, console: bool, run: Option<&str>) -> Result<()> {
    let (vm, took) =
        launcher::boot_to_agent(&image.vmm()?, &image.guest(), Duration::from_secs(300)).await?;
    println!(
        "microVM up: guest agent answered its health check over vsock {:.0} ms after InstanceStart ({})",
        took.as_secs_f64() * 1000.0,
        environment(image)
    );
    if let Some(command) = run {
        let out = vm.agent().run(command).await?;
        print!("{}", out.stdout);
        eprint!("{}", out.stderr);
        println!("(exit status {})", out.exit_code);
    }
    let console_log = vm.dir().join("console.log");
    let console_text = console.then(|| std::fs::read_to_string(&console_log));
    vm.shutdown(Duration::from_secs(30)).await?;
    match console_text {
        Some(Ok(text)) => eprint!("{text}"),
        Some(Err(e)) => bail!("reading the console log {}: {e}", console_log.display()),
        None => {}
    }
    println!("microVM shut down cleanly");
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sandfork: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Prints the bench's JSON on stdout (first, so that it is never lost) and,
/// with `--json FILE`, writes it there with its report beside it.
fn emit(report: &serde_json::Value, json: Option<&std::path::Path>) -> Result<()> {
    println!("{}", serde_json::to_string(report)?);
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(report)? + "\n";
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        let markdown = bench::report::write(path, report)?;
        eprintln!("bench: report in {}", markdown.display());
    }
    Ok(())
}

/// `sandfork bench --only cluster-scale`: on this host, whatever its KVM.
async fn cluster_scale(
    nodes: usize,
    routes: &str,
    json: Option<&std::path::Path>,
) -> Result<ExitCode> {
    let routes = routes
        .split(',')
        .map(|r| r.trim().parse::<usize>().ok().filter(|&r| r > 0))
        .collect::<Option<Vec<_>>>()
        .filter(|r| r.is_sorted_by(|a, b| a < b))
        .with_context(|| {
            format!("--scale-routes takes positive route counts, ascending, not {routes:?}")
        })?;
    let exe = std::env::current_exe().context("finding this binary (the gateway)")?;
    let report = bench::cluster_scale::measure(&bench::cluster_scale::ScaleBench {
        nodes,
        routes: &routes,
        exe: &exe,
    })
    .await?;
    emit(&report, json)?;
    Ok(match bench::failed(&report) {
        true => ExitCode::FAILURE,
        false => ExitCode::SUCCESS,
    })
}

fn run(cli: Cli) -> Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    if !matches!(
        cli.command,
        Command::Up { .. } | Command::Bench { .. } | Command::Stress { .. } | Command::Serve(_)
    ) {
        output::default_sigpipe();
    }
    match cli.command {
        Command::Up {
            image,
            console,
            run,
        } => {
            if let Some(code) = run_in_lab_if_needed(&image, &[], &[], LAB_TIMEOUT)? {
                return Ok(code);
            }
            runtime.block_on(up(&image, console, run.as_deref()))?;
        }
        Command::Bench {
            action: Some(bench::BenchCommand::Report { json }),
            ..
        } => {
            let report = bench::report::load(&json)?;
            let markdown = bench::report::write(&json, &report)?;
            println!("{}", markdown.display());
        }
        Command::Bench {
            action: None,
            image,
            json,
            runs,
            firecracker,
            only,
            no_sdk,
            sdk_runs,
            sdk_python,
            lab_memory,
            sample_timeout,
            density_max,
            sdk_phases,
            rl_counts,
            rl_steps,
            rl_budget,
            rl_groups,
            timeout,
            keep_logs,
            vmm_parts,
            scale_nodes,
            scale_routes,
            task_images,
            agent,
            images_scratch,
        } => {
            // Before the bench, not after its hours.
            if let Some(path) = &json {
                bench::report::check(path)?;
            }
            // No guest: the control plane on this host.
            if only == Some(bench::Part::ClusterScale) {
                let json = json.as_deref();
                return runtime.block_on(cluster_scale(scale_nodes, &scale_routes, json));
            }
            let image = image.context("sandfork bench needs --kernel and --rootfs")?;
            if runs == 0 || sdk_runs == 0 {
                bail!("--runs and --sdk-runs must be at least 1");
            }
            for list in [&rl_counts, &rl_steps, &rl_groups] {
                if list
                    .split(',')
                    .any(|x| x.trim().parse::<u32>().map_or(true, |v| v == 0))
                {
                    bail!(
                        "--rl-counts, --rl-steps and --rl-groups are lists of positive numbers, \
                         not {list:?}"
                    );
                }
            }
            let images_only = only == Some(bench::Part::Images);
            let vmm_part = only.is_none() || only == Some(bench::Part::Vmm);
            // `--only sdk` leaves out the rl phase, `--only rl` runs it alone.
            let phases = match (only, sdk_phases) {
                (Some(bench::Part::Rl), _) => Some(bench::sdk::RL_PHASES.to_owned()),
                (_, Some(given)) => Some(given),
                (Some(bench::Part::Sdk), None) => Some(bench::sdk::SDK_PHASES.to_owned()),
                _ => None,
            };
            // The SDK is installed here, before the lab: its root is read-only.
            let sdk_python = match !no_sdk && only != Some(bench::Part::Vmm) && !images_only {
                true if image.in_lab => Some(sdk_python.context("no --sdk-python in the lab")?),
                true => Some(bench::sdk::python(sdk_python)?),
                false => None,
            };
            // The task images are made here too (the lab's root is read-only).
            let images_phase = phases
                .as_deref()
                .is_some_and(|p| p.split(',').any(|n| n.trim() == bench::sdk::IMAGES_PHASE));
            let task_images = match task_images {
                None if images_only || images_phase => Some(bench::images::task_images()?),
                given => given,
            };
            let mut envs: Vec<(&str, &std::ffi::OsStr)> = sdk_python
                .iter()
                .map(|p| ("SANDFORK_SDK_PYTHON", p.as_os_str()))
                .collect();
            if let Some(dir) = &task_images {
                envs.push(("SANDFORK_TASK_IMAGES", dir.as_os_str()));
            }
            let lab_memory = lab_memory
                .unwrap_or_else(sandfork_lab::host_sized_memory_mib)
                .to_string();
            // Made here and shared with the lab, whose root is read-only.
            if let Some(dir) = &keep_logs {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            let keep_logs = keep_logs.map(std::fs::canonicalize).transpose()?;
            let keep_logs_arg = keep_logs.as_ref().map(|d| d.to_string_lossy().into_owned());
            // The report's folder, made here and shared with the lab too.
            let json_dir = match &json {
                Some(path) => {
                    let dir = match path.parent() {
                        Some(p) if !p.as_os_str().is_empty() => p,
                        _ => std::path::Path::new("."),
                    };
                    std::fs::create_dir_all(dir)
                        .with_context(|| format!("creating {}", dir.display()))?;
                    Some(std::fs::canonicalize(dir)?.to_string_lossy().into_owned())
                }
                None => None,
            };
            let mut lab_args = vec!["--memory", &lab_memory];
            let mut shared: Vec<&String> =
                [&keep_logs_arg, &json_dir].into_iter().flatten().collect();
            shared.dedup();
            for dir in shared {
                lab_args.extend(["--rw", dir]);
            }
            // The lab's own bound comes after the bench's, which prints its
            // report at its own: the lab's start and stop are the margin.
            let lab_timeout = Duration::from_secs(timeout) + LAB_MARGIN;
            // The conversions need no guest: they run here, on hardware.
            let images = match images_only {
                true => Some((
                    task_images.clone().context("no task images")?,
                    agent.context("--only images needs --agent (or SANDFORK_AGENT)")?,
                )),
                false => None,
            };
            if images.is_none()
                && let Some(code) = run_in_lab_if_needed(&image, &envs, &lab_args, lab_timeout)?
            {
                return Ok(code);
            }
            let vmm = image.vmm()?;
            let guest = image.guest();
            let plan = bench::Plan {
                environment: match images_only {
                    true => "host".to_owned(),
                    false => environment(&image).to_string(),
                },
                vmm: &vmm,
                image: &guest,
                vmm_figures: vmm_part.then_some(bench::VmmFigures {
                    runs,
                    firecracker: firecracker.as_deref(),
                    parts: if vmm_parts.is_empty() {
                        bench::VmmPart::ALL
                    } else {
                        &vmm_parts
                    },
                }),
                sdk: sdk_python.as_deref().map(|python| bench::sdk::SdkBench {
                    python,
                    vmm: &vmm,
                    image: &guest,
                    runs: sdk_runs,
                    sample_timeout: Duration::from_secs(sample_timeout),
                    density_max,
                    phases: phases.as_deref(),
                    rl_counts: &rl_counts,
                    rl_steps: &rl_steps,
                    rl_budget: Duration::from_secs(rl_budget),
                    rl_groups: &rl_groups,
                    keep_logs: keep_logs.as_deref(),
                    task_images: task_images.as_deref(),
                }),
                images: images
                    .as_ref()
                    .map(|(entry, agent)| bench::images::ImagesBench {
                        entry,
                        agent,
                        scratch: &images_scratch,
                        runs,
                    }),
                deadline: std::time::Instant::now() + Duration::from_secs(timeout),
            };
            let report = runtime.block_on(plan.run());
            // The summary for people (on stderr, which reaches the terminal
            // through the lab too); the JSON on stdout for machines, always.
            eprint!("{}", bench::summary::summary(&report));
            emit(&report, json.as_deref())?;
            if bench::failed(&report) {
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::Stress { image, args } => {
            if !image.in_lab {
                stress::load_host(args.host_load);
            }
            if let Some(code) = run_in_lab_if_needed(&image, &[], &[], args.longest_run())? {
                return Ok(code);
            }
            if let Some(kib) = args.kvm_trace {
                let dir = vmm_driver::process::kvm_trace::enable(kib)
                    .context("turning on the KVM trace (--kvm-trace)")?;
                eprintln!("stress: tracing KVM events in {}", dir.display());
            }
            let vmm = image.vmm()?;
            let guest = image.guest();
            let plan = stress::Plan {
                vmm: &vmm,
                image: &guest,
                args: &args,
            };
            let mut report = runtime.block_on(plan.run())?;
            report["environment"] = serde_json::json!(environment(&image).to_string());
            eprintln!(
                "stress: {} trials, {} failed or hung",
                report["runs"], report["bad"]
            );
            if image.in_lab {
                // The lab machine's kernel log is this run's alone: its stall
                // reports count stalls that no trial overran, too.
                let stalls = stress::lab_stalls();
                eprintln!(
                    "stress: lab stall reports: {} soft lockups, {} long clocksource readouts, {} RCU stalls, {} stood still",
                    stalls["soft_lockup"],
                    stalls["long_readout"],
                    stalls["rcu_stall"],
                    stalls["stood_still"]
                );
                report["lab_stalls"] = stalls;
            }
            println!("{}", serde_json::to_string(&report)?);
            if report["bad"].as_u64() != Some(0) {
                return Ok(ExitCode::from(1));
            }
        }
        Command::Serve(args) => return serve::run(*args),
        Command::Soak(args) => return runtime.block_on(soak::run(args)),
        Command::Auth(cmd) => return runtime.block_on(auth::run(cmd)),
        Command::Status(args) => return runtime.block_on(status::run(args)),
        Command::Nodes(args) => return runtime.block_on(nodes::run(args)),
        Command::Cluster(cmd) => return cluster::run(cmd),
        Command::Ls(args) => return runtime.block_on(sandboxes::ls(args)),
        Command::Create(args) => return runtime.block_on(sandboxes::create(args)),
        Command::Run(args) => return runtime.block_on(run::run(args)),
        Command::Exec(args) => return runtime.block_on(exec::run(args)),
        Command::Pause(args) => return runtime.block_on(sandboxes::pause(args)),
        Command::Resume(args) => return runtime.block_on(sandboxes::resume(args)),
        Command::Fork(args) => return runtime.block_on(sandboxes::fork(args)),
        Command::Snapshot(args) => return runtime.block_on(sandboxes::snapshot(args)),
        Command::Timeout(args) => return runtime.block_on(sandboxes::timeout(args)),
        Command::Rm(args) => return runtime.block_on(sandboxes::rm(args)),
        Command::Logs(args) => return runtime.block_on(logs::run(args)),
        Command::Cp(args) => return runtime.block_on(cp::run(args)),
        Command::Template(cmd) => return runtime.block_on(template::run(cmd)),
        Command::Team(cmd) => return runtime.block_on(teams::team(cmd)),
        Command::Key(cmd) => return runtime.block_on(teams::key(cmd)),
        Command::Completions(args) => return Ok(completions::run(args, Cli::command())),
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_report_renders_without_a_kernel_and_a_bench_takes_json() {
        Cli::command().debug_assert();
        let report = Cli::try_parse_from(["sandfork", "bench", "report", "--json", "o/b.json"]);
        match report.map(|c| c.command) {
            Ok(Command::Bench {
                action: Some(bench::BenchCommand::Report { json }),
                ..
            }) => assert_eq!(json, PathBuf::from("o/b.json")),
            Ok(_) => panic!("not bench report"),
            Err(e) => panic!("{e}"),
        }
        assert!(Cli::try_parse_from(["sandfork", "bench", "report"]).is_err());
        let bench = Cli::try_parse_from([
            "sandfork", "bench", "--kernel", "k", "--rootfs", "r", "--json", "o/b.json",
        ]);
        match bench.map(|c| c.command) {
            Ok(Command::Bench {
                action: None,
                image: Some(image),
                json: Some(json),
                ..
            }) => assert_eq!((image.kernel, json), ("k".into(), "o/b.json".into())),
            Ok(_) => panic!("not a bench with --json"),
            Err(e) => panic!("{e}"),
        }
    }
}

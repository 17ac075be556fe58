//! Node figures through the real E2B Python SDK: a `sandfork serve` started
//! here on a fresh data dir and key, and `sdk_bench.py` run against it with
//! the SDK venv's python. Both run where the microVMs run (inside the lab
//! when the host cannot boot Linux), so the script can read the memory of the
//! server's processes from /proc; the script's JSON is merged into the report.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStderr, Command};

use crate::launcher::GuestImage;

const SCRIPT: &str = include_str!("sdk_bench.py");
/// The `rl` phase, imported by the script from its own directory.
const RL_SCRIPT: &str = include_str!("rl_bench.py");
/// Every phase but the rl ones (`--only sdk`; `--only rl` runs those), the
/// creates on a node without networking included.
pub const SDK_PHASES: &str = "first_command_faults,create_to_first_command,fork16,fork100,\
     fork_phases,guest_tcp,creates_concurrent,creates_concurrent16,idle,density,create_no_network";
/// `--only rl`: branching an episode (`rl`), fork per group (`rl_group`),
/// back to a checkpoint (`rollback`).
pub const RL_PHASES: &str = "rl,rl_group,rollback";
/// VMM processes the server keeps started (its default); the script waits
/// for the pool to be full before each phase.
const POOL_SIZE: usize = 4;
const STOP_TIMEOUT: Duration = Duration::from_secs(60);
/// Above `serve`'s default count limit: a fork of 100 must fit (with its
/// parent and the warm pool), and the density phase.
const MAX_SANDBOXES: usize = 128;
const VCPU_OVERCOMMIT: f64 = 128.0;

pub struct SdkBench<'a> {
    /// A python with the pinned e2b package (scripts/sdk-setup.sh prints one).
    pub python: &'a Path,
    pub vmm: &'a Path,
    pub image: &'a GuestImage,
    /// Sequential creates measured to their first command result.
    pub runs: usize,
    /// Each sample (a create to its first answer, a fork to every child's)
    /// at most this long; one that overruns is recorded as failed.
    pub sample_timeout: Duration,
    /// `density_idle_sandboxes`: creates until the node refuses or this
    /// many (0: not measured).
    pub density_max: usize,
    /// Only these phases of the script (comma-separated), or all.
    pub phases: Option<&'a str>,
    /// The `rl` phase's children per branch and steps to branch at
    /// (comma-separated).
    pub rl_counts: &'a str,
    pub rl_steps: &'a str,
    /// No new rl case after this long (zero: no bound).
    pub rl_budget: Duration,
    /// The `rl_group` phase's group sizes (comma-separated).
    pub rl_groups: &'a str,
    /// The task images' cache entry (tests/support/task_images.py), for
    /// the `images` phase: served by a registry on loopback for its time.
    pub task_images: Option<&'a Path>,
    /// Where each bench node's server log is kept (`serve.log`, and
    /// `serve-no-network.log` for the node without networking).
    pub keep_logs: Option<&'a Path>,
}

/// The pseudo-phase run on a second node started with `--no-network`: the
/// creates again (`sdk_create_to_first_command_no_network_ms`), against the
/// networked node's figure of the same run.
pub const NO_NETWORK_PHASE: &str = "create_no_network";
const CREATE_PHASE: &str = "create_to_first_command";
/// Creates by image against the task images (`--sdk-phases images`).
pub const IMAGES_PHASE: &str = "images";

/// The script's phases of `phases` (None: all) and whether the creates run
/// again on a node without networking.
fn split_phases(phases: Option<&str>) -> (Option<String>, bool) {
    let Some(list) = phases else {
        return (None, true);
    };
    let names: Vec<&str> = list.split(',').map(str::trim).collect();
    let script: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| *n != NO_NETWORK_PHASE && !n.is_empty())
        .collect();
    (Some(script.join(",")), names.contains(&NO_NETWORK_PHASE))
}

impl SdkBench<'_> {
    /// The script's phases on a node with networking (as `serve` runs by
    /// default), then the creates on one without, when asked.
    pub async fn measure(&self) -> Result<Value> {
        let (script_phases, no_network) = split_phases(self.phases);
        let mut report = match &script_phases {
            Some(p) if p.is_empty() => json!({}),
            p => {
                let mut r = self.measure_node(true, p.as_deref()).await?;
                // `serve`'s default: every sandbox in a network slot.
                r["sdk_detail"]["networking"] = json!(true);
                r
            }
        };
        if no_network {
            eprintln!("bench: sdk: the creates again, on a node started with --no-network");
            let off = self.measure_node(false, Some(CREATE_PHASE)).await?;
            let on_p50 = report["sdk_create_to_first_command_ms"]["p50"].as_f64();
            let off_figure = off["sdk_create_to_first_command_ms"].clone();
            if let (Some(on), Some(off)) = (on_p50, off_figure["p50"].as_f64()) {
                report["sdk_create_networking_ratio"] = json!(on / off);
            }
            report["sdk_create_to_first_command_no_network_ms"] = off_figure;
            report["sdk_detail"]["no_network"] = off;
        }
        Ok(report)
    }

    async fn measure_node(&self, network: bool, phases: Option<&str>) -> Result<Value> {
        let dir = tempfile::tempdir().context("creating the SDK bench directory")?;
        let script_path = dir.path().join("sdk_bench.py");
        write_scripts(dir.path())?;
        let log_path = dir.path().join("serve.log");
        let port = free_port()?;
        let key = api_key()?;
        let url = format!("http://127.0.0.1:{port}");

        let images_phase = phases.is_some_and(|p| p.split(',').any(|n| n.trim() == IMAGES_PHASE));
        let registry = match (images_phase, self.task_images) {
            (true, Some(entry)) => Some(super::images::Registry::start(&entry.join("storage"))?),
            (true, None) => bail!("the images phase needs the task images (--task-images)"),
            (false, _) => None,
        };
        let mut server =
            self.start_server(dir.path(), port, &key, &log_path, network, images_phase)?;
        let server_pid = server.id().context("the server exited at once")?;
        eprintln!(
            "bench: sdk: sandfork serve (pid {server_pid}) at {url}, log {}",
            log_path.display()
        );
        let report_file = dir.path().join("report.json");
        let mut script = Command::new(self.python);
        script.arg(&script_path);
        if let Some(phases) = phases {
            script.arg("--phases").arg(phases);
        }
        if let Some(registry) = &registry {
            script.arg("--task-registry").arg(&registry.host);
        }
        let script = script
            .arg("--server-pid")
            .arg(server_pid.to_string())
            .arg("--vmm-exe")
            .arg(self.vmm)
            .arg("--pool-size")
            .arg(POOL_SIZE.to_string())
            .arg("--runs")
            .arg(self.runs.to_string())
            .arg("--sample-timeout")
            .arg(self.sample_timeout.as_secs_f64().to_string())
            .arg("--density-max")
            .arg(self.density_max.to_string())
            .arg("--rl-counts")
            .arg(self.rl_counts)
            .arg("--rl-steps")
            .arg(self.rl_steps)
            .arg("--rl-budget")
            .arg(self.rl_budget.as_secs().to_string())
            .arg("--rl-groups")
            .arg(self.rl_groups)
            .arg("--report-file")
            .arg(&report_file)
            .env("E2B_API_URL", &url)
            .env("E2B_SANDBOX_URL", &url)
            .env("E2B_API_KEY", &key)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn();
        let mut script = match script {
            Ok(s) => s,
            Err(e) => {
                stop(&mut server).await;
                return Err(e).context("running the SDK bench script");
            }
        };
        let progress = relay(script.stderr.take().context("the script's stderr")?);
        // The script bounds every sample; this bounds the script (the
        // caller's deadline cuts this future, which kills it on drop too).
        let output = tokio::select! {
            output = script.wait_with_output() => match output {
                Ok(o) => Ok(o),
                Err(e) => Err(format!("waiting for the SDK bench script: {e}")),
            },
            status = server.wait() => Err(format!(
                "sandfork serve exited ({}) during the SDK bench",
                status.map_or_else(|e| e.to_string(), |s| s.to_string())
            )),
        };
        stop(&mut server).await;
        drop(registry);
        let script_tail = progress.await.unwrap_or_default();
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        if let Some(keep) = self.keep_logs {
            let kept = keep.join(if network {
                "serve.log"
            } else {
                "serve-no-network.log"
            });
            if let Err(e) = std::fs::write(&kept, &log) {
                eprintln!(
                    "bench: sdk: keeping the server log in {}: {e}",
                    kept.display()
                );
            }
        }
        let partial = std::fs::read(&report_file).ok();
        let mut report = assemble(output, partial.as_deref(), &script_tail, &log);
        report["sdk_detail"]["server_log_problems"] = log_problems(&log);
        Ok(report)
    }

    fn start_server(
        &self,
        dir: &Path,
        port: u16,
        key: &str,
        log: &Path,
        network: bool,
        images: bool,
    ) -> Result<Child> {
        let data = dir.join("data");
        let log = std::fs::File::create(log).context("creating the server log")?;
        let image = self.image;
        let mut serve = Command::new(std::env::current_exe()?);
        serve.arg("serve");
        if !network {
            serve.arg("--no-network");
        }
        if images {
            // Its own build cache, where its image conversions go (in the
            // lab the shared one is read-only).
            serve.env("SANDFORK_CACHE", dir.join("cache"));
        }
        serve
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--data-dir")
            .arg(&data)
            .arg("--pool-size")
            .arg(POOL_SIZE.to_string())
            // The density phase is bounded by memory, not by the count.
            .arg("--max-sandboxes")
            .arg(MAX_SANDBOXES.max(self.density_max + 32).to_string())
            // and vCPUs (one lab CPU is 32 at the default overcommit)
            .arg("--vcpu-overcommit")
            .arg(VCPU_OVERCOMMIT.to_string())
            .arg("--kernel")
            .arg(&image.kernel)
            .arg("--rootfs")
            .arg(&image.rootfs)
            .arg("--vmm")
            .arg(self.vmm)
            .arg("--vcpus")
            .arg(image.vcpus.to_string())
            .arg("--mem-mib")
            .arg(image.mem_mib.to_string())
            // this process already runs where microVMs boot
            .arg("--in-lab")
            .env("SANDFORK_API_KEY", key)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("starting sandfork serve")
    }
}

/// The script, the module it imports and the guest's TCP server it reads,
/// side by side in `dir`.
fn write_scripts(dir: &Path) -> Result<()> {
    std::fs::write(dir.join("sdk_bench.py"), SCRIPT).context("writing the SDK bench script")?;
    std::fs::write(dir.join("rl_bench.py"), RL_SCRIPT).context("writing the rl bench script")?;
    std::fs::write(dir.join("guest_tcp_server.py"), super::guest_tcp::SERVER)
        .context("writing the guest's TCP server")
}

/// Passes the script's progress on to our stderr line by line and returns its
/// last lines, which hold the traceback when it fails.
fn relay(stderr: ChildStderr) -> tokio::task::JoinHandle<String> {
    const KEPT: usize = 40;
    tokio::spawn(async move {
        let mut tail = std::collections::VecDeque::with_capacity(KEPT);
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            eprintln!("{line}");
            if tail.len() == KEPT {
                tail.pop_front();
            }
            tail.push_back(line);
        }
        Vec::from(tail).join("\n")
    })
}

/// Ends the server as its users would (SIGTERM), killing it if it hangs.
async fn stop(server: &mut Child) {
    if let Some(pid) = server.id().and_then(|p| i32::try_from(p).ok()) {
        // ESRCH: it has exited already.
        let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        if tokio::time::timeout(STOP_TIMEOUT, server.wait())
            .await
            .is_ok()
        {
            return;
        }
        eprintln!("bench: sdk: the server did not stop within {STOP_TIMEOUT:?}; killing it");
    }
    if let Err(e) = server.kill().await {
        eprintln!("bench: sdk: killing the server: {e}");
    }
}

/// The SDK figures from what the script left: its JSON on stdout, else the
/// report it saved after its last phase; what went wrong in `sdk_error`,
/// with the script's and the server's last lines.
fn assemble(
    output: Result<std::process::Output, String>,
    saved: Option<&[u8]>,
    script_tail: &str,
    server_log: &str,
) -> Value {
    let (printed, failure) = match output {
        Ok(o) => match parse_report(&o.stdout) {
            Ok(report) => (Some(report), None),
            Err(e) => (
                None,
                Some(format!("the SDK bench script failed ({}): {e:#}", o.status)),
            ),
        },
        Err(e) => (None, Some(e)),
    };
    let Some(failure) = failure else {
        return printed.unwrap_or_else(|| json!({}));
    };
    let mut report = saved
        .and_then(|s| parse_report(s).ok())
        .unwrap_or_else(|| json!({}));
    eprintln!("bench: sdk: {failure}");
    report["sdk_error"] = json!(failure);
    report["sdk_detail"]["script_tail"] = json!(script_tail);
    report["sdk_detail"]["server_log_tail"] = json!(tail(server_log, 40));
    report
}

/// The script's report: one JSON object.
fn parse_report(stdout: &[u8]) -> Result<Value> {
    let value: Value = serde_json::from_slice(stdout).with_context(|| {
        format!(
            "the SDK bench script printed no JSON: {:?}",
            String::from_utf8_lossy(stdout)
        )
    })?;
    if !value.is_object() {
        bail!("the SDK bench script printed {value}, not an object");
    }
    Ok(value)
}

/// The server's warnings and errors during the bench: their number and the
/// first few, so a figure that hides a misbehaving server says so.
fn log_problems(log: &str) -> Value {
    const KEPT: usize = 10;
    let problems: Vec<String> = log
        .lines()
        .map(strip_ansi)
        .filter(|l| {
            l.split_whitespace()
                .take(3)
                .any(|w| w == "WARN" || w == "ERROR")
        })
        .collect();
    json!({
        "count": problems.len(),
        "first": &problems[..problems.len().min(KEPT)],
    })
}

/// The log without terminal colour sequences (`ESC [ ... m`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

/// A fresh key in E2B's format, so no earlier key is ever reused.
fn api_key() -> Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom")?;
    Ok(format!(
        "e2b_{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    ))
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The python to run the script with: the one given, or the venv that
/// scripts/sdk-setup.sh of this source tree creates (once) and prints.
pub fn python(given: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(python) = given {
        return Ok(python);
    }
    let setup = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/sdk-setup.sh");
    if !setup.exists() {
        bail!(
            "{} is not here to install the E2B SDK: pass --sdk-python (a python with e2b), \
             or --no-sdk",
            setup.display()
        );
    }
    eprintln!(
        "bench: sdk: setting up the E2B Python SDK ({})",
        setup.display()
    );
    let output = std::process::Command::new(&setup)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", setup.display()))?;
    if !output.status.success() {
        bail!("{} failed ({})", setup.display(), output.status);
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    match stdout.lines().last() {
        Some(line) if !line.trim().is_empty() => Ok(PathBuf::from(line.trim())),
        _ => bail!("{} printed no python path", setup.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_no_network_creates_are_a_phase_of_their_own() {
        assert_eq!(split_phases(None), (None, true));
        assert_eq!(
            split_phases(Some("fork16,create_no_network")),
            (Some("fork16".into()), true)
        );
        assert_eq!(
            split_phases(Some("create_no_network")),
            (Some(String::new()), true)
        );
        assert_eq!(
            split_phases(Some("guest_tcp, fork16")),
            (Some("guest_tcp,fork16".into()), false)
        );
    }

    /// `--only sdk` runs every phase the script has but the rl ones, which
    /// `--only rl` runs, and the images one, which runs only when named.
    #[test]
    fn only_sdk_names_every_phase_but_rl() {
        // The phase table's entries: `("name", self.method, [keys])`.
        let text = SCRIPT.split_whitespace().collect::<Vec<_>>().join(" ");
        let entries = text.split("\", self.").collect::<Vec<_>>();
        let mut script: Vec<&str> = entries[..entries.len() - 1]
            .iter()
            .filter_map(|before| before.rsplit_once('"'))
            .filter(|(head, _)| head.trim_end().ends_with('('))
            .map(|(_, name)| name)
            .collect();
        let rl: Vec<&str> = RL_PHASES.split(',').collect();
        assert!(rl.iter().all(|p| script.contains(p)), "{script:?}");
        assert!(script.contains(&IMAGES_PHASE), "{script:?}");
        script.retain(|name| !rl.contains(name) && *name != IMAGES_PHASE);
        script.push(NO_NETWORK_PHASE);
        script.sort_unstable();
        let mut only: Vec<&str> = SDK_PHASES.split(',').map(str::trim).collect();
        only.sort_unstable();
        assert!(script.len() > 5, "phases found in the script: {script:?}");
        assert_eq!(only, script);
    }

    #[test]
    fn report_must_be_one_object() {
        let v = parse_report(br#"{"idle_sandbox_mib": 5.5}"#).unwrap();
        assert_eq!(v["idle_sandbox_mib"], 5.5);
        assert!(parse_report(b"[1, 2]").is_err());
        assert!(parse_report(b"Traceback (most recent call last):").is_err());
        assert!(parse_report(b"").is_err());
    }

    fn exited(code: i32, stdout: &str) -> Result<std::process::Output, String> {
        use std::os::unix::process::ExitStatusExt;
        Ok(std::process::Output {
            status: std::process::ExitStatus::from_raw(code << 8),
            stdout: stdout.as_bytes().to_vec(),
            stderr: Vec::new(),
        })
    }

    #[test]
    fn what_the_script_measured_is_kept_whatever_ends_it() {
        // It printed its report (a phase failed: it says so itself).
        let r = assemble(
            exited(
                1,
                r#"{"sdk_fork16_ms": null, "sdk_errors": {"fork16": "x"}}"#,
            ),
            None,
            "",
            "",
        );
        assert_eq!(r["sdk_errors"]["fork16"], "x");
        assert!(r.get("sdk_error").is_none());
        // It died mid-phase: the report it saved after the last phase.
        let saved = br#"{"sdk_create_to_first_command_ms": {"p50": 5}}"#;
        let r = assemble(
            exited(137, ""),
            Some(saved),
            "Traceback ...",
            "a\nb\nthe server's last line",
        );
        assert_eq!(r["sdk_create_to_first_command_ms"]["p50"], 5);
        assert!(
            r["sdk_error"]
                .as_str()
                .unwrap()
                .contains("exit status: 137"),
            "{r}"
        );
        assert_eq!(r["sdk_detail"]["script_tail"], "Traceback ...");
        assert!(
            r["sdk_detail"]["server_log_tail"]
                .as_str()
                .unwrap()
                .ends_with("last line")
        );
        // The server went away, nothing saved: the error alone.
        let r = assemble(Err("sandfork serve exited (signal 9)".into()), None, "", "");
        assert_eq!(r["sdk_error"], "sandfork serve exited (signal 9)");
        // A torn file (written while killed) is no report.
        let r = assemble(Err("x".into()), Some(b"{\"a\": "), "", "");
        assert_eq!(r.as_object().unwrap().len(), 2, "{r}");
    }

    #[test]
    fn server_warnings_and_errors_are_picked_from_its_log() {
        let log = "\u{1b}[2m2026-11-30T04:30:01Z\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m server: up\n\
                   2026-11-30T04:30:02Z \u{1b}[33m WARN\u{1b}[0m server::node::pool: warm pool: starting a VMM: gone\n\
                   2026-11-30T04:30:03Z ERROR server: fork failed\n\
                   2026-11-30T04:30:04Z  INFO server: the word WARN later on is no warning\n";
        let p = log_problems(log);
        assert_eq!(p["count"], 2);
        assert_eq!(
            p["first"][0],
            "2026-11-30T04:30:02Z  WARN server::node::pool: warm pool: starting a VMM: gone"
        );
        assert_eq!(
            p["first"][1],
            "2026-11-30T04:30:03Z ERROR server: fork failed"
        );
        assert_eq!(log_problems("")["count"], 0);
    }

    #[test]
    fn api_keys_are_fresh_and_e2b_shaped() {
        let (a, b) = (api_key().unwrap(), api_key().unwrap());
        assert_ne!(a, b);
        assert!(a.starts_with("e2b_") && a.len() == 36, "{a}");
        assert!(a[4..].chars().all(|c| c.is_ascii_hexdigit()));
    }

    /// The script's own checks of its percentiles and /proc readers, with any
    /// python 3 (no SDK needed).
    #[test]
    fn script_self_test() {
        let dir = tempfile::tempdir().unwrap();
        write_scripts(dir.path()).unwrap();
        let script = dir.path().join("sdk_bench.py");
        let out = std::process::Command::new("python3")
            .arg(&script)
            .arg("--self-test")
            .output()
            .expect("python3 runs");
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The script against a stand-in SDK (no node): a sandbox whose first
/// command never answers is a failed sample, the bench goes on, every
/// phase reports, and the density phase stops where the node refuses.
#[cfg(test)]
mod stand_in {
    use super::write_scripts;

    /// `e2b` and `httpx` as far as the script uses them: the seventh sandbox
    /// created (the third of the create phase, after the four of the page
    /// fault phase) never answers; more than five alive at once are refused.
    const FAKE_E2B: &str = r#"
import threading, itertools
_lock = threading.Lock()
_made = itertools.count(1)
_alive = set()

class ServiceBusyException(Exception):
    pass

class _Result:
    stdout = "ready\n"

class _Commands:
    def __init__(self, n):
        self.n = n
    def run(self, cmd, **kw):
        if self.n == 7:
            threading.Event().wait()  # as a guest that stopped answering
        return _Result()

class Sandbox:
    def __init__(self, n):
        self.sandbox_id = f"sbx{n}"
        self.commands = _Commands(n)

    @classmethod
    def create(cls, template, **kw):
        with _lock:
            if len(_alive) >= 5:
                raise ServiceBusyException("503: node over capacity: not enough memory")
            s = cls(next(_made))
            _alive.add(s.sandbox_id)
            return s

    def fork(self, count, **kw):
        return [Sandbox.create("fork") for _ in range(min(count, 2))]

    def create_snapshot(self, **kw):
        return None

    @classmethod
    def connect(cls, sandbox_id, **kw):
        s = cls(0)
        s.sandbox_id = sandbox_id
        return s

    def kill(self, **kw):
        with _lock:
            _alive.discard(self.sandbox_id)
"#;
    const FAKE_HTTPX: &str = r#"
class HTTPError(Exception):
    pass

class _Answer:
    status_code = 204
    text = "(stand-in diagnostics)"
    def json(self):
        return {"memoryMB": {"total": 1}, "vmmPageFaults": {"minor": 10, "major": 1}}

def get(url, **kw):
    return _Answer()

class _Forked:
    status_code = 201
    text = ""
    headers = {
        "sandfork-parent-paused-ms": "1.5",
        "sandfork-fork-phases": '{"children": 3, "totalMs": 9.0, "parentPausedMs": 1.5, '
        '"vmm": {"freezeMs": 0.2}, "child": {"loadedMs": {"median": 2.0, "max": 3.0}}}',
    }
    def json(self):
        return [{"sandbox": {"sandboxID": f"child{i}"}} for i in range(3)]

def request(method, url, **kw):
    # POST /sandboxes/{id}/fork (the fork past the SDK's limit), DELETE
    return _Forked() if url.endswith("/fork") else _Answer()

class Client:
    # the kept connection `_api` sends on
    def __init__(self, **kw):
        pass
    def request(self, method, url, **kw):
        return request(method, url, **kw)
"#;

    #[test]
    fn a_sample_that_never_answers_is_recorded_and_the_bench_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("lib");
        std::fs::create_dir_all(lib.join("e2b")).unwrap();
        std::fs::create_dir_all(lib.join("e2b-0.0.1.dist-info")).unwrap();
        std::fs::write(lib.join("e2b/__init__.py"), FAKE_E2B).unwrap();
        std::fs::write(
            lib.join("e2b-0.0.1.dist-info/METADATA"),
            "Metadata-Version: 2.1\nName: e2b\nVersion: 0.0.1\n",
        )
        .unwrap();
        std::fs::write(lib.join("httpx.py"), FAKE_HTTPX).unwrap();
        write_scripts(dir.path()).unwrap();
        let script = dir.path().join("sdk_bench.py");
        let report_file = dir.path().join("report.json");
        let me = std::process::id().to_string();
        let started = std::time::Instant::now();
        let out = std::process::Command::new("python3")
            .arg(&script)
            .args(["--server-pid", &me, "--vmm-exe", "/nonexistent"])
            .args([
                "--runs",
                "4",
                "--creates",
                "2",
                "--creates16",
                "4",
                "--idle",
                "1",
            ])
            .args([
                "--idle-seconds",
                "0",
                "--pool-size",
                "0",
                "--settle-seconds",
                "0",
            ])
            // No VMM processes here: the node never "settles"; a warning.
            .args(["--settle-timeout", "1", "--working-set-settle-seconds", "0"])
            .args(["--sample-timeout", "2", "--density-max", "50"])
            // Every phase but guest_tcp's, which needs a guest's network, and
            // rl's, whose steps' answers are checked in a real guest.
            .args([
                "--phases",
                "first_command_faults,create_to_first_command,fork16,fork100,\
                 fork_phases,creates_concurrent,creates_concurrent16,idle,density",
            ])
            .arg("--report-file")
            .arg(&report_file)
            .env("PYTHONPATH", &lib)
            .env("E2B_API_URL", "http://127.0.0.1:9")
            .env("E2B_API_KEY", "e2b_test")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{}\n{stderr}", out.status);
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        // Three creates answered; the stuck one is a failed sample.
        let created = &report["sdk_create_to_first_command_ms"];
        assert_eq!(created["samples"].as_array().unwrap().len(), 3, "{report}");
        let failed = &report["sdk_detail"]["create_to_first_command"]["failed_samples"];
        assert_eq!(failed[0]["sample"], 2, "{report}");
        assert!(
            failed[0]["error"]
                .as_str()
                .unwrap()
                .contains("TimeoutError"),
            "{report}"
        );
        // The page faults of a first command, before and after the working set.
        let faults = &report["first_command_page_faults"];
        assert_eq!(faults["without_prefetch"], 0, "{report}");
        assert_eq!(faults["with_prefetch"]["p50"], 0, "{report}");
        // The phases after it ran.
        assert!(report["sdk_fork16_ms"].is_number(), "{report}");
        // The fork past the Python SDK's limit goes over HTTP, with the
        // parent's pause from the node's answer.
        assert!(report["sdk_fork100_ms"].is_number(), "{report}");
        assert_eq!(report["sdk_detail"]["fork100"]["parent_paused_ms"], 1.5);
        assert_eq!(report["sdk_detail"]["fork100"]["fork_call"], "http");
        // Forks of 1, 16 and 100 over HTTP, each sample with the node's
        // phases; the parent's pause of each against a snapshot call's.
        for (n, samples) in [(1, 3), (16, 2), (100, 1)] {
            let phases = &report[format!("fork{n}_phases")];
            assert_eq!(
                phases["samples"].as_array().unwrap().len(),
                samples,
                "{report}"
            );
            assert_eq!(phases["median"]["total_ms"], 9.0, "{report}");
            assert_eq!(phases["median"]["child_loaded_ms_max"], 3.0, "{report}");
            assert!(
                phases["median"]["client_all_answered_ms"].is_number(),
                "{report}"
            );
        }
        let pauses = &report["fork_parent_pause_ms"]["samples"];
        assert_eq!(pauses.as_array().unwrap().len(), 6, "{report}");
        let snapshot = &report["snapshot_parent_pause_ms"]["samples"];
        assert_eq!(snapshot.as_array().unwrap().len(), 3, "{report}");
        assert!(report["sdk_creates_per_s_4way"].as_f64().unwrap() > 0.0);
        assert!(report["sdk_creates_per_s_16way"].as_f64().unwrap() > 0.0);
        assert_eq!(
            report["sdk_detail"]["creates_concurrent16"]["concurrency"],
            16
        );
        assert!(report["idle_sandbox_mib"].is_number(), "{report}");
        // Refused at the sixth: five admitted.
        assert_eq!(report["density_idle_sandboxes"], 5, "{report}");
        let density = &report["sdk_detail"]["density"];
        assert!(
            density["refused_with"]
                .as_str()
                .unwrap()
                .contains("ServiceBusyException"),
            "{report}"
        );
        assert_eq!(density["answered"], 5, "{report}");
        assert!(report.get("sdk_errors").is_none(), "{report}");
        assert!(
            report["sdk_warnings"][0]
                .as_str()
                .unwrap()
                .contains("did not settle")
        );
        // What it saved is what it printed.
        let saved: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&report_file).unwrap()).unwrap();
        assert_eq!(saved, report);
        assert!(started.elapsed() < std::time::Duration::from_secs(60));
    }
}

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
/// VMM processes the server keeps started (its default); the script waits
/// for the pool to be full before each phase.
const POOL_SIZE: usize = 4;
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

pub struct SdkBench<'a> {
    /// A python with the pinned e2b package (scripts/sdk-setup.sh prints one).
    pub python: &'a Path,
    pub vmm: &'a Path,
    pub image: &'a GuestImage,
    /// Sequential creates measured to their first command result.
    pub runs: usize,
}

impl SdkBench<'_> {
    pub async fn measure(&self) -> Result<Value> {
        let dir = tempfile::tempdir().context("creating the SDK bench directory")?;
        let script = dir.path().join("sdk_bench.py");
        std::fs::write(&script, SCRIPT).context("writing the SDK bench script")?;
        let log_path = dir.path().join("serve.log");
        let port = free_port()?;
        let key = api_key()?;
        let url = format!("http://127.0.0.1:{port}");

        let mut server = self.start_server(dir.path(), port, &key, &log_path)?;
        let server_pid = server.id().context("the server exited at once")?;
        eprintln!(
            "bench: sdk: sandfork serve (pid {server_pid}) at {url}, log {}",
            log_path.display()
        );
        let mut script = Command::new(self.python)
            .arg(&script)
            .arg("--server-pid")
            .arg(server_pid.to_string())
            .arg("--vmm-exe")
            .arg(self.vmm)
            .arg("--pool-size")
            .arg(POOL_SIZE.to_string())
            .arg("--runs")
            .arg(self.runs.to_string())
            .env("E2B_API_URL", &url)
            .env("E2B_SANDBOX_URL", &url)
            .env("E2B_API_KEY", &key)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("running the SDK bench script")?;
        let progress = relay(script.stderr.take().context("the script's stderr")?);
        let output = tokio::select! {
            output = script.wait_with_output() => output.context("running the SDK bench script")?,
            status = server.wait() => {
                bail!(
                    "sandfork serve exited ({}) during the SDK bench; its log ends:\n{}",
                    status?,
                    log_tail(&log_path)
                );
            }
        };
        stop(&mut server).await?;
        let script_tail = progress.await.unwrap_or_default();
        if !output.status.success() {
            bail!(
                "the SDK bench script failed ({}):\n{}\nthe server's log ends:\n{}",
                output.status,
                script_tail,
                log_tail(&log_path)
            );
        }
        let mut report = parse_report(&output.stdout)?;
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        report["sdk_detail"]["server_log_problems"] = log_problems(&log);
        Ok(report)
    }

    fn start_server(&self, dir: &Path, port: u16, key: &str, log: &Path) -> Result<Child> {
        let data = dir.join("data");
        let log = std::fs::File::create(log).context("creating the server log")?;
        let image = self.image;
        Command::new(std::env::current_exe()?)
            .arg("serve")
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--data-dir")
            .arg(&data)
            .arg("--pool-size")
            .arg(POOL_SIZE.to_string())
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
async fn stop(server: &mut Child) -> Result<()> {
    if let Some(pid) = server.id() {
        let pid = Pid::from_raw(i32::try_from(pid).context("server pid")?);
        // ESRCH: it has exited already.
        let _ = kill(pid, Signal::SIGTERM);
        if tokio::time::timeout(STOP_TIMEOUT, server.wait())
            .await
            .is_ok()
        {
            return Ok(());
        }
        eprintln!("bench: sdk: the server did not stop within {STOP_TIMEOUT:?}; killing it");
    }
    server.kill().await.context("killing the server")
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

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
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
    fn report_must_be_one_object() {
        let v = parse_report(br#"{"idle_sandbox_mib": 5.5}"#).unwrap();
        assert_eq!(v["idle_sandbox_mib"], 5.5);
        assert!(parse_report(b"[1, 2]").is_err());
        assert!(parse_report(b"Traceback (most recent call last):").is_err());
        assert!(parse_report(b"").is_err());
    }

    #[test]
    fn server_warnings_and_errors_are_picked_from_its_log() {
        let log = "\u{1b}[2m2026-11-30T04:30:01Z\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m server: up\n\
                   2026-11-30T04:30:02Z \u{1b}[33m WARN\u{1b}[0m server::pool: warm pool: starting a VMM: gone\n\
                   2026-11-30T04:30:03Z ERROR server: fork failed\n\
                   2026-11-30T04:30:04Z  INFO server: the word WARN later on is no warning\n";
        let p = log_problems(log);
        assert_eq!(p["count"], 2);
        assert_eq!(
            p["first"][0],
            "2026-11-30T04:30:02Z  WARN server::pool: warm pool: starting a VMM: gone"
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
        let script = dir.path().join("sdk_bench.py");
        std::fs::write(&script, SCRIPT).unwrap();
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

//! Running a command in a lab machine: one QEMU process per command.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::{LabConfig, OutputMode, TcgThreads, check_rw_dir, effective_env};
use crate::error::{LabError, Result};
use crate::job::{GuestStatus, job_script};
use crate::prepare::{LabPaths, prepare};
use crate::qemu::{MachineFiles, QEMU, qemu_args};
use crate::stall::{BEAT, NUDGE, StallEvent, StallWatch};

/// How long QEMU may take to power off after the command has ended.
const POWEROFF_GRACE: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(50);
/// How long the machine may take to report its state on a timeout, and how
/// much of it is kept.
const DIAG_TIMEOUT: Duration = Duration::from_secs(30);
const DIAG_MAX_BYTES: usize = 256 * 1024;
/// QEMU's monitor has said all it will when it has been quiet this long.
const MONITOR_QUIET: Duration = Duration::from_secs(2);
/// The lines init starts serving diagnostics with, and ends a report with.
const DIAG_READY: &str = "SANDFORK-DIAG-READY";
const DIAG_END: &str = "SANDFORK-DIAG-END";

/// Directories the lab mounts afresh, hiding the host's.
const FRESH_INSIDE: [&str; 2] = ["/tmp", "/run"];

/// The read-write shares to mount: `dirs` less those a share of another
/// already covers (the same directory, or one inside it: a data dir under
/// the build cache), so a caller may name both and none hides another.
fn outermost(dirs: Vec<PathBuf>) -> Vec<PathBuf> {
    let mut kept: Vec<PathBuf> = Vec::with_capacity(dirs.len());
    for dir in dirs {
        if kept.iter().any(|k| dir.starts_with(k)) {
            continue;
        }
        kept.retain(|k| !k.starts_with(&dir));
        kept.push(dir);
    }
    kept
}

/// A working directory under /tmp or /run (a checkout in /tmp, say) would be
/// hidden by the lab's fresh mounts: returns the top directory below that
/// mount (`/tmp/ci` for `/tmp/ci/crates/x`) to share read-write, unless a
/// share already covers it.
fn shadowed_tree<'a>(cwd: &Path, mut shared: impl Iterator<Item = &'a Path>) -> Option<PathBuf> {
    let top = FRESH_INSIDE.iter().find_map(|fresh| {
        let rest = cwd.strip_prefix(fresh).ok()?;
        let first = rest.components().next()?;
        Some(Path::new(fresh).join(first))
    })?;
    (!shared.any(|dir| cwd.starts_with(dir))).then_some(top)
}

/// A prepared lab: a kernel and initramfs ready to boot.
#[derive(Debug, Clone)]
pub struct Lab {
    paths: LabPaths,
}

/// A finished command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabOutput {
    /// The command's exit code; 128+N when a signal N ended it.
    pub code: i32,
    /// Empty unless the output mode was [`OutputMode::Capture`].
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl LabOutput {
    pub fn success(&self) -> bool {
        self.code == 0
    }
}

impl Lab {
    /// Finds the cached lab under `<cache_dir>/lab/`, building it if needed
    /// (downloads the kernel package with apt the first time). Reuses the lab
    /// prepared last without asking apt; see [`Lab::prepare_refresh`].
    pub fn prepare(cache_dir: &Path) -> Result<Lab> {
        Ok(Lab {
            paths: prepare(cache_dir, false)?,
        })
    }

    /// Like [`Lab::prepare`], but asks apt for the current kernel package
    /// first, building a new lab when it changed.
    pub fn prepare_refresh(cache_dir: &Path) -> Result<Lab> {
        Ok(Lab {
            paths: prepare(cache_dir, true)?,
        })
    }

    /// A lab from files prepared earlier.
    pub fn from_paths(paths: LabPaths) -> Lab {
        Lab { paths }
    }

    pub fn paths(&self) -> &LabPaths {
        &self.paths
    }

    /// Runs `argv` in a fresh lab machine and waits for it.
    pub fn run(&self, config: &LabConfig, argv: &[String]) -> Result<LabOutput> {
        self.spawn(config, argv)?.wait()
    }

    /// Starts `argv` in a fresh lab machine; the machine lives until the
    /// command ends, [`LabChild::kill`] is called, or the timeout passes.
    pub fn spawn(&self, config: &LabConfig, argv: &[String]) -> Result<LabChild> {
        let program = argv.first().ok_or(LabError::EmptyCommand)?.clone();
        if config.cpus == 0 || config.memory_mib < 256 {
            return Err(LabError::BadConfig(
                "the lab needs at least 1 vCPU and 256 MiB".into(),
            ));
        }
        if config.icount && config.tcg_threads == TcgThreads::Multi {
            return Err(LabError::BadConfig(
                "instruction counting (icount) needs single-threaded TCG".into(),
            ));
        }
        let cwd = match &config.cwd {
            Some(c) => c.clone(),
            None => std::env::current_dir().map_err(|e| LabError::io("current directory", e))?,
        };
        if !cwd.is_absolute() {
            return Err(LabError::BadConfig(format!(
                "working directory {} is not absolute",
                cwd.display()
            )));
        }
        let host_env = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)));
        let env = effective_env(config, host_env)?;
        let checked = config
            .rw_dirs
            .iter()
            .map(|d| check_rw_dir(d))
            .collect::<Result<Vec<_>, _>>()?;
        let mut shares: Vec<(String, PathBuf)> = outermost(checked)
            .into_iter()
            .enumerate()
            .map(|(i, dir)| (format!("rw{i}"), dir))
            .collect();
        if let Some(dir) = shadowed_tree(&cwd, shares.iter().map(|(_, d)| d.as_path())) {
            shares.push((format!("rw{}", shares.len()), check_rw_dir(&dir)?));
        }

        sweep_stale_run_dirs(&std::env::temp_dir(), Duration::from_secs(3600));
        let run_dir = tempfile::Builder::new()
            .prefix(RUN_DIR_PREFIX)
            .tempdir()
            .map_err(|e| LabError::io("create the run directory", e))?;
        let dir = run_dir.path().to_path_buf();
        if dir.to_string_lossy().contains(char::is_whitespace) {
            return Err(LabError::BadConfig(format!(
                "the temporary directory {} has blanks in its path (set TMPDIR)",
                dir.display()
            )));
        }
        let write = |name: &str, text: &str| {
            std::fs::write(dir.join(name), text)
                .map_err(|e| LabError::io(format!("write {name}"), e))
        };
        write(RUNNER_PID, &std::process::id().to_string())?;
        write("job.sh", &job_script(&cwd, &env, argv))?;
        let mounts: String = shares
            .iter()
            .map(|(tag, d)| format!("{tag} {}\n", d.display()))
            .collect();
        write("mounts", &mounts)?;

        let sock = |name: &str| -> Result<(PathBuf, UnixListener)> {
            let path = dir.join(name);
            let l = UnixListener::bind(&path)
                .map_err(|e| LabError::io(format!("listen on {}", path.display()), e))?;
            Ok((path, l))
        };
        let (out_path, out_l) = sock("out.sock")?;
        let (err_path, err_l) = sock("err.sock")?;
        let (status_path, status_l) = sock("status.sock")?;
        let (diag_path, diag_l) = sock("diag.sock")?;
        let console_log = config
            .console_log
            .clone()
            .unwrap_or_else(|| dir.join("console.log"));
        let qemu_stderr_path = dir.join("qemu.stderr");
        let qemu_stderr = std::fs::File::create(&qemu_stderr_path)
            .map_err(|e| LabError::io("create qemu.stderr", e))?;

        let args = qemu_args(
            config,
            &MachineFiles {
                kernel: &self.paths.kernel,
                initramfs: &self.paths.initramfs,
                job_dir: &dir,
                console_log: &console_log,
                stdout_sock: &out_path,
                stderr_sock: &err_path,
                status_sock: &status_path,
                diag_sock: &diag_path,
                monitor_sock: &dir.join("monitor.sock"),
                rw_shares: &shares,
            },
        );
        let mut cmd = Command::new(QEMU);
        cmd.args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(qemu_stderr);
        if config.die_with_parent {
            let parent = std::process::id();
            // SAFETY: the closure runs between fork and exec and only calls
            // prctl and getppid, which are async-signal-safe and allocate nothing.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    // The parent may have died before the prctl took effect.
                    if u32::try_from(libc::getppid()).ok() != Some(parent) {
                        return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                    }
                    Ok(())
                });
            }
        }
        let qemu = cmd.spawn().map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                LabError::ToolMissing {
                    program: QEMU.into(),
                    package: "qemu-system-x86",
                }
            } else {
                LabError::io(format!("start {QEMU}"), e)
            }
        })?;

        let (status_tx, status_rx) = mpsc::channel();
        let status_thread = std::thread::spawn(move || {
            if let Ok((s, _)) = status_l.accept() {
                for line in BufReader::new(s).lines() {
                    let Ok(line) = line else { break };
                    if status_tx.send(line).is_err() {
                        break;
                    }
                }
            }
        });
        // QEMU connects at start; init says when it serves the port, and
        // the connection is kept for a timeout.
        let (diag_tx, diag) = mpsc::channel();
        std::thread::spawn(move || {
            let Ok((stream, _)) = diag_l.accept() else {
                return;
            };
            let mut ready = String::new();
            if BufReader::new(&stream).read_line(&mut ready).is_ok()
                && ready.trim_end() == DIAG_READY
            {
                let _ = diag_tx.send(stream);
            }
        });
        let stdout_thread = spawn_copier(out_l, config.output, Sink::Stdout);
        let stderr_thread = spawn_copier(err_l, config.output, Sink::Stderr);

        Ok(LabChild {
            qemu,
            run_dir: Some(run_dir),
            sockets: vec![out_path, err_path, status_path, diag_path],
            diag,
            stdout_thread: Some(stdout_thread),
            stderr_thread: Some(stderr_thread),
            status_thread: Some(status_thread),
            status_rx,
            status: GuestStatus::default(),
            stall: StallWatch::new(config.nudge_stalls),
            started: Instant::now(),
            timeout: config.timeout,
            killed: false,
            qemu_exit: None,
            program,
            cwd,
            console_log,
            qemu_stderr: qemu_stderr_path,
        })
    }
}

#[derive(Clone, Copy)]
enum Sink {
    Stdout,
    Stderr,
}

/// Accepts QEMU's connection for one port and copies what arrives.
fn spawn_copier(listener: UnixListener, mode: OutputMode, sink: Sink) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        let Ok((mut s, _)) = listener.accept() else {
            return kept;
        };
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            match mode {
                OutputMode::Capture => kept.extend_from_slice(&buf[..n]),
                // Writes to our own stdout/stderr failing (closed pipe) must
                // not stop the drain, or QEMU would block on a full socket.
                OutputMode::Inherit => match sink {
                    Sink::Stdout => {
                        let mut o = std::io::stdout().lock();
                        let _ = o.write_all(&buf[..n]).and_then(|_| o.flush());
                    }
                    Sink::Stderr => {
                        let _ = std::io::stderr().lock().write_all(&buf[..n]);
                    }
                },
            }
        }
        kept
    })
}

/// A command running in a lab machine.
#[derive(Debug)]
pub struct LabChild {
    qemu: Child,
    run_dir: Option<tempfile::TempDir>,
    sockets: Vec<PathBuf>,
    stdout_thread: Option<JoinHandle<Vec<u8>>>,
    stderr_thread: Option<JoinHandle<Vec<u8>>>,
    status_thread: Option<JoinHandle<()>>,
    diag: Receiver<UnixStream>,
    status_rx: Receiver<String>,
    status: GuestStatus,
    stall: StallWatch,
    started: Instant,
    timeout: Option<Duration>,
    killed: bool,
    qemu_exit: Option<ExitStatus>,
    program: String,
    cwd: PathBuf,
    console_log: PathBuf,
    qemu_stderr: PathBuf,
}

impl LabChild {
    /// The QEMU process id.
    pub fn id(&self) -> u32 {
        self.qemu.id()
    }

    /// Stops the machine at once (SIGKILL to QEMU).
    pub fn kill(&mut self) -> Result<()> {
        if self.qemu_exit.is_none() {
            self.killed = true;
            if let Err(e) = self.qemu.kill() {
                // Already exited: nothing to stop.
                if e.kind() != std::io::ErrorKind::InvalidInput {
                    return Err(LabError::io("kill qemu", e));
                }
            }
        }
        Ok(())
    }

    /// Waits for the command, applying the timeout; the exit code, or why
    /// there is none.
    pub fn wait(mut self) -> Result<LabOutput> {
        let mut timed_out = false;
        let mut diagnostics = String::new();
        let mut exit_seen: Option<Instant> = None;
        loop {
            if let Some(st) = self
                .qemu
                .try_wait()
                .map_err(|e| LabError::io("wait for qemu", e))?
            {
                self.qemu_exit = Some(st);
                break;
            }
            if let Some(t) = self.timeout
                && self.started.elapsed() >= t
            {
                timed_out = true;
                diagnostics = self.diagnose();
                self.stop_qemu()?;
                break;
            }
            if let Some(seen) = exit_seen
                && seen.elapsed() >= POWEROFF_GRACE
            {
                // The command is done but the machine hangs in power-off.
                self.stop_qemu()?;
                break;
            }
            match self.status_rx.recv_timeout(POLL) {
                Ok(line) if line.trim_end() == BEAT => {
                    if let Some(event) = self.stall.beat(Instant::now()) {
                        eprintln!("{event}");
                    }
                }
                Ok(line) => self.status.take_line(&line),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => std::thread::sleep(POLL),
            }
            if let Some(event) = self.stall.poll(Instant::now()) {
                eprintln!("{event}");
                if let StallEvent::Stalled { nudged: true, .. } = event {
                    self.monitor(NUDGE);
                }
            }
            if self.status.exit_code.is_some() && exit_seen.is_none() {
                exit_seen = Some(Instant::now());
            }
        }
        let (stdout, stderr) = self.join_readers();
        if let Some(summary) = self.stall.summary() {
            eprintln!("{summary}");
        }
        while let Ok(line) = self.status_rx.try_recv() {
            self.status.take_line(&line);
        }
        let st = &self.status;
        if let Some(msg) = &st.error {
            return Err(LabError::Guest(msg.clone()));
        }
        if st.not_found {
            return Err(LabError::CommandNotFound {
                program: self.program.clone(),
            });
        }
        if st.no_cwd {
            return Err(LabError::NoWorkingDir {
                cwd: self.cwd.clone(),
            });
        }
        if let Some(code) = st.exit_code {
            return Ok(LabOutput {
                code,
                stdout,
                stderr,
            });
        }
        if timed_out {
            return Err(LabError::Timeout {
                after: self.started.elapsed(),
                diagnostics,
                console_tail: tail(&self.console_log, 25),
            });
        }
        if self.killed {
            return Err(LabError::Killed);
        }
        Err(LabError::NoExitStatus {
            qemu_status: self
                .qemu_exit
                .map(|s| s.to_string())
                .unwrap_or_else(|| "unknown".into()),
            qemu_stderr: std::fs::read_to_string(&self.qemu_stderr).unwrap_or_default(),
            console_tail: tail(&self.console_log, 25),
        })
    }

    /// The machine's state: what its init reports (kernel messages,
    /// threads) and, from QEMU's monitor, the emulated CPU's registers (a
    /// machine whose init cannot answer is stuck below it: in its kernel or
    /// in the emulator).
    fn diagnose(&mut self) -> String {
        let guest = self.guest_diagnostics();
        let cpu = self.monitor(&["info registers", "info cpus", "info lapic"]);
        format!("{guest}--- lab CPU (QEMU monitor)\n{cpu}")
    }

    /// Sends commands to QEMU's human monitor and returns what it printed
    /// until it went quiet.
    fn monitor(&self, commands: &[&str]) -> String {
        let Some(dir) = self.run_dir.as_ref().map(|d| d.path().join("monitor.sock")) else {
            return "(no monitor)\n".into();
        };
        let mut stream = match UnixStream::connect(&dir) {
            Ok(s) => s,
            Err(e) => return format!("(cannot reach QEMU's monitor: {e})\n"),
        };
        let _ = stream.set_read_timeout(Some(MONITOR_QUIET));
        for c in commands {
            let _ = stream.write_all(format!("{c}\n").as_bytes());
        }
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        let deadline = Instant::now() + DIAG_TIMEOUT;
        while let Ok(n) = stream.read(&mut buf) {
            if n == 0 || Instant::now() >= deadline || out.len() > DIAG_MAX_BYTES {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        // Leave out the monitor's echo of what was typed (with terminal
        // escapes) and the floating-point and vector registers.
        String::from_utf8_lossy(&out)
            .lines()
            .map(|l| l.trim_end_matches('\r'))
            .filter(|l| {
                !["(qemu)", "FCW=", "FPR", "YMM", "XMM", "DR"]
                    .iter()
                    .any(|p| l.starts_with(p))
            })
            .fold(String::new(), |mut text, l| {
                text.push_str(l);
                text.push('\n');
                text
            })
    }

    /// Asks the machine's init for its state (kernel messages, threads);
    /// at most [`DIAG_TIMEOUT`], and says so when it does not answer.
    fn guest_diagnostics(&mut self) -> String {
        let Ok(stream) = self.diag.try_recv() else {
            return "(the lab's init was not serving diagnostics yet)".into();
        };
        let deadline = Instant::now() + DIAG_TIMEOUT;
        let mut report = String::new();
        let asked = stream
            .set_read_timeout(Some(DIAG_TIMEOUT))
            .and_then(|()| (&stream).write_all(b"diag\n"));
        if let Err(e) = asked {
            return format!("(cannot ask the lab for diagnostics: {e})");
        }
        for line in BufReader::new(&stream).lines() {
            match line {
                Ok(line) if line == DIAG_END => return report,
                Ok(line) => {
                    report.push_str(&line);
                    report.push('\n');
                }
                Err(_) => break,
            }
            if Instant::now() >= deadline || report.len() > DIAG_MAX_BYTES {
                break;
            }
        }
        report.push_str("(the lab's diagnostics were cut short)\n");
        report
    }

    fn stop_qemu(&mut self) -> Result<()> {
        let _ = self.qemu.kill();
        let st = self
            .qemu
            .wait()
            .map_err(|e| LabError::io("wait for qemu", e))?;
        self.qemu_exit = Some(st);
        Ok(())
    }

    /// Collects the output threads once QEMU is gone. A thread still waiting
    /// for QEMU to connect (QEMU failed early) is woken by connecting to it.
    fn join_readers(&mut self) -> (Vec<u8>, Vec<u8>) {
        for s in &self.sockets {
            let _ = UnixStream::connect(s);
        }
        let out = self
            .stdout_thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default();
        let err = self
            .stderr_thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default();
        if let Some(t) = self.status_thread.take() {
            let _ = t.join();
        }
        (out, err)
    }
}

impl Drop for LabChild {
    fn drop(&mut self) {
        if self.qemu_exit.is_none() {
            let _ = self.qemu.kill();
            let _ = self.qemu.wait();
        }
        self.join_readers();
        // The run directory goes with the child; a console log to keep is
        // written elsewhere through `LabConfig::console_log`.
        drop(self.run_dir.take());
    }
}

/// The last `n` lines of a text file, or nothing.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Where each run keeps its sockets, job and console log.
const RUN_DIR_PREFIX: &str = "sandfork-lab-";
/// The run's own pid, in its directory: a directory whose runner is gone
/// was left by a run killed by a signal (its `TempDir` never dropped).
const RUNNER_PID: &str = "runner.pid";

/// Removes the run directories in `tmp` that runs killed by a signal left:
/// those whose runner process is gone, and those without a runner's pid
/// (made before it was written) older than `unowned_after`.
fn sweep_stale_run_dirs(tmp: &Path, unowned_after: Duration) {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().starts_with(RUN_DIR_PREFIX) {
            continue;
        }
        let dir = entry.path();
        let stale = match std::fs::read_to_string(dir.join(RUNNER_PID)) {
            Ok(pid) => {
                let pid = pid.trim();
                !pid.is_empty() && !Path::new("/proc").join(pid).exists()
            }
            Err(_) => entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > unowned_after),
        };
        if stale {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn run_dirs_of_runners_gone_are_swept_and_live_ones_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let made = |name: &str, pid: Option<String>| {
            let dir = tmp.path().join(name);
            std::fs::create_dir(&dir).unwrap();
            std::fs::write(dir.join("console.log"), "x").unwrap();
            if let Some(pid) = pid {
                std::fs::write(dir.join(RUNNER_PID), pid).unwrap();
            }
            dir
        };
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let dead = made("sandfork-lab-dead", Some(gone.to_string()));
        let live = made("sandfork-lab-live", Some(std::process::id().to_string()));
        let young = made("sandfork-lab-young", None);
        let other = made("other-dir", Some(gone.to_string()));
        sweep_stale_run_dirs(tmp.path(), Duration::from_secs(3600));
        assert!(!dead.exists());
        assert!(live.exists() && young.exists() && other.exists());
        // Without a pid, only its age tells.
        sweep_stale_run_dirs(tmp.path(), Duration::ZERO);
        assert!(!young.exists() && live.exists());
    }
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("log");
        std::fs::write(&f, "a\nb\nc\n").unwrap();
        assert_eq!(tail(&f, 2), "b\nc");
        assert_eq!(tail(&f, 10), "a\nb\nc");
        assert_eq!(tail(&d.path().join("missing"), 3), "");
    }

    #[test]
    fn empty_command_is_rejected_before_qemu() {
        let lab = Lab::from_paths(LabPaths {
            dir: "/nonexistent".into(),
            kernel: "/nonexistent/vmlinuz".into(),
            initramfs: "/nonexistent/initramfs.cpio".into(),
            manifest: "/nonexistent/manifest".into(),
        });
        assert!(matches!(
            lab.spawn(&LabConfig::default(), &[]),
            Err(LabError::EmptyCommand)
        ));
    }
}

#[cfg(test)]
mod shadow_tests {
    use super::*;

    #[test]
    fn nested_shares_keep_the_outer_one() {
        let paths = |v: &[&str]| v.iter().map(PathBuf::from).collect::<Vec<_>>();
        // CI's checkout sits under the cache: the cache's share covers both,
        // in either order.
        for named in [
            ["/var/cache/sf/ci-checkout/target/data", "/var/cache/sf"],
            ["/var/cache/sf", "/var/cache/sf/ci-checkout/target/data"],
        ] {
            assert_eq!(outermost(paths(&named)), paths(&["/var/cache/sf"]));
        }
        assert_eq!(
            outermost(paths(&["/srv/data", "/var/cache/sf", "/srv/data"])),
            paths(&["/srv/data", "/var/cache/sf"])
        );
        // A sibling whose name only starts the same is not nested.
        assert_eq!(
            outermost(paths(&["/var/cache/sf-data", "/var/cache/sf"])),
            paths(&["/var/cache/sf-data", "/var/cache/sf"])
        );
    }

    #[test]
    fn a_checkout_under_tmp_is_shared() {
        let none: [&Path; 0] = [];
        assert_eq!(
            shadowed_tree(Path::new("/tmp/ci/crates/lab"), none.into_iter()),
            Some(PathBuf::from("/tmp/ci"))
        );
        assert_eq!(
            shadowed_tree(Path::new("/work/main"), none.into_iter()),
            None
        );
        assert_eq!(shadowed_tree(Path::new("/tmp"), none.into_iter()), None);
        assert_eq!(
            shadowed_tree(Path::new("/tmp/ci/x"), [Path::new("/tmp/ci")].into_iter()),
            None
        );
    }
}

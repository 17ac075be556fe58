//! `sandfork soak`: many sandboxes kept busy through the node's envd proxy
//! for a while, every answer checked, every failure recorded, and the
//! node's memory read before and after. Commands echo a unique token and a
//! sum the shell computes; files of random content and varied size are
//! written and read back byte for byte. The load ends at a count
//! (`--commands`, `--files`) or a duration, whichever comes first; the
//! sandboxes are killed at the end, on failure and on Ctrl-C.

mod memory;
mod report;

use std::cell::{Cell, RefCell};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use bytes::Bytes;
use envd_proto::process::{DataEvent, EndEvent, ProcessConfig, ProcessEvent, StartRequest};
use futures_util::StreamExt;
use serde_json::{Value, json};

use crate::client::envd::Sandbox;
use crate::client::{Node, NodeError, check_id, http};
use memory::{Located, NodeMemory};

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Examples:\n  sandfork soak                                   # 16 sandboxes, 2000 commands, 500 files, at most 10 min\n  sandfork soak --sandboxes 4 --commands 300 --files 100 --duration 3m\n  sandfork soak --sandboxes 32 --commands 10000 --files 2000 --duration 30m\n\nOne JSON object on stdout, a summary on stderr; exit status 1 when any operation\nfailed or the server's RSS grew more than --max-growth-mib."
)]
pub struct SoakArgs {
    /// The template (or snapshot) the sandboxes are created from.
    #[arg(long, default_value = "base")]
    template: String,
    /// Sandboxes to create and keep busy.
    #[arg(long, short = 's', default_value_t = 16)]
    sandboxes: usize,
    /// Concurrent workers, each running one operation at a time on the
    /// sandboxes in turn [default: twice --sandboxes].
    #[arg(long, short = 'c')]
    workers: Option<usize>,
    /// Commands to run (echo of a token and a sum, stdout checked).
    #[arg(long, default_value_t = 2000)]
    commands: u64,
    /// File round trips (written, read back, compared byte for byte).
    #[arg(long, default_value_t = 500)]
    files: u64,
    /// At most this long for the load (after the sandboxes are up), e.g. 90s, 30m.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// The largest file written, in KiB (sizes vary from 1 byte up to it).
    #[arg(long, value_name = "KIB", default_value_t = 1024)]
    max_file_kib: u64,
    /// Each operation (a command, a write, a read) at most this long
    /// before it counts as failed.
    #[arg(long, value_name = "SECS", default_value_t = 120)]
    op_timeout: u64,
    /// Fail when the server's RSS grew more than this many MiB from the
    /// reading after the warm-up to the one at the end.
    // The warm-up has every worker move a largest file at once, so the
    // allocator's high-water mark for transfers is reached before the first
    // reading; 64 MiB leaves room for what the node keeps (sandbox logs,
    // metrics), while a leak of 7 KiB or more per operation over the long
    // run's 12 000 operations exceeds it.
    #[arg(long, value_name = "MIB", default_value_t = 64.0)]
    max_growth_mib: f64,
    /// Stop the load after this many failed operations (the rest would
    /// mostly repeat the first failures).
    #[arg(long, default_value_t = 100)]
    max_errors: usize,
    /// The node server's pid, for its memory [default: the process
    /// listening on the node URL's loopback port].
    #[arg(long)]
    server_pid: Option<u32>,
    /// Seed of the file contents, sizes and tokens [default: from the clock].
    #[arg(long)]
    seed: Option<u64>,
}

/// The arguments, checked.
#[derive(Debug, Clone, PartialEq)]
struct Bounds {
    template: String,
    sandboxes: usize,
    workers: usize,
    commands: u64,
    files: u64,
    duration: Duration,
    max_file_bytes: usize,
    op_timeout: Duration,
    max_growth_mib: f64,
    max_errors: usize,
}

const MAX_SANDBOXES: usize = 256;
const MAX_WORKERS: usize = 1024;
/// Files are compared in memory; 16 MiB per worker is plenty for a soak.
const MAX_FILE_KIB: u64 = 16 * 1024;
const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

impl SoakArgs {
    fn bounds(&self) -> Result<Bounds> {
        if !(1..=MAX_SANDBOXES).contains(&self.sandboxes) {
            bail!("--sandboxes must be 1 to {MAX_SANDBOXES}");
        }
        let workers = self.workers.unwrap_or(self.sandboxes * 2);
        if !(1..=MAX_WORKERS).contains(&workers) {
            bail!("--workers must be 1 to {MAX_WORKERS}");
        }
        if self.commands == 0 && self.files == 0 {
            bail!("nothing to do: --commands and --files are both 0");
        }
        if self.duration < Duration::from_secs(1) || self.duration > MAX_DURATION {
            bail!("--duration must be 1s to 24h");
        }
        if !(1..=MAX_FILE_KIB).contains(&self.max_file_kib) {
            bail!("--max-file-kib must be 1 to {MAX_FILE_KIB}");
        }
        if self.op_timeout == 0 {
            bail!("--op-timeout must be at least 1 second");
        }
        if self.max_growth_mib.is_nan() || self.max_growth_mib < 0.0 {
            bail!("--max-growth-mib must be 0 or more");
        }
        if self.max_errors == 0 {
            bail!("--max-errors must be at least 1");
        }
        Ok(Bounds {
            template: self.template.clone(),
            sandboxes: self.sandboxes,
            workers,
            commands: self.commands,
            files: self.files,
            duration: self.duration,
            max_file_bytes: (self.max_file_kib * 1024) as usize,
            op_timeout: Duration::from_secs(self.op_timeout),
            max_growth_mib: self.max_growth_mib,
            max_errors: self.max_errors,
        })
    }
}

/// Creates at most this long (a loaded or emulated node queues guest loads).
const CREATE_TIMEOUT: Duration = Duration::from_secs(600);
/// Setup creates under way at once (see `create_all`).
const CREATES_AT_ONCE: usize = 8;
const KILL_TIMEOUT: Duration = Duration::from_secs(60);
/// The sandboxes outlive the load by this much, so none times out mid-run
/// and a soak killed without its clean-up leaves nothing for long.
const SANDBOX_MARGIN: Duration = Duration::from_secs(900);
/// How often the server's memory is sampled during the load.
const SAMPLE_EVERY: Duration = Duration::from_secs(10);
/// The warm pool refills after the creates; the first reading waits until
/// the server's processes have been the same for this long...
const SETTLED_FOR: Duration = Duration::from_secs(5);
/// ...but no longer than this.
const SETTLE_AT_MOST: Duration = Duration::from_secs(120);
/// Where each worker's file goes in the guest (one file per worker,
/// overwritten: the guest's use stays bounded however long the soak runs).
const FILE_DIR: &str = "/tmp/sandfork-soak";
/// What a command prints: `$0` is the token, the rest the sum's terms.
const COMMAND_SCRIPT: &str = r#"echo "$0"; echo $(($1 * $2 + $3))"#;
/// A command's output kept for the check; more than this is wrong anyway.
const MAX_OUTPUT: usize = 64 * 1024;

/// splitmix64: fast, seedable, and enough for test data (not for secrets).
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform enough below `n` (> 0) for sizes and terms.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn bytes(&mut self, len: usize) -> Bytes {
        let mut data = Vec::with_capacity(len + 8);
        while data.len() < len {
            data.extend_from_slice(&self.next().to_le_bytes());
        }
        data.truncate(len);
        Bytes::from(data)
    }

    /// A size from 1 to `max`, spread over the powers of two (as many tiny
    /// files as large ones), `max` itself now and then.
    fn file_size(&mut self, max: usize) -> usize {
        let max = max.max(1) as u64;
        let bits = 64 - u64::from(max.leading_zeros());
        let cap = (1u64 << self.below(bits + 1)).min(max);
        (1 + self.below(cap)) as usize
    }
}

/// Whether operation `n` (of `commands + files`) is a file round trip: the
/// files spread evenly among the commands, so whatever bound ends the load
/// first, both kinds have run in proportion.
fn is_file_op(n: u64, commands: u64, files: u64) -> bool {
    let total = u128::from(commands + files);
    let (n, files) = (u128::from(n), u128::from(files));
    (n + 1) * files / total > n * files / total
}

/// A command and the stdout it must print.
fn command(token: &str, a: u64, b: u64, c: u64) -> (StartRequest, String) {
    let process = ProcessConfig {
        cmd: "/bin/sh".into(),
        args: vec![
            "-c".into(),
            COMMAND_SCRIPT.into(),
            token.into(),
            a.to_string(),
            b.to_string(),
            c.to_string(),
        ],
        ..ProcessConfig::default()
    };
    let request = StartRequest {
        process,
        stdin: Some(false),
        ..StartRequest::default()
    };
    (request, format!("{token}\n{}\n", a * b + c))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Setup,
    WarmUp,
    Load,
    CleanUp,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Setup => "setup",
            Phase::WarmUp => "warm_up",
            Phase::Load => "load",
            Phase::CleanUp => "clean_up",
        }
    }
}

/// One failed operation.
#[derive(Debug, Clone)]
struct Failure {
    op: &'static str,
    phase: Phase,
    sandbox: String,
    /// Seconds since the soak started.
    at_s: f64,
    error: String,
}

impl Failure {
    fn to_json(&self) -> Value {
        json!({
            "op": self.op,
            "phase": self.phase.name(),
            "sandbox": self.sandbox,
            "at_s": (self.at_s * 10.0).round() / 10.0,
            "error": self.error,
        })
    }
}

/// How the load ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// Every operation asked for ran.
    Counts,
    Duration,
    /// --max-errors reached.
    Errors,
    /// A sandbox could not be created or opened: no load ran.
    Setup,
    Interrupted,
}

impl Ended {
    fn name(self) -> &'static str {
        match self {
            Ended::Counts => "counts",
            Ended::Duration => "duration",
            Ended::Errors => "errors",
            Ended::Setup => "setup_failed",
            Ended::Interrupted => "interrupted",
        }
    }
}

/// What the soak has seen so far; read for the report whatever ended it.
/// The runtime is single-threaded and no borrow is held across an await.
#[derive(Default)]
struct Record {
    failures: RefCell<Vec<Failure>>,
    commands: Cell<u64>,
    files: Cell<u64>,
    bytes: Cell<u64>,
    command_ms: RefCell<Vec<f64>>,
    write_ms: RefCell<Vec<f64>>,
    read_ms: RefCell<Vec<f64>>,
    /// Ids of the sandboxes created, for the clean-up.
    created: RefCell<Vec<String>>,
    setup_s: Cell<f64>,
    load_started: Cell<Option<Instant>>,
    load_s: Cell<f64>,
    memory_before: Cell<Option<NodeMemory>>,
    memory_after: Cell<Option<NodeMemory>>,
    /// (seconds into the load, server RSS MiB)
    rss_samples: RefCell<Vec<(f64, f64)>>,
}

struct Soak<'a> {
    node: &'a Node,
    bounds: &'a Bounds,
    server: Option<u32>,
    started: Instant,
    record: Record,
    /// The next load operation's number.
    next_op: Cell<u64>,
    stop: Cell<bool>,
    seed: u64,
}

impl Soak<'_> {
    fn fail(&self, op: &'static str, phase: Phase, sandbox: &str, error: impl std::fmt::Display) {
        let failure = Failure {
            op,
            phase,
            sandbox: sandbox.to_owned(),
            at_s: self.started.elapsed().as_secs_f64(),
            error: error.to_string(),
        };
        let mut failures = self.record.failures.borrow_mut();
        if failures.len() < 5 {
            eprintln!(
                "soak: {} {} failed on {}: {}",
                phase.name(),
                op,
                sandbox,
                failure.error
            );
        }
        failures.push(failure);
        if phase == Phase::Load && failures.len() >= self.bounds.max_errors {
            self.stop.set(true);
        }
    }

    /// `f` within the operation timeout.
    async fn bounded<T>(&self, f: impl Future<Output = Result<T, NodeError>>) -> Result<T, String> {
        match tokio::time::timeout(self.bounds.op_timeout, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "no answer within {} s",
                self.bounds.op_timeout.as_secs()
            )),
        }
    }

    /// Creates and opens the sandboxes, [`CREATES_AT_ONCE`] at a time: a
    /// create holds disk room for its memory snapshot until its guest runs,
    /// so 32 at once ask a node for 32 snapshots' room at once (in the
    /// lab's `/tmp`, more than it has); the soak is about steady load.
    async fn create_all(&self) -> Option<Vec<Sandbox>> {
        let lifetime = self.bounds.duration + SANDBOX_MARGIN;
        let body = crate::sandboxes::create_body(
            Some(&self.bounds.template),
            lifetime.as_secs(),
            &[("sandfork-soak".into(), self.seed.to_string())],
            &[],
            false,
        );
        let creates = (0..self.bounds.sandboxes).map(|_| async {
            let created = tokio::time::timeout(
                CREATE_TIMEOUT,
                crate::sandboxes::create_sandbox(self.node, &body),
            )
            .await;
            let answer = match created {
                Ok(Ok(answer)) => answer,
                Ok(Err(e)) => return Err(("create", String::new(), format!("{e:#}"))),
                Err(_) => {
                    let why = format!("no answer within {} s", CREATE_TIMEOUT.as_secs());
                    return Err(("create", String::new(), why));
                }
            };
            let id = answer["sandboxID"].as_str().unwrap_or_default().to_owned();
            if check_id(&id).is_err() {
                return Err((
                    "create",
                    id,
                    format!("the node answered no usable sandboxID: {answer}"),
                ));
            }
            self.record.created.borrow_mut().push(id.clone());
            self.bounded(Sandbox::open(self.node, &id, None))
                .await
                .map_err(|e| ("open", id, e))
        });
        let mut sandboxes = Vec::new();
        let created: Vec<_> = futures_util::stream::iter(creates)
            .buffered(CREATES_AT_ONCE)
            .collect()
            .await;
        for result in created {
            match result {
                Ok(sandbox) => sandboxes.push(sandbox),
                Err((op, id, error)) => self.fail(op, Phase::Setup, &id, error),
            }
        }
        (sandboxes.len() == self.bounds.sandboxes).then_some(sandboxes)
    }

    async fn command_op(&self, sandbox: &Sandbox, n: u64, rng: &mut Rng, phase: Phase) {
        let token = format!("soak-{n}-{:016x}", rng.next());
        let (a, b, c) = (rng.below(1 << 20), rng.below(1 << 20), rng.below(1 << 20));
        let (request, expected) = command(&token, a, b, c);
        let start = Instant::now();
        let result = self.bounded(run_to_end(sandbox, &request)).await;
        let took = ms(start.elapsed());
        if phase == Phase::Load {
            self.record.commands.set(self.record.commands.get() + 1);
        }
        let checked = result.and_then(|(out, end)| {
            if !end.exited || end.exit_code != 0 {
                return Err(format!(
                    "it ended with {} (exit code {}), stderr {:?}",
                    end.status, end.exit_code, out.stderr
                ));
            }
            if out.stdout != expected {
                return Err(format!(
                    "stdout {:?}, expected {expected:?} (stderr {:?})",
                    out.stdout, out.stderr
                ));
            }
            Ok(())
        });
        match checked {
            Ok(()) if phase == Phase::Load => self.record.command_ms.borrow_mut().push(took),
            Ok(()) => {}
            Err(e) => self.fail("command", phase, &sandbox.id, e),
        }
    }

    /// A file of `size` (random by default) written to the guest and read
    /// back through the proxy, compared byte for byte.
    async fn file_op(
        &self,
        sandbox: &Sandbox,
        worker: usize,
        rng: &mut Rng,
        size: usize,
        phase: Phase,
    ) {
        let data = rng.bytes(size);
        let path = format!("{FILE_DIR}/w{worker}.bin");
        if phase == Phase::Load {
            self.record.files.set(self.record.files.get() + 1);
        }
        let start = Instant::now();
        let len = Some(data.len() as u64);
        let written = self
            .bounded(sandbox.upload(&path, http::full(data.clone()), len))
            .await;
        let write_took = ms(start.elapsed());
        if let Err(e) = written {
            return self.fail("file_write", phase, &sandbox.id, format!("{path}: {e}"));
        }
        let start = Instant::now();
        let read = self
            .bounded(async {
                let response = sandbox.download(&path).await?;
                http::read_body(self.node.url(), response).await
            })
            .await;
        let read_took = ms(start.elapsed());
        let back = match read {
            Ok(back) => back,
            Err(e) => return self.fail("file_read", phase, &sandbox.id, format!("{path}: {e}")),
        };
        if let Some(difference) = report::difference(&data, &back) {
            return self.fail(
                "file_compare",
                phase,
                &sandbox.id,
                format!("{path}: {difference}"),
            );
        }
        if phase == Phase::Load {
            let moved = 2 * data.len() as u64;
            self.record.bytes.set(self.record.bytes.get() + moved);
            self.record.write_ms.borrow_mut().push(write_took);
            self.record.read_ms.borrow_mut().push(read_took);
        }
    }

    /// Every sandbox answers a command, then every worker moves a largest
    /// file at once: the node has served the load's peak before the first
    /// memory reading.
    async fn warm_up(&self, sandboxes: &[Sandbox]) {
        let mut rng = Rng(self.seed ^ 0x5741_524d);
        let rngs: Vec<Rng> = (0..sandboxes.len().max(self.bounds.workers))
            .map(|_| Rng(rng.next()))
            .collect();
        let commands = sandboxes
            .iter()
            .zip(rngs.clone())
            .map(|(sandbox, mut rng)| async move {
                self.command_op(sandbox, 0, &mut rng, Phase::WarmUp).await
            });
        futures_util::future::join_all(commands).await;
        let files = (0..self.bounds.workers)
            .zip(rngs)
            .map(|(w, mut rng)| async move {
                let sandbox = &sandboxes[w % sandboxes.len()];
                let size = self.bounds.max_file_bytes;
                self.file_op(sandbox, w, &mut rng, size, Phase::WarmUp)
                    .await
            });
        futures_util::future::join_all(files).await;
    }

    async fn worker(&self, sandboxes: &[Sandbox], worker: usize, mut rng: Rng, deadline: Instant) {
        let (commands, files) = (self.bounds.commands, self.bounds.files);
        loop {
            if self.stop.get() || Instant::now() >= deadline {
                return;
            }
            let n = self.next_op.get();
            if n >= commands + files {
                return;
            }
            self.next_op.set(n + 1);
            let sandbox = &sandboxes[(n % sandboxes.len() as u64) as usize];
            if is_file_op(n, commands, files) {
                let size = rng.file_size(self.bounds.max_file_bytes);
                self.file_op(sandbox, worker, &mut rng, size, Phase::Load)
                    .await;
            } else {
                self.command_op(sandbox, n, &mut rng, Phase::Load).await;
            }
        }
    }

    fn read_memory(&self) -> Option<NodeMemory> {
        let pid = self.server?;
        match NodeMemory::read(pid) {
            Ok(m) => Some(m),
            Err(e) => {
                self.fail(
                    "memory",
                    Phase::Load,
                    "",
                    format!("reading process {pid}: {e}"),
                );
                None
            }
        }
    }

    /// Until the server's processes have been the same for a while (the
    /// warm pool refilled after the creates), within a bound.
    async fn settle(&self) {
        let Some(pid) = self.server else { return };
        let until = Instant::now() + SETTLE_AT_MOST;
        let mut last = memory::descendant_count(pid);
        let mut same_since = Instant::now();
        while Instant::now() < until && same_since.elapsed() < SETTLED_FOR {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let now = memory::descendant_count(pid);
            if now != last {
                (last, same_since) = (now, Instant::now());
            }
        }
    }

    async fn sample_memory(&self, load_start: Instant) {
        loop {
            tokio::time::sleep(SAMPLE_EVERY).await;
            if let Some(m) = self.server.and_then(|pid| NodeMemory::read(pid).ok()) {
                let at = load_start.elapsed().as_secs_f64();
                let rss = m.server_rss_kib as f64 / 1024.0;
                self.record.rss_samples.borrow_mut().push((at, rss));
            }
        }
    }

    /// Set-up, warm-up, the load and the readings around it.
    async fn drive(&self) -> Ended {
        let Some(sandboxes) = self.create_all().await else {
            return Ended::Setup;
        };
        eprintln!(
            "soak: {} sandboxes up in {:.1} s; warming up",
            sandboxes.len(),
            self.started.elapsed().as_secs_f64()
        );
        self.warm_up(&sandboxes).await;
        self.settle().await;
        self.record.memory_before.set(self.read_memory());
        self.record
            .setup_s
            .set(self.started.elapsed().as_secs_f64());
        eprintln!(
            "soak: load: {} commands and {} files from {} workers, at most {}",
            self.bounds.commands,
            self.bounds.files,
            self.bounds.workers,
            humantime::format_duration(self.bounds.duration)
        );
        let load_start = Instant::now();
        self.record.load_started.set(Some(load_start));
        let deadline = load_start + self.bounds.duration;
        let mut seeds = Rng(self.seed);
        let workers = (0..self.bounds.workers).map(|w| {
            let rng = Rng(seeds.next());
            self.worker(&sandboxes, w, rng, deadline)
        });
        tokio::select! {
            _ = futures_util::future::join_all(workers) => {}
            () = self.sample_memory(load_start) => {}
        }
        self.record.load_s.set(load_start.elapsed().as_secs_f64());
        self.record.memory_after.set(self.read_memory());
        if self.stop.get() {
            Ended::Errors
        } else if self.next_op.get() >= self.bounds.commands + self.bounds.files {
            Ended::Counts
        } else {
            Ended::Duration
        }
    }

    /// Kills every sandbox created, whatever happened before.
    async fn clean_up(&self) {
        let ids = self.record.created.borrow().clone();
        let kills = ids.iter().map(|id| async move {
            let path = format!("/sandboxes/{id}");
            let killed = tokio::time::timeout(
                KILL_TIMEOUT,
                self.node.sandbox_call(id, "DELETE", &path, None),
            )
            .await;
            match killed {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => self.fail("kill", Phase::CleanUp, id, e),
                Err(_) => self.fail("kill", Phase::CleanUp, id, "no answer within 60 s"),
            }
        });
        futures_util::future::join_all(kills).await;
    }
}

/// A command's output, each stream cut at [`MAX_OUTPUT`].
#[derive(Debug, Default)]
struct Output {
    stdout: String,
    stderr: String,
}

/// Runs a process to the end of its stream: its output and end event.
async fn run_to_end(
    sandbox: &Sandbox,
    request: &StartRequest,
) -> Result<(Output, EndEvent), NodeError> {
    let mut stream = sandbox.start(request).await?;
    let mut out = Output::default();
    let mut end = None;
    let keep = |to: &mut String, data: &[u8]| {
        let room = MAX_OUTPUT.saturating_sub(to.len());
        to.push_str(&String::from_utf8_lossy(&data[..data.len().min(room)]));
    };
    while let Some(event) = stream.next().await? {
        match event {
            ProcessEvent::Data(DataEvent::Stdout(b) | DataEvent::Pty(b)) => {
                keep(&mut out.stdout, &b.0)
            }
            ProcessEvent::Data(DataEvent::Stderr(b)) => keep(&mut out.stderr, &b.0),
            ProcessEvent::End(e) => end = Some(e),
            ProcessEvent::Start(_) | ProcessEvent::Keepalive(_) => {}
        }
    }
    let end = end.ok_or_else(|| NodeError::Malformed {
        what: "the process stream".into(),
        reason: "it ended without the process's end event".into(),
    })?;
    Ok((out, end))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Ctrl-C or SIGTERM.
async fn interrupted() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

pub async fn run(args: SoakArgs) -> Result<ExitCode> {
    let bounds = args.bounds()?;
    let node = Node::from_config()?;
    // Unreachable nodes and refused keys end here, before anything is made.
    let node_info: Value = node.json("GET", "/v1/node", None).await?;
    let located = match args.server_pid {
        Some(pid) if std::path::Path::new(&format!("/proc/{pid}")).exists() => Located::Here(pid),
        Some(pid) => bail!("--server-pid {pid}: no such process here"),
        None => memory::locate(node.endpoint.host(), node.endpoint.port()),
    };
    match &located {
        Located::Here(pid) => eprintln!("soak: the node's server is process {pid} here"),
        Located::NotHere(why) => eprintln!("soak: the node's memory is not read: {why}"),
    }
    let seed = args.seed.unwrap_or_else(|| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        now.as_nanos() as u64 ^ u64::from(std::process::id()) << 32
    });
    let soak = Soak {
        node: &node,
        bounds: &bounds,
        server: match located {
            Located::Here(pid) => Some(pid),
            Located::NotHere(_) => None,
        },
        started: Instant::now(),
        record: Record::default(),
        next_op: Cell::new(0),
        stop: Cell::new(false),
        seed,
    };
    eprintln!(
        "soak: creating {} sandboxes from {:?} on {}",
        bounds.sandboxes,
        bounds.template,
        node.url()
    );
    let ended = tokio::select! {
        ended = soak.drive() => ended,
        () = interrupted() => {
            eprintln!("soak: interrupted; killing the sandboxes");
            Ended::Interrupted
        }
    };
    if ended == Ended::Interrupted
        && let Some(start) = soak.record.load_started.get()
    {
        soak.record.load_s.set(start.elapsed().as_secs_f64());
    }
    soak.clean_up().await;
    let not_read = match &located {
        Located::NotHere(why) => Some(why.as_str()),
        Located::Here(_) => None,
    };
    let report = report::report(&soak, ended, not_read, &node_info);
    eprint!("{}", report::summary(&report));
    println!("{}", serde_json::to_string(&report)?);
    Ok(if report["passed"] == true {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        soak: SoakArgs,
    }

    fn bounds(args: &[&str]) -> Result<Bounds> {
        let cli = Cli::try_parse_from(std::iter::once("soak").chain(args.iter().copied()))?;
        cli.soak.bounds()
    }

    #[test]
    fn arguments_are_bounded() {
        let b = bounds(&[]).unwrap();
        assert_eq!((b.sandboxes, b.workers), (16, 32));
        assert_eq!((b.commands, b.files), (2000, 500));
        assert_eq!(b.duration, Duration::from_secs(600));
        assert_eq!(b.max_file_bytes, 1 << 20);
        let b = bounds(&["-s", "4", "-c", "3", "--duration", "90s"]).unwrap();
        assert_eq!((b.sandboxes, b.workers, b.duration.as_secs()), (4, 3, 90));
        assert!(bounds(&["--files", "0"]).is_ok());
        for bad in [
            &["--sandboxes", "0"][..],
            &["--sandboxes", "257"],
            &["--workers", "0"],
            &["--commands", "0", "--files", "0"],
            &["--duration", "0s"],
            &["--duration", "25h"],
            &["--max-file-kib", "0"],
            &["--max-file-kib", "16385"],
            &["--op-timeout", "0"],
            &["--max-growth-mib", "-1"],
            &["--max-growth-mib", "NaN"],
            &["--max-errors", "0"],
        ] {
            assert!(bounds(bad).is_err(), "{bad:?} accepted");
        }
        assert!(bounds(&["--duration", "ten"]).is_err());
    }

    #[test]
    fn files_spread_evenly_among_commands() {
        for (commands, files) in [(300, 100), (2000, 500), (0, 7), (7, 0), (1, 1), (10, 3)] {
            let ops: Vec<bool> = (0..commands + files)
                .map(|n| is_file_op(n, commands, files))
                .collect();
            assert_eq!(ops.iter().filter(|f| **f).count() as u64, files);
            // Any prefix holds its share of files, give or take one.
            for cut in 1..ops.len() {
                let got = ops[..cut].iter().filter(|f| **f).count() as f64;
                let share = cut as f64 * files as f64 / (commands + files) as f64;
                assert!((got - share).abs() <= 1.0, "{commands}/{files} at {cut}");
            }
        }
    }

    #[test]
    fn a_command_prints_its_token_and_sum() {
        let (request, expected) = command("soak-1-ab", 3, 4, 5);
        assert_eq!(expected, "soak-1-ab\n17\n");
        assert_eq!(request.process.cmd, "/bin/sh");
        assert_eq!(request.process.args[2..], ["soak-1-ab", "3", "4", "5"]);
        assert_eq!(request.stdin, Some(false));
    }

    #[test]
    fn file_sizes_stay_within_bounds_and_vary() {
        let mut rng = Rng(7);
        let sizes: Vec<usize> = (0..2000).map(|_| rng.file_size(1 << 20)).collect();
        assert!(sizes.iter().all(|s| (1..=1 << 20).contains(s)));
        assert!(sizes.iter().any(|s| *s < 1024));
        assert!(sizes.iter().any(|s| *s > 512 << 10));
        assert_eq!(Rng(1).file_size(1), 1);
        assert_eq!(rng.bytes(13).len(), 13);
        assert_ne!(Rng(1).bytes(64), Rng(2).bytes(64));
    }
}

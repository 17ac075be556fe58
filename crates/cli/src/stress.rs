//! `sandfork stress`: many boots, restores, forks and two-VM runs, each
//! bounded, counting the ones that failed and the ones that hung (did not
//! answer within the bound). Every bad trial prints the diagnostics of the
//! VMs it had (console, VMM log, vCPU states, threads, kernel messages), so
//! a rare hang can be found and told apart from a slow run.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use vmm_api::SnapshotType;
use vmm_driver::process::{ProcessError, VmmProcess, diagnostics};
use vmm_driver::{ClientError, VmmClient};

use crate::bench::median;
use crate::launcher::{self, GuestImage};

/// How many trials of each kind, and how long each may take.
#[derive(clap::Args)]
pub struct StressArgs {
    #[arg(long, default_value_t = 10)]
    pub boots: usize,
    #[arg(long, default_value_t = 10)]
    pub restores: usize,
    /// Forks of a restored VM, each into --fork-children children.
    #[arg(long, default_value_t = 10)]
    pub forks: usize,
    #[arg(long, default_value_t = 4)]
    pub fork_children: usize,
    /// Runs of two two-vCPU VMs booted at once.
    #[arg(long, default_value_t = 10)]
    pub two_vm: usize,
    /// Seconds any one wait (agent, exit) may take before it counts as a hang.
    #[arg(long, default_value_t = 120)]
    pub bound: u64,
    /// Threads that keep the host's CPUs busy meanwhile (outside the lab).
    #[arg(long, default_value_t = 0)]
    pub host_load: usize,
    /// Trace the KVM events of the kernel that runs the VMs (in the lab, the
    /// lab machine's) into a ring buffer of this many KiB per CPU, so that a
    /// hang's diagnostics show its vCPUs' last exits. Needs root.
    #[arg(long, value_name = "KIB")]
    pub kvm_trace: Option<u32>,
}

impl StressArgs {
    pub fn bound(&self) -> Duration {
        Duration::from_secs(self.bound.max(1))
    }

    /// Room for every trial to use its whole bound twice, and the snapshot.
    pub fn longest_run(&self) -> Duration {
        let trials = self.boots + self.restores + self.forks + self.two_vm + 1;
        self.bound() * 2 * trials as u32
    }
}

/// One stress run: what to boot, and the trials.
pub struct Plan<'a> {
    pub vmm: &'a Path,
    pub image: &'a GuestImage,
    pub args: &'a StressArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Boot,
    Restore,
    Fork,
    TwoVm,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Boot => "boot",
            Kind::Restore => "restore",
            Kind::Fork => "fork",
            Kind::TwoVm => "two_vm",
        }
    }
}

enum Outcome {
    Ok,
    Failed(String),
    Hung(String),
}

/// The VMs a trial has started, so that a trial cut off by its bound can
/// still be diagnosed before it is dropped (which kills them).
#[derive(Default)]
struct Witness(Mutex<Vec<(PathBuf, u32, VmmClient)>>);

impl Witness {
    fn watch(&self, vm: &VmmProcess) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push((
            vm.dir().to_owned(),
            vm.pid(),
            vm.api().clone(),
        ));
    }

    async fn diagnose(&self) -> String {
        let vms = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut out = String::new();
        for (dir, pid, api) in vms {
            let report = diagnostics::diagnose(&dir, pid, &api).await;
            let _ = writeln!(out, "=== VMM {pid} ({}) ===\n{report}", dir.display());
        }
        out
    }
}

/// Whether an error is something that did not answer in time (a hang), as
/// opposed to one that answered wrongly.
fn is_hang(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<ProcessError>(),
            Some(ProcessError::Timeout { .. })
        ) || matches!(
            cause.downcast_ref::<ClientError>(),
            Some(ClientError::NoAnswer { .. } | ClientError::Timeout { .. })
        ) || matches!(
            cause.downcast_ref::<vmm_driver::agent_client::AgentError>(),
            Some(vmm_driver::agent_client::AgentError::Timeout(_))
        )
    })
}

async fn ready(vm: &mut VmmProcess, bound: Duration) -> Result<()> {
    launcher::ready_after_restore(vm, bound).await
}

/// Runs `echo <word>` in the guest and checks the answer.
async fn answers(vm: &VmmProcess, word: &str) -> Result<()> {
    let out = vm.agent().run(&format!("echo {word}; nproc")).await?;
    let first = out.stdout.lines().next().unwrap_or_default();
    if out.exit_code != 0 || first != word {
        bail!("the guest answered {out:?} to `echo {word}`");
    }
    Ok(())
}

/// Ctrl+Alt+Del and a clean exit within `bound`.
async fn shut_down(vm: &mut VmmProcess, bound: Duration) -> Result<()> {
    vm.api().send_ctrl_alt_del().await?;
    let status = vm.wait_exit(bound).await?;
    if !status.success() {
        bail!("the VMM ended with {status}\n{}", vm.logs());
    }
    Ok(())
}

impl Plan<'_> {
    async fn boot(&self, witness: &Witness) -> Result<()> {
        let mut vm = launcher::launch(self.vmm, self.image).await?;
        witness.watch(&vm);
        vm.wait_for_agent(self.args.bound()).await?;
        answers(&vm, "booted").await?;
        shut_down(&mut vm, self.args.bound()).await
    }

    async fn restore(&self, snapshot: &Snapshot, witness: &Witness) -> Result<()> {
        let mut vm = VmmProcess::spawn(self.vmm).await?;
        witness.watch(&vm);
        vm.load_snapshot(&snapshot.state, &snapshot.mem, true)
            .await?;
        ready(&mut vm, self.args.bound()).await?;
        answers(&vm, "restored").await
    }

    async fn fork(&self, snapshot: &Snapshot, witness: &Witness) -> Result<()> {
        let mut parent = VmmProcess::spawn(self.vmm).await?;
        witness.watch(&parent);
        parent
            .load_snapshot(&snapshot.state, &snapshot.mem, true)
            .await?;
        ready(&mut parent, self.args.bound()).await?;
        let mut children = Vec::with_capacity(self.args.fork_children);
        for _ in 0..self.args.fork_children {
            let child = VmmProcess::spawn(self.vmm).await?;
            witness.watch(&child);
            children.push(child);
        }
        let dir = tempfile::tempdir()?;
        let info = parent
            .fork(dir.path(), self.args.fork_children as u32)
            .await?;
        let loads = children.iter_mut().enumerate().map(|(i, child)| {
            let info = &info;
            async move {
                child.load_fork_child(info, i).await?;
                ready(child, self.args.bound()).await?;
                answers(child, &format!("child{i}")).await
            }
        });
        for result in futures_util::future::join_all(loads).await {
            result?;
        }
        answers(&parent, "parent").await
    }

    async fn two_vm(&self, witness: &Witness) -> Result<()> {
        let image = GuestImage {
            vcpus: 2,
            ..self.image.clone()
        };
        let mut a = launcher::launch(self.vmm, &image).await?;
        witness.watch(&a);
        let mut b = launcher::launch(self.vmm, &image).await?;
        witness.watch(&b);
        let (ra, rb) = tokio::join!(
            a.wait_for_agent(self.args.bound()),
            b.wait_for_agent(self.args.bound())
        );
        ra?;
        rb?;
        for vm in [&a, &b] {
            let out = vm.agent().run("nproc").await?;
            if out.stdout.trim() != "2" {
                bail!("a two-vCPU guest counts {:?} CPUs", out.stdout.trim());
            }
        }
        let (sa, sb) = tokio::join!(
            shut_down(&mut a, self.args.bound()),
            shut_down(&mut b, self.args.bound())
        );
        sa.and(sb)
    }

    /// One trial, bounded: a trial still running after twice the bound (its
    /// own waits have the bound each) is a hang, diagnosed before it is
    /// dropped.
    async fn trial(&self, kind: Kind, snapshot: &Snapshot) -> (Outcome, Duration) {
        let witness = Witness::default();
        let start = Instant::now();
        let work = async {
            match kind {
                Kind::Boot => self.boot(&witness).await,
                Kind::Restore => self.restore(snapshot, &witness).await,
                Kind::Fork => self.fork(snapshot, &witness).await,
                Kind::TwoVm => self.two_vm(&witness).await,
            }
        };
        // Polled through a pinned reference, so that a trial cut off still
        // holds its VMs (dropping it kills them) while they are diagnosed;
        // it is dropped when this function returns.
        let mut work = std::pin::pin!(work);
        let result = tokio::time::timeout(self.args.bound() * 2, &mut work).await;
        let took = start.elapsed();
        let outcome = match result {
            Ok(Ok(())) => Outcome::Ok,
            Ok(Err(e)) => {
                let text = format!("{e:#}");
                // A timed-out wait already carries the diagnostics.
                let text = if text.contains("--- end of diagnostics ---") {
                    text
                } else {
                    format!("{text}\n{}", witness.diagnose().await)
                };
                if is_hang(&e) {
                    Outcome::Hung(text)
                } else {
                    Outcome::Failed(text)
                }
            }
            Err(_) => Outcome::Hung(format!(
                "no result within {:?}\n{}",
                self.args.bound() * 2,
                witness.diagnose().await
            )),
        };
        (outcome, took)
    }

    pub async fn run(&self) -> Result<Value> {
        if self.args.fork_children == 0 {
            bail!("--fork-children must be at least 1");
        }
        let dir = tempfile::tempdir()?;
        let snapshot = Snapshot::make(self, dir.path())
            .await
            .context("making the snapshot the restores and forks start from")?;
        let mut tally: Vec<(Kind, Tally)> = [Kind::Boot, Kind::Restore, Kind::Fork, Kind::TwoVm]
            .into_iter()
            .map(|k| (k, Tally::default()))
            .collect();
        let a = self.args;
        let rounds = a.boots.max(a.restores).max(a.forks).max(a.two_vm);
        // Kinds interleaved round by round, so trouble that comes and goes
        // with time spreads over all of them.
        for round in 0..rounds {
            for (kind, counts) in &mut tally {
                let wanted = match kind {
                    Kind::Boot => a.boots,
                    Kind::Restore => a.restores,
                    Kind::Fork => a.forks,
                    Kind::TwoVm => a.two_vm,
                };
                if round >= wanted {
                    continue;
                }
                let (outcome, took) = self.trial(*kind, &snapshot).await;
                let name = kind.name();
                let ms = took.as_secs_f64() * 1000.0;
                match &outcome {
                    Outcome::Ok => {
                        eprintln!("stress: {name} {}/{wanted}: ok, {ms:.0} ms", round + 1)
                    }
                    Outcome::Failed(e) | Outcome::Hung(e) => {
                        let what = if matches!(outcome, Outcome::Hung(_)) {
                            "HUNG"
                        } else {
                            "FAILED"
                        };
                        eprintln!(
                            "stress: {name} {}/{wanted}: {what} after {ms:.0} ms: {e}",
                            round + 1
                        );
                    }
                }
                counts.add(outcome, ms);
            }
        }
        let mut report = json!({
            "bound_s": self.args.bound().as_secs(),
            "host_load_threads": self.args.host_load,
        });
        let (mut runs, mut bad) = (0, 0);
        for (kind, counts) in tally {
            runs += counts.runs();
            bad += counts.failed + counts.hung;
            report[kind.name()] = counts.json();
        }
        report["runs"] = json!(runs);
        report["bad"] = json!(bad);
        report["bad_rate"] = json!(if runs > 0 {
            bad as f64 / runs as f64
        } else {
            0.0
        });
        Ok(report)
    }
}

/// A full snapshot of a booted, idle guest.
struct Snapshot {
    state: PathBuf,
    mem: PathBuf,
}

impl Snapshot {
    async fn make(plan: &Plan<'_>, dir: &Path) -> Result<Snapshot> {
        let (vm, _) = launcher::boot_to_agent(plan.vmm, plan.image, plan.args.bound()).await?;
        // Let the guest settle, as a template is snapshotted idle.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let snapshot = Snapshot {
            state: dir.join("stress.state"),
            mem: dir.join("stress.mem"),
        };
        vm.snapshot(SnapshotType::Full, &snapshot.state, &snapshot.mem)
            .await?;
        drop(vm);
        Ok(snapshot)
    }
}

#[derive(Default)]
struct Tally {
    ok: usize,
    failed: usize,
    hung: usize,
    ms: Vec<f64>,
    /// The first line of each bad trial's error.
    errors: Vec<String>,
}

impl Tally {
    fn runs(&self) -> usize {
        self.ok + self.failed + self.hung
    }

    fn add(&mut self, outcome: Outcome, ms: f64) {
        match outcome {
            Outcome::Ok => {
                self.ok += 1;
                self.ms.push(ms);
            }
            Outcome::Failed(e) => {
                self.failed += 1;
                self.errors.push(first_line(&e));
            }
            Outcome::Hung(e) => {
                self.hung += 1;
                self.errors.push(first_line(&e));
            }
        }
    }

    fn json(&self) -> Value {
        let mut ms = self.ms.clone();
        let max = ms
            .iter()
            .copied()
            .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
        json!({
            "runs": self.runs(),
            "ok": self.ok,
            "failed": self.failed,
            "hung": self.hung,
            "ok_ms_p50": (!ms.is_empty()).then(|| median(&mut ms)),
            "ok_ms_max": max,
            "errors": self.errors,
        })
    }
}

fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or_default().to_owned()
}

/// What the kernel log says about machine-wide stalls: the lab's nested-KVM
/// livelock (README, "Hangs") shows there as a soft lockup of a vCPU thread,
/// a clocksource readout that took minutes, an RCU stall or init's "stood
/// still" line, also when it was too short for any trial to overrun.
const STALL_SIGNS: [(&str, &str); 4] = [
    ("soft_lockup", "soft lockup"),
    ("long_readout", "Long readout interval"),
    ("rcu_stall", "detected stall"),
    ("stood_still", "stood still"),
];

/// The stall reports in `log`, counted by kind, with their lines.
pub fn stalls_in(log: &str) -> Value {
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| STALL_SIGNS.iter().any(|(_, sign)| l.contains(sign)))
        .collect();
    let mut report = json!({ "lines": lines });
    for (kind, sign) in STALL_SIGNS {
        report[kind] = json!(lines.iter().filter(|l| l.contains(sign)).count());
    }
    report
}

/// Kernel messages read for [`lab_stalls`]: more than a lab run's machine
/// logs (its ring buffer holds a few thousand).
const KERNEL_LOG_LINES: usize = 20_000;

/// The stall reports of this machine's kernel since it booted: in the lab
/// that is one run's own machine, so they belong to this run.
pub fn lab_stalls() -> Value {
    stalls_in(&diagnostics::kernel_messages(KERNEL_LOG_LINES))
}

/// `threads` threads that spin until the process ends: a host kept busy,
/// as CI machines are while other jobs build.
pub fn load_host(threads: usize) {
    for _ in 0..threads {
        std::thread::spawn(|| {
            let mut x: u64 = 1;
            loop {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_that_ran_out_are_hangs_wrong_answers_are_failures() {
        let timeout = anyhow::Error::from(ProcessError::Timeout {
            what: "the guest agent's health check",
            waited: Duration::from_secs(1),
            logs: String::new(),
        })
        .context("restoring");
        assert!(is_hang(&timeout));
        let no_answer = anyhow::Error::from(vmm_driver::agent_client::AgentError::Timeout(
            Duration::from_secs(1),
        ));
        assert!(is_hang(&no_answer));
        assert!(!is_hang(&anyhow::anyhow!("the guest answered \"\"")));
    }

    #[test]
    fn stall_reports_are_counted_by_kind() {
        let log = "[  1.0] kvm: Nested Virtualization enabled\n\
                   [576.1] watchdog: BUG: soft lockup - CPU#0 stuck for 107s! [vcpu1:900]\n\
                   [576.2] clocksource: Long readout interval, skipping watchdog check\n\
                   [576.3] sandfork-lab: this machine stood still for about 112 s\n";
        let r = stalls_in(log);
        assert_eq!(
            (
                r["soft_lockup"].as_u64(),
                r["long_readout"].as_u64(),
                r["rcu_stall"].as_u64(),
                r["stood_still"].as_u64()
            ),
            (Some(1), Some(1), Some(0), Some(1))
        );
        assert_eq!(r["lines"].as_array().map(Vec::len), Some(3));
        assert_eq!(stalls_in("")["soft_lockup"], json!(0));
    }

    #[test]
    fn a_tally_counts_each_outcome_and_times_only_good_trials() {
        let mut t = Tally::default();
        t.add(Outcome::Ok, 30.0);
        t.add(Outcome::Ok, 10.0);
        t.add(Outcome::Ok, 20.0);
        t.add(Outcome::Hung("no result within 4s\ndetails".into()), 4000.0);
        t.add(Outcome::Failed("wrong answer".into()), 5.0);
        let j = t.json();
        assert_eq!(
            (
                j["runs"].as_u64(),
                j["ok"].as_u64(),
                j["hung"].as_u64(),
                j["failed"].as_u64()
            ),
            (Some(5), Some(3), Some(1), Some(1))
        );
        assert_eq!(j["ok_ms_p50"].as_f64(), Some(20.0));
        assert_eq!(j["ok_ms_max"].as_f64(), Some(30.0));
        assert_eq!(j["errors"], json!(["no result within 4s", "wrong answer"]));
    }
}

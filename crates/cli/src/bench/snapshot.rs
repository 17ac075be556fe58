//! Snapshot, restore and fork figures: pause, full and diff snapshot, restore
//! to a serving agent, fork of 1 and of 16 to every child serving, and the
//! memory an idle child costs.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{Value, json};
use vmm_api::SnapshotType;
use vmm_driver::process::VmmProcess;

use super::median;
use crate::launcher::{self, GuestImage};

const AGENT_TIMEOUT: Duration = Duration::from_secs(300);
/// A guest left alone this long before measuring is idle.
const SETTLE: Duration = Duration::from_secs(2);

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn timed<T>(f: impl std::future::Future<Output = Result<T>>) -> Result<(T, f64)> {
    let start = Instant::now();
    let value = f.await?;
    Ok((value, ms(start.elapsed())))
}

async fn ready(vm: &mut VmmProcess) -> Result<()> {
    launcher::ready_after_restore(vm, AGENT_TIMEOUT).await
}

/// Private resident memory of a process, in MiB (`/proc/<pid>/smaps_rollup`).
fn private_mib(pid: u32) -> Result<f64> {
    let m = host_mem::ProcessMemory::of(pid)
        .with_context(|| format!("reading the memory of process {pid}"))?;
    Ok(m.private_kib as f64 / 1024.0)
}

/// Pause and snapshots of one booted guest, then `runs` restores of the full
/// snapshot. `diff` is false for VMMs that need dirty tracking set at boot.
async fn pause_snapshot_restore(
    vmm: &Path,
    image: &GuestImage,
    runs: usize,
    dir: &Path,
    diff: bool,
) -> Result<Value> {
    let (vm, _) = launcher::boot_to_agent(vmm, image, AGENT_TIMEOUT).await?;
    tokio::time::sleep(SETTLE).await;
    let state = dir.join("full.state");
    let mem = dir.join("full.mem");
    let ((), pause_ms) = timed(async { Ok(vm.api().pause().await?) }).await?;
    let ((), full_ms) =
        timed(async { Ok(vm.snapshot(SnapshotType::Full, &state, &mem).await?) }).await?;
    let mut report = json!({"pause_ms": pause_ms, "snapshot_full_ms": full_ms});
    if diff {
        vm.api().resume().await?;
        tokio::time::sleep(SETTLE).await;
        vm.api().pause().await?;
        let ((), diff_ms) = timed(async {
            Ok(vm
                .snapshot(
                    SnapshotType::Diff,
                    &dir.join("diff.state"),
                    &dir.join("diff.mem"),
                )
                .await?)
        })
        .await?;
        report["snapshot_diff_ms"] = json!(diff_ms);
    }
    // The source goes away: restores must not depend on it.
    vm.shutdown(Duration::from_secs(5)).await?;

    let mut restore_ms = Vec::with_capacity(runs);
    let mut load_ms = Vec::with_capacity(runs);
    for _ in 0..runs {
        // Pre-spawned, as a warm pool keeps them.
        let mut vm = VmmProcess::spawn(vmm).await?;
        let start = Instant::now();
        vm.load_snapshot(&state, &mem, true).await?;
        load_ms.push(ms(start.elapsed()));
        ready(&mut vm).await?;
        restore_ms.push(ms(start.elapsed()));
        vm.shutdown(Duration::from_secs(5)).await?;
    }
    report["restore_to_agent_ms_samples"] = json!(restore_ms.clone());
    report["restore_to_agent_ms"] = json!(median(&mut restore_ms));
    // The VMM's part alone: the load request until the VM runs.
    report["restore_load_ms"] = json!(median(&mut load_ms));
    Ok(report)
}

/// Forks a booted guest into `n` pre-spawned VMMs; returns the time from the
/// fork request to every child serving, and the children.
async fn fork(
    parent: &VmmProcess,
    vmm: &Path,
    n: usize,
    dir: &Path,
) -> Result<(Vec<VmmProcess>, f64)> {
    let mut pool = Vec::with_capacity(n);
    for _ in 0..n {
        pool.push(VmmProcess::spawn(vmm).await?);
    }
    std::fs::create_dir_all(dir)?;
    let start = Instant::now();
    let info = parent.fork(dir, n as u32).await?;
    let loads = pool.iter_mut().enumerate().map(|(i, child)| {
        let info = &info;
        async move {
            child.load_fork_child(info, i).await?;
            ready(child).await
        }
    });
    for result in futures_util::future::join_all(loads).await {
        result?;
    }
    Ok((pool, ms(start.elapsed())))
}

/// Forks of a sandbox as sandboxes are made: restored from a snapshot, so a
/// fork writes only the pages it changed since.
async fn fork_figures(vmm: &Path, dir: &Path) -> Result<Value> {
    let mut parent = VmmProcess::spawn(vmm).await?;
    parent
        .load_snapshot(&dir.join("full.state"), &dir.join("full.mem"), true)
        .await?;
    ready(&mut parent).await?;
    tokio::time::sleep(SETTLE).await;
    let (one, fork1_ms) = fork(&parent, vmm, 1, &dir.join("fork1")).await?;
    drop(one);
    let (children, fork16_ms) = fork(&parent, vmm, 16, &dir.join("fork16")).await?;
    tokio::time::sleep(SETTLE).await;
    let mut private = Vec::with_capacity(children.len());
    for child in &children {
        private.push(private_mib(child.pid())?);
    }
    let mean = private.iter().sum::<f64>() / private.len() as f64;
    Ok(json!({
        "fork1_ms": fork1_ms,
        "fork16_ms": fork16_ms,
        "child_private_mib": mean,
        "child_private_mib_samples": private,
        "idle_children_per_24gib": (24.0 * 1024.0 / mean).floor(),
    }))
}

/// sandfork's figures (the forks' with `forks`).
pub async fn measure(vmm: &Path, image: &GuestImage, runs: usize, forks: bool) -> Result<Value> {
    let dir = tempfile::tempdir()?;
    let mut report = pause_snapshot_restore(vmm, image, runs, dir.path(), true).await?;
    if !forks {
        return Ok(report);
    }
    let forks = fork_figures(vmm, dir.path()).await?;
    if let (Value::Object(r), Value::Object(f)) = (&mut report, forks) {
        r.extend(f);
    }
    Ok(report)
}

/// A reference Firecracker's figures for what it can do (no fork; no diff
/// without dirty tracking from boot).
pub async fn measure_reference(vmm: &Path, image: &GuestImage, runs: usize) -> Result<Value> {
    let dir = tempfile::tempdir()?;
    pause_snapshot_restore(vmm, image, runs, dir.path(), false).await
}

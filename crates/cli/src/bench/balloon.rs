//! Memory a guest frees, given back: a guest with the node's balloon (free
//! page reporting) fills a tmpfs, removes the file, and its VMM's Pss (what
//! the node's admission charges) is read until most of it is gone.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::launcher::{self, GuestImage};

const AGENT_TIMEOUT: Duration = Duration::from_secs(300);
/// The guest reports free blocks 2 s after they are freed; the lab is slow.
const GIVE_BACK_WITHIN: Duration = Duration::from_secs(60);

fn pss_mib(pid: u32) -> Result<f64> {
    let m = host_mem::ProcessMemory::of(pid)
        .with_context(|| format!("reading the memory of process {pid}"))?;
    Ok(m.pss_kib as f64 / 1024.0)
}

/// `balloon_fill_mib` (200, or half the guest when smaller) filled and
/// freed; `balloon_reclaimed_mib`: how far the VMM's Pss fell from full;
/// `balloon_reclaim_s`: until three quarters of the fill had left it.
pub async fn measure(vmm: &Path, image: &GuestImage) -> Result<Value> {
    let fill = 200.min(image.mem_mib / 2);
    let balloon = server::node::config::node_balloon();
    let mut vm = launcher::launch_with(vmm, image, Some(&balloon)).await?;
    vm.wait_for_agent(AGENT_TIMEOUT).await?;
    let agent = vm.agent();
    let run = |cmd: String| {
        let agent = agent.clone();
        async move {
            let out = agent.run(&cmd).await?;
            if out.exit_code != 0 {
                bail!("{cmd}: exit {}: {}", out.exit_code, out.stderr.trim());
            }
            Ok(())
        }
    };
    run(format!(
        "mkdir -p /run/fill && mount -t tmpfs -o size={}m fill /run/fill",
        fill + 16
    ))
    .await?;
    // What the boot freed is reported first.
    tokio::time::sleep(Duration::from_secs(5)).await;
    run(format!(
        "dd if=/dev/zero of=/run/fill/f bs=1M count={fill} 2>/dev/null"
    ))
    .await?;
    let full = pss_mib(vm.pid())?;
    run("rm /run/fill/f".into()).await?;
    let freed = Instant::now();
    let target = full - fill as f64 * 0.75;
    let mut reached = None;
    let mut now = full;
    while freed.elapsed() < GIVE_BACK_WITHIN {
        tokio::time::sleep(Duration::from_millis(250)).await;
        now = pss_mib(vm.pid())?;
        if reached.is_none() && now <= target {
            reached = Some(freed.elapsed());
            // A little longer for the last reports.
            tokio::time::sleep(Duration::from_secs(3)).await;
            now = pss_mib(vm.pid())?;
            break;
        }
    }
    vm.shutdown(Duration::from_secs(5)).await?;
    Ok(json!({
        "balloon_fill_mib": fill,
        "balloon_full_pss_mib": full,
        "balloon_reclaimed_mib": full - now,
        "balloon_reclaim_s": reached.map(|d| d.as_secs_f64()),
    }))
}

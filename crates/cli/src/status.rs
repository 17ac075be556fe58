//! `sandfork status`: the node's capacity and its sandboxes (`GET /v1/node`).

use std::process::ExitCode;

use anyhow::Result;
use serde_json::Value;

use crate::client::Node;
use crate::output;

#[derive(clap::Args)]
pub struct StatusArgs {
    /// Print JSON (the default when stdout is not a terminal).
    #[arg(long)]
    json: bool,
}

pub async fn run(args: StatusArgs) -> Result<ExitCode> {
    let node = Node::from_config()?;
    let mut info: Value = node.json("GET", "/v1/node", None).await?;
    if output::wants_json(args.json) {
        info["url"] = Value::from(node.url());
        output::print_json(&info)?;
        return Ok(ExitCode::SUCCESS);
    }
    let n = |path: &[&str]| {
        path.iter()
            .try_fold(&info, |v, k| v.get(*k))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    println!(
        "node       {} (sandfork {}, envd {})",
        node.url(),
        output::field(&info, "version"),
        output::field(&info, "envdVersion")
    );
    println!(
        "sandboxes  {} running, {} paused, {} starting (at most {} running)",
        n(&["sandboxes", "running"]),
        n(&["sandboxes", "paused"]),
        n(&["sandboxes", "starting"]),
        n(&["sandboxes", "max"])
    );
    println!(
        "vCPUs      {} of {} used, {} free",
        n(&["vcpus", "used"]),
        n(&["vcpus", "total"]),
        n(&["vcpus", "free"])
    );
    println!(
        "memory     {} of {} MiB used, {} MiB free",
        n(&["memoryMB", "used"]),
        n(&["memoryMB", "total"]),
        n(&["memoryMB", "free"])
    );
    println!(
        "disk       {} MiB free of {} MiB ({} MiB kept free)",
        n(&["diskMB", "free"]),
        n(&["diskMB", "total"]),
        n(&["diskMB", "minFree"])
    );
    let f = |path: &[&str]| {
        path.iter()
            .try_fold(&info, |v, k| v.get(*k))
            .and_then(Value::as_f64)
            .unwrap_or(0.0)
    };
    println!(
        "images     {} templates; disk {:.1} % used, evicting above {} % down to {} %; \
         {} evicted ({} MiB), {} conversions refused",
        n(&["diskMB", "images", "templates"]),
        f(&["diskMB", "usedPercent"]),
        f(&["diskMB", "images", "highWatermark"]),
        f(&["diskMB", "images", "lowWatermark"]),
        n(&["diskMB", "images", "evicted"]),
        n(&["diskMB", "images", "evictedMB"]),
        n(&["diskMB", "images", "refused"])
    );
    Ok(ExitCode::SUCCESS)
}

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
    Ok(ExitCode::SUCCESS)
}

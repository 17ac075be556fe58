//! `sandfork nodes`: the cluster's nodes and its sandbox map, read from etcd
//! (what the gateways route by): each node's capacity and use, how many
//! sandboxes it holds and how many are paused in the object store; then the
//! sandboxes whose node is gone, lost or waiting for a resume elsewhere.

use std::collections::BTreeMap;
use std::process::ExitCode;

use anyhow::{Context, Result};
use serde_json::{Value, json};

use crate::output;

#[derive(clap::Args)]
pub struct NodesArgs {
    /// etcd endpoints, comma-separated.
    #[arg(long, env = "SANDFORK_ETCD", value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    /// Print JSON (the default when stdout is not a terminal).
    #[arg(long)]
    json: bool,
}

pub async fn run(args: NodesArgs) -> Result<ExitCode> {
    // etcd through TLS when SANDFORK_TLS_CERT, _KEY and _CA name a part's files
    let tls = match sandfork_tls::TlsFiles::from_env()? {
        Some(files) => Some(files.load()?),
        None => None,
    };
    let etcd = sandfork_cluster::Cluster::connect_with(&args.etcd, tls.as_ref())
        .await
        .context("connecting to etcd")?;
    let nodes = sandfork_cluster::keyspace::placement_order(etcd.nodes().await?);
    let routes = etcd.sandboxes().await?;
    // Per node: (sandboxes mapped to it, of which durably paused).
    let mut held: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    let mut orphans = Vec::new();
    for (id, route) in &routes {
        let node = route.value.node_id.as_str();
        if nodes.iter().any(|n| n.node_id == node) {
            let e = held.entry(node).or_default();
            e.0 += 1;
            e.1 += u64::from(route.value.paused.is_some());
        } else {
            let state = match route.value.paused {
                Some(_) => "paused (resumes on another node)",
                None => "lost",
            };
            orphans.push((id.clone(), node.to_owned(), state));
        }
    }
    if output::wants_json(args.json) {
        let nodes: Vec<Value> = nodes
            .iter()
            .map(|n| {
                let (mapped, paused) = held.get(n.node_id.as_str()).copied().unwrap_or_default();
                json!({
                    "nodeID": n.node_id, "address": n.api_addr, "incarnation": n.incarnation,
                    "capacity": n.capacity, "load": n.load, "freeShare": n.free_share(),
                    "sandboxes": mapped, "durablyPaused": paused,
                })
            })
            .collect();
        let orphans: Vec<Value> = orphans
            .iter()
            .map(|(id, node, state)| json!({"sandboxID": id, "nodeID": node, "state": state}))
            .collect();
        output::print_json(&json!({"nodes": nodes, "withoutNode": orphans}))?;
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = nodes
        .iter()
        .map(|n| {
            let (mapped, paused) = held.get(n.node_id.as_str()).copied().unwrap_or_default();
            vec![
                n.node_id.clone(),
                n.api_addr.clone(),
                format!("{}/{}", n.load.sandboxes, n.capacity.max_sandboxes),
                format!("{}/{}", n.load.vcpus, n.capacity.vcpus),
                format!("{}/{}", n.load.memory_mib, n.capacity.memory_mib),
                mapped.to_string(),
                paused.to_string(),
            ]
        })
        .collect();
    output::print_table(
        &[
            "NODE",
            "ADDRESS",
            "RUNNING",
            "VCPUS",
            "MEMORY MIB",
            "MAPPED",
            "STORED PAUSES",
        ],
        &rows,
    )?;
    if !orphans.is_empty() {
        println!();
        let rows: Vec<Vec<String>> = orphans
            .into_iter()
            .map(|(id, node, state)| vec![id, node, state.to_owned()])
            .collect();
        output::print_table(&["SANDBOX", "GONE NODE", "STATE"], &rows)?;
    }
    Ok(ExitCode::SUCCESS)
}

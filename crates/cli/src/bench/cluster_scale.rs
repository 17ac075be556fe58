//! `sandfork bench --only cluster-scale`: the cluster's control plane at the
//! size of a training fleet, on one machine. Real etcd (three members on
//! loopback), real gateways (this binary's `serve --role gateway`) and the
//! cluster crate's own code, driven by a load harness that registers node
//! records and claims sandbox routes as nodes do. No sandbox runs: these are
//! the control plane's figures; the harness never stands in for a node in a
//! test of the data path.
//!
//! Per route count (10k, 50k, 100k by default): the rate of the claims that
//! took the map there; a fresh gateway's time until its watched copy holds
//! every route, and its resident memory over a gateway of an empty map; route
//! lookups in that copy (`View::sandbox`, the gateway's lookup); placement
//! decisions over the nodes' records; one node's reconcile pass.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures_util::StreamExt;
use hyper::body::Buf;
use sandfork_cluster::harness::Etcd;
use sandfork_cluster::keyspace;
use sandfork_cluster::{Cluster, LocalSandbox, NodeCapacity, NodeLoad, Registration, View};
use serde_json::{Map, Value, json};

use crate::client::http::{self, Endpoint};

/// Claims in flight at once (a fleet's creates arrive from many nodes).
const CLAIMS_IN_FLIGHT: usize = 64;
const LOOKUPS: usize = 100_000;
const PLACEMENT_WINDOW: Duration = Duration::from_secs(1);
const RECONCILE_SAMPLES: usize = 3;
/// How long a gateway or a view may take to hold the whole map.
const LOAD_BOUND: Duration = Duration::from_secs(180);
const METRICS_KEY: &str = "cluster-scale-bench";

pub struct ScaleBench<'a> {
    pub nodes: usize,
    /// Route counts, ascending.
    pub routes: &'a [usize],
    /// This binary, started as the gateway.
    pub exe: &'a Path,
}

/// A sandbox ID of E2B's length (20 characters).
fn sandbox_id(n: usize) -> String {
    format!("s{n:019}")
}

/// `10000` -> `10k` (the key suffix of a route count).
pub(crate) fn size_suffix(routes: usize) -> String {
    match routes % 1000 {
        0 => format!("{}k", routes / 1000),
        _ => routes.to_string(),
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// The `p` quantile of `sorted` milliseconds, to the nanosecond.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).map_or(f64::NAN, |v| (v * 1e6).round() / 1e6)
}

pub async fn measure(plan: &ScaleBench<'_>) -> Result<Value> {
    if plan.nodes == 0 || plan.routes.is_empty() {
        bail!("the cluster-scale bench needs at least one node and one route count");
    }
    let etcd = Etcd::start_members(3).context("starting 3 etcd members")?;
    etcd.elected(Duration::from_secs(30)).await?;
    let endpoints = etcd.endpoints();
    let cluster = Cluster::connect(&endpoints).await?;
    eprintln!("bench: cluster-scale: registering {} nodes", plan.nodes);
    let capacity = NodeCapacity {
        max_sandboxes: 4096,
        vcpus: 256,
        memory_mib: 1 << 20,
    };
    let mut nodes = Vec::with_capacity(plan.nodes);
    for i in 0..plan.nodes {
        // Nothing listens there: no request reaches a node in this bench.
        let node = Registration::start(
            cluster.clone(),
            &format!("scale-{i:03}"),
            "127.0.0.1:9",
            capacity,
            Duration::from_secs(60),
        )
        .await?;
        node.set_load(NodeLoad {
            sandboxes: (i % 50) as u64,
            vcpus: (i % 50) as u64,
            memory_mib: 512 * (i % 50) as u64,
            templates: vec!["base".into(), format!("task-{}", i % 10)],
        });
        nodes.push(node);
    }
    let (_, empty_rss_kib) = gateway_in_step(plan.exe, &endpoints, 0).await?;

    let mut report = Map::new();
    let mut detail = Vec::new();
    let mut errors = Map::new();
    let mut claimed = 0;
    for &size in plan.routes {
        let suffix = size_suffix(size);
        let mut one = Map::new();
        one.insert("routes".into(), json!(size));
        let started = Instant::now();
        claim(&nodes, claimed..size).await?;
        let took = started.elapsed();
        let per_s = (size - claimed) as f64 / took.as_secs_f64();
        eprintln!(
            "bench: cluster-scale: {} claims to {size} routes in {:.1} s ({per_s:.0}/s)",
            size - claimed,
            took.as_secs_f64()
        );
        claimed = size;
        report.insert(
            format!("cluster_claims_per_s_{suffix}"),
            json!(per_s.round()),
        );

        match gateway_in_step(plan.exe, &endpoints, size).await {
            Ok((reload, rss_kib)) => {
                let mib = rss_kib.saturating_sub(empty_rss_kib) as f64 / 1024.0;
                eprintln!(
                    "bench: cluster-scale: a gateway held {size} routes after {reload:.0} ms, \
                     {mib:.1} MiB over an empty map's"
                );
                report.insert(format!("gateway_reload_ms_{suffix}"), json!(reload));
                report.insert(
                    format!("gateway_watch_mib_{suffix}"),
                    json!((mib * 10.0).round() / 10.0),
                );
                one.insert("gateway_rss_kib".into(), json!(rss_kib));
            }
            Err(e) => {
                eprintln!("bench: cluster-scale: gateway at {size} routes: {e:#}");
                errors.insert(format!("gateway_{suffix}"), json!(format!("{e:#}")));
            }
        }

        match in_process(&cluster, &nodes, size).await {
            Ok(figures) => {
                for (key, value) in [
                    ("gateway_route_lookup_p50_ms", &figures["lookup_p50_ms"]),
                    ("gateway_route_lookup_p99_ms", &figures["lookup_p99_ms"]),
                    ("cluster_placements_per_s", &figures["placements_per_s"]),
                    ("cluster_reconcile_pass_ms", &figures["reconcile_pass_ms"]),
                ] {
                    report.insert(format!("{key}_{suffix}"), value.clone());
                }
                one.extend(figures.as_object().cloned().unwrap_or_default());
            }
            Err(e) => {
                eprintln!("bench: cluster-scale: in-process figures at {size} routes: {e:#}");
                errors.insert(format!("view_{suffix}"), json!(format!("{e:#}")));
            }
        }
        detail.push(Value::Object(one));
    }
    // The unsuffixed keys are those of the largest map.
    let largest = size_suffix(claimed);
    for key in [
        "gateway_route_lookup_p99_ms",
        "cluster_placements_per_s",
        "cluster_claims_per_s",
    ] {
        if let Some(v) = report.get(&format!("{key}_{largest}")).cloned() {
            report.insert(key.into(), v);
        }
    }
    report.insert(
        "cluster_scale_detail".into(),
        json!({
            "nodes": plan.nodes,
            "etcd_members": 3,
            "gateway_empty_rss_kib": empty_rss_kib,
            "sizes": detail,
            "method": "etcd with 3 members on loopback (this host's disk); node records \
                registered under leases as nodes register, routes claimed through \
                Registration::claim (the node's transaction) with 64 in flight, IDs of \
                20 characters spread over the nodes; per route count: a new `serve --role \
                gateway` process until its /metrics says its watch is in step with every \
                route (reload_ms from its spawn), its VmRSS less that of a gateway of an \
                empty map (watch_mib); in this process the gateway's View: 100000 lookups \
                of random existing routes, each timed (p50/p99), placement orders \
                (placement_order_for over the nodes' records) for 1 s, and 3 reconcile \
                passes of one node holding its share of the routes",
        }),
    );
    if !errors.is_empty() {
        report.insert("errors".into(), Value::Object(errors));
    }
    Ok(Value::Object(report))
}

/// Claims the routes `range` names, spread over `nodes`, some in flight.
async fn claim(nodes: &[Registration], range: std::ops::Range<usize>) -> Result<()> {
    let mut answers = futures_util::stream::iter(range)
        .map(|n| async move {
            let id = sandbox_id(n);
            let node = &nodes[n % nodes.len()];
            (node.claim(&id).await, id)
        })
        .buffer_unordered(CLAIMS_IN_FLIGHT);
    while let Some((answer, id)) = answers.next().await {
        if !answer.with_context(|| format!("claiming {id}"))? {
            bail!("the claim of {id} was refused");
        }
    }
    Ok(())
}

/// Starts a gateway and waits until its watch is in step holding `routes`
/// routes: the time from its spawn (ms) and its resident memory (KiB).
async fn gateway_in_step(exe: &Path, endpoints: &[String], routes: usize) -> Result<(f64, u64)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let listen = format!("127.0.0.1:{port}");
    let started = Instant::now();
    let mut child = tokio::process::Command::new(exe)
        .args(["serve", "--role", "gateway", "--listen", &listen])
        .arg(format!("--etcd={}", endpoints.join(",")))
        .env("SANDFORK_API_KEY", METRICS_KEY)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {} serve --role gateway", exe.display()))?;
    let pid = child.id().context("the gateway exited at once")?;
    let endpoint = Endpoint::parse(&format!("http://{listen}"))?;
    let mut seen = None;
    let reload = loop {
        if started.elapsed() > LOAD_BOUND {
            bail!(
                "the gateway's watch did not hold {routes} routes within {} s (last scrape: {seen:?})",
                LOAD_BOUND.as_secs()
            );
        }
        if let Some(status) = child.try_wait()? {
            bail!("the gateway exited: {status}");
        }
        if let Ok(scrape) = scrape(&endpoint).await {
            let in_step = metric(&scrape, "_watch_in_step");
            let held = metric(&scrape, "_routes");
            if in_step == Some(1.0) && held == Some(routes as f64) {
                break ms(started.elapsed());
            }
            seen = Some((in_step, held));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let rss_kib = vm_rss_kib(pid)?;
    child.kill().await?;
    Ok((reload, rss_kib))
}

async fn scrape(endpoint: &Endpoint) -> Result<String> {
    let request = endpoint
        .request("GET", "/metrics")
        .header("x-api-key", METRICS_KEY)
        .body(http::empty())?;
    let answer = endpoint.send(request).await?;
    if !answer.status().is_success() {
        bail!("/metrics answered {}", answer.status());
    }
    let body = http_body_util::BodyExt::collect(answer.into_body())
        .await?
        .aggregate();
    Ok(std::io::read_to_string(body.reader())?)
}

/// The value of the unlabelled metric whose name ends in `suffix`.
fn metric(scrape: &str, suffix: &str) -> Option<f64> {
    scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once(' '))
        .find(|(name, _)| name.ends_with(suffix))
        .and_then(|(_, value)| value.trim().parse().ok())
}

fn vm_rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS in the gateway's status")
}

/// The gateway's lookups and placements in this process's own `View`, and
/// one node's reconcile passes, with `routes` routes in the map.
async fn in_process(cluster: &Cluster, nodes: &[Registration], routes: usize) -> Result<Value> {
    let view = View::start(cluster.clone());
    let started = Instant::now();
    while !(view.in_step() && view.sizes().1 == routes) {
        if started.elapsed() > LOAD_BOUND {
            bail!(
                "the view held {:?} (nodes, routes) after {} s, in step: {}",
                view.sizes(),
                LOAD_BOUND.as_secs(),
                view.in_step()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let view_load_ms = ms(started.elapsed());

    // xorshift: spread lookups without a random crate.
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut lookups = Vec::with_capacity(LOOKUPS);
    for _ in 0..LOOKUPS {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let id = sandbox_id((state % routes as u64) as usize);
        let t = Instant::now();
        let found = view.sandbox(&id);
        let took = t.elapsed();
        if found.is_none() {
            bail!("the view lacks route {id}");
        }
        lookups.push(took.as_secs_f64() * 1e3);
    }
    lookups.sort_by(f64::total_cmp);

    let t = Instant::now();
    let mut placements = 0u64;
    while t.elapsed() < PLACEMENT_WINDOW {
        let records = view.nodes().context("the view fell out of step")?;
        let order = keyspace::placement_order_for(records, Some("task-3"));
        std::hint::black_box(order.first());
        placements += 1;
    }
    let placements_per_s = placements as f64 / t.elapsed().as_secs_f64();
    drop(view);

    let node = &nodes[0];
    let local: Vec<LocalSandbox> = (0..routes)
        .step_by(nodes.len())
        .map(|n| LocalSandbox {
            id: sandbox_id(n),
            team: "default".into(),
            running: true,
            pause_generation: 0,
            kept_local: false,
        })
        .collect();
    let mut passes = Vec::with_capacity(RECONCILE_SAMPLES);
    for _ in 0..RECONCILE_SAMPLES {
        let t = Instant::now();
        let done = node.reconcile(&local, |_| false).await?;
        passes.push(ms(t.elapsed()));
        if done.claimed + done.released > 0 || !done.moved.is_empty() {
            bail!("a reconcile pass of a settled map changed it: {done:?}");
        }
    }
    let mut sorted = passes.clone();
    let reconcile_pass_ms = crate::bench::median(&mut sorted);
    Ok(json!({
        "view_load_ms": view_load_ms,
        "lookup_p50_ms": percentile(&lookups, 0.5),
        "lookup_p99_ms": percentile(&lookups, 0.99),
        "lookup_max_ms": percentile(&lookups, 1.0),
        "lookups": LOOKUPS,
        "placements_per_s": placements_per_s.round(),
        "reconcile_pass_ms": reconcile_pass_ms,
        "reconcile_pass_ms_samples": passes,
        "reconcile_local_sandboxes": local.len(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_name_their_keys_in_thousands() {
        assert_eq!(size_suffix(10_000), "10k");
        assert_eq!(size_suffix(100_000), "100k");
        assert_eq!(size_suffix(1_500), "1500");
    }

    #[test]
    fn a_metric_is_read_by_its_name_s_end() {
        let scrape = "# HELP sandfork_gateway_routes Sandbox routes\n\
                      sandfork_gateway_routes 100000\n\
                      sandfork_gateway_watch_in_step 1\n";
        assert_eq!(metric(scrape, "_routes"), Some(100000.0));
        assert_eq!(metric(scrape, "_watch_in_step"), Some(1.0));
        assert_eq!(metric(scrape, "_nodes"), None);
    }

    #[test]
    fn ids_are_e2b_s_length() {
        assert_eq!(sandbox_id(7).len(), 20);
    }
}

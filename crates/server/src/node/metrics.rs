//! The node's Prometheus metrics (`GET /metrics`, OpenMetrics text): one
//! registry, owned by the [`crate::node::sandbox::Manager`], fed where the
//! node already has one point for a fact:
//!
//! - every [`Lifecycle`](crate::node::events::Lifecycle) fact passes
//!   [`Metrics::saw`] (the manager's one sender of them);
//! - every admission refusal passes [`Metrics::refused`] (the capacity's
//!   reservation and the cluster's hooks);
//! - the HTTP floor's one layer over the control plane times each
//!   lifecycle operation ([`Metrics::operation`]);
//! - what is a level rather than an event (sandboxes by state, pools,
//!   memory, builds) is read from the node's own records at each scrape
//!   ([`Metrics::scrape`]), so no handler keeps a copy of it.
//!
//! Labels are bounded: operation and reason names from fixed lists, HTTP
//! status codes, teams and templates (as many as the node has), never a
//! sandbox id.

use std::collections::HashSet;
use std::sync::Mutex;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::node::clock::now_ms;
use crate::node::events::LifecycleKind;
use crate::node::sandbox::Manager;
use crate::node::store::{BuildRecord, BuildStatus, SandboxState};

/// What `GET /metrics` answers with (OpenMetrics text).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels<const N: usize> = [(&'static str, String); N];
type HistogramFamily<const N: usize> = Family<Labels<N>, Histogram, fn() -> Histogram>;

/// Upper bounds (seconds) of lifecycle operations: a pause of a small guest
/// takes tens of ms on hardware, a fork of 100 in the emulated lab minutes.
const OPERATION_BUCKETS: [f64; 14] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
/// Upper bounds (seconds) of template builds and image conversions.
const BUILD_BUCKETS: [f64; 10] = [
    5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
];
/// Upper bounds (seconds) of a fork's steps: a vCPU freeze takes well under
/// a millisecond on hardware, a fork of 100's children minutes in the lab.
const FORK_PHASE_BUCKETS: [f64; 18] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0,
];
/// Upper bounds of a fork's children count (the API takes at most 100).
const FORK_CHILDREN_BUCKETS: [f64; 8] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 100.0];

/// A lifecycle operation a client asks for, as the metrics name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Create,
    Fork,
    Pause,
    Resume,
    Connect,
    Snapshot,
    Rollback,
    Kill,
}

impl Operation {
    pub const ALL: [Operation; 8] = [
        Operation::Create,
        Operation::Fork,
        Operation::Pause,
        Operation::Resume,
        Operation::Connect,
        Operation::Snapshot,
        Operation::Rollback,
        Operation::Kill,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Create => "create",
            Operation::Fork => "fork",
            Operation::Pause => "pause",
            Operation::Resume => "resume",
            Operation::Connect => "connect",
            Operation::Snapshot => "snapshot",
            Operation::Rollback => "rollback",
            Operation::Kill => "kill",
        }
    }
}

/// The `kind` label of a lifecycle fact: E2B's event type's last word.
fn kind_name(kind: LifecycleKind) -> &'static str {
    let name = kind.as_str();
    name.rsplit_once('.').map_or(name, |(_, last)| last)
}

/// How many children a fork asked for, put in its answer by the fork routes
/// for the layer that times it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForkChildren(pub u32);

/// The `children` label of a fork's latency: a few ranges, not every N.
fn children_range(n: u32) -> &'static str {
    match n {
        0 | 1 => "1",
        2..=4 => "2-4",
        5..=16 => "5-16",
        _ => "17+",
    }
}

/// Why an admission was refused, as the metrics name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The node's sandbox count limit.
    NodeSandboxes,
    Vcpus,
    Memory,
    Disk,
    /// The team's own limits on this node.
    TeamSandboxes,
    TeamMemory,
    /// The team's limit across the cluster, or the cluster's state unreadable.
    ClusterTeam,
    ClusterState,
    /// Anything else the cluster said (not here, moved, unavailable).
    Cluster,
}

impl Refusal {
    pub const ALL: [Refusal; 9] = [
        Refusal::NodeSandboxes,
        Refusal::Vcpus,
        Refusal::Memory,
        Refusal::Disk,
        Refusal::TeamSandboxes,
        Refusal::TeamMemory,
        Refusal::ClusterTeam,
        Refusal::ClusterState,
        Refusal::Cluster,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::NodeSandboxes => "node_sandboxes",
            Refusal::Vcpus => "vcpus",
            Refusal::Memory => "memory",
            Refusal::Disk => "disk",
            Refusal::TeamSandboxes => "team_sandboxes",
            Refusal::TeamMemory => "team_memory",
            Refusal::ClusterTeam => "cluster_team",
            Refusal::ClusterState => "cluster_state",
            Refusal::Cluster => "cluster",
        }
    }
}

/// The node's registry and the families fed by events.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Held through a scrape: the levels are cleared and set again in it.
    scraping: Mutex<()>,
    started_at_ms: u64,
    // Fed by events.
    lifecycle: Family<Labels<1>, Counter>,
    operation_seconds: HistogramFamily<2>,
    operation_errors: Family<Labels<2>, Counter>,
    fork_seconds: HistogramFamily<1>,
    fork_children: Histogram,
    fork_phase_seconds: HistogramFamily<1>,
    refusals: Family<Labels<1>, Counter>,
    cross_node_children: Family<Labels<1>, Counter>,
    build_seconds: HistogramFamily<2>,
    /// Builds already in `build_seconds` (by build id).
    builds_seen: Mutex<HashSet<String>>,
    vmm_exits: Counter,
    // Levels, set at each scrape.
    sandboxes: Family<Labels<3>, Gauge>,
    starting: Gauge,
    pool_idle: Gauge,
    pool_target: Gauge,
    network_slots: Family<Labels<1>, Gauge>,
    memory_available: Gauge,
    sandboxes_pss: Gauge,
    capacity_vcpus: Family<Labels<1>, Gauge>,
    capacity_memory: Family<Labels<1>, Gauge>,
    builds: Family<Labels<2>, Gauge>,
}

fn operation_histogram() -> Histogram {
    Histogram::new(OPERATION_BUCKETS)
}

fn fork_phase_histogram() -> Histogram {
    Histogram::new(FORK_PHASE_BUCKETS)
}

fn build_histogram() -> Histogram {
    Histogram::new(BUILD_BUCKETS)
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut m = Metrics {
            registry: Registry::with_prefix("sandfork"),
            scraping: Mutex::new(()),
            started_at_ms: now_ms(),
            lifecycle: Family::default(),
            operation_seconds: Family::new_with_constructor(operation_histogram),
            operation_errors: Family::default(),
            fork_seconds: Family::new_with_constructor(operation_histogram),
            fork_children: Histogram::new(FORK_CHILDREN_BUCKETS),
            fork_phase_seconds: Family::new_with_constructor(fork_phase_histogram),
            refusals: Family::default(),
            cross_node_children: Family::default(),
            build_seconds: Family::new_with_constructor(build_histogram),
            builds_seen: Mutex::default(),
            vmm_exits: Counter::default(),
            sandboxes: Family::default(),
            starting: Gauge::default(),
            pool_idle: Gauge::default(),
            pool_target: Gauge::default(),
            network_slots: Family::default(),
            memory_available: Gauge::default(),
            sandboxes_pss: Gauge::default(),
            capacity_vcpus: Family::default(),
            capacity_memory: Family::default(),
            builds: Family::default(),
        };
        let r = &mut m.registry;
        r.register(
            "lifecycle_events",
            "Sandbox lifecycle facts (created, forked, paused, resumed, killed), the node's own \
             included (a timeout's kill or pause)",
            m.lifecycle.clone(),
        );
        r.register_with_unit(
            "operation_duration",
            "Lifecycle operations clients asked for, by operation and outcome (ok or error)",
            Unit::Seconds,
            m.operation_seconds.clone(),
        );
        r.register(
            "operation_errors",
            "Lifecycle operations that failed, by operation and reason (the answer's HTTP status)",
            m.operation_errors.clone(),
        );
        r.register_with_unit(
            "fork_duration",
            "Forks by the number of children asked for (1, 2-4, 5-16, 17+)",
            Unit::Seconds,
            m.fork_seconds.clone(),
        );
        r.register(
            "fork_children",
            "The number of children each fork asked for",
            m.fork_children.clone(),
        );
        r.register_with_unit(
            "fork_phase_duration",
            "Where forks of running sandboxes spend their time, by step: the node's (admitted, \
             vmms_taken, fork_call, recorded, children, total), the parent's VMM's while it \
             stands still (parent_paused, vmm_*), and each child's (child_*)",
            Unit::Seconds,
            m.fork_phase_seconds.clone(),
        );
        r.register(
            "admission_refusals",
            "Creates, forks and resumes refused for room or by the cluster, by reason",
            m.refusals.clone(),
        );
        r.register(
            "cross_node_fork_children",
            "Fork children this node asked other nodes of its cluster to make, by outcome",
            m.cross_node_children.clone(),
        );
        r.register_with_unit(
            "template_build_duration",
            "Finished template builds and image conversions, by kind (build, image) and outcome \
             (ready, error)",
            Unit::Seconds,
            m.build_seconds.clone(),
        );
        r.register(
            "vmm_exits",
            "Sandboxes removed because their VMM process ended by itself",
            m.vmm_exits.clone(),
        );
        r.register(
            "sandboxes",
            "Sandboxes recorded on this node, by state, team and template",
            m.sandboxes.clone(),
        );
        r.register(
            "sandboxes_starting",
            "Creates, resumes and fork children holding room without a VMM serving yet",
            m.starting.clone(),
        );
        r.register(
            "warm_pool_idle",
            "Booted VMM processes waiting in the warm pool",
            m.pool_idle.clone(),
        );
        r.register(
            "warm_pool_target",
            "The warm pool's size when full",
            m.pool_target.clone(),
        );
        r.register(
            "network_slots",
            "Network slots (namespace, tap, addresses), by state (ready, in_use)",
            m.network_slots.clone(),
        );
        r.register_with_unit(
            "host_memory_available",
            "The host's MemAvailable",
            Unit::Bytes,
            m.memory_available.clone(),
        );
        r.register_with_unit(
            "sandboxes_memory_pss",
            "The proportional set size of every sandbox's VMM, summed (shared pages counted once)",
            Unit::Bytes,
            m.sandboxes_pss.clone(),
        );
        r.register(
            "capacity_vcpus",
            "vCPUs: the node's limit (total) and what sandboxes hold (used)",
            m.capacity_vcpus.clone(),
        );
        r.register_with_unit(
            "capacity_memory",
            "Memory: the node's limit (total) and what sandboxes are charged (used)",
            Unit::Bytes,
            m.capacity_memory.clone(),
        );
        r.register(
            "template_builds",
            "Template builds and image conversions recorded, by kind (build, image) and status \
             (waiting, building, ready, error)",
            m.builds.clone(),
        );
        m.start_at_zero();
        m
    }

    /// Every series whose labels are known beforehand, at zero: a family
    /// with no series is left out of a scrape, and a series that appears
    /// only at its first event has no rate until its second.
    fn start_at_zero(&self) {
        for kind in LifecycleKind::ALL {
            self.lifecycle
                .get_or_create_owned(&[("kind", kind_name(kind).to_owned())]);
        }
        for op in Operation::ALL {
            self.operation_seconds.get_or_create_owned(&[
                ("operation", op.as_str().to_owned()),
                ("outcome", "ok".to_owned()),
            ]);
        }
        for n in [1, 2, 5, 17] {
            self.fork_seconds
                .get_or_create_owned(&[("children", children_range(n).to_owned())]);
        }
        for why in Refusal::ALL {
            self.refusals
                .get_or_create_owned(&[("reason", why.as_str().to_owned())]);
        }
        for outcome in ["made", "failed"] {
            self.cross_node_children
                .get_or_create_owned(&[("outcome", outcome.to_owned())]);
        }
        for kind in ["build", "image"] {
            for outcome in ["ready", "error"] {
                self.build_seconds.get_or_create_owned(&[
                    ("kind", kind.to_owned()),
                    ("outcome", outcome.to_owned()),
                ]);
            }
        }
    }

    /// A lifecycle fact the node recorded.
    pub(crate) fn saw(&self, kind: LifecycleKind) {
        self.lifecycle
            .get_or_create(&[("kind", kind_name(kind).to_owned())])
            .inc();
    }

    /// An admission refused for `why`.
    pub fn refused(&self, why: Refusal) {
        self.refusals
            .get_or_create(&[("reason", why.as_str().to_owned())])
            .inc();
    }

    /// One step of a fork took `took` (see
    /// [`crate::node::sandbox::ForkTimes`] for the names).
    pub(crate) fn fork_phase(&self, step: &'static str, took: std::time::Duration) {
        self.fork_phase_seconds
            .get_or_create(&[("phase", step.to_owned())])
            .observe(took.as_secs_f64());
    }

    /// `count` fork children asked of other nodes, `made` of them made there.
    pub fn cross_node_fork(&self, count: u32, made: usize) {
        let made = made as u64;
        let inc = |outcome: &str, n: u64| {
            self.cross_node_children
                .get_or_create(&[("outcome", outcome.to_owned())])
                .inc_by(n);
        };
        inc("made", made);
        inc("failed", u64::from(count).saturating_sub(made));
    }

    /// Operation `op` took `seconds` and answered `status` (an HTTP status
    /// code: 2xx is success, anything else an error named by its code);
    /// `children` for a fork.
    pub fn operation(&self, op: Operation, seconds: f64, status: u16, children: Option<u32>) {
        let ok = (200..300).contains(&status);
        let outcome = if ok { "ok" } else { "error" };
        self.operation_seconds
            .get_or_create(&[
                ("operation", op.as_str().to_owned()),
                ("outcome", outcome.to_owned()),
            ])
            .observe(seconds);
        if !ok {
            self.operation_errors
                .get_or_create(&[
                    ("operation", op.as_str().to_owned()),
                    ("reason", status.to_string()),
                ])
                .inc();
        }
        if let (Operation::Fork, Some(n), true) = (op, children, ok) {
            self.fork_children.observe(f64::from(n));
            self.fork_seconds
                .get_or_create(&[("children", children_range(n).to_owned())])
                .observe(seconds);
        }
    }

    /// The whole exposition: the levels read from `manager` now, then every
    /// family.
    pub fn scrape(&self, manager: &Manager) -> String {
        let _one = self.scraping.lock().unwrap_or_else(|p| p.into_inner());
        self.read_levels(manager);
        let mut text = String::new();
        if let Err(e) = encode(&mut text, &self.registry) {
            // Writing into a String cannot fail; an encoder's own error is
            // logged and the scrape is what was written.
            tracing::warn!("encoding the metrics: {e}");
        }
        text
    }

    fn read_levels(&self, manager: &Manager) {
        let records = manager.list().unwrap_or_else(|e| {
            tracing::warn!("metrics: listing sandboxes: {e}");
            Vec::new()
        });
        self.sandboxes.clear();
        for r in &records {
            let state = match r.state {
                SandboxState::Running => "running",
                SandboxState::Paused => "paused",
            };
            self.sandboxes
                .get_or_create(&[
                    ("state", state.to_owned()),
                    ("team", r.team().to_owned()),
                    ("template", r.template_id.clone()),
                ])
                .inc();
        }
        let capacity = manager.capacity();
        let (limits, held) = (capacity.limits(), capacity.held());
        let live = manager.live_count();
        self.starting
            .set(held.sandboxes.saturating_sub(live) as i64);
        self.pool_idle.set(manager.pool().idle_count() as i64);
        self.pool_target.set(manager.config().pool_size as i64);
        // Zeros without networking: a dashboard's query stays valid.
        let (ready, in_use) = manager.pool().net().map_or((0, 0), |net| net.counts());
        for (state, n) in [("ready", ready), ("in_use", in_use)] {
            self.network_slots
                .get_or_create(&[("state", state.to_owned())])
                .set(n as i64);
        }
        match host_mem::mem_available_mib() {
            Ok(mib) => {
                self.memory_available.set(mib_bytes(mib));
            }
            Err(e) => tracing::debug!("metrics: reading MemAvailable: {e}"),
        }
        self.sandboxes_pss
            .set(i64::try_from(capacity.pss_kib().saturating_mul(1024)).unwrap_or(i64::MAX));
        let set = |family: &Family<Labels<1>, Gauge>, total: i64, used: i64| {
            family
                .get_or_create(&[("kind", "total".to_owned())])
                .set(total);
            family
                .get_or_create(&[("kind", "used".to_owned())])
                .set(used);
        };
        set(&self.capacity_vcpus, limits.vcpus as i64, held.vcpus as i64);
        set(
            &self.capacity_memory,
            mib_bytes(limits.memory_mib),
            mib_bytes(held.memory_mib),
        );
        let exits = manager.vmm_exits();
        self.vmm_exits
            .inc_by(exits.saturating_sub(self.vmm_exits.get()));
        match manager.store().builds() {
            Ok(builds) => self.read_builds(&builds),
            Err(e) => tracing::warn!("metrics: listing builds: {e}"),
        }
    }

    /// Builds by kind and status; those finished since the node started
    /// and not yet counted go into the duration histogram (a build's end
    /// has several writers, its record one shape).
    fn read_builds(&self, builds: &[BuildRecord]) {
        self.builds.clear();
        for kind in ["build", "image"] {
            for status in ["waiting", "building", "ready", "error"] {
                self.builds
                    .get_or_create(&[("kind", kind.to_owned()), ("status", status.to_owned())])
                    .set(0);
            }
        }
        let mut seen = self.builds_seen.lock().unwrap_or_else(|p| p.into_inner());
        for b in builds {
            let kind = build_kind(b);
            self.builds
                .get_or_create(&[
                    ("kind", kind.to_owned()),
                    ("status", b.status.as_str().to_owned()),
                ])
                .inc();
            let Some(finished) = b.finished_at_ms else {
                continue;
            };
            if finished < self.started_at_ms
                || matches!(b.status, BuildStatus::Waiting | BuildStatus::Building)
                || !seen.insert(b.build_id.clone())
            {
                continue;
            }
            let seconds = finished.saturating_sub(b.started_at_ms) as f64 / 1000.0;
            self.build_seconds
                .get_or_create(&[
                    ("kind", kind.to_owned()),
                    ("outcome", b.status.as_str().to_owned()),
                ])
                .observe(seconds);
        }
    }
}

/// An image conversion's record names its source `image <reference>`
/// (see [`crate::node::template::image_create`]).
fn build_kind(b: &BuildRecord) -> &'static str {
    if b.source.starts_with("image ") {
        "image"
    } else {
        "build"
    }
}

fn mib_bytes(mib: u64) -> i64 {
    i64::try_from(mib.saturating_mul(1 << 20)).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fork_is_timed_by_its_children_range_and_errors_by_status() {
        let m = Metrics::new();
        m.operation(Operation::Fork, 0.2, 201, Some(4));
        m.operation(Operation::Create, 0.1, 429, None);
        m.refused(Refusal::Memory);
        let mut text = String::new();
        encode(&mut text, &m.registry).unwrap();
        assert!(text.contains("sandfork_fork_duration_seconds_count{children=\"2-4\"} 1"));
        assert!(text.contains("sandfork_fork_children_sum 4.0"));
        assert!(
            text.contains("sandfork_operation_errors_total{operation=\"create\",reason=\"429\"} 1")
        );
        assert!(text.contains("sandfork_admission_refusals_total{reason=\"memory\"} 1"));
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn a_forks_steps_are_histograms_by_phase() {
        let m = Metrics::new();
        m.fork_phase("vmm_freeze", std::time::Duration::from_micros(300));
        m.fork_phase("vmm_freeze", std::time::Duration::from_millis(20));
        m.fork_phase("children", std::time::Duration::from_secs(3));
        let mut text = String::new();
        encode(&mut text, &m.registry).unwrap();
        let series = "sandfork_fork_phase_duration_seconds";
        assert!(
            text.contains(&format!("{series}_count{{phase=\"vmm_freeze\"}} 2")),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "{series}_bucket{{le=\"0.0005\",phase=\"vmm_freeze\"}} 1"
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!("{series}_sum{{phase=\"children\"}} 3.0")),
            "{text}"
        );
    }
}

//! The gateway's own Prometheus metrics (`GET /metrics` on a gateway):
//! requests by what they are and how they were answered, etcd round trips,
//! where a sandbox's route came from, creates placed on nodes and the
//! nodes and routes its watch holds. The nodes' own families are each
//! node's `/metrics`.
//!
//! A gateway holds no keys: its scrape takes the cluster's admin key given
//! to it as `SANDFORK_API_KEY` (the nodes' own key), as a bearer token or
//! `X-API-KEY`; a gateway started without one answers its scrape 403.

use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

type Labels<const N: usize> = [(&'static str, String); N];

/// Upper bounds (seconds) of an etcd round trip.
const ETCD_BUCKETS: [f64; 10] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0];
/// Upper bounds (seconds) of a request through the gateway (a fork of many
/// in the lab takes minutes).
const REQUEST_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0,
];

#[derive(Debug)]
pub struct GatewayMetrics {
    registry: Registry,
    requests: Family<Labels<2>, Counter>,
    request_seconds: Family<Labels<1>, Histogram, fn() -> Histogram>,
    etcd_seconds: Family<Labels<1>, Histogram, fn() -> Histogram>,
    routes_answered: Family<Labels<1>, Counter>,
    placements: Family<Labels<1>, Counter>,
    take_ins: Family<Labels<1>, Counter>,
    nodes: Gauge,
    routes: Gauge,
    in_step: Gauge,
}

fn request_histogram() -> Histogram {
    Histogram::new(REQUEST_BUCKETS)
}

fn etcd_histogram() -> Histogram {
    Histogram::new(ETCD_BUCKETS)
}

impl Default for GatewayMetrics {
    fn default() -> Self {
        GatewayMetrics::new()
    }
}

impl GatewayMetrics {
    pub fn new() -> GatewayMetrics {
        let mut m = GatewayMetrics {
            registry: Registry::with_prefix("sandfork_gateway"),
            requests: Family::default(),
            request_seconds: Family::new_with_constructor(request_histogram),
            etcd_seconds: Family::new_with_constructor(etcd_histogram),
            routes_answered: Family::default(),
            placements: Family::default(),
            take_ins: Family::default(),
            nodes: Gauge::default(),
            routes: Gauge::default(),
            in_step: Gauge::default(),
        };
        let r = &mut m.registry;
        r.register(
            "requests",
            "Requests by what they are (create, sandbox, envd, list, ...) and the answer's status",
            m.requests.clone(),
        );
        r.register_with_unit(
            "request_duration",
            "Requests by what they are, until the answer's head",
            Unit::Seconds,
            m.request_seconds.clone(),
        );
        r.register_with_unit(
            "etcd_round_trip_duration",
            "Questions the gateway asked etcd itself (its watch's copy lacked the answer), by \
             outcome (ok, error)",
            Unit::Seconds,
            m.etcd_seconds.clone(),
        );
        r.register(
            "routes_answered",
            "Sandbox routes looked up, by where the answer came from (watch, etcd, last_known, \
             missing)",
            m.routes_answered.clone(),
        );
        r.register(
            "create_placements",
            "Creates sent to a node, by its answer (made, refused, other, unreachable)",
            m.placements.clone(),
        );
        r.register(
            "take_ins",
            "Resumes of sandboxes whose node is gone, sent to another node, by outcome (resumed, \
             refused, unreachable)",
            m.take_ins.clone(),
        );
        r.register(
            "nodes",
            "Nodes in the watch's copy of the cluster",
            m.nodes.clone(),
        );
        r.register(
            "routes",
            "Sandbox routes in the watch's copy of the cluster",
            m.routes.clone(),
        );
        r.register(
            "watch_in_step",
            "1 while the watch's copy follows etcd",
            m.in_step.clone(),
        );
        // Known label values start at zero (see the node's metrics).
        for outcome in ["ok", "error"] {
            m.etcd_seconds
                .get_or_create_owned(&[("outcome", outcome.to_owned())]);
        }
        for source in ["watch", "etcd", "last_known", "missing", "error"] {
            m.routes_answered
                .get_or_create_owned(&[("source", source.to_owned())]);
        }
        for outcome in ["made", "refused", "other", "unreachable"] {
            m.placements
                .get_or_create_owned(&[("outcome", outcome.to_owned())]);
        }
        for outcome in ["resumed", "refused", "unreachable"] {
            m.take_ins
                .get_or_create_owned(&[("outcome", outcome.to_owned())]);
        }
        m
    }

    pub fn request(&self, target: &'static str, status: u16, took: Duration) {
        self.requests
            .get_or_create(&[("target", target.to_owned()), ("code", status.to_string())])
            .inc();
        self.request_seconds
            .get_or_create(&[("target", target.to_owned())])
            .observe(took.as_secs_f64());
    }

    pub fn etcd(&self, ok: bool, took: Duration) {
        let outcome = if ok { "ok" } else { "error" };
        self.etcd_seconds
            .get_or_create(&[("outcome", outcome.to_owned())])
            .observe(took.as_secs_f64());
    }

    pub fn route_from(&self, source: &'static str) {
        self.routes_answered
            .get_or_create(&[("source", source.to_owned())])
            .inc();
    }

    pub fn placed(&self, outcome: &'static str) {
        self.placements
            .get_or_create(&[("outcome", outcome.to_owned())])
            .inc();
    }

    pub fn took_in(&self, outcome: &'static str) {
        self.take_ins
            .get_or_create(&[("outcome", outcome.to_owned())])
            .inc();
    }

    /// The exposition, with the watch's levels as they are now.
    pub fn scrape(&self, view: &sandfork_cluster::View) -> String {
        let (nodes, routes) = view.sizes();
        self.scrape_with(nodes, routes, view.in_step())
    }

    /// The exposition with the watch's levels given.
    pub fn scrape_with(&self, nodes: usize, routes: usize, in_step: bool) -> String {
        self.nodes.set(nodes as i64);
        self.routes.set(routes as i64);
        self.in_step.set(i64::from(in_step));
        let mut text = String::new();
        if let Err(e) = encode(&mut text, &self.registry) {
            tracing::warn!("encoding the gateway's metrics: {e}");
        }
        text
    }
}

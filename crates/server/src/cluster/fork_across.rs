//! A fork across nodes (`POST /sandboxes/{id}/fork` of a running sandbox on
//! a node of a cluster): the node freezes the parent once and makes as many
//! children as fit on it; the rest go to other nodes, freest first (by the
//! capacity and load they publish in etcd), each asked over node-to-node
//! HTTP to make some from the frozen fork (`POST /internal/forks`, with the
//! caller's API key, so each node admits or refuses them as it would a
//! create of that team). Those nodes fetch the fork's files from this one
//! at once ([`super::fork_files`]), not from the object store. A node that
//! refuses (capacity) or cannot be reached passes its children on to the
//! next; children no node takes, or that fail, are errors in the answer, as
//! a child that fails to start on one node is.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use sandfork_cluster::NodeRecord;
use serde::{Deserialize, Serialize};

use super::Node;
use super::fork_files::ForkManifest;
use crate::node::sandbox::{Frozen, SandboxError};
use crate::wire::{self, ForkEntry};

/// How long another node may take to make its children (fetch and start).
const CHILDREN_TIMEOUT: Duration = Duration::from_secs(600);
/// Another node's answer: one small entry per child.
const MAX_CHILDREN_ANSWER: usize = 4 << 20;

/// What a node is asked to make children of (`POST /internal/forks`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChildrenRequest {
    /// `host:port` of the node that froze the fork (and serves its files).
    pub source: String,
    /// The fork's export there, and its token.
    pub export: String,
    pub token: crate::node::ids::Token,
    pub count: u32,
    pub timeout_secs: u64,
    pub fork: ForkManifest,
}

/// The children a node has room for by what it publishes: the scarcest of
/// sandboxes, vCPUs and memory (a limit of 0: none).
fn room(node: &NodeRecord, vcpus: u64, memory_mib: u64) -> u64 {
    let fits = |cap: u64, used: u64, each: u64| {
        if cap == 0 || each == 0 {
            u64::MAX
        } else {
            cap.saturating_sub(used) / each
        }
    };
    [
        fits(node.capacity.max_sandboxes, node.load.sandboxes, 1),
        fits(node.capacity.vcpus, node.load.vcpus, vcpus),
        fits(node.capacity.memory_mib, node.load.memory_mib, memory_mib),
    ]
    .into_iter()
    .min()
    .unwrap_or(0)
}

/// How many of `count` children each of `nodes` is asked for: freest
/// first, each as many as it has room for; what none has room for goes to
/// the freest (it admits or refuses for itself: the published loads lag).
/// Nodes asked for none are left out.
pub fn split(count: u32, nodes: &[NodeRecord], vcpus: u64, memory_mib: u64) -> Vec<(usize, u32)> {
    let mut order: Vec<usize> = (0..nodes.len()).collect();
    let rooms: Vec<u64> = nodes.iter().map(|n| room(n, vcpus, memory_mib)).collect();
    order.sort_by(|&a, &b| {
        rooms[b]
            .cmp(&rooms[a])
            .then_with(|| nodes[a].node_id.cmp(&nodes[b].node_id))
    });
    let mut left = count;
    let mut plan: Vec<(usize, u32)> = Vec::new();
    for &i in &order {
        if left == 0 {
            break;
        }
        let take = rooms[i].min(u64::from(left)) as u32;
        if take > 0 {
            plan.push((i, take));
            left -= take;
        }
    }
    if left > 0
        && let Some(&first) = order.first()
    {
        match plan.iter_mut().find(|(i, _)| *i == first) {
            Some(entry) => entry.1 += left,
            None => plan.insert(0, (first, left)),
        }
    }
    plan
}

fn error_entry(status: StatusCode, message: &str) -> ForkEntry {
    ForkEntry::error(status.as_u16(), message)
}

/// What one node answered for the `asked` children it was asked for.
enum Answer {
    /// Its entries (one per child, made or failed).
    Made(Vec<ForkEntry>),
    /// It refused them all for capacity, or could not be reached: the next
    /// node may take them.
    Refused(String),
    /// They fail (the team is at its limit, the request was refused): one
    /// entry each with this status and message.
    Failed(StatusCode, String),
}

/// The children of a fork made on other nodes.
#[derive(Default, Debug)]
pub struct Elsewhere {
    /// One answer entry per child (`{"sandbox": ...}` or `{"error": ...}`),
    /// in order.
    pub entries: Vec<ForkEntry>,
    /// Each child made: its node's address and its id.
    made: Vec<(String, String)>,
    /// How those nodes are reached.
    dialer: sandfork_tls::Dialer,
}

impl Elsewhere {
    fn failed(count: u32, status: StatusCode, message: &str) -> Elsewhere {
        Elsewhere {
            entries: vec![error_entry(status, message); count as usize],
            made: Vec::new(),
            dialer: sandfork_tls::Dialer::plain(),
        }
    }

    /// Kills the children other nodes made, as their nodes' API would for
    /// the caller (`api_key`): the fork's client went away before its
    /// answer, so nobody knows their ids. Children that cannot be killed
    /// are left to their timeout.
    pub async fn undo(&self, api_key: &str) {
        let mut kills = tokio::task::JoinSet::new();
        for (addr, id) in self.made.clone() {
            let api_key = api_key.to_owned();
            let dialer = self.dialer.clone();
            kills.spawn(async move {
                let uri = format!("/sandboxes/{id}");
                let sent = send(
                    &dialer,
                    &addr,
                    hyper::Method::DELETE,
                    &uri,
                    &api_key,
                    Bytes::new(),
                )
                .await;
                match sent {
                    Ok((status, ..)) if status.is_success() || status == StatusCode::NOT_FOUND => {}
                    Ok((status, _, body)) => tracing::warn!(
                        "cluster: fork child {id} on {addr}: not killed after its client went \
                         away: {status} {}",
                        String::from_utf8_lossy(&body[..body.len().min(300)])
                    ),
                    Err(e) => tracing::warn!(
                        "cluster: fork child {id} on {addr}: not killed after its client went \
                         away: {e}"
                    ),
                }
            });
        }
        while kills.join_next().await.is_some() {}
        if !self.made.is_empty() {
            let ids: Vec<&str> = self.made.iter().map(|(_, id)| id.as_str()).collect();
            tracing::info!(
                "cluster: the client went away before the answer: removed the {} fork \
                 children other nodes made for it: {}",
                ids.len(),
                ids.join(", ")
            );
        }
    }
}

/// Makes `count` children of `frozen` on other nodes of the cluster, in
/// order. `api_key` is the caller's: each node admits the children as a
/// create of its team.
pub async fn elsewhere(
    node: &Arc<Node>,
    frozen: Result<Frozen, SandboxError>,
    count: u32,
    timeout: Duration,
    api_key: &str,
) -> Elsewhere {
    let metrics = node.manager.metrics();
    let failed = |status, message: String| {
        metrics.cross_node_fork(count, 0);
        Elsewhere::failed(count, status, &message)
    };
    let frozen = match frozen {
        Ok(f) => f,
        Err(e) => {
            return failed(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("listing the fork's files for other nodes: {e}"),
            );
        }
    };
    let me = node.registration.node_id();
    let nodes = match node.registration.cluster().nodes().await {
        Ok(nodes) => nodes,
        Err(e) => {
            return failed(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("cluster state: {e}"),
            );
        }
    };
    let Some(source) = nodes
        .iter()
        .find(|n| n.node_id == me)
        .map(|n| n.api_addr.clone())
    else {
        return failed(
            StatusCode::SERVICE_UNAVAILABLE,
            "this node is not registered in the cluster".into(),
        );
    };
    // Nodes of another CPU template would refuse the children (see `super::cpu`).
    let mut candidates: Vec<NodeRecord> = nodes
        .into_iter()
        .filter(|n| n.node_id != me && n.cpu_template == frozen.parent.cpu_template)
        .collect();
    let started = std::time::Instant::now();
    let exported = match node.forks.export(&frozen, &me).await {
        Ok(e) => e,
        Err(e) => {
            return failed(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("serving the fork's files to other nodes: {e}"),
            );
        }
    };
    tracing::info!(
        "cluster: sandbox {}: fork {} described for other nodes in {} ms; {count} children to \
         place on {} other node(s)",
        frozen.parent.id,
        exported.id,
        started.elapsed().as_millis(),
        candidates.len()
    );
    let request = ChildrenRequest {
        source,
        export: exported.id.clone(),
        token: exported.token.clone(),
        count: 0,
        timeout_secs: timeout.as_secs(),
        fork: exported.manifest,
    };
    let (vcpus, memory_mib) = (u64::from(frozen.parent.cpu_count), frozen.parent.memory_mb);
    let mut entries = Vec::with_capacity(count as usize);
    let mut made_on = Vec::new();
    let mut left = count;
    let mut refusals = Vec::new();
    while left > 0 && !candidates.is_empty() {
        let plan = split(left, &candidates, vcpus, memory_mib);
        let asked: Vec<(NodeRecord, u32)> = plan
            .iter()
            .map(|&(i, n)| (candidates[i].clone(), n))
            .collect();
        let mut tried: Vec<usize> = plan.iter().map(|&(i, _)| i).collect();
        tried.sort_unstable();
        for i in tried.into_iter().rev() {
            candidates.remove(i);
        }
        let mut asking = tokio::task::JoinSet::new();
        for (index, (to, n)) in asked.iter().enumerate() {
            let request = ChildrenRequest {
                count: *n,
                ..request.clone()
            };
            let (to, api_key, dialer) = (to.clone(), api_key.to_owned(), node.dialer.clone());
            asking.spawn(async move { (index, ask(&dialer, &to, request, &api_key).await) });
        }
        let mut answers: Vec<Option<Answer>> = asked.iter().map(|_| None).collect();
        while let Some(done) = asking.join_next().await {
            match done {
                Ok((index, answer)) => answers[index] = Some(answer),
                Err(e) => tracing::error!("cluster: asking a node for fork children: {e}"),
            }
        }
        let answers = answers.into_iter().map(|a| {
            a.unwrap_or_else(|| {
                Answer::Failed(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the request's task ended early".into(),
                )
            })
        });
        for ((to, n), answer) in asked.into_iter().zip(answers) {
            match answer {
                Answer::Made(mut made) => {
                    tracing::info!(
                        "cluster: sandbox {}: node {} made {} of {n} children",
                        frozen.parent.id,
                        to.node_id,
                        made.iter().filter(|e| e.sandbox_id().is_some()).count()
                    );
                    made_on.extend(
                        made.iter().filter_map(|e| {
                            Some((to.api_addr.clone(), e.sandbox_id()?.to_owned()))
                        }),
                    );
                    made.resize_with(n as usize, || {
                        error_entry(
                            StatusCode::BAD_GATEWAY,
                            "the node answered for fewer children",
                        )
                    });
                    entries.extend(made);
                    left -= n;
                }
                Answer::Failed(status, message) => {
                    entries.extend(vec![error_entry(status, &message); n as usize]);
                    left -= n;
                }
                Answer::Refused(why) => {
                    tracing::info!(
                        "cluster: sandbox {}: node {} did not take {n} fork children: {why}",
                        frozen.parent.id,
                        to.node_id
                    );
                    refusals.push(format!("node {}: {why}", to.node_id));
                }
            }
        }
    }
    node.forks.remove(&exported.id);
    if left > 0 {
        let why = if refusals.is_empty() {
            "no other node in the cluster".to_owned()
        } else {
            refusals.join("; ")
        };
        entries.extend(vec![
            error_entry(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("no node in the cluster has room for this fork child ({why})"),
            );
            left as usize
        ]);
    }
    metrics.cross_node_fork(count, made_on.len());
    Elsewhere {
        entries,
        made: made_on,
        dialer: node.dialer.clone(),
    }
}

/// Asks node `to` for `request.count` children.
async fn ask(
    dialer: &sandfork_tls::Dialer,
    to: &NodeRecord,
    request: ChildrenRequest,
    api_key: &str,
) -> Answer {
    let body = match serde_json::to_vec(&request) {
        Ok(b) => b,
        Err(e) => return Answer::Failed(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    let exchange = send(
        dialer,
        &to.api_addr,
        hyper::Method::POST,
        "/internal/forks",
        api_key,
        Bytes::from(body),
    );
    let (status, team_limit, bytes) = match tokio::time::timeout(CHILDREN_TIMEOUT, exchange).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => return Answer::Refused(e),
        Err(_) => {
            // It may still make them: its children are its own to settle
            // (claimed there, reaped at their timeout).
            return Answer::Failed(
                StatusCode::GATEWAY_TIMEOUT,
                format!(
                    "node {} did not answer within {CHILDREN_TIMEOUT:?}",
                    to.node_id
                ),
            );
        }
    };
    let message = || {
        serde_json::from_slice::<wire::Error>(&bytes)
            .ok()
            .map(|e| e.message)
            .unwrap_or_else(|| String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned())
    };
    if status.is_success() {
        return match serde_json::from_slice::<Vec<ForkEntry>>(&bytes) {
            Ok(entries) => Answer::Made(entries),
            Err(e) => Answer::Failed(
                StatusCode::BAD_GATEWAY,
                format!("node {}'s answer: {e}", to.node_id),
            ),
        };
    }
    if team_limit {
        return Answer::Failed(status, message());
    }
    match status {
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE | StatusCode::NOT_FOUND => {
            Answer::Refused(format!("{status}: {}", message()))
        }
        _ => Answer::Failed(status, format!("node {}: {}", to.node_id, message())),
    }
}

/// One request to the node at `addr` with the caller's `api_key`: its
/// status, whether it is a team's limit, and its body.
async fn send(
    dialer: &sandfork_tls::Dialer,
    addr: &str,
    method: hyper::Method,
    uri: &str,
    api_key: &str,
    body: Bytes,
) -> Result<(StatusCode, bool, Bytes), String> {
    let stream = dialer
        .connect(addr)
        .await
        .map_err(|e| format!("connecting: {e}"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(uri)
        .header(hyper::header::HOST, addr)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header(wire::API_KEY_HEADER, api_key)
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    let answer = sender
        .send_request(req)
        .await
        .map_err(|e| format!("request: {e}"))?;
    let status = answer.status();
    let team_limit = answer.headers().contains_key(wire::TEAM_LIMIT_HEADER);
    let bytes = http_body_util::Limited::new(answer.into_body(), MAX_CHILDREN_ANSWER)
        .collect()
        .await
        .map_err(|e| format!("reading the answer: {e}"))?
        .to_bytes();
    Ok((status, team_limit, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandfork_cluster::{NodeCapacity, NodeLoad};

    fn node(id: &str, max: u64, used: u64) -> NodeRecord {
        NodeRecord {
            node_id: id.into(),
            incarnation: 1,
            api_addr: "127.0.0.1:1".into(),
            capacity: NodeCapacity {
                max_sandboxes: max,
                vcpus: 64,
                memory_mib: 64 << 10,
            },
            load: NodeLoad {
                sandboxes: used,
                vcpus: used,
                memory_mib: used * 512,
                ..NodeLoad::default()
            },
            cpu_template: None,
        }
    }

    #[test]
    fn children_go_to_the_roomiest_nodes_first() {
        // 6 children: b has room for 4, c for 8: c takes all 6.
        let nodes = [node("b", 8, 4), node("c", 10, 2)];
        assert_eq!(split(6, &nodes, 1, 512), vec![(1, 6)]);
        // 10: c its 8, b the other 2.
        assert_eq!(split(10, &nodes, 1, 512), vec![(1, 8), (0, 2)]);
        // More than all have room for: the roomiest is asked for the rest
        // (it admits or refuses for itself).
        assert_eq!(split(14, &nodes, 1, 512), vec![(1, 10), (0, 4)]);
        // Memory can be what is scarce: 2 GiB free on c is 4 children of 512.
        let mut c = node("c", 100, 0);
        c.capacity.memory_mib = 2048;
        assert_eq!(split(6, &[c.clone()], 1, 512), vec![(0, 6)]);
        assert_eq!(room(&c, 1, 512), 4);
        // Ties by node id; nodes asked for none are left out.
        let even = [node("z", 8, 0), node("a", 8, 0)];
        assert_eq!(split(3, &even, 1, 512), vec![(1, 3)]);
        assert!(split(0, &even, 1, 512).is_empty());
        assert!(split(3, &[], 1, 512).is_empty());
    }
}

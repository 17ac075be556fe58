//! `POST /internal/forks`: a node of a cluster makes children of a fork
//! frozen on another node ([`super::fork_across`]). It admits or refuses
//! them as it would a create of the caller's team, fetches what it lacks
//! of the fork's files from that node (shared files into its
//! `cluster-cache` by content, the state rewritten to name the copies),
//! gives each child a disk layer of its own over the sealed copy and starts
//! it; the cluster layer claims each child in etcd before the answer leaves.

use std::path::Path;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::{Extension, Json};
use sandfork_cluster::peer::PeerChunks;

use super::cache;
use super::durable::DurableError;
use super::fork_across::ChildrenRequest;
use super::fork_files::ForkManifest;
use crate::http::api::{ApiError, MAX_FORK_COUNT, Shared};
use crate::node::capacity::Ask;
use crate::node::sandbox::{CopiedFork, SandboxError};
use crate::node::tenants::Caller;

pub async fn make_children(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    Json(req): Json<ChildrenRequest>,
) -> Result<Response, ApiError> {
    let node = state
        .cluster
        .get()
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "no such route"))?;
    let parent = &req.fork.parent;
    if !caller.admin && *caller.team != *parent.team() {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "the fork's sandbox is not the caller's team's",
        ));
    }
    if req.count == 0 || i64::from(req.count) > MAX_FORK_COUNT {
        return Err(ApiError::bad_request(format!(
            "count must be from 1 to {MAX_FORK_COUNT}"
        )));
    }
    if !crate::node::ids::is_sandbox_id(&req.export) {
        return Err(ApiError::bad_request("not a fork export's name"));
    }
    // Files are fetched only from a node of the cluster, the one that says
    // it froze the fork.
    let nodes = node
        .registration
        .cluster()
        .nodes()
        .await
        .map_err(ApiError::cluster_state)?;
    if !nodes
        .iter()
        .any(|n| n.node_id == req.fork.node_id && n.api_addr == req.source)
    {
        return Err(ApiError::bad_request(format!(
            "{} is not node {}'s address in the cluster",
            req.source, req.fork.node_id
        )));
    }
    let manager = &state.manager;
    let rootfs = manager.config().rootfs.clone();
    cache::same_raw_base(&rootfs, req.fork.files.raw_base_size, "the fork")
        .and_then(|()| {
            super::cpu::check_here(
                manager,
                &format!("the fork of sandbox {}", parent.id),
                parent.cpu_template.as_deref(),
            )
        })
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
    let timeout = Duration::from_secs(
        req.timeout_secs
            .clamp(1, manager.config().max_timeout.as_secs().max(1)),
    );
    let count = req.count;
    let child = Ask::sandbox(u64::from(parent.cpu_count), parent.memory_mb);
    let slots = manager
        .capacity()
        .reserve_for(
            child.times(u64::from(count)),
            &format!(
                "{count} {} of a fork on node {}",
                if count == 1 { "child" } else { "children" },
                req.fork.node_id
            ),
            Some(parent.team()),
        )
        .map_err(SandboxError::from)?;
    let source = PeerChunks {
        addr: req.source.clone(),
        prefix: format!("/internal/forks/{}/chunks", req.export),
        api_key: headers
            .get(crate::node::keys::HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned(),
        token: req.token.clone(),
    };
    let cache_dir = manager.config().cluster_cache_dir();
    let started = Instant::now();
    let fork = &req.fork;
    let results = manager
        .fork_copied(
            fork.parent.clone(),
            count,
            timeout,
            slots,
            async |dir: &Path| {
                let placed = place(&source, &cache_dir, fork, dir, &rootfs).await;
                tracing::info!(
                    "cluster: the files of fork {} of sandbox {} on node {}: {} in {} ms",
                    req.export,
                    fork.parent.id,
                    fork.node_id,
                    if placed.is_ok() {
                        "fetched"
                    } else {
                        "not fetched"
                    },
                    started.elapsed().as_millis()
                );
                placed.map_err(|e| SandboxError::Unavailable(e.to_string()))
            },
        )
        .await?;
    Ok(crate::http::api::fork_answer(results, None))
}

/// Copies the fork's files from `source`: the layers and memory files into
/// the cache (each layer naming the copy below it, the lowest this node's
/// `rootfs`), the state into `dir` naming the memory files' copies.
async fn place(
    source: &PeerChunks,
    cache_dir: &Path,
    fork: &ForkManifest,
    dir: &Path,
    rootfs: &Path,
) -> Result<CopiedFork, DurableError> {
    let state = dir.join("fork.state");
    let (sealed, mem) = fork
        .files
        .place_sealed(cache_dir, source, rootfs, &state)
        .await?;
    Ok(CopiedFork { state, mem, sealed })
}

//! A node of a cluster makes children of a fork frozen on another node
//! ([`super::fork_across`], asked through `POST /internal/forks`). It
//! admits or refuses them as it would a create of the caller's team,
//! fetches what it lacks of the fork's files from that node (shared files
//! into its `cluster-cache` by content, the state rewritten to name the
//! copies), gives each child a disk layer of its own over the sealed copy
//! and starts it; each child is claimed in etcd (the node's hooks) before
//! the answer leaves.

use std::path::Path;
use std::time::{Duration, Instant};

use sandfork_cluster::peer::PeerChunks;

use super::durable::DurableError;
use super::fork_across::ChildrenRequest;
use super::fork_files::ForkManifest;
use super::{Node, cache};
use crate::node::events::Denial;
use crate::node::sandbox::{CopiedFork, ForkResults, SandboxError};
use crate::node::tenants::Caller;

/// Why a node does not make children of another node's fork.
#[derive(Debug, thiserror::Error)]
pub enum ChildrenRefused {
    #[error("the fork's sandbox is not the caller's team's")]
    NotTheCallersTeam,
    /// The request names what this node does not take from it.
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Denied(#[from] Denial),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
}

impl Node {
    /// Makes `req.count` children of a fork frozen on another node, as
    /// `caller` (whose API key, `api_key`, fetches the fork's files there).
    pub async fn make_children(
        &self,
        caller: &Caller,
        api_key: &str,
        req: &ChildrenRequest,
    ) -> Result<ForkResults, ChildrenRefused> {
        let parent = &req.fork.parent;
        if !caller.admin && *caller.team != *parent.team() {
            return Err(ChildrenRefused::NotTheCallersTeam);
        }
        if !crate::node::ids::is_sandbox_id(&req.export) {
            return Err(ChildrenRefused::Invalid(
                "not a fork export's name".to_owned(),
            ));
        }
        // Files are fetched only from a node of the cluster, the one that
        // says it froze the fork.
        let nodes = self
            .registration
            .cluster()
            .nodes()
            .await
            .map_err(|e| Denial::ClusterState(e.to_string()))?;
        if !nodes
            .iter()
            .any(|n| n.node_id == req.fork.node_id && n.api_addr == req.source)
        {
            return Err(ChildrenRefused::Invalid(format!(
                "{} is not node {}'s address in the cluster",
                req.source, req.fork.node_id
            )));
        }
        let manager = &self.manager;
        let rootfs = manager.config().rootfs.clone();
        cache::same_raw_base(&rootfs, req.fork.files.raw_base_size, "the fork")
            .and_then(|()| {
                super::cpu::check_here(
                    manager,
                    &format!("the fork of sandbox {}", parent.id),
                    parent.cpu_template.as_deref(),
                )
            })
            .map_err(|e| Denial::Unavailable(e.to_string()))?;
        let timeout = Duration::from_secs(
            req.timeout_secs
                .clamp(1, manager.config().max_timeout.as_secs().max(1)),
        );
        let source = PeerChunks::new(
            req.source.clone(),
            format!("/internal/forks/{}/chunks", req.export),
            api_key.to_owned(),
            req.token.as_str().to_owned(),
            self.dialer.clone(),
        );
        let cache_dir = manager.config().cluster_cache_dir();
        let started = Instant::now();
        let fork = &req.fork;
        let results = manager
            .fork_copied(
                fork.parent.clone(),
                req.count,
                timeout,
                &fork.node_id,
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
        Ok(results)
    }
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

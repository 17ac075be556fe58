//! Forks of what is not running (E2B's RL RFC, infra #3424 and #3441): a
//! paused sandbox (`POST /sandboxes/{id}/fork` on a paused one) and a named
//! snapshot (`POST /snapshots/{id}/fork`), each into `count` new sandboxes in
//! one call, answered as a running sandbox's fork is (one result per child).
//!
//! A paused sandbox's memory is already in files (its last pause): the
//! children restore that snapshot, as its own resume would. Its root layer
//! is sealed here, on the host (no VMM holds it), and branched: the paused
//! sandbox goes on in a fresh top layer of its own and stays paused and
//! resumable; each child gets a top layer in its own directory. A snapshot's
//! fork is `count` creates from it under one capacity reservation (all or
//! none fit), started together.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use disk_layers::LayeredDisk;

use super::child::ChildGuest;
use super::live::{self, Phase};
use super::{CreateParams, Manager, ROOT_LAYER, SandboxError, adopted_record, io};
use crate::node::capacity::{Ask, Reservation};
use crate::node::ids;
use crate::node::launch::Guest;
use crate::node::net::SandboxNetwork;
use crate::node::store::{ForkedFrom, PausedSnapshot, SandboxRecord, VolumeMount};

/// One result per child, in order, as a running sandbox's fork answers.
pub type ForkResults = Vec<Result<SandboxRecord, SandboxError>>;

/// What a snapshot's children get besides its memory and disk.
#[derive(Debug, Clone, Default)]
pub struct SnapshotForkParams {
    pub timeout: Duration,
    pub metadata: BTreeMap<String, String>,
    /// The team the children belong to (None: the default team).
    pub team: Option<String>,
}

/// A child whose task ended without an answer (it panicked).
fn lost_child() -> SandboxError {
    SandboxError::Io {
        what: "starting a fork child".into(),
        source: std::io::Error::other("its task ended early"),
    }
}

/// Waits for every child task; each answers with its index.
async fn collect(
    mut tasks: tokio::task::JoinSet<(usize, Result<SandboxRecord, SandboxError>)>,
    count: usize,
) -> ForkResults {
    let mut results: Vec<Option<Result<SandboxRecord, SandboxError>>> =
        (0..count).map(|_| None).collect();
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok((index, r)) => results[index] = Some(r),
            Err(e) => tracing::error!("a fork child task failed: {e}"),
        }
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(lost_child())))
        .collect()
}

/// A fork frozen on another node, its files copied here: what its
/// children start from.
#[derive(Debug, Clone)]
pub struct CopiedFork {
    /// The fork's VMM state, naming the memory files' copies.
    pub state: PathBuf,
    /// The last memory file it maps.
    pub mem: PathBuf,
    /// The copy of the sealed root layer the children stack on (its chain
    /// copied below it).
    pub sealed: PathBuf,
}

impl Manager {
    /// `count` children of a fork frozen on another node, the parent's
    /// record `parent` as that node keeps it: `place` copies the fork's
    /// files, those the children share into the directory it is given (new,
    /// and named by every child's record), and says where they are. Each
    /// child gets a top layer of its own over the sealed copy, and starts
    /// from the copied state as a paused sandbox's child does; `slots` holds
    /// their capacity (one child's share each). One result per child.
    pub async fn fork_copied(
        self: &Arc<Self>,
        parent: SandboxRecord,
        count: u32,
        timeout: Duration,
        from_node: &str,
        place: impl AsyncFnOnce(&std::path::Path) -> Result<CopiedFork, SandboxError>,
    ) -> Result<ForkResults, SandboxError> {
        let team = parent.team().to_owned();
        let parent_id = parent.id.clone();
        let fork = async {
            let child = Ask::sandbox(u64::from(parent.cpu_count), parent.memory_mb);
            let slots = self.capacity.reserve_for(
                child.times(u64::from(count)),
                &format!(
                    "{count} {} of a fork on node {from_node}",
                    if count == 1 { "child" } else { "children" },
                ),
                Some(&team),
            )?;
            self.fork_copied_unannounced(parent, count, timeout, slots, place)
                .await
        };
        self.announced_fork(&team, &parent_id, fork, |results| results)
            .await
    }

    async fn fork_copied_unannounced(
        self: &Arc<Self>,
        parent: SandboxRecord,
        count: u32,
        timeout: Duration,
        mut slots: Reservation,
        place: impl AsyncFnOnce(&std::path::Path) -> Result<CopiedFork, SandboxError>,
    ) -> Result<ForkResults, SandboxError> {
        // Held to the end: the collector must not judge the fork's and the
        // children's new directories before their records name them.
        let _busy = self.activity.read().await;
        let fork_dir = self.new_fork_dir()?;
        let copied = match place(&fork_dir).await {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&fork_dir);
                return Err(e);
            }
        };
        // Nothing of the other node's paths: its directories, layers and
        // snapshots are not here.
        let parent = adopted_record(parent, &fork_dir, None);
        let child = Ask::sandbox(u64::from(parent.cpu_count), parent.memory_mb);
        let snapshot = PausedSnapshot {
            state: copied.state,
            mem: copied.mem,
        };
        let mut tasks = tokio::task::JoinSet::new();
        for index in 0..count as usize {
            let manager = self.clone();
            let (parent, snapshot, sealed) =
                (parent.clone(), snapshot.clone(), copied.sealed.clone());
            let hold = slots.split(child);
            tasks.spawn(async move {
                let r = async {
                    let child_id = ids::sandbox_id().map_err(io("generating a sandbox id"))?;
                    let dir = manager.sandbox_dir(&child_id);
                    std::fs::create_dir_all(&dir)
                        .map_err(io(format!("creating {}", dir.display())))?;
                    let top = dir.join(ROOT_LAYER);
                    let made = {
                        let top = top.clone();
                        tokio::task::spawn_blocking(move || {
                            LayeredDisk::create(&sealed, &top).map(drop)
                        })
                        .await
                    };
                    if let Err(e) = made
                        .map_err(SandboxError::from)
                        .and_then(|r| r.map_err(SandboxError::from))
                    {
                        let _ = std::fs::remove_dir_all(&dir);
                        return Err(e);
                    }
                    // Never volumes: a parent with volumes forks on its own node.
                    manager
                        .paused_child(
                            &parent,
                            &snapshot,
                            child_id,
                            top,
                            Vec::new(),
                            index,
                            timeout,
                            hold,
                        )
                        .await
                }
                .await;
                (index, r)
            });
        }
        let results = collect(tasks, count as usize).await;
        if results.iter().all(Result::is_err) {
            let _ = std::fs::remove_dir_all(&fork_dir);
        }
        Ok(results)
    }

    /// Forks the paused sandbox `id` into `count` new running sandboxes that
    /// continue from its paused memory and disk; it stays paused (and
    /// resumable, on a layer of its own). Each child gets its own access
    /// token, `timeout` and the parent's metadata and network policy. A
    /// sandbox paused without its memory is refused (409): there is no
    /// state to continue from but its disk.
    pub async fn fork_paused(
        self: &Arc<Self>,
        id: &str,
        count: u32,
        timeout: Duration,
    ) -> Result<ForkResults, SandboxError> {
        let team = self.get(id)?.team().to_owned();
        let fork = self.fork_paused_unannounced(id, count, timeout);
        self.announced_fork(&team, id, fork, |results| results)
            .await
    }

    async fn fork_paused_unannounced(
        self: &Arc<Self>,
        id: &str,
        count: u32,
        timeout: Duration,
    ) -> Result<ForkResults, SandboxError> {
        // Held to the end: the collector must not judge the children's new
        // directories before their records name them.
        let _busy = self.activity.read().await;
        let sandbox = self.sandbox(id)?;
        let Ok(guest) = sandbox.guest.try_lock() else {
            return Err(live::busy(id));
        };
        match sandbox.phase() {
            Phase::Paused => {}
            Phase::Running => {
                return Err(SandboxError::Conflict {
                    id: id.to_owned(),
                    state: "running (not paused)",
                });
            }
            other => return Err(other.refusal(id)),
        }
        let parent = self.get(id)?;
        // Its volumes move onto new layers, as its root disk does: no create
        // or delete of them meanwhile (a create would write the layer being
        // sealed).
        let _volumes = self
            .volume_changes_if(!parent.volume_mounts.is_empty())
            .await;
        let Some(snapshot) = parent.snapshot.clone() else {
            return Err(SandboxError::Conflict {
                id: id.to_owned(),
                state: "paused without its memory (resume it to fork it)",
            });
        };
        // Its children would restore the agent that did not answer.
        if parent.envd_unresponsive_at_pause {
            return Err(SandboxError::AgentUnresponsiveAtPause(id.to_owned()));
        }
        let child = Ask::sandbox(u64::from(parent.cpu_count), parent.memory_mb);
        let mut slots = self.capacity.reserve_for(
            child.times(u64::from(count)),
            &format!(
                "a fork of {count} {} of paused sandbox {id}",
                if count == 1 { "child" } else { "children" }
            ),
            Some(parent.team()),
        )?;

        // New ids and directories first; the seal last, so a failure before
        // it leaves the paused sandbox as it was.
        let mut children = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let child_id = ids::sandbox_id().map_err(io("generating a sandbox id"))?;
            children.push(child_id);
        }
        let dirs: Vec<PathBuf> = children.iter().map(|c| self.sandbox_dir(c)).collect();
        let remove_dirs = |dirs: &[PathBuf]| {
            for d in dirs {
                let _ = std::fs::remove_dir_all(d);
            }
        };
        for d in &dirs {
            if let Err(e) = std::fs::create_dir_all(d) {
                remove_dirs(&dirs);
                return Err(io(format!("creating {}", d.display()))(e));
            }
        }
        let sealed = self.root_layer(&parent);
        let layer_id = ids::sandbox_id().map_err(io("generating a layer name"))?;
        let own_dir = self.sandbox_dir(id);
        let own_top = own_dir.join(format!("root-{layer_id}.layer"));
        let tops: Vec<PathBuf> = dirs.iter().map(|d| d.join(ROOT_LAYER)).collect();
        // Each volume's layer is branched too: the paused sandbox's next one
        // in its own directory, a copy for each child in the child's.
        let branches: Vec<Branch> = parent
            .volume_mounts
            .iter()
            .map(|m| Branch {
                sealed: m.disk.clone(),
                own: own_dir.join(format!("vol{}-{layer_id}.layer", m.slot)),
                children: dirs
                    .iter()
                    .map(|d| d.join(format!("vol{}.layer", m.slot)))
                    .collect(),
            })
            .collect();
        let root = Branch {
            sealed: sealed.clone(),
            own: own_top.clone(),
            children: tops.clone(),
        };
        // The root first: a failure there leaves everything as it was.
        let branched = {
            let (root, branches) = (root, branches.clone());
            tokio::task::spawn_blocking(move || -> Result<usize, SandboxError> {
                root.seal()?;
                // The volumes sealed before one that failed: recorded below,
                // then the fork fails.
                let mut done = 0;
                for b in &branches {
                    if let Err(e) = b.seal() {
                        tracing::warn!("sealing {}: {e}", b.sealed.display());
                        break;
                    }
                    done += 1;
                }
                Ok(done)
            })
            .await
        };
        let volumes_sealed = match branched.map_err(SandboxError::from).and_then(|r| r) {
            Ok(n) => n,
            Err(e) => {
                remove_dirs(&dirs);
                return Err(e);
            }
        };
        let mounts: Vec<VolumeMount> = parent
            .volume_mounts
            .iter()
            .zip(&branches)
            .take(volumes_sealed)
            .map(|(m, b)| VolumeMount {
                disk: b.own.clone(),
                ..m.clone()
            })
            .chain(parent.volume_mounts.iter().skip(volumes_sealed).cloned())
            .collect();
        // Sealed: from here the paused sandbox must name its new layers, and
        // its directory (the sealed layers, its pause's memory) outlive it.
        let recorded = self
            .store
            .update_sandbox(id, |s| {
                s.root_layer = Some(own_top.clone());
                s.has_dependents = true;
                s.volume_mounts = mounts.clone();
            })
            .map_err(SandboxError::from)
            .and_then(|p| {
                // Each volume is on the paused sandbox's new layer now.
                self.volumes_moved(&mounts, &own_dir)?;
                Ok(p)
            });
        if volumes_sealed < branches.len() {
            remove_dirs(&dirs);
            return Err(SandboxError::Io {
                what: format!(
                    "sealing volume {}'s layer for a fork of paused sandbox {id} (see the \
                     node's log; the sandbox stays paused)",
                    parent.volume_mounts[volumes_sealed].volume_id
                ),
                source: std::io::Error::other("the seal failed"),
            });
        }
        let parent = match recorded {
            Ok(Some(p)) => p,
            Ok(None) => {
                remove_dirs(&dirs);
                return Err(SandboxError::NotFound(id.to_owned()));
            }
            Err(e) => {
                tracing::error!(
                    "sandbox {id}: its root layer {} is sealed but the record naming its new \
                     layer {} was not written: {e}",
                    sealed.display(),
                    own_top.display()
                );
                remove_dirs(&dirs);
                return Err(e);
            }
        };
        // The children start without the parent: it may resume meanwhile
        // (its pause files stay: a later pause stacks on them).
        drop(guest);

        let mut tasks = tokio::task::JoinSet::new();
        for (index, (child_id, top)) in children.into_iter().zip(tops).enumerate() {
            let manager = self.clone();
            let (parent, snapshot) = (parent.clone(), snapshot.clone());
            let hold = slots.split(child);
            // Its copies: not the volumes, which stay the paused sandbox's.
            let copies: Vec<VolumeMount> = parent
                .volume_mounts
                .iter()
                .zip(&branches)
                .map(|(m, b)| VolumeMount {
                    disk: b.children[index].clone(),
                    copy: true,
                    ..m.clone()
                })
                .collect();
            tasks.spawn(async move {
                let r = manager
                    .paused_child(
                        &parent, &snapshot, child_id, top, copies, index, timeout, hold,
                    )
                    .await;
                (index, r)
            });
        }
        Ok(collect(tasks, count as usize).await)
    }

    /// Starts one child of a paused sandbox from its pause snapshot, on the
    /// child's own top layer (already made, in its directory) and with
    /// `volume_mounts`, its copies of the parent's volumes.
    #[allow(clippy::too_many_arguments, reason = "one child's parts, each once")]
    async fn paused_child(
        &self,
        parent: &SandboxRecord,
        snapshot: &PausedSnapshot,
        id: String,
        root: PathBuf,
        volume_mounts: Vec<VolumeMount>,
        branch: usize,
        timeout: Duration,
        hold: Reservation,
    ) -> Result<SandboxRecord, SandboxError> {
        let from = ChildGuest {
            guest: Guest::Restore(self.restore_onto(
                &snapshot.state,
                &snapshot.mem,
                &root,
                None,
                &volume_mounts,
            )),
            root_layer: None,
            vmm: None,
            volume_mounts,
            branch: u32::try_from(branch).unwrap_or(u32::MAX),
        };
        let dir = self.sandbox_dir(&id);
        let (record, _) = self
            .start_child(parent, &id, &dir, from, timeout, hold)
            .await?;
        Ok(record)
    }

    /// `count` new sandboxes from the snapshot `id_or_name` (an id or a
    /// name, E2B's `:default` tag allowed), started together under one
    /// reservation: all fit or none start. Each is a create from the
    /// snapshot with `params`' timeout and metadata and the network its
    /// source had when the snapshot was taken (rules and policy, a traffic
    /// token of its own when private), as a running sandbox's children do.
    pub async fn fork_snapshot(
        self: &Arc<Self>,
        id_or_name: &str,
        count: u32,
        params: SnapshotForkParams,
    ) -> Result<ForkResults, SandboxError> {
        let team = crate::node::tenants::team_or_default(params.team.as_deref()).to_owned();
        // Its children name the snapshot, by id when it resolves.
        let snapshot = self
            .resolve_template(id_or_name)
            .map_or_else(|_| id_or_name.to_owned(), |t| t.id);
        let fork = self.fork_snapshot_unannounced(id_or_name, count, params);
        self.announced_fork(&team, &snapshot, fork, |results| results)
            .await
    }

    async fn fork_snapshot_unannounced(
        self: &Arc<Self>,
        id_or_name: &str,
        count: u32,
        params: SnapshotForkParams,
    ) -> Result<ForkResults, SandboxError> {
        let _busy = self.activity.read().await;
        let (template, _pin) = self.pin_template(id_or_name)?;
        if !template.is_snapshot() {
            return Err(SandboxError::TemplateNotFound(format!(
                "snapshot {id_or_name}"
            )));
        }
        if template.filesystem_only {
            return Err(SandboxError::Invalid(format!(
                "snapshot {} is filesystem-only: a fork restores memory, and it has none to \
                 restore (create sandboxes from it instead: each cold-boots on its disk)",
                template.id
            )));
        }
        let child = Ask::sandbox(u64::from(template.vcpus), template.mem_mib);
        let mut slots = self.capacity.reserve_for(
            child.times(u64::from(count)),
            &format!(
                "a fork of {count} {} of snapshot {}",
                if count == 1 { "child" } else { "children" },
                template.id
            ),
            Some(crate::node::tenants::team_or_default(
                params.team.as_deref(),
            )),
        )?;
        // Each child stacks a copy on the snapshot's sealed volume layers:
        // no delete of those volumes until every child's record names its
        // copies (a deleted snapshot no longer keeps them).
        let _volumes = self
            .volume_changes_if(!template.volume_mounts.is_empty())
            .await;
        let template = Arc::new(template);
        let mut tasks = tokio::task::JoinSet::new();
        for index in 0..count as usize {
            let manager = self.clone();
            let template = template.clone();
            let (timeout, metadata, team) =
                (params.timeout, params.metadata.clone(), params.team.clone());
            let hold = slots.split(child);
            tasks.spawn(async move {
                let r = async {
                    let network = match &template.source_network {
                        Some(n) => SandboxNetwork {
                            ingress: n
                                .ingress
                                .for_child()
                                .map_err(io("generating a traffic access token"))?,
                            slot: None,
                            ..n.clone()
                        },
                        // Taken before snapshots kept their source's network.
                        None => SandboxNetwork::default(),
                    };
                    let create = CreateParams {
                        template_id: template.id.clone(),
                        timeout,
                        metadata,
                        // As E2B's v2 creates: an envd access token for each.
                        secure: true,
                        auto_pause_memory: true,
                        network,
                        team,
                        forked_from: Some(ForkedFrom {
                            parent_id: template.id.clone(),
                            branch: u32::try_from(index).unwrap_or(u32::MAX),
                        }),
                        ..CreateParams::default()
                    };
                    let id = ids::sandbox_id().map_err(io("generating a sandbox id"))?;
                    let r = manager
                        .create_inner(&id, &template, create, &[], hold)
                        .await;
                    if r.is_err() {
                        let _ = std::fs::remove_dir_all(manager.sandbox_dir(&id));
                    }
                    r
                }
                .await;
                (index, r)
            });
        }
        // The pin is held until every child's record names the snapshot.
        Ok(collect(tasks, count as usize).await)
    }
}

/// A layer sealed under new writable ones: `own` for the disk's owner,
/// one per child.
#[derive(Debug, Clone)]
struct Branch {
    sealed: PathBuf,
    own: PathBuf,
    children: Vec<PathBuf>,
}

impl Branch {
    fn seal(&self) -> Result<(), SandboxError> {
        LayeredDisk::open(&self.sealed)?
            .seal_and_branch(&self.own, &self.children)
            .map(drop)?;
        Ok(())
    }
}

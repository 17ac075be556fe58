//! Forks (`POST /sandboxes/{id}/fork`): a running sandbox's memory frozen
//! once and shared copy-on-write, its root disk sealed and branched, one new
//! sandbox per child.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_api::ForkInfo;
use vmm_driver::process::{ProcessError, Restore};

use super::child::ChildGuest;
use super::live::{self, Phase, Sandbox};
use super::{Manager, SandboxError, io};
use crate::node::capacity::{Ask, Reservation};
use crate::node::ids;
use crate::node::launch::{Guest, LaunchTimes, Launched, Taken};
use crate::node::store::{SandboxRecord, VolumeMount};
use crate::node::volume;

/// The layer a fork answer says drive `drive` of the forked VM writes to now.
pub(super) fn new_layer(info: &ForkInfo, drive: &str) -> Result<PathBuf, SandboxError> {
    info.parent
        .iter()
        .find(|d| d.drive_id == drive)
        .map(|d| PathBuf::from(&d.path_on_host))
        .ok_or_else(|| {
            SandboxError::Invalid(format!(
                "the VMM's fork answer names no new layer for drive {drive}"
            ))
        })
}

/// What a fork made.
#[derive(Debug)]
pub struct Forked {
    /// One result per child, in order.
    pub children: Vec<Result<SandboxRecord, SandboxError>>,
    /// Where the fork's time went (the parent's pause among it).
    pub times: ForkTimes,
}

/// Where one fork's time went, each step measured where it runs. The
/// node's steps follow each other: `admitted`, `vmms_taken`, `fork_call`,
/// `recorded` and `children` add up to `total` (but for the bookkeeping
/// between them).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ForkTimes {
    /// Children made on this node.
    pub children_here: u32,
    /// Waiting for the node's locks, room reserved, the fork's directory
    /// made.
    pub admitted: Duration,
    /// The children's VMMs taken from the pool (or started), while the
    /// parent still runs.
    pub vmms_taken: Duration,
    /// The parent's VMM's `PUT /fork`, as the node waited for it.
    pub fork_call: Duration,
    /// How long the parent stood still in it (the VMM's measure).
    pub parent_paused: Duration,
    /// The VMM's own steps: before the freeze, while the parent stood
    /// still, after it ran again (None from a VMM that does not report
    /// them).
    pub vmm: Option<vmm_api::ForkPhases>,
    /// The parent's new layers recorded.
    pub recorded: Duration,
    /// From then until the last child (here or elsewhere) was ready.
    pub children: Duration,
    /// From the fork's start until the last child was ready.
    pub total: Duration,
    /// Per child started here, in no order: its launch's steps, and when
    /// it was ready counted from the start of `children`.
    pub per_child: Vec<(LaunchTimes, Duration)>,
}

impl ForkTimes {
    /// The node's steps and the VMM's, by name, for the metrics.
    pub fn steps(&self) -> Vec<(&'static str, Duration)> {
        let mut steps = vec![
            ("admitted", self.admitted),
            ("vmms_taken", self.vmms_taken),
            ("fork_call", self.fork_call),
            ("parent_paused", self.parent_paused),
            ("recorded", self.recorded),
            ("children", self.children),
            ("total", self.total),
        ];
        if let Some(v) = &self.vmm {
            let us = Duration::from_micros;
            steps.extend([
                ("vmm_disks_prepared", us(v.disks_prepared_us)),
                ("vmm_freeze", us(v.freeze_us)),
                ("vmm_state_saved", us(v.state_saved_us)),
                ("vmm_memory", us(v.memory_us)),
                ("vmm_disks", us(v.disks_us)),
                ("vmm_resume", us(v.resume_us)),
                ("vmm_children_disks", us(v.children_disks_us)),
                ("vmm_state_written", us(v.state_written_us)),
            ]);
        }
        steps
    }

    /// Each child's steps, by name, for the metrics.
    pub fn child_steps(&self) -> impl Iterator<Item = (&'static str, Duration)> + '_ {
        self.per_child.iter().flat_map(|(t, ready_at)| {
            [
                ("child_confined", t.confined),
                ("child_loaded", t.loaded),
                ("child_agent_ready", t.ready),
                ("child_recorded", t.recorded),
                ("child_ready_at", *ready_at),
            ]
        })
    }
}

/// A fork frozen on this node, as another node needs it to make children of
/// its own (see the server's `crate::cluster::fork_across`).
#[derive(Debug, Clone)]
pub struct Frozen {
    /// The parent's record after the fork.
    pub parent: SandboxRecord,
    /// The fork's VMM state.
    pub state: PathBuf,
    /// The memory files the state maps, base first, with the ranges it reads.
    pub memory: Vec<vmm_driver::snapshot_state::MemoryLayer>,
    /// The sealed root layer every child stacks on, then the layers below
    /// it (the raw image at the bottom is not among them: `raw_base`).
    pub disk: Vec<PathBuf>,
    pub raw_base: Option<(PathBuf, u64)>,
}

/// Whether a fork's (or a snapshot's) failure leaves the parent's VMM in
/// doubt: only a request never sent, or one the VMM refused (a 4xx: its
/// memory and disks did not move onto the new files), leaves it as it
/// was.
pub(super) fn parent_unknown_after(e: &SandboxError) -> bool {
    use vmm_driver::ClientError;
    !matches!(
        e,
        SandboxError::Vmm(ProcessError::Api(ClientError::InvalidRequest(_)))
            | SandboxError::Vmm(ProcessError::Api(ClientError::Api {
                status: 400..=499,
                ..
            }))
    )
}

impl Manager {
    /// Stops sandbox `id`, whose `what` (a fork, a snapshot) failed inside
    /// its VMM after its disk or memory may have moved onto the files that
    /// are about to be removed: the error that says so.
    pub(super) async fn stop_in_doubt(
        &self,
        id: &str,
        sandbox: &Arc<Sandbox>,
        guest: tokio::sync::MutexGuard<'_, Option<Launched>>,
        what: &str,
        e: SandboxError,
    ) -> SandboxError {
        tracing::error!("sandbox {id}: its {what} failed inside its VMM ({e}): stopped");
        let stopped = self.remove(id, Some(sandbox), Some(guest)).await;
        SandboxError::Unavailable(format!(
            "{e}; the sandbox was stopped (its disk and memory are in doubt){}",
            stopped.err().map(|s| format!(": {s}")).unwrap_or_default()
        ))
    }

    /// A new directory for a fork's files (frozen memory, state, every new
    /// root layer): they are shared by parent and children, so they live
    /// outside any one sandbox's directory.
    pub(super) fn new_fork_dir(&self) -> Result<PathBuf, SandboxError> {
        let dir = self
            .config
            .data_dir
            .join("forks")
            .join(ids::sandbox_id().map_err(io("generating a fork id"))?);
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        Ok(dir)
    }

    /// Forks a running sandbox into `count` new ones that continue from its
    /// current memory and disk (sandfork's `PUT /fork`: memory frozen once
    /// and shared copy-on-write, the disk sealed and branched). The parent
    /// runs on. Each child gets its own access token, `timeout` and the
    /// parent's metadata; one result per child.
    pub async fn fork(
        self: &Arc<Self>,
        id: &str,
        count: u32,
        timeout: Duration,
    ) -> Result<Forked, SandboxError> {
        let alone = None::<fn(Result<Frozen, SandboxError>, u32) -> std::future::Ready<()>>;
        Ok(self.fork_spread(id, count, timeout, alone).await?.0)
    }

    /// [`Manager::fork`], where the children that do not fit on this node
    /// (when `elsewhere` is given) are made by `elsewhere` from the frozen
    /// fork: it is called with the fork (or why its files could not be
    /// listed) and how many children it is to make, while this node's
    /// children start, and its answer returned beside theirs (None when all
    /// fit here, and it is not called). Without `elsewhere`, all children
    /// fit here or none is made.
    pub async fn fork_spread<R>(
        self: &Arc<Self>,
        id: &str,
        count: u32,
        timeout: Duration,
        elsewhere: Option<impl AsyncFnOnce(Result<Frozen, SandboxError>, u32) -> R>,
    ) -> Result<(Forked, Option<R>), SandboxError> {
        let team = self.get(id)?.team().to_owned();
        // Children made elsewhere are told of there.
        let fork = self.fork_spread_unannounced(id, count, timeout, elsewhere);
        self.announced_fork(&team, id, fork, |(forked, _)| &mut forked.children)
            .await
    }

    async fn fork_spread_unannounced<R>(
        self: &Arc<Self>,
        id: &str,
        count: u32,
        timeout: Duration,
        elsewhere: Option<impl AsyncFnOnce(Result<Frozen, SandboxError>, u32) -> R>,
    ) -> Result<(Forked, Option<R>), SandboxError> {
        let t0 = Instant::now();
        let _busy = self.activity.read().await;
        let sandbox = self.sandbox(id)?;
        let Ok(guest) = sandbox.guest.try_lock() else {
            return Err(live::busy(id));
        };
        if sandbox.phase() != Phase::Running {
            return Err(sandbox.phase().refusal(id));
        }
        let parent = self.get(id)?;
        // A fork moves the parent's volumes onto new layers: no create or
        // delete of them meanwhile. Their children's copies stack on the
        // volumes' files, which are this node's: all are made here.
        let _volumes = self
            .volume_changes_if(!parent.volume_mounts.is_empty())
            .await;
        let elsewhere = elsewhere.filter(|_| parent.volume_mounts.is_empty());
        // All children or none on one node: they come from one freeze of
        // the parent, and a caller asking for N should not get fewer that
        // happened to fit. In a cluster, those that do not fit go to other
        // nodes. Disk: the frozen memory, and room for a pause as a create
        // checks (the children share the frozen memory; their pauses later
        // write what each changed, as any sandbox's do).
        let child = Ask::sandbox(u64::from(parent.cpu_count), parent.memory_mb);
        let reserve = |n: u32| {
            self.capacity.reserve_for(
                Ask {
                    disk_mib: parent.memory_mb.saturating_mul(2),
                    ..child.times(u64::from(n))
                },
                &format!(
                    "a fork of {n} {}",
                    if n == 1 { "child" } else { "children" }
                ),
                Some(parent.team()),
            )
        };
        let (mut slots, local) = match reserve(count) {
            Ok(slots) => (slots, count),
            Err(all) if elsewhere.is_some() => {
                let mut fitted = None;
                for n in (0..count).rev() {
                    if let Ok(slots) = reserve(n) {
                        fitted = Some((slots, n));
                        break;
                    }
                }
                fitted.ok_or(all)?
            }
            Err(all) => return Err(all.into()),
        };
        let elsewhere = elsewhere.filter(|_| local < count);
        let child = Ask {
            disk_mib: 0,
            ..child
        };
        let Some(launched) = guest.as_ref() else {
            return Err(Phase::Gone.refusal(id));
        };
        // The layer the fork seals (the parent's writable one until now).
        let sealed = self.root_layer(&parent);
        let fork_dir = self.new_fork_dir()?;
        // Every child's VMM first, from the pool or started in parallel,
        // while the parent runs on: it then stops only for the freeze, and
        // the children load the frozen state at once.
        let started = Instant::now();
        let mut times = ForkTimes {
            children_here: local,
            admitted: started - t0,
            ..ForkTimes::default()
        };
        let vmms = self
            .pool
            .take_many(local as usize, &parent.network.policy)
            .await;
        times.vmms_taken = started.elapsed();
        sandbox.set_phase(Phase::Forking)?;
        // The VMM makes at least one child's layer: with none here, one
        // unused (removed below).
        let call = Instant::now();
        let forked = launched.vm.fork(&fork_dir, local.max(1)).await;
        times.fork_call = call.elapsed();
        let recording = Instant::now();
        if forked.is_ok() {
            crate::node::crash::point("fork.frozen");
        }
        sandbox.set_phase(Phase::Running)?;
        let recorded = forked.map_err(SandboxError::from).and_then(|info| {
            // The parent now writes to its new layer and its old one is
            // sealed under every child: its directory must outlive it.
            let parent_root = new_layer(&info, &self.template.root_drive_id)?;
            // Its volumes too: each volume is on the parent's new layer
            // from now on (the children's are copies).
            let mounts = parent
                .volume_mounts
                .iter()
                .map(|m| {
                    let disk = new_layer(&info, &volume::slot_drive(m.slot))?;
                    Ok(VolumeMount { disk, ..m.clone() })
                })
                .collect::<Result<Vec<_>, SandboxError>>()?;
            let parent = self
                .store
                .update_sandbox(id, |s| {
                    s.root_layer = Some(parent_root);
                    s.has_dependents = true;
                    s.uses_dirs.push(fork_dir.clone());
                    s.volume_mounts = mounts.clone();
                })?
                .ok_or_else(|| SandboxError::NotFound(id.to_owned()))?;
            self.volumes_moved(&mounts, &fork_dir)?;
            Ok((info, parent))
        });
        let (info, parent) = match recorded {
            Ok(r) => r,
            Err(e) => {
                // A VMM that failed inside the fork (or answered what was
                // not asked) may have moved the parent onto files in the
                // fork's directory, which goes now: the node cannot vouch
                // for the parent's disk or memory, so it is stopped.
                let e = if parent_unknown_after(&e) {
                    self.stop_in_doubt(id, &sandbox, guest, "fork", e).await
                } else {
                    e
                };
                let _ = std::fs::remove_dir_all(&fork_dir);
                // Stopping VMMs blocks: off the async threads.
                let _ = tokio::task::spawn_blocking(move || drop(vmms)).await;
                return Err(e);
            }
        };
        if local == 0 {
            for drive in info.children.iter().flatten() {
                let _ = std::fs::remove_file(&drive.path_on_host);
            }
        }
        times.parent_paused = Duration::from_micros(info.paused_us);
        times.vmm = info.phases;
        times.recorded = recording.elapsed();
        tracing::info!(
            "sandbox {id}: forked into {local} here{}: the parent was paused {:.1} ms; the \
             children's VMMs were ready after {} ms",
            if local < count {
                format!(" and {} elsewhere", count - local)
            } else {
                String::new()
            },
            times.parent_paused.as_secs_f64() * 1000.0,
            times.vmms_taken.as_millis()
        );
        // The children start without the parent: it may change meanwhile.
        drop(guest);
        if let Some(why) = &info.children_failed {
            // The parent forked and runs on its new layers (recorded
            // above), but the VMM could not make the children's layers or
            // state after it resumed, and removed what it had made of them:
            // no child can start. Their VMMs and room go back.
            let failed = || {
                SandboxError::Unavailable(format!(
                    "the fork's children could not be made (the parent runs on): {why}"
                ))
            };
            tracing::error!("sandbox {id}: {}", failed());
            drop(slots);
            // Stopping VMMs blocks: off the async threads.
            let _ = tokio::task::spawn_blocking(move || drop(vmms)).await;
            let remote = match elsewhere {
                Some(elsewhere) => Some(elsewhere(Err(failed()), count - local).await),
                None => None,
            };
            times.total = t0.elapsed();
            let children = (0..local).map(|_| Err(failed())).collect();
            return Ok((Forked { children, times }, remote));
        }
        let children_start = Instant::now();

        let remote = async {
            let elsewhere = elsewhere?;
            Some(elsewhere(frozen(&info, &parent, &sealed).await, count - local).await)
        };
        let mut results: Vec<Option<Result<SandboxRecord, SandboxError>>> =
            (0..local).map(|_| None).collect();
        let mut tasks = tokio::task::JoinSet::new();
        for (index, vmm) in vmms.into_iter().enumerate() {
            let slot = slots.split(child);
            let vmm = match vmm {
                Ok(vmm) => vmm,
                Err(e) => {
                    results[index] = Some(Err(e.into()));
                    continue;
                }
            };
            let manager = self.clone();
            let (info, parent) = (info.clone(), parent.clone());
            tasks.spawn(async move {
                let r = manager
                    .fork_child(&parent, &info, index, timeout, slot, vmm)
                    .await;
                (index, r, children_start.elapsed())
            });
        }
        let per_child = &mut times.per_child;
        let here = async {
            while let Some(done) = tasks.join_next().await {
                match done {
                    Ok((index, r, ready_at)) => {
                        results[index] = Some(r.map(|(record, launch)| {
                            per_child.push((launch, ready_at));
                            record
                        }))
                    }
                    Err(e) => tracing::error!("a fork child task failed: {e}"),
                }
            }
        };
        let ((), remote) = tokio::join!(here, remote);
        times.children = children_start.elapsed();
        times.total = t0.elapsed();
        tracing::info!(
            "sandbox {id}: fork of {count}: {}",
            times
                .steps()
                .iter()
                .map(|(step, took)| format!("{step} {:.1} ms", took.as_secs_f64() * 1e3))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for (step, took) in times.steps().into_iter().chain(times.child_steps()) {
            self.metrics.fork_phase(step, took);
        }
        let children = results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(SandboxError::Io {
                        what: "starting a fork child".into(),
                        source: std::io::Error::other("its task ended early"),
                    })
                })
            })
            .collect();
        Ok((Forked { children, times }, remote))
    }

    async fn fork_child(
        &self,
        parent: &SandboxRecord,
        info: &ForkInfo,
        index: usize,
        timeout: Duration,
        hold: Reservation,
        vmm: Taken,
    ) -> Result<(SandboxRecord, LaunchTimes), SandboxError> {
        let restore = Restore::fork_child(info, index).ok_or_else(|| {
            SandboxError::Invalid(format!("the VMM's fork answer has no child {index}"))
        })?;
        // Its volumes' copies: the layers the VMM made for their slots.
        let volume_mounts = parent
            .volume_mounts
            .iter()
            .map(|m| {
                let slot = volume::slot_drive(m.slot);
                let disk = restore
                    .drives
                    .iter()
                    .find(|d| d.drive_id == slot)
                    .map(|d| PathBuf::from(&d.path_on_host))
                    .ok_or_else(|| {
                        SandboxError::Invalid(format!(
                            "the VMM's fork answer names no layer of child {index} for {slot}"
                        ))
                    })?;
                Ok(VolumeMount {
                    disk,
                    copy: true,
                    ..m.clone()
                })
            })
            .collect::<Result<Vec<_>, SandboxError>>()?;
        // Its read-only slots are not in the answer (a fork branches only
        // writable disks).
        let restore = self.with_slots(restore, &[]);
        let id = ids::sandbox_id().map_err(io("generating a sandbox id"))?;
        let dir = self.sandbox_dir(&id);
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        // The VMM made the child's layer beside the fork's memory.
        let root_layer = restore
            .drives
            .iter()
            .find(|d| d.drive_id == self.template.root_drive_id)
            .map(|d| PathBuf::from(&d.path_on_host));
        let from = ChildGuest {
            guest: Guest::Restore(restore),
            root_layer,
            vmm: Some(vmm),
            volume_mounts,
            branch: u32::try_from(index).unwrap_or(u32::MAX),
        };
        self.start_child(parent, &id, &dir, from, timeout, hold)
            .await
    }
}

/// What another node needs of the fork `info` of `parent`, whose sealed
/// root layer is `sealed`.
async fn frozen(
    info: &ForkInfo,
    parent: &SandboxRecord,
    sealed: &std::path::Path,
) -> Result<Frozen, SandboxError> {
    let state = PathBuf::from(&info.snapshot_path);
    let (parent, sealed) = (parent.clone(), sealed.to_owned());
    tokio::task::spawn_blocking(move || {
        let memory = vmm_driver::snapshot_state::memory_layers(&state)
            .map_err(|e| SandboxError::Unavailable(e.to_string()))?;
        let (disk, raw_base) = super::moved::disk_files(&sealed)?;
        Ok(Frozen {
            parent,
            state,
            memory,
            disk,
            raw_base,
        })
    })
    .await?
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use vmm_driver::ClientError;
    use vmm_driver::process::ProcessError;

    use super::{SandboxError, parent_unknown_after};

    /// Only a fork the VMM refused, or never got, leaves the parent as it
    /// was; an internal failure, a lost answer or an answer naming what was
    /// not asked puts it in doubt.
    #[test]
    fn a_fork_failed_inside_the_vmm_puts_the_parent_in_doubt() {
        let api = |status| {
            SandboxError::Vmm(ProcessError::Api(ClientError::Api {
                status,
                fault_message: "no".into(),
            }))
        };
        assert!(!parent_unknown_after(&api(400)));
        assert!(!parent_unknown_after(&SandboxError::Vmm(
            ProcessError::Api(ClientError::InvalidRequest("bad id".into()))
        )));
        assert!(parent_unknown_after(&api(500)));
        assert!(parent_unknown_after(&SandboxError::Vmm(
            ProcessError::NotAsked {
                path: PathBuf::from("/elsewhere/layer")
            }
        )));
        assert!(parent_unknown_after(&SandboxError::Vmm(ProcessError::Api(
            ClientError::NoAnswer {
                path: PathBuf::from("api.sock"),
                method: vmm_driver::Method::PUT,
                route: "/fork".into(),
                waited: std::time::Duration::from_secs(60),
            }
        ))));
        assert!(parent_unknown_after(&SandboxError::NotFound("x".into())));
    }
}

//! Snapshots (E2B's `POST /sandboxes/{id}/snapshots`): a running sandbox's
//! memory and root disk captured as a template that new sandboxes restore,
//! while the sandbox runs on; listing them and deleting them.
//!
//! A snapshot is taken with the VMM's fork (one child, never started): the
//! guest stops only while its memory is frozen and its root layer sealed,
//! then runs on a new layer. The snapshot's state and memory go in
//! `templates/<id>/`; its disk is the source's sealed layer, left where it
//! was (the source's directory outlives the source). Its memory may stack on
//! earlier files (the template's, the source's pauses, earlier snapshots), so
//! every sandbox and snapshot records the snapshots it stacks on
//! (`uses_snapshots`) and a snapshot in use is never deleted.
//!
//! A filesystem-only snapshot (E2B's `memory: false`) is taken the same way
//! once the guest has written back its page cache; its sandboxes cold-boot
//! on its disk ([`TemplateRecord::filesystem_only`]).
//!
//! Volumes: the VMM's fork seals every writable drive, the volumes' slots
//! too, so a memory snapshot keeps each mounted volume's sealed layer
//! ([`TemplateRecord::volume_mounts`]); the source's mounts (and the
//! volumes' records) move to its new layers, as a fork's parent's do, and
//! each sandbox made from the snapshot stacks its own copy on the sealed
//! layers. A filesystem-only snapshot of a sandbox with mounts is refused:
//! its sandboxes cold-boot, and a cold boot attaches no volume yet.

use std::collections::HashMap;

use vmm_api::ForkParams;

use super::live::{self, Phase};
use super::{Manager, SandboxError, io, sync_files};
use crate::node::capacity::Ask;
use crate::node::clock::now_ms;
use crate::node::ids;
use crate::node::store::{BuildStatus, SandboxState, TemplateRecord, VolumeMount};
use crate::node::volume;

const STATE: &str = "vm.state";
const MEM: &str = "vm.mem";
/// A snapshot's source's next root layer is in `<its dir>/snap-<snapshot id>`.
const DISK_DIR_PREFIX: &str = "snap-";
/// Longest snapshot name.
const MAX_NAME: usize = 128;

/// What a snapshot asks for (already parsed by the API).
#[derive(Debug, Clone, Default)]
pub struct SnapshotParams {
    pub name: Option<String>,
    /// The snapshot's id, when the caller chose it (a template build).
    pub id: Option<String>,
    /// E2B's `memory: false`: its sandboxes cold-boot on its disk.
    pub filesystem_only: bool,
}

/// `mounts` moved onto the new layers `layer_of` their slot names (after
/// the VMM branched them).
fn moved_mounts(
    mounts: &[VolumeMount],
    layer_of: impl Fn(usize) -> Result<std::path::PathBuf, SandboxError>,
) -> Result<Vec<VolumeMount>, SandboxError> {
    mounts
        .iter()
        .map(|m| {
            Ok(VolumeMount {
                disk: layer_of(m.slot)?,
                ..m.clone()
            })
        })
        .collect()
}

/// Names: letters, digits and `._-/`, so they fit in a URL path segment.
fn check_name(name: &str) -> Result<(), SandboxError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-/".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(SandboxError::Invalid(format!(
            "snapshot name {name:?} must be 1 to {MAX_NAME} letters, digits, '.', '_', '-' or '/'"
        )))
    }
}

/// A template a create is restoring; unpinned on drop.
pub(super) struct Pin<'a> {
    manager: &'a Manager,
    id: String,
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        let mut pins = self.manager.pins.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = pins.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                pins.remove(&self.id);
            }
        }
    }
}

impl Manager {
    /// The template (base or snapshot) named by `id_or_name`: an id, a
    /// snapshot's name, either with E2B's `:default` tag; or
    /// `<name or id>:<buildID>`, the template one build of it made (E2B
    /// creates by build id: Harbor does).
    pub fn resolve_template(&self, id_or_name: &str) -> Result<TemplateRecord, SandboxError> {
        let wanted = ids::without_default_tag(id_or_name);
        if wanted == self.template.id {
            return Ok(self.template.clone());
        }
        if let Some(t) = self.store.template(wanted)? {
            return Ok(t);
        }
        if let Some(t) = self
            .store
            .templates()?
            .into_iter()
            .find(|t| t.names.iter().any(|n| n == wanted))
        {
            return Ok(t);
        }
        // Tags are never UUIDs (E2B's rule), so a name is tried first.
        match wanted.rsplit_once(':') {
            Some((name, build_id)) => self.template_of_build(name, build_id, id_or_name),
            None => Err(SandboxError::TemplateNotFound(id_or_name.to_owned())),
        }
    }

    /// The template build `build_id` of the template `name` (an alias, the
    /// E2B template id or the build's own id) made; a build that made none
    /// (yet) is a 404 that says why, in E2B's words while it is not ready
    /// (clients wait on them).
    fn template_of_build(
        &self,
        name: &str,
        build_id: &str,
        asked: &str,
    ) -> Result<TemplateRecord, SandboxError> {
        let build = self.store.builds()?.into_iter().find(|b| {
            b.build_id == build_id
                && (b.name == name
                    || b.template_id == name
                    || b.e2b.as_ref().is_some_and(|e| e.template_id == name))
        });
        let Some(b) = build else {
            return Err(SandboxError::TemplateNotFound(asked.to_owned()));
        };
        let why = match b.status {
            BuildStatus::Ready => match self.store.template(&b.template_id)? {
                Some(t) => return Ok(t),
                None => format!(
                    "build {build_id} of template {name} was deleted{}",
                    b.reason.map(|r| format!(": {r}")).unwrap_or_default()
                ),
            },
            BuildStatus::Waiting | BuildStatus::Building => format!(
                "tag '{build_id}' does not exist for template '{name}' (its build is {}, not \
                 ready yet)",
                b.status.as_str()
            ),
            BuildStatus::Error => format!(
                "build {build_id} of template {name} failed: {}",
                b.reason.unwrap_or_default()
            ),
        };
        Err(SandboxError::BuildNotReady(why))
    }

    /// Resolves a template and keeps it from deletion until the pin drops.
    pub(super) fn pin_template(
        &self,
        id_or_name: &str,
    ) -> Result<(TemplateRecord, Pin<'_>), SandboxError> {
        let mut pins = self.pins.lock().unwrap_or_else(|p| p.into_inner());
        let template = self.resolve_template(id_or_name)?;
        *pins.entry(template.id.clone()).or_default() += 1;
        let pin = Pin {
            manager: self,
            id: template.id.clone(),
        };
        Ok((template, pin))
    }

    /// The snapshot whose taking moved sandbox `id`'s disk to `layer`, if
    /// one did (the layer is in that snapshot's directory of `id`'s).
    pub(super) fn snapshot_of_layer(&self, id: &str, layer: &std::path::Path) -> Option<String> {
        let dir = layer.parent()?;
        if dir.parent()? != self.sandbox_dir(id) {
            return None;
        }
        let name = dir.file_name()?.to_str()?;
        name.strip_prefix(DISK_DIR_PREFIX).map(str::to_owned)
    }

    /// Snapshots a running sandbox, which runs on; returns the new template.
    pub async fn snapshot(
        &self,
        id: &str,
        params: SnapshotParams,
    ) -> Result<TemplateRecord, SandboxError> {
        let _busy = self.activity.read().await;
        let source = self.get(id)?;
        if let Some(name) = &params.name {
            check_name(name)?;
            if self.resolve_template(name).is_ok() {
                return Err(SandboxError::NameTaken(name.clone()));
            }
        }
        if source.state != SandboxState::Running {
            return Err(SandboxError::Conflict {
                id: id.to_owned(),
                state: "paused",
            });
        }
        if params.filesystem_only {
            Manager::refuse_mounted(
                &source,
                "mounting volumes: a filesystem-only snapshot (memory: false) does not keep \
                 volumes yet (its sandboxes cold-boot, and a cold boot attaches no volume); \
                 take a memory snapshot",
            )?;
        }
        let sandbox = self.sandbox(id)?;
        let Ok(guest) = sandbox.guest.try_lock() else {
            return Err(live::busy(id));
        };
        if sandbox.phase() != Phase::Running {
            return Err(sandbox.phase().refusal(id));
        }
        // The snapshot seals the volumes' layers and moves the source's
        // onto new ones (as a fork does): no create, mount or delete of
        // them meanwhile.
        let _volumes = self
            .volume_changes_if(!source.volume_mounts.is_empty())
            .await;
        // Re-read under the lock: a fork may have moved its volumes since.
        let source = self.get(id)?;
        // Room for the memory file it writes (held while it is written).
        let _room = self.capacity.reserve(
            Ask {
                disk_mib: source.memory_mb,
                ..Ask::default()
            },
            &format!("a snapshot of sandbox {id}"),
        )?;
        let Some(launched) = guest.as_ref() else {
            return Err(Phase::Gone.refusal(id));
        };
        // What a cold boot reads is the disk alone: the guest's page cache
        // goes to it first (what it writes after the sync and before the
        // freeze may be missing, as from a filesystem-only pause).
        if params.filesystem_only {
            self.sync_guest(&source, launched, "a filesystem-only snapshot")
                .await?;
        }

        let snap_id = match params.id {
            Some(id) => id,
            None => ids::sandbox_id().map_err(io("generating a snapshot id"))?,
        };
        // Written in place, not renamed: the state names its memory files by path.
        let dir = self.config.templates_dir().join(&snap_id);
        // The source's next root layer (and the unused child's) go here.
        let disk_dir = self
            .sandbox_dir(id)
            .join(format!("{DISK_DIR_PREFIX}{snap_id}"));
        for d in [&dir, &disk_dir] {
            std::fs::create_dir_all(d).map_err(io(format!("creating {}", d.display())))?;
        }
        let sealed = self.root_layer(&source);
        sandbox.set_phase(Phase::Forking)?;
        let forked = launched
            .vm
            .fork_with(&ForkParams {
                snapshot_path: dir.join(STATE).display().to_string(),
                mem_file_path: dir.join(MEM).display().to_string(),
                disk_dir: disk_dir.display().to_string(),
                children: 1,
            })
            .await;
        if forked.is_ok() {
            crate::node::crash::point("snapshot.frozen");
        }
        sandbox.set_phase(Phase::Running)?;
        if let Ok(info) = &forked
            && let Some(why) = &info.children_failed
        {
            // The VMM writes the state after the source resumed, and could
            // not: the source runs on in this snapshot's files (its new
            // layers, its memory), which cannot be kept without the
            // snapshot. It is stopped, as after a fork that failed inside
            // its VMM, and the files go.
            tracing::error!(
                "sandbox {id}: its snapshot's state could not be written ({why}): stopped"
            );
            let stopped = self.remove(id, Some(&sandbox), Some(guest)).await;
            let _ = std::fs::remove_dir_all(&dir);
            let _ = std::fs::remove_dir_all(&disk_dir);
            return Err(SandboxError::Unavailable(format!(
                "the snapshot's state could not be written: {why}; the sandbox was stopped{}",
                stopped.err().map(|s| format!(": {s}")).unwrap_or_default()
            )));
        }
        let drive = &self.template.root_drive_id;
        // The VMM branched every writable drive, the volumes' slots too:
        // the source's volumes are on new layers beside its root's.
        let new_layers = forked.map_err(SandboxError::from).and_then(|info| {
            let root = super::fork::new_layer(&info, drive)?;
            let moved = moved_mounts(&source.volume_mounts, |slot| {
                super::fork::new_layer(&info, &volume::slot_drive(slot))
            })?;
            Ok((root, moved, info))
        });
        let (new_root, moved, info) = match new_layers {
            Ok(r) => r,
            Err(e) => {
                // The source may run on the files about to go: stopped.
                let e = if super::fork::parent_unknown_after(&e) {
                    self.stop_in_doubt(id, &sandbox, guest, "snapshot", e).await
                } else {
                    e
                };
                let _ = std::fs::remove_dir_all(&dir);
                let _ = std::fs::remove_dir_all(&disk_dir);
                return Err(e);
            }
        };
        // Every create stacks its own layer on the sealed one: the child's
        // layer is never used.
        for d in info.children.iter().flatten() {
            let _ = std::fs::remove_file(&d.path_on_host);
        }
        let mut files = vec![
            dir.join(STATE),
            dir.join(MEM),
            sealed.clone(),
            new_root.clone(),
            dir.clone(),
            disk_dir.clone(),
            self.config.templates_dir(),
        ];
        files.extend(source.volume_mounts.iter().map(|m| m.disk.clone()));
        files.extend(moved.iter().map(|m| m.disk.clone()));
        sync_files(files).await?;

        // The source now writes to its new layers, its memory runs on the
        // snapshot's file, and its directory holds the snapshot's disks.
        let sealed_volumes = source.volume_mounts.clone();
        let source = self
            .store
            .update_sandbox(id, |s| {
                s.root_layer = Some(new_root);
                s.has_dependents = true;
                s.uses_snapshots.push(snap_id.clone());
                s.volume_mounts = moved.clone();
            })?
            .ok_or_else(|| SandboxError::NotFound(id.to_owned()))?;
        // Each volume (not a copy) is on the source's new layer, in the
        // source's directory, which it keeps after the source's kill.
        self.volumes_moved(&moved, &self.sandbox_dir(id))?;
        // Its sealed volume layers stack on the volumes' files (the source's
        // directories name them already; named again, in case).
        let mut uses_dirs = source.uses_dirs.clone();
        for d in self.volume_dirs(&sealed_volumes)? {
            if !uses_dirs.contains(&d) {
                uses_dirs.push(d);
            }
        }
        let mut uses_snapshots = source.uses_snapshots.clone();
        uses_snapshots.retain(|s| s != &snap_id);
        // Its memory has the devices its source's template gave it.
        let source_template = self.store.template(&source.template_id).ok().flatten();
        let record = TemplateRecord {
            id: snap_id.clone(),
            snapshot: dir.join(STATE),
            mem: dir.join(MEM),
            dir,
            root_layer: sealed,
            root_drive_id: drive.clone(),
            kernel: self.template.kernel.clone(),
            rootfs: self.template.rootfs.clone(),
            vcpus: u8::try_from(source.cpu_count).unwrap_or(self.template.vcpus),
            mem_mib: source.memory_mb,
            disk_size_mb: source.disk_size_mb,
            created_at_ms: now_ms(),
            source_sandbox: Some(id.to_owned()),
            names: params.name.into_iter().collect(),
            agent_token: source.access_token.clone(),
            source_network: Some(crate::node::net::SandboxNetwork {
                slot: None,
                ..source.network.clone()
            }),
            env_vars: source.env_vars.clone(),
            uses_snapshots,
            uses_dirs,
            net_abi: source_template.as_ref().and_then(|t| t.net_abi),
            balloon: source_template.as_ref().is_some_and(|t| t.balloon),
            // Its state holds the source's CPUID.
            cpu_template: source.cpu_template.clone(),
            // And its spare drives, as the source had them.
            volume_slots: source_template.map_or(0, |t| t.volume_slots),
            image: None,
            image_digest: None,
            filesystem_only: params.filesystem_only,
            volume_mounts: sealed_volumes,
        };
        self.store.put_template(&record)?;
        Ok(record)
    }

    /// Snapshots, oldest first; only those of `sandbox` when given, only those
    /// with `name` (as id or name, `:default` allowed) when given.
    pub fn snapshots(
        &self,
        sandbox: Option<&str>,
        name: Option<&str>,
    ) -> Result<Vec<TemplateRecord>, SandboxError> {
        let name = name.map(ids::without_default_tag);
        let mut all: Vec<TemplateRecord> = self
            .store
            .templates()?
            .into_iter()
            .filter(|t| t.is_snapshot())
            .filter(|t| sandbox.is_none_or(|s| t.source_sandbox.as_deref() == Some(s)))
            .filter(|t| name.is_none_or(|n| t.id == n || t.names.iter().any(|m| m == n)))
            .collect();
        all.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(all)
    }

    /// Deletes a snapshot or built template: its id and names are gone from
    /// every lookup at once, also while sandboxes or snapshots still stack on
    /// its files (E2B's semantics: they run on unaffected). Its files go now
    /// when nothing uses them, else once the garbage collector finds its last
    /// user gone. The base template is not deleted. Returns the template's id.
    pub async fn delete_template(&self, id_or_name: &str) -> Result<String, SandboxError> {
        let (template, users) = {
            // Held so no create pins it between the check and the removal.
            let pins = self.pins.lock().unwrap_or_else(|p| p.into_inner());
            let template = self.resolve_template(id_or_name)?;
            if template.id == self.template.id {
                return Err(SandboxError::Invalid(format!(
                    "template {} is the node's built-in template and is not deleted",
                    template.id
                )));
            }
            let users = self.template_users(&template.id, &pins)?;
            if users.is_empty() {
                self.store.remove_template(&template.id)?;
            } else {
                self.store.retire_template(&template)?;
            }
            (template, users)
        };
        if users.is_empty() {
            self.remove_template_files(&template).await?;
        } else {
            tracing::info!(
                "template {}: deleted; its files stay while {} use them",
                template.id,
                users.join(", ")
            );
        }
        Ok(template.id)
    }

    /// Removes template `id` and its files when nothing uses it (see
    /// [`Manager::template_users`]), decided under the same lock as
    /// [`Manager::delete_template`]'s, so no create pins it meanwhile.
    /// Returns its record, or None when it is in use (it stays, whole) or
    /// gone already. The base template is never removed.
    pub async fn evict_template(&self, id: &str) -> Result<Option<TemplateRecord>, SandboxError> {
        let template = {
            let pins = self.pins.lock().unwrap_or_else(|p| p.into_inner());
            let Some(template) = self.store.template(id)? else {
                return Ok(None);
            };
            if template.id == self.template.id || !self.template_users(id, &pins)?.is_empty() {
                return Ok(None);
            }
            self.store.remove_template(id)?;
            template
        };
        self.remove_template_files(&template).await?;
        Ok(Some(template))
    }

    /// Whether anything uses template `id` now (see [`Manager::template_users`]).
    pub fn template_in_use(&self, id: &str) -> Result<bool, SandboxError> {
        let pins = self.pins.lock().unwrap_or_else(|p| p.into_inner());
        Ok(!self.template_users(id, &pins)?.is_empty())
    }

    /// Who stacks on template `id`'s files: sandboxes made from it or
    /// stacking on it, snapshots (deleted ones too) stacking on it, creates
    /// restoring it right now (`pins`, held by the caller).
    pub(super) fn template_users(
        &self,
        id: &str,
        pins: &HashMap<String, usize>,
    ) -> Result<Vec<String>, SandboxError> {
        let mut users: Vec<String> = self
            .store
            .sandboxes()?
            .into_iter()
            .filter(|s| s.template_id == id || s.uses_snapshots.iter().any(|u| u == id))
            .map(|s| format!("sandbox {}", s.id))
            .collect();
        let templates = self.store.templates()?;
        let retired = self.store.retired_templates()?;
        users.extend(
            templates
                .iter()
                .chain(&retired)
                .filter(|t| t.id != id && t.uses_snapshots.iter().any(|u| u == id))
                .map(|t| format!("snapshot {}", t.id)),
        );
        if pins.contains_key(id) {
            users.push("a sandbox being created".into());
        }
        Ok(users)
    }

    /// Removes a deleted template's directory (a snapshot's disk layer stays:
    /// it lives in the source's directory, which the collector judges).
    pub(super) async fn remove_template_files(
        &self,
        template: &TemplateRecord,
    ) -> Result<(), SandboxError> {
        let dir = template.dir.clone();
        let templates = self.config.templates_dir();
        if dir.parent() == Some(templates.as_path()) && template.id != ids::BASE_TEMPLATE {
            tokio::task::spawn_blocking(move || {
                if let Err(e) = std::fs::remove_dir_all(&dir)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    tracing::warn!("removing {}: {e}", dir.display());
                }
            })
            .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The source's mounts follow the VMM's new layers, slot by slot; a
    /// slot the answer lacks fails the whole move.
    #[test]
    fn the_sources_mounts_move_to_the_new_layers() {
        let mount = |slot: usize, disk: &str| VolumeMount {
            volume_id: format!("v{slot}"),
            name: format!("n{slot}"),
            slot,
            path: format!("/p{slot}"),
            read_only: false,
            disk: disk.into(),
            copy: slot == 1,
        };
        let before = [mount(0, "/a/volume.layer"), mount(1, "/f/vol1.layer")];
        let moved = moved_mounts(&before, |slot| {
            Ok(std::path::PathBuf::from(format!(
                "/s/snap-x/vol{slot}-new.layer"
            )))
        })
        .unwrap();
        assert_eq!(
            moved,
            [
                mount(0, "/s/snap-x/vol0-new.layer"),
                mount(1, "/s/snap-x/vol1-new.layer")
            ]
        );
        let lacking = moved_mounts(&before, |slot| match slot {
            0 => Ok("/s/x.layer".into()),
            _ => Err(SandboxError::Invalid("no layer".into())),
        });
        assert!(lacking.is_err());
    }

    #[test]
    fn names_are_checked() {
        check_name("my-snap_1.0/x").unwrap();
        assert!(check_name("").is_err());
        assert!(check_name("a b").is_err());
        assert!(check_name("a:b").is_err());
        assert!(check_name(&"a".repeat(MAX_NAME + 1)).is_err());
    }
}

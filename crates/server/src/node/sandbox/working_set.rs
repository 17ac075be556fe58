//! A template's working set: the guest memory the first command of a
//! sandbox restored from it touches (restore, agent init, the command), so
//! that later restores have the VMM populate it at once rather than take a
//! page fault per page on the first command's path.
//!
//! Recorded once per template, from the first sandbox created from it that
//! runs a command: a second after that command's answer ended, the pages
//! its VMM has present in its mapping of the template's memory file
//! (`/proc/<pid>/maps` and `pagemap`, in file offsets, which are the
//! snapshot's flat memory offsets), with those it wrote (private copies)
//! told apart, go to `working-set.json` in the template's directory. The
//! written ones are populated for writing: they would fault on the guest's
//! write anyway, and are most of a first command's faults. Creates from a
//! template with one pass it to the VMM's load (`prefetch_path`). Only the
//! template's own memory file is read: for a snapshot template stacked on
//! another, the pages of its lower layers are not in it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::{Manager, Phase};
use crate::node::clock::now_ms;
use crate::node::store::TemplateRecord;

const FILE: &str = "working-set.json";
/// A sandbox whose first command has not come by then records nothing.
const WAIT_FOR_COMMAND: Duration = Duration::from_secs(600);
/// After the first command's answer: its shell's last pages.
const SETTLE: Duration = Duration::from_secs(1);
const POLL: Duration = Duration::from_millis(200);

/// The working-set file of `template`, when it has one.
pub fn file_of(template: &TemplateRecord) -> Option<PathBuf> {
    let path = template.dir.join(FILE);
    path.exists().then_some(path)
}

impl Manager {
    /// After a create from `template`: records its working set from sandbox
    /// `id` when it has none and no other sandbox is recording it.
    pub(super) fn record_working_set(&self, template: &TemplateRecord, id: &str) {
        if file_of(template).is_some() {
            return;
        }
        {
            let mut recording = self.recording.lock().unwrap_or_else(|p| p.into_inner());
            if !recording.insert(template.id.clone()) {
                return;
            }
        }
        let (me, id, template) = (self.me.clone(), id.to_owned(), template.clone());
        tokio::spawn(async move {
            let Some(manager) = me.upgrade() else {
                return;
            };
            if let Err(e) = manager.record_after_first_command(&template, &id).await {
                tracing::info!(
                    "template {}: working set not recorded from sandbox {id}: {e}",
                    template.id
                );
            }
            let mut recording = manager.recording.lock().unwrap_or_else(|p| p.into_inner());
            recording.remove(&template.id);
        });
    }

    async fn record_after_first_command(
        self: &Arc<Self>,
        template: &TemplateRecord,
        id: &str,
    ) -> Result<(), String> {
        let sandbox = self.registry().get(id).ok_or("it is gone")?;
        let since = now_ms();
        let deadline = tokio::time::Instant::now() + WAIT_FOR_COMMAND;
        // Its first proxied request has come and gone.
        while sandbox.last_used_ms() <= since || sandbox.in_flight() > 0 {
            if tokio::time::Instant::now() > deadline {
                return Err("no command came".into());
            }
            tokio::time::sleep(POLL).await;
        }
        tokio::time::sleep(SETTLE).await;
        if sandbox.phase() != Phase::Running {
            return Err("it no longer runs".into());
        }
        let pid = sandbox.probe().ok_or("no VMM")?.pid();
        let mem = std::fs::canonicalize(&template.mem).map_err(|e| e.to_string())?;
        let dir = template.dir.clone();
        let (pages, bytes, written) = tokio::task::spawn_blocking(move || write(pid, &mem, &dir))
            .await
            .map_err(|e| e.to_string())??;
        tracing::info!(
            "template {}: working set recorded from sandbox {id}: {} KiB in {pages} ranges, \
             {} KiB of them written",
            template.id,
            bytes >> 10,
            written >> 10
        );
        Ok(())
    }

    /// Sandbox `id`'s VMM's page faults so far, while it runs.
    pub fn vmm_faults(&self, id: &str) -> Option<host_mem::resident::Faults> {
        let pid = self.registry().get(id)?.probe()?.pid();
        host_mem::resident::Faults::of(pid).ok()
    }
}

/// Writes the resident ranges of `mem` in process `pid` to `dir`'s working
/// set file (whole or not at all), the written ones told apart; returns
/// their count, their bytes and the written bytes.
fn write(pid: u32, mem: &Path, dir: &Path) -> Result<(usize, u64, u64), String> {
    let resident =
        host_mem::resident::resident_file_ranges(pid, mem).map_err(|e| format!("reading: {e}"))?;
    if resident.present.is_empty() {
        // What the VMM maps by that name, to tell a path mismatch from pages
        // not (yet) mapped.
        let name = mem.file_name().unwrap_or_default().to_string_lossy();
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
        let similar: Vec<&str> = maps.lines().filter(|l| l.contains(&*name)).collect();
        return Err(format!(
            "no page of {} is mapped (its mappings by that name: {similar:?})",
            mem.display()
        ));
    }
    let set = vmm_api::WorkingSet {
        present: resident.present,
        written: resident.written,
    };
    let sum = |r: &[(u64, u64)]| r.iter().map(|(s, e)| e - s).sum::<u64>();
    let (bytes, written) = (sum(&set.present), sum(&set.written));
    let text = serde_json::to_vec(&set).map_err(|e| e.to_string())?;
    let tmp = dir.join(format!("{FILE}.tmp"));
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::File::open(&tmp)?.sync_all())
        .and_then(|()| std::fs::rename(&tmp, dir.join(FILE)))
        .map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    Ok((set.present.len(), bytes, written))
}

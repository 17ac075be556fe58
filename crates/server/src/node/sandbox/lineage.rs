//! The lineage of a sandbox's guest (see [`Lineage`]): where its VMM may be
//! handed files when it loads or boots it, from the sandbox's record alone.
//! Every launch of a sandbox's guest names it (see [`crate::node::launch::Plan`]).

use std::path::{Path, PathBuf};

use vmm_driver::process::Lineage;

use super::Manager;
use crate::node::store::SandboxRecord;

impl Manager {
    /// The lineage of a sandbox with its own directory `own` that stacks
    /// on the directories `uses_dirs` (of the sandboxes and forks below it,
    /// as records keep them for the collector), the snapshots
    /// `uses_snapshots` and its template `template_id`: those directories,
    /// the templates' and the node's base template's, and the cluster cache
    /// (what a sandbox taken in from the object store stacks on: files named
    /// by their content's digest, which a VMM cannot guess).
    pub(crate) fn lineage(
        &self,
        own: &Path,
        uses_dirs: &[PathBuf],
        uses_snapshots: &[String],
        template_id: &str,
    ) -> Lineage {
        let mut dirs = uses_dirs.to_vec();
        dirs.push(own.to_owned());
        let templates = self.config.templates_dir();
        let ids = uses_snapshots.iter().map(String::as_str);
        for id in ids.chain([template_id]) {
            dirs.push(templates.join(id));
            if let Ok(Some(template)) = self.store.template(id) {
                dirs.extend(template_dirs(&template));
            }
        }
        dirs.extend(template_dirs(&self.template));
        // Never a whole data directory or what holds one (a template whose
        // image lay in the data dir itself would otherwise let in all)...
        let areas = crate::node::jail::data_dirs(&self.config);
        dirs.retain(|d| !areas.iter().any(|area| area.starts_with(d)));
        // ...but the cluster cache, whose names cannot be guessed.
        dirs.push(self.config.cluster_cache_dir());
        Lineage::new(dirs)
    }

    /// The lineage of the sandbox `record` keeps (its own directory always:
    /// records from before `uses_dirs` name none).
    pub(crate) fn record_lineage(&self, record: &SandboxRecord) -> Lineage {
        self.lineage(
            &self.sandbox_dir(&record.id),
            &record.uses_dirs,
            &record.uses_snapshots,
            &record.template_id,
        )
    }
}

/// A template's directory and those of its snapshot, root layer and the
/// image below it (which an image build keeps in its own directory).
fn template_dirs(template: &crate::node::store::TemplateRecord) -> Vec<PathBuf> {
    let files = [
        &template.snapshot,
        &template.mem,
        &template.root_layer,
        &template.rootfs,
    ];
    let parents = files
        .into_iter()
        .filter_map(|p| p.parent().map(Path::to_owned))
        .filter(|p| !p.as_os_str().is_empty());
    std::iter::once(template.dir.clone())
        .chain(parents)
        .collect()
}

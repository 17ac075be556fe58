//! The `base` template: the base image booted once with a writable layered
//! root disk, snapshotted at a serving agent, its root layer sealed. Every
//! sandbox restores that snapshot with its own layer stacked on the seal.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use disk_layers::LayeredDisk;
use vmm_api::process::{GuestSpec, ProcessError};
use vmm_api::{Drive, SnapshotType};

use crate::config::Config;
use crate::ids;
use crate::pool::Pool;
use crate::store::{Store, StoreError, TemplateRecord};

pub const BASE: &str = "base";
pub const ROOT_DRIVE: &str = "rootfs";
const SNAPSHOT: &str = "vm.state";
const MEM: &str = "vm.mem";
const ROOT_LAYER: &str = "root.layer";
/// A cold boot in the lab takes tens of seconds.
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
/// Quiet console: its output costs boot time.
const BOOT_ARGS: &str = "console=ttyS0 reboot=k panic=1 pci=off nomodule i8042.noaux \
    i8042.nomux i8042.nopnp i8042.dumbkbd quiet";

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the template's root disk: {0}")]
    Disk(#[from] disk_layers::Error),
    #[error("booting the template: {0}")]
    Vmm(#[from] ProcessError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("a blocking task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> TemplateError {
    let path = path.to_owned();
    move |source| TemplateError::Io { what, path, source }
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The stored `base` template when it is whole and built from the configured
/// kernel, image and machine size; otherwise builds it (and records it).
pub async fn ensure_base(
    config: &Config,
    store: &Store,
    pool: &Pool,
) -> Result<TemplateRecord, TemplateError> {
    if let Some(t) = store.template(BASE)? {
        let same_inputs = t.kernel == config.kernel
            && t.rootfs == config.rootfs
            && t.vcpus == config.vcpus
            && t.mem_mib == config.mem_mib;
        let whole = [&t.snapshot, &t.mem, &t.root_layer]
            .iter()
            .all(|p| p.is_file());
        if same_inputs && whole {
            return Ok(t);
        }
        tracing::info!("template {BASE}: rebuilding (inputs changed or files missing)");
    }
    let started = std::time::Instant::now();
    let record = build(config, pool, BASE).await?;
    store.put_template(&record)?;
    tracing::info!(
        "template {BASE}: built in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(record)
}

/// Boots, snapshots and seals a template in a scratch directory, then renames
/// it into place, so a crash never leaves a half-built template under its name.
async fn build(config: &Config, pool: &Pool, id: &str) -> Result<TemplateRecord, TemplateError> {
    let parent = config.templates_dir();
    let scratch = parent.join(format!(
        ".build-{id}-{}",
        ids::hex(&ids::random_bytes(4).map_err(io("reading random bytes", &parent))?)
    ));
    std::fs::create_dir_all(&scratch).map_err(io("creating", &scratch))?;
    let result = build_in(config, pool, &scratch).await;
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&scratch);
    }
    let disk_size_mb = result?;

    let dir = parent.join(id);
    // An unrecorded directory of this name is a leftover of an earlier build.
    if dir.exists() {
        let old = parent.join(format!(".old-{id}-{}", now_ms()));
        std::fs::rename(&dir, &old).map_err(io("moving aside", &dir))?;
        let _ = std::fs::remove_dir_all(&old);
    }
    std::fs::rename(&scratch, &dir).map_err(io("renaming into place", &dir))?;
    sync_dir(&parent)?;
    Ok(TemplateRecord {
        id: id.into(),
        snapshot: dir.join(SNAPSHOT),
        mem: dir.join(MEM),
        root_layer: dir.join(ROOT_LAYER),
        root_drive_id: ROOT_DRIVE.into(),
        dir,
        kernel: config.kernel.clone(),
        rootfs: config.rootfs.clone(),
        vcpus: config.vcpus,
        mem_mib: config.mem_mib,
        disk_size_mb,
        created_at_ms: now_ms(),
        source_sandbox: None,
        names: Vec::new(),
        agent_token: None,
        env_vars: Default::default(),
        uses_snapshots: Vec::new(),
        uses_dirs: Vec::new(),
    })
}

/// Returns the root disk's size in MiB.
async fn build_in(config: &Config, pool: &Pool, dir: &Path) -> Result<u64, TemplateError> {
    let root = dir.join(ROOT_LAYER);
    let (rootfs, top) = (config.rootfs.clone(), root.clone());
    let disk_size =
        tokio::task::spawn_blocking(move || LayeredDisk::create(&rootfs, &top).map(|d| d.len()))
            .await??;

    let mut vm = pool.take().await?;
    vm.boot(&GuestSpec {
        kernel: config.kernel.clone(),
        boot_args: Some(BOOT_ARGS.into()),
        vcpus: config.vcpus,
        mem_mib: config.mem_mib,
        drives: vec![Drive::new(
            ROOT_DRIVE,
            root.display().to_string(),
            true,
            false,
        )],
        vsock: true,
    })
    .await?;
    vm.wait_for_agent(BOOT_TIMEOUT).await?;
    // Pausing parks the disk worker and flushes the root layer, so the
    // snapshot's memory and the layer agree.
    vm.snapshot(SnapshotType::Full, &dir.join(SNAPSHOT), &dir.join(MEM))
        .await?;
    drop(vm);

    // Seal the root layer: branching it once seals it; the branch is not needed.
    let (top, scratch) = (root.clone(), dir.join("unused.layer"));
    tokio::task::spawn_blocking(move || -> Result<(), TemplateError> {
        let disk = LayeredDisk::open(&top)?;
        disk.seal_and_branch(&scratch, &[])?;
        drop(disk);
        std::fs::remove_file(&scratch).map_err(io("removing", &scratch))?;
        Ok(())
    })
    .await??;
    for name in [SNAPSHOT, MEM, ROOT_LAYER] {
        let path = dir.join(name);
        std::fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(io("syncing", &path))?;
    }
    sync_dir(dir)?;
    Ok(disk_size / (1024 * 1024))
}

pub fn sync_dir(dir: &Path) -> Result<(), TemplateError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing", dir))
}

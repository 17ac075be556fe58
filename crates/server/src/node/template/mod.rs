//! Templates: snapshots every sandbox restores. The `base` template is the
//! base image booted once with a writable layered root disk, snapshotted at a
//! serving agent, its root layer sealed; every sandbox restores that snapshot
//! with its own layer stacked on the seal. Built templates ([`build`]) are
//! made the same way from a root filesystem built by `template-build`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use vmm_driver::agent_client::AgentError;
use vmm_driver::process::ProcessError;

use crate::node::capacity::Capacity;
use crate::node::config::Config;
use crate::node::pool::Pool;
use crate::node::store::{Store, StoreError, TemplateRecord};

mod boot;
pub mod build;
pub mod code_interpreter;
pub mod e2b_build;
mod image;
mod image_create;
pub mod image_disk;

pub use boot::{BootSpec, Prepare};
pub use build::{BuildParams, BuildSource, Templates};
pub use image_create::{
    Conversion, ImageError, ImageStart, image_name, image_of_create, is_image_reference,
};

pub const BASE: &str = crate::node::ids::BASE_TEMPLATE;
pub const ROOT_DRIVE: &str = "rootfs";

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
    #[error("the template's guest agent: {0}")]
    Agent(#[from] AgentError),
    #[error("the start command: {0}")]
    StartCommand(String),
    #[error("the ready command: {0}")]
    NotReady(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("a blocking task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
    #[error("the template's network: {0}")]
    Network(#[from] crate::node::net::NetError),
    #[error("the template's cgroup: {0}")]
    Cgroup(#[from] cgroup::Error),
}

impl From<crate::node::launch::LaunchError> for TemplateError {
    fn from(e: crate::node::launch::LaunchError) -> TemplateError {
        match e {
            crate::node::launch::LaunchError::Vmm(e) => TemplateError::Vmm(e),
            crate::node::launch::LaunchError::Network(e) => TemplateError::Network(e),
            crate::node::launch::LaunchError::Cgroup(e) => TemplateError::Cgroup(e),
        }
    }
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> TemplateError {
    let path = path.to_owned();
    move |source| TemplateError::Io { what, path, source }
}

/// The stored `base` template when it is whole and built from the configured
/// kernel, image and machine size; otherwise builds it (and records it).
pub async fn ensure_base(
    config: &Config,
    store: &Store,
    pool: &Pool,
    capacity: &Arc<Capacity>,
) -> Result<TemplateRecord, TemplateError> {
    if let Some(t) = store.template(BASE)? {
        let same_inputs = t.kernel == config.kernel
            && t.rootfs == config.rootfs
            && t.vcpus == config.vcpus
            && t.mem_mib == config.mem_mib
            // A snapshot with an interface needs a slot's tap, one without
            // leaves sandboxes offline: it must match the node.
            && t.net_abi == pool.net().map(|_| sandfork_network::plan::NET_ABI_VERSION)
            // Sandboxes get the devices their template's snapshot has.
            && t.balloon == pool.balloon().is_some()
            // Its snapshot's CPUID is what the node offers guests.
            && t.cpu_template == crate::node::config::cpu_template_name(pool.cpu_template());
        if same_inputs && t.files_whole() {
            return Ok(t);
        }
        tracing::info!("template {BASE}: rebuilding (inputs changed or files missing)");
    }
    let started = std::time::Instant::now();
    let spec = BootSpec {
        rootfs: config.rootfs.clone(),
        vcpus: config.vcpus,
        mem_mib: config.mem_mib,
        prepare: Prepare::default(),
    };
    let record = boot::build(config, pool, capacity, BASE, &spec, &|line| {
        tracing::info!("template {BASE}: {line}")
    })
    .await?;
    store.put_template(&record)?;
    tracing::info!(
        "template {BASE}: built in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(record)
}

pub fn sync_dir(dir: &Path) -> Result<(), TemplateError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing", dir))
}

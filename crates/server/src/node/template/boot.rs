//! Boots a root filesystem into a template: a writable layer over the image,
//! the guest up to its agent, the template's start command left running and
//! its ready command passing, a full snapshot, the layer sealed. All in a
//! scratch directory renamed into place at the end, so a crash never leaves a
//! half-built template under its name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use disk_layers::LayeredDisk;
use vmm_api::{Drive, SnapshotType};
use vmm_driver::agent_client::{AgentClient, AgentInit};
use vmm_driver::process::{GuestSpec, Lineage};

use super::{ROOT_DRIVE, TemplateError, io, sync_dir};
use crate::node::capacity::{Ask, Capacity};
use crate::node::clock::now_ms;
use crate::node::config::Config;
use crate::node::ids;
use crate::node::launch::{self, BOOT_ARGS, Guest, Plan, Ready};
use crate::node::pool::Pool;
use crate::node::sandbox::Manager;
use crate::node::store::TemplateRecord;
use crate::node::volume;

const SNAPSHOT: &str = "vm.state";
const MEM: &str = "vm.mem";
const ROOT_LAYER: &str = "root.layer";
/// A cold boot in the lab takes tens of seconds.
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
/// How long the ready command may take to pass (E2B's builds allow 10
/// minutes; a server warming up in an emulated lab needs minutes).
pub const READY_TIMEOUT: Duration = Duration::from_secs(600);
const READY_EVERY: Duration = Duration::from_secs(1);
/// One run of the ready command (a hung one counts as not ready).
const READY_RUN_TIMEOUT: Duration = Duration::from_secs(30);
/// The start command's output, in the guest (shown in the build log on failure).
const START_LOG: &str = "/tmp/.sandfork-start.log";
/// Images need not have bash: commands run under the POSIX shell.
const SHELL: &str = "/bin/sh";
/// Prefix of scratch directories under `templates/`.
const SCRATCH_PREFIX: &str = ".build-";

/// What to boot.
#[derive(Debug, Clone)]
pub struct BootSpec {
    /// The root filesystem image (ext4, the agent as init).
    pub rootfs: PathBuf,
    pub vcpus: u8,
    pub mem_mib: u64,
    pub prepare: Prepare,
}

impl BootSpec {
    /// An image's root filesystem booted as its config says.
    pub fn from_image(image: &template_build::Template, vcpus: u8, mem_mib: u64) -> BootSpec {
        BootSpec {
            rootfs: image.rootfs.clone(),
            vcpus,
            mem_mib,
            prepare: Prepare::from_image(&image.config),
        }
    }
}

/// What runs in the guest before the snapshot.
#[derive(Debug, Clone, Default)]
pub struct Prepare {
    /// Sandbox-wide environment (the image's `Env`), kept by every sandbox.
    pub env_vars: BTreeMap<String, String>,
    /// Where the start and ready commands run (the image's `WorkingDir`).
    pub workdir: Option<String>,
    /// Started in the background; it is still running in the snapshot.
    pub start_cmd: Option<String>,
    /// Run until it exits 0 (within [`READY_TIMEOUT`]) before the snapshot.
    pub ready_cmd: Option<String>,
}

/// Quotes `s` for a POSIX shell.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

impl Prepare {
    /// What an image's config says: its environment and working directory.
    pub fn from_image(image: &template_build::ImageConfig) -> Prepare {
        Prepare {
            env_vars: image.env.iter().cloned().collect(),
            workdir: image.working_dir.clone(),
            ..Prepare::default()
        }
    }

    /// `cmd` run in the working directory (when it has one).
    fn in_workdir(&self, cmd: &str) -> String {
        match &self.workdir {
            Some(dir) => format!("cd {} && {cmd}", shell_quote(dir)),
            None => cmd.to_owned(),
        }
    }

    pub async fn run(
        &self,
        agent: &AgentClient,
        log: &(dyn Fn(&str) + Sync),
    ) -> Result<(), TemplateError> {
        if !self.env_vars.is_empty() {
            // So the start command sees the image's environment too.
            let mut init = AgentInit::after_restore()?;
            init.env_vars = Some(self.env_vars.clone());
            agent.init(&init).await?;
        }
        if let Some(start) = &self.start_cmd {
            log(&format!("starting: {start}"));
            // Backgrounded with its output in a file: the call returns at
            // once and the process lives on (the agent reaps it later).
            let line = format!(
                "mkdir -p /tmp; {} </dev/null >{START_LOG} 2>&1 &",
                self.in_workdir(&format!("exec {SHELL} -c {}", shell_quote(start)))
            );
            let out = agent.run_argv(SHELL, &["-c", &line]).await?;
            if out.exit_code != 0 {
                return Err(TemplateError::StartCommand(format!(
                    "exited {}: {}",
                    out.exit_code,
                    out.stderr.trim()
                )));
            }
        }
        if let Some(ready) = &self.ready_cmd {
            log(&format!("waiting for: {ready}"));
            let started = Instant::now();
            let agent = agent.clone().with_timeout(READY_RUN_TIMEOUT);
            let line = self.in_workdir(ready);
            let mut tries = 0u32;
            loop {
                tries += 1;
                let last = match agent.run_argv(SHELL, &["-c", &line]).await {
                    Ok(out) if out.exit_code == 0 => break,
                    Ok(out) => format!("exited {}: {}", out.exit_code, out.stderr.trim()),
                    Err(e) => e.to_string(),
                };
                if started.elapsed() >= READY_TIMEOUT {
                    let tail = agent
                        .run_argv(SHELL, &["-c", &format!("tail -n 20 {START_LOG}")])
                        .await
                        .map(|o| o.stdout)
                        .unwrap_or_default();
                    for l in tail.lines() {
                        log(&format!("start command: {l}"));
                    }
                    return Err(TemplateError::NotReady(format!(
                        "did not pass within {} s ({tries} tries; last {last})",
                        READY_TIMEOUT.as_secs()
                    )));
                }
                if tries == 1 || tries.is_multiple_of(10) {
                    log(&format!("not ready yet ({last})"));
                }
                tokio::time::sleep(READY_EVERY).await;
            }
            log(&format!(
                "ready after {:.1} s",
                started.elapsed().as_secs_f64()
            ));
        }
        Ok(())
    }
}

/// The shell an E2B SDK's `commands.run` starts, as its default user.
const SDK_SHELL: [&str; 3] = ["-l", "-c", "true"];
const SDK_USER: &str = "user";

/// Runs what every sandbox's first command runs (a login bash as the SDK's
/// default user) once before the snapshot, so that its binaries, libraries
/// and profile files are in the guest's page cache, and so in the snapshot's
/// memory: otherwise each restored sandbox reads them from its disk on its
/// first command. Images without bash or that user just skip it.
async fn warm_up(agent: &AgentClient, log: &(dyn Fn(&str) + Sync)) {
    let started = Instant::now();
    match agent
        .clone()
        .with_user(SDK_USER)
        .run_argv("/bin/bash", &SDK_SHELL)
        .await
    {
        Ok(out) if out.exit_code == 0 => log(&format!(
            "warmed the first command's files in {:.1} s",
            started.elapsed().as_secs_f64()
        )),
        Ok(out) => log(&format!("no warm-up (exit {})", out.exit_code)),
        Err(e) => log(&format!("no warm-up ({e})")),
    }
}

/// [`build`] with the node's own configuration, pool and capacity.
pub async fn build_on(
    manager: &Manager,
    id: &str,
    spec: &BootSpec,
    log: &(dyn Fn(&str) + Sync),
) -> Result<TemplateRecord, TemplateError> {
    let (config, pool, capacity) = (manager.config(), manager.pool(), manager.capacity());
    build(config, pool, capacity, id, spec, log).await
}

/// Builds template `id` from `spec` into `templates/<id>/` and returns its
/// record (no names; the caller stores it).
pub async fn build(
    config: &Config,
    pool: &Pool,
    capacity: &Arc<Capacity>,
    id: &str,
    spec: &BootSpec,
    log: &(dyn Fn(&str) + Sync),
) -> Result<TemplateRecord, TemplateError> {
    let parent = config.templates_dir();
    let scratch = parent.join(format!(
        "{SCRATCH_PREFIX}{id}-{}",
        ids::hex(&ids::random_bytes(4).map_err(io("reading random bytes", &parent))?)
    ));
    std::fs::create_dir_all(&scratch).map_err(io("creating", &scratch))?;
    let result = build_in(config, pool, capacity, spec, &scratch, log).await;
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
        rootfs: spec.rootfs.clone(),
        vcpus: spec.vcpus,
        mem_mib: spec.mem_mib,
        disk_size_mb,
        created_at_ms: now_ms(),
        source_sandbox: None,
        names: Vec::new(),
        agent_token: None,
        source_network: None,
        env_vars: spec.prepare.env_vars.clone(),
        uses_snapshots: Vec::new(),
        uses_dirs: Vec::new(),
        // Every launch of a networked node has the interface.
        net_abi: pool.net().map(|_| sandfork_network::plan::NET_ABI_VERSION),
        balloon: pool.balloon().is_some(),
        cpu_template: crate::node::config::cpu_template_name(pool.cpu_template()),
        volume_slots: volume::SLOTS,
        image: None,
        image_digest: None,
        filesystem_only: false,
        volume_mounts: Vec::new(),
    })
}

/// Returns the root disk's size in MiB.
async fn build_in(
    config: &Config,
    pool: &Pool,
    capacity: &Arc<Capacity>,
    spec: &BootSpec,
    dir: &Path,
    log: &(dyn Fn(&str) + Sync),
) -> Result<u64, TemplateError> {
    let root = dir.join(ROOT_LAYER);
    let (rootfs, top) = (spec.rootfs.clone(), root.clone());
    let disk_size =
        tokio::task::spawn_blocking(move || LayeredDisk::create(&rootfs, &top).map(|d| d.len()))
            .await??;

    // Spare drives a restore points at volumes (see `node::volume`).
    let volume_slots = volume::template_drives(dir).map_err(io("making volume slots in", dir))?;
    log(&format!(
        "booting {} with {} vCPU and {} MiB",
        spec.rootfs.display(),
        spec.vcpus,
        spec.mem_mib
    ));
    let plan = Plan {
        guest: Guest::Boot(GuestSpec {
            kernel: config.kernel.clone(),
            boot_args: Some(BOOT_ARGS.into()),
            vcpus: spec.vcpus,
            mem_mib: spec.mem_mib,
            drives: [Drive::new(
                ROOT_DRIVE,
                root.display().to_string(),
                true,
                false,
            )]
            .into_iter()
            .chain(volume_slots)
            .collect(),
            vsock: true,
            // The node's, set by the launch.
            cpu_template: None,
        }),
        ready: Ready::Health,
        // A build's guest uses the node like a sandbox's; it is counted, not refused.
        hold: capacity.hold(Ask::sandbox(u64::from(spec.vcpus), spec.mem_mib)),
        timeout: BOOT_TIMEOUT,
        egress: Default::default(),
        // Its disk's one layer stacks on the image the server chose.
        lineage: Lineage::new(
            [dir.to_owned()]
                .into_iter()
                .chain(spec.rootfs.parent().map(Path::to_owned)),
        ),
    };
    let launched = launch::launch(pool, plan).await?;
    let vm = &launched.vm;
    log(&format!(
        "agent up {:.1} s after start",
        launched.times.ready.as_secs_f64()
    ));
    spec.prepare.run(&vm.agent(), log).await?;
    warm_up(&vm.agent(), log).await;
    // Pausing parks the disk worker and flushes the root layer, so the
    // snapshot's memory and the layer agree.
    vm.snapshot(SnapshotType::Full, &dir.join(SNAPSHOT), &dir.join(MEM))
        .await?;
    launched.stop().await;
    log("snapshot taken; sealing the root layer");

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
    for name in [SNAPSHOT, MEM, ROOT_LAYER, volume::PLACEHOLDER] {
        let path = dir.join(name);
        std::fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(io("syncing", &path))?;
    }
    sync_dir(dir)?;
    Ok(disk_size / (1024 * 1024))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_quoted_and_run_in_the_workdir() {
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        let p = Prepare {
            workdir: Some("/home/a b".into()),
            ..Prepare::default()
        };
        assert_eq!(p.in_workdir("ls"), "cd '/home/a b' && ls");
        assert_eq!(Prepare::default().in_workdir("ls"), "ls");
    }
}

//! Boots one microVM through the Firecracker-compatible API of a VMM binary
//! (sandfork-vmm, or a real Firecracker for comparison) and waits for the
//! guest agent: the path shared by `up` and `bench`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use vmm_api::{BootSource, Drive, MachineConfig, VmmClient, Vsock};

/// The guest agent's port (E2B's envd port).
pub const AGENT_PORT: u32 = 49983;

/// What to boot.
#[derive(Clone, Debug)]
pub struct GuestImage {
    pub kernel: PathBuf,
    pub rootfs: PathBuf,
    pub vcpus: u8,
    pub mem_mib: u64,
}

pub struct RunningVm {
    child: Child,
    pub dir: tempfile::TempDir,
    pub api: VmmClient,
}

impl RunningVm {
    pub fn vsock_path(&self) -> PathBuf {
        self.dir.path().join("vsock.sock")
    }

    pub fn console_path(&self) -> PathBuf {
        self.dir.path().join("console.log")
    }

    /// Stops the VM: Ctrl+Alt+Del makes the agent shut the guest down; a
    /// VMM that does not end in time is killed.
    pub async fn shutdown(mut self, grace: Duration) -> Result<()> {
        let _ = self.api.send_ctrl_alt_del().await;
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for RunningVm {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Spawns `vmm_binary`, configures the guest and starts it; returns at once.
pub async fn launch(vmm_binary: &Path, image: &GuestImage) -> Result<RunningVm> {
    let dir = tempfile::tempdir()?;
    let api_sock = dir.path().join("api.sock");
    let child = Command::new(vmm_binary)
        .arg("--api-sock")
        .arg(&api_sock)
        .stdin(Stdio::null())
        .stdout(File::create(dir.path().join("console.log"))?)
        .stderr(File::create(dir.path().join("vmm.log"))?)
        .spawn()
        .with_context(|| format!("starting {}", vmm_binary.display()))?;
    let vm = RunningVm {
        child,
        api: VmmClient::new(&api_sock),
        dir,
    };
    vm.api
        .wait_for_socket(Duration::from_secs(10))
        .await
        .context("waiting for the VMM's API socket")?;
    vm.api
        .put_machine_config(&MachineConfig::new(image.vcpus, image.mem_mib))
        .await?;
    vm.api
        .put_boot_source(&BootSource {
            kernel_image_path: image.kernel.display().to_string(),
            boot_args: Some(
                "console=ttyS0 reboot=k panic=1 pci=off nomodule i8042.noaux i8042.nomux \
                 i8042.nopnp i8042.dumbkbd quiet"
                    .into(),
            ),
            initrd_path: None,
        })
        .await?;
    vm.api
        .put_drive(&Drive::new(
            "rootfs",
            image.rootfs.display().to_string(),
            true,
            true,
        ))
        .await?;
    vm.api
        .put_vsock(&Vsock::new(3, vm.vsock_path().display().to_string()))
        .await?;
    vm.api.instance_start().await?;
    Ok(vm)
}

/// Polls the agent's health check until it answers; returns the time taken.
pub async fn wait_for_agent(vm: &mut RunningVm, timeout: Duration) -> Result<Duration> {
    let start = Instant::now();
    loop {
        let probe = vmm_api::vsock_connect::agent_health(
            &vm.vsock_path(),
            AGENT_PORT,
            Duration::from_secs(2),
        )
        .await;
        if let Ok(204) = probe {
            return Ok(start.elapsed());
        }
        if let Some(status) = vm.child.try_wait()? {
            let console = std::fs::read_to_string(vm.console_path()).unwrap_or_default();
            bail!("the VMM exited ({status}) before the agent answered; console:\n{console}");
        }
        if start.elapsed() > timeout {
            bail!("the guest agent did not answer within {timeout:?} (last: {probe:?})");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

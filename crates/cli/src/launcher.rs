//! Boots one microVM from the default image with a VMM binary (sandfork-vmm,
//! or a real Firecracker for comparison): the path shared by `up` and `bench`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Result;
use vmm_api::Drive;
use vmm_driver::agent_client::AgentInit;
use vmm_driver::process::{GuestSpec, VmmProcess};

/// What to boot.
#[derive(Clone, Debug)]
pub struct GuestImage {
    pub kernel: PathBuf,
    pub rootfs: PathBuf,
    pub vcpus: u8,
    pub mem_mib: u64,
}

/// The kernel command line of benchmark and `up` guests: quiet, so console
/// output does not slow the boot being measured.
const BOOT_ARGS: &str = "console=ttyS0 reboot=k panic=1 pci=off nomodule i8042.noaux \
    i8042.nomux i8042.nopnp i8042.dumbkbd quiet";

/// Spawns `vmm_binary` and boots the image (read-only root, vsock); returns
/// once the VMM has started the guest.
pub async fn launch(vmm_binary: &Path, image: &GuestImage) -> Result<VmmProcess> {
    launch_with(vmm_binary, image, None).await
}

/// [`launch`] with a balloon device.
pub async fn launch_with(
    vmm_binary: &Path,
    image: &GuestImage,
    balloon: Option<&vmm_api::Balloon>,
) -> Result<VmmProcess> {
    let vm = VmmProcess::spawn(vmm_binary).await?;
    if let Some(balloon) = balloon {
        vm.api().put_balloon(balloon).await?;
    }
    boot(&vm, image).await?;
    Ok(vm)
}

/// Boots the image on a VMM already spawned, with whatever devices the
/// caller gave it before (a network interface, a balloon).
pub async fn boot(vm: &VmmProcess, image: &GuestImage) -> Result<()> {
    vm.boot(&GuestSpec {
        kernel: image.kernel.clone(),
        boot_args: Some(BOOT_ARGS.into()),
        vcpus: image.vcpus,
        mem_mib: image.mem_mib,
        drives: vec![Drive::new(
            "rootfs",
            image.rootfs.display().to_string(),
            true,
            true,
        )],
        vsock: true,
        cpu_template: None,
    })
    .await?;
    Ok(())
}

/// Boots and waits for the guest agent; returns the VM and the time taken.
pub async fn boot_to_agent(
    vmm_binary: &Path,
    image: &GuestImage,
    timeout: Duration,
) -> Result<(VmmProcess, Duration)> {
    let mut vm = launch(vmm_binary, image).await?;
    let took = vm.wait_for_agent(timeout).await?;
    Ok((vm, took))
}

/// Waits for a restored guest's agent and initialises it (clock, entropy),
/// as every restore or fork must before the guest serves anything. The
/// init is the readiness probe, as the node's creates have it: one vsock
/// connection where a health poll and then an init took two.
pub async fn ready_after_restore(vm: &mut VmmProcess, timeout: Duration) -> Result<()> {
    vm.init_agent(&AgentInit::after_restore()?, None, timeout)
        .await?;
    Ok(())
}

//! Boots real microVMs with the `sandfork-vmm` binary for the lab tests.
//!
//! These tests need a /dev/kvm that can run a Linux guest, plus the guest
//! kernel and base image named by `SANDFORK_KERNEL` and `SANDFORK_ROOTFS`
//! (`scripts/test.sh` builds both and runs these tests in the KVM lab when
//! the host cannot boot Linux itself).

#![allow(dead_code)]

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vmm_api::{BootSource, Drive, MachineConfig, VmmClient, Vsock};

/// The agent's port inside the guest (E2B's envd port).
pub const AGENT_PORT: u32 = 49983;
/// Lab times are emulated and slow: leave generous room.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(120);

pub fn kernel() -> PathBuf {
    PathBuf::from(
        std::env::var("SANDFORK_KERNEL").expect("SANDFORK_KERNEL must name the guest vmlinux"),
    )
}

pub fn rootfs() -> PathBuf {
    PathBuf::from(
        std::env::var("SANDFORK_ROOTFS").expect("SANDFORK_ROOTFS must name the base image"),
    )
}

/// A test that runs longer than this is stuck: the watchdog prints the VM's
/// logs and ends the test process, so a hang fails loudly instead of
/// eating the CI budget.
const WATCHDOG: Duration = Duration::from_secs(300);

pub struct TestVm {
    pub dir: tempfile::TempDir,
    pub api: VmmClient,
    child: Child,
    finished: Arc<AtomicBool>,
}

fn start_watchdog(dir: PathBuf) -> Arc<AtomicBool> {
    let finished = Arc::new(AtomicBool::new(false));
    let flag = finished.clone();
    std::thread::spawn(move || {
        let start = Instant::now();
        while start.elapsed() < WATCHDOG {
            if flag.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let read = |name| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
        eprintln!(
            "watchdog: test stuck for {WATCHDOG:?}\n--- console ---\n{}\n--- vmm ---\n{}",
            read("console.log"),
            read("vmm.log")
        );
        std::process::exit(101);
    });
    finished
}

pub struct Boot {
    pub vcpus: u8,
    pub mem_mib: u64,
    /// Replaces the default kernel command line when set.
    pub boot_args: Option<String>,
    /// Extra drives: (path, read-only).
    pub drives: Vec<(PathBuf, bool)>,
}

impl Default for Boot {
    fn default() -> Self {
        Boot {
            vcpus: 1,
            mem_mib: 256,
            boot_args: None,
            drives: Vec::new(),
        }
    }
}

impl TestVm {
    /// Starts a VMM process with its API socket in a fresh directory.
    pub async fn spawn() -> TestVm {
        let dir = tempfile::tempdir().unwrap();
        let api_sock = dir.path().join("api.sock");
        let console = File::create(dir.path().join("console.log")).unwrap();
        let stderr = File::create(dir.path().join("vmm.log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_sandfork-vmm"))
            .arg("--api-sock")
            .arg(&api_sock)
            .stdin(Stdio::null())
            .stdout(console)
            .stderr(stderr)
            .spawn()
            .expect("spawning sandfork-vmm");
        let api = VmmClient::new(&api_sock);
        let finished = start_watchdog(dir.path().to_owned());
        api.wait_for_socket(Duration::from_secs(10)).await.unwrap();
        TestVm {
            dir,
            api,
            child,
            finished,
        }
    }

    pub fn vsock_path(&self) -> PathBuf {
        self.dir.path().join("vsock.sock")
    }

    /// Configures the guest (read-only base image as root) without starting it.
    pub async fn configure(&self, boot: &Boot) {
        self.api
            .put_machine_config(&MachineConfig::new(boot.vcpus, boot.mem_mib))
            .await
            .unwrap();
        self.api
            .put_boot_source(&BootSource {
                kernel_image_path: kernel().display().to_string(),
                boot_args: boot.boot_args.clone(),
                initrd_path: None,
            })
            .await
            .unwrap();
        let root = Drive::new("rootfs", rootfs().display().to_string(), true, true);
        self.api.put_drive(&root).await.unwrap();
        for (i, (path, read_only)) in boot.drives.iter().enumerate() {
            let drive = Drive::new(
                format!("data{i}"),
                path.display().to_string(),
                false,
                *read_only,
            );
            self.api.put_drive(&drive).await.unwrap();
        }
        self.api
            .put_vsock(&Vsock::new(3, self.vsock_path().display().to_string()))
            .await
            .unwrap();
    }

    pub async fn boot(&self, boot: &Boot) {
        self.configure(boot).await;
        self.api.instance_start().await.unwrap();
    }

    /// Polls the agent's health check until it answers 204; returns how long it took.
    pub async fn wait_for_agent(&mut self) -> Duration {
        let start = Instant::now();
        loop {
            if let Ok(204) = vmm_api::vsock_connect::agent_health(
                &self.vsock_path(),
                AGENT_PORT,
                Duration::from_secs(5),
            )
            .await
            {
                return start.elapsed();
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "the VMM exited ({status}) before the agent answered\n{}",
                    self.logs()
                );
            }
            assert!(
                start.elapsed() < BOOT_TIMEOUT,
                "agent not ready in time\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits for the VMM process to end.
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                start.elapsed() < timeout,
                "VMM still running\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn console(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("console.log")).unwrap_or_default()
    }

    pub fn vmm_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("vmm.log")).unwrap_or_default()
    }

    pub fn logs(&self) -> String {
        format!(
            "--- console ---\n{}\n--- vmm ---\n{}",
            self.console(),
            self.vmm_log()
        )
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for TestVm {
    fn drop(&mut self) {
        self.finished.store(true, Ordering::SeqCst);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A command line that runs `script` under bash as init instead of the agent.
pub fn bash_init(script: &str) -> String {
    format!(
        "console=ttyS0 reboot=k panic=1 pci=off nomodule i8042.noaux i8042.nomux i8042.nopnp \
         i8042.dumbkbd init=/bin/bash -- -c \"mount -t proc proc /proc; {script}\""
    )
}

pub fn write_file(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
}

//! Boots real microVMs with the `sandfork-vmm` binary for the lab tests.
//!
//! These tests need a /dev/kvm that can run a Linux guest, plus the guest
//! kernel and base image named by `SANDFORK_KERNEL` and `SANDFORK_ROOTFS`
//! (`scripts/test.sh` builds both and runs these tests in the KVM lab when
//! the host cannot boot Linux itself).

#![allow(dead_code)]

pub mod netns;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vmm_api::Drive;
use vmm_driver::VmmClient;
use vmm_driver::process::{GuestSpec, VmmProcess, diagnostics};

#[allow(unused_imports)]
pub use vmm_driver::process::AGENT_PORT;

/// Lab times are emulated and slow: leave generous room.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(120);

/// A test that runs longer than this is stuck: the watchdog prints the VM's
/// logs and ends the test process, so a hang fails loudly instead of
/// eating the CI budget.
const WATCHDOG: Duration = Duration::from_secs(300);

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

/// A `sandfork-vmm` process under test, watched by a watchdog.
pub struct TestVm {
    vm: VmmProcess,
    finished: Arc<AtomicBool>,
}

fn start_watchdog(dir: PathBuf, pid: u32) -> Arc<AtomicBool> {
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
        let api = VmmClient::new(dir.join("api.sock"));
        let report = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map(|rt| rt.block_on(diagnostics::diagnose(&dir, pid, &api)))
            .unwrap_or_else(|e| format!("(no diagnostics: {e})"));
        // Straight to the process's stderr: the test harness captures what a
        // test's threads print with eprintln!, and exit() would discard it.
        let mut stderr = std::io::stderr().lock();
        let _ = writeln!(
            stderr,
            "watchdog: a test is stuck after {WATCHDOG:?} with VMM {pid} in {}\n{report}",
            dir.display()
        );
        let _ = stderr.flush();
        std::process::exit(101);
    });
    finished
}

pub struct Boot {
    pub vcpus: u8,
    pub mem_mib: u64,
    /// Replaces the default kernel command line when set.
    pub boot_args: Option<String>,
    /// Extra drives after the read-only root: (path, read-only).
    pub drives: Vec<(PathBuf, bool)>,
    /// The CPU template (machine-config `cpu_template`); None: the host's CPU.
    pub cpu_template: Option<vmm_api::CpuTemplate>,
}

impl Default for Boot {
    fn default() -> Self {
        Boot {
            vcpus: 1,
            mem_mib: 256,
            boot_args: None,
            drives: Vec::new(),
            cpu_template: None,
        }
    }
}

impl Boot {
    fn guest(&self) -> GuestSpec {
        let mut drives = vec![Drive::new(
            "rootfs",
            rootfs().display().to_string(),
            true,
            true,
        )];
        for (i, (path, read_only)) in self.drives.iter().enumerate() {
            drives.push(Drive::new(
                format!("data{i}"),
                path.display().to_string(),
                false,
                *read_only,
            ));
        }
        GuestSpec {
            kernel: kernel(),
            boot_args: self.boot_args.clone(),
            vcpus: self.vcpus,
            mem_mib: self.mem_mib,
            drives,
            vsock: true,
            cpu_template: self.cpu_template,
        }
    }
}

impl TestVm {
    /// Starts a VMM process with its API socket in a fresh directory.
    pub async fn spawn() -> TestVm {
        let vm = VmmProcess::spawn(Path::new(env!("CARGO_BIN_EXE_sandfork-vmm")))
            .await
            .expect("spawning sandfork-vmm");
        let finished = start_watchdog(vm.dir().to_owned(), vm.pid());
        TestVm { vm, finished }
    }

    /// Watches a VMM process started some other way (in a network namespace).
    /// A VM booted with the default guest, its agent answering.
    pub async fn ready() -> TestVm {
        let mut vm = TestVm::spawn().await;
        vm.boot(&Boot::default()).await;
        vm.wait_for_agent().await;
        vm
    }

    pub fn from_process(vm: VmmProcess) -> TestVm {
        let finished = start_watchdog(vm.dir().to_owned(), vm.pid());
        TestVm { vm, finished }
    }

    pub fn api(&self) -> &VmmClient {
        self.vm.api()
    }

    pub fn pid(&self) -> u32 {
        self.vm.pid()
    }

    pub fn vm(&self) -> &VmmProcess {
        &self.vm
    }

    pub fn dir(&self) -> &Path {
        self.vm.dir()
    }

    pub fn vsock_path(&self) -> PathBuf {
        self.vm.vsock_path()
    }

    /// Configures the guest (read-only base image as root) without starting it.
    pub async fn configure(&self, boot: &Boot) {
        self.vm.configure(&boot.guest()).await.unwrap();
    }

    pub async fn boot(&self, boot: &Boot) {
        self.vm.boot(&boot.guest()).await.unwrap();
    }

    /// Boots, for a VMM that may end before it answers.
    pub async fn try_boot(&self, boot: &Boot) -> bool {
        self.vm.boot(&boot.guest()).await.is_ok()
    }

    /// Polls the agent's health check until it answers 204; returns how long it took.
    pub async fn wait_for_agent(&mut self) -> Duration {
        match self.vm.wait_for_agent(BOOT_TIMEOUT).await {
            Ok(took) => took,
            Err(e) => panic!("{e}"),
        }
    }

    /// Polls the agent's health check for at most `timeout`.
    pub async fn wait_for_agent_within(
        &mut self,
        timeout: Duration,
    ) -> Result<Duration, vmm_driver::process::ProcessError> {
        self.vm.wait_for_agent(timeout).await
    }

    /// Waits for the VMM process to end.
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        match self.vm.wait_exit(timeout).await {
            Ok(status) => status,
            Err(e) => panic!("{e}"),
        }
    }

    pub fn console(&self) -> String {
        self.vm.console()
    }

    pub fn vmm_log(&self) -> String {
        self.vm.vmm_log()
    }

    pub fn logs(&self) -> String {
        self.vm.logs()
    }

    /// Each thread of the VMM: its id, name and seccomp mode (the
    /// `Seccomp:` line of its status: 2 is a filter).
    pub fn thread_seccomp_modes(&self) -> Vec<(u32, String, String)> {
        let pid = self.pid();
        let mut threads = Vec::new();
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
            let task = task.unwrap();
            let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
                continue; // ended meanwhile
            };
            let field = |name: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .map(|v| v.trim().to_string())
                    .unwrap_or_default()
            };
            let tid = task.file_name().to_string_lossy().parse().unwrap();
            threads.push((tid, field("Name:"), field("Seccomp:")));
        }
        threads
    }
}

impl Drop for TestVm {
    fn drop(&mut self) {
        self.finished.store(true, Ordering::SeqCst);
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

/// The host's end of a guest network: a persistent tap with an address, up; deleted
/// on drop. Taps get one fixed host MAC, so a guest restored onto another tap finds
/// the host at the address its ARP cache already holds.
pub struct HostTap {
    pub name: String,
}

pub const HOST_TAP_MAC: &str = "02:5f:00:00:00:01";
/// The host's address on every test tap, and the guest's.
pub const HOST_IP: &str = "172.16.0.1";
pub const GUEST_IP: &str = "172.16.0.2";
pub const GUEST_MAC: &str = "06:00:ac:10:00:02";

fn ip(args: &[&str]) {
    let status = std::process::Command::new("ip")
        .args(args)
        .status()
        .expect("running ip");
    assert!(status.success(), "ip {}: {status}", args.join(" "));
}

impl HostTap {
    pub fn create(name: &str) -> HostTap {
        // A tap left by an earlier, killed run would make `add` fail.
        let _ = std::process::Command::new("ip")
            .args(["link", "del", name])
            .stderr(std::process::Stdio::null())
            .status();
        ip(&["tuntap", "add", "dev", name, "mode", "tap"]);
        let tap = HostTap {
            name: name.to_owned(),
        };
        ip(&["link", "set", "dev", name, "address", HOST_TAP_MAC]);
        ip(&["addr", "add", &format!("{HOST_IP}/30"), "dev", name]);
        ip(&["link", "set", name, "up"]);
        tap
    }
}

impl Drop for HostTap {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.name])
            .status();
    }
}

/// Has the guest send `mib` MiB over TCP to `sink` (a listener in this process
/// the guest can reach at its address); checks all of it arrived and returns
/// the time from its first byte to its end.
pub async fn guest_sends_mib(
    agent: &vmm_driver::agent_client::AgentClient,
    sink: std::net::TcpListener,
    mib: usize,
) -> Duration {
    use std::io::Read;
    let addr = sink.local_addr().unwrap();
    let received = std::thread::spawn(move || {
        let (mut conn, _) = sink.accept().unwrap();
        let mut buf = vec![0u8; 1 << 16];
        let (mut total, mut first) = (0usize, None);
        loop {
            let n = conn.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            first.get_or_insert_with(Instant::now);
            total += n;
        }
        (total, first.map(|t| t.elapsed()))
    });
    let send = format!(
        "import socket\n\
         s = socket.create_connection(('{}', {}), timeout=120)\n\
         buf = b'x' * 65536\n\
         for _ in range({}):\n\
         \x20   s.sendall(buf)\n\
         s.close()\n",
        addr.ip(),
        addr.port(),
        mib * 16
    );
    let out = agent.run_argv("python3", &["-c", &send]).await.unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");
    let (total, took) = received.join().unwrap();
    assert_eq!(total, mib << 20);
    took.unwrap()
}

/// Sends `payload` from the guest to a listener in this process over TCP and back
/// the other way; checks the exact bytes both ways.
pub async fn tcp_exchange(agent: &vmm_driver::agent_client::AgentClient) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind((HOST_IP, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let host = tokio::spawn(async move {
        let (mut stream, peer) = listener.accept().await.unwrap();
        let mut got = Vec::new();
        stream.read_to_end(&mut got).await.unwrap();
        stream.write_all(b"hello from the host").await.unwrap();
        stream.shutdown().await.unwrap();
        (got, peer)
    });
    let script = format!(
        "import socket\n\
         s = socket.create_connection(('{HOST_IP}', {port}), timeout=60)\n\
         s.sendall(b'hello from the guest')\n\
         s.shutdown(socket.SHUT_WR)\n\
         data = b''\n\
         while True:\n\
         \x20   chunk = s.recv(4096)\n\
         \x20   if not chunk:\n\
         \x20       break\n\
         \x20   data += chunk\n\
         print(data.decode())\n"
    );
    let out = agent.run_argv("python3", &["-c", &script]).await.unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");
    assert_eq!(out.stdout, "hello from the host\n");
    let (got, peer) = tokio::time::timeout(Duration::from_secs(60), host)
        .await
        .expect("the host side finished")
        .unwrap();
    assert_eq!(got, b"hello from the guest");
    assert_eq!(peer.ip().to_string(), GUEST_IP);
}

/// Brings the guest's eth0 up with [`GUEST_IP`] and pings the host three times.
pub async fn guest_net_up_and_ping(agent: &vmm_driver::agent_client::AgentClient) -> String {
    let out = agent
        .run(&format!(
            "ip addr add {GUEST_IP}/30 dev eth0 && ip link set eth0 up && \
             cat /sys/class/net/eth0/address && ping -c 3 -W 10 {HOST_IP}"
        ))
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");
    assert!(out.stdout.contains("3 received"), "{out:?}");
    out.stdout
}

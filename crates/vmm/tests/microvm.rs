//! Lab tests: real microVMs booted by the `sandfork-vmm` binary.
//! Run with `scripts/test.sh`, which provides KVM, the kernel and the image.

#![cfg(test)]

mod common;

use std::time::Duration;

use common::{AGENT_PORT, Boot, TestVm, bash_init};
use vmm_api::{InstanceState, NetworkInterface, VcpuPhase};
use vmm_driver::vsock_connect::{VsockConnectError, agent_health};

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn boots_to_agent_over_vsock_and_shuts_down_on_ctrl_alt_del() {
    let mut vm = TestVm::spawn().await;
    vm.boot(&Boot::default()).await;
    let ready = vm.wait_for_agent().await;
    eprintln!("boot to agent: {ready:?}");
    assert_eq!(
        vm.api().get_instance_info().await.unwrap().state,
        InstanceState::Running
    );

    // Every thread is under its seccomp filter once the guest runs: the
    // main thread, the vCPUs, the API thread and the device workers.
    let threads = vm.thread_seccomp_modes();
    let pid = vm.pid();
    assert!(threads.iter().any(|(tid, _, _)| *tid == pid), "{threads:?}");
    assert!(
        threads.iter().any(|(_, name, _)| name.starts_with("vcpu")),
        "{threads:?}"
    );
    assert!(
        threads.iter().all(|(_, _, mode)| mode == "2"),
        "{threads:?}"
    );

    vm.api().send_ctrl_alt_del().await.unwrap();
    let status = vm.wait_exit(Duration::from_secs(60)).await;
    assert_eq!(status.code(), Some(0), "{}", vm.logs());
    assert!(
        vm.vmm_log().contains("shut down or rebooted"),
        "{}",
        vm.logs()
    );
    assert!(!vm.vsock_path().exists(), "vsock socket left behind");
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn two_vms_with_two_vcpus_run_at_once() {
    let mut a = TestVm::spawn().await;
    let mut b = TestVm::spawn().await;
    let boot = Boot {
        vcpus: 2,
        ..Boot::default()
    };
    a.boot(&boot).await;
    b.boot(&boot).await;
    a.wait_for_agent().await;
    b.wait_for_agent().await;
    for vm in [&a, &b] {
        assert!(
            vm.console().contains("smp: Brought up 1 node, 2 CPUs"),
            "{}",
            vm.logs()
        );
    }
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn a_guest_that_stops_answering_is_diagnosed() {
    // One vCPU: two-vCPU guests are where the lab's emulator stalls (see
    // README, "Hangs"); the reports are per vCPU either way.
    let mut vm = TestVm::ready().await;

    // Running: each vCPU thread answers its kick with where it is.
    let running = vm.api().get_vcpus().await.unwrap();
    assert_eq!(running.len(), 1, "{running:?}");
    for (i, vcpu) in running.iter().enumerate() {
        assert_eq!(usize::from(vcpu.id), i);
        assert!(
            matches!(vcpu.phase, VcpuPhase::InGuest | VcpuPhase::InVmm),
            "{vcpu}"
        );
        assert!(vcpu.exits > 0, "{vcpu}");
        assert!(
            vcpu.registers.as_deref().unwrap_or("").contains("rip="),
            "{vcpu}"
        );
        assert!(vcpu.mp_state.is_some(), "{vcpu}");
    }

    // The debug hook: the guest stopped under the agent, as a hung guest
    // looks from the host. The bounded wait fails with the diagnostics.
    vm.api().pause().await.unwrap();
    let err = vm
        .wait_for_agent_within(Duration::from_secs(5))
        .await
        .expect_err("a paused guest's agent does not answer")
        .to_string();
    let last_console_line = vm.console().lines().last().unwrap_or_default().to_owned();
    for part in [
        "the guest agent's health check did not happen within 5s",
        "--- console (tail) ---",
        last_console_line.as_str(),
        "--- vmm log (tail) ---",
        "vcpu0: Paused",
        "--- VMM threads",
        " vcpu0 ",
        "--- host kernel messages (tail) ---",
        "--- end of diagnostics ---",
    ] {
        assert!(err.contains(part), "no {part:?} in:\n{err}");
    }
    // Paused vCPUs still answer with their registers.
    assert!(err.contains("mp_state"), "{err}");
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn read_write_disk_keeps_guest_writes_read_only_disk_refuses_them() {
    let dir = tempfile::tempdir().unwrap();
    let rw = dir.path().join("rw.img");
    let ro = dir.path().join("ro.img");
    common::write_file(&rw, &vec![0u8; 1 << 20]);
    common::write_file(&ro, &vec![0u8; 1 << 20]);

    let script = "echo -n written-by-guest | dd of=/dev/vdb conv=fsync 2>/dev/null; echo rw=$?; \
                  echo -n written-by-guest | dd of=/dev/vdc conv=fsync 2>/dev/null; echo ro=$?; \
                  head -c 5 /dev/vdc >/dev/null && echo ro-readable; \
                  echo b > /proc/sysrq-trigger";
    let mut vm = TestVm::spawn().await;
    vm.boot(&Boot {
        boot_args: Some(bash_init(script)),
        drives: vec![(rw.clone(), false), (ro.clone(), true)],
        ..Boot::default()
    })
    .await;
    let status = vm.wait_exit(common::BOOT_TIMEOUT).await;
    assert_eq!(status.code(), Some(0), "{}", vm.logs());
    let console = vm.console();
    assert!(console.contains("rw=0"), "{console}");
    assert!(console.contains("ro=1"), "{console}");
    assert!(console.contains("ro-readable"), "{console}");
    assert!(std::fs::read(&rw).unwrap().starts_with(b"written-by-guest"));
    assert!(std::fs::read(&ro).unwrap().iter().all(|b| *b == 0));
}

/// Boots a guest whose init at once writes `key` to /proc/sysrq-trigger;
/// checks its VMM ended with exit status `code`.
async fn sysrq(key: char, code: i32) -> TestVm {
    let mut vm = TestVm::spawn().await;
    vm.boot(&Boot {
        boot_args: Some(bash_init(&format!("echo {key} > /proc/sysrq-trigger"))),
        ..Boot::default()
    })
    .await;
    let status = vm.wait_exit(common::BOOT_TIMEOUT).await;
    assert_eq!(status.code(), Some(code), "{}", vm.logs());
    vm
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn guest_reboot_ends_the_vmm_cleanly() {
    let vm = sysrq('b', 0).await;
    assert!(
        !vm.dir().join("api.sock").exists(),
        "API socket left behind"
    );
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn guest_panic_ends_the_vmm_with_a_panic_status() {
    let vm = sysrq('c', 2).await;
    assert!(
        vm.console().contains("sysrq: Trigger a crash"),
        "{}",
        vm.logs()
    );
    assert!(vm.vmm_log().contains("panicked"), "{}", vm.logs());
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn pause_stops_the_guest_and_resume_continues_it() {
    let vm = TestVm::ready().await;

    vm.api().pause().await.unwrap();
    assert_eq!(
        vm.api().get_instance_info().await.unwrap().state,
        InstanceState::Paused
    );
    let paused = agent_health(&vm.vsock_path(), AGENT_PORT, Duration::from_secs(3)).await;
    assert!(
        matches!(paused, Err(VsockConnectError::Timeout(..))),
        "{paused:?}"
    );

    vm.api().resume().await.unwrap();
    assert_eq!(
        vm.api().get_instance_info().await.unwrap().state,
        InstanceState::Running
    );
    let resumed = agent_health(&vm.vsock_path(), AGENT_PORT, Duration::from_secs(30)).await;
    assert_eq!(resumed.unwrap(), 204);
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn bad_requests_after_start_and_to_unheard_ports_fail_cleanly() {
    let vm = TestVm::ready().await;

    let drive = vmm_api::Drive::new("late", common::rootfs().display().to_string(), false, true);
    let err = vm.api().put_drive(&drive).await.unwrap_err().to_string();
    assert!(err.contains("not supported after starting"), "{err}");
    let err = vm.api().instance_start().await.unwrap_err().to_string();
    assert!(err.contains("not supported after starting"), "{err}");

    let refused = vmm_driver::vsock_connect::connect(&vm.vsock_path(), 4242).await;
    assert!(
        matches!(refused, Err(VsockConnectError::Refused(4242))),
        "{refused:?}"
    );
    // The VM is unharmed.
    assert_eq!(
        agent_health(&vm.vsock_path(), AGENT_PORT, Duration::from_secs(30))
            .await
            .unwrap(),
        204
    );
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn the_agent_serves_envd_over_vsock() {
    let vm = TestVm::ready().await;
    let agent = vm.vm().agent();

    let out = agent
        .run("echo out; echo err >&2; id -un; exit 3")
        .await
        .unwrap();
    assert_eq!(out.exit_code, 3, "{out:?}");
    assert_eq!(out.stdout, "out\nroot\n");
    assert_eq!(out.stderr, "err\n");

    // A file written over /files is seen by processes, and the other way round.
    let payload: Vec<u8> = (0..3 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    agent
        .write_file("/tmp/dir with space/data.bin", payload.clone())
        .await
        .unwrap();
    let seen = agent
        .run("f='/tmp/dir with space/data.bin'; wc -c < \"$f\"; od -An -tu1 -j 1000 -N 4 \"$f\"")
        .await
        .unwrap();
    let words: Vec<&str> = seen.stdout.split_whitespace().collect();
    assert_eq!(words, ["3145728", "247", "248", "249", "250"], "{seen:?}");
    assert_eq!(
        agent
            .read_file("/tmp/dir with space/data.bin")
            .await
            .unwrap(),
        payload
    );
    agent.run("echo from-guest > /tmp/g.txt").await.unwrap();
    assert_eq!(
        agent.read_file("/tmp/g.txt").await.unwrap().as_ref(),
        b"from-guest\n"
    );
    let missing = agent.read_file("/tmp/none").await.unwrap_err().to_string();
    assert!(missing.contains("404"), "{missing}");

    // Init sets the guest's wall clock.
    agent
        .init(&vmm_driver::agent_client::AgentInit::after_restore().unwrap())
        .await
        .unwrap();
    let guest_now: u64 = agent
        .run("date +%s")
        .await
        .unwrap()
        .stdout
        .trim()
        .parse()
        .unwrap();
    let host_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(
        guest_now.abs_diff(host_now) <= 5,
        "{guest_now} vs {host_now}"
    );
}

#[tokio::test]
#[ignore = "lab: boots a microVM with a network interface on a tap"]
async fn a_guest_on_a_tap_pings_the_host_and_talks_tcp() {
    let tap = common::HostTap::create("sfk0");
    let mut vm = TestVm::spawn().await;
    vm.configure(&Boot::default()).await;
    let api = vm.api().clone();

    // Refused before boot with a message that names the problem.
    let bad_mac = NetworkInterface::new("eth0", &tap.name, Some("06:00:ac:10:00"));
    let err = api.put_network_interface(&bad_mac).await.unwrap_err();
    assert!(err.to_string().contains("guest_mac"), "{err}");
    let not_a_tap = NetworkInterface::new("eth0", "lo", None);
    let err = api.put_network_interface(&not_a_tap).await.unwrap_err();
    assert!(err.to_string().contains("cannot attach to tap lo"), "{err}");

    let net = NetworkInterface::new("eth0", &tap.name, Some(common::GUEST_MAC));
    api.put_network_interface(&net).await.unwrap();
    let config = api.get_vm_config().await.unwrap();
    assert_eq!(config.network_interfaces, vec![net.clone()]);
    api.instance_start().await.unwrap();
    vm.wait_for_agent().await;

    let err = api.put_network_interface(&net).await.unwrap_err();
    assert!(
        err.to_string().contains("not supported after starting"),
        "{err}"
    );

    let agent = vm.vm().agent();
    let stdout = common::guest_net_up_and_ping(&agent).await;
    assert!(stdout.starts_with(common::GUEST_MAC), "{stdout}");
    common::tcp_exchange(&agent).await;
    // 8 MiB: the guest's TX path runs at 1-2 MiB/s in the emulated lab, and
    // 32 MiB overran the agent's 60 s command timeout on a busy CI host.
    guest_to_host_throughput(&agent, 8).await;
}

/// Streams `mib` MiB from the guest to the host over TCP; prints the rate.
async fn guest_to_host_throughput(agent: &vmm_driver::agent_client::AgentClient, mib: usize) {
    let sink = std::net::TcpListener::bind((common::HOST_IP, 0)).unwrap();
    let took = common::guest_sends_mib(agent, sink, mib).await;
    eprintln!(
        "guest -> host TCP over virtio-net/tap: {mib} MiB in {took:?} = {:.1} MiB/s (emulated lab)",
        mib as f64 / took.as_secs_f64()
    );
}

/// Arms the VMM's debug-only seccomp self-test for threads of `kind`,
/// boots, and checks the VMM ended with status 148 and said why.
async fn a_forbidden_call_ends_the_vmm(kind: &str) {
    // The VMM inherits the variable at spawn; nothing else here reads the
    // environment.
    // SAFETY: tests in this binary run one at a time (--test-threads=1).
    unsafe { std::env::set_var("SANDFORK_VMM_SECCOMP_SELF_TEST", kind) };
    let mut vm = TestVm::spawn().await;
    // SAFETY: as above.
    unsafe { std::env::remove_var("SANDFORK_VMM_SECCOMP_SELF_TEST") };
    // The VMM may or may not get far enough to answer the boot request.
    let _ = vm.try_boot(&Boot::default()).await;
    let status = vm.wait_exit(common::BOOT_TIMEOUT).await;
    assert_eq!(status.code(), Some(148), "{}", vm.logs());
    let line = format!(
        "forbidden system call {} in a {kind} thread",
        libc::SYS_uname
    );
    assert!(vm.vmm_log().contains(&line), "{}", vm.logs());
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn a_vcpu_thread_making_a_forbidden_call_ends_the_vmm_with_status_148() {
    // vCPU threads call uname right after their filter is in, before any
    // guest code (the debug-only hook in crates/vmm/src/seccomp.rs).
    a_forbidden_call_ends_the_vmm("vcpu").await;
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn the_main_thread_making_a_forbidden_call_ends_the_vmm_with_status_148() {
    // The main thread, once the VM is built.
    a_forbidden_call_ends_the_vmm("main").await;
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn a_device_thread_making_a_forbidden_call_ends_the_vmm_with_status_148() {
    // Device workers, as soon as the guest's driver starts them.
    a_forbidden_call_ends_the_vmm("device").await;
}

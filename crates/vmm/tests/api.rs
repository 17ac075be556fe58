//! The VMM binary's API refuses bad input before boot with a clear 400 and
//! keeps serving. These run on any host: nothing here starts a guest.

#![cfg(test)]

mod common;

use std::process::{Command, Stdio};

use common::TestVm;
use vmm_api::{BootSource, Drive, MachineConfig, Vsock};
use vmm_driver::ClientError;

fn fault(result: Result<(), ClientError>) -> String {
    match result {
        Err(ClientError::Api {
            status,
            fault_message,
        }) => {
            assert_eq!(status, 400, "{fault_message}");
            fault_message
        }
        other => panic!("expected a 400, got {other:?}"),
    }
}

#[tokio::test]
async fn missing_kernel_and_drive_files_are_refused() {
    let vm = TestVm::spawn().await;
    let msg = fault(
        vm.api()
            .put_boot_source(&BootSource {
                kernel_image_path: "/nonexistent/vmlinux".into(),
                boot_args: None,
                initrd_path: None,
            })
            .await,
    );
    assert!(msg.contains("/nonexistent/vmlinux"), "{msg}");
    let msg = fault(
        vm.api()
            .put_drive(&Drive::new("root", "/nonexistent/disk.img", true, false))
            .await,
    );
    assert!(msg.contains("/nonexistent/disk.img"), "{msg}");
    let dir = tempfile::tempdir().unwrap();
    let msg = fault(
        vm.api()
            .put_drive(&Drive::new(
                "root",
                dir.path().display().to_string(),
                true,
                true,
            ))
            .await,
    );
    assert!(msg.contains("directory"), "{msg}");
    // The VMM is still there and unconfigured.
    let info = vm.api().get_instance_info().await.unwrap();
    assert_eq!(info.state, vmm_api::InstanceState::NotStarted);
    assert!(vm.api().get_vm_config().await.unwrap().drives.is_empty());
}

/// Whether this host's CPU has `flag` (`/proc/cpuinfo`).
fn host_has(flag: &str) -> bool {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|w| w == flag))
}

/// Checks the CPU templates against this host's own KVM (PVM's answers
/// `KVM_GET_SUPPORTED_CPUID` too): a template is accepted, or refused
/// naming what is missing; one whose features the host's CPU lacks is
/// refused; Firecracker's are refused whatever the host.
#[tokio::test]
async fn cpu_templates_are_checked_against_this_hosts_kvm() {
    let vm = TestVm::spawn().await;
    let put = async |t: vmm_api::CpuTemplate| {
        let machine = MachineConfig {
            cpu_template: Some(t),
            ..MachineConfig::new(1, 128)
        };
        vm.api().put_machine_config(&machine).await
    };
    let msg = fault(put(vmm_api::CpuTemplate::T2).await);
    assert!(msg.contains("T2 is not supported"), "{msg}");
    let kvm = std::path::Path::new("/dev/kvm").exists();
    for t in vmm_api::CpuTemplate::SUPPORTED {
        match put(t).await {
            Ok(()) => {
                let got = vm.api().get_machine_config().await.unwrap();
                assert_eq!(got.cpu_template, Some(t));
                eprintln!("{t}: accepted");
            }
            Err(e) => {
                let msg = fault(Err(e));
                assert!(
                    msg.starts_with(&format!(
                        "CPU template {t}: this host's KVM does not support "
                    )),
                    "{msg}"
                );
                eprintln!("{msg}");
            }
        }
    }
    if kvm && !host_has("avx512f") {
        let msg = fault(put(vmm_api::CpuTemplate::X86_64V4).await);
        assert!(msg.contains("avx512f"), "{msg}");
    }
    if kvm && !host_has("avx2") {
        let msg = fault(put(vmm_api::CpuTemplate::X86_64V3).await);
        assert!(msg.contains("avx2"), "{msg}");
    }
}

#[tokio::test]
async fn impossible_machine_configs_are_refused() {
    let vm = TestVm::spawn().await;
    for (vcpus, mem) in [(0, 128), (33, 128), (1, 0), (1, 1 << 40)] {
        fault(
            vm.api()
                .put_machine_config(&MachineConfig::new(vcpus, mem))
                .await,
        );
    }
    // Nothing of the refused configs stuck.
    assert_eq!(
        vm.api().get_machine_config().await.unwrap(),
        MachineConfig::default()
    );
    vm.api()
        .put_machine_config(&MachineConfig::new(2, 512))
        .await
        .unwrap();
    assert_eq!(vm.api().get_machine_config().await.unwrap().vcpu_count, 2);
}

#[tokio::test]
async fn actions_out_of_order_are_refused() {
    let vm = TestVm::spawn().await;
    let msg = fault(vm.api().instance_start().await);
    assert!(msg.contains("without kernel configuration"), "{msg}");
    let msg = fault(vm.api().pause().await);
    assert!(msg.contains("before starting"), "{msg}");
    fault(vm.api().resume().await);
    fault(vm.api().send_ctrl_alt_del().await);
    let msg = fault(
        vm.api()
            .put_vsock(&Vsock::new(3, "/nonexistent-dir/v.sock"))
            .await,
    );
    assert!(msg.contains("does not exist"), "{msg}");
}

#[tokio::test]
async fn malformed_json_is_refused_and_the_server_keeps_serving() {
    let vm = TestVm::spawn().await;
    for body in [
        &b"{"[..],
        b"[]",
        b"{\"vcpu_count\": \"two\", \"mem_size_mib\": 128}",
        b"\xff\xfe",
    ] {
        let response = vm
            .api()
            .request(
                vmm_driver::Method::PUT,
                "/machine-config",
                Some(body.to_vec()),
            )
            .await
            .unwrap();
        assert_eq!(response.status, 400);
        let body: serde_json::Value = serde_json::from_slice(&response.body).unwrap();
        assert!(
            body["fault_message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{body}"
        );
    }
    assert!(vm.api().get_instance_info().await.is_ok());
}

#[test]
fn a_bad_config_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("vm.json");
    std::fs::write(
        &config,
        r#"{"boot-source": {"kernel_image_path": "/nonexistent/vmlinux"}, "drives": []}"#,
    )
    .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_sandfork-vmm"))
        .arg("--no-api")
        .arg("--config-file")
        .arg(&config)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("/nonexistent/vmlinux"), "{stderr}");

    std::fs::write(&config, "{ not json").unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_sandfork-vmm"))
        .args(["--no-api", "--config-file"])
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("parsing"));
}

/// A 2 MiB transparent huge page behind a thread's stack was about half of an
/// idle sandbox's private memory: the VMM turns them off for itself.
#[tokio::test]
async fn the_vmm_runs_without_transparent_huge_pages() {
    let vm = TestVm::spawn().await;
    let status = std::fs::read_to_string(format!("/proc/{}/status", vm.pid())).unwrap();
    let thp = status
        .lines()
        .find_map(|l| l.strip_prefix("THP_enabled:"))
        .expect("a THP_enabled line");
    assert_eq!(thp.trim(), "0", "{status}");
}

//! Boots real lab machines. Slow (tens of seconds each under TCG):
//! `cargo test -p sandfork-lab --test lab_run -- --ignored --test-threads=1`.

#![cfg(test)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sandfork_lab::{
    Lab, LabConfig, LabError, OutputMode, PortForward, TcgThreads, default_cache_dir,
};

/// Each machine takes a host core per vCPU: one at a time.
static ONE_MACHINE: Mutex<()> = Mutex::new(());

const INSIDE: &str = "SANDFORK_LAB_TEST_INSIDE";

fn lab() -> Lab {
    Lab::prepare(&default_cache_dir()).expect("prepare the lab")
}

fn captured() -> LabConfig {
    LabConfig {
        output: OutputMode::Capture,
        timeout: Some(Duration::from_secs(600)),
        ..LabConfig::default()
    }
}

fn argv(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

#[test]
#[ignore = "lab: boots QEMU"]
fn command_output_and_exit_code_come_back() {
    let _one = ONE_MACHINE.lock().unwrap_or_else(|e| e.into_inner());
    let out = lab()
        .run(
            &captured(),
            &argv(&[
                "sh",
                "-c",
                "ls -l /dev/kvm; grep -c -w svm /proc/cpuinfo; pwd; echo hi >&2; exit 7",
            ]),
        )
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.code, 7, "stdout: {stdout}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].starts_with("crw") && lines[0].ends_with("/dev/kvm"));
    assert_ne!(lines[1], "0", "the lab CPU must have svm");
    let cwd = std::env::current_dir().unwrap();
    assert_eq!(lines[2], cwd.to_str().unwrap());
    assert_eq!(out.stderr, b"hi\n");
}

/// Opens /dev/kvm and makes a VM and a vCPU: what a VMM does first.
fn kvm_ioctls() -> Result<(), String> {
    const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;
    const KVM_CREATE_VM: libc::c_ulong = 0xAE01;
    const KVM_CREATE_VCPU: libc::c_ulong = 0xAE41;
    let kvm = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map_err(|e| format!("open /dev/kvm: {e}"))?;
    use std::os::fd::AsRawFd;
    // SAFETY: these KVM ioctls take an integer argument and touch no memory
    // of ours; the results are checked.
    let (api, vm) = unsafe {
        (
            libc::ioctl(kvm.as_raw_fd(), KVM_GET_API_VERSION, 0),
            libc::ioctl(kvm.as_raw_fd(), KVM_CREATE_VM, 0),
        )
    };
    println!("KVM_GET_API_VERSION={api}");
    if api != 12 || vm < 0 {
        return Err(format!("api {api}, vm fd {vm}"));
    }
    // SAFETY: as above; vm is a fresh VM fd owned here.
    let vcpu = unsafe { libc::ioctl(vm, KVM_CREATE_VCPU, 0) };
    println!(
        "KVM_CREATE_VM=ok KVM_CREATE_VCPU={}",
        if vcpu >= 0 { "ok" } else { "failed" }
    );
    // SAFETY: closing fds this function opened.
    unsafe {
        if vcpu >= 0 {
            libc::close(vcpu);
        }
        libc::close(vm);
    }
    if vcpu < 0 {
        return Err("KVM_CREATE_VCPU failed".into());
    }
    Ok(())
}

/// Runs this very test binary inside the lab: a host-built, dynamically linked
/// Rust binary, KVM ioctls, and a read-write share under the lab's own /tmp.
#[test]
#[ignore = "lab: boots QEMU"]
fn this_test_binary_runs_inside_with_kvm() {
    if let Some(rw) = std::env::var_os(INSIDE) {
        kvm_ioctls().unwrap();
        std::fs::write(std::path::Path::new(&rw).join("written-inside"), "yes").unwrap();
        return;
    }
    let _one = ONE_MACHINE.lock().unwrap_or_else(|e| e.into_inner());
    let rw = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let config = LabConfig {
        env: vec![(INSIDE.into(), rw.path().to_str().unwrap().into())],
        rw_dirs: vec![rw.path().to_path_buf()],
        ..captured()
    };
    let out = lab()
        .run(
            &config,
            &argv(&[
                exe.to_str().unwrap(),
                "--exact",
                "this_test_binary_runs_inside_with_kvm",
                "--ignored",
                "--nocapture",
            ]),
        )
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.code,
        0,
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("KVM_GET_API_VERSION=12"), "{stdout}");
    assert!(stdout.contains("KVM_CREATE_VCPU=ok"), "{stdout}");
    assert_eq!(
        std::fs::read_to_string(rw.path().join("written-inside")).unwrap(),
        "yes"
    );
}

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A server inside, reached through a forwarded port, then killed.
#[test]
#[ignore = "lab: boots QEMU"]
fn forwarded_port_reaches_a_server_inside() {
    let _one = ONE_MACHINE.lock().unwrap_or_else(|e| e.into_inner());
    let site = tempfile::tempdir().unwrap();
    std::fs::write(site.path().join("index.html"), "served from the lab\n").unwrap();
    let port = free_port();
    let config = LabConfig {
        forwards: vec![PortForward {
            host_addr: Ipv4Addr::LOCALHOST,
            host_port: port,
            guest_port: 8000,
        }],
        // The site is under /tmp, which the lab covers: share it.
        rw_dirs: vec![site.path().to_path_buf()],
        ..captured()
    };
    // busybox is on every host the lab runs on (busybox-static).
    let mut child = lab()
        .spawn(
            &config,
            &argv(&[
                "busybox",
                "httpd",
                "-f",
                "-p",
                "8000",
                "-h",
                site.path().to_str().unwrap(),
            ]),
        )
        .expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(300);
    let body = loop {
        assert!(Instant::now() < deadline, "no answer through the forward");
        if let Some(b) = get(port) {
            break b;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(body.contains("served from the lab"), "{body}");
    child.kill().unwrap();
    assert!(matches!(child.wait(), Err(LabError::Killed)));
}

/// One HTTP GET; None until the server answers (slirp accepts the connection
/// before anything listens inside, then closes it).
fn get(port: u16) -> Option<String> {
    let mut s = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(b"GET / HTTP/1.0\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    body.starts_with("HTTP/").then_some(body)
}

#[test]
#[ignore = "lab: boots QEMU"]
fn missing_command_and_timeout_are_errors() {
    let _one = ONE_MACHINE.lock().unwrap_or_else(|e| e.into_inner());
    let lab = lab();
    match lab.run(&captured(), &argv(&["no-such-command-in-the-lab"])) {
        Err(LabError::CommandNotFound { program }) => {
            assert_eq!(program, "no-such-command-in-the-lab")
        }
        other => panic!("expected CommandNotFound, got {other:?}"),
    }
    let config = LabConfig {
        timeout: Some(Duration::from_secs(3)),
        ..captured()
    };
    let started = Instant::now();
    match lab.run(&config, &argv(&["sleep", "1000"])) {
        Err(LabError::Timeout { after, .. }) => assert!(after >= Duration::from_secs(3)),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
#[ignore = "lab: boots QEMU"]
fn a_timeout_reports_the_machines_kernel_messages_and_threads() {
    let _one = ONE_MACHINE.lock().unwrap_or_else(|e| e.into_inner());
    let config = LabConfig {
        timeout: Some(Duration::from_secs(40)),
        ..captured()
    };
    // The command is up long before the timeout: a stuck job, as a hung test is.
    let script = "echo sandfork-stuck-job >/dev/kmsg; exec sleep 1000";
    let err = lab()
        .run(&config, &argv(&["sh", "-c", script]))
        .expect_err("the job overruns its timeout");
    let LabError::Timeout { diagnostics, .. } = &err else {
        panic!("expected Timeout, got {err:?}");
    };
    let message = err.to_string();
    for part in ["lab kernel messages", "sandfork-stuck-job", "MemAvailable"] {
        assert!(diagnostics.contains(part), "no {part:?} in:\n{message}");
    }
    // The job's thread, asleep in the kernel, with where it waits.
    assert!(
        diagnostics
            .lines()
            .any(|l| l.contains(" sleep S ") && !l.ends_with(" -")),
        "no sleeping job thread in:\n{message}"
    );
    assert!(message.contains("the lab's state just before"), "{message}");
}

/// `MODULE.PARAM=VALUE` on the lab kernel's command line reaches that module
/// when init loads it, as modprobe would pass it (insmod does not).
#[test]
#[ignore = "lab: boots QEMU"]
fn module_parameters_on_the_kernel_command_line_reach_the_module() {
    let _one = ONE_MACHINE.lock().unwrap_or_else(|e| e.into_inner());
    let config = LabConfig {
        cpus: 1,
        tcg_threads: TcgThreads::Single,
        kernel_args: vec!["kvm_amd.vgif=0".into()],
        ..captured()
    };
    let out = lab()
        .run(
            &config,
            &argv(&["cat", "/sys/module/kvm_amd/parameters/vgif"]),
        )
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        (out.code, stdout.trim()),
        (0, "0"),
        "stderr: {:?}",
        out.stderr
    );
}

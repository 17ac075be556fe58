//! The server over a real Unix socket, driven by `VmmClient` and by raw HTTP, with a
//! small controller thread that answers actions the way the VMM's controller does:
//! polling the receiver's eventfd, then draining the queue.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener as StdUnixListener, UnixStream as StdUnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc::TryRecvError;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_api::{
    Balloon, BalloonStats, BalloonStatsUpdate, BalloonUpdate, BootSource, Drive, InstanceInfo,
    InstanceState, MachineConfig, MachineConfigUpdate, NetworkInterface, PartialDrive,
    SnapshotCreateParams, SnapshotLoadParams, SnapshotType, VmConfig, VmmAction, VmmActionError,
    VmmData, Vsock,
};
use vmm_driver::{ClientError, VmmClient};

use super::{ApiRequestReceiver, ApiServerError, ApiServerHandle, spawn_api_server};

type ActionLog = Arc<Mutex<Vec<VmmAction>>>;

struct TestVmm {
    server: Option<ApiServerHandle>,
    controller: Option<JoinHandle<()>>,
    actions: ActionLog,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl TestVmm {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("api.sock");
        let (server, receiver) = spawn_api_server(&socket).unwrap();
        let actions = ActionLog::default();
        let log = actions.clone();
        let controller = std::thread::Builder::new()
            .name("test-controller".into())
            .spawn(move || run_controller(receiver, log))
            .unwrap();
        Self {
            server: Some(server),
            controller: Some(controller),
            actions,
            socket,
            _dir: dir,
        }
    }

    fn client(&self) -> VmmClient {
        VmmClient::new(&self.socket)
    }

    fn actions(&self) -> Vec<VmmAction> {
        self.actions.lock().unwrap().clone()
    }

    fn stop(&mut self) {
        if let Some(server) = self.server.take() {
            server.shutdown().unwrap();
        }
        // The controller sees the channel close once the server thread is gone.
        if let Some(controller) = self.controller.take() {
            controller.join().unwrap();
        }
    }
}

impl Drop for TestVmm {
    fn drop(&mut self) {
        self.stop();
    }
}

#[derive(Default)]
struct ControllerState {
    machine: MachineConfig,
    boot: Option<BootSource>,
    drives: Vec<Drive>,
    vsock: Option<Vsock>,
    nets: Vec<NetworkInterface>,
    balloon: Option<Balloon>,
    state: Option<InstanceState>,
}

fn run_controller(receiver: ApiRequestReceiver, log: ActionLog) {
    let mut vm = ControllerState::default();
    loop {
        let mut pfd = libc::pollfd {
            fd: receiver.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is a valid pollfd for the duration of the call and nfds is 1.
        unsafe { libc::poll(&mut pfd, 1, 20) };
        receiver.clear_event();
        loop {
            let request = match receiver.try_recv() {
                Ok(r) => r,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            };
            log.lock().unwrap().push(request.action.clone());
            let result = answer(&mut vm, request.action.clone());
            request.respond(result);
        }
    }
}

fn answer(vm: &mut ControllerState, action: VmmAction) -> Result<VmmData, VmmActionError> {
    let started = vm.state.is_some();
    let pre_boot = |what: &str| {
        if started {
            Err(VmmActionError::bad_request(format!(
                "{what} is only allowed before InstanceStart"
            )))
        } else {
            Ok(())
        }
    };
    match action {
        VmmAction::GetInstanceInfo => Ok(VmmData::InstanceInfo(InstanceInfo {
            id: "test".into(),
            state: vm.state.unwrap_or(InstanceState::NotStarted),
            vmm_version: "0.1.0".into(),
            app_name: "sandfork-vmm".into(),
        })),
        VmmAction::GetMachineConfig => Ok(VmmData::MachineConfig(vm.machine.clone())),
        VmmAction::GetVmConfig => Ok(VmmData::VmConfig(Box::new(VmConfig {
            boot_source: vm.boot.clone(),
            drives: vm.drives.clone(),
            machine_config: Some(vm.machine.clone()),
            vsock: vm.vsock.clone(),
            network_interfaces: vm.nets.clone(),
            ..Default::default()
        }))),
        VmmAction::PutMachineConfig(m) => {
            pre_boot("PUT /machine-config")?;
            vm.machine = m;
            Ok(VmmData::Empty)
        }
        VmmAction::PatchMachineConfig(u) => {
            pre_boot("PATCH /machine-config")?;
            vm.machine = vm.machine.patched(&u)?;
            Ok(VmmData::Empty)
        }
        VmmAction::PutBootSource(b) => {
            pre_boot("PUT /boot-source")?;
            vm.boot = Some(b);
            Ok(VmmData::Empty)
        }
        VmmAction::PutDrive(d) => {
            pre_boot("PUT /drives")?;
            vm.drives.retain(|x| x.drive_id != d.drive_id);
            vm.drives.push(d);
            Ok(VmmData::Empty)
        }
        VmmAction::PatchDrive(p) => match vm.drives.iter_mut().find(|d| d.drive_id == p.drive_id) {
            Some(d) => {
                if let Some(path) = p.path_on_host {
                    d.path_on_host = path;
                }
                Ok(VmmData::Empty)
            }
            None => Err(VmmActionError::bad_request(format!(
                "no drive {:?}",
                p.drive_id
            ))),
        },
        VmmAction::PutVsock(v) => {
            pre_boot("PUT /vsock")?;
            vm.vsock = Some(v);
            Ok(VmmData::Empty)
        }
        VmmAction::PutNetworkInterface(n) => {
            pre_boot("PUT /network-interfaces")?;
            vm.nets.retain(|x| x.iface_id != n.iface_id);
            vm.nets.push(n);
            Ok(VmmData::Empty)
        }
        VmmAction::InstanceStart => {
            pre_boot("InstanceStart")?;
            if vm.boot.is_none() {
                return Err(VmmActionError::bad_request("no boot source configured"));
            }
            vm.state = Some(InstanceState::Running);
            Ok(VmmData::Empty)
        }
        VmmAction::Pause | VmmAction::Resume if !started => Err(VmmActionError::bad_request(
            "the microVM has not been started",
        )),
        VmmAction::Pause => {
            vm.state = Some(InstanceState::Paused);
            Ok(VmmData::Empty)
        }
        VmmAction::Resume => {
            vm.state = Some(InstanceState::Running);
            Ok(VmmData::Empty)
        }
        VmmAction::SendCtrlAltDel | VmmAction::FlushMetrics => Ok(VmmData::Empty),
        VmmAction::CreateSnapshot(_) => Ok(VmmData::Empty),
        VmmAction::Fork(p) => Ok(VmmData::Fork(vmm_api::ForkInfo {
            snapshot_path: p.snapshot_path,
            mem_file_path: p.mem_file_path,
            parent: Vec::new(),
            children: vec![Vec::new(); p.children as usize],
            children_failed: None,
            paused_us: 1,
            phases: None,
        })),
        VmmAction::LoadSnapshot(_) => Err(VmmActionError::internal("cannot map memory file")),
        VmmAction::GetVcpus => Ok(VmmData::Vcpus(Vec::new())),
        VmmAction::GetDevices => Ok(VmmData::Devices(Vec::new())),
        VmmAction::PutBalloon(b) => {
            pre_boot("PUT /balloon")?;
            vm.balloon = Some(b);
            Ok(VmmData::Empty)
        }
        VmmAction::GetBalloon => vm
            .balloon
            .clone()
            .map(VmmData::Balloon)
            .ok_or_else(|| VmmActionError::bad_request("No balloon device found.")),
        VmmAction::PatchBalloon(u) => {
            if let Some(b) = &mut vm.balloon {
                b.amount_mib = u.amount_mib;
            }
            Ok(VmmData::Empty)
        }
        VmmAction::GetBalloonStats => Ok(VmmData::BalloonStats(Box::new(BalloonStats {
            target_mib: vm.balloon.as_ref().map_or(0, |b| b.amount_mib),
            free_memory: Some(1 << 20),
            ..BalloonStats::default()
        }))),
        VmmAction::PatchBalloonStats(_) => Ok(VmmData::Empty),
    }
}

/// A raw HTTP/1.1 exchange; returns the status, the head and the body.
fn raw_http(socket: &Path, request: &[u8]) -> (u16, String, String) {
    let mut stream = StdUnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(request).unwrap();
    let mut out = Vec::new();
    stream.read_to_end(&mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head.to_string(), body.to_string())
}

fn request(method: &str, path: &str, headers: &str, body: &str) -> Vec<u8> {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn fault_message(body: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    v["fault_message"].as_str().unwrap().to_string()
}

fn api_error(err: ClientError) -> (u16, String) {
    match err {
        ClientError::Api {
            status,
            fault_message,
        } => (status, fault_message),
        other => panic!("expected an API error, got {other}"),
    }
}

#[tokio::test]
async fn client_drives_every_route() {
    let vmm = TestVmm::start();
    let c = vmm.client();
    c.wait_for_socket(Duration::from_secs(5)).await.unwrap();

    assert_eq!(
        c.get_machine_config().await.unwrap(),
        MachineConfig::default()
    );
    let info = c.get_instance_info().await.unwrap();
    assert_eq!(info.state, InstanceState::NotStarted);

    let machine = MachineConfig::new(2, 256);
    let boot = BootSource {
        kernel_image_path: "/k/vmlinux".into(),
        boot_args: Some("console=ttyS0".into()),
        initrd_path: None,
    };
    let drive = Drive::new("rootfs", "/img/rootfs.ext4", true, false);
    let vsock = Vsock::new(3, "/tmp/v.sock");
    let net = NetworkInterface::new("eth0", "tap0", Some("06:00:AC:10:00:02"));
    let update = MachineConfigUpdate {
        mem_size_mib: Some(512),
        ..Default::default()
    };
    c.put_machine_config(&machine).await.unwrap();
    c.patch_machine_config(&update).await.unwrap();
    c.put_boot_source(&boot).await.unwrap();
    c.put_drive(&drive).await.unwrap();
    c.put_vsock(&vsock).await.unwrap();
    c.put_network_interface(&net).await.unwrap();
    assert_eq!(c.get_machine_config().await.unwrap().mem_size_mib, 512);
    let balloon = Balloon {
        amount_mib: 0,
        deflate_on_oom: true,
        stats_polling_interval_s: 1,
        free_page_reporting: true,
        free_page_hinting: false,
    };
    c.put_balloon(&balloon).await.unwrap();

    c.instance_start().await.unwrap();
    c.pause().await.unwrap();
    assert_eq!(
        c.get_instance_info().await.unwrap().state,
        InstanceState::Paused
    );
    let snap = SnapshotCreateParams {
        snapshot_type: SnapshotType::Full,
        snapshot_path: "/s/vm.state".into(),
        mem_file_path: "/s/vm.mem".into(),
    };
    c.create_snapshot(&snap).await.unwrap();
    c.resume().await.unwrap();
    c.send_ctrl_alt_del().await.unwrap();
    c.flush_metrics().await.unwrap();
    let patch = PartialDrive {
        drive_id: "rootfs".into(),
        path_on_host: Some("/img/other.ext4".into()),
        rate_limiter: None,
    };
    c.patch_drive(&patch).await.unwrap();
    c.patch_balloon(64).await.unwrap();
    assert_eq!(c.get_balloon().await.unwrap().amount_mib, 64);
    let stats = c.get_balloon_stats().await.unwrap();
    assert_eq!((stats.target_mib, stats.free_memory), (64, Some(1 << 20)));
    c.patch_balloon_stats(5).await.unwrap();

    let config = c.get_vm_config().await.unwrap();
    assert_eq!(config.boot_source.as_ref(), Some(&boot));
    assert_eq!(config.drives[0].path_on_host, "/img/other.ext4");
    assert_eq!(config.vsock.as_ref(), Some(&vsock));
    assert_eq!(config.network_interfaces, vec![net.clone()]);

    let mut expect_machine = machine.clone();
    expect_machine.mem_size_mib = 512;
    assert_eq!(config.machine_config, Some(expect_machine));

    assert_eq!(
        vmm.actions(),
        vec![
            VmmAction::GetMachineConfig,
            VmmAction::GetInstanceInfo,
            VmmAction::PutMachineConfig(machine),
            VmmAction::PatchMachineConfig(update),
            VmmAction::PutBootSource(boot),
            VmmAction::PutDrive(drive),
            VmmAction::PutVsock(vsock),
            VmmAction::PutNetworkInterface(net),
            VmmAction::GetMachineConfig,
            VmmAction::PutBalloon(balloon.clone()),
            VmmAction::InstanceStart,
            VmmAction::Pause,
            VmmAction::GetInstanceInfo,
            VmmAction::CreateSnapshot(snap),
            VmmAction::Resume,
            VmmAction::SendCtrlAltDel,
            VmmAction::FlushMetrics,
            VmmAction::PatchDrive(patch),
            VmmAction::PatchBalloon(BalloonUpdate { amount_mib: 64 }),
            VmmAction::GetBalloon,
            VmmAction::GetBalloonStats,
            VmmAction::PatchBalloonStats(BalloonStatsUpdate {
                stats_polling_interval_s: 5,
            }),
            VmmAction::GetVmConfig,
        ]
    );
}

#[test]
fn status_codes_and_content_types() {
    let vmm = TestVmm::start();
    let (status, head, body) = raw_http(&vmm.socket, &request("GET", "/", "", ""));
    assert_eq!(status, 200);
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    let info: InstanceInfo = serde_json::from_str(&body).unwrap();
    assert_eq!(info.state, InstanceState::NotStarted);

    let (status, _, body) = raw_http(&vmm.socket, &request("GET", "/machine-config", "", ""));
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (v["vcpu_count"].as_u64(), v["mem_size_mib"].as_u64()),
        (Some(1), Some(128))
    );

    // No Content-Type at all, as `curl -d` without -H sends it: still accepted.
    let body = r#"{"kernel_image_path": "/k"}"#;
    let (status, _, resp) = raw_http(&vmm.socket, &request("PUT", "/boot-source", "", body));
    assert_eq!((status, resp.as_str()), (204, ""));
    let form = "Content-Type: application/x-www-form-urlencoded\r\n";
    let (status, _, _) = raw_http(&vmm.socket, &request("PUT", "/boot-source", form, body));
    assert_eq!(status, 204);
}

#[tokio::test]
async fn controller_errors_keep_their_status_and_message() {
    let vmm = TestVmm::start();
    let c = vmm.client();
    let (status, msg) = api_error(c.instance_start().await.unwrap_err());
    assert_eq!((status, msg.as_str()), (400, "no boot source configured"));
    let (status, msg) = api_error(c.pause().await.unwrap_err());
    assert_eq!(status, 400);
    assert!(msg.contains("not been started"), "{msg}");

    let load = SnapshotLoadParams::from_file("/s/vm.state", "/s/vm.mem", true);
    let (status, msg) = api_error(c.load_snapshot(&load).await.unwrap_err());
    assert_eq!((status, msg.as_str()), (500, "cannot map memory file"));
    assert_eq!(vmm.actions().last(), Some(&VmmAction::LoadSnapshot(load)));
}

#[test]
fn drive_id_must_match_the_path() {
    let vmm = TestVmm::start();
    let body = r#"{"drive_id": "data", "path_on_host": "/d", "is_root_device": false}"#;
    let (status, _, resp) = raw_http(&vmm.socket, &request("PUT", "/drives/rootfs", "", body));
    assert_eq!(status, 400);
    let msg = fault_message(&resp);
    assert!(
        msg.contains("\"rootfs\"") && msg.contains("\"data\""),
        "{msg}"
    );

    let (status, _, resp) = raw_http(&vmm.socket, &request("PUT", "/drives/a%2Fb", "", body));
    assert_eq!(status, 400);
    assert!(fault_message(&resp).contains("drive_id"), "{resp}");

    let patch = r#"{"drive_id": "other"}"#;
    let (status, _, _) = raw_http(&vmm.socket, &request("PATCH", "/drives/data", "", patch));
    assert_eq!(status, 400);

    let (status, _, _) = raw_http(&vmm.socket, &request("PUT", "/drives/data", "", body));
    assert_eq!(status, 204);
    // Only the matching request reached the controller.
    assert_eq!(vmm.actions().len(), 1);
}

#[test]
fn malformed_bodies_are_400_with_the_parse_error() {
    let vmm = TestVmm::start();
    let cases = [
        (
            "PUT",
            "/machine-config",
            r#"{"vcpu_count": 2,"#,
            "invalid JSON body: EOF",
        ),
        (
            "PUT",
            "/machine-config",
            r#"{"vcpu_count": "2", "mem_size_mib": 128}"#,
            "invalid type: string \"2\", expected u8",
        ),
        (
            "PUT",
            "/machine-config",
            r#"{"vcpu_count": 2, "mem_size_mib": 128, "cpus": 2}"#,
            "unknown field `cpus`",
        ),
        (
            "PUT",
            "/machine-config",
            r#"{"vcpu_count": 2}"#,
            "missing field `mem_size_mib`",
        ),
        ("PUT", "/machine-config", "", "request body is empty"),
        (
            "PUT",
            "/actions",
            r#"{"action_type": "Reboot"}"#,
            "unknown variant `Reboot`",
        ),
        (
            "PATCH",
            "/vm",
            r#"{"state": "Stopped"}"#,
            "unknown variant `Stopped`",
        ),
        (
            "PUT",
            "/vsock",
            r#"{"guest_cid": 3}"#,
            "missing field `uds_path`",
        ),
        (
            "PUT",
            "/snapshot/load",
            r#"{"snapshot_path": "/s"}"#,
            "one of mem_backend or mem_file_path is required",
        ),
        (
            "PUT",
            "/snapshot/create",
            "\"text\"",
            "invalid JSON body: invalid type: string \"text\", expected struct SnapshotCreateParams",
        ),
        ("PATCH", "/machine-config", "{}", "at least one field"),
        (
            "PUT",
            "/fork",
            r#"{"snapshot_path": "/s", "mem_file_path": "/m", "disk_dir": "/d", "children": 0}"#,
            "children must be between 1 and 256",
        ),
        (
            "PUT",
            "/fork",
            r#"{"snapshot_path": "/s", "mem_file_path": "/m", "children": 2}"#,
            "missing field `disk_dir`",
        ),
        // Parsed fine, refused by validation before reaching the controller.
        (
            "PUT",
            "/machine-config",
            r#"{"vcpu_count": 0, "mem_size_mib": 128}"#,
            "vcpu_count must be between 1 and 32, got 0",
        ),
        (
            "PUT",
            "/vsock",
            r#"{"guest_cid": 1, "uds_path": "/v"}"#,
            "guest_cid must be between 3",
        ),
        (
            "PUT",
            "/boot-source",
            r#"{"kernel_image_path": ""}"#,
            "kernel_image_path must not be empty",
        ),
        (
            "PUT",
            "/network-interfaces/eth0",
            r#"{"iface_id": "eth1", "host_dev_name": "tap0"}"#,
            "the iface_id in the path (\"eth0\") differs from the one in the body (\"eth1\")",
        ),
        (
            "PUT",
            "/network-interfaces/eth0",
            r#"{"iface_id": "eth0", "host_dev_name": "tap0", "guest_mac": "06:00:AC:10:00"}"#,
            "guest_mac \"06:00:AC:10:00\" is invalid",
        ),
        (
            "PUT",
            "/network-interfaces/eth0",
            r#"{"iface_id": "eth0"}"#,
            "missing field `host_dev_name`",
        ),
        (
            "PUT",
            "/network-interfaces/eth.0",
            r#"{"iface_id": "eth.0", "host_dev_name": "tap0"}"#,
            "iface_id \"eth.0\" is invalid",
        ),
    ];
    for (method, path, body, want) in cases {
        let (status, head, resp) = raw_http(&vmm.socket, &request(method, path, "", body));
        assert_eq!(status, 400, "{method} {path} {body}: {head}");
        let msg = fault_message(&resp);
        assert!(
            msg.contains(want),
            "{method} {path} {body}: got {msg:?}, want {want:?}"
        );
    }
    assert!(vmm.actions().is_empty(), "{:?}", vmm.actions());
}

#[test]
fn unknown_routes_and_wrong_methods_are_400_like_firecracker() {
    let vmm = TestVmm::start();
    let cases = [
        (
            "GET",
            "/nope",
            "Invalid request method and/or path: GET /nope",
        ),
        ("PUT", "/vm", "Invalid request method and/or path: PUT /vm"),
        (
            "DELETE",
            "/machine-config",
            "Invalid request method and/or path: DELETE /machine-config",
        ),
        (
            "GET",
            "/drives/rootfs",
            "Invalid request method and/or path: GET /drives/rootfs",
        ),
        // Firecracker's PATCH updates rate limiters, which sandfork does not have.
        (
            "PATCH",
            "/network-interfaces/eth0",
            "Invalid request method and/or path: PATCH /network-interfaces/eth0",
        ),
        (
            "PUT",
            "/mmds",
            "Invalid request method and/or path: PUT /mmds",
        ),
        (
            "DELETE",
            "/balloon",
            "Invalid request method and/or path: DELETE /balloon",
        ),
    ];
    for (method, path, want) in cases {
        let (status, _, resp) = raw_http(&vmm.socket, &request(method, path, "", "{}"));
        assert_eq!(status, 400, "{method} {path}");
        assert_eq!(fault_message(&resp), want);
    }
    assert!(vmm.actions().is_empty());
}

#[test]
fn oversized_bodies_are_refused() {
    let vmm = TestVmm::start();
    // Announced size: refused without reading the body.
    let head = "PUT /boot-source HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 100000\r\n\r\n";
    let (status, _, resp) = raw_http(&vmm.socket, head.as_bytes());
    assert_eq!(status, 400);
    assert_eq!(
        fault_message(&resp),
        "request body of 100000 bytes exceeds the limit of 51200 bytes"
    );

    // Chunked, so the size is only known while reading.
    let payload = format!(
        r#"{{"kernel_image_path": "/k", "boot_args": "{}"}}"#,
        "a".repeat(60_000)
    );
    let chunked = format!(
        "PUT /boot-source HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{payload}\r\n0\r\n\r\n",
        payload.len()
    );
    let (status, _, resp) = raw_http(&vmm.socket, chunked.as_bytes());
    assert_eq!(status, 400);
    assert!(fault_message(&resp).contains("limit 51200 bytes"), "{resp}");

    // Just under the limit is fine.
    let payload = format!(
        r#"{{"kernel_image_path": "/k", "boot_args": "{}"}}"#,
        "a".repeat(50_000)
    );
    let (status, _, _) = raw_http(&vmm.socket, &request("PUT", "/boot-source", "", &payload));
    assert_eq!(status, 204);
    assert_eq!(vmm.actions().len(), 1);
}

#[tokio::test]
async fn controller_gone_is_500() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("api.sock");
    let (server, receiver) = spawn_api_server(&socket).unwrap();
    drop(receiver);
    let (status, msg) = api_error(VmmClient::new(&socket).pause().await.unwrap_err());
    assert_eq!(
        (status, msg.as_str()),
        (500, "the VMM controller is not running")
    );
    server.shutdown().unwrap();
}

#[tokio::test]
async fn shutdown_removes_the_socket() {
    let mut vmm = TestVmm::start();
    let c = vmm.client();
    c.get_instance_info().await.unwrap();
    vmm.stop();
    assert!(!vmm.socket.exists());
    let err = c.get_instance_info().await.unwrap_err();
    assert!(matches!(err, ClientError::Io { .. }), "{err}");
}

#[test]
fn stale_socket_is_replaced_but_live_one_and_files_are_not() {
    let dir = tempfile::tempdir().unwrap();

    // A socket file nobody listens on, as a crashed VMM leaves behind.
    let stale = dir.path().join("stale.sock");
    drop(StdUnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let (server, _rx) = spawn_api_server(&stale).unwrap();
    assert!(StdUnixStream::connect(&stale).is_ok());

    // The same path while that server runs.
    let err = spawn_api_server(&stale).unwrap_err();
    assert!(matches!(err, ApiServerError::InUse { .. }), "{err}");
    server.shutdown().unwrap();
    assert!(!stale.exists());

    let file = dir.path().join("file");
    std::fs::write(&file, "keep me").unwrap();
    let err = spawn_api_server(&file).unwrap_err();
    assert!(matches!(err, ApiServerError::NotASocket { .. }), "{err}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
}

#[test]
fn server_thread_is_named_api_and_socket_is_private() {
    use std::os::unix::fs::PermissionsExt;
    let vmm = TestVmm::start();
    let mode = std::fs::metadata(&vmm.socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let names = || -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .map(|n| n.trim().to_string())
            .collect()
    };
    // A new thread names itself once it runs, which may be a moment later.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !names().iter().any(|n| n == "api") && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(names().iter().any(|n| n == "api"), "{:?}", names());
}

//! Writes the seed corpora (`fuzz/seeds/<target>/`) from real messages: state
//! files, layer headers and Connect envelopes made by the crates' own
//! encoders, requests as a guest driver or an SDK sends them.
//!
//! Usage: make_seeds <seeds dir>

use std::path::Path;

// The instrumented code calls into libFuzzer's coverage hooks.
use libfuzzer_sys as _;

use envd_proto::envelope::{self, FLAG_NONE};
use envd_proto::process::{
    DataEvent, ProcessConfig, ProcessEvent, ProcessSelector, StartEvent, StartRequest,
    StartResponse,
};
use envd_proto::{Code, ConnectError, EndStream};
use sandfork_fuzz::{DATA_BASE, F_INDIRECT, F_NEXT, F_WRITE, QueueInput};

/// One chain of `(address, length, device-writable)` buffers.
type Chain<'a> = &'a [(u64, u32, bool)];

fn le16(v: u16) -> [u8; 2] {
    v.to_le_bytes()
}

fn write(dir: &Path, target: &str, name: &str, bytes: &[u8]) {
    let d = dir.join(target);
    std::fs::create_dir_all(&d).expect("seed dir");
    std::fs::write(d.join(name), bytes).expect("seed");
}

fn envd(dir: &Path) {
    let start = StartRequest {
        process: ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-l".into(), "-c".into(), "echo hello".into()],
            envs: [("LANG".to_string(), "C.UTF-8".to_string())].into(),
            cwd: Some("/home/user".into()),
        },
        tag: Some("t1".into()),
        stdin: Some(false),
        ..Default::default()
    };
    let mut request = vec![0u8]; // chunk size byte: 1 byte at a time
    request.extend_from_slice(&envelope::encode_message(&start).expect("encode"));
    write(dir, "envd_envelope", "start-request", &request);

    let mut stream = vec![7u8];
    for event in [
        ProcessEvent::Start(StartEvent { pid: 42 }),
        ProcessEvent::Data(DataEvent::Stdout(envd_proto::json::B64(
            b"hello\n".to_vec().into(),
        ))),
    ] {
        let msg = StartResponse { event };
        stream.extend_from_slice(&envelope::encode_message(&msg).expect("encode"));
    }
    stream.extend_from_slice(&envelope::encode_end_stream(&EndStream::ok()));
    write(dir, "envd_envelope", "start-stream", &stream);

    let mut error = vec![255u8];
    error.extend_from_slice(&envelope::encode_end_stream(&EndStream::error(
        ConnectError::new(Code::NotFound, "process with pid 7 not found"),
    )));
    let connect = envd_proto::process::ConnectRequest {
        process: ProcessSelector::Pid(7),
    };
    error.extend_from_slice(&envelope::encode_message(&connect).expect("encode"));
    error.extend_from_slice(&envelope::encode(
        FLAG_NONE,
        b"{\"path\":\"/tmp\",\"depth\":1}",
    ));
    write(dir, "envd_envelope", "connect-error", &error);
}

fn snapshot(dir: &Path) {
    let state = sandfork_fuzz::seeds::microvm_state();
    let bytes = vmm::snapshot::format::encode(&state).expect("encode state");
    write(dir, "snapshot_state", "state-1vcpu", &bytes);
}

fn disk_layer(dir: &Path) {
    let tmp = tempfile::tempdir().expect("tmp");
    let child = sandfork_fuzz::layers::fixture(tmp.path());
    let disk = disk_layers::LayeredDisk::open(&child).expect("child");
    disk.write_at(&[2; 512], 0).expect("write");
    drop(disk);
    // A layer over the sealed one, and the sealed one over the raw base.
    write(
        dir,
        "disk_layer",
        "child-of-sealed",
        &std::fs::read(&child).expect("child"),
    );
    let sealed = tmp.path().join("sealed.sfl");
    write(
        dir,
        "disk_layer",
        "sealed-over-raw",
        &std::fs::read(&sealed).expect("sealed"),
    );
}

/// A virtio-blk request header at `at` in the data area.
fn blk_header(data: &mut Vec<u8>, at: u64, request_type: u32, sector: u64) {
    let off = (at - DATA_BASE) as usize;
    if data.len() < off + 16 {
        data.resize(off + 16, 0);
    }
    data[off..off + 4].copy_from_slice(&request_type.to_le_bytes());
    data[off + 8..off + 16].copy_from_slice(&sector.to_le_bytes());
}

fn block(dir: &Path) {
    let h = DATA_BASE;
    let (buf, status) = (DATA_BASE + 0x1000, DATA_BASE + 0x3000);
    let cases: [(&str, u32, &[Chain]); 5] = [
        (
            "read",
            0,
            &[&[(h, 16, false), (buf, 1024, true), (status, 1, true)]],
        ),
        (
            "write",
            1,
            &[&[(h, 16, false), (buf, 512, false), (status, 1, true)]],
        ),
        ("flush", 4, &[&[(h, 16, false), (status, 1, true)]]),
        (
            "get-id",
            8,
            &[&[(h, 16, false), (buf, 20, true), (status, 1, true)]],
        ),
        (
            "split-header",
            0,
            &[&[
                (h, 10, false),
                (h + 10, 6, false),
                (buf, 512, true),
                (status, 1, true),
            ]],
        ),
    ];
    for (name, request_type, chains) in cases {
        let mut out = Vec::new();
        let mut q = QueueInput::chains(8, chains);
        q.flags = 1; // event_idx
        q.write(&mut out);
        let mut data = Vec::new();
        blk_header(&mut data, h, request_type, 3);
        out.extend_from_slice(&data);
        write(dir, "block_request", name, &out);
    }
    // An indirect table in the data area holding the whole request.
    let table = DATA_BASE + 0x100;
    let mut q = QueueInput {
        size_log2: 4,
        ..Default::default()
    };
    q.descs.push(sandfork_fuzz::Desc {
        addr: table,
        len: 3 * 16,
        flags: F_INDIRECT,
        next: 0,
    });
    q.heads.push(0);
    let mut out = Vec::new();
    q.write(&mut out);
    let mut data = Vec::new();
    blk_header(&mut data, h, 0, 0);
    data.resize(0x100 + 48, 0);
    for (i, (addr, len, flags)) in [
        (h, 16u32, F_NEXT),
        (buf, 512, F_NEXT | F_WRITE),
        (status, 1, F_WRITE),
    ]
    .into_iter()
    .enumerate()
    {
        let at = 0x100 + 16 * i;
        data[at..at + 8].copy_from_slice(&addr.to_le_bytes());
        data[at + 8..at + 12].copy_from_slice(&len.to_le_bytes());
        data[at + 12..at + 14].copy_from_slice(&le16(flags));
        data[at + 14..at + 16].copy_from_slice(&le16(i as u16 + 1));
    }
    out.extend_from_slice(&data);
    write(dir, "block_request", "indirect-read", &out);
}

fn virtio_queue(dir: &Path) {
    // A restored queue of 16 at 0x1000/0x2000/0x3000, two chains published.
    let mut out = vec![1u8]; // event_idx, ready, addresses modulo memory
    out.extend_from_slice(&le16(0)); // next_avail
    out.extend_from_slice(&le16(0)); // next_used
    out.extend_from_slice(&le16(16)); // size
    for a in [0x1000u64, 0x2000, 0x3000] {
        out.extend_from_slice(&a.to_le_bytes());
    }
    let mut mem = vec![0u8; 0x5000];
    let descs = [
        (0x4000u64, 64u32, F_NEXT, 1u16),
        (0x4100, 64, F_WRITE, 0),
        (0x4200, 32, F_WRITE, 0),
    ];
    for (i, (addr, len, flags, next)) in descs.into_iter().enumerate() {
        let at = 0x1000 + 16 * i;
        mem[at..at + 8].copy_from_slice(&addr.to_le_bytes());
        mem[at + 8..at + 12].copy_from_slice(&len.to_le_bytes());
        mem[at + 12..at + 14].copy_from_slice(&le16(flags));
        mem[at + 14..at + 16].copy_from_slice(&le16(next));
    }
    mem[0x2002..0x2004].copy_from_slice(&le16(2)); // avail idx
    mem[0x2004..0x2006].copy_from_slice(&le16(0));
    mem[0x2006..0x2008].copy_from_slice(&le16(2));
    out.extend_from_slice(&mem);
    write(dir, "virtio_queue", "two-chains", &out);
}

fn net(dir: &Path) {
    // RX: two 2 KiB buffers; TX: one frame as header + payload descriptors.
    let (rx1, rx2, tx_hdr, tx_data) = (
        DATA_BASE,
        DATA_BASE + 0x800,
        DATA_BASE + 0x1000,
        DATA_BASE + 0x1100,
    );
    let mut frame = vec![0u8; 12];
    frame.extend_from_slice(&[0xff; 6]);
    frame.extend_from_slice(&[2, 0, 0, 0, 0, 1]);
    frame.extend_from_slice(&[0x08, 0x06]);
    frame.extend_from_slice(&[0u8; 28]);
    for (name, mergeable) in [("whole", 0u8), ("mergeable", 1)] {
        let mut out = vec![mergeable];
        QueueInput::chains(8, &[&[(rx1, 2048, true)], &[(rx2, 2048, true)]]).write(&mut out);
        QueueInput::chains(8, &[&[(tx_hdr, 12, false), (tx_data, 60, false)]]).write(&mut out);
        out.push(2);
        for f in [&frame[..], &frame[..40]] {
            out.extend_from_slice(&le16(f.len() as u16));
            out.extend_from_slice(f);
        }
        let mut data = vec![0u8; 0x1100 + 60];
        data[0x1100..0x1100 + 42].copy_from_slice(&frame[12..54]);
        out.extend_from_slice(&data);
        write(dir, "net_frames", name, &out);
    }
}

/// A vsock header (virtio 1.2, 5.10.6).
fn vsock_header(src_port: u32, dst_port: u32, len: u32, op: u16, flags: u32) -> [u8; 44] {
    let mut b = [0u8; 44];
    b[0..8].copy_from_slice(&3u64.to_le_bytes());
    b[8..16].copy_from_slice(&2u64.to_le_bytes());
    b[16..20].copy_from_slice(&src_port.to_le_bytes());
    b[20..24].copy_from_slice(&dst_port.to_le_bytes());
    b[24..28].copy_from_slice(&len.to_le_bytes());
    b[28..30].copy_from_slice(&1u16.to_le_bytes());
    b[30..32].copy_from_slice(&op.to_le_bytes());
    b[32..36].copy_from_slice(&flags.to_le_bytes());
    b[36..40].copy_from_slice(&(256 * 1024u32).to_le_bytes());
    b
}

fn vsock(dir: &Path) {
    // TX: REQUEST to the listened port 1024, RW with 5 bytes, CREDIT_REQUEST,
    // SHUTDOWN, then a REQUEST to a port nobody listens on (RST answer).
    let packets: Vec<Vec<u8>> = vec![
        vsock_header(5000, 1024, 0, 1, 0).to_vec(),
        [&vsock_header(5000, 1024, 5, 5, 0)[..], b"hello"].concat(),
        vsock_header(5000, 1024, 0, 7, 0).to_vec(),
        vsock_header(5000, 1024, 0, 4, 3).to_vec(),
        vsock_header(5001, 77, 0, 1, 0).to_vec(),
    ];
    let mut data = Vec::new();
    let mut tx_chains: Vec<Vec<(u64, u32, bool)>> = Vec::new();
    for p in &packets {
        let at = DATA_BASE + data.len() as u64;
        data.extend_from_slice(p);
        data.resize(data.len().next_multiple_of(64), 0);
        if p.len() > 44 {
            tx_chains.push(vec![
                (at, 44, false),
                (at + 44, (p.len() - 44) as u32, false),
            ]);
        } else {
            tx_chains.push(vec![(at, 44, false)]);
        }
    }
    let rx_base = DATA_BASE + 0x8000;
    let rx: Vec<Vec<(u64, u32, bool)>> = (0..4)
        .map(|i| {
            vec![
                (rx_base + i * 0x1000, 44, true),
                (rx_base + i * 0x1000 + 64, 4096, true),
            ]
        })
        .collect();
    let rx: Vec<Chain> = rx.iter().map(Vec::as_slice).collect();
    let tx: Vec<Chain> = tx_chains.iter().map(Vec::as_slice).collect();
    let mut out = Vec::new();
    QueueInput::chains(8, &rx).write(&mut out);
    QueueInput::chains(8, &tx).write(&mut out);
    QueueInput::chains(4, &[&[(DATA_BASE + 0x7000, 8, true)]]).write(&mut out);
    out.extend_from_slice(&data);
    write(dir, "vsock_packets", "connect-send-shutdown", &out);
}

fn balloon(dir: &Path) {
    // Inflate: 8 PFNs (two runs); deflate: the same array; statistics: free
    // and total memory; reporting: two free blocks as a guest reports them.
    let pfns = DATA_BASE;
    let stats = DATA_BASE + 0x100;
    let mut data = Vec::new();
    for pfn in [0x50u32, 0x51, 0x52, 0x53, 0x80, 0x81, 0x82, 0x83] {
        data.extend_from_slice(&pfn.to_le_bytes());
    }
    data.resize(0x100, 0);
    for (tag, value) in [(4u16, 100u64 << 20), (5, 256 << 20)] {
        data.extend_from_slice(&tag.to_le_bytes());
        data.extend_from_slice(&value.to_le_bytes());
    }
    let mut out = Vec::new();
    QueueInput::chains(8, &[&[(pfns, 32, false)]]).write(&mut out);
    QueueInput::chains(8, &[&[(pfns, 32, false)]]).write(&mut out);
    QueueInput::chains(8, &[&[(stats, 20, false)]]).write(&mut out);
    QueueInput::chains(
        8,
        &[&[(0x6_0000, 0x1_0000, true), (0x8_0000, 0x2_0000, true)]],
    )
    .write(&mut out);
    out.extend_from_slice(&data);
    write(dir, "balloon_queues", "inflate-deflate-stats-report", &out);
}

/// An MMIO access: `op` bit 0 write, bits 2..4 width - 1, bit 6 "4 bytes".
fn mmio_op(out: &mut Vec<u8>, write: bool, offset: u16, value: Option<u32>) {
    out.push(if write { 1 | 0x40 } else { 0x40 });
    out.extend_from_slice(&offset.to_le_bytes());
    if let Some(v) = value {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

fn mmio(dir: &Path) {
    // A Linux driver's probe and setup of queue 0, then DRIVER_OK, a
    // notification, config reads and a reset.
    for (name, device) in [("block", 0u8), ("net", 1), ("vsock", 2)] {
        let mut ops = Vec::new();
        let mut n = 0u8;
        let mut op = |ops: &mut Vec<u8>, w, off, v| {
            mmio_op(ops, w, off, v);
            n += 1;
        };
        op(&mut ops, false, 0x000, None); // magic
        op(&mut ops, false, 0x004, None); // version
        op(&mut ops, false, 0x008, None); // device id
        op(&mut ops, true, 0x070, Some(0)); // status reset
        op(&mut ops, true, 0x070, Some(1)); // ACKNOWLEDGE
        op(&mut ops, true, 0x070, Some(3)); // DRIVER
        op(&mut ops, true, 0x014, Some(0)); // device features sel
        op(&mut ops, false, 0x010, None);
        op(&mut ops, true, 0x014, Some(1));
        op(&mut ops, false, 0x010, None);
        op(&mut ops, true, 0x024, Some(0)); // driver features sel
        op(&mut ops, true, 0x020, Some(0));
        op(&mut ops, true, 0x024, Some(1));
        op(&mut ops, true, 0x020, Some(1)); // VERSION_1
        op(&mut ops, true, 0x070, Some(11)); // FEATURES_OK
        op(&mut ops, false, 0x070, None);
        op(&mut ops, true, 0x030, Some(0)); // queue sel
        op(&mut ops, false, 0x034, None); // queue num max
        op(&mut ops, true, 0x038, Some(16)); // queue num
        op(&mut ops, true, 0x080, Some(0x1_0000)); // desc low
        op(&mut ops, true, 0x084, Some(0));
        op(&mut ops, true, 0x090, Some(0x1_1000)); // avail low
        op(&mut ops, true, 0x094, Some(0));
        op(&mut ops, true, 0x0a0, Some(0x1_2000)); // used low
        op(&mut ops, true, 0x0a4, Some(0));
        op(&mut ops, true, 0x044, Some(1)); // queue ready
        op(&mut ops, true, 0x070, Some(15)); // DRIVER_OK
        op(&mut ops, true, 0x050, Some(0)); // notify
        op(&mut ops, false, 0x060, None); // interrupt status
        op(&mut ops, true, 0x064, Some(1)); // interrupt ack
        op(&mut ops, false, 0x100, None); // config
        op(&mut ops, false, 0x104, None);
        op(&mut ops, true, 0x070, Some(0)); // reset
        let mut out = vec![device, n];
        out.extend_from_slice(&ops);
        write(dir, "mmio", name, &out);
    }
}

fn vmm_api(dir: &Path) {
    // (method index: GET 0, PUT 1, PATCH 2; route index; path id; body)
    let cases: [(&str, u8, u8, &str, &str); 8] = [
        (
            "machine-config",
            1,
            1,
            "",
            r#"{"vcpu_count":2,"mem_size_mib":512,"smt":false}"#,
        ),
        (
            "boot-source",
            1,
            2,
            "",
            r#"{"kernel_image_path":"/k/vmlinux","boot_args":"console=ttyS0"}"#,
        ),
        (
            "drive",
            1,
            3,
            "rootfs",
            r#"{"drive_id":"rootfs","path_on_host":"/r.ext4","is_root_device":true,"is_read_only":false}"#,
        ),
        (
            "vsock",
            1,
            4,
            "",
            r#"{"guest_cid":3,"uds_path":"/run/v.sock"}"#,
        ),
        (
            "net",
            1,
            5,
            "eth0",
            r#"{"iface_id":"eth0","host_dev_name":"tap0","guest_mac":"02:00:00:00:00:01"}"#,
        ),
        ("action", 1, 6, "", r#"{"action_type":"InstanceStart"}"#),
        (
            "snapshot-load",
            1,
            10,
            "",
            r#"{"snapshot_path":"/s/vm.state","mem_backend":{"backend_type":"File","backend_path":"/s/vm.mem"},"resume_vm":true}"#,
        ),
        ("vm-pause", 2, 7, "", r#"{"state":"Paused"}"#),
    ];
    for (name, method, route, id, body) in cases {
        let mut out = vec![method, route, id.len() as u8];
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(body.as_bytes());
        write(dir, "vmm_api", name, &out);
    }
}

fn server_api(dir: &Path) {
    // (method: GET 0, POST 1, DELETE 2; route index; flags: 1 API key,
    // 2 routing headers, 4 host, 8 access token; id; body)
    let cases: [(&str, u8, u8, u8, &str, &str); 8] = [
        (
            "create-v2",
            1,
            2,
            1,
            "",
            r#"{"templateID":"base","timeout":300,"metadata":{"team":"a"},"envVars":{"A":"1"},"autoPause":false}"#,
        ),
        (
            "list",
            0,
            22,
            1,
            "state=running&limit=2&metadata=team%3Da",
            "",
        ),
        ("get", 0, 3, 1, "ibx1234567890abcdef", ""),
        (
            "timeout",
            1,
            4,
            1,
            "ibx1234567890abcdef",
            r#"{"timeout":60}"#,
        ),
        (
            "connect",
            1,
            10,
            1,
            "ibx1234567890abcdef",
            r#"{"timeout":30}"#,
        ),
        ("kill", 2, 3, 1, "ibx1234567890abcdef", ""),
        (
            "template",
            1,
            19,
            1,
            "",
            r#"{"alias":"py","dockerfile":"FROM base\nRUN true","cpuCount":2,"memoryMB":512}"#,
        ),
        (
            "proxy-envd",
            1,
            24,
            2 | 4 | 8,
            "ibx1234567890abcdef",
            r#"{"process":{"cmd":"ls"}}"#,
        ),
    ];
    for (name, method, route, flags, id, body) in cases {
        let mut out = vec![method, route, flags, id.len() as u8];
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(body.as_bytes());
        write(dir, "server_api", name, &out);
    }
}

/// What a guest sends the egress proxy first: ClientHellos (one record, and
/// cut into small ones, with and without a name) and HTTP request heads.
fn egress(dir: &Path) {
    use sandfork_network::egress::sni::client_hello;
    let hellos = [
        ("hello", client_hello(Some("allowed.test"), 16384)),
        ("hello-split", client_hello(Some("a.wild.test"), 20)),
        ("hello-no-name", client_hello(None, 16384)),
    ];
    for (name, hello) in hellos {
        write(dir, "egress_heads", name, &hello);
    }
    let heads = [
        ("get", "GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n"),
        (
            "absolute",
            "GET http://a.test/x HTTP/1.1\r\nHost: a.test\r\n\r\n",
        ),
        ("no-host", "GET / HTTP/1.0\r\n\r\n"),
    ];
    for (name, head) in heads {
        write(dir, "egress_heads", name, head.as_bytes());
    }
}

fn main() {
    let dir = std::env::args_os()
        .nth(1)
        .expect("usage: make_seeds <seeds dir>");
    let dir = Path::new(&dir);
    envd(dir);
    snapshot(dir);
    disk_layer(dir);
    block(dir);
    virtio_queue(dir);
    net(dir);
    vsock(dir);
    balloon(dir);
    mmio(dir);
    vmm_api(dir);
    server_api(dir);
    egress(dir);
}

//! Lab tests: pause, snapshot and restore of real microVMs.
//! Run with `scripts/test.sh`, which provides KVM, the kernel and the image.

#![cfg(test)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{AGENT_PORT, Boot, TestVm, bash_init};
use vmm_api::{
    InstanceState, NetworkInterface, NetworkOverride, SnapshotLoadParams, SnapshotType,
    VsockOverride,
};
use vmm_driver::agent_client::{AgentClient, AgentInit};
use vmm_driver::vsock_connect::agent_health;

/// A guest whose init counts, printing each number on the console and keeping
/// the last one in a file in guest memory (tmpfs). The file is replaced by a
/// rename, never truncated in place: a snapshot or a reader landing between a
/// truncation and its write would see it empty.
fn counting_guest() -> Boot {
    Boot {
        boot_args: Some(bash_init(
            "mount -t tmpfs tmpfs /tmp; i=0; \
             while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; \
             echo count=$i; sleep 0.1; done",
        )),
        ..Boot::default()
    }
}

/// The numbers counted on a console, in order.
fn counts(console: &str) -> Vec<u64> {
    console
        .lines()
        .filter_map(|l| l.trim().strip_prefix("count="))
        .filter_map(|n| n.parse().ok())
        .collect()
}

/// Waits until the console shows a count of at least `n`; returns the counts.
async fn wait_for_count(vm: &TestVm, n: u64) -> Vec<u64> {
    let start = Instant::now();
    loop {
        let seen = counts(&vm.console());
        if seen.last().is_some_and(|&last| last >= n) {
            return seen;
        }
        assert!(
            start.elapsed() < common::BOOT_TIMEOUT,
            "no count={n} yet\n{}",
            vm.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn assert_consecutive(seen: &[u64], logs: &str) {
    for pair in seen.windows(2) {
        assert_eq!(
            pair[1],
            pair[0] + 1,
            "counting skipped or restarted\n{logs}"
        );
    }
}

/// A VM booted into [`counting_guest`] that has counted to `n`.
async fn counting_source(n: u64) -> TestVm {
    let vm = TestVm::spawn().await;
    vm.boot(&counting_guest()).await;
    wait_for_count(&vm, n).await;
    vm
}

/// Waits for a restored guest's agent, then gives it the init a restore
/// takes ([`AgentInit::after_restore`]).
async fn agent_after_restore(vm: &mut TestVm) {
    vm.wait_for_agent().await;
    vm.vm()
        .agent()
        .init(&AgentInit::after_restore().unwrap())
        .await
        .unwrap();
}

async fn snapshot(vm: &TestVm, kind: SnapshotType, dir: &Path, name: &str) {
    let state = dir.join(format!("{name}.state"));
    let mem = dir.join(format!("{name}.mem"));
    vm.vm()
        .snapshot(kind, &state, &mem)
        .await
        .unwrap_or_else(|e| panic!("snapshot {name}: {e}\n{}", vm.logs()));
}

async fn restore(dir: &Path, name: &str) -> TestVm {
    let vm = TestVm::spawn().await;
    let state = dir.join(format!("{name}.state"));
    let mem = dir.join(format!("{name}.mem"));
    vm.vm()
        .load_snapshot(&state, &mem, true)
        .await
        .unwrap_or_else(|e| panic!("load {name}: {e}\n{}", vm.logs()));
    vm
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn a_counting_guest_keeps_counting_after_pause_snapshot_and_restore() {
    let snapshots = tempfile::tempdir().unwrap();
    let source = counting_source(3).await;

    // Pause: counting stops, and goes on from where it was after resume.
    source.api().pause().await.unwrap();
    let at_pause = counts(&source.console());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(counts(&source.console()), at_pause, "counted while paused");
    source.api().resume().await.unwrap();
    let after = wait_for_count(&source, at_pause.last().unwrap() + 3).await;
    assert_consecutive(&after, &source.logs());

    // A full snapshot; the source goes on counting after it.
    snapshot(&source, SnapshotType::Full, snapshots.path(), "full").await;
    let at_snapshot = *counts(&source.console()).last().unwrap();
    source.api().resume().await.unwrap();
    wait_for_count(&source, at_snapshot + 3).await;
    assert_consecutive(&counts(&source.console()), &source.logs());

    // Restored in a new VMM process, the guest continues from the snapshot.
    let restored = restore(snapshots.path(), "full").await;
    assert_eq!(
        restored.api().get_instance_info().await.unwrap().state,
        InstanceState::Running
    );
    let seen = wait_for_count(&restored, at_snapshot + 3).await;
    assert!(
        seen[0] == at_snapshot + 1 || seen[0] == at_snapshot + 2,
        "restored guest started at {} after a snapshot at {at_snapshot}\n{}",
        seen[0],
        restored.logs()
    );
    assert_consecutive(&seen, &restored.logs());

    // A diff snapshot of the source holds only what changed since the full one,
    // and restores on top of it.
    snapshot(&source, SnapshotType::Diff, snapshots.path(), "diff").await;
    let at_diff = *counts(&source.console()).last().unwrap();
    let full_size = allocated(&snapshots.path().join("full.mem"));
    let diff_size = allocated(&snapshots.path().join("diff.mem"));
    eprintln!("memory files: full {full_size} bytes, diff {diff_size} bytes");
    assert!(
        diff_size * 4 < full_size,
        "diff {diff_size} vs full {full_size}"
    );

    // A snapshot that fails before the VM's memory moved (its memory
    // file's directory is missing) is refused, a 400: its caller may take
    // the VM for unchanged. One that fails after (its state's directory is
    // missing, its memory written and mapped) is a 500 that says the VM is
    // in doubt: its memory now lives in the file written.
    let missing = snapshots.path().join("missing");
    let attempt = |state: &Path, mem: &Path| vmm_api::SnapshotCreateParams {
        snapshot_type: SnapshotType::Full,
        snapshot_path: state.display().to_string(),
        mem_file_path: mem.display().to_string(),
    };
    let status = |r: Result<(), vmm_driver::ClientError>| match r {
        Err(vmm_driver::ClientError::Api {
            status,
            fault_message,
        }) => (status, fault_message),
        other => panic!("expected the VMM's refusal, got {other:?}"),
    };
    let (code, why) = status(
        source
            .api()
            .create_snapshot(&attempt(
                &snapshots.path().join("r.state"),
                &missing.join("r.mem"),
            ))
            .await,
    );
    assert_eq!(code, 400, "{why}");
    assert!(!why.contains("in doubt"), "{why}");
    let (code, why) = status(
        source
            .api()
            .create_snapshot(&attempt(
                &missing.join("f.state"),
                &snapshots.path().join("f.mem"),
            ))
            .await,
    );
    assert_eq!(code, 500, "{why}");
    assert!(why.contains("in doubt"), "{why}");
    drop(source);

    // The snapshot outlives the VMM that took it.
    let from_diff = restore(snapshots.path(), "diff").await;
    let seen = wait_for_count(&from_diff, at_diff + 3).await;
    assert!(seen[0] > at_snapshot + 3, "{seen:?}");
    assert!(seen[0] <= at_diff + 2, "{seen:?} vs {at_diff}");
    assert_consecutive(&seen, &from_diff.logs());
}

fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn a_restored_two_vcpu_guest_answers_on_its_own_vsock_socket() {
    let snapshots = tempfile::tempdir().unwrap();
    let mut source = TestVm::spawn().await;
    source
        .boot(&Boot {
            vcpus: 2,
            ..Boot::default()
        })
        .await;
    source.wait_for_agent().await;
    snapshot(&source, SnapshotType::Full, snapshots.path(), "agent").await;

    let mut children = Vec::new();
    for _ in 0..2 {
        let mut child = restore(snapshots.path(), "agent").await;
        let took = child.wait_for_agent().await;
        eprintln!("restore to agent: {took:?}");
        children.push(child);
    }
    // The source is still paused: its agent does not answer; resumed, it does.
    // (Once, in the lab, its API socket refused here: the VMM had ended.)
    if let Err(e) = source.api().resume().await {
        panic!("resuming the source: {e}\n{}", source.logs());
    }
    assert_eq!(
        agent_health(&source.vsock_path(), AGENT_PORT, Duration::from_secs(30))
            .await
            .unwrap(),
        204
    );
    for child in &children {
        assert_eq!(
            agent_health(&child.vsock_path(), AGENT_PORT, Duration::from_secs(30))
                .await
                .unwrap(),
            204
        );
        // Both vCPUs run work after the restore.
        assert_eq!(
            run(child, "nproc; taskset -c 1 echo on-cpu1").await,
            "2\non-cpu1"
        );
    }
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn a_corrupted_snapshot_is_refused_and_the_vmm_can_still_load_a_good_one() {
    let snapshots = tempfile::tempdir().unwrap();
    let source = counting_source(2).await;
    snapshot(&source, SnapshotType::Full, snapshots.path(), "good").await;
    drop(source);

    let state = std::fs::read(snapshots.path().join("good.state")).unwrap();
    let mut corrupted = state.clone();
    let middle = corrupted.len() / 2;
    corrupted[middle] ^= 0xff;
    std::fs::write(snapshots.path().join("bad.state"), &corrupted).unwrap();
    std::fs::write(
        snapshots.path().join("short.state"),
        &state[..state.len() - 100],
    )
    .unwrap();
    std::fs::copy(
        snapshots.path().join("good.mem"),
        snapshots.path().join("bad.mem"),
    )
    .unwrap();
    std::fs::copy(
        snapshots.path().join("good.mem"),
        snapshots.path().join("short.mem"),
    )
    .unwrap();

    let vm = TestVm::spawn().await;
    for (name, expect) in [("bad", "corrupted"), ("short", "truncated")] {
        let err = vm
            .vm()
            .load_snapshot(
                &snapshots.path().join(format!("{name}.state")),
                &snapshots.path().join(format!("{name}.mem")),
                true,
            )
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains(expect), "{name}: {err}");
        assert_eq!(
            vm.api().get_instance_info().await.unwrap().state,
            InstanceState::NotStarted
        );
    }
    // A memory file of the wrong size is refused too.
    std::fs::write(snapshots.path().join("tiny.mem"), b"tiny").unwrap();
    let err = vm
        .vm()
        .load_snapshot(
            &snapshots.path().join("good.state"),
            &snapshots.path().join("tiny.mem"),
            true,
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("holds 4 bytes"), "{err}");

    vm.vm()
        .load_snapshot(
            &snapshots.path().join("good.state"),
            &snapshots.path().join("good.mem"),
            true,
        )
        .await
        .unwrap();
    wait_for_count(&vm, 5).await;
}

/// The private and shared resident memory of a process, in KiB, from
/// `/proc/<pid>/smaps_rollup`.
fn memory_kib(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
    let field = |name: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (
        field("Private_Clean:") + field("Private_Dirty:"),
        field("Shared_Clean:") + field("Shared_Dirty:"),
    )
}

async fn run(vm: &TestVm, command: &str) -> String {
    run_with(vm, vm.vm().agent(), command).await
}

/// [`run`] through `agent` (one with its own bound).
async fn run_with(vm: &TestVm, agent: AgentClient, command: &str) -> String {
    let out = agent
        .run(command)
        .await
        .unwrap_or_else(|e| panic!("{command}: {e}\n{}", vm.logs()));
    assert_eq!(out.exit_code, 0, "{command}: {out:?}\n{}", vm.logs());
    out.stdout.trim().to_owned()
}

async fn count(vm: &TestVm) -> u64 {
    run(vm, "cat /tmp/count").await.parse().unwrap()
}

async fn fork_children(parent: &TestVm, dir: &Path, n: u32) -> Vec<TestVm> {
    // A warm pool: the VMM processes exist before the fork.
    let mut pool = Vec::new();
    for _ in 0..n {
        pool.push(TestVm::spawn().await);
    }
    let fork = parent
        .vm()
        .fork(dir, n)
        .await
        .unwrap_or_else(|e| panic!("fork: {e}\n{}", parent.logs()));
    eprintln!(
        "fork of {n}: parent paused {} us: {:?}",
        fork.paused_us, fork.phases
    );
    // The VMM says where the pause went: its steps are disjoint parts of
    // it, and only bookkeeping lies between them. The parent's next layers
    // are made before it, the children's layers and the state after it.
    let p = fork.phases.expect("the fork's answer has its phases");
    let steps = p.freeze_us + p.state_saved_us + p.memory_us + p.disks_us + p.resume_us;
    assert!(
        steps <= fork.paused_us && steps * 2 >= fork.paused_us,
        "steps {steps} us against a pause of {} us: {p:?}",
        fork.paused_us
    );
    assert!(
        p.disks_prepared_us > 0 && p.children_disks_us > 0 && p.state_written_us > 0,
        "{p:?}"
    );
    assert_eq!(fork.children_failed, None);
    assert_eq!(fork.children.len(), n as usize);
    // The answer names the layers the parent writes to now, beside the
    // children's: callers record them instead of guessing their names.
    let drives =
        |d: &[vmm_api::DriveOverride]| d.iter().map(|d| d.drive_id.clone()).collect::<Vec<_>>();
    assert!(!fork.parent.is_empty(), "{fork:?}");
    for d in &fork.parent {
        let layer = Path::new(&d.path_on_host);
        assert!(layer.starts_with(dir) && layer.is_file(), "{d:?}");
    }
    for child in &fork.children {
        assert_eq!(drives(child), drives(&fork.parent));
    }
    for (i, child) in pool.iter_mut().enumerate() {
        child.vm().load_fork_child(&fork, i).await.unwrap();
        agent_after_restore(child).await;
    }
    pool
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn forks_of_a_running_vm_continue_diverge_and_share_memory() {
    let work = tempfile::tempdir().unwrap();
    let base = work.path().join("data.img");
    common::write_file(&base, &vec![0u8; 8 << 20]);
    let top = work.path().join("data.top");
    disk_layers::LayeredDisk::create(&base, &top).unwrap();

    let mut parent = TestVm::spawn().await;
    parent
        .boot(&Boot {
            drives: vec![(top.clone(), false)],
            ..Boot::default()
        })
        .await;
    parent.wait_for_agent().await;
    run(
        &parent,
        "echo parent | dd of=/dev/vdb conv=fsync 2>/dev/null; \
         (i=0; while true; do i=$((i+1)); echo $i > /tmp/n; mv /tmp/n /tmp/count; sleep 0.1; done) \
         >/dev/null 2>&1 </dev/null & echo started",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let fork_dir = work.path().join("fork1");
    std::fs::create_dir(&fork_dir).unwrap();
    let at_fork = count(&parent).await;
    let children = fork_children(&parent, &fork_dir, 3).await;

    // The parent runs on.
    let parent_later = count(&parent).await;
    assert!(parent_later > at_fork, "{parent_later} <= {at_fork}");

    let mut randoms = Vec::new();
    for (i, child) in children.iter().enumerate() {
        // Each child kept counting from the fork point.
        let first = count(child).await;
        assert!(first >= at_fork, "child {i}: {first} < {at_fork}");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(count(child).await > first, "child {i} stopped counting");
        // Then writes its own memory and disk.
        run(
            child,
            &format!(
                "echo child{i} > /tmp/who; echo child{i} | dd of=/dev/vdb conv=fsync 2>/dev/null"
            ),
        )
        .await;
        randoms.push(run(child, "head -c 16 /dev/urandom | od -An -tx1").await);
    }
    for (i, child) in children.iter().enumerate() {
        assert_eq!(run(child, "cat /tmp/who").await, format!("child{i}"));
        assert_eq!(
            run(
                child,
                "dd if=/dev/vdb bs=512 count=1 iflag=direct 2>/dev/null | head -c 6"
            )
            .await,
            format!("child{i}")[..6]
        );
    }
    assert_eq!(
        run(&parent, "cat /tmp/who 2>/dev/null || echo none").await,
        "none"
    );
    assert_eq!(
        run(
            &parent,
            "dd if=/dev/vdb bs=512 count=1 iflag=direct 2>/dev/null | head -c 6"
        )
        .await,
        "parent"
    );
    randoms.sort();
    randoms.dedup();
    assert_eq!(randoms.len(), children.len(), "children share RNG output");

    // Siblings share the frozen memory: most of each child is shared.
    for child in &children {
        let (private, shared) = memory_kib(child.vm().pid());
        eprintln!("child: private {private} KiB, shared {shared} KiB");
        assert!(
            shared > private,
            "private {private} KiB vs shared {shared} KiB"
        );
    }

    // A fork of a fork.
    let fork_dir = work.path().join("fork2");
    std::fs::create_dir(&fork_dir).unwrap();
    let grandchildren = fork_children(&children[1], &fork_dir, 1).await;
    assert_eq!(run(&grandchildren[0], "cat /tmp/who").await, "child1");
    let g = count(&grandchildren[0]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(count(&grandchildren[0]).await > g);
    assert_eq!(
        run(
            &grandchildren[0],
            "dd if=/dev/vdb bs=512 count=1 iflag=direct 2>/dev/null | head -c 6"
        )
        .await,
        "child1"
    );
}

/// The children's layers are made after the parent resumed; when they
/// cannot be (here a file already holds a child's layer path), the parent
/// has forked all the same and runs on its new layer, the answer says why
/// there are no children, and nothing of theirs is left: no child layer,
/// no state file, the file in the way untouched. The next fork works.
#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn a_fork_whose_children_cannot_be_made_keeps_its_parent_and_leaves_nothing() {
    let work = tempfile::tempdir().unwrap();
    let base = work.path().join("data.img");
    common::write_file(&base, &vec![0u8; 8 << 20]);
    let top = work.path().join("data.top");
    disk_layers::LayeredDisk::create(&base, &top).unwrap();
    let mut parent = TestVm::spawn().await;
    parent
        .boot(&Boot {
            drives: vec![(top.clone(), false)],
            ..Boot::default()
        })
        .await;
    parent.wait_for_agent().await;
    run(
        &parent,
        "echo before | dd of=/dev/vdb conv=fsync 2>/dev/null",
    )
    .await;

    let fork_dir = work.path().join("fork1");
    std::fs::create_dir(&fork_dir).unwrap();
    let in_the_way = fork_dir.join("data0.2.layer");
    std::fs::write(&in_the_way, b"not a layer").unwrap();
    let fork = parent
        .vm()
        .fork(&fork_dir, 2)
        .await
        .unwrap_or_else(|e| panic!("fork: {e}\n{}", parent.logs()));
    eprintln!("a fork whose children failed: {fork:?}");
    let why = fork
        .children_failed
        .as_deref()
        .expect("the answer says why");
    assert!(why.contains("data0.2.layer"), "{why}");
    assert!(fork.children.is_empty(), "{fork:?}");
    let next = fork_dir.join("data0.0.layer");
    assert_eq!(fork.parent.len(), 1, "{fork:?}");
    assert_eq!(Path::new(&fork.parent[0].path_on_host), next);
    let mut left: Vec<String> = std::fs::read_dir(&fork_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    // The frozen memory stays: the parent runs on it.
    assert_eq!(
        left,
        ["data0.0.layer", "data0.2.layer", "fork.mem"],
        "{left:?}"
    );
    assert_eq!(std::fs::read(&in_the_way).unwrap(), b"not a layer");

    // The parent runs on, writing to its new layer over the sealed one.
    let read = "dd if=/dev/vdb bs=512 count=1 iflag=direct 2>/dev/null | head -c 6";
    assert_eq!(run(&parent, read).await, "before");
    run(
        &parent,
        "echo after! | dd of=/dev/vdb conv=fsync 2>/dev/null",
    )
    .await;
    assert_eq!(run(&parent, read).await, "after!");
    let sealed = disk_layers::LayeredDisk::open(&top).unwrap();
    let mut first = [0u8; 6];
    sealed.read_at(&mut first, 0).unwrap();
    assert_eq!(
        &first, b"before",
        "the sealed layer kept the disk at the fork"
    );

    // A fork after it works, from the parent's disk as it is now.
    let fork_dir = work.path().join("fork2");
    std::fs::create_dir(&fork_dir).unwrap();
    let children = fork_children(&parent, &fork_dir, 1).await;
    assert_eq!(run(&children[0], read).await, "after!");
}

#[tokio::test]
#[ignore = "lab: boots a microVM with a network interface on a tap"]
async fn a_networked_guest_restored_onto_another_tap_still_reaches_the_host() {
    let snapshots = tempfile::tempdir().unwrap();
    let first_tap = common::HostTap::create("sfk0");
    let mut source = TestVm::spawn().await;
    source.configure(&Boot::default()).await;
    source
        .api()
        .put_network_interface(&NetworkInterface::new(
            "eth0",
            &first_tap.name,
            Some(common::GUEST_MAC),
        ))
        .await
        .unwrap();
    source.api().instance_start().await.unwrap();
    source.wait_for_agent().await;
    common::guest_net_up_and_ping(&source.vm().agent()).await;
    snapshot(&source, SnapshotType::Full, snapshots.path(), "net").await;
    drop(source);
    drop(first_tap);

    let state = snapshots.path().join("net.state");
    let mem = snapshots.path().join("net.mem");
    let second_tap = common::HostTap::create("sfk1");
    let mut restored = TestVm::spawn().await;
    let mut params =
        SnapshotLoadParams::from_file(state.display().to_string(), mem.display().to_string(), true);
    params.vsock_override = Some(VsockOverride {
        uds_path: restored.vsock_path().display().to_string(),
    });
    // An override for an interface the snapshot does not have is refused.
    params.network_overrides = vec![NetworkOverride {
        iface_id: "eth9".into(),
        host_dev_name: second_tap.name.clone(),
    }];
    let err = restored.api().load_snapshot(&params).await.unwrap_err();
    assert!(
        err.to_string().contains("no such network interface"),
        "{err}"
    );

    params.network_overrides[0].iface_id = "eth0".into();
    restored
        .api()
        .load_snapshot(&params)
        .await
        .unwrap_or_else(|e| panic!("load: {e}\n{}", restored.logs()));
    agent_after_restore(&mut restored).await;
    let agent = restored.vm().agent();
    // eth0 kept its address and MAC; it now reaches the host through sfk1.
    let out = agent
        .run(&format!(
            "cat /sys/class/net/eth0/address && ping -c 3 -W 10 {}",
            common::HOST_IP
        ))
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}\n{}", restored.logs());
    assert!(out.stdout.starts_with(common::GUEST_MAC), "{out:?}");
    assert!(out.stdout.contains("3 received"), "{out:?}");
    common::tcp_exchange(&agent).await;
}

/// The VMM process's proportional set size in MiB, as the node's admission
/// reads it.
fn pss_mib(vm: &TestVm) -> u64 {
    host_mem::ProcessMemory::of(vm.pid()).unwrap().pss_kib / 1024
}

/// MiB a guest fills and frees in the balloon tests. Small: every page a
/// guest touches first is a nested page fault, which the emulated lab serves
/// so slowly that 200 MiB made its own kernel stall for minutes (CI), and
/// 64 MiB for 84 s, a dd past the agent's 60 s (stop 43's CI).
const FILL_MIB: u64 = 32;
/// The fill's own bound: the lab may stall while it serves those faults.
const FILL_WITHIN: Duration = Duration::from_secs(180);
/// How long freed memory may take to leave the VMM: the guest reports free
/// blocks 2 s after it frees them, a few batches of 32 at a time, and the
/// lab is emulated.
const GIVE_BACK_WITHIN: Duration = Duration::from_secs(60);

/// A 512 MiB guest, so that the fill fits in a tmpfs beside the rest.
fn roomy() -> Boot {
    Boot {
        mem_mib: 512,
        ..Boot::default()
    }
}

/// Fills a fresh tmpfs in the guest with `FILL_MIB` MiB, then removes the
/// file and waits until the VMM's Pss falls by at least 3/4 of it, or the
/// bound passes. Returns the Pss before, with the file, and at the end.
async fn fill_and_free(vm: &TestVm, expect_back: bool) -> (u64, u64, u64) {
    run(
        vm,
        "mkdir -p /run/fill && mount -t tmpfs -o size=128m fill /run/fill && echo ok",
    )
    .await;
    // Freed guest memory from the boot settles first (it is reported too).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before = pss_mib(vm);
    run_with(
        vm,
        vm.vm().agent().with_timeout(FILL_WITHIN),
        &format!("dd if=/dev/zero of=/run/fill/f bs=1M count={FILL_MIB} 2>/dev/null && echo ok"),
    )
    .await;
    let full = pss_mib(vm);
    assert!(
        full >= before + FILL_MIB * 9 / 10,
        "the guest's {FILL_MIB} MiB did not reach the VMM: Pss {before} -> {full} MiB"
    );
    run(vm, "rm /run/fill/f && echo ok").await;
    let freed = Instant::now();
    let target = full - FILL_MIB * 3 / 4;
    // Without a balloon, long enough for reports that would have come.
    let bound = if expect_back {
        GIVE_BACK_WITHIN
    } else {
        Duration::from_secs(15)
    };
    let mut now = pss_mib(vm);
    while now > target && freed.elapsed() < bound {
        tokio::time::sleep(Duration::from_millis(500)).await;
        now = pss_mib(vm);
    }
    eprintln!(
        "VMM Pss: {before} MiB before, {full} MiB with {FILL_MIB} MiB in tmpfs, \
         {now} MiB {:.1} s after the file was removed",
        freed.elapsed().as_secs_f64()
    );
    if expect_back {
        assert!(
            now <= target,
            "Pss {now} MiB {GIVE_BACK_WITHIN:?} after freeing; expected at most {target} MiB"
        );
    }
    (before, full, now)
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn memory_a_guest_frees_goes_back_to_the_host_booted_and_restored() {
    let snapshots = tempfile::tempdir().unwrap();
    let mut booted = TestVm::spawn().await;
    booted.configure(&roomy()).await;
    booted
        .api()
        .put_balloon(&vmm_api::Balloon {
            amount_mib: 0,
            deflate_on_oom: true,
            stats_polling_interval_s: 1,
            free_page_reporting: true,
            free_page_hinting: false,
        })
        .await
        .unwrap();
    booted.api().instance_start().await.unwrap();
    booted.wait_for_agent().await;
    // Booted: guest memory is a memfd; freed pages are punched out of it.
    fill_and_free(&booted, true).await;
    let stats = booted.api().get_balloon_stats().await.unwrap();
    eprintln!("booted: {stats:?}");
    assert!(
        stats.reported_bytes >= (FILL_MIB * 3 / 4) << 20,
        "{stats:?}"
    );
    assert_eq!(
        stats.total_memory.map(|b| b >> 20).map(|m| m > 400),
        Some(true),
        "{stats:?}"
    );

    // A target: the guest inflates the balloon to it and says so.
    booted.api().patch_balloon(64).await.unwrap();
    let started = Instant::now();
    loop {
        let s = booted.api().get_balloon_stats().await.unwrap();
        if s.actual_mib == 64 {
            assert!(s.inflated_bytes >= 60 << 20, "{s:?}");
            break;
        }
        assert!(started.elapsed() < GIVE_BACK_WITHIN, "not inflated: {s:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    booted.api().patch_balloon(0).await.unwrap();
    let started = Instant::now();
    while booted.api().get_balloon_stats().await.unwrap().actual_mib != 0 {
        assert!(started.elapsed() < GIVE_BACK_WITHIN, "not deflated");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Restored: memory is the snapshot's file mapped privately; freed pages
    // drop their private copies. The balloon came with the snapshot.
    snapshot(&booted, SnapshotType::Full, snapshots.path(), "balloon").await;
    drop(booted);
    let mut restored = restore(snapshots.path(), "balloon").await;
    restored.wait_for_agent().await;
    assert!(
        restored
            .api()
            .get_balloon()
            .await
            .unwrap()
            .free_page_reporting
    );
    fill_and_free(&restored, true).await;
    let stats = restored.api().get_balloon_stats().await.unwrap();
    assert!(
        stats.reported_bytes >= (FILL_MIB * 3 / 4) << 20,
        "{stats:?}"
    );
    // Its statistics go on after the restore (the guest's buffer was kept).
    assert!(stats.free_memory.is_some(), "{stats:?}");
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn without_a_balloon_memory_a_guest_frees_stays_with_its_vmm() {
    let mut vm = TestVm::spawn().await;
    vm.boot(&roomy()).await;
    vm.wait_for_agent().await;
    let (_, full, end) = fill_and_free(&vm, false).await;
    // What the balloon test gives back stays here: the comparison it needs.
    assert!(
        end + FILL_MIB / 2 > full,
        "Pss {full} -> {end} MiB without a balloon"
    );
    assert!(vm.api().get_balloon().await.is_err());
}

/// The CPU flags the guest's kernel sees (`/proc/cpuinfo`).
async fn guest_cpu_flags(vm: &TestVm) -> Vec<String> {
    run(vm, "grep -m1 '^flags' /proc/cpuinfo")
        .await
        .split_whitespace()
        .skip(2)
        .map(str::to_owned)
        .collect()
}

/// Whether this host's KVM can offer `name` (a Linux flag name).
fn kvm_offers(host: &[kvm_bindings::kvm_cpuid_entry2], name: &str) -> bool {
    use vmm::arch::x86_64::cpu_features::{feature, read};
    feature(name).is_some_and(|f| read(host, f.reg) & f.mask() != 0)
}

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn a_guest_under_a_cpu_template_sees_its_level_only_and_restores() {
    let kvm = kvm_ioctls::Kvm::new().unwrap();
    let supported = vmm::vstate::vm::supported_cpuid(&kvm).unwrap();
    let host = supported.as_slice();
    // What x86-64-v2 takes away that this host (the lab's nested KVM) has:
    // there must be some, or the test proves nothing.
    let above_v2: Vec<&str> = [
        "avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "xsave",
    ]
    .into_iter()
    .filter(|f| kvm_offers(host, f))
    .collect();
    eprintln!("this host's KVM offers, above x86-64-v2: {above_v2:?}");
    assert!(
        !above_v2.is_empty(),
        "the host offers nothing above x86-64-v2"
    );

    // A level the lab's CPU lacks is refused before boot, by name.
    let refused = TestVm::spawn().await;
    if !kvm_offers(host, "avx512f") {
        let machine = vmm_api::MachineConfig {
            cpu_template: Some(vmm_api::CpuTemplate::X86_64V4),
            ..vmm_api::MachineConfig::new(1, 128)
        };
        let err = refused
            .api()
            .put_machine_config(&machine)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("x86-64-v4") && err.contains("avx512f"),
            "{err}"
        );
    }
    drop(refused);

    let snapshots = tempfile::tempdir().unwrap();
    let mut source = TestVm::spawn().await;
    source
        .boot(&Boot {
            cpu_template: Some(vmm_api::CpuTemplate::X86_64V2),
            ..Boot::default()
        })
        .await;
    source.wait_for_agent().await;
    let check = |flags: &[String], logs: &str| {
        for f in &above_v2 {
            assert!(
                !flags.iter().any(|g| g == f),
                "{f} under x86-64-v2: {flags:?}\n{logs}"
            );
        }
        for f in [
            "sse4_2",
            "ssse3",
            "popcnt",
            "cx16",
            "pni",
            "x2apic",
            "hypervisor",
        ] {
            assert!(
                flags.iter().any(|g| g == f),
                "{f} missing under x86-64-v2: {flags:?}\n{logs}"
            );
        }
    };
    let flags = guest_cpu_flags(&source).await;
    eprintln!("guest flags under x86-64-v2: {}", flags.join(" "));
    check(&flags, &source.logs());

    // Its snapshot restores (this host has all it offers), CPU unchanged.
    source.api().pause().await.unwrap();
    snapshot(&source, SnapshotType::Full, snapshots.path(), "v2").await;
    drop(source);
    let mut restored = restore(snapshots.path(), "v2").await;
    agent_after_restore(&mut restored).await;
    assert_eq!(guest_cpu_flags(&restored).await, flags);
    assert_eq!(run(&restored, "echo restored").await, "restored");
}

/// Loads `name` from `dir` into a fresh VMM with `drives` instead of the
/// snapshot's, and waits for its agent.
async fn restore_onto(dir: &Path, name: &str, drives: Vec<vmm_api::DriveOverride>) -> TestVm {
    let mut vm = TestVm::spawn().await;
    let plan = vmm_driver::process::Restore {
        state: dir.join(format!("{name}.state")),
        mem: dir.join(format!("{name}.mem")),
        drives,
        prefetch: None,
    };
    vm.vm()
        .restore(&plan)
        .await
        .unwrap_or_else(|e| panic!("load {name}: {e}\n{}", vm.logs()));
    vm.wait_for_agent().await;
    vm.vm()
        .agent()
        .init(&vmm_driver::agent_client::AgentInit::after_restore().unwrap())
        .await
        .unwrap();
    vm
}

/// The guest's device of drive `id` (its virtio serial is the drive's id).
const VOLUME_DEV: &str = "d=/dev/$(grep -lx data0 /sys/block/vd*/serial | cut -d/ -f4)";

#[tokio::test]
#[ignore = "lab: boots a microVM"]
async fn a_spare_drive_restored_onto_a_volume_mounts_keeps_its_files_and_forks_copy_on_write() {
    const SIZE: u64 = 64 << 20;
    let work = tempfile::tempdir().unwrap();
    // The snapshot's spare drive: a writable sparse placeholder, never written.
    let placeholder = work.path().join("slot.img");
    std::fs::File::create(&placeholder)
        .unwrap()
        .set_len(SIZE)
        .unwrap();
    let template = TestVm::spawn().await;
    template
        .boot(&Boot {
            drives: vec![(placeholder.clone(), false)],
            ..Boot::default()
        })
        .await;
    let mut template = template;
    template.wait_for_agent().await;
    // The kernel read the placeholder's first sectors when it probed it:
    // they sit in the snapshot's page cache.
    snapshot(&template, SnapshotType::Full, work.path(), "template").await;
    drop(template);

    // The volume: an ext4 image under a writable layer, smaller than the
    // slot (the guest keeps the placeholder's capacity; the filesystem
    // never reaches past its own end).
    let base = work.path().join("volume.img");
    std::fs::File::create(&base)
        .unwrap()
        .set_len(SIZE / 2)
        .unwrap();
    let mkfs = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&base)
        .output()
        .unwrap();
    assert!(mkfs.status.success(), "{mkfs:?}");
    let top = work.path().join("volume.layer");
    disk_layers::LayeredDisk::create(&base, &top).unwrap();
    let on = |path: &Path| {
        vec![vmm_api::DriveOverride::new(
            "data0",
            path.display().to_string(),
        )]
    };

    let vm = restore_onto(work.path(), "template", on(&top)).await;
    // Mounted under /tmp: the test guest's root is read-only.
    run(
        &vm,
        &format!(
            "{VOLUME_DEV}; blockdev --flushbufs $d && mkdir -p /tmp/vol && mount $d /tmp/vol \
             && echo parent > /tmp/vol/f && sync"
        ),
    )
    .await;
    // Paused and resumed (onto the same layer): the volume is still mounted
    // with its file.
    snapshot(&vm, SnapshotType::Full, work.path(), "paused").await;
    drop(vm);
    let parent = restore_onto(work.path(), "paused", on(&top)).await;
    assert_eq!(run(&parent, "cat /tmp/vol/f").await, "parent");

    // Each fork child has its own copy of the volume.
    let fork_dir = work.path().join("fork");
    std::fs::create_dir(&fork_dir).unwrap();
    let children = fork_children(&parent, &fork_dir, 2).await;
    for (i, child) in children.iter().enumerate() {
        assert_eq!(run(child, "cat /tmp/vol/f").await, "parent");
        run(child, &format!("echo child{i} > /tmp/vol/f && sync")).await;
    }
    for (i, child) in children.iter().enumerate() {
        assert_eq!(
            run(child, "echo 3 > /proc/sys/vm/drop_caches; cat /tmp/vol/f").await,
            format!("child{i}")
        );
    }
    assert_eq!(
        run(&parent, "echo 3 > /proc/sys/vm/drop_caches; cat /tmp/vol/f").await,
        "parent"
    );

    // A spare drive left unused is restored read-only: the guest's writes
    // fail and the shared placeholder stays untouched.
    let mut unused = on(&placeholder);
    unused[0].read_only = true;
    let vm = restore_onto(work.path(), "template", unused).await;
    let out = vm
        .vm()
        .agent()
        .run(&format!(
            "{VOLUME_DEV}; echo x | dd of=$d bs=4096 count=1 conv=sync oflag=direct"
        ))
        .await
        .unwrap();
    assert_ne!(out.exit_code, 0, "{out:?}");
    assert_eq!(allocated(&placeholder), 0);
}

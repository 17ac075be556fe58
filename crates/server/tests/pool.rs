//! The warm pool with the real VMM binary (its API serves without a guest,
//! so this runs on any host): VMMs wait in the node's run dir, a dead one is
//! never handed out, closing stops them.

mod common;

use std::time::{Duration, Instant};

use common::vmm_binary;
use server::pool::Pool;
use vmm_driver::process::ProcessIdentity;

fn vmm_dirs(run_dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(run_dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_pooled_vmm_is_replaced_and_close_stops_the_rest() {
    let scratch = tempfile::tempdir().unwrap();
    let run_dir = scratch.path().join("run");
    let pool = Pool::start(vmm_binary(), run_dir.clone(), 1);
    let deadline = Instant::now() + Duration::from_secs(30);
    while pool.idle_count() < 1 {
        assert!(Instant::now() < deadline, "the pool never filled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dirs = vmm_dirs(&run_dir);
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    let dead = ProcessIdentity::read(&dirs[0]).expect("an identity file");
    dead.kill();
    while dead.is_alive() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut vm = pool.take().await.expect("a VMM");
    assert_ne!(vm.pid(), dead.pid, "the dead VMM was handed out");
    assert!(vm.is_running());
    vm.api().get_instance_info().await.expect("it answers");
    assert!(!dirs[0].exists(), "the dead VMM's directory is removed");

    // Refilled meanwhile; closing stops the idle ones.
    let deadline = Instant::now() + Duration::from_secs(30);
    while pool.idle_count() < 1 {
        assert!(Instant::now() < deadline, "the pool never refilled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let idle: Vec<ProcessIdentity> = vmm_dirs(&run_dir)
        .iter()
        .filter(|d| **d != vm.dir())
        .filter_map(|d| ProcessIdentity::read(d))
        .collect();
    pool.close();
    for p in &idle {
        let deadline = Instant::now() + Duration::from_secs(10);
        while p.is_alive() {
            assert!(Instant::now() < deadline, "pid {} survived close", p.pid);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(vmm_dirs(&run_dir), vec![vm.dir().to_owned()]);
}

/// A server that crashed between starting a VMM and recording its identity
/// left a directory without `vmm.pid`: the next start still finds the VMM
/// (by its socket argument) and stops it, and leaves owned VMMs alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reclaim_stops_a_vmm_whose_identity_was_never_recorded() {
    let scratch = tempfile::tempdir().unwrap();
    let run_dir = scratch.path().join("run");
    let unrecorded = run_dir.join("vmm-unrecorded");
    std::fs::create_dir_all(&unrecorded).unwrap();
    let mut orphan = std::process::Command::new(vmm_binary())
        .arg("--api-sock")
        .arg(unrecorded.join("api.sock"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !unrecorded.join("api.sock").exists() {
        assert!(Instant::now() < deadline, "the VMM never bound its socket");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ProcessIdentity::read(&unrecorded).is_none());

    let store = server::store::Store::open(&scratch.path().join("store.redb")).unwrap();
    server::sandbox::reclaim_run_dir(&run_dir, &store);

    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = orphan.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the unrecorded VMM survived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(!status.success(), "{status}");
    assert!(!unrecorded.exists(), "its directory is removed");
}

/// A fork's children take their VMMs at once: more than the pool holds,
/// each a different process that answers, the pool's own handed out first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn take_many_hands_out_the_pooled_vmms_and_starts_the_rest_together() {
    let scratch = tempfile::tempdir().unwrap();
    let run_dir = scratch.path().join("run");
    let pool = Pool::start(vmm_binary(), run_dir.clone(), 2);
    let deadline = Instant::now() + Duration::from_secs(30);
    while pool.idle_count() < 2 {
        assert!(Instant::now() < deadline, "the pool never filled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pooled: Vec<u32> = vmm_dirs(&run_dir)
        .iter()
        .filter_map(|d| ProcessIdentity::read(d))
        .map(|p| p.pid)
        .collect();
    let taken = pool
        .take_many(6, &sandfork_network::EgressPolicy::default())
        .await;
    assert_eq!(taken.len(), 6);
    let mut pids = Vec::new();
    for t in taken {
        let (vm, net) = t.expect("a VMM");
        assert!(net.is_none());
        vm.api().get_instance_info().await.expect("it answers");
        pids.push(vm.pid());
    }
    let mut distinct = pids.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 6, "{pids:?}");
    for p in pooled {
        assert!(
            pids.contains(&p),
            "pooled VMM {p} was not handed out: {pids:?}"
        );
    }
    pool.close();
}

//! The warm pool with the real VMM binary (its API serves without a guest,
//! so this runs on any host): VMMs wait in the node's run dir, a dead one is
//! never handed out, closing stops them.

#![cfg(test)]

mod common;

use std::time::{Duration, Instant};

use common::vmm_binary;
use server::node::pool::Pool;
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

    let store = server::node::store::Store::open(&scratch.path().join("store.redb")).unwrap();
    server::node::sandbox::reclaim_run_dir(&run_dir, &store);

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

/// A burst of guest loads runs in waves: at most `load_limit` at once, the
/// rest wait their turn, and every one ends. Each snapshot is a FIFO, so a
/// VMM's load stays in its read of the state file until the test lets it
/// go: a FIFO with a reader is a load under way (opening its write end
/// without blocking succeeds only then), and the writer held open keeps
/// that load waiting until it is dropped (end of file: the load fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_loads_run_at_most_load_limit_at_once() {
    use rustix::fs::{CWD, FileType, Mode, OFlags};

    let scratch = tempfile::tempdir().unwrap();
    let pool = Pool::start(vmm_binary(), scratch.path().join("run"), 0);
    let limit = pool.load_limit();
    let n = limit + 2;
    let fifos: Vec<std::path::PathBuf> = (0..n)
        .map(|i| {
            let p = scratch.path().join(format!("state-{i}"));
            rustix::fs::mknodat(CWD, &p, FileType::Fifo, Mode::from_raw_mode(0o600), 0).unwrap();
            p
        })
        .collect();
    let mut loads = tokio::task::JoinSet::new();
    let vmms = pool
        .take_many(n, &sandfork_network::EgressPolicy::default())
        .await;
    for (taken, state) in vmms.into_iter().zip(&fifos) {
        let (vm, _) = taken.expect("a VMM");
        let restore = vmm_driver::process::Restore {
            state: state.clone(),
            mem: scratch.path().join("memory"),
            drives: Vec::new(),
            prefetch: None,
        };
        let pool = pool.clone();
        loads.spawn(async move {
            let loaded = pool.restore(&vm, &restore).await;
            (vm, loaded)
        });
    }
    // The write end of every FIFO a load reads now, held open.
    let mut held: Vec<Option<rustix::fd::OwnedFd>> = (0..n).map(|_| None).collect();
    let mut seen = vec![false; n];
    let probe = |held: &mut Vec<Option<rustix::fd::OwnedFd>>, seen: &mut Vec<bool>| {
        for (i, fifo) in fifos.iter().enumerate() {
            if seen[i] {
                continue;
            }
            if let Ok(fd) = rustix::fs::open(fifo, OFlags::WRONLY | OFlags::NONBLOCK, Mode::empty())
            {
                held[i] = Some(fd);
                seen[i] = true;
            }
        }
        held.iter().filter(|h| h.is_some()).count()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while probe(&mut held, &mut seen) < limit {
        assert!(Instant::now() < deadline, "the first loads never started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The rest wait their turn.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        probe(&mut held, &mut seen),
        limit,
        "more loads than the limit at once"
    );
    // Each load let go makes room for one more, until all have run.
    while seen.iter().any(|s| !s) {
        assert!(
            Instant::now() < deadline,
            "seen {seen:?}: the waiting loads never ran"
        );
        if let Some(h) = held.iter_mut().find(|h| h.is_some()) {
            drop(h.take());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            probe(&mut held, &mut seen) <= limit,
            "more loads than the limit at once"
        );
    }
    held.clear();
    let mut ended = 0;
    while let Some(done) = loads.join_next().await {
        let (_vm, loaded) = done.unwrap();
        assert!(loaded.is_err(), "an empty state file loaded");
        ended += 1;
    }
    assert_eq!(ended, n);
    pool.close();
}

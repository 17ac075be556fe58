//! The manager's state changes against interleavings no lab is needed for:
//! a real store and a pool whose VMM binary does not exist, so that any
//! restore fails at once.

use std::sync::Arc;
use std::time::Duration;

use super::Manager;
use crate::config::Config;
use crate::pool::Pool;
use crate::store::{PausedSnapshot, SandboxRecord, SandboxState, Store, TemplateRecord};

const ID: &str = "iabcdefghijklmnopqrst";

fn paused(data: &std::path::Path) -> SandboxRecord {
    SandboxRecord {
        id: ID.into(),
        template_id: "base".into(),
        started_at_ms: 1,
        end_at_ms: 2,
        state: SandboxState::Paused,
        cpu_count: 1,
        memory_mb: 128,
        disk_size_mb: 1,
        pause_generation: 1,
        snapshot: Some(PausedSnapshot {
            state: data.join("pause-1.state"),
            mem: data.join("pause-1.mem"),
        }),
        uses_dirs: vec![data.join("sandboxes").join(ID)],
        ..Default::default()
    }
}

fn manager(data: &std::path::Path) -> Arc<Manager> {
    let mut config = Config::new(
        "127.0.0.1:0".parse().unwrap(),
        "/nonexistent/vmlinux".into(),
        data.join("rootfs.raw"),
        "/nonexistent/sandfork-vmm".into(),
    );
    config.data_dir = data.to_owned();
    config.run_dir = Some(data.join("run"));
    config.pool_size = 0;
    config.capacity.min_free_disk_mib = 0;
    let store = Store::open(&data.join("s.redb")).unwrap();
    store.put_sandbox(&paused(data)).unwrap();
    let template = TemplateRecord {
        id: "base".into(),
        dir: data.join("templates/base"),
        snapshot: data.join("templates/base/vm.state"),
        mem: data.join("templates/base/vm.mem"),
        root_layer: data.join("templates/base/root.layer"),
        root_drive_id: "rootfs".into(),
        kernel: config.kernel.clone(),
        rootfs: config.rootfs.clone(),
        vcpus: 1,
        mem_mib: 128,
        disk_size_mb: 1,
        ..Default::default()
    };
    let pool = Pool::start(config.vmm.clone(), data.join("run"), 0);
    Manager::new(config, store, pool, template)
}

/// Two resumes of one paused sandbox: the second, which read the record
/// before the first finished, must not restore it again (two VMMs would
/// write one root layer); it finds it running and only extends its time.
#[tokio::test]
async fn a_resume_that_waited_finds_the_sandbox_running() {
    let tmp = tempfile::tempdir().unwrap();
    let m = manager(tmp.path());
    // Hold the second resume before its claim, as a first resume's would.
    let busy = m.activity.write().await;
    let second = tokio::spawn({
        let m = m.clone();
        async move { m.resume(ID, Duration::from_secs(60)).await }
    });
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    // The first resume has restored it meanwhile.
    m.store
        .update_sandbox(ID, |s| {
            s.state = SandboxState::Running;
            s.vmm_dir = Some(tmp.path().join("run/vmm-1"));
        })
        .unwrap();
    drop(busy);
    let (r, resumed) = second.await.unwrap().expect("no second restore");
    assert!(!resumed);
    assert_eq!(r.state, SandboxState::Running);
    assert!(r.end_at_ms > 2, "its time was extended");
}

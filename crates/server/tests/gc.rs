//! The garbage collector on real files: real layered disks (a base template,
//! a sandbox forked into children, orphans), records in the real store.

#![cfg(test)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use disk_layers::LayeredDisk;
use server::node::config::Config;
use server::node::pool::Pool;
use server::node::sandbox::Manager;
use server::node::store::{SandboxRecord, SandboxState, Store, TemplateRecord};

fn record(id: &str, root: &Path, uses: &[&Path]) -> SandboxRecord {
    SandboxRecord {
        id: id.into(),
        template_id: "base".into(),
        started_at_ms: 1,
        end_at_ms: u64::MAX,
        state: SandboxState::Paused,
        cpu_count: 1,
        memory_mb: 256,
        disk_size_mb: 1,
        root_layer: Some(root.to_owned()),
        uses_dirs: uses.iter().map(|p| p.to_path_buf()).collect(),
        ..Default::default()
    }
}

fn layer_over(base: &Path, top: &Path) {
    std::fs::create_dir_all(top.parent().unwrap()).unwrap();
    LayeredDisk::create(base, top).unwrap();
}

struct Setup {
    _tmp: tempfile::TempDir,
    data: PathBuf,
    manager: Arc<Manager>,
}

fn setup(records: impl FnOnce(&Path) -> Vec<SandboxRecord>) -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().to_owned();
    let mut config = Config::new(
        "127.0.0.1:0".parse().unwrap(),
        "/nonexistent/vmlinux".into(),
        data.join("rootfs.raw"),
        "/nonexistent/sandfork-vmm".into(),
    );
    config.data_dir = data.clone();
    config.pool_size = 0;
    std::fs::write(&config.rootfs, vec![0u8; 1 << 20]).unwrap();
    let base = data.join("templates/base/root.layer");
    layer_over(&config.rootfs, &base);
    let scratch = data.join("templates/base/unused.layer");
    LayeredDisk::open(&base)
        .unwrap()
        .seal_and_branch(&scratch, &[])
        .unwrap();
    std::fs::remove_file(scratch).unwrap();
    let store = Store::open(&data.join("s.redb")).unwrap();
    for r in records(&data) {
        store.put_sandbox(&r).unwrap();
    }
    let template = TemplateRecord {
        id: "base".into(),
        dir: data.join("templates/base"),
        snapshot: data.join("templates/base/vm.state"),
        mem: data.join("templates/base/vm.mem"),
        root_layer: base,
        root_drive_id: "rootfs".into(),
        kernel: config.kernel.clone(),
        rootfs: config.rootfs.clone(),
        vcpus: 1,
        mem_mib: 256,
        disk_size_mb: 1,
        ..Default::default()
    };
    store.put_template(&template).unwrap();
    let pool = Pool::start(config.vmm.clone(), config.run_dir(), 0);
    let manager = Manager::new(config, store, pool, template);
    Setup {
        _tmp: tmp,
        data,
        manager,
    }
}

#[tokio::test]
async fn unused_dirs_and_layers_go_and_what_a_chain_reads_stays() {
    let s = setup(|data| {
        let base = data.join("templates/base/root.layer");
        // Sandbox a was forked into children 1 and 2 in fork f, then killed
        // (its directory kept: the fork stacks on its sealed layer); child 2
        // was killed too. Child 1 and sandbox b live.
        let a = data.join("sandboxes/a");
        let f = data.join("forks/f");
        layer_over(&base, &a.join("root.layer"));
        std::fs::create_dir_all(&f).unwrap();
        LayeredDisk::open(&a.join("root.layer"))
            .unwrap()
            .seal_and_branch(
                &f.join("rootfs.0.layer"),
                &[f.join("rootfs.1.layer"), f.join("rootfs.2.layer")],
            )
            .unwrap();
        let c1 = data.join("sandboxes/c1");
        std::fs::create_dir_all(&c1).unwrap();
        let b = data.join("sandboxes/b");
        layer_over(&base, &b.join("root.layer"));
        // Orphans: a killed sandbox's kept directory and an unused fork's.
        layer_over(&base, &data.join("sandboxes/k/root.layer"));
        std::fs::create_dir_all(data.join("forks/g")).unwrap();
        std::fs::write(data.join("forks/g/fork.mem"), b"m").unwrap();
        vec![
            record("c1", &f.join("rootfs.1.layer"), &[&a, &f, &c1]),
            record("b", &b.join("root.layer"), &[&b]),
        ]
    });
    let d = &s.data;
    let stats = s.manager.collect_garbage().await.unwrap();
    assert_eq!(stats.skipped, None);
    let mut dirs = stats.dirs.clone();
    dirs.sort();
    assert_eq!(dirs, [d.join("forks/g"), d.join("sandboxes/k")]);
    let mut layers = stats.layers.clone();
    layers.sort();
    assert_eq!(
        layers,
        [
            d.join("forks/f/rootfs.0.layer"),
            d.join("forks/f/rootfs.2.layer")
        ]
    );
    for kept in [
        "sandboxes/a/root.layer",
        "forks/f/rootfs.1.layer",
        "sandboxes/b/root.layer",
        "templates/base/root.layer",
    ] {
        assert!(d.join(kept).is_file(), "{kept}");
    }
    // The child still opens: its whole chain is there.
    LayeredDisk::open(&d.join("forks/f/rootfs.1.layer")).unwrap();
    // Nothing more the second time.
    let again = s.manager.collect_garbage().await.unwrap();
    assert!(
        again.dirs.is_empty() && again.layers.is_empty(),
        "{again:?}"
    );

    // Once child 1 is gone, so is everything it stacked on.
    assert!(s.manager.store().remove_sandbox("c1").unwrap());
    let stats = s.manager.collect_garbage().await.unwrap();
    let mut dirs = stats.dirs;
    dirs.sort();
    assert_eq!(
        dirs,
        [
            d.join("forks/f"),
            d.join("sandboxes/a"),
            d.join("sandboxes/c1")
        ]
    );
    assert!(d.join("sandboxes/b/root.layer").is_file());
}

#[tokio::test]
async fn records_from_before_dir_tracking_stop_the_collector() {
    let s = setup(|data| {
        let base = data.join("templates/base/root.layer");
        let old = data.join("sandboxes/old");
        layer_over(&base, &old.join("root.layer"));
        std::fs::create_dir_all(data.join("forks/f")).unwrap();
        vec![record("old", &old.join("root.layer"), &[])]
    });
    let stats = s.manager.collect_garbage().await.unwrap();
    assert!(stats.skipped.is_some());
    assert!(s.data.join("forks/f").is_dir());
}

/// Directories under `templates/` without a record: a snapshot's memory a
/// crash left (kept while the sandbox whose memory runs on it lives), a
/// build's files (kept while it claims them), a dead build's scratch.
#[tokio::test]
async fn unrecorded_template_dirs_go_once_no_sandbox_or_build_uses_them() {
    let s = setup(|data| {
        let b = data.join("sandboxes/b");
        layer_over(
            &data.join("templates/base/root.layer"),
            &b.join("root.layer"),
        );
        for d in ["o", "u", "w", ".build-w-0a0b", ".build-x-0a0b", ".gc-z"] {
            let dir = data.join("templates").join(d);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("vm.mem"), b"m").unwrap();
        }
        vec![SandboxRecord {
            uses_snapshots: vec!["u".into()],
            ..record("b", &b.join("root.layer"), &[&b])
        }]
    });
    let t = s.data.join("templates");
    let building = s.manager.writing_template("w");
    let stats = s.manager.collect_garbage().await.unwrap();
    assert_eq!(stats.skipped, None);
    let mut left: Vec<_> = std::fs::read_dir(&t)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left, [".build-w-0a0b", "base", "u", "w"], "{stats:?}");
    assert_eq!(stats.dirs.len(), 3, "{stats:?}");

    drop(building);
    assert!(s.manager.store().remove_sandbox("b").unwrap());
    s.manager.collect_garbage().await.unwrap();
    let left: Vec<_> = std::fs::read_dir(&t)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(left, ["base"]);
}

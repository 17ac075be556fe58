//! The manager's state changes against interleavings no lab is needed for:
//! a real store and the real VMM binary, which starts on this host but
//! refuses the paused sandbox's snapshot (its files hold no snapshot), so
//! that every restore fails, after the VMM process ran.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use vmm_driver::process::{ProcessIdentity, VmmProbe, VmmProcess};

use super::{Manager, PauseMode, Phase, ResumeMode, Sandbox, SandboxError};
use crate::node::config::Config;
use crate::node::launch::Launched;
use crate::node::pool::Pool;
use crate::node::store::{PausedSnapshot, SandboxRecord, SandboxState, Store, TemplateRecord};

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

/// target/debug/sandfork-vmm, next to this test's directory (`cargo test
/// --workspace` builds it), or `SANDFORK_VMM`.
fn vmm_binary() -> std::path::PathBuf {
    let path = std::env::var_os("SANDFORK_VMM").map_or_else(
        || {
            let exe = std::env::current_exe().unwrap();
            exe.parent().unwrap().parent().unwrap().join("sandfork-vmm")
        },
        Into::into,
    );
    assert!(
        path.is_file(),
        "{} is missing: build it first (cargo build -p sandfork-vmm)",
        path.display()
    );
    path
}

fn manager(data: &std::path::Path) -> Arc<Manager> {
    let mut config = Config::new(
        "127.0.0.1:0".parse().unwrap(),
        "/nonexistent/vmlinux".into(),
        data.join("rootfs.raw"),
        vmm_binary(),
    );
    // Room for exactly one running copy of the sandbox: a second restore
    // while one is under way would be refused for capacity (a headroom of
    // its whole size: a starting sandbox is charged all of it).
    config.capacity.memory_mib = Some(128);
    config.capacity.memory_headroom_mib = 128;
    config.capacity.vcpus = Some(1);
    config.data_dir = data.to_owned();
    config.run_dir = Some(data.join("run"));
    config.pool_size = 0;
    config.capacity.min_free_disk_mib = 0;
    let store = Store::open(&data.join("s.redb")).unwrap();
    store.put_sandbox(&paused(data)).unwrap();
    std::fs::create_dir_all(data.join("sandboxes").join(ID)).unwrap();
    for f in ["pause-1.state", "pause-1.mem"] {
        std::fs::write(data.join(f), b"not a snapshot").unwrap();
    }
    with_store(config, store)
}

/// A node's config for a test that boots nothing: no kernel or VMM binary
/// (their paths do not exist), no warm pool, its data (and run dir) in
/// `data`, its base image `rootfs`.
pub(crate) fn offline_config(data: &Path, rootfs: PathBuf) -> Config {
    let mut config = Config::new(
        "127.0.0.1:0".parse().unwrap(),
        "/nonexistent/vmlinux".into(),
        rootfs,
        "/nonexistent/sandfork-vmm".into(),
    );
    config.data_dir = data.to_owned();
    config.run_dir = Some(data.join("run"));
    config.pool_size = 0;
    config
}

/// A manager of `config` (no VMM pool; its base template's files in
/// `templates/base` of its data dir, 1 MiB of disk) on `store`.
pub(crate) fn with_store(config: Config, store: Store) -> Arc<Manager> {
    let data = config.data_dir.clone();
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

/// What each of many tasks got from one change.
#[derive(Debug, Default)]
struct Outcomes {
    ok: usize,
    not_found: usize,
    conflict: usize,
    restore_failed: usize,
    over_capacity: usize,
    other: Vec<String>,
}

impl Outcomes {
    fn count<T>(&mut self, r: Result<T, SandboxError>) {
        match r {
            Ok(_) => self.ok += 1,
            Err(SandboxError::NotFound(_)) => self.not_found += 1,
            Err(SandboxError::Conflict { .. }) => self.conflict += 1,
            Err(SandboxError::Vmm(_)) => self.restore_failed += 1,
            Err(SandboxError::OverCapacity(_) | SandboxError::AtCapacity { .. }) => {
                self.over_capacity += 1
            }
            Err(e) => self.other.push(e.to_string()),
        }
    }
}

/// VMM directories left in the run dir (each a VMM process that ran).
fn vmm_dirs(data: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(data.join("run"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// Many tasks pause, resume and kill one paused sandbox at once: the
/// sandbox's state machine lets one change run at a time, so no two
/// restores overlap (a second would be refused for capacity, the node
/// holding room for one), no record is stranded in a state it is not in,
/// and no VMM outlives its failed restore; the kill that wins removes
/// everything, and the changes after it find nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_pauses_resumes_and_kills_change_one_sandbox_at_a_time() {
    let tmp = tempfile::tempdir().unwrap();
    let m = manager(tmp.path());

    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..16 {
        let m = m.clone();
        tasks.spawn(async move {
            if i % 2 == 0 {
                (
                    "resume",
                    m.resume(ID, Duration::from_secs(60), ResumeMode::Restore)
                        .await
                        .map(drop),
                )
            } else {
                ("pause", m.pause(ID, PauseMode::Full, false).await.map(drop))
            }
        });
    }
    let (mut resumes, mut pauses) = (Outcomes::default(), Outcomes::default());
    while let Some(done) = tasks.join_next().await {
        let (op, r) = done.unwrap();
        match op {
            "resume" => resumes.count(r),
            _ => pauses.count(r),
        }
    }
    // Every resume waited its turn and tried its own restore; none ran
    // beside another.
    assert_eq!(resumes.restore_failed, 8, "{resumes:?}");
    assert_eq!(resumes.over_capacity, 0, "{resumes:?}");
    // A paused sandbox is not paused again.
    assert_eq!(pauses.conflict, 8, "{pauses:?}");
    assert!(resumes.other.is_empty() && pauses.other.is_empty());
    let record = m.get(ID).unwrap();
    assert_eq!(record.state, SandboxState::Paused);
    assert!(record.vmm_dir.is_none());
    assert_eq!(m.phase(ID), Some(Phase::Paused));
    assert!(
        vmm_dirs(tmp.path()).is_empty(),
        "{:?}",
        vmm_dirs(tmp.path())
    );
    assert_eq!(m.capacity().held(), crate::node::capacity::Ask::default());

    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..12 {
        let m = m.clone();
        tasks.spawn(async move {
            match i % 3 {
                0 => ("kill", m.kill(ID).await),
                1 => ("pause", m.pause(ID, PauseMode::Full, false).await.map(drop)),
                _ => (
                    "resume",
                    m.resume(ID, Duration::from_secs(60), ResumeMode::Restore)
                        .await
                        .map(drop),
                ),
            }
        });
    }
    let (mut kills, mut others) = (Outcomes::default(), Outcomes::default());
    while let Some(done) = tasks.join_next().await {
        let (op, r) = done.unwrap();
        if op == "kill" {
            kills.count(r);
        } else {
            others.count(r);
        }
    }
    assert_eq!((kills.ok, kills.not_found), (1, 3), "{kills:?}");
    assert_eq!(others.over_capacity, 0, "{others:?}");
    assert!(others.other.is_empty(), "{others:?}");
    assert!(matches!(m.get(ID), Err(SandboxError::NotFound(_))));
    assert_eq!(m.phase(ID), None);
    assert!(!tmp.path().join("sandboxes").join(ID).exists());
    assert!(
        vmm_dirs(tmp.path()).is_empty(),
        "{:?}",
        vmm_dirs(tmp.path())
    );
    assert_eq!(m.capacity().held(), crate::node::capacity::Ask::default());
}

/// A running sandbox's VMM (the real binary) is charged the memory it
/// really uses, read from /proc, plus the headroom: a few MiB for an
/// empty VMM, far below the 256 MiB its guest could touch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_vmm_is_charged_what_it_uses_plus_headroom() {
    use crate::node::capacity::{Ask, Capacity, Limits, memory};
    let tmp = tempfile::tempdir().unwrap();
    let limits = Limits {
        vcpus: 4,
        memory_mib: 10_000,
        memory_headroom_mib: 16,
        sandboxes: 4,
        min_free_disk_mib: 0,
    };
    let capacity = Capacity::new(limits, tmp.path().to_owned());
    let pool = Pool::start(vmm_binary(), tmp.path().join("run"), 0);
    let vm = pool.take().await.unwrap();
    let pid = vm.pid();
    let launched = crate::node::launch::Launched::adopted(vm, capacity.hold(Ask::sandbox(1, 256)));
    capacity.sample();
    let charged = capacity.held().memory_mib;
    let pss = host_mem::kib_to_mib(memory::pss_kib(pid).unwrap());
    assert!(pss > 0, "VMM {pid} uses no memory?");
    // Read twice, a moment apart: an idle VMM's use barely moves.
    assert!(
        charged > 16 && charged.abs_diff(pss + 16) <= 2,
        "charged {charged} MiB, the VMM uses {pss} MiB"
    );
    assert!(charged < 64, "{charged}");
    launched.stop().await;
    assert_eq!(capacity.held(), Ask::default());
}

/// One request to the node's real router.
async fn call(app: &axum::Router, req: axum::http::Request<axum::body::Body>) -> (u16, Value) {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let response = app.clone().oneshot(req).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

const KEY: &str = "e2b_0123456789abcdef0123456789abcdef01234567";

fn authed(method: &str, uri: &str) -> axum::http::Request<axum::body::Body> {
    axum::http::Request::builder()
        .method(method)
        .uri(uri)
        .header("x-api-key", KEY)
        .body(axum::body::Body::empty())
        .unwrap()
}

/// Gives the recorded sandbox `id` a running VMM of the real binary (no
/// guest: its API serves without one), holding its capacity, as a launch
/// or an adoption does.
async fn run_vmm(m: &Arc<Manager>, data: &std::path::Path, id: &str) -> VmmProbe {
    m.store
        .update_sandbox(id, |s| {
            s.state = SandboxState::Running;
            s.end_at_ms = crate::node::clock::now_ms() + 600_000;
            s.snapshot = None;
        })
        .unwrap()
        .unwrap();
    let dir = data.join("run").join(format!("vmm-{id}"));
    std::fs::create_dir_all(data.join("run")).unwrap();
    let vm = VmmProcess::spawn_in(&vmm_binary(), dir).await.unwrap();
    let probe = vm.probe();
    let hold = m
        .capacity()
        .reserve(crate::node::capacity::Ask::sandbox(1, 128), "a test")
        .unwrap();
    let sandbox = Sandbox::new(id.into(), None, Default::default(), Phase::Starting);
    let mut guest = sandbox.guest.lock().await;
    m.run_guest(&sandbox, &mut guest, Launched::adopted(vm, hold))
        .unwrap();
    drop(guest);
    assert!(m.registry().insert(sandbox));
    probe
}

/// A running sandbox whose VMM process is killed from outside is noticed:
/// removed as on E2B (the API's GET answers 404, the proxy 502 "not
/// found"), its capacity given back, its files gone, and counted on
/// `/v1/node`; a kill through the API stops a VMM too and is not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_whose_vmm_exits_by_itself_is_removed_and_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let m = manager(tmp.path());
    let state = Arc::new(crate::http::state::AppState {
        manager: m.clone(),
        templates: crate::node::template::Templates::new(m.clone()),
        keys: crate::node::keys::ApiKeys::for_key(KEY),
        guests: Default::default(),
        cluster: Default::default(),
        creates: Default::default(),
        webhooks: crate::node::webhooks::Webhooks::start(&m, Default::default()),
    });
    let app = crate::http::api::router(state);
    let node = |app: axum::Router| async move { call(&app, authed("GET", "/v1/node")).await.1 };

    // Killed through the API: its VMM ends, and that is no death.
    let probe = run_vmm(&m, tmp.path(), ID).await;
    assert_eq!(
        call(&app, authed("DELETE", &format!("/sandboxes/{ID}")))
            .await
            .0,
        204
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while ProcessIdentity::of(probe.pid()).is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "the killed VMM still runs"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(node(app.clone()).await["sandboxes"]["vmmExited"], 0);

    // Killed from outside.
    let mut record = paused(tmp.path());
    record.id = "isecondsandboxabcdefg".into();
    m.store.put_sandbox(&record).unwrap();
    let id = record.id.as_str();
    let probe = run_vmm(&m, tmp.path(), id).await;
    let (status, got) = call(&app, authed("GET", &format!("/sandboxes/{id}"))).await;
    assert_eq!(
        (status, got["state"].as_str()),
        (200, Some("running")),
        "{got}"
    );
    assert_eq!(node(app.clone()).await["vcpus"]["used"], 1);
    ProcessIdentity::of(probe.pid())
        .expect("the VMM runs")
        .kill();

    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (status, got) = call(&app, authed("GET", &format!("/sandboxes/{id}"))).await;
        if status == 404 {
            break;
        }
        assert_eq!(status, 200, "{got}");
        assert!(std::time::Instant::now() < deadline, "still {got}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let health = axum::http::Request::get("/health")
        .header("e2b-sandbox-id", id)
        .header("e2b-sandbox-port", "49983")
        .body(axum::body::Body::empty())
        .unwrap();
    let (status, got) = call(&app, health).await;
    assert_eq!(status, 502, "{got}");
    assert!(
        got["message"]
            .as_str()
            .unwrap_or("")
            .contains("was not found"),
        "{got}"
    );
    let (status, list) = call(&app, authed("GET", "/v2/sandboxes")).await;
    assert_eq!(
        (status, list.as_array().map(Vec::len)),
        (200, Some(0)),
        "{list}"
    );
    // Its capacity goes back once its VMM is reaped, a moment after its
    // record (a loaded host widens the moment).
    let info = loop {
        let info = node(app.clone()).await;
        if info["vcpus"]["used"] == 0 {
            break info;
        }
        assert!(std::time::Instant::now() < deadline, "still held: {info}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(info["sandboxes"]["vmmExited"], 1, "{info}");
    assert_eq!(m.capacity().held(), crate::node::capacity::Ask::default());
    assert_eq!(m.phase(id), None);
    assert!(!probe.dir().exists(), "the VMM's directory stays");
    assert!(!tmp.path().join("sandboxes").join(id).exists());
}

#[tokio::test]
async fn a_sandboxs_lineage_is_what_its_record_stacks_on() {
    let data = tempfile::tempdir().unwrap();
    let m = manager(data.path());
    let record = SandboxRecord {
        uses_dirs: vec![
            data.path().join("forks/f1"),
            data.path().join("sandboxes/parent"),
        ],
        uses_snapshots: vec!["snap1".into()],
        template_id: "custom".into(),
        ..paused(data.path())
    };
    let lineage = m.record_lineage(&record);
    let at = |p: &str| data.path().join(p);
    for held in [
        format!("sandboxes/{ID}/root.layer"),
        "sandboxes/parent/snap-1/vm.mem".into(),
        "forks/f1/fork.mem".into(),
        "templates/snap1/vm.mem".into(),
        "templates/custom/root.layer".into(),
        "templates/base/vm.mem".into(),
        "cluster-cache/0123abcd".into(),
    ] {
        assert!(lineage.holds(&at(&held)), "{held}: {lineage:?}");
    }
    // The base template's image lies in the data dir itself here: that
    // does not let the whole data dir in.
    for other in [
        "sandboxes/neighbour/root.layer",
        "forks/f2/fork.mem",
        "templates/theirs/vm.mem",
        "rootfs.raw",
    ] {
        assert!(!lineage.holds(&at(other)), "{other}: {lineage:?}");
    }
}

//! Lab test: `sandfork serve` killed (SIGKILL) and stopped (SIGTERM) while
//! sandboxes run and are paused. The next start adopts the running
//! sandboxes' VMMs (their processes and files go on), keeps the paused ones,
//! drops a sandbox whose VMM died meanwhile, and stops the old warm pool's
//! VMMs; the sandboxes' logs and metrics are still served after it (an
//! adopted sandbox's console is not read twice); a kill and a clean stop
//! leave no process and no directory behind.
//!
//! And crashes inside a change (the server's crash points, see
//! `server::node::crash`): a pause, a fork and a snapshot each cut short by the
//! server's death lose nothing the node acknowledged, leave nothing
//! half-made visible, and leak no process or directory.
//!
//! Needs KVM that boots Linux, `SANDFORK_KERNEL`/`SANDFORK_ROOTFS`, and the
//! `sandfork` and `sandfork-vmm` binaries next to the test binary's directory.

#![cfg(test)]

mod common;

use std::path::{Path, PathBuf};

use std::time::{Duration, Instant};

use common::{ServeProcess, http, run};
use serde_json::{Value, json};
use server::node::config::Config;
use server::node::store::{SandboxState, Store};
use vmm_driver::process::ProcessIdentity;

struct Node {
    serve: ServeProcess,
    /// The crash point the next start is given (`SANDFORK_CRASH_AT`).
    crash_at: Option<&'static str>,
}

impl std::ops::Deref for Node {
    type Target = ServeProcess;
    fn deref(&self) -> &ServeProcess {
        &self.serve
    }
}

impl std::ops::DerefMut for Node {
    fn deref_mut(&mut self) -> &mut ServeProcess {
        &mut self.serve
    }
}

impl Node {
    /// A node on a free loopback port with data dir `data` (made here) and
    /// API key `key`, not started.
    fn new(data: &Path, key: &str) -> Node {
        std::fs::create_dir(data).unwrap();
        Node {
            serve: ServeProcess::new(data, key),
            crash_at: None,
        }
    }

    /// Where its VMMs' directories are.
    fn run_dir(&self) -> PathBuf {
        let mut c = Config::new(self.addr, "k".into(), "r".into(), "v".into());
        c.data_dir = self.data.clone();
        c.run_dir()
    }

    fn start(&mut self) {
        let args = ["--pool-size", "1", "--listen", &self.addr.to_string()].map(str::to_owned);
        let crash_at = self.crash_at.unwrap_or_default();
        self.serve.spawn(&args, &[("SANDFORK_CRASH_AT", crash_at)]);
    }

    /// Sends a request that reaches the crash point and waits for the
    /// server to die there (SIGABRT, its crash point's exit).
    async fn crash_during(&mut self, method: &str, path: &str, body: Value) {
        let point = self.crash_at.expect("a crash point");
        let (addr, key) = (self.addr, self.key.clone());
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nx-api-key: {key}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\
             connection: close\r\n\r\n{body}",
            body.to_string().len()
        );
        // The status line of an answer, if one comes before the server dies.
        let request = tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
            stream.write_all(head.as_bytes()).await.ok()?;
            let mut answer = Vec::new();
            let _ = stream.read_to_end(&mut answer).await;
            let answer = String::from_utf8_lossy(&answer);
            answer
                .lines()
                .next()
                .filter(|l| !l.is_empty())
                .map(str::to_owned)
        });
        let mut request = Some(request);
        let mut answered = None;
        self.wait_crash(async || {
            // Answered with the server alive: it never reached the point.
            if let Some(done) = request.take_if(|r| r.is_finished()) {
                answered = done.await.ok().flatten();
            }
            answered.is_some()
        })
        .await
        .unwrap_or_else(|log| {
            panic!("{method} {path} answered {answered:?} instead of reaching {point}:\n{log}")
        });
        if let Some(request) = request
            && let Ok(Some(answered)) = request.await
        {
            panic!("{method} {path} answered {answered:?} before the crash");
        }
    }

    /// Waits for the server to die at its crash point (SIGABRT); `Err(log)`
    /// as soon as `gave_up` says it will not.
    async fn wait_crash(&mut self, mut gave_up: impl AsyncFnMut() -> bool) -> Result<(), String> {
        let point = self.crash_at.expect("a crash point");
        let deadline = Instant::now() + Duration::from_secs(600);
        let status = loop {
            if let Some(status) = self.serve.try_wait() {
                break status;
            }
            if gave_up().await {
                return Err(self.log());
            }
            assert!(
                Instant::now() < deadline,
                "the server did not reach {point}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status.signal(),
            Some(6),
            "the server ended otherwise than at {point} ({status}):\n{}",
            self.log()
        );
        assert!(self.log().contains(&format!("crash point {point}")));
        Ok(())
    }

    async fn call(&self, method: &str, path: &str, body: Value) -> (u16, Value) {
        let a = http(self.addr, method, path, &self.auth(), body.to_string()).await;
        let json = if a.body.is_empty() {
            Value::Null
        } else {
            a.json()
        };
        (a.status, json)
    }

    async fn create(&self) -> (String, String) {
        self.create_from("base").await
    }

    async fn create_from(&self, template: &str) -> (String, String) {
        let (status, s) = self
            .call(
                "POST",
                "/v2/sandboxes",
                json!({"templateID": template, "timeout": 900, "secure": true}),
            )
            .await;
        assert_eq!(status, 201, "{s}\n{}", self.log());
        (
            s["sandboxID"].as_str().unwrap().to_owned(),
            s["envdAccessToken"].as_str().unwrap().to_owned(),
        )
    }

    async fn sh(&self, (id, token): &(String, String), command: &str) -> (i32, String) {
        let routing = [
            ("e2b-sandbox-id", id.as_str()),
            ("e2b-sandbox-port", "49983"),
            ("x-access-token", token.as_str()),
        ];
        run(self.addr, &routing, command).await
    }

    /// Its log lines (`timestamp message`) and metrics timestamps, through
    /// E2B's routes.
    async fn history(&self, id: &str) -> (Vec<String>, Vec<String>) {
        let (status, logs) = self
            .call("GET", &format!("/v2/sandboxes/{id}/logs"), json!({}))
            .await;
        assert_eq!(status, 200, "{logs}");
        let (status, metrics) = self
            .call("GET", &format!("/sandboxes/{id}/metrics"), json!({}))
            .await;
        assert_eq!(status, 200, "{metrics}");
        let lines = logs["logs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| format!("{} {}", l["timestamp"], l["message"]))
            .collect();
        let samples = metrics
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["timestamp"].to_string())
            .collect();
        (lines, samples)
    }

    /// Starts an E2B build of template `alias` (its template and build ids).
    async fn build(&self, alias: &str, build: &Value) -> (String, String) {
        let (status, t) = self
            .call("POST", "/v3/templates", json!({"name": alias}))
            .await;
        assert_eq!(status, 202, "{t}");
        let ids = (
            t["templateID"].as_str().unwrap().to_owned(),
            t["buildID"].as_str().unwrap().to_owned(),
        );
        let path = format!("/v2/templates/{}/builds/{}", ids.0, ids.1);
        let (status, body) = self.call("POST", &path, build.clone()).await;
        assert_eq!(status, 202, "{body}");
        ids
    }

    async fn build_status(&self, (template, build): &(String, String)) -> String {
        let path = format!("/templates/{template}/builds/{build}/status");
        let (status, body) = self.call("GET", &path, json!({})).await;
        assert_eq!(status, 200, "{body}");
        body["status"].as_str().unwrap().to_owned()
    }

    /// The ids of the sandboxes listed.
    async fn sandboxes(&self) -> Vec<String> {
        let (status, listed) = self.call("GET", "/sandboxes", json!({})).await;
        assert_eq!(status, 200, "{listed}");
        listed
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["sandboxID"].as_str().unwrap().to_owned())
            .collect()
    }

    async fn state(&self, id: &str) -> Option<String> {
        let (status, s) = self
            .call("GET", &format!("/sandboxes/{id}"), json!({}))
            .await;
        match status {
            200 => Some(s["state"].as_str().unwrap().to_owned()),
            404 => None,
            other => panic!("GET /sandboxes/{id}: {other} {s}"),
        }
    }
}

/// The VMM a running sandbox's record names (read while the server is down:
/// the store is open in one process at a time).
fn vmm_of(data: &Path, id: &str) -> (PathBuf, ProcessIdentity) {
    let store = Store::open(&data.join("sandfork.redb")).unwrap();
    let record = store.sandbox(id).unwrap().expect("a record");
    assert_eq!(record.state, SandboxState::Running);
    let dir = record.vmm_dir.expect("a VMM directory");
    let identity = ProcessIdentity::read(&dir).expect("an identity file");
    (dir, identity)
}

fn wait_dead(process: &ProcessIdentity) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while process.is_alive() {
        assert!(Instant::now() < deadline, "pid {} still runs", process.pid);
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    all.sort();
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab: boots microVMs"]
async fn a_restarted_server_adopts_running_sandboxes_and_keeps_paused_ones() {
    let scratch = tempfile::tempdir().unwrap();
    let data = scratch.path().join("data");
    let mut node = Node::new(&data, &format!("e2b_{}", "5a".repeat(16)));
    let run_dir = node.run_dir();
    node.start();
    node.wait_up().await;

    // running: a file and a background process
    let kept = node.create().await;
    let (code, _) = node
        .sh(
            &kept,
            "echo kept > /root/kept.txt && setsid sleep 4242 </dev/null >/dev/null 2>&1 &",
        )
        .await;
    assert_eq!(code, 0);
    // a fork child of it: its lineage outlives the node's in-memory events
    let (status, forked) = node
        .call(
            "POST",
            &format!("/sandboxes/{}/fork", kept.0),
            json!({"count": 1, "timeout": 900}),
        )
        .await;
    assert_eq!(status, 201, "{forked}");
    let child = (
        forked[0]["sandbox"]["sandboxID"]
            .as_str()
            .unwrap()
            .to_owned(),
        forked[0]["sandbox"]["envdAccessToken"]
            .as_str()
            .unwrap()
            .to_owned(),
    );
    // paused: a file
    let paused = node.create().await;
    assert_eq!(node.sh(&paused, "echo paused > /root/p.txt").await.0, 0);
    let (status, body) = node
        .call("POST", &format!("/sandboxes/{}/pause", paused.0), json!({}))
        .await;
    assert_eq!(status, 204, "{body}");
    // running, but its VMM dies while the server is down
    let lost = node.create().await;
    // what the node observed of them so far (each request looks anew)
    let kept_seen = node.history(&kept.0).await;
    // (the pause read its console's last lines)
    let paused_seen = node.history(&paused.0).await;
    node.history(&lost.0).await;
    let inits = |lines: &[String]| lines.iter().filter(|l| l.contains("/init applied")).count();
    assert_eq!(inits(&kept_seen.0), 1, "{:?}", kept_seen.0);
    assert!(!kept_seen.1.is_empty() && inits(&paused_seen.0) == 1);
    let observe = data.join("observe");
    assert!(observe.join(&kept.0).is_dir() && observe.join(&lost.0).is_dir());

    node.crash();
    let (kept_dir, kept_vmm) = vmm_of(&data, &kept.0);
    let (lost_dir, lost_vmm) = vmm_of(&data, &lost.0);
    let (child_dir, child_vmm) = vmm_of(&data, &child.0);
    assert!(
        kept_vmm.is_alive(),
        "a server crash leaves its VMMs running"
    );
    let old_pool: Vec<(PathBuf, ProcessIdentity)> = entries(&run_dir)
        .into_iter()
        .filter(|d| *d != kept_dir && *d != lost_dir && *d != child_dir)
        .filter_map(|d| ProcessIdentity::read(&d).map(|p| (d, p)))
        .collect();
    assert!(!old_pool.is_empty(), "the warm pool had a VMM");
    lost_vmm.kill();
    wait_dead(&lost_vmm);

    let t0 = Instant::now();
    node.start();
    node.wait_up().await;
    eprintln!("restart after a crash: serving in {:?}", t0.elapsed());
    assert_eq!(node.state(&kept.0).await.as_deref(), Some("running"));
    let (code, out) = node
        .sh(
            &kept,
            "cat /root/kept.txt && pgrep -x sleep >/dev/null && echo sleeping",
        )
        .await;
    assert_eq!((code, out.as_str()), (0, "kept\nsleeping\n"));
    assert!(kept_vmm.is_alive(), "the same VMM process, adopted");
    // The fork tree without the events the node kept in memory: from the
    // child's record.
    assert_eq!(
        node.sh(&child, "cat /root/kept.txt").await,
        (0, "kept\n".into())
    );
    let (status, tree) = node
        .call(
            "GET",
            &format!("/v1/sandboxes/{}/lineage", child.0),
            json!({}),
        )
        .await;
    assert_eq!(status, 200, "{tree}");
    assert_eq!(tree["rootID"], kept.0.as_str(), "{tree}");
    let nodes: Vec<(&str, &str, i64, &str)> = tree["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["sandboxID"].as_str().unwrap_or(""),
                n["parentID"].as_str().unwrap_or(""),
                n["branch"].as_i64().unwrap_or(-1),
                n["state"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        nodes,
        [
            (kept.0.as_str(), "", -1, "running"),
            (child.0.as_str(), kept.0.as_str(), 0, "running")
        ],
        "{tree}"
    );
    assert_eq!(node.state(&paused.0).await.as_deref(), Some("paused"));
    assert_eq!(
        node.state(&lost.0).await,
        None,
        "a sandbox whose VMM died is gone"
    );
    assert!(!lost_dir.exists());
    assert!(
        !observe.join(&lost.0).exists(),
        "the lost one's logs go with it"
    );
    // Logs and metrics from before the crash, each once: the adopted
    // sandbox's console is followed on from where it was.
    let kept_now = node.history(&kept.0).await;
    for seen in &kept_seen.0 {
        assert!(kept_now.0.contains(seen), "{seen} lost: {:?}", kept_now.0);
    }
    assert!(kept_seen.1.iter().all(|t| kept_now.1.contains(t)));
    assert_eq!(inits(&kept_now.0), 1, "{:?}", kept_now.0);
    assert_eq!(node.history(&paused.0).await, paused_seen);
    for (dir, process) in &old_pool {
        wait_dead(process);
        assert!(!dir.exists(), "{} left behind", dir.display());
    }

    // resume the paused one after the restart: its file is there
    let (status, body) = node
        .call(
            "POST",
            &format!("/sandboxes/{}/connect", paused.0),
            json!({"timeout": 900}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(
        node.sh(&paused, "cat /root/p.txt").await,
        (0, "paused\n".into())
    );

    // a clean stop: both running sandboxes keep running and are adopted
    node.stop();
    let (_, resumed_vmm) = vmm_of(&data, &paused.0);
    assert!(kept_vmm.is_alive() && resumed_vmm.is_alive());
    node.start();
    node.wait_up().await;
    for sandbox in [&kept, &paused, &child] {
        assert_eq!(node.state(&sandbox.0).await.as_deref(), Some("running"));
        assert_eq!(node.sh(sandbox, "echo up").await, (0, "up\n".into()));
    }

    // kills stop the adopted VMMs; a clean stop then leaves nothing running
    for (sandbox, vmm) in [
        (&child, &child_vmm),
        (&kept, &kept_vmm),
        (&paused, &resumed_vmm),
    ] {
        let (status, body) = node
            .call("DELETE", &format!("/sandboxes/{}", sandbox.0), json!({}))
            .await;
        assert_eq!(status, 204, "{body}");
        wait_dead(vmm);
        assert!(!observe.join(&sandbox.0).exists(), "its logs go with it");
    }
    let pool: Vec<ProcessIdentity> = entries(&run_dir)
        .iter()
        .filter_map(|d| ProcessIdentity::read(d))
        .collect();
    node.stop();
    for process in &pool {
        wait_dead(process);
    }
    assert_eq!(
        entries(&run_dir),
        Vec::<PathBuf>::new(),
        "the run dir is empty"
    );
}

/// Every VMM process with an identity in `run_dir` (read while the server
/// is down).
fn vmm_processes(run_dir: &Path) -> Vec<ProcessIdentity> {
    entries(run_dir)
        .iter()
        .filter_map(|d| ProcessIdentity::read(d))
        .filter(ProcessIdentity::is_alive)
        .collect()
}

/// The server is killed at each crash point in turn, each restart settling
/// what the last crash left: a pause cut short before its record (the
/// sandbox runs on, adopted and resumed) and after it (paused; its VMM
/// stopped), a fork and a snapshot cut short after the VMM moved the disk
/// to a new layer and before anything was recorded (the record follows the
/// VMM's disk, so what the guest wrote after survives a pause and resume
/// read from the disk, not the page cache; no child, no snapshot is
/// visible). At the end nothing is left running and no sandbox or fork
/// directory remains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab: boots microVMs"]
async fn a_crash_inside_a_pause_fork_or_snapshot_loses_nothing_acknowledged() {
    let scratch = tempfile::tempdir().unwrap();
    let data = scratch.path().join("data");
    let mut node = Node::new(&data, &format!("e2b_{}", "6b".repeat(16)));
    node.crash_at = Some("pause.written");
    let run_dir = node.run_dir();
    node.start();
    node.wait_up().await;
    let a = node.create().await;
    let (code, _) = node
        .sh(
            &a,
            "echo one > /root/one && setsid sleep 4242 </dev/null >/dev/null 2>&1 &",
        )
        .await;
    assert_eq!(code, 0);
    // What the guest wrote, read from its disk (not the page cache), and
    // its process.
    let disk_and_process = |files: &str| {
        format!(
            "sync && echo 3 > /proc/sys/vm/drop_caches && cat {files} && pgrep -x sleep >/dev/null && echo sleeping"
        )
    };
    let pause = format!("/sandboxes/{}/pause", a.0);
    node.crash_during("POST", &pause, json!({})).await;

    // A pause cut short before its record: running on, adopted.
    node.crash_at = Some("pause.committed");
    node.start();
    node.wait_up().await;
    assert_eq!(node.state(&a.0).await.as_deref(), Some("running"));
    assert_eq!(
        node.sh(&a, &disk_and_process("/root/one")).await,
        (0, "one\nsleeping\n".into())
    );
    node.crash_during("POST", &pause, json!({})).await;
    let left = vmm_processes(&run_dir);

    // A pause cut short after its record: paused, and no VMM of before
    // runs (the sandbox's, the warm pool's).
    node.crash_at = Some("fork.frozen");
    node.start();
    node.wait_up().await;
    assert_eq!(node.state(&a.0).await.as_deref(), Some("paused"));
    for process in &left {
        wait_dead(process);
    }
    let (status, body) = node
        .call(
            "POST",
            &format!("/sandboxes/{}/connect", a.0),
            json!({"timeout": 900}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(
        node.sh(
            &a,
            &format!(
                "echo two > /root/two && {}",
                disk_and_process("/root/one /root/two")
            )
        )
        .await,
        (0, "one\ntwo\nsleeping\n".into())
    );
    node.crash_during(
        "POST",
        &format!("/sandboxes/{}/fork", a.0),
        json!({"count": 1, "timeout": 600}),
    )
    .await;
    let (_, parent_vmm) = vmm_of(&data, &a.0);
    let others: Vec<ProcessIdentity> = vmm_processes(&run_dir)
        .into_iter()
        .filter(|p| *p != parent_vmm)
        .collect();

    // A fork cut short: the parent runs on its new layer (the same VMM,
    // adopted), no child; the VMMs taken for children are stopped.
    node.crash_at = Some("snapshot.frozen");
    node.start();
    node.wait_up().await;
    assert!(parent_vmm.is_alive());
    for process in &others {
        wait_dead(process);
    }
    let (status, listed) = node.call("GET", "/sandboxes", json!({})).await;
    assert_eq!(status, 200, "{listed}");
    let ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["sandboxID"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [a.0.as_str()], "only the parent");
    assert_eq!(
        node.sh(
            &a,
            &format!(
                "echo three > /root/three && {}",
                disk_and_process("/root/one /root/two /root/three")
            )
        )
        .await,
        (0, "one\ntwo\nthree\nsleeping\n".into())
    );
    node.crash_during("POST", &format!("/sandboxes/{}/snapshots", a.0), json!({}))
        .await;

    // A snapshot cut short: no snapshot listed; what the guest writes now
    // lands on the disk its next pause keeps.
    node.crash_at = None;
    node.start();
    node.wait_up().await;
    let (status, snapshots) = node.call("GET", "/snapshots", json!({})).await;
    assert_eq!((status, snapshots), (200, json!([])));
    assert_eq!(
        node.sh(&a, "echo four > /root/four").await,
        (0, String::new())
    );
    let (status, body) = node.call("POST", &pause, json!({})).await;
    assert_eq!(status, 204, "{body}");
    let (status, body) = node
        .call(
            "POST",
            &format!("/sandboxes/{}/connect", a.0),
            json!({"timeout": 900}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(
        node.sh(
            &a,
            &disk_and_process("/root/one /root/two /root/three /root/four")
        )
        .await,
        (0, "one\ntwo\nthree\nfour\nsleeping\n".into()),
        "{}",
        node.log()
    );

    // Nothing leaks: after the kill and a restart (its garbage collection),
    // no VMM runs and no sandbox or fork directory is left.
    let (status, body) = node
        .call("DELETE", &format!("/sandboxes/{}", a.0), json!({}))
        .await;
    assert_eq!(status, 204, "{body}");
    node.stop();
    node.start();
    node.wait_up().await;
    let pool = vmm_processes(&run_dir);
    node.stop();
    for process in &pool {
        wait_dead(process);
    }
    assert_eq!(entries(&run_dir), Vec::<PathBuf>::new(), "the run dir");
    assert_eq!(entries(&data.join("sandboxes")), Vec::<PathBuf>::new());
    assert_eq!(entries(&data.join("forks")), Vec::<PathBuf>::new());
    // The snapshot cut short wrote its memory under templates/: gone with
    // its last user.
    assert_eq!(unrecorded(&data), Vec::<PathBuf>::new());
    assert_eq!(
        entries(&data.join("templates")),
        [data.join("templates/base")]
    );
    assert_eq!(vmm_cgroups(&run_dir), Vec::<PathBuf>::new());
}

/// What no record accounts for (read while the server is down): directories
/// under `templates/` no template (deleted ones included) is in, and under
/// `sandboxes/` and `forks/` no sandbox or template uses.
fn unrecorded(data: &Path) -> Vec<PathBuf> {
    let store = Store::open(&data.join("sandfork.redb")).unwrap();
    let templates: Vec<_> = store
        .templates()
        .unwrap()
        .into_iter()
        .chain(store.retired_templates().unwrap())
        .collect();
    let sandboxes = store.sandboxes().unwrap();
    let used: Vec<&PathBuf> = templates
        .iter()
        .flat_map(|t| &t.uses_dirs)
        .chain(sandboxes.iter().flat_map(|s| &s.uses_dirs))
        .collect();
    let mut left: Vec<PathBuf> = entries(&data.join("templates"))
        .into_iter()
        .filter(|d| !templates.iter().any(|t| t.dir == *d))
        .collect();
    left.extend(
        entries(&data.join("sandboxes"))
            .into_iter()
            .chain(entries(&data.join("forks")))
            .filter(|d| !used.contains(&d)),
    );
    left
}

/// The cgroups of the node's VMMs left once they are gone (the lab mounts
/// cgroup2 at /sys/fs/cgroup; the node's groups are under `sandfork/<run
/// dir name>`). Waits a little: a group goes just after its VMM.
fn vmm_cgroups(run_dir: &Path) -> Vec<PathBuf> {
    let node = Path::new("/sys/fs/cgroup/sandfork").join(run_dir.file_name().unwrap());
    assert!(node.is_dir(), "no cgroup {}", node.display());
    let groups = || -> Vec<PathBuf> { entries(&node).into_iter().filter(|p| p.is_dir()).collect() };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !groups().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    groups()
}

/// The VMMs of template builds' sandboxes (read while the server is down).
fn build_sandbox_vmms(data: &Path) -> Vec<ProcessIdentity> {
    let store = Store::open(&data.join("sandfork.redb")).unwrap();
    store
        .sandboxes()
        .unwrap()
        .into_iter()
        .filter(|s| s.metadata.contains_key("sandfork.templateBuild"))
        .filter_map(|s| ProcessIdentity::read(&s.vmm_dir?))
        .filter(ProcessIdentity::is_alive)
        .collect()
}

/// E2B template builds cut short at each crash point, then the collector:
/// a build whose step's snapshot was cut short (its sandbox's memory on an
/// unrecorded `templates/` directory) ends `error`, unusable, its sandbox
/// and that directory gone; one whose template was recorded (by its
/// snapshot, its sandbox still running; or its sandbox gone, its tags not
/// yet moved) ends `ready`, a sandbox of it answering with what its step
/// wrote, its sandbox gone. A deleted template whose last user died while
/// the node was down, its record removed by the next start's collector
/// before a crash: its files go at the next. Nothing is left: no VMM, no
/// directory or cgroup without a record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "lab: boots microVMs"]
async fn a_crash_inside_a_template_build_or_the_collector_leaks_nothing() {
    let scratch = tempfile::tempdir().unwrap();
    let data = scratch.path().join("data");
    let mut node = Node::new(&data, &format!("e2b_{}", "7c".repeat(16)));
    let run_dir = node.run_dir();
    let templates = data.join("templates");
    let steps = json!({
        "fromTemplate": "base",
        "steps": [{"type": "RUN", "args": ["echo built > /root/built", "root"], "force": false}],
    });

    // Cut short at its step's snapshot (the step cache's).
    node.crash_at = Some("snapshot.frozen");
    node.start();
    node.wait_up().await;
    let cut = node.build("cut", &steps).await;
    node.wait_crash(async || false).await.unwrap();
    let builders = build_sandbox_vmms(&data);
    assert_eq!(builders.len(), 1, "the build's sandbox runs on");
    assert_eq!(unrecorded(&data).len(), 1, "the snapshot's memory");

    node.crash_at = Some("template.snapshotted");
    node.start();
    node.wait_up().await;
    for process in &builders {
        wait_dead(process);
    }
    assert_eq!(node.build_status(&cut).await, "error");
    let (status, body) = node
        .call("POST", "/v2/sandboxes", json!({"templateID": "cut"}))
        .await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(node.sandboxes().await, Vec::<String>::new());
    let made = node.build("made", &steps).await;
    node.wait_crash(async || false).await.unwrap();
    assert_eq!(
        unrecorded(&data),
        Vec::<PathBuf>::new(),
        "the restart's collector"
    );
    let builders = build_sandbox_vmms(&data);
    assert_eq!(builders.len(), 1, "the build's sandbox runs on");

    // Cut short with its template recorded and its sandbox running.
    node.crash_at = Some("template.written");
    node.start();
    node.wait_up().await;
    for process in &builders {
        wait_dead(process);
    }
    assert_eq!(node.build_status(&made).await, "ready");
    let user = node.create_from("made").await;
    assert_eq!(
        node.sh(&user, "cat /root/built").await,
        (0, "built\n".into())
    );
    assert_eq!(node.sandboxes().await, std::slice::from_ref(&user.0));
    let tagged = node.build("tagged", &steps).await;
    node.wait_crash(async || false).await.unwrap();
    assert_eq!(build_sandbox_vmms(&data), Vec::new());

    // Cut short with its sandbox gone, its tags not moved yet.
    node.crash_at = None;
    node.start();
    node.wait_up().await;
    assert_eq!(node.build_status(&tagged).await, "ready");
    let other = node.create_from("tagged").await;
    assert_eq!(
        node.sh(&other, "cat /root/built").await,
        (0, "built\n".into())
    );
    let (status, body) = node
        .call("DELETE", &format!("/sandboxes/{}", other.0), json!({}))
        .await;
    assert_eq!(status, 204, "{body}");

    // The collector cut short: `made` deleted while a sandbox uses it, the
    // sandbox's VMM dead while the node is down; the next start drops the
    // sandbox, and its collector the template's record, and dies.
    let (status, body) = node.call("DELETE", "/templates/made", json!({})).await;
    assert_eq!(status, 204, "{body}");
    node.crash();
    let (_, user_vmm) = vmm_of(&data, &user.0);
    user_vmm.kill();
    wait_dead(&user_vmm);
    let retired = {
        let store = Store::open(&data.join("sandfork.redb")).unwrap();
        store.retired_templates().unwrap()
    };
    assert_eq!(retired.len(), 1, "made, kept for its user");
    let made_dir = retired[0].dir.clone();
    assert!(made_dir.starts_with(&templates), "{}", made_dir.display());
    node.crash_at = Some("gc.removing");
    node.start();
    node.wait_crash(async || false).await.unwrap();
    assert!(made_dir.is_dir(), "the crash came before its files went");

    node.crash_at = None;
    node.start();
    node.wait_up().await;
    assert!(
        !made_dir.exists(),
        "{}: a deleted template's files, left",
        made_dir.display()
    );
    let (status, body) = node
        .call("POST", "/v2/sandboxes", json!({"templateID": "made"}))
        .await;
    assert_eq!(status, 404, "{body}");

    // Nothing leaks.
    assert_eq!(node.sandboxes().await, Vec::<String>::new());
    let pool = vmm_processes(&run_dir);
    node.stop();
    for process in &pool {
        wait_dead(process);
    }
    assert_eq!(entries(&run_dir), Vec::<PathBuf>::new(), "the run dir");
    assert_eq!(unrecorded(&data), Vec::<PathBuf>::new());
    assert_eq!(vmm_cgroups(&run_dir), Vec::<PathBuf>::new());
}

//! The real router in-process, without microVMs: authentication, validation,
//! errors, get, list and its pagination, timeout, kill, the proxy's routing of
//! unknown sandboxes. Sandboxes are records in the real store.

#![cfg(test)]

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use server::http::api::{AppState, router};
use server::node::clock::now_ms;
use server::node::config::Config;
use server::node::keys::ApiKeys;
use server::node::pool::Pool;
use server::node::sandbox::Manager;
use server::node::store::{
    BuildRecord, BuildStatus, E2bBuild, PauseReason, PausedSnapshot, SandboxRecord, SandboxState,
    Store, TemplateRecord,
};
use server::node::template::Templates;
use server::node::webhooks::{Destinations, Policy, Webhooks};
use tower::ServiceExt;

mod common;

const KEY: &str = "e2b_0123456789abcdef0123456789abcdef01234567";

struct Node {
    app: axum::Router,
    manager: Arc<Manager>,
    templates: Arc<Templates>,
    dir: tempfile::TempDir,
}

fn record(id: &str, started: u64, state: SandboxState, team: &str) -> SandboxRecord {
    SandboxRecord {
        id: id.into(),
        template_id: "base".into(),
        alias: Some("base".into()),
        metadata: BTreeMap::from([("team".into(), team.into())]),
        access_token: Some(format!("tok-{id}").into()),
        started_at_ms: started,
        end_at_ms: started + 3_600_000,
        state,
        cpu_count: 1,
        memory_mb: 256,
        disk_size_mb: 2048,
        ..Default::default()
    }
}

/// A node whose store holds `records`; its VMM binary does not exist, so
/// nothing here can start a microVM.
fn node(records: &[SandboxRecord]) -> Node {
    node_with(records, &[])
}

/// A snapshot record `id` taken from `source` at `created`, with files in
/// `<data>/templates/<id>/`.
fn snapshot(data: &std::path::Path, id: &str, source: &str, created: u64) -> TemplateRecord {
    let dir = data.join("templates").join(id);
    TemplateRecord {
        id: id.into(),
        snapshot: dir.join("vm.state"),
        mem: dir.join("vm.mem"),
        root_layer: data.join("sandboxes").join(source).join("root.layer"),
        dir,
        root_drive_id: "rootfs".into(),
        kernel: "/nonexistent/vmlinux".into(),
        rootfs: "/nonexistent/rootfs.ext4".into(),
        vcpus: 1,
        mem_mib: 256,
        disk_size_mb: 2048,
        created_at_ms: created,
        source_sandbox: Some(source.into()),
        ..Default::default()
    }
}

/// Like [`node`], with templates in the store too (made by `templates`
/// from the data directory).
fn node_with(
    records: &[SandboxRecord],
    templates: &[&dyn Fn(&std::path::Path) -> TemplateRecord],
) -> Node {
    node_configured(records, templates, |_, _| ())
}

/// Like [`node_with`], with `setup` changing the config and the store first.
fn node_configured(
    records: &[SandboxRecord],
    templates: &[&dyn Fn(&std::path::Path) -> TemplateRecord],
    setup: impl FnOnce(&mut Config, &Store),
) -> Node {
    node_keyed(records, templates, setup, ApiKeys::for_key(KEY))
}

/// Like [`node_configured`], accepting `keys`.
fn node_keyed(
    records: &[SandboxRecord],
    templates: &[&dyn Fn(&std::path::Path) -> TemplateRecord],
    setup: impl FnOnce(&mut Config, &Store),
    keys: ApiKeys,
) -> Node {
    node_in(
        tempfile::tempdir().unwrap(),
        records,
        templates,
        setup,
        keys,
    )
}

/// Like [`node_keyed`], on data directory `dir` (and its store, if it has
/// one: a node started again).
fn node_in(
    dir: tempfile::TempDir,
    records: &[SandboxRecord],
    templates: &[&dyn Fn(&std::path::Path) -> TemplateRecord],
    setup: impl FnOnce(&mut Config, &Store),
    keys: ApiKeys,
) -> Node {
    let mut config = Config::new(
        "127.0.0.1:0".parse().unwrap(),
        "/nonexistent/vmlinux".into(),
        "/nonexistent/rootfs.ext4".into(),
        "/nonexistent/sandfork-vmm".into(),
    );
    config.data_dir = dir.path().to_owned();
    config.run_dir = Some(dir.path().join("run"));
    config.pool_size = 0;
    std::fs::create_dir_all(config.sandboxes_dir()).unwrap();
    let store = Store::open(&dir.path().join("s.redb")).unwrap();
    for r in records {
        store.put_sandbox(r).unwrap();
    }
    for make in templates {
        let t = make(dir.path());
        std::fs::create_dir_all(&t.dir).unwrap();
        std::fs::write(&t.snapshot, b"state").unwrap();
        store.put_template(&t).unwrap();
    }
    let template = TemplateRecord {
        id: "base".into(),
        dir: dir.path().join("templates/base"),
        snapshot: dir.path().join("templates/base/vm.state"),
        mem: dir.path().join("templates/base/vm.mem"),
        root_layer: dir.path().join("templates/base/root.layer"),
        root_drive_id: "rootfs".into(),
        kernel: config.kernel.clone(),
        rootfs: config.rootfs.clone(),
        vcpus: 1,
        mem_mib: 256,
        disk_size_mb: 2048,
        ..Default::default()
    };
    setup(&mut config, &store);
    let pool = Pool::start(config.vmm.clone(), config.run_dir(), 0);
    let manager = Manager::new(config, store, pool, template);
    let templates = Templates::new(manager.clone());
    let state = Arc::new(AppState {
        manager: manager.clone(),
        templates: templates.clone(),
        keys,
        guests: Default::default(),
        cluster: Default::default(),
        creates: Default::default(),
        // Tries close together, so that a test sees a retry at once.
        webhooks: Webhooks::start(
            &manager,
            Policy {
                attempts: 3,
                first_retry: std::time::Duration::from_millis(20),
                max_retry: std::time::Duration::from_millis(100),
                attempt_timeout: std::time::Duration::from_secs(5),
                concurrent: 4,
                // the tests' receivers, on loopback
                destinations: Destinations {
                    allowed: vec!["127.0.0.0/8".parse().unwrap()],
                },
            },
        ),
    });
    Node {
        app: router(state),
        manager,
        templates,
        dir,
    }
}

struct Answer {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    json: Value,
}

async fn call(node: &Node, req: Request<Body>) -> Answer {
    let response = node.app.clone().oneshot(req).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let json = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|e| panic!("{status}: not JSON ({e}): {bytes:?}"))
    };
    Answer {
        status,
        headers,
        json,
    }
}

fn authed(method: &str, uri: &str, body: &str) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("x-api-key", KEY)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

impl Node {
    /// An authenticated request's answer.
    async fn authed(&self, method: &str, uri: &str, body: &str) -> Answer {
        call(self, authed(method, uri, body)).await
    }

    /// Sends an authenticated request and checks it is refused with
    /// `status` and E2B's error body.
    async fn refuses(&self, method: &str, uri: &str, body: &str, status: StatusCode) -> Answer {
        let a = self.authed(method, uri, body).await;
        assert_error(&a, status);
        a
    }
}

fn assert_error(a: &Answer, status: StatusCode) {
    assert_eq!(a.status, status, "{}", a.json);
    assert_eq!(a.json["code"], status.as_u16(), "{}", a.json);
    assert!(
        a.json["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{}",
        a.json
    );
}

#[tokio::test]
async fn health_needs_no_key() {
    let node = node(&[]);
    let a = call(&node, Request::get("/health").body(Body::empty()).unwrap()).await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
}

#[tokio::test]
async fn control_plane_needs_the_api_key() {
    let node = node(&[record("abc", 1, SandboxState::Running, "x")]);
    for (method, uri) in [
        ("POST", "/v2/sandboxes"),
        ("POST", "/sandboxes"),
        ("GET", "/v2/sandboxes"),
        ("GET", "/sandboxes"),
        ("GET", "/sandboxes/abc"),
        ("DELETE", "/sandboxes/abc"),
        ("POST", "/sandboxes/abc/timeout"),
    ] {
        let missing = Request::builder()
            .method(method)
            .uri(uri)
            .body(Body::from("{}"))
            .unwrap();
        assert_error(&call(&node, missing).await, StatusCode::UNAUTHORIZED);
        let wrong = Request::builder()
            .method(method)
            .uri(uri)
            .header("x-api-key", "e2b_00")
            .body(Body::from("{}"))
            .unwrap();
        assert_error(&call(&node, wrong).await, StatusCode::UNAUTHORIZED);
    }
    // Routing headers on a control-plane path do not bypass the key.
    let req = Request::post("/sandboxes/abc/timeout")
        .header("e2b-sandbox-id", "abc")
        .body(Body::from("{\"timeout\":5}"))
        .unwrap();
    assert_error(&call(&node, req).await, StatusCode::UNAUTHORIZED);
    // The sandbox was not touched.
    assert_eq!(node.manager.get("abc").unwrap().end_at_ms, 1 + 3_600_000);
}

#[tokio::test]
async fn create_validates_its_body() {
    let node = node(&[]);
    for (uri, body) in [
        ("/v2/sandboxes", "{"),
        ("/v2/sandboxes", "[]"),
        ("/v2/sandboxes", r#"{"timeout":"long"}"#),
        ("/v2/sandboxes", r#"{"metadata":{"k":1}}"#),
        ("/v2/sandboxes", r#"{"timeout":-5}"#),
        ("/sandboxes", r#"{"templateID":"base","timeout":99999999}"#),
        ("/sandboxes", r#"{"envVars":"A=1"}"#),
    ] {
        let a = node.authed("POST", uri, body).await;
        assert_error(&a, StatusCode::BAD_REQUEST);
    }
    let a = call(
        &node,
        authed(
            "POST",
            "/v2/sandboxes",
            r#"{"templateID":"no-such-template"}"#,
        ),
    )
    .await;
    assert_error(&a, StatusCode::NOT_FOUND);
    assert!(
        a.json["message"]
            .as_str()
            .unwrap()
            .contains("no-such-template")
    );
}

#[tokio::test]
async fn unknown_sandboxes_are_not_found() {
    let node = node(&[]);
    for (method, uri, body) in [
        ("GET", "/sandboxes/nosuch", ""),
        ("DELETE", "/sandboxes/nosuch", ""),
        ("POST", "/sandboxes/nosuch/timeout", r#"{"timeout":30}"#),
    ] {
        node.refuses(method, uri, body, StatusCode::NOT_FOUND).await;
    }
}

/// E2B's API reads the id first: one that cannot be a sandbox id is 400
/// "Invalid sandbox ID" on every route (was 404 here), and `<id>-<client id>`,
/// as older SDKs send it, names `<id>`.
#[tokio::test]
async fn malformed_sandbox_ids_are_400_and_client_suffixes_are_dropped() {
    let node = node(&[record("abc", now_ms(), SandboxState::Running, "x")]);
    for (method, uri, body) in [
        ("GET", "/sandboxes/..%2Fetc", ""),
        ("GET", "/sandboxes/ABC!", ""),
        ("DELETE", "/sandboxes/a-b-c", ""),
        ("POST", "/sandboxes/a.b/timeout", r#"{"timeout":30}"#),
        ("POST", "/sandboxes/a%20b/pause", ""),
        ("POST", "/sandboxes/a_b/fork", "{}"),
        ("GET", "/sandboxes/%2E%2E/logs", ""),
    ] {
        let a = node.authed(method, uri, body).await;
        assert_error(&a, StatusCode::BAD_REQUEST);
        assert_eq!(a.json["message"], "Invalid sandbox ID", "{method} {uri}");
    }
    let a = node.authed("GET", "/sandboxes/abc-6532622b", "").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json);
    assert_eq!(a.json["sandboxID"], "abc");
}

/// E2B's timeout looks only among running sandboxes: a paused one is 404
/// (it was moved here), and its end stays as the pause left it.
#[tokio::test]
async fn the_timeout_of_a_paused_sandbox_is_not_found() {
    let node = node(&[record("held", 1, SandboxState::Paused, "x")]);
    let before = node.manager.get("held").unwrap().end_at_ms;
    assert_error(
        &call(
            &node,
            authed("POST", "/sandboxes/held/timeout", r#"{"timeout":300}"#),
        )
        .await,
        StatusCode::NOT_FOUND,
    );
    assert_eq!(node.manager.get("held").unwrap().end_at_ms, before);
}

#[tokio::test]
async fn get_answers_the_sandbox_detail() {
    let node = node(&[record("abc", 1_767_225_600_000, SandboxState::Running, "x")]);
    let a = node.authed("GET", "/sandboxes/abc", "").await;
    assert_eq!(a.status, StatusCode::OK);
    let d = &a.json;
    assert_eq!(d["sandboxID"], "abc");
    assert_eq!(d["templateID"], "base");
    assert_eq!(d["alias"], "base");
    assert!(d["clientID"].is_string());
    assert_eq!(d["startedAt"], "2026-01-01T00:00:00.000Z");
    assert_eq!(d["endAt"], "2026-01-01T01:00:00.000Z");
    assert_eq!(d["cpuCount"], 1);
    assert_eq!(d["memoryMB"], 256);
    assert_eq!(d["diskSizeMB"], 2048);
    assert_eq!(d["state"], "running");
    assert_eq!(d["envdVersion"], envd_proto::ENVD_VERSION);
    assert_eq!(d["envdAccessToken"], "tok-abc");
    assert_eq!(d["metadata"]["team"], "x");
    assert_eq!(d["lifecycle"]["onTimeout"], "kill");
}

#[tokio::test]
async fn list_filters_and_pages() {
    let records: Vec<_> = (0..5)
        .map(|i| {
            record(
                &format!("s{i}"),
                1000 + i,
                if i == 4 {
                    SandboxState::Paused
                } else {
                    SandboxState::Running
                },
                if i % 2 == 0 { "even" } else { "odd" },
            )
        })
        .collect();
    let node = node(&records);

    // Pages of two, newest first, through x-next-token.
    let mut seen = Vec::new();
    let mut uri = "/v2/sandboxes?limit=2".to_owned();
    loop {
        let a = node.authed("GET", &uri, "").await;
        assert_eq!(a.status, StatusCode::OK);
        let items = a.json.as_array().unwrap();
        assert!(items.len() <= 2);
        for item in items {
            for field in [
                "sandboxID",
                "templateID",
                "clientID",
                "startedAt",
                "endAt",
                "cpuCount",
                "memoryMB",
                "diskSizeMB",
                "state",
                "envdVersion",
            ] {
                assert!(!item[field].is_null(), "{field} missing in {item}");
            }
            assert!(
                item.get("envdAccessToken").is_none(),
                "list leaks the token"
            );
            seen.push(item["sandboxID"].as_str().unwrap().to_owned());
        }
        match a.headers.get("x-next-token") {
            Some(t) => uri = format!("/v2/sandboxes?limit=2&nextToken={}", t.to_str().unwrap()),
            None => break,
        }
    }
    assert_eq!(seen, ["s4", "s3", "s2", "s1", "s0"]);

    // Filters: state and metadata (as the SDK encodes it).
    let a = call(
        &node,
        authed(
            "GET",
            "/v2/sandboxes?state=running&metadata=team%3Deven&order=asc",
            "",
        ),
    )
    .await;
    let ids: Vec<_> = a
        .json
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["sandboxID"].clone())
        .collect();
    assert_eq!(ids, ["s0", "s2"]);
    let a = node.authed("GET", "/v2/sandboxes?state=paused", "").await;
    assert_eq!(a.json.as_array().unwrap().len(), 1);
    assert_eq!(a.json[0]["state"], "paused");

    // v1 lists running sandboxes in one page.
    let a = node.authed("GET", "/sandboxes", "").await;
    assert_eq!(a.json.as_array().unwrap().len(), 4);
    assert!(a.headers.get("x-next-token").is_none());

    node.refuses(
        "GET",
        "/v2/sandboxes?limit=1000",
        "",
        StatusCode::BAD_REQUEST,
    )
    .await;
}

#[tokio::test]
async fn timeout_moves_the_end_and_expiry_kills() {
    let now = now_ms();
    let node = node(&[record("abc", now, SandboxState::Running, "x")]);
    let a = call(
        &node,
        authed("POST", "/sandboxes/abc/timeout", r#"{"timeout":30}"#),
    )
    .await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
    let end = node.manager.get("abc").unwrap().end_at_ms;
    assert!(
        (now + 29_000..=now_ms() + 30_000).contains(&end),
        "{end} vs {now}"
    );
    for body in ["", "{}", r#"{"timeout":-1}"#, "nonsense"] {
        node.refuses(
            "POST",
            "/sandboxes/abc/timeout",
            body,
            StatusCode::BAD_REQUEST,
        )
        .await;
    }
    // Above the maximum is clamped to it (E2B clamps to the plan's longest
    // lifetime), not refused.
    let a = call(
        &node,
        authed("POST", "/sandboxes/abc/timeout", r#"{"timeout":99999999}"#),
    )
    .await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
    let end = node.manager.get("abc").unwrap().end_at_ms;
    assert!(end <= now_ms() + 24 * 3_600_000, "{end}");
    assert!(end >= now + 24 * 3_600_000 - 60_000, "{end}");
    // Not yet expired: the reaper leaves it.
    node.manager.reap_expired().await;
    assert!(node.manager.get("abc").is_ok());
    node.manager
        .set_timeout("abc", std::time::Duration::ZERO)
        .unwrap();
    node.manager.reap_expired().await;
    assert!(node.manager.get("abc").is_err());
}

#[tokio::test]
async fn timeout_zero_ends_the_sandbox_now() {
    let now = now_ms();
    let node = node(&[record("abc", now, SandboxState::Running, "x")]);
    let a = call(
        &node,
        authed("POST", "/sandboxes/abc/timeout", r#"{"timeout":0}"#),
    )
    .await;
    assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.json);
    // E2B ends it at once: no waiting for the reaper's tick (the handler
    // starts a reap; give it a moment).
    for _ in 0..100 {
        if node.manager.get("abc").is_err() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("timeout 0 left the sandbox running");
}

#[tokio::test]
async fn malformed_requests_are_400_never_auth_errors() {
    let now = now_ms();
    // A node of 64 sandboxes at most, for the fork count's bound.
    let node = node_configured(
        &[record("abc", now, SandboxState::Running, "x")],
        &[],
        |c, _| c.max_sandboxes = 64,
    );
    for (method, uri) in [
        ("POST", "/sandboxes"),
        ("POST", "/v2/sandboxes"),
        ("POST", "/sandboxes/abc/timeout"),
        ("POST", "/sandboxes/abc/refreshes"),
        ("POST", "/sandboxes/abc/pause"),
        ("POST", "/sandboxes/abc/resume"),
        ("POST", "/sandboxes/abc/connect"),
        ("POST", "/v2/sandboxes/abc/connect"),
        ("POST", "/sandboxes/abc/fork"),
        ("POST", "/sandboxes/abc/snapshots"),
        ("POST", "/templates"),
    ] {
        let a = node.authed(method, uri, "{not json").await;
        assert_error(&a, StatusCode::BAD_REQUEST);
    }
    for uri in [
        "/v2/sandboxes?limit=0",
        "/v2/sandboxes?state=gone",
        "/v2/sandboxes?startedAfter=yesterday",
        "/v2/sandboxes?order=up",
        "/v2/sandboxes?nextToken=x",
    ] {
        node.refuses("GET", uri, "", StatusCode::BAD_REQUEST).await;
    }
    // Fork's bounds in E2B's order and words (the SDKs map 400 to an
    // invalid-argument error; a 401 read as a bad key).
    for (body, message) in [
        (r#"{"count":0}"#, "Count must be at least 1"),
        (r#"{"count":-1}"#, "Count must be at least 1"),
        (r#"{"count":101}"#, "Count cannot be greater than 100"),
        (
            r#"{"count":64}"#,
            "Count must be lower than the maximum number of concurrent sandboxes (64)",
        ),
        (
            r#"{"count":0,"timeout":0}"#,
            "Timeout must be greater than 0",
        ),
    ] {
        let a = node.authed("POST", "/sandboxes/abc/fork", body).await;
        assert_error(&a, StatusCode::BAD_REQUEST);
        assert_eq!(a.json["message"], message, "{body}");
    }
    // Also for a sandbox that does not exist: the body is checked first.
    let a = call(
        &node,
        authed("POST", "/sandboxes/nosuch/fork", r#"{"count":0}"#),
    )
    .await;
    assert_error(&a, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn a_file_url_no_sandbox_signed_is_envds_invalid_signature() {
    let node = node(&[record("abc", now_ms(), SandboxState::Running, "x")]);
    for method in ["GET", "POST"] {
        let req = Request::builder()
            .method(method)
            .uri("/files?path=%2Fhome%2Fuser%2Fa&signature=v1_wrong")
            .body(Body::empty())
            .unwrap();
        let a = call(&node, req).await;
        assert_error(&a, StatusCode::UNAUTHORIZED);
        assert_eq!(a.json["message"], "invalid signature");
    }
}

#[tokio::test]
async fn list_reads_started_after_as_the_sdks_send_it() {
    let node = node(&[
        record("old", 1_767_225_600_000, SandboxState::Running, "x"),
        record(
            "new",
            1_767_225_600_000 + 60_000,
            SandboxState::Running,
            "x",
        ),
    ]);
    for query in [
        // JS: toISOString()
        "startedAfter=2026-01-01T00%3A00%3A30.000Z",
        // Python: astimezone().isoformat(), microseconds and an offset
        "startedAfter=2026-01-01T01%3A00%3A30.000000%2B01%3A00",
    ] {
        let a = node
            .authed("GET", &format!("/v2/sandboxes?{query}"), "")
            .await;
        assert_eq!(a.status, StatusCode::OK, "{query}: {}", a.json);
        let ids: Vec<_> = a
            .json
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["sandboxID"].clone())
            .collect();
        assert_eq!(ids, ["new"], "{query}");
    }
}

#[tokio::test]
async fn refreshes_extend_but_never_shorten() {
    let now = now_ms();
    let node = node(&[
        record("abc", now, SandboxState::Running, "x"),
        record("held", now, SandboxState::Paused, "x"),
    ]);
    node.manager
        .set_timeout("abc", std::time::Duration::from_secs(10))
        .unwrap();
    let refresh = |body: &'static str| authed("POST", "/sandboxes/abc/refreshes", body);
    assert_eq!(
        call(&node, refresh(r#"{"duration":600}"#)).await.status,
        StatusCode::NO_CONTENT
    );
    let end = node.manager.get("abc").unwrap().end_at_ms;
    assert!(end >= now + 599_000, "{end} vs {now}");
    // a shorter refresh leaves the later end
    assert_eq!(
        call(&node, refresh(r#"{"duration":5}"#)).await.status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(node.manager.get("abc").unwrap().end_at_ms, end);
    for body in [
        r#"{"duration":3601}"#,
        r#"{"duration":-1}"#,
        r#"{"time":5}"#,
        "nonsense",
    ] {
        assert_error(&call(&node, refresh(body)).await, StatusCode::BAD_REQUEST);
    }
    node.refuses(
        "POST",
        "/sandboxes/nosuch/refreshes",
        "{}",
        StatusCode::NOT_FOUND,
    )
    .await;
    node.refuses(
        "POST",
        "/sandboxes/held/refreshes",
        "{}",
        StatusCode::CONFLICT,
    )
    .await;
}

#[tokio::test]
async fn kill_removes_the_sandbox() {
    let node = node(&[record("abc", 1, SandboxState::Running, "x")]);
    let a = node.authed("DELETE", "/sandboxes/abc", "").await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
    node.refuses("DELETE", "/sandboxes/abc", "", StatusCode::NOT_FOUND)
        .await;
    node.refuses("GET", "/sandboxes/abc", "", StatusCode::NOT_FOUND)
        .await;
}

#[tokio::test]
async fn the_proxy_answers_502_for_sandboxes_it_does_not_run() {
    // A record without a VMM (as after a restart) is not reachable either.
    let node = node(&[record("abc", 1, SandboxState::Running, "x")]);
    for req in [
        Request::post("/process.Process/Start")
            .header("e2b-sandbox-id", "nosuch")
            .header("e2b-sandbox-port", "49983")
            .body(Body::from("x"))
            .unwrap(),
        Request::get("/health")
            .header("e2b-sandbox-id", "abc")
            .body(Body::empty())
            .unwrap(),
        Request::get("/files?path=/etc/hostname")
            .header("host", "49983-abc.sandfork.test:3000")
            .body(Body::empty())
            .unwrap(),
    ] {
        let a = call(&node, req).await;
        assert_eq!(a.status, StatusCode::BAD_GATEWAY);
        assert_eq!(a.json["code"], 502);
        assert!(
            a.json["message"]
                .as_str()
                .unwrap()
                .contains("was not found")
        );
        assert!(a.json["sandboxId"].is_string());
    }
}

#[tokio::test]
async fn pause_resume_and_connect_answer_by_state() {
    let now = now_ms();
    let node = node(&[
        record("run", now, SandboxState::Running, "x"),
        record("held", now, SandboxState::Paused, "x"),
    ]);
    for uri in [
        "/sandboxes/nosuch/pause",
        "/sandboxes/nosuch/resume",
        "/sandboxes/nosuch/connect",
        "/v2/sandboxes/nosuch/connect",
    ] {
        node.refuses("POST", uri, "{}", StatusCode::NOT_FOUND).await;
    }
    // Pausing a paused sandbox: 409, as E2B ("already paused").
    node.refuses("POST", "/sandboxes/held/pause", "{}", StatusCode::CONFLICT)
        .await;
    // Whatever it would keep; a malformed mode is the caller's error.
    assert_error(
        &call(
            &node,
            authed("POST", "/sandboxes/held/pause", r#"{"memory":false}"#),
        )
        .await,
        StatusCode::CONFLICT,
    );
    assert_error(
        &call(
            &node,
            authed("POST", "/sandboxes/held/pause", r#"{"memory":"no"}"#),
        )
        .await,
        StatusCode::BAD_REQUEST,
    );
    // A reboot asked of a running sandbox only extends it (E2B: a no-op).
    let a = call(
        &node,
        authed(
            "POST",
            "/v2/sandboxes/run/connect",
            r#"{"timeout":60,"memory":false}"#,
        ),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json);
    // The old resume route refuses a running sandbox.
    assert_error(
        &call(
            &node,
            authed("POST", "/sandboxes/run/resume", r#"{"timeout":60}"#),
        )
        .await,
        StatusCode::CONFLICT,
    );
    // Connect to a running sandbox: 200, the Sandbox object, a longer
    // timeout extends it and a shorter one does not shorten it.
    let before = node.manager.get("run").unwrap().end_at_ms;
    let a = call(
        &node,
        authed("POST", "/v2/sandboxes/run/connect", r#"{"timeout":60}"#),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json);
    assert_eq!(a.json["sandboxID"], "run");
    assert_eq!(a.json["envdAccessToken"], "tok-run");
    assert_eq!(node.manager.get("run").unwrap().end_at_ms, before);
    let a = call(
        &node,
        authed("POST", "/sandboxes/run/connect", r#"{"timeout":7200}"#),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(node.manager.get("run").unwrap().end_at_ms > before);
    for body in ["{", r#"{"timeout":-1}"#] {
        node.refuses(
            "POST",
            "/v2/sandboxes/run/connect",
            body,
            StatusCode::BAD_REQUEST,
        )
        .await;
    }
}

/// A sandbox the node paused for memory pressure is `paused` with its
/// reason; to its owner it still runs: its timeout can be set, a request
/// (routed, or found by its token) tries to resume it (here the VMM cannot
/// start: a 503 saying so, and it stays paused), its owner's pause makes the
/// pause theirs (no request resumes it then), and at its end it gets what
/// its timeout would have done.
#[tokio::test]
async fn a_sandbox_paused_for_memory_pressure_still_runs_for_its_owner() {
    let now = now_ms();
    let squeezed = |id: &str, end_at_ms: u64, auto_pause: bool| SandboxRecord {
        end_at_ms,
        auto_pause,
        pause_reason: Some(PauseReason::MemoryPressure),
        ..record(id, now, SandboxState::Paused, "x")
    };
    let node = node(&[
        squeezed("squeezed", now + 3_600_000, false),
        squeezed("over", now - 1, false),
        squeezed("overap", now - 1, true),
    ]);
    let a = node.authed("GET", "/sandboxes/squeezed", "").await;
    assert_eq!(a.json["state"], "paused", "{}", a.json);
    assert_eq!(a.json["pauseReason"], "memoryPressure", "{}", a.json);
    // Its record names no memory snapshot: a resume would cold-boot it.
    assert_eq!(a.json["pauseMode"], "filesystem", "{}", a.json);
    let info = node.authed("GET", "/v1/node", "").await.json;
    assert_eq!(info["memoryPressure"]["enabled"], true, "{info}");
    assert_eq!(info["memoryPressure"]["pausedNow"], 3, "{info}");

    let a = call(
        &node,
        authed("POST", "/sandboxes/squeezed/timeout", r#"{"timeout":60}"#),
    )
    .await;
    assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.json);
    let end = node.manager.get("squeezed").unwrap().end_at_ms;
    assert!(end < now + 120_000, "{end}");

    let routed = || {
        Request::post("/process.Process/Start")
            .header("e2b-sandbox-id", "squeezed")
            .header("x-access-token", "tok-squeezed")
            .body(Body::from("x"))
            .unwrap()
    };
    // Only a request its guest would take wakes it: its envd token.
    for token in [None, Some("tok-over")] {
        let mut req = Request::post("/process.Process/Start").header("e2b-sandbox-id", "squeezed");
        if let Some(t) = token {
            req = req.header("x-access-token", t);
        }
        let a = call(&node, req.body(Body::from("x")).unwrap()).await;
        assert_error(&a, StatusCode::UNAUTHORIZED);
    }
    let by_token = || {
        Request::post("/process.Process/Start")
            .header("x-access-token", "tok-squeezed")
            .body(Body::from("x"))
            .unwrap()
    };
    for req in [routed(), by_token()] {
        let a = call(&node, req).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.json);
        assert!(
            a.json["message"]
                .as_str()
                .unwrap()
                .contains("paused by its node for memory pressure and could not be resumed"),
            "{}",
            a.json
        );
        let r = node.manager.get("squeezed").unwrap();
        assert_eq!(r.state, SandboxState::Paused);
        assert_eq!(r.pause_reason, Some(PauseReason::MemoryPressure));
    }

    // Its owner pauses it: 204, and it stays paused, as theirs.
    let a = node.authed("POST", "/sandboxes/squeezed/pause", "{}").await;
    assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.json);
    let r = node.manager.get("squeezed").unwrap();
    assert_eq!(r.pause_reason, Some(PauseReason::Request));
    let a = call(&node, routed()).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{}", a.json);
    node.refuses(
        "POST",
        "/sandboxes/squeezed/pause",
        "{}",
        StatusCode::CONFLICT,
    )
    .await;
    assert_error(
        &call(
            &node,
            authed("POST", "/sandboxes/squeezed/timeout", r#"{"timeout":60}"#),
        )
        .await,
        StatusCode::NOT_FOUND,
    );

    // Their time is up: killed, or paused as by its timeout.
    node.manager.reap_expired().await;
    assert!(node.manager.get("over").is_err());
    let r = node.manager.get("overap").unwrap();
    assert_eq!(
        (r.state, r.pause_reason),
        (SandboxState::Paused, Some(PauseReason::Timeout))
    );
    let a = node.authed("GET", "/sandboxes/overap", "").await;
    assert_eq!(a.json["pauseReason"], "timeout", "{}", a.json);
}

#[tokio::test]
async fn diagnostics_need_a_sandbox_whose_vmm_runs_here() {
    let now = now_ms();
    let node = node(&[
        record("run", now, SandboxState::Running, "x"),
        record("held", now, SandboxState::Paused, "x"),
    ]);
    let diagnose = |id: &str| authed("GET", &format!("/v1/sandboxes/{id}/diagnostics"), "");
    assert_error(
        &call(&node, diagnose("nosuch")).await,
        StatusCode::NOT_FOUND,
    );
    let paused = call(&node, diagnose("held")).await;
    assert_error(&paused, StatusCode::CONFLICT);
    assert!(paused.json["message"].as_str().unwrap().contains("paused"));
    // A record that says running, with no VMM of it on this node.
    assert_error(&call(&node, diagnose("run")).await, StatusCode::CONFLICT);
    let unauthenticated = Request::builder()
        .uri("/v1/sandboxes/run/diagnostics")
        .body(Body::empty())
        .unwrap();
    assert_error(
        &call(&node, unauthenticated).await,
        StatusCode::UNAUTHORIZED,
    );
}

#[tokio::test]
async fn fork_validates_and_needs_a_running_sandbox() {
    let now = now_ms();
    let node = node(&[
        record("run", now, SandboxState::Running, "x"),
        record("held", now, SandboxState::Paused, "x"),
    ]);
    node.refuses(
        "POST",
        "/sandboxes/nosuch/fork",
        "{}",
        StatusCode::NOT_FOUND,
    )
    .await;
    for body in [
        r#"{"count":0}"#,
        r#"{"count":101}"#,
        r#"{"count":"x"}"#,
        r#"{"timeout":-3}"#,
    ] {
        node.refuses("POST", "/sandboxes/run/fork", body, StatusCode::BAD_REQUEST)
            .await;
    }
    // A paused sandbox forks from its paused memory: one paused without it
    // has none to fork.
    let a = call(
        &node,
        authed("POST", "/sandboxes/held/fork", r#"{"count":2}"#),
    )
    .await;
    assert_error(&a, StatusCode::CONFLICT);
    assert!(
        a.json["message"]
            .as_str()
            .unwrap()
            .contains("paused without its memory"),
        "{}",
        a.json
    );
    // A snapshot's fork: the count and timeout first, then the snapshot;
    // a template that is no snapshot is not found.
    let (bad, missing, nosuch) = (
        StatusCode::BAD_REQUEST,
        StatusCode::NOT_FOUND,
        "/snapshots/nosuch/fork",
    );
    for (uri, body, status) in [
        (nosuch, r#"{"count":0}"#, bad),
        (nosuch, r#"{"timeout":0}"#, bad),
        (nosuch, "{not json", bad),
        (nosuch, r#"{"count":2}"#, missing),
        ("/snapshots/team%2Fnosuch/fork", "{}", missing),
        ("/snapshots/base/fork", "{}", missing),
    ] {
        let a = node.authed("POST", uri, body).await;
        assert_error(&a, status);
    }
}

#[tokio::test]
async fn snapshot_create_validates_and_needs_a_running_sandbox() {
    let now = now_ms();
    let node = node(&[record("held", now, SandboxState::Paused, "x")]);
    node.refuses(
        "POST",
        "/sandboxes/nosuch/snapshots",
        "{}",
        StatusCode::NOT_FOUND,
    )
    .await;
    node.refuses(
        "POST",
        "/sandboxes/NO..pe/snapshots",
        "{}",
        StatusCode::BAD_REQUEST,
    )
    .await;
    for body in [
        r#"{"name":"has space"}"#,
        r#"{"name":"a:b"}"#,
        r#"{"name":7}"#,
        "{",
    ] {
        node.refuses(
            "POST",
            "/sandboxes/held/snapshots",
            body,
            StatusCode::BAD_REQUEST,
        )
        .await;
    }
    node.refuses(
        "POST",
        "/sandboxes/held/snapshots",
        "{}",
        StatusCode::CONFLICT,
    )
    .await;
    let unauthed = Request::builder()
        .method("POST")
        .uri("/sandboxes/held/snapshots")
        .body(Body::empty())
        .unwrap();
    assert_error(&call(&node, unauthed).await, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn snapshots_are_listed_newest_first_filtered_and_paged() {
    let node = node_with(
        &[],
        &[
            &|d| snapshot(d, "snapa", "src1", 1_000),
            &|d| TemplateRecord {
                names: vec!["team/named".into()],
                ..snapshot(d, "snapb", "src2", 2_000)
            },
            &|d| snapshot(d, "snapc", "src1", 3_000),
        ],
    );
    let all = node.authed("GET", "/snapshots", "").await;
    assert_eq!(all.status, StatusCode::OK, "{}", all.json);
    let ids: Vec<&str> = all
        .json
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["snapshotID"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["snapc", "snapb", "snapa"]);
    assert_eq!(all.json[1]["names"], serde_json::json!(["team/named"]));
    assert_eq!(all.json[0]["names"], serde_json::json!([]));
    assert_eq!(all.json[0]["sandboxID"], "src1");
    assert!(all.headers.get("x-next-token").is_none());

    let src1 = node.authed("GET", "/snapshots?sandboxID=src1", "").await;
    assert_eq!(src1.json.as_array().unwrap().len(), 2);
    let named = node.authed("GET", "/snapshots?name=team%2Fnamed", "").await;
    assert_eq!(named.json[0]["snapshotID"], "snapb");
    assert_eq!(named.json.as_array().unwrap().len(), 1);

    let mut seen = Vec::new();
    let mut uri = "/snapshots?limit=2".to_owned();
    loop {
        let page = node.authed("GET", &uri, "").await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.json);
        for s in page.json.as_array().unwrap() {
            seen.push(s["snapshotID"].as_str().unwrap().to_owned());
        }
        match page.headers.get("x-next-token") {
            Some(t) => uri = format!("/snapshots?limit=2&nextToken={}", t.to_str().unwrap()),
            None => break,
        }
    }
    assert_eq!(seen, ["snapc", "snapb", "snapa"]);
    for bad in ["/snapshots?limit=0", "/snapshots?nextToken=x"] {
        node.refuses("GET", bad, "", StatusCode::BAD_REQUEST).await;
    }
}

#[tokio::test]
async fn a_snapshot_deleted_while_used_loses_its_name_and_keeps_its_files_for_its_users() {
    let now = now_ms();
    let made = SandboxRecord {
        template_id: "snapa".into(),
        uses_snapshots: vec!["snapa".into()],
        ..record("made", now, SandboxState::Paused, "x")
    };
    // The source runs on the snapshot's memory until it goes.
    let source = SandboxRecord {
        uses_snapshots: vec!["snapb".into()],
        ..record("src1", now, SandboxState::Running, "x")
    };
    let node = node_with(
        &[made, source],
        &[
            &|d| snapshot(d, "snapa", "src0", 1_000),
            &|d| snapshot(d, "snapb", "src1", 2_000),
            // snapc was taken from a sandbox made from snapd
            &|d| TemplateRecord {
                uses_snapshots: vec!["snapd".into()],
                ..snapshot(d, "snapc", "src3", 3_000)
            },
            &|d| TemplateRecord {
                names: vec!["team/named".into()],
                ..snapshot(d, "snapd", "src4", 4_000)
            },
        ],
    );
    node.refuses("DELETE", "/templates/nosuch", "", StatusCode::NOT_FOUND)
        .await;
    node.refuses("DELETE", "/templates/base", "", StatusCode::BAD_REQUEST)
        .await;
    // As on E2B: deleted at once, whatever stacks on it (its users keep
    // running on its files, which stay until the last user goes).
    let dir = |id: &str| node.dir.path().join("templates").join(id);
    // snapd (by name) first: snapc stacks on it.
    for id in ["snapa", "snapb", "team%2Fnamed%3Adefault", "snapc"] {
        let gone = node.authed("DELETE", &format!("/templates/{id}"), "").await;
        assert_eq!(gone.status, StatusCode::NO_CONTENT, "{id}: {}", gone.json);
        node.refuses(
            "DELETE",
            &format!("/templates/{id}"),
            "",
            StatusCode::NOT_FOUND,
        )
        .await;
    }
    let left = node.authed("GET", "/snapshots", "").await;
    assert_eq!(left.json, serde_json::json!([]));
    assert_error(
        &call(
            &node,
            authed("POST", "/v2/sandboxes", r#"{"templateID":"snapa"}"#),
        )
        .await,
        StatusCode::NOT_FOUND,
    );
    // snapc had no user: gone at once; the others wait for theirs (snapd's
    // was snapc, so the collector finds it unused).
    assert!(!dir("snapc").exists());
    for id in ["snapa", "snapb", "snapd"] {
        assert!(dir(id).is_dir(), "{id}");
    }
    let gc = node.manager.collect_garbage().await.unwrap();
    assert_eq!(gc.templates, ["snapd"], "{gc:?}");
    node.manager.kill("made").await.unwrap();
    let gc = node.manager.collect_garbage().await.unwrap();
    assert_eq!(gc.templates, ["snapa"], "{gc:?}");
    assert!(!dir("snapa").exists() && dir("snapb").is_dir());
    node.manager.kill("src1").await.unwrap();
    let gc = node.manager.collect_garbage().await.unwrap();
    assert_eq!(gc.templates, ["snapb"], "{gc:?}");
    assert!(!dir("snapb").exists());
    assert!(node.manager.store().retired_templates().unwrap().is_empty());
}

#[tokio::test]
async fn create_from_an_unknown_snapshot_is_not_found() {
    let node = node(&[]);
    assert_error(
        &call(
            &node,
            authed(
                "POST",
                "/v2/sandboxes",
                r#"{"templateID":"nosuch:default"}"#,
            ),
        )
        .await,
        StatusCode::NOT_FOUND,
    );
}

#[tokio::test]
async fn metrics_and_logs_answer_by_sandbox_and_check_their_query() {
    let node = node(&[record("held", now_ms(), SandboxState::Paused, "x")]);
    for uri in [
        "/sandboxes/nosuch/metrics",
        "/sandboxes/nosuch/logs",
        "/v2/sandboxes/nosuch/logs",
    ] {
        node.refuses("GET", uri, "", StatusCode::NOT_FOUND).await;
    }
    node.refuses(
        "GET",
        "/sandboxes/NO..pe/metrics",
        "",
        StatusCode::BAD_REQUEST,
    )
    .await;
    for uri in [
        "/sandboxes/held/metrics?start=x",
        "/sandboxes/held/metrics?start=9&end=8",
        "/sandboxes/held/logs?limit=0",
        "/v2/sandboxes/held/logs?direction=sideways",
        "/v2/sandboxes/held/logs?level=loud",
    ] {
        node.refuses("GET", uri, "", StatusCode::BAD_REQUEST).await;
    }
    for uri in [
        "/sandboxes/metrics",
        "/sandboxes/metrics?sandbox_ids=",
        "/sandboxes/metrics?sandbox_ids=,",
    ] {
        node.refuses("GET", uri, "", StatusCode::BAD_REQUEST).await;
    }
    let many = format!(
        "/sandboxes/metrics?sandbox_ids={}",
        vec!["a"; 101].join(",")
    );
    node.refuses("GET", &many, "", StatusCode::BAD_REQUEST)
        .await;
    // Unknown and never-sampled sandboxes are left out, not an error.
    let m = call(
        &node,
        authed(
            "GET",
            "/sandboxes/metrics?sandbox_ids=held,nosuch,NO..pe",
            "",
        ),
    )
    .await;
    assert_eq!(
        (m.status, m.json.clone()),
        (StatusCode::OK, serde_json::json!({"sandboxes": {}}))
    );
    // A paused sandbox that was never watched: nothing yet, in E2B's shapes.
    let m = call(
        &node,
        authed("GET", "/sandboxes/held/metrics?start=1&end=2", ""),
    )
    .await;
    assert_eq!(
        (m.status, m.json.clone()),
        (StatusCode::OK, serde_json::json!([]))
    );
    let l = node.authed("GET", "/sandboxes/held/logs", "").await;
    assert_eq!(l.status, StatusCode::OK);
    assert_eq!(l.json, serde_json::json!({"logs": [], "logEntries": []}));
    let l = call(
        &node,
        authed("GET", "/v2/sandboxes/held/logs?level=warn", ""),
    )
    .await;
    assert_eq!(l.json, serde_json::json!({"logs": []}));
    let unauthed = Request::builder()
        .uri("/sandboxes/held/metrics")
        .body(Body::empty())
        .unwrap();
    assert_error(&call(&node, unauthed).await, StatusCode::UNAUTHORIZED);
}

/// What a node observed of a sandbox is on disk (`<data>/observe/<id>/`):
/// the next process serves it through E2B's routes, and it goes with the
/// sandbox's record.
#[tokio::test]
async fn logs_and_metrics_kept_on_disk_are_served_and_go_with_the_sandbox() {
    let now = now_ms();
    let node = node_configured(
        &[record("held", now, SandboxState::Paused, "x")],
        &[],
        |c, _| {
            // As a node that observed `held` (and a sandbox since gone) left it.
            let dir = c.observe_dir().join("held");
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(
                dir.join("logs.jsonl"),
                format!(
                    "{{\"at_ms\":{now},\"level\":\"info\",\"source\":\"console\",\"message\":\"boot\"}}\n\
                     {{\"at_ms\":{},\"level\":\"warn\",\"source\":\"agent\",\"message\":\"low\"}}\n",
                    now + 1
                ),
            )
            .unwrap();
            std::fs::write(
                dir.join("metrics.jsonl"),
                format!(
                    "{{\"at_ms\":{now},\"ts\":1,\"cpu_count\":2,\"cpu_used_pct\":1.5,\
                     \"mem_total\":1000,\"mem_used\":500,\"mem_cache\":0,\"disk_used\":7,\
                     \"disk_total\":9}}\n"
                ),
            )
            .unwrap();
            std::fs::create_dir_all(c.observe_dir().join("ghost")).unwrap();
        },
    );
    let l = node.authed("GET", "/sandboxes/held/logs", "").await;
    assert_eq!(l.status, StatusCode::OK);
    let lines: Vec<Value> = l.json["logs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| serde_json::from_str(e["line"].as_str().unwrap()).unwrap())
        .collect();
    assert_eq!(
        lines,
        [
            serde_json::json!({"level": "info", "logger": "console", "message": "boot"}),
            serde_json::json!({"level": "warn", "logger": "agent", "message": "low"}),
        ]
    );
    let v2 = call(
        &node,
        authed("GET", "/v2/sandboxes/held/logs?level=warn", ""),
    )
    .await;
    assert_eq!(v2.json["logs"].as_array().unwrap().len(), 1);
    assert_eq!(v2.json["logs"][0]["fields"]["source"], "agent");
    let m = node.authed("GET", "/sandboxes/held/metrics", "").await;
    assert_eq!(m.json.as_array().unwrap().len(), 1, "{}", m.json);
    assert_eq!(
        (
            m.json[0]["cpuCount"].as_u64(),
            m.json[0]["diskTotal"].as_u64()
        ),
        (Some(2), Some(9))
    );
    let batch = call(
        &node,
        authed("GET", "/sandboxes/metrics?sandbox_ids=held", ""),
    )
    .await;
    assert_eq!(batch.json["sandboxes"]["held"]["memUsed"], 500);

    let observe = node.dir.path().join("observe");
    node.manager.kill("held").await.unwrap();
    assert!(!observe.join("held").exists());
    assert!(observe.join("ghost").exists());
    let gc = node.manager.collect_garbage().await.unwrap();
    assert!(gc.dirs.contains(&observe.join("ghost")), "{gc:?}");
    assert!(!observe.join("ghost").exists());
}

/// A node with room for `memory_mib` of sandboxes and 2 vCPUs, holding a
/// running sandbox `run` and a paused one `held` (records only: they hold
/// no capacity, since no VMM of theirs runs here).
fn small_node(configure: impl FnOnce(&mut Config)) -> Node {
    let now = now_ms();
    let held = SandboxRecord {
        snapshot: Some(PausedSnapshot {
            state: "/nonexistent/pause-1.state".into(),
            mem: "/nonexistent/pause-1.mem".into(),
        }),
        ..record("held", now, SandboxState::Paused, "x")
    };
    node_configured(
        &[record("run", now, SandboxState::Running, "x"), held],
        &[],
        |c, _| {
            c.capacity.vcpus = Some(2);
            c.capacity.vcpu_overcommit = 1.0;
            c.capacity.memory_mib = Some(600);
            // A headroom of a whole guest: each sandbox is charged its full
            // 256 MiB, so the figures here are plain sums.
            c.capacity.memory_headroom_mib = 256;
            c.max_sandboxes = 5;
            configure(c)
        },
    )
}

async fn node_info(node: &Node) -> Value {
    let a = call(node, authed("GET", "/v1/node", "")).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json);
    a.json
}

fn assert_holds_nothing(info: &Value) {
    assert_eq!(info["vcpus"]["used"], 0, "{info}");
    assert_eq!(info["memoryMB"]["used"], 0, "{info}");
    assert_eq!(info["sandboxes"]["starting"], 0, "{info}");
}

#[tokio::test]
async fn node_reports_capacity_and_use() {
    let node = small_node(|c| {
        c.capacity.min_free_disk_mib = 100;
        c.capacity.image_disk.high_percent = 99.5;
    });
    let unauthed = Request::get("/v1/node").body(Body::empty()).unwrap();
    assert_error(&call(&node, unauthed).await, StatusCode::UNAUTHORIZED);
    let info = node_info(&node).await;
    assert_eq!(info["vcpus"]["total"], 2);
    assert_eq!(info["vcpus"]["free"], 2);
    assert_eq!(info["memoryMB"]["total"], 600);
    assert_eq!(info["memoryMB"]["free"], 600);
    assert_holds_nothing(&info);
    assert_eq!(info["sandboxes"]["running"], 1);
    assert_eq!(info["sandboxes"]["paused"], 1);
    assert_eq!(info["sandboxes"]["max"], 5);
    assert_eq!(info["diskMB"]["minFree"], 100);
    let (total, free) = (
        info["diskMB"]["total"].as_u64().unwrap(),
        info["diskMB"]["free"].as_u64().unwrap(),
    );
    assert!(total > 0 && free < total, "{info}");
    let used = info["diskMB"]["usedPercent"].as_f64().unwrap();
    assert!(used > 0.0 && used <= 100.0, "{info}");
    assert!(info["diskMB"]["used"].as_u64().unwrap() > 0, "{info}");
    let images = &info["diskMB"]["images"];
    assert_eq!(images["highWatermark"], 99.5, "{info}");
    assert_eq!(images["lowWatermark"], 80.0, "{info}");
    assert_eq!(images["templates"], 0, "{info}");
    assert_eq!(images["evicted"], 0, "{info}");
    assert_eq!(images["refused"], 0, "{info}");
    assert_eq!(info["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(info["envdVersion"], envd_proto::ENVD_VERSION);
}

#[tokio::test]
async fn over_capacity_answers_503_saying_what_and_holds_nothing() {
    // 200 MiB: not one 256 MiB sandbox fits.
    let node = small_node(|c| c.capacity.memory_mib = Some(200));
    let a = call(
        &node,
        authed("POST", "/v2/sandboxes", r#"{"templateID":"base"}"#),
    )
    .await;
    assert_error(&a, StatusCode::SERVICE_UNAVAILABLE);
    let message = a.json["message"].as_str().unwrap();
    assert!(
        message.contains("not enough memory for a sandbox: it needs 256 MiB, 200 MiB of the node's 200 MiB are free"),
        "{message}"
    );
    let a = call(
        &node,
        authed("POST", "/sandboxes/held/resume", r#"{"timeout":60}"#),
    )
    .await;
    assert_error(&a, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        a.json["message"]
            .as_str()
            .unwrap()
            .contains("for resuming sandbox held: it needs 256 MiB"),
        "{}",
        a.json
    );
    // A fork that does not fit is refused whole, before anything starts.
    let a = call(
        &node,
        authed("POST", "/sandboxes/run/fork", r#"{"count":3}"#),
    )
    .await;
    assert_error(&a, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        a.json["message"]
            .as_str()
            .unwrap()
            .contains("not enough vCPUs for a fork of 3 children: it needs 3 vCPUs, 2 vCPUs of the node's 2 vCPUs are free"),
        "{}",
        a.json
    );
    let info = node_info(&node).await;
    assert_holds_nothing(&info);
    assert_eq!(info["sandboxes"]["paused"], 1);
    assert_eq!(
        node.manager.get("held").unwrap().state,
        SandboxState::Paused
    );
    assert!(std::fs::read_dir(node.dir.path().join("forks")).is_err());
}

#[tokio::test]
async fn the_count_limit_stays_429() {
    let node = small_node(|c| c.max_sandboxes = 0);
    let a = node.authed("POST", "/v2/sandboxes", "{}").await;
    assert_error(&a, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        a.json["message"]
            .as_str()
            .unwrap()
            .contains("at most 0 sandboxes"),
        "{}",
        a.json
    );
}

#[tokio::test]
async fn too_little_disk_answers_503() {
    let node = small_node(|c| c.capacity.min_free_disk_mib = u64::MAX / 2);
    let a = node.authed("POST", "/v2/sandboxes", "{}").await;
    assert_error(&a, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        a.json["message"]
            .as_str()
            .unwrap()
            .contains("not enough disk space for a sandbox: it needs 256 MiB free"),
        "{}",
        a.json
    );
    let a = node.authed("POST", "/sandboxes/run/snapshots", "{}").await;
    assert_error(&a, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        a.json["message"]
            .as_str()
            .unwrap()
            .contains("disk space for a snapshot of sandbox run"),
        "{}",
        a.json
    );
    assert_holds_nothing(&node_info(&node).await);
}

#[tokio::test]
async fn creates_and_forks_that_fail_give_their_reservation_back() {
    // Room enough: these get past the check, then fail (no VMM, no template
    // files here) and must hand back what they reserved.
    let node = small_node(|c| {
        c.capacity.vcpus = Some(8);
        c.capacity.memory_mib = Some(4096);
        // nor by the host's free disk (this is not a disk test)
        c.capacity.min_free_disk_mib = 0;
    });
    let mut creates = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let app = node.app.clone();
        creates.spawn(async move {
            let req = authed("POST", "/v2/sandboxes", "{}");
            app.oneshot(req).await.unwrap().status()
        });
    }
    for status in creates.join_all().await {
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    }
    // `run` is a record whose VMM does not run here: the fork reserves, then
    // finds no VMM to fork.
    let a = call(
        &node,
        authed("POST", "/sandboxes/run/fork", r#"{"count":2}"#),
    )
    .await;
    assert_error(&a, StatusCode::NOT_FOUND);
    // A resume reserves, then finds no VMM binary to restore into.
    let a = call(
        &node,
        authed("POST", "/sandboxes/held/resume", r#"{"timeout":60}"#),
    )
    .await;
    assert_error(&a, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        node.manager.get("held").unwrap().state,
        SandboxState::Paused
    );
    assert_holds_nothing(&node_info(&node).await);
}

/// A template built from an image (not a snapshot), with files in
/// `<data>/templates/<id>/` and the name `name`.
fn built(data: &std::path::Path, id: &str, name: &str, created: u64) -> TemplateRecord {
    let dir = data.join("templates").join(id);
    TemplateRecord {
        root_layer: dir.join("root.layer"),
        source_sandbox: None,
        names: vec![name.into()],
        vcpus: 2,
        mem_mib: 512,
        ..snapshot(data, id, "unused", created)
    }
}

fn build_record(id: &str, name: &str, status: BuildStatus, started: u64) -> BuildRecord {
    BuildRecord {
        template_id: id.into(),
        build_id: format!("build-{id}"),
        name: name.into(),
        source: "debian packages jq".into(),
        vcpus: 1,
        mem_mib: 256,
        status,
        reason: (status == BuildStatus::Error).then(|| "apt failed".into()),
        started_at_ms: started,
        finished_at_ms: None,
        log: vec!["line 1".into(), "line 2".into()],
        reason_step: None,
        e2b: None,
    }
}

/// What E2B offers and this node does not is refused by name when asked
/// for, never ignored; absent, empty or off it is accepted.
#[tokio::test]
async fn a_create_asking_for_what_the_node_lacks_is_refused_by_name() {
    let node = node(&[]);
    for (extra, field) in [
        (r#""autoResume":{"enabled":true}"#, "autoResume"),
        (
            r#""iam":{"tokens":{"gcp":{"audience":"x","tokenType":"oidc"}}}"#,
            "iam.tokens (gcp)",
        ),
        (r#""mcp":{"github":{}}"#, "mcp"),
    ] {
        let body = format!(r#"{{"templateID":"base",{extra}}}"#);
        let a = node
            .refuses("POST", "/v2/sandboxes", &body, StatusCode::BAD_REQUEST)
            .await;
        let message = a.json["message"].as_str().unwrap();
        assert!(message.starts_with(field), "{extra}: {message}");
    }
    for (method, path) in [("GET", "/secrets"), ("POST", "/secrets/s1")] {
        let a = node
            .refuses(method, path, "{}", StatusCode::FORBIDDEN)
            .await;
        assert!(
            a.json["message"]
                .as_str()
                .unwrap()
                .contains("not available")
        );
    }
    // A token without its type is malformed, as E2B's schema says.
    node.refuses(
        "POST",
        "/v2/sandboxes",
        r#"{"iam":{"tokens":{"gcp":{"audience":"x"}}}}"#,
        StatusCode::BAD_REQUEST,
    )
    .await;
    for extra in [
        r#""autoResume":{"enabled":false}"#,
        r#""iam":{"tokens":{}}"#,
        r#""iam":{}"#,
        r#""volumeMounts":[]"#,
        r#""mcp":null"#,
    ] {
        let body = format!(r#"{{"templateID":"base",{extra}}}"#);
        let a = node.authed("POST", "/v2/sandboxes", &body).await;
        // Past the request's checks (it fails later: this node has no VMM).
        assert_ne!(a.status, StatusCode::BAD_REQUEST, "{extra}: {}", a.json);
    }
}

/// E2B's `pauseMode`: what a paused sandbox's pause saved; absent while
/// it runs.
#[tokio::test]
async fn a_paused_sandbox_says_what_its_pause_saved() {
    let now = now_ms();
    let full = SandboxRecord {
        snapshot: Some(server::node::store::PausedSnapshot {
            state: "/nonexistent/vm.state".into(),
            mem: "/nonexistent/vm.mem".into(),
        }),
        ..record("withmem", now, SandboxState::Paused, "x")
    };
    let node = node(&[
        full,
        record("diskonly", now, SandboxState::Paused, "x"),
        record("live", now, SandboxState::Running, "x"),
    ]);
    for (id, mode) in [
        ("withmem", Value::from("full")),
        ("diskonly", Value::from("filesystem")),
        ("live", Value::Null),
    ] {
        let a = node.authed("GET", &format!("/sandboxes/{id}"), "").await;
        assert_eq!(a.json["pauseMode"], mode, "{id}: {}", a.json);
    }
}

/// A create of the code interpreter while its build runs waits a while,
/// then is told to come back (503, `Retry-After`, `Should-Retry: true`):
/// the build takes minutes, the SDKs give up on a request after 60 s.
#[tokio::test]
async fn a_create_of_a_builtin_being_built_is_told_when_to_come_back() {
    let node = node_configured(&[], &[], |c, store| {
        c.builtin_wait = std::time::Duration::from_millis(200);
        store
            .put_build(&build_record(
                "tplci",
                "code-interpreter",
                BuildStatus::Building,
                now_ms() - 90_000,
            ))
            .unwrap();
    });
    for template in ["code-interpreter", "code-interpreter-v1"] {
        let body = format!(r#"{{"templateID":"{template}"}}"#);
        let refused = node.refuses(
            "POST",
            "/v2/sandboxes",
            &body,
            StatusCode::SERVICE_UNAVAILABLE,
        );
        let a = tokio::time::timeout(std::time::Duration::from_secs(20), refused)
            .await
            .expect("a create waits on the build a bounded time");
        let message = a.json["message"].as_str().unwrap();
        assert!(message.contains("being built (9"), "{message}");
        assert_eq!(a.headers["retry-after"], "20");
        assert_eq!(a.headers["should-retry"], "true");
    }
}

#[tokio::test]
async fn template_builds_check_their_input() {
    let paused = record("sleepy", now_ms(), SandboxState::Paused, "x");
    let running = record("awake", now_ms(), SandboxState::Running, "x");
    let node = node_configured(
        &[paused, running],
        &[&|d| built(d, "tpl1", "taken", 1)],
        |c, _| c.agent = Some(common::BUSYBOX.into()),
    );
    let empty_dir = node.dir.path().join("empty");
    std::fs::create_dir_all(&empty_dir).unwrap();
    let post = |body: String| authed("POST", "/templates", &body);
    let cases: Vec<(String, StatusCode, &str)> = vec![
        ("{}".into(), StatusCode::BAD_REQUEST, "name"),
        (
            r#"{"name":"x"}"#.into(),
            StatusCode::BAD_REQUEST,
            "exactly one",
        ),
        (
            r#"{"name":"Bad Name","from":{"debian_packages":["jq"]}}"#.into(),
            StatusCode::BAD_REQUEST,
            "lowercase",
        ),
        (
            r#"{"name":"x","from":{"debian_packages":[]}}"#.into(),
            StatusCode::BAD_REQUEST,
            "at least one",
        ),
        (
            r#"{"name":"x","from":{"debian_packages":["jq;rm"]}}"#.into(),
            StatusCode::BAD_REQUEST,
            "jq;rm",
        ),
        (
            r#"{"name":"x","from":{"oci_layout":"rel/dir"}}"#.into(),
            StatusCode::BAD_REQUEST,
            "absolute",
        ),
        (
            r#"{"name":"x","from":{"oci_layout":"/nonexistent/img"}}"#.into(),
            StatusCode::BAD_REQUEST,
            "no such file",
        ),
        (
            format!(
                r#"{{"name":"x","from":{{"oci_layout":"{}"}}}}"#,
                empty_dir.display()
            ),
            StatusCode::BAD_REQUEST,
            "index.json",
        ),
        (
            format!(
                r#"{{"name":"x","from":{{"docker_archive":"{}"}}}}"#,
                empty_dir.display()
            ),
            StatusCode::BAD_REQUEST,
            "not a file",
        ),
        (
            r#"{"name":"x","from":{"sandbox":"nosuch"}}"#.into(),
            StatusCode::NOT_FOUND,
            "nosuch",
        ),
        (
            r#"{"name":"x","from":{"sandbox":"sleepy"}}"#.into(),
            StatusCode::CONFLICT,
            "paused",
        ),
        (
            r#"{"name":"x","from":{"sandbox":"awake"},"memory_mb":512}"#.into(),
            StatusCode::BAD_REQUEST,
            "keeps",
        ),
        (
            r#"{"name":"x","from":{"debian_packages":["jq"]},"vcpus":0}"#.into(),
            StatusCode::BAD_REQUEST,
            "vcpus",
        ),
        (
            r#"{"name":"x","from":{"debian_packages":["jq"]},"memory_mb":100000}"#.into(),
            StatusCode::BAD_REQUEST,
            "memory_mb",
        ),
        (
            r#"{"name":"taken","from":{"debian_packages":["jq"]}}"#.into(),
            StatusCode::CONFLICT,
            "taken",
        ),
        (
            r#"{"name":"base","from":{"debian_packages":["jq"]}}"#.into(),
            StatusCode::CONFLICT,
            "base",
        ),
    ];
    for (body, status, says) in cases {
        let a = call(&node, post(body.clone())).await;
        assert_error(&a, status);
        let message = a.json["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
    }
    // Nothing was recorded by any of them.
    assert!(node.manager.store().builds().unwrap().is_empty());

    // Without an agent binary the node cannot build images.
    let no_agent = node_with(&[], &[]);
    let layout_dir = tempfile::tempdir().unwrap();
    let layout = common::busybox_oci_layout(layout_dir.path());
    let a = call(
        &no_agent,
        post(format!(
            r#"{{"name":"x","from":{{"oci_layout":"{}"}}}}"#,
            layout.display()
        )),
    )
    .await;
    assert_error(&a, StatusCode::SERVICE_UNAVAILABLE);
}

/// An image build boots a VM: one that does not fit in the node's memory or
/// vCPUs is refused with 503 like a sandbox, and nothing is recorded or held.
#[tokio::test]
async fn a_template_build_that_does_not_fit_answers_503() {
    let node = small_node(|c| {
        c.capacity.memory_mib = Some(200);
        c.agent = Some(common::BUSYBOX.into());
    });
    let body = r#"{"name":"x","from":{"debian_packages":["jq"]}}"#;
    let a = node.authed("POST", "/templates", body).await;
    assert_error(&a, StatusCode::SERVICE_UNAVAILABLE);
    let message = a.json["message"].as_str().unwrap();
    assert!(
        message.contains("not enough memory for a template build: it needs 256 MiB, 200 MiB"),
        "{message}"
    );
    let body = r#"{"name":"x","from":{"debian_packages":["jq"]},"vcpus":3,"memory_mb":128}"#;
    let a = node.authed("POST", "/templates", body).await;
    assert_error(&a, StatusCode::SERVICE_UNAVAILABLE);
    let message = a.json["message"].as_str().unwrap();
    assert!(
        message.contains("not enough vCPUs for a template build: it needs 3 vCPUs"),
        "{message}"
    );
    assert!(node.manager.store().builds().unwrap().is_empty());
    assert_holds_nothing(&node_info(&node).await);
}

/// Polls the build's status until it is no longer `building`.
async fn wait_for_build(node: &Node, id: &str, build: &str) -> Value {
    let uri = format!("/templates/{id}/builds/{build}/status");
    for _ in 0..600 {
        let a = call(node, authed("GET", &uri, "")).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.json);
        if a.json["status"] != "building" {
            return a.json;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("build {id} still building after a minute");
}

/// The real builder makes the image's root filesystem on the host; booting
/// it fails here (no VMM), and the build says so with its log.
#[tokio::test]
async fn an_image_build_that_cannot_boot_ends_in_error_with_its_log() {
    let cache = tempfile::tempdir().unwrap();
    let layout_dir = tempfile::tempdir().unwrap();
    let layout = common::busybox_oci_layout(layout_dir.path());
    let node = node_configured(&[], &[], |c, _| {
        c.agent = Some(common::BUSYBOX.into());
        c.build_cache = Some(cache.path().to_owned());
    });
    let body = format!(
        r#"{{"name":"bb","from":{{"oci_layout":"{}"}},"start_cmd":"sleep 1000","memory_mb":384}}"#,
        layout.display()
    );
    let a = node.authed("POST", "/templates", &body).await;
    assert_eq!(a.status, StatusCode::ACCEPTED, "{}", a.json);
    assert_eq!(a.json["status"], "building");
    assert_eq!(a.json["names"], serde_json::json!(["bb"]));
    let id = a.json["templateID"].as_str().unwrap().to_owned();
    let build = a.json["buildID"].as_str().unwrap().to_owned();

    // While it builds the name is taken.
    let again = node.authed("POST", "/templates", &body).await;
    let listed = node.authed("GET", "/templates", "").await;
    let mine = listed
        .json
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["templateID"] == id.as_str())
        .cloned()
        .unwrap();
    assert_eq!(mine["memoryMB"], 384);
    if mine["buildStatus"] == "building" {
        // Its VM's memory and vCPUs are held while it builds.
        let info = node_info(&node).await;
        if info["memoryMB"]["used"] != 0 {
            assert_eq!(info["memoryMB"]["used"], 384, "{info}");
            assert_eq!(info["vcpus"]["used"], 1, "{info}");
            assert_eq!(info["sandboxes"]["starting"], 0, "{info}");
        }
        assert_error(&again, StatusCode::CONFLICT);
        node.refuses(
            "DELETE",
            &format!("/templates/{id}"),
            "",
            StatusCode::CONFLICT,
        )
        .await;
    }

    let status = wait_for_build(&node, &id, &build).await;
    assert_eq!(status["status"], "error", "{status}");
    let reason = status["reason"]["message"].as_str().unwrap();
    assert!(
        reason.contains("VMM") || reason.contains("sandfork-vmm"),
        "{reason}"
    );
    // The failed build gave its room back.
    assert_holds_nothing(&node_info(&node).await);
    let logs: Vec<&str> = status["logs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    assert!(
        logs.iter()
            .any(|l| l.contains("building the root filesystem")),
        "{logs:?}"
    );
    assert!(
        logs.iter().any(|l| l.starts_with("root filesystem ")),
        "{logs:?}"
    );
    assert!(logs.last().unwrap().starts_with("error: "), "{logs:?}");
    // The image is in the build cache; no template files are left behind.
    let cached: Vec<_> = std::fs::read_dir(cache.path().join("templates"))
        .unwrap()
        .flatten()
        .filter(|e| e.path().join("rootfs.ext4").is_file())
        .collect();
    assert_eq!(cached.len(), 1);
    let leftovers: Vec<_> = std::fs::read_dir(node.dir.path().join("templates"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    // The offset skips lines; a wrong build id is not found.
    let skipped = call(
        &node,
        authed(
            "GET",
            &format!("/templates/{id}/builds/{build}/status?logsOffset=1"),
            "",
        ),
    )
    .await;
    assert_eq!(
        skipped.json["logs"].as_array().unwrap().len(),
        logs.len() - 1
    );
    assert_error(
        &call(
            &node,
            authed("GET", &format!("/templates/{id}/builds/other/status"), ""),
        )
        .await,
        StatusCode::NOT_FOUND,
    );
    assert!(node.manager.store().template(&id).unwrap().is_none());

    // A failed build does not hold its name, and goes when deleted.
    let gone = node.authed("DELETE", "/templates/bb", "").await;
    assert_eq!(gone.status, StatusCode::NO_CONTENT, "{}", gone.json);
    assert!(node.manager.store().build(&id).unwrap().is_none());
    assert_error(
        &call(
            &node,
            authed("GET", &format!("/templates/{id}/builds/{build}/status"), ""),
        )
        .await,
        StatusCode::NOT_FOUND,
    );
}

#[tokio::test]
async fn templates_are_listed_and_deleted_with_their_files_kept_for_their_users() {
    let user = SandboxRecord {
        template_id: "tpl1".into(),
        uses_snapshots: vec!["tpl1".into()],
        ..record("user1", now_ms(), SandboxState::Paused, "x")
    };
    let node = node_configured(
        &[user],
        &[&|d| built(d, "tpl1", "web", 2_000), &|d| {
            snapshot(d, "snap1", "src", 1_000)
        }],
        |_, store| {
            store
                .put_build(&build_record("tpl1", "web", BuildStatus::Ready, 1_500))
                .unwrap();
            store
                .put_build(&build_record("tpl2", "slow", BuildStatus::Building, 3_000))
                .unwrap();
            store
                .put_build(&build_record("tpl3", "broken", BuildStatus::Error, 4_000))
                .unwrap();
        },
    );
    let a = node.authed("GET", "/templates", "").await;
    assert_eq!(a.status, StatusCode::OK);
    let all = a.json.as_array().unwrap();
    let row = |i: usize| {
        let t = &all[i];
        (
            t["templateID"].as_str().unwrap(),
            t["kind"].as_str().unwrap(),
            t["buildStatus"].as_str().unwrap(),
        )
    };
    assert_eq!(
        (0..all.len()).map(row).collect::<Vec<_>>(),
        [
            ("base", "base", "ready"),
            ("snap1", "snapshot", "ready"),
            ("tpl1", "built", "ready"),
            ("tpl2", "built", "building"),
            ("tpl3", "built", "error")
        ]
    );
    let web = &all[2];
    assert_eq!(web["names"], serde_json::json!(["web"]));
    assert_eq!(web["aliases"], serde_json::json!(["web"]));
    assert_eq!(
        (web["cpuCount"].as_u64(), web["memoryMB"].as_u64()),
        (Some(2), Some(512))
    );
    assert_eq!(web["buildID"], "build-tpl1");
    assert!(
        web["createdAt"]
            .as_str()
            .unwrap()
            .starts_with("1970-01-01T00:00:02")
    );
    let one = node.authed("GET", "/templates/web", "").await;
    assert_eq!(one.json["templateID"], "tpl1");
    // The E2B CLI's `template list` names its team; `template unpublish`
    // and `publish` patch the template (this node publishes nothing).
    let by_team = node.authed("GET", "/templates?teamID=t1", "").await;
    assert_eq!(by_team.json.as_array().map(Vec::len), Some(all.len()));
    let patch = |id: &str, body: &str| authed("PATCH", &format!("/v2/templates/{id}"), body);
    let private = call(&node, patch("web", r#"{"public":false}"#)).await;
    assert_eq!(
        (private.status, private.json.clone()),
        (StatusCode::OK, serde_json::json!({"names": ["web"]}))
    );
    let public = call(&node, patch("tpl1", r#"{"public":true}"#)).await;
    assert_error(&public, StatusCode::BAD_REQUEST);
    assert!(public.json["message"].as_str().unwrap().contains("publish"));
    assert_error(
        &call(&node, patch("nosuch", r#"{"public":false}"#)).await,
        StatusCode::NOT_FOUND,
    );
    assert_error(
        &call(&node, patch("web", r#"{"public":"yes"}"#)).await,
        StatusCode::BAD_REQUEST,
    );
    node.refuses("GET", "/templates/nosuch", "", StatusCode::NOT_FOUND)
        .await;
    let s = call(
        &node,
        authed("GET", "/templates/tpl3/builds/build-tpl3/status", ""),
    )
    .await;
    assert_eq!(
        (
            s.json["status"].as_str(),
            s.json["reason"]["message"].as_str()
        ),
        (Some("error"), Some("apt failed"))
    );
    assert_eq!(s.json["logs"], serde_json::json!(["line 1", "line 2"]));

    node.refuses("DELETE", "/templates/base", "", StatusCode::BAD_REQUEST)
        .await;
    let building = node.authed("DELETE", "/templates/slow", "").await;
    assert_error(&building, StatusCode::CONFLICT);
    assert!(building.json["message"].as_str().unwrap().contains("build"));
    // Deleted while a sandbox stacks on it: the name goes at once, the
    // files when the sandbox does.
    let dir = node.dir.path().join("templates/tpl1");
    let gone = node.authed("DELETE", "/templates/web", "").await;
    assert_eq!(gone.status, StatusCode::NO_CONTENT, "{}", gone.json);
    assert!(dir.is_dir());
    node.refuses("GET", "/templates/web", "", StatusCode::NOT_FOUND)
        .await;
    node.manager.kill("user1").await.unwrap();
    let gc = node.manager.collect_garbage().await.unwrap();
    assert_eq!(gc.templates, ["tpl1"], "{gc:?}");
    assert!(!dir.exists());
    assert!(node.manager.store().build("tpl1").unwrap().is_none());
    let broken = node.authed("DELETE", "/templates/tpl3", "").await;
    assert_eq!(broken.status, StatusCode::NO_CONTENT);
    let left: Vec<String> = call(&node, authed("GET", "/templates", ""))
        .await
        .json
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["templateID"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(left, ["base", "snap1", "tpl2"]);
}

#[tokio::test]
async fn builds_a_restart_interrupted_are_marked_error_and_their_files_go() {
    let node = node_configured(&[], &[&|d| built(d, "done1", "done", 1)], |c, store| {
        store
            .put_build(&build_record("done1", "done", BuildStatus::Building, 1))
            .unwrap();
        store
            .put_build(&build_record("cut1", "cut", BuildStatus::Building, 2))
            .unwrap();
        let t = c.templates_dir();
        for d in [".build-cut1-0a0b", "cut1"] {
            std::fs::create_dir_all(t.join(d)).unwrap();
            std::fs::write(t.join(d).join("vm.mem"), b"x").unwrap();
        }
    });
    // As a start does: the builds recovered, then the collector's pass.
    node.templates.recover().await.unwrap();
    node.manager.collect_garbage().await.unwrap();
    let store = node.manager.store();
    assert_eq!(
        store.build("done1").unwrap().unwrap().status,
        BuildStatus::Ready
    );
    let cut = store.build("cut1").unwrap().unwrap();
    assert_eq!(cut.status, BuildStatus::Error);
    assert!(cut.reason.unwrap().contains("restart"));
    let t = node.dir.path().join("templates");
    assert!(!t.join(".build-cut1-0a0b").exists());
    assert!(!t.join("cut1").exists());
    assert!(t.join("done1").is_dir());
}

/// A fork of a paused sandbox seals its root layer and branches it before
/// any child starts: the sandbox stays paused on a new layer of its own with
/// the same content. Here no child can start (no VMM binary): each answers
/// its error, their directories go, and nothing stays reserved.
#[tokio::test]
async fn a_paused_fork_branches_the_disk_and_reports_each_child() {
    let now = now_ms();
    let node = node_configured(&[], &[], |c, store| {
        c.capacity.vcpus = Some(8);
        c.capacity.memory_mib = Some(4096);
        c.capacity.min_free_disk_mib = 0;
        let dir = c.sandboxes_dir().join("held");
        std::fs::create_dir_all(&dir).unwrap();
        let base = c.data_dir.join("base.img");
        std::fs::File::create(&base)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let disk = disk_layers::LayeredDisk::create(&base, &dir.join("root.layer")).unwrap();
        disk.write_at(b"paused state", 4096).unwrap();
        disk.flush().unwrap();
        let held = SandboxRecord {
            snapshot: Some(PausedSnapshot {
                state: dir.join("pause-1.state"),
                mem: dir.join("pause-1.mem"),
            }),
            pause_generation: 1,
            uses_dirs: vec![dir],
            ..record("held", now, SandboxState::Paused, "x")
        };
        store.put_sandbox(&held).unwrap();
    });
    let a = call(
        &node,
        authed("POST", "/sandboxes/held/fork", r#"{"count":2}"#),
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.json);
    let results = a.json.as_array().unwrap();
    assert_eq!(results.len(), 2);
    for r in results {
        assert_eq!(r["error"]["code"], 500, "{r}");
    }
    let held = node.manager.get("held").unwrap();
    assert_eq!(held.state, SandboxState::Paused);
    assert!(held.has_dependents);
    let sandboxes = node.dir.path().join("sandboxes");
    let old = sandboxes.join("held").join("root.layer");
    let top = held.root_layer.clone().expect("a new layer");
    assert_eq!(top.parent(), old.parent());
    assert!(disk_layers::LayeredDisk::open(&old).unwrap().is_read_only());
    let disk = disk_layers::LayeredDisk::open(&top).unwrap();
    assert!(!disk.is_read_only());
    let mut buf = [0u8; 12];
    disk.read_at(&mut buf, 4096).unwrap();
    assert_eq!(&buf, b"paused state");
    let dirs: Vec<_> = std::fs::read_dir(&sandboxes)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(dirs, ["held"], "the failed children's directories go");
    assert_holds_nothing(&node_info(&node).await);
}

// Tenants: teams, their keys, what each team sees, limits and the rate.

/// A request with `key`.
fn keyed(key: &str, method: &str, uri: &str, body: &str) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("x-api-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

/// Makes team `body` (its JSON) through the admin route and a key of it:
/// (team id, key).
async fn team(node: &Node, body: &str) -> (String, String) {
    let a = call(node, authed("POST", "/admin/teams", body)).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.json);
    let id = a.json["teamID"].as_str().unwrap().to_owned();
    let a = call(
        node,
        authed(
            "POST",
            &format!("/admin/teams/{id}/keys"),
            r#"{"name":"t"}"#,
        ),
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.json);
    (id, a.json["key"].as_str().unwrap().to_owned())
}

/// `r` owned by `team`.
fn owned(team: &str, r: SandboxRecord) -> SandboxRecord {
    SandboxRecord {
        team: Some(team.into()),
        ..r
    }
}

#[tokio::test]
async fn teams_and_keys_are_made_by_the_admin_and_a_revoked_key_is_refused() {
    let node = node(&[]);
    let (team_id, key) = team(&node, r#"{"name":"research","maxSandboxes":3}"#).await;
    assert!(team_id.starts_with("team_"));
    let hex = key.strip_prefix("e2b_").unwrap();
    assert_eq!(hex.len(), 40);
    assert!(
        hex.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    );
    // The key works on the control plane, not on the admin routes.
    let a = call(&node, keyed(&key, "GET", "/v2/sandboxes", "")).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json);
    for (method, uri) in [
        ("GET", "/admin/teams"),
        ("POST", "/admin/teams"),
        ("GET", "/admin/teams/research/keys"),
        ("POST", "/admin/teams/research/keys"),
        ("PATCH", "/admin/teams/research"),
    ] {
        let a = call(&node, keyed(&key, method, uri, r#"{"name":"x"}"#)).await;
        assert_error(&a, StatusCode::FORBIDDEN);
    }
    // Listed by name or id, with its limits and use, the key masked.
    let a = node.authed("GET", "/admin/teams", "").await;
    assert_eq!(a.json[0]["teamID"], "default");
    assert_eq!(a.json[1]["name"], "research");
    assert_eq!(a.json[1]["limits"]["maxSandboxes"], 3);
    assert_eq!(a.json[1]["usage"]["sandboxes"], 0);
    assert_eq!(a.json[1]["keys"], 1);
    let keys = node.authed("GET", "/admin/teams/research/keys", "").await;
    assert_eq!(keys.status, StatusCode::OK);
    let listed = keys.json.to_string();
    assert!(!listed.contains(hex), "{listed}");
    assert_eq!(
        keys.json[0]["mask"],
        format!("e2b_{}…{}", &hex[..4], &hex[36..])
    );
    let key_id = keys.json[0]["keyID"].as_str().unwrap().to_owned();
    // Names are unique and checked; unknown teams are 404.
    assert_error(
        &call(
            &node,
            authed("POST", "/admin/teams", r#"{"name":"research"}"#),
        )
        .await,
        StatusCode::CONFLICT,
    );
    for bad in [
        r#"{"name":""}"#,
        r#"{"name":"a b"}"#,
        r#"{}"#,
        r#"{"name":"x","max":1}"#,
    ] {
        node.refuses("POST", "/admin/teams", bad, StatusCode::BAD_REQUEST)
            .await;
    }
    node.refuses(
        "POST",
        "/admin/teams/nosuch/keys",
        "{}",
        StatusCode::NOT_FOUND,
    )
    .await;
    // Only the key's hash is in the store.
    let store = std::fs::read(node.dir.path().join("s.redb")).unwrap();
    assert!(!store.windows(hex.len()).any(|w| w == hex.as_bytes()));
    // Revoked: its next request is 401; the node's own key goes on.
    let a = call(
        &node,
        authed("DELETE", &format!("/admin/keys/{key_id}"), ""),
    )
    .await;
    assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.json);
    assert_error(
        &call(&node, keyed(&key, "GET", "/v2/sandboxes", "")).await,
        StatusCode::UNAUTHORIZED,
    );
    assert_error(
        &call(
            &node,
            authed("DELETE", &format!("/admin/keys/{key_id}"), ""),
        )
        .await,
        StatusCode::NOT_FOUND,
    );
    assert_eq!(
        node.authed("GET", "/v2/sandboxes", "").await.status,
        StatusCode::OK
    );
    // A node started again on the store knows the team and its other keys.
    let (_, kept) = team(&node, r#"{"name":"other"}"#).await;
    let again = ApiKeys::for_key(KEY);
    again.load(node.manager.store()).unwrap();
    assert!(again.accepts(&kept));
    assert!(!again.accepts(&key));
    assert_eq!(again.team("research").unwrap().id, team_id);
}

/// Each sandbox route, with a body it accepts.
const SANDBOX_ROUTES: &[(&str, &str, &str)] = &[
    ("GET", "/sandboxes/{id}", ""),
    ("DELETE", "/sandboxes/{id}", ""),
    ("POST", "/sandboxes/{id}/timeout", r#"{"timeout":30}"#),
    ("POST", "/sandboxes/{id}/refreshes", "{}"),
    ("POST", "/sandboxes/{id}/pause", "{}"),
    ("POST", "/sandboxes/{id}/resume", "{}"),
    ("POST", "/sandboxes/{id}/connect", "{}"),
    ("POST", "/v2/sandboxes/{id}/connect", "{}"),
    ("POST", "/sandboxes/{id}/fork", "{}"),
    (
        "PUT",
        "/sandboxes/{id}/network",
        r#"{"allowInternetAccess":false}"#,
    ),
    ("POST", "/sandboxes/{id}/snapshots", "{}"),
    ("GET", "/sandboxes/{id}/metrics", ""),
    ("GET", "/sandboxes/{id}/logs", ""),
    ("GET", "/v2/sandboxes/{id}/logs", ""),
    ("GET", "/v1/sandboxes/{id}/diagnostics", ""),
];

#[tokio::test]
async fn another_teams_sandbox_answers_as_an_unknown_one_on_every_route() {
    let now = now_ms();
    let node = node(&[
        record("theirs", now, SandboxState::Running, "x"),
        record("paused", now, SandboxState::Paused, "x"),
    ]);
    let (_, key) = team(&node, r#"{"name":"a"}"#).await;
    for id in ["theirs", "paused"] {
        for (method, route, body) in SANDBOX_ROUTES {
            let foreign = call(&node, keyed(&key, method, &route.replace("{id}", id), body)).await;
            let unknown = call(
                &node,
                keyed(&key, method, &route.replace("{id}", "nosuch"), body),
            )
            .await;
            assert_error(&foreign, StatusCode::NOT_FOUND);
            assert_eq!(foreign.status, unknown.status, "{method} {route}");
            assert_eq!(
                foreign.json.to_string().replace(id, "nosuch"),
                unknown.json.to_string(),
                "{method} {route}"
            );
            // The E2B client suffix (`<id>-<client>`) does not get round it.
            let suffixed = route.replace("{id}", &format!("{id}-sandfork"));
            let a = call(&node, keyed(&key, method, &suffixed, body)).await;
            assert_error(&a, StatusCode::NOT_FOUND);
        }
    }
    // Untouched: still there, same end, same network, for its own team.
    let theirs = node.manager.get("theirs").unwrap();
    assert_eq!(theirs.end_at_ms, now + 3_600_000);
    assert!(theirs.network.allow_internet_access.is_none_or(|a| a));
    assert_eq!(
        node.manager.get("paused").unwrap().state,
        SandboxState::Paused
    );
    let a = node.authed("GET", "/sandboxes/theirs", "").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json);
}

#[tokio::test]
async fn lists_hold_only_the_callers_own() {
    let node = node(&[]);
    let (a_id, a_key) = team(&node, r#"{"name":"a"}"#).await;
    let (b_id, b_key) = team(&node, r#"{"name":"b"}"#).await;
    let now = now_ms();
    for r in [
        owned(&a_id, record("a1", now, SandboxState::Running, "x")),
        owned(&a_id, record("a2", now + 1, SandboxState::Paused, "x")),
        owned(&b_id, record("b1", now + 2, SandboxState::Running, "x")),
        record("d1", now + 3, SandboxState::Running, "x"),
    ] {
        node.manager.store().put_sandbox(&r).unwrap();
    }
    let ids = |a: &Answer| -> Vec<String> {
        let mut v: Vec<String> = a
            .json
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["sandboxID"].as_str().unwrap().to_owned())
            .collect();
        v.sort();
        v
    };
    for (key, v2, v1) in [
        (a_key.as_str(), vec!["a1", "a2"], vec!["a1"]),
        (b_key.as_str(), vec!["b1"], vec!["b1"]),
        (KEY, vec!["d1"], vec!["d1"]),
    ] {
        let a = call(&node, keyed(key, "GET", "/v2/sandboxes", "")).await;
        assert_eq!(ids(&a), v2);
        let a = call(&node, keyed(key, "GET", "/sandboxes", "")).await;
        assert_eq!(ids(&a), v1);
        // Paging counts only the caller's.
        let a = call(&node, keyed(key, "GET", "/v2/sandboxes?limit=1", "")).await;
        assert_eq!(a.headers.contains_key("x-next-token"), v2.len() > 1);
    }
}

#[tokio::test]
async fn another_teams_templates_and_snapshots_answer_as_unknown_ones() {
    let snap = |d: &std::path::Path| TemplateRecord {
        names: vec!["their-snap".into()],
        ..snapshot(d, "snapa", "gone", 10)
    };
    let mine = |d: &std::path::Path| snapshot(d, "snapd", "gone", 11);
    let built_t = |d: &std::path::Path| built(d, "builta", "their-tpl", 12);
    let node = node_with(&[], &[&snap, &mine, &built_t]);
    let (a_id, a_key) = team(&node, r#"{"name":"a"}"#).await;
    let store = node.manager.store();
    for t in ["snapa", "builta"] {
        store
            .set_owner(&server::node::tenants::template_owner_key(t), Some(&a_id))
            .unwrap();
    }
    store
        .put_build(&build_record("builta", "their-tpl", BuildStatus::Ready, 12))
        .unwrap();
    // The default team's key: team a's are unknown, by id or name.
    for (method, route, body) in [
        ("GET", "/templates/{id}", ""),
        ("DELETE", "/templates/{id}", ""),
        ("GET", "/templates/{id}/builds/b-{id}/status", ""),
        ("POST", "/snapshots/{id}/fork", "{}"),
        ("POST", "/v2/templates/{id}/builds/b-{id}", "{}"),
        (
            "GET",
            &format!("/templates/{{id}}/files/{}", "a".repeat(64)),
            "",
        ),
    ] {
        for id in ["snapa", "their-snap", "builta", "their-tpl"] {
            let foreign = node.authed(method, &route.replace("{id}", id), body).await;
            let unknown = call(
                &node,
                authed(method, &route.replace("{id}", "nosuch"), body),
            )
            .await;
            assert_eq!(
                foreign.status,
                StatusCode::NOT_FOUND,
                "{method} {route} {id}: {}",
                foreign.json
            );
            assert_eq!(
                foreign.json.to_string().replace(id, "nosuch"),
                unknown.json.to_string(),
                "{method} {route} {id}"
            );
        }
    }
    // A create naming it is refused as an unknown template is.
    for id in ["snapa", "their-snap", "builta"] {
        let foreign = call(
            &node,
            authed(
                "POST",
                "/v2/sandboxes",
                &format!(r#"{{"templateID":"{id}"}}"#),
            ),
        )
        .await;
        let unknown = call(
            &node,
            authed("POST", "/v2/sandboxes", r#"{"templateID":"nosuch"}"#),
        )
        .await;
        assert_error(&foreign, StatusCode::NOT_FOUND);
        assert_eq!(
            foreign.json.to_string().replace(id, "nosuch"),
            unknown.json.to_string()
        );
    }
    // Still there for team a; the lists each see their own (and base).
    assert_eq!(
        call(&node, keyed(&a_key, "GET", "/templates/their-snap", ""))
            .await
            .status,
        StatusCode::OK
    );
    let names = |a: &Answer, key: &str| -> Vec<String> {
        let mut v: Vec<String> = a
            .json
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t[key].as_str().unwrap().to_owned())
            .collect();
        v.sort();
        v
    };
    let a = call(&node, keyed(&a_key, "GET", "/templates", "")).await;
    assert_eq!(names(&a, "templateID"), ["base", "builta", "snapa"]);
    let a = node.authed("GET", "/templates", "").await;
    assert_eq!(names(&a, "templateID"), ["base", "snapd"]);
    // E2B's default templates: the node's own, the same for every team.
    let a = call(&node, keyed(&a_key, "GET", "/default-templates", "")).await;
    assert_eq!(names(&a, "templateID"), ["base"]);
    let a = node.authed("GET", "/default-templates", "").await;
    assert_eq!(names(&a, "templateID"), ["base"]);
    let a = call(&node, keyed(&a_key, "GET", "/snapshots", "")).await;
    assert_eq!(names(&a, "snapshotID"), ["snapa"]);
    let a = node.authed("GET", "/snapshots", "").await;
    assert_eq!(names(&a, "snapshotID"), ["snapd"]);
    // Every team may start from base: team a's create gets past the
    // template (and fails later: this node has no VMM).
    let a = call(
        &node,
        keyed(&a_key, "POST", "/v2/sandboxes", r#"{"templateID":"base"}"#),
    )
    .await;
    assert_ne!(a.status, StatusCode::NOT_FOUND, "{}", a.json);
    // A template build from another team's sandbox is refused as from an unknown one.
    node.manager
        .store()
        .put_sandbox(&record("dsb", now_ms(), SandboxState::Running, "x"))
        .unwrap();
    let body = |id: &str| format!(r#"{{"name":"t-{id}","from":{{"sandbox":"{id}"}}}}"#);
    let foreign = call(&node, keyed(&a_key, "POST", "/templates", &body("dsb"))).await;
    assert_error(&foreign, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn team_limits_refuse_creates_and_forks_with_e2bs_429() {
    let node = small_node(|_| ());
    let (a_id, a_key) = team(&node, r#"{"name":"a","maxSandboxes":0}"#).await;
    let a = call(&node, keyed(&a_key, "POST", "/v2/sandboxes", "{}")).await;
    assert_error(&a, StatusCode::TOO_MANY_REQUESTS);
    let message = a.json["message"].as_str().unwrap();
    assert!(
        message.contains("maximum number of concurrent sandboxes (0)"),
        "{message}"
    );
    // Memory: the base template's 256 MiB is over 100.
    let a = call(
        &node,
        authed(
            "PATCH",
            "/admin/teams/a",
            r#"{"maxSandboxes":null,"maxMemoryMB":100}"#,
        ),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json);
    assert!(a.json["limits"].get("maxSandboxes").is_none(), "{}", a.json);
    let a = call(&node, keyed(&a_key, "POST", "/v2/sandboxes", "{}")).await;
    assert_error(&a, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        a.json["message"]
            .as_str()
            .unwrap()
            .contains("memory limit of your team (100 MiB)"),
        "{}",
        a.json
    );
    // A fork of one of its sandboxes counts its children.
    node.manager
        .store()
        .put_sandbox(&owned(
            &a_id,
            record("arun", now_ms(), SandboxState::Running, "x"),
        ))
        .unwrap();
    call(
        &node,
        authed(
            "PATCH",
            "/admin/teams/a",
            r#"{"maxMemoryMB":null,"maxSandboxes":1}"#,
        ),
    )
    .await;
    let a = call(
        &node,
        keyed(&a_key, "POST", "/sandboxes/arun/fork", r#"{"count":2}"#),
    )
    .await;
    assert_error(&a, StatusCode::TOO_MANY_REQUESTS);
    // Other teams are not held back by it; nor is team a once raised (the
    // create then gets as far as this node goes without a VMM).
    for key in [KEY, a_key.as_str()] {
        if key != KEY {
            call(
                &node,
                authed("PATCH", "/admin/teams/a", r#"{"maxSandboxes":5}"#),
            )
            .await;
        }
        let a = call(&node, keyed(key, "POST", "/v2/sandboxes", "{}")).await;
        assert_ne!(a.status, StatusCode::TOO_MANY_REQUESTS, "{}", a.json);
    }
    // The default team has limits too when set.
    call(
        &node,
        authed("PATCH", "/admin/teams/default", r#"{"maxSandboxes":0}"#),
    )
    .await;
    let a = node.authed("POST", "/v2/sandboxes", "{}").await;
    assert_error(&a, StatusCode::TOO_MANY_REQUESTS);
    // Nothing stays held.
    assert_holds_nothing(&node_info(&node).await);
}

#[tokio::test]
async fn each_key_is_rate_limited_with_a_429_and_retry_after() {
    let node = node_keyed(
        &[],
        &[],
        |_, _| (),
        ApiKeys::for_key(KEY).with_rate_limit(5),
    );
    let (_, key) = team(&node, r#"{"name":"a"}"#).await;
    let (_, fast) = team(&node, r#"{"name":"f","requestsPerSecond":1000}"#).await;
    // The burst is twice the rate; the node's key used 4 above.
    let mut ok = 0;
    let mut refused = None;
    for _ in 0..20 {
        let a = call(&node, keyed(&key, "GET", "/v2/sandboxes", "")).await;
        if a.status == StatusCode::OK {
            ok += 1;
        } else {
            refused = Some(a);
            break;
        }
    }
    // Ten at once (one more if the loop took over 200 ms).
    assert!((10..=11).contains(&ok), "{ok}");
    let refused = refused.unwrap();
    assert_error(&refused, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        refused.json["message"]
            .as_str()
            .unwrap()
            .contains("rate limit")
    );
    let retry: u64 = refused.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=2).contains(&retry), "{retry}");
    // Other keys have their own buckets; a team may have a higher rate.
    for _ in 0..50 {
        let a = call(&node, keyed(&fast, "GET", "/v2/sandboxes", "")).await;
        assert_eq!(a.status, StatusCode::OK);
    }
    // Wrong keys are 401, not counted against anyone.
    assert_error(
        &call(&node, keyed("e2b_00", "GET", "/v2/sandboxes", "")).await,
        StatusCode::UNAUTHORIZED,
    );
}

#[tokio::test]
async fn e2b_builds_wait_across_a_restart_and_their_tags_move() {
    let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let node = node_configured(
        &[],
        &[
            &|d| TemplateRecord {
                names: names(&["web", "tplw", "web:v1", "tplw:v1"]),
                ..built(d, "tplw", "web", 1)
            },
            &|d| TemplateRecord {
                names: names(&["web:old", "tplw:old"]),
                ..built(d, "tplw2", "web", 2)
            },
        ],
        |_, store| {
            for (id, status, at) in [
                ("tplw", BuildStatus::Ready, 1),
                ("tplw2", BuildStatus::Ready, 2),
                ("tplw3", BuildStatus::Waiting, 3),
            ] {
                let mut b = build_record(id, "web", status, at);
                if status == BuildStatus::Waiting {
                    b.log.clear();
                }
                b.e2b = Some(E2bBuild {
                    template_id: "tplw".into(),
                    tags: vec!["default".into()],
                });
                store.put_build(&b).unwrap();
            }
        },
    );
    // As after a restart: the waiting build waits on.
    node.templates.recover().await.unwrap();
    let s = call(
        &node,
        authed("GET", "/templates/tplw/builds/build-tplw3/status", ""),
    )
    .await;
    assert_eq!(
        (s.status, &s.json["status"]),
        (StatusCode::OK, &Value::from("waiting"))
    );
    assert_eq!(s.json["logEntries"], serde_json::json!([]));
    let link = call(
        &node,
        Request::builder()
            .uri(format!("/templates/tplw/files/{}", "ab".repeat(32)))
            .header("x-api-key", KEY)
            .header("host", "127.0.0.1:3000")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(link.status, StatusCode::CREATED, "{}", link.json);

    // Another build of the name: the same template, a new build.
    let r = call(
        &node,
        authed("POST", "/v3/templates", r#"{"name":"Web:v2"}"#),
    )
    .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.json);
    assert_eq!(r.json["templateID"], "tplw");
    assert_eq!(r.json["tags"], serde_json::json!(["v2"]));
    assert_ne!(r.json["buildID"], "build-tplw3");
    let r = node
        .authed("POST", "/v3/templates", r#"{"name":"base"}"#)
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST);

    let a = node.authed("GET", "/templates/aliases/web", "").await;
    assert_eq!(
        (a.status, &a.json["templateID"]),
        (StatusCode::OK, &Value::from("tplw"))
    );
    let a = node.authed("GET", "/templates/aliases/nope", "").await;
    assert_error(&a, StatusCode::NOT_FOUND);

    let tags = |node| async move {
        let t = call(node, authed("GET", "/templates/tplw/tags", "")).await;
        assert_eq!(t.status, StatusCode::OK, "{}", t.json);
        t.json
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                format!(
                    "{}={}",
                    t["tag"].as_str().unwrap(),
                    t["buildID"].as_str().unwrap()
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        tags(&node).await,
        ["default=build-tplw", "old=build-tplw2", "v1=build-tplw"]
    );
    // The tag reads of E2B's 2.63 client.
    let count = node.authed("GET", "/templates/web/tags/count", "").await;
    assert_eq!(
        count.json,
        serde_json::json!({"total": 3}),
        "{}",
        count.json
    );
    node.refuses(
        "GET",
        "/templates/nope/tags/count",
        "",
        StatusCode::NOT_FOUND,
    )
    .await;
    let exists = node
        .authed("GET", "/templates/tplw/tags/exists?tag=V1", "")
        .await;
    assert_eq!(
        exists.json,
        serde_json::json!({"exists": true, "normalizedTag": "v1"})
    );
    let exists = node
        .authed("GET", "/templates/tplw/tags/exists?tag=v9", "")
        .await;
    assert_eq!(exists.json["exists"], false);
    for bad in ["", "?tag=", "?tag=a%20b"] {
        let uri = format!("/templates/tplw/tags/exists{bad}");
        node.refuses("GET", &uri, "", StatusCode::BAD_REQUEST).await;
    }
    let group_tags = |a: &Answer| {
        a.json["tags"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["tag"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let first = node
        .authed(
            "GET",
            "/templates/tplw/tags/groups?sort=name_asc&tagsLimit=2",
            "",
        )
        .await;
    assert_eq!(group_tags(&first), ["default", "old"], "{}", first.json);
    assert_eq!(first.json["nextCursor"], "2");
    assert_eq!(first.json["tags"][1]["hasMore"], false);
    assert_eq!(
        first.json["tags"][1]["assignments"][0]["buildId"],
        "build-tplw2"
    );
    let rest = node
        .authed(
            "GET",
            "/templates/tplw/tags/groups?sort=name_asc&tagsLimit=2&tagsCursor=2",
            "",
        )
        .await;
    assert_eq!(group_tags(&rest), ["v1"]);
    assert_eq!(rest.json["nextCursor"], Value::Null);
    let found = node
        .authed("GET", "/templates/tplw/tags/groups?search=OL", "")
        .await;
    assert_eq!(group_tags(&found), ["old"]);
    for bad in [
        "sort=newest",
        "tagsLimit=0",
        "tagsLimit=101",
        "tagsCursor=x",
    ] {
        let uri = format!("/templates/tplw/tags/groups?{bad}");
        node.refuses("GET", &uri, "", StatusCode::BAD_REQUEST).await;
    }
    let v1 = node
        .authed("GET", "/templates/web/tags/v1/assignments", "")
        .await;
    let data = v1.json["data"].as_array().unwrap();
    assert_eq!(data.len(), 1, "{}", v1.json);
    assert_eq!(data[0]["buildId"], "build-tplw");
    let id = data[0]["assignmentId"].as_str().unwrap();
    assert_eq!(
        id.split('-').map(str::len).collect::<Vec<_>>(),
        [8, 4, 4, 4, 12],
        "{id}"
    );
    assert_eq!(v1.json["nextCursor"], Value::Null);
    let none = node
        .authed("GET", "/templates/web/tags/v9/assignments", "")
        .await;
    assert_eq!(none.json["data"], serde_json::json!([]));
    // The old build takes the default tag: `web` now creates from it.
    let r = call(
        &node,
        authed(
            "POST",
            "/templates/tags",
            r#"{"target":"web:old","tags":["default"]}"#,
        ),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    assert_eq!(r.json["buildID"], "build-tplw2");
    assert_eq!(node.manager.resolve_template("web").unwrap().id, "tplw2");
    assert_eq!(node.manager.resolve_template("tplw:v1").unwrap().id, "tplw");
    let r = call(
        &node,
        authed(
            "DELETE",
            "/templates/tags",
            r#"{"name":"web","tags":["v1"]}"#,
        ),
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(
        tags(&node).await,
        ["default=build-tplw2", "old=build-tplw2"]
    );
    let r = call(
        &node,
        authed(
            "POST",
            "/templates/tags",
            r#"{"target":"nope:v1","tags":["x"]}"#,
        ),
    )
    .await;
    assert_error(&r, StatusCode::NOT_FOUND);

    let list = node.authed("GET", "/v2/templates", "").await;
    let ours: Vec<&Value> = list
        .json
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["templateID"] == "tplw")
        .collect();
    assert_eq!(ours.len(), 1, "{}", list.json);
    assert_eq!(ours[0]["buildID"], "build-tplw2");

    // Deleting the template deletes every build of it.
    let d = node.authed("DELETE", "/templates/web", "").await;
    assert_eq!(d.status, StatusCode::NO_CONTENT, "{}", d.json);
    assert!(node.manager.resolve_template("tplw:v1").is_err());
    assert!(node.manager.store().builds().unwrap().is_empty());
    let a = node.authed("GET", "/templates/aliases/web", "").await;
    assert_error(&a, StatusCode::NOT_FOUND);
}

/// E2B template `tplw` (alias `web`) on this node: its first build (default
/// tag) and a second (`v2`), ready; one building, one failed, one waiting.
fn web_builds(extra: &[(&str, BuildStatus, u64)]) -> Node {
    let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let extra = extra.to_vec();
    node_configured(
        &[],
        &[
            &|d| TemplateRecord {
                names: names(&["web", "tplw"]),
                ..built(d, "tplw", "web", 1)
            },
            &|d| TemplateRecord {
                names: names(&["web:v2", "tplw:v2"]),
                ..built(d, "tplw2", "web", 2)
            },
        ],
        move |_, store| {
            let all = [
                ("tplw", BuildStatus::Ready, 1),
                ("tplw2", BuildStatus::Ready, 2),
            ];
            for (id, status, at) in all.into_iter().chain(extra) {
                let mut b = build_record(id, "web", status, at);
                b.e2b = Some(E2bBuild {
                    template_id: "tplw".into(),
                    tags: vec!["default".into()],
                });
                store.put_build(&b).unwrap();
            }
        },
    )
}

#[tokio::test]
async fn e2b_creates_by_build_id_and_builds_that_lose_their_tags_stay() {
    let node = web_builds(&[
        ("tplw3", BuildStatus::Building, 3),
        ("tplw4", BuildStatus::Error, 4),
    ]);
    // `<alias or templateID>:<buildID>` is the template that build made.
    for (name, want) in [
        ("web:build-tplw2", "tplw2"),
        ("web:build-tplw", "tplw"),
        ("tplw:build-tplw2", "tplw2"),
    ] {
        assert_eq!(
            node.manager.resolve_template(name).unwrap().id,
            want,
            "{name}"
        );
    }
    let create = |t: &str| authed("POST", "/sandboxes", &format!(r#"{{"templateID":"{t}"}}"#));
    // A build not ready yet: E2B's words, which Harbor waits on.
    let a = call(&node, create("web:build-tplw3")).await;
    assert_error(&a, StatusCode::NOT_FOUND);
    let m = a.json["message"].as_str().unwrap();
    assert!(
        m.contains("tag 'build-tplw3' does not exist for template 'web'"),
        "{m}"
    );
    // A failed one says so (and is not waited on).
    let a = call(&node, create("web:build-tplw4")).await;
    assert_error(&a, StatusCode::NOT_FOUND);
    let m = a.json["message"].as_str().unwrap();
    assert!(
        m.contains("failed: apt failed") && !m.contains("does not exist"),
        "{m}"
    );
    // No such build of that template: a plain 404.
    for name in [
        "web:0f8fad5b-d9cb-469f-a165-70867728950e",
        "other:build-tplw",
        "web:nope",
    ] {
        let a = call(&node, create(name)).await;
        assert_error(&a, StatusCode::NOT_FOUND);
        assert_eq!(
            a.json["message"],
            format!("template {name} not found"),
            "{name}"
        );
    }
    // Tags name a build by its id too; the first build, left without any
    // tag, stays and is still created from by its build id.
    let r = call(
        &node,
        authed(
            "POST",
            "/templates/tags",
            r#"{"target":"web:build-tplw2","tags":["default"]}"#,
        ),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    assert_eq!(r.json["buildID"], "build-tplw2");
    assert_eq!(node.manager.resolve_template("web").unwrap().id, "tplw2");
    let old = node.manager.resolve_template("web:build-tplw").unwrap();
    assert_eq!((old.id.as_str(), old.names.len()), ("tplw", 0));
    assert!(node.dir.path().join("templates/tplw").is_dir());
}

#[tokio::test]
async fn a_second_build_of_a_template_in_flight_answers_409() {
    let node = web_builds(&[
        ("tplw3", BuildStatus::Building, 3),
        ("tplw5", BuildStatus::Waiting, 5),
    ]);
    let r = call(
        &node,
        authed("POST", "/v3/templates", r#"{"name":"web:v3"}"#),
    )
    .await;
    assert_error(&r, StatusCode::CONFLICT);
    let m = r.json["message"].as_str().unwrap();
    assert!(
        m.contains("build-tplw3") && m.contains("still running"),
        "{m}"
    );
    // A build requested before the other one started waits; its start is
    // refused the same way, and it waits on.
    let r = call(
        &node,
        authed(
            "POST",
            "/v2/templates/tplw/builds/build-tplw5",
            r#"{"fromTemplate":"base","steps":[]}"#,
        ),
    )
    .await;
    assert_error(&r, StatusCode::CONFLICT);
    let m = r.json["message"].as_str().unwrap();
    assert!(
        m.contains("build-tplw3") && m.contains("still running"),
        "{m}"
    );
    let b = node.manager.store().build("tplw5").unwrap().unwrap();
    assert_eq!(b.status, BuildStatus::Waiting);
    // Another template builds meanwhile.
    let r = call(
        &node,
        authed("POST", "/v3/templates", r#"{"name":"other"}"#),
    )
    .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.json);
}

#[tokio::test]
async fn untagged_builds_past_the_cap_go_and_say_they_were_replaced() {
    use server::node::template::e2b_build::KEEP_UNTAGGED;
    // Builds b0..=b{n}: each tagged v<i>; a sandbox still runs on b0.
    let n = KEEP_UNTAGGED + 2;
    let user = SandboxRecord {
        template_id: "b0".into(),
        ..record("user0", now_ms(), SandboxState::Running, "x")
    };
    type Make = Box<dyn Fn(&std::path::Path) -> TemplateRecord>;
    let makers: Vec<Make> = (0..=n)
        .map(|i| {
            Box::new(move |d: &std::path::Path| TemplateRecord {
                names: vec![format!("app:v{i}"), format!("b0:v{i}")],
                ..built(d, &format!("b{i}"), "app", i as u64)
            }) as Make
        })
        .collect();
    let refs: Vec<&dyn Fn(&std::path::Path) -> TemplateRecord> =
        makers.iter().map(|m| m.as_ref()).collect();
    let node = node_configured(&[user], &refs, |_, store| {
        for i in 0..=n {
            let mut b = build_record(&format!("b{i}"), "app", BuildStatus::Ready, i as u64);
            b.e2b = Some(E2bBuild {
                template_id: "b0".into(),
                tags: vec![format!("v{i}")],
            });
            store.put_build(&b).unwrap();
        }
    });
    // The newest build takes every tag: b0..b{n-1} lose their last one.
    let tags: Vec<String> = (0..n).map(|i| format!("v{i}")).collect();
    let body = serde_json::json!({"target": format!("app:v{n}"), "tags": tags}).to_string();
    let r = node.authed("POST", "/templates/tags", &body).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.json);
    // The newest KEEP_UNTAGGED untagged ones stay, and b0 (in use); b1 went.
    for i in (2..n).chain([0]) {
        let name = format!("app:build-b{i}");
        assert_eq!(
            node.manager.resolve_template(&name).unwrap().id,
            format!("b{i}")
        );
    }
    let a = call(
        &node,
        authed("POST", "/sandboxes", r#"{"templateID":"app:build-b1"}"#),
    )
    .await;
    assert_error(&a, StatusCode::NOT_FOUND);
    let m = a.json["message"].as_str().unwrap();
    assert!(
        m.contains("was deleted: replaced by newer builds of app"),
        "{m}"
    );
    let listed = node.authed("GET", "/templates", "").await;
    let builds: Vec<&str> = listed
        .json
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["buildID"].as_str())
        .collect();
    assert!(!builds.contains(&"build-b1"), "{builds:?}");
    assert!(builds.contains(&"build-b2"), "{builds:?}");
}

/// `authed` with an `Idempotency-Key`.
fn with_key(key: &str, body: &str) -> Request<Body> {
    let mut req = authed("POST", "/v2/sandboxes", body);
    req.headers_mut()
        .insert("idempotency-key", key.parse().unwrap());
    req
}

/// A node whose store recorded, before it restarted, a create with key
/// `done` (answered `seeded`), one interrupted by the restart (`cut`) and
/// one expired (`old`), all the default team's, of `body`.
fn node_after_creates(body: &str) -> Node {
    use server::node::store::{IdempotentAnswer, IdempotentCreate};
    let json: Value = serde_json::from_str(body).unwrap();
    let fingerprint = server::node::idempotent::fingerprint("POST /v2/sandboxes", &json);
    let later = now_ms() + 3_600_000;
    let seeded = IdempotentAnswer {
        body: r#"{"sandboxID":"seeded","templateID":"base","envdAccessToken":"tok"}"#.into(),
    };
    node_configured(&[], &[], |_, store| {
        for (key, expires_at_ms, answer) in [
            ("default/done", later, Some(seeded.clone())),
            ("default/cut", later, None),
            ("default/old", now_ms() - 1, Some(seeded.clone())),
        ] {
            let c = IdempotentCreate {
                fingerprint: fingerprint.clone(),
                expires_at_ms,
                answer,
            };
            store.put_idempotent_create(key, &c).unwrap();
        }
    })
}

#[tokio::test]
async fn a_create_replayed_with_its_idempotency_key_answers_the_first_answer_after_a_restart() {
    let body = r#"{"templateID":"base","timeout":60,"metadata":{"a":"b"}}"#;
    let node = node_after_creates(body);
    // The same request, spaced differently: the first answer, byte for byte.
    for body in [
        body,
        r#"{ "templateID": "base", "metadata": {"a": "b"}, "timeout": 60 }"#,
    ] {
        let response = node
            .app
            .clone()
            .oneshot(with_key("done", body))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(
            &bytes[..],
            br#"{"sandboxID":"seeded","templateID":"base","envdAccessToken":"tok"}"#
        );
    }
    // Another request with the key: E2B's 409, which the SDKs do not retry.
    let a = call(
        &node,
        with_key("done", r#"{"templateID":"base","timeout":61}"#),
    )
    .await;
    assert_error(&a, StatusCode::CONFLICT);
    assert_eq!(a.json["error_code"], "idempotency_request_mismatch");
    assert!(a.headers.get("should-retry").is_none());
    // Interrupted by the restart: not run again.
    let a = call(&node, with_key("cut", body)).await;
    assert_error(&a, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(a.json["error_code"], "idempotency_outcome_unknown");
    // Expired, or another team's key: a create of its own (which fails
    // here, without a VMM), and a failed create is not recorded.
    let (_, team_key) = team(&node, r#"{"name":"other"}"#).await;
    let mut other = keyed(&team_key, "POST", "/v2/sandboxes", body);
    other
        .headers_mut()
        .insert("idempotency-key", "done".parse().unwrap());
    for req in [with_key("old", body), other] {
        let a = call(&node, req).await;
        assert_ne!(a.status, StatusCode::CREATED, "{}", a.json);
        assert_ne!(a.json["sandboxID"], "seeded", "{}", a.json);
    }
    let store = node.manager.store();
    assert!(store.idempotent_create("default/old").unwrap().is_none());
    assert!(store.idempotent_create("default/done").unwrap().is_some());
}

#[tokio::test]
async fn a_malformed_idempotency_key_is_a_400_that_says_why() {
    let node = node(&[]);
    for key in ["Upper", "a_b", &"a".repeat(256)] {
        let a = call(&node, with_key(key, "{}")).await;
        assert_error(&a, StatusCode::BAD_REQUEST);
        let m = a.json["message"].as_str().unwrap();
        assert!(m.contains("Idempotency-Key must be 1 to 255"), "{m}");
    }
    let mut empty = authed("POST", "/v2/sandboxes", "{}");
    empty
        .headers_mut()
        .insert("idempotency-key", "".parse().unwrap());
    assert_error(&call(&node, empty).await, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn limits_answer_with_retry_after_for_the_sdks_retry() {
    let node = small_node(|c| c.max_sandboxes = 0);
    let a = node.authed("POST", "/v2/sandboxes", "{}").await;
    assert_error(&a, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(a.headers["retry-after"], "1");
    assert_eq!(a.headers["should-retry"], "true");
    let node = small_node(|_| ());
    let (_, key) = team(&node, r#"{"name":"a","maxSandboxes":0}"#).await;
    let a = call(&node, keyed(&key, "POST", "/v2/sandboxes", "{}")).await;
    assert_error(&a, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(a.headers["retry-after"], "1");
    assert_eq!(a.headers["should-retry"], "true");
    // A refused create with a key is not recorded: the SDK's retry, which
    // sends the key again, is a new attempt.
    for _ in 0..2 {
        let mut r = keyed(&key, "POST", "/v2/sandboxes", "{}");
        r.headers_mut()
            .insert("idempotency-key", "k".parse().unwrap());
        let a = call(&node, r).await;
        assert_error(&a, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(a.headers["retry-after"], "1");
    }
}

// ---- Lifecycle webhooks ------------------------------------------------------

const KILLED: &str = "sandbox.lifecycle.killed";

/// A webhook body for `url` and `events`, signed with `secret`.
fn hook(url: &str, events: &[&str], secret: &str) -> String {
    serde_json::json!({
        "name": "hook",
        "url": url,
        "events": events,
        "signatureSecret": secret,
    })
    .to_string()
}

#[tokio::test]
async fn webhooks_are_registered_read_changed_and_deleted_as_on_e2b() {
    let node = node(&[]);
    let a = call(
        &node,
        authed(
            "POST",
            "/events/webhooks",
            &hook("http://127.0.0.1:9/h", &[KILLED, KILLED], "s3cret"),
        ),
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.json);
    let id = a.json["id"].as_str().unwrap().to_owned();
    assert_eq!(id.len(), 36, "a UUID: {id}");
    assert_eq!(a.json["teamID"], "default");
    assert_eq!(a.json["name"], "hook");
    assert_eq!(a.json["url"], "http://127.0.0.1:9/h");
    assert_eq!(a.json["enabled"], true);
    assert_eq!(a.json["events"], serde_json::json!([KILLED]));
    assert!(a.json["createdAt"].as_str().unwrap().ends_with('Z'));
    assert!(!a.json.to_string().contains("s3cret"), "{}", a.json);

    let listed = call(&node, authed("GET", "/events/webhooks", "")).await;
    assert_eq!(listed.json.as_array().unwrap().len(), 1);
    assert_eq!(listed.json[0], a.json);
    let got = call(&node, authed("GET", &format!("/events/webhooks/{id}"), "")).await;
    assert_eq!(got.json, a.json);

    let patched = call(
        &node,
        authed(
            "PATCH",
            &format!("/events/webhooks/{id}"),
            r#"{"enabled":false,"events":["sandbox.lifecycle.forked","sandbox.lifecycle.updated"]}"#,
        ),
    )
    .await;
    assert_eq!(patched.status, StatusCode::OK, "{}", patched.json);
    assert_eq!(patched.json["enabled"], false);
    assert_eq!(
        patched.json["events"],
        serde_json::json!(["sandbox.lifecycle.forked", "sandbox.lifecycle.updated"])
    );
    assert_eq!(patched.json["url"], a.json["url"]);
    let deliveries = call(
        &node,
        authed("GET", &format!("/events/webhooks/{id}/deliveries"), ""),
    )
    .await;
    assert_eq!(deliveries.json, serde_json::json!([]));

    let gone = call(
        &node,
        authed("DELETE", &format!("/events/webhooks/{id}"), ""),
    )
    .await;
    assert_eq!(gone.status, StatusCode::OK);
    for (method, uri) in [
        ("GET", format!("/events/webhooks/{id}")),
        ("DELETE", format!("/events/webhooks/{id}")),
        ("PATCH", format!("/events/webhooks/{id}")),
        ("GET", format!("/events/webhooks/{id}/deliveries")),
    ] {
        assert_error(
            &call(&node, authed(method, &uri, "{}")).await,
            StatusCode::NOT_FOUND,
        );
    }
    let listed = call(&node, authed("GET", "/events/webhooks", "")).await;
    assert_eq!(listed.json, serde_json::json!([]));
}

#[tokio::test]
async fn a_webhook_needs_an_http_url_known_events_and_a_secret() {
    let node = node(&[]);
    let ok = "http://127.0.0.1:9/h";
    for body in [
        hook("ftp://example.com/h", &[KILLED], "s"),
        hook("file:///etc/passwd", &[KILLED], "s"),
        hook("example.com/h", &[KILLED], "s"),
        hook("http://user:pw@example.com/h", &[KILLED], "s"),
        hook(ok, &["sandbox.lifecycle.exploded"], "s"),
        hook(ok, &["created"], "s"),
        hook(ok, &[], "s"),
        hook(ok, &[KILLED], ""),
        r#"{"url":"http://127.0.0.1:9/h","events":["sandbox.lifecycle.killed"]}"#.into(),
        r#"{"events":["sandbox.lifecycle.killed"],"signatureSecret":"s"}"#.into(),
        r#"{"url":"http://127.0.0.1:9/h","signatureSecret":"s"}"#.into(),
        r#"{"url":7}"#.into(),
        "nonsense".into(),
    ] {
        let a = call(&node, authed("POST", "/events/webhooks", &body)).await;
        assert_error(&a, StatusCode::BAD_REQUEST);
    }
    let listed = call(&node, authed("GET", "/events/webhooks", "")).await;
    assert_eq!(listed.json, serde_json::json!([]), "nothing was registered");

    let a = call(
        &node,
        authed("POST", "/events/webhooks", &hook(ok, &[KILLED], "s")),
    )
    .await;
    let id = a.json["id"].as_str().unwrap();
    for body in [
        r#"{"url":"gopher://x"}"#,
        r#"{"events":["nope"]}"#,
        r#"{"events":[]}"#,
        r#"{"signatureSecret":""}"#,
    ] {
        let a = call(
            &node,
            authed("PATCH", &format!("/events/webhooks/{id}"), body),
        )
        .await;
        assert_error(&a, StatusCode::BAD_REQUEST);
    }
    let got = call(&node, authed("GET", &format!("/events/webhooks/{id}"), "")).await;
    assert_eq!(got.json, a.json, "a refused change changes nothing");
    assert_error(
        &call(&node, authed("GET", "/events/sandboxes?limit=0", "")).await,
        StatusCode::BAD_REQUEST,
    );
    assert_error(
        &call(&node, authed("GET", "/events/sandboxes?orderAsc=maybe", "")).await,
        StatusCode::BAD_REQUEST,
    );
}

/// What a receiver on loopback was sent: each request's headers and body.
type Received = Arc<std::sync::Mutex<Vec<(axum::http::HeaderMap, bytes::Bytes)>>>;

/// A receiver on 127.0.0.1 answering request n (0-based) with `status(n)`:
/// its URL and what it got.
async fn receiver(status: fn(usize) -> u16) -> (String, Received) {
    let got: Received = Arc::default();
    let kept = got.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(
            move |headers: axum::http::HeaderMap, body: bytes::Bytes| async move {
                let mut got = kept.lock().unwrap();
                got.push((headers, body));
                StatusCode::from_u16(status(got.len() - 1)).unwrap()
            },
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/hook"), got)
}

/// Waits until `got` holds `n` requests (or fails after 10 s).
async fn received(got: &Received, n: usize) -> Vec<(axum::http::HeaderMap, bytes::Bytes)> {
    for _ in 0..500 {
        if got.lock().unwrap().len() >= n {
            return got.lock().unwrap().clone();
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!(
        "the receiver got {} requests, not {n}",
        got.lock().unwrap().len()
    );
}

/// E2B's check, as its documentation gives it to receivers.
fn signed(secret: &str, body: &[u8]) -> String {
    use base64::Engine as _;
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    h.update(secret.as_bytes());
    h.update(body);
    base64::engine::general_purpose::STANDARD
        .encode(h.finalize())
        .trim_end_matches('=')
        .to_owned()
}

/// The deliveries of webhook `id`, once there are `n` and none is pending.
async fn settled(node: &Node, key: &str, id: &str, n: usize) -> Value {
    for _ in 0..500 {
        let a = call(
            node,
            keyed(key, "GET", &format!("/events/webhooks/{id}/deliveries"), ""),
        )
        .await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.json);
        let all = a.json.as_array().unwrap();
        if all.len() >= n && all.iter().all(|d| d["status"] != "pending") {
            return a.json;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("deliveries of {id}: not {n}, or still pending");
}

#[tokio::test]
async fn a_kill_is_delivered_signed_to_its_teams_webhook_and_retried_until_answered() {
    let now = now_ms();
    let node = node(&[]);
    let (a_team, a_key) = team(&node, r#"{"name":"a"}"#).await;
    let (_, b_key) = team(&node, r#"{"name":"b"}"#).await;
    for r in [
        owned(&a_team, record("mine", now, SandboxState::Running, "x")),
        record("theirs", now, SandboxState::Running, "y"),
    ] {
        node.manager.store().put_sandbox(&r).unwrap();
    }
    // The first try is answered 500: the second, 200.
    let (url, got) = receiver(|n| if n == 0 { 500 } else { 200 }).await;
    let a = call(
        &node,
        keyed(
            &a_key,
            "POST",
            "/events/webhooks",
            &hook(&url, &[KILLED], "s3cret"),
        ),
    )
    .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.json);
    let id = a.json["id"].as_str().unwrap().to_owned();
    assert_eq!(a.json["teamID"], a_team.as_str());

    // Another team sees nothing of it.
    let b_list = call(&node, keyed(&b_key, "GET", "/events/webhooks", "")).await;
    assert_eq!(b_list.json, serde_json::json!([]));
    for (method, uri) in [
        ("GET", format!("/events/webhooks/{id}")),
        ("PATCH", format!("/events/webhooks/{id}")),
        ("GET", format!("/events/webhooks/{id}/deliveries")),
        ("DELETE", format!("/events/webhooks/{id}")),
    ] {
        assert_error(
            &call(&node, keyed(&b_key, method, &uri, "{}")).await,
            StatusCode::NOT_FOUND,
        );
    }

    // Another team's sandbox ends: nothing is sent.
    let a = call(&node, authed("DELETE", "/sandboxes/theirs", "")).await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
    let a = call(&node, keyed(&a_key, "DELETE", "/sandboxes/mine", "")).await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);

    let got = received(&got, 2).await;
    let deliveries = settled(&node, &a_key, &id, 1).await;
    assert_eq!(deliveries.as_array().unwrap().len(), 1, "{deliveries}");
    let d = &deliveries[0];
    assert_eq!(d["status"], "delivered", "{d}");
    assert_eq!(d["attempts"], 2, "{d}");
    assert_eq!(d["responseStatus"], 200, "{d}");
    assert_eq!(d["eventType"], KILLED);
    assert_eq!(d["sandboxID"], "mine");
    assert_eq!(d["webhookID"], id.as_str());
    assert_eq!(got.len(), 2, "only its own sandbox's event, twice");
    for (headers, body) in &got {
        assert_eq!(headers["e2b-webhook-id"], id.as_str());
        assert_eq!(headers["e2b-delivery-id"], d["id"].as_str().unwrap());
        assert_eq!(headers["e2b-signature-version"], "v1");
        assert_eq!(headers["content-type"], "application/json");
        assert_eq!(
            headers["e2b-signature"].to_str().unwrap(),
            signed("s3cret", body)
        );
        assert_ne!(
            headers["e2b-signature"].to_str().unwrap(),
            signed("other", body)
        );
    }
    assert_eq!(got[0].1, got[1].1, "a retry sends the same bytes");
    let event: Value = serde_json::from_slice(&got[0].1).unwrap();
    assert_eq!(event["type"], KILLED);
    assert_eq!(event["version"], "v2");
    assert_eq!(event["sandboxId"], "mine");
    assert_eq!(event["sandboxTeamId"], a_team.as_str());
    assert_eq!(event["sandboxTemplateId"], "base");
    assert_eq!(event["eventId"], Value::Null);
    assert_eq!(event["id"], d["eventID"]);
    assert_eq!(event["eventData"]["sandbox_metadata"]["team"], "x");
    let execution = &event["eventData"]["execution"];
    assert_eq!(execution["vcpu_count"], 1);
    assert_eq!(execution["memory_mb"], 256);
    assert!(execution["execution_time"].as_u64().is_some(), "{event}");

    // The team's events: its own sandbox's only.
    let mine = call(&node, keyed(&a_key, "GET", "/events/sandboxes", "")).await;
    assert_eq!(mine.json.as_array().unwrap().len(), 1, "{}", mine.json);
    assert_eq!(mine.json[0], event);
    let one = call(&node, keyed(&a_key, "GET", "/events/sandboxes/mine", "")).await;
    assert_eq!(one.json, mine.json);
    let foreign = call(&node, keyed(&b_key, "GET", "/events/sandboxes/mine", "")).await;
    assert_eq!(foreign.json, serde_json::json!([]));
    let b_events = call(&node, keyed(&b_key, "GET", "/events/sandboxes", "")).await;
    assert_eq!(b_events.json, serde_json::json!([]));
}

#[tokio::test]
async fn the_nodes_own_ends_are_delivered_and_a_receiver_that_fails_is_tried_3_times() {
    let now = now_ms();
    let squeezed = |id: &str, auto_pause: bool| SandboxRecord {
        auto_pause,
        pause_reason: Some(PauseReason::MemoryPressure),
        end_at_ms: now - 1,
        ..record(id, now - 10_000, SandboxState::Paused, "x")
    };
    let node = node(&[
        SandboxRecord {
            end_at_ms: now - 1,
            ..record("expired", now - 10_000, SandboxState::Running, "x")
        },
        squeezed("squeezed-kept", true),
        squeezed("squeezed-gone", false),
    ]);
    let (ok_url, ok_got) = receiver(|_| 204).await;
    let (bad_url, bad_got) = receiver(|_| 503).await;
    let events = [KILLED, "sandbox.lifecycle.paused"];
    let ok = call(
        &node,
        authed("POST", "/events/webhooks", &hook(&ok_url, &events, "k")),
    )
    .await;
    let bad = call(
        &node,
        authed("POST", "/events/webhooks", &hook(&bad_url, &events, "k")),
    )
    .await;
    // Disabled: sent nothing.
    let (off_url, off_got) = receiver(|_| 200).await;
    let off = call(
        &node,
        authed("POST", "/events/webhooks", &hook(&off_url, &events, "k")),
    )
    .await;
    let a = call(
        &node,
        authed(
            "PATCH",
            &format!("/events/webhooks/{}", off.json["id"].as_str().unwrap()),
            r#"{"enabled":false}"#,
        ),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json);

    // At its timeout: a running sandbox is killed; one the node paused for
    // memory pressure is paused for its owner now (autoPause) or killed.
    node.manager.reap_expired().await;
    let got = received(&ok_got, 3).await;
    let mut seen: Vec<(String, String)> = got
        .iter()
        .map(|(_, body)| {
            let e: Value = serde_json::from_slice(body).unwrap();
            (
                e["sandboxId"].as_str().unwrap().to_owned(),
                e["type"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("expired".to_owned(), KILLED.to_owned()),
            ("squeezed-gone".to_owned(), KILLED.to_owned()),
            (
                "squeezed-kept".to_owned(),
                "sandbox.lifecycle.paused".to_owned()
            ),
        ]
    );
    let deliveries = settled(&node, KEY, ok.json["id"].as_str().unwrap(), 3).await;
    assert!(
        deliveries
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["status"] == "delivered" && d["attempts"] == 1),
        "{deliveries}"
    );

    // Each of the three tried 3 times (the test's policy), then failed.
    let deliveries = settled(&node, KEY, bad.json["id"].as_str().unwrap(), 3).await;
    assert_eq!(deliveries.as_array().unwrap().len(), 3, "{deliveries}");
    for d in deliveries.as_array().unwrap() {
        assert_eq!(d["status"], "failed", "{d}");
        assert_eq!(d["attempts"], 3, "{d}");
        assert_eq!(d["responseStatus"], 503, "{d}");
        assert!(d["error"].as_str().unwrap().contains("503"), "{d}");
    }
    assert_eq!(bad_got.lock().unwrap().len(), 9);
    assert!(off_got.lock().unwrap().is_empty());

    // Kept in the store: a node opened on it again has the webhooks.
    let store = node.manager.store();
    assert_eq!(store.webhooks().unwrap().len(), 3);
    assert_eq!(store.deliveries().unwrap().len(), 6);
}

#[tokio::test]
async fn a_receiver_that_does_not_listen_fails_with_the_reason() {
    let node = node(&[record("abc", 1, SandboxState::Running, "x")]);
    // A port nothing listens on: bound, then closed.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let a = call(
        &node,
        authed(
            "POST",
            "/events/webhooks",
            &hook(&format!("http://127.0.0.1:{port}/x"), &[KILLED], "k"),
        ),
    )
    .await;
    let id = a.json["id"].as_str().unwrap().to_owned();
    let a = call(&node, authed("DELETE", "/sandboxes/abc", "")).await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
    let deliveries = settled(&node, KEY, &id, 1).await;
    let d = &deliveries[0];
    assert_eq!(d["status"], "failed", "{d}");
    assert_eq!(d["attempts"], 3, "{d}");
    assert_eq!(d["responseStatus"], Value::Null, "{d}");
    assert!(d["error"].as_str().unwrap().contains("connecting"), "{d}");
}

#[tokio::test]
async fn webhooks_and_pending_deliveries_outlive_a_restart() {
    use server::node::webhooks::{DeliveryRecord, DeliveryStatus, WebhookRecord, signature};
    let (url, got) = receiver(|_| 200).await;
    let webhook = WebhookRecord {
        id: "0e4f5a1c-0000-4000-8000-000000000001".into(),
        team: "default".into(),
        name: "kept".into(),
        url,
        events: vec![KILLED.into()],
        enabled: true,
        secret: "k".into(),
        created_at_ms: now_ms() - 60_000,
    };
    let pending = DeliveryRecord {
        id: "d1".into(),
        webhook_id: webhook.id.clone(),
        event_id: "e1".into(),
        event_type: KILLED.into(),
        sandbox_id: "abc".into(),
        body: r#"{"type":"sandbox.lifecycle.killed"}"#.into(),
        status: DeliveryStatus::Pending,
        attempts: 1,
        response_status: Some(500),
        error: Some("the receiver answered 500".into()),
        created_at_ms: now_ms() - 1_000,
        last_attempt_at_ms: Some(now_ms() - 1_000),
    };
    // What a node left in its store when it stopped mid-retry.
    let node = node_configured(&[], &[], |_, store| {
        store.put_webhook(&webhook).unwrap();
        store.put_delivery(&pending).unwrap();
    });
    let listed = call(&node, authed("GET", "/events/webhooks", "")).await;
    assert_eq!(listed.json[0]["id"], webhook.id.as_str());
    assert_eq!(listed.json[0]["url"], webhook.url.as_str());
    // The pending delivery goes on where it was: its second try.
    let sent = received(&got, 1).await;
    assert_eq!(&sent[0].1[..], pending.body.as_bytes());
    assert_eq!(
        sent[0].0["e2b-signature"].to_str().unwrap(),
        signature("k", pending.body.as_bytes())
    );
    let deliveries = settled(&node, KEY, &webhook.id, 1).await;
    assert_eq!(deliveries[0]["status"], "delivered");
    assert_eq!(deliveries[0]["attempts"], 2);
}

/// A node that converts images (its agent is any file: no conversion here
/// gets that far), its pull cache in its data dir.
fn image_node(setup: impl FnOnce(&mut Config)) -> Node {
    node_configured(&[], &[], |c, _| {
        c.agent = Some(common::BUSYBOX.into());
        c.build_cache = Some(c.data_dir.join("cache"));
        setup(c);
    })
}

/// A loopback port nothing listens on.
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The templates and builds `GET /templates` lists under `name`.
async fn listed_as(node: &Node, name: &str) -> Vec<Value> {
    let a = node.authed("GET", "/templates", "").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json);
    a.json
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["names"].as_array().unwrap().iter().any(|n| n == name))
        .cloned()
        .collect()
}

/// A template id that is an image reference is pulled (here from a
/// registry that is not there: 502 with what the pull met), and a failed
/// conversion leaves no build and no template behind, so the next create
/// tries again; template names, `name:tag` included, are not images.
#[tokio::test]
async fn a_create_naming_an_image_pulls_it_and_a_failure_leaves_nothing() {
    let node = image_node(|_| ());
    let image = format!("127.0.0.1:{}/sdk/img:v1", closed_port());
    for _ in 0..2 {
        let body = format!(r#"{{"templateID":"{image}"}}"#);
        let a = node
            .refuses("POST", "/v2/sandboxes", &body, StatusCode::BAD_GATEWAY)
            .await;
        let message = a.json["message"].as_str().unwrap();
        assert!(
            message.contains(&image) && message.contains("connect"),
            "{message}"
        );
        assert_eq!(a.headers["should-retry"], "false");
        assert!(listed_as(&node, &image).await.is_empty());
        assert!(node.manager.store().builds().unwrap().is_empty());
    }
    for (template, status) in [
        ("localhost:1/UPPER:v1", StatusCode::BAD_REQUEST),
        ("my-template:v2", StatusCode::NOT_FOUND),
        ("python:3.12", StatusCode::NOT_FOUND),
    ] {
        let body = format!(r#"{{"templateID":"{template}"}}"#);
        node.refuses("POST", "/v2/sandboxes", &body, status).await;
    }
}

/// Above the high watermark for images (here 0 %: any use is above) with
/// no image template to evict, a create that would convert an image is
/// refused before any pull: 503 with `Retry-After` (the SDKs retry it), the
/// watermark in its message, nothing recorded, and the refusal counted in
/// `GET /v1/node`; a create of a template is not an image's conversion and
/// is not refused for it.
#[tokio::test]
async fn a_conversion_above_the_high_watermark_is_refused_with_retry_after() {
    let node = image_node(|c| {
        c.capacity.image_disk.high_percent = 0.0;
        c.capacity.image_disk.low_percent = 0.0;
    });
    let image = format!("127.0.0.1:{}/sdk/img:v1", closed_port());
    let body = format!(r#"{{"templateID":"{image}"}}"#);
    let a = node
        .refuses(
            "POST",
            "/v2/sandboxes",
            &body,
            StatusCode::SERVICE_UNAVAILABLE,
        )
        .await;
    let message = a.json["message"].as_str().unwrap();
    assert!(
        message.contains(&image) && message.contains("high watermark"),
        "{message}"
    );
    assert_eq!(a.headers["should-retry"], "true");
    assert_eq!(a.headers["retry-after"], "10");
    assert!(node.manager.store().builds().unwrap().is_empty());
    let info = node_info(&node).await;
    assert_eq!(info["diskMB"]["images"]["refused"], 1, "{info}");
    assert_eq!(info["diskMB"]["images"]["highWatermark"], 0.0, "{info}");
    let a = node
        .authed("POST", "/v2/sandboxes", r#"{"templateID":"mine"}"#)
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND, "{}", a.json);
}

/// With `--image-metadata-key`, the create's metadata names the image (any
/// name Docker takes); without it the same metadata is only metadata; a
/// create naming another template too is refused.
#[tokio::test]
async fn the_metadata_key_names_the_image_when_configured() {
    let image = format!("localhost:{}/task/one:v1", closed_port());
    let body = format!(r#"{{"metadata":{{"image":"{image}"}}}}"#);
    let keyed = image_node(|c| c.image_metadata_key = Some("image".into()));
    let a = keyed
        .refuses("POST", "/v2/sandboxes", &body, StatusCode::BAD_GATEWAY)
        .await;
    assert!(
        a.json["message"].as_str().unwrap().contains(&image),
        "{}",
        a.json
    );
    let both = format!(r#"{{"templateID":"mine","metadata":{{"image":"{image}"}}}}"#);
    keyed
        .refuses("POST", "/v2/sandboxes", &both, StatusCode::BAD_REQUEST)
        .await;
    let plain = image_node(|_| ());
    let a = plain.authed("POST", "/v2/sandboxes", &body).await;
    assert_ne!(a.status, StatusCode::BAD_GATEWAY, "{}", a.json);
    assert!(!a.json.to_string().contains(&image), "{}", a.json);
}

/// Concurrent creates of one new image wait on one conversion: the
/// registry (here one that accepts and never answers) sees one connection;
/// past `builtin_wait` each is told to come back (503, `Retry-After`,
/// `Should-Retry: true`) while the conversion, listed as a build, goes on.
#[tokio::test]
async fn concurrent_creates_of_one_image_wait_on_one_conversion() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let image = format!(
        "127.0.0.1:{}/sdk/slow:v1",
        listener.local_addr().unwrap().port()
    );
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            held.push(s);
        }
    });
    let node = Arc::new(image_node(|c| {
        c.builtin_wait = std::time::Duration::from_millis(300);
    }));
    let creates: Vec<_> = (0..8)
        .map(|_| {
            let node = node.clone();
            let body = format!(r#"{{"templateID":"{image}"}}"#);
            tokio::spawn(async move {
                node.refuses(
                    "POST",
                    "/v2/sandboxes",
                    &body,
                    StatusCode::SERVICE_UNAVAILABLE,
                )
                .await
            })
        })
        .collect();
    for create in creates {
        let a = create.await.unwrap();
        let message = a.json["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("template {image} is being built")),
            "{message}"
        );
        assert_eq!(a.headers["retry-after"], "20");
        assert_eq!(a.headers["should-retry"], "true");
    }
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
    let listed = listed_as(&node, &image).await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["buildStatus"], "building", "{listed:?}");
}

// ---- Volumes ----------------------------------------------------------------

/// The ext4 superblock's magic (0xEF53, at byte 56 of the superblock at
/// 1024) of the image at `path`.
fn is_ext4(path: &std::path::Path) -> bool {
    use std::os::unix::fs::FileExt;
    let mut magic = [0u8; 2];
    let file = std::fs::File::open(path).unwrap();
    file.read_exact_at(&mut magic, 1024 + 56).unwrap();
    u16::from_le_bytes(magic) == 0xEF53
}

/// The names under the node's `volumes/`.
fn volume_dirs(node: &Node) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(node.dir.path().join("volumes"))
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// A delete of volume `id` refused with a 409 naming `holder`, the sandbox
/// or snapshot that holds it.
async fn volume_delete_refused(node: &Node, id: &str, holder: &str) {
    let a = node
        .refuses(
            "DELETE",
            &format!("/volumes/{id}"),
            "",
            StatusCode::CONFLICT,
        )
        .await;
    let message = a.json["message"].as_str().unwrap_or_default();
    assert!(message.contains(holder), "{}", a.json);
}

/// Makes volume `body` (its JSON) with `key`: its answer, checked to be a
/// 201 with E2B's `VolumeAndToken`.
async fn new_volume(node: &Node, key: &str, body: &str) -> Value {
    let a = call(node, keyed(key, "POST", "/volumes", body)).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.json);
    assert!(a.json["volumeID"].as_str().is_some_and(|id| !id.is_empty()));
    assert!(a.json["token"].as_str().is_some_and(|t| t.len() >= 32));
    assert!(a.json.get("domain").is_none(), "{}", a.json);
    a.json
}

impl Node {
    /// This node stopped and another started on its data directory and
    /// store, as a node's start does (unrecorded volume directories go).
    fn restarted(self) -> Node {
        let Node {
            app,
            manager,
            templates,
            dir,
        } = self;
        drop((app, templates, manager));
        let node = node_in(dir, &[], &[], |_, _| (), ApiKeys::for_key(KEY));
        node.manager.forget_unrecorded_volumes().unwrap();
        node
    }
}

#[tokio::test]
async fn volumes_are_created_listed_read_and_deleted_as_on_e2b() {
    let node = node(&[]);
    let data = new_volume(&node, KEY, r#"{"name":"data"}"#).await;
    let id = data["volumeID"].as_str().unwrap().to_owned();
    assert_eq!(data["name"], "data");
    // The default size: 10 GiB, sparse.
    assert_eq!(data["sizeMB"], 10240);
    let small = new_volume(&node, KEY, r#"{"name":"small_2","sizeMB":64}"#).await;
    assert_eq!(small["sizeMB"], 64);
    let small_id = small["volumeID"].as_str().unwrap().to_owned();

    // Each its own directory: an ext4 image of its size under a layer.
    let mut ids = vec![id.clone(), small_id.clone()];
    ids.sort();
    assert_eq!(volume_dirs(&node), ids);
    for (vid, bytes) in [(&id, 10u64 << 30), (&small_id, 64 << 20)] {
        let dir = node.dir.path().join("volumes").join(vid);
        let base = dir.join("base.ext4");
        assert_eq!(std::fs::metadata(&base).unwrap().len(), bytes);
        assert!(is_ext4(&base));
        assert!(dir.join("volume.layer").is_file());
    }
    let big =
        std::fs::metadata(node.dir.path().join("volumes").join(&id).join("base.ext4")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert!(
        big.blocks() * 512 < 64 << 20,
        "a 10 GiB volume takes {} bytes of the host's disk",
        big.blocks() * 512
    );

    // Listed oldest first as E2B's `Volume` (no token); read as
    // `VolumeAndToken`, the create's token.
    let listed = node.authed("GET", "/volumes", "").await;
    assert_eq!(listed.status, StatusCode::OK);
    assert_eq!(
        listed.json,
        serde_json::json!([
            {"volumeID": id, "name": "data", "sizeMB": 10240},
            {"volumeID": small_id, "name": "small_2", "sizeMB": 64},
        ])
    );
    let got = node.authed("GET", &format!("/volumes/{id}"), "").await;
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(got.json, data);

    // A name is the team's once.
    let a = node
        .refuses(
            "POST",
            "/volumes",
            r#"{"name":"data"}"#,
            StatusCode::CONFLICT,
        )
        .await;
    assert!(a.json["message"].as_str().unwrap().contains("data"));

    // Deleted: its record and its directory.
    let a = node.authed("DELETE", &format!("/volumes/{id}"), "").await;
    assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.json);
    assert_eq!(volume_dirs(&node), [small_id.as_str()]);
    for method in ["GET", "DELETE"] {
        node.refuses(method, &format!("/volumes/{id}"), "", StatusCode::NOT_FOUND)
            .await;
    }
    let listed = node.authed("GET", "/volumes", "").await;
    assert_eq!(listed.json.as_array().unwrap().len(), 1, "{}", listed.json);
    // Its name is free again.
    new_volume(&node, KEY, r#"{"name":"data","sizeMB":64}"#).await;
}

#[tokio::test]
async fn a_volume_needs_a_plain_name_and_a_size_a_slot_holds() {
    let node = node(&[]);
    let long = "a".repeat(64);
    for body in [
        "{}".to_owned(),
        r#"{"name":""}"#.to_owned(),
        r#"{"name":"a b"}"#.to_owned(),
        r#"{"name":"-data"}"#.to_owned(),
        r#"{"name":"x/y"}"#.to_owned(),
        r#"{"name":".."}"#.to_owned(),
        r#"{"name":"données"}"#.to_owned(),
        format!(r#"{{"name":"{long}"}}"#),
        r#"{"name":"ok","sizeMB":63}"#.to_owned(),
        r#"{"name":"ok","sizeMB":65537}"#.to_owned(),
        r#"{"name":7}"#.to_owned(),
    ] {
        let a = node
            .refuses("POST", "/volumes", &body, StatusCode::BAD_REQUEST)
            .await;
        let message = a.json["message"].as_str().unwrap();
        assert!(
            ["name", "sizeMB", "malformed"]
                .iter()
                .any(|w| message.contains(w)),
            "{body}: {message}"
        );
    }
    assert_eq!(
        node.authed("GET", "/volumes", "").await.json,
        serde_json::json!([])
    );
    assert!(volume_dirs(&node).is_empty());
    // The limits themselves are taken.
    let longest = "b".repeat(63);
    new_volume(
        &node,
        KEY,
        &format!(r#"{{"name":"{longest}","sizeMB":64}}"#),
    )
    .await;
    new_volume(&node, KEY, r#"{"name":"9-x_Y","sizeMB":65536}"#).await;
}

#[tokio::test]
async fn another_teams_volume_answers_as_an_unknown_one() {
    let node = node(&[]);
    let (_, b_key) = team(&node, r#"{"name":"b"}"#).await;
    let theirs = new_volume(&node, &b_key, r#"{"name":"data","sizeMB":64}"#).await;
    let id = theirs["volumeID"].as_str().unwrap();
    // The default team sees none of it, and may use the same name.
    assert_eq!(
        node.authed("GET", "/volumes", "").await.json,
        serde_json::json!([])
    );
    for method in ["GET", "DELETE"] {
        node.refuses(method, &format!("/volumes/{id}"), "", StatusCode::NOT_FOUND)
            .await;
    }
    let mine = new_volume(&node, KEY, r#"{"name":"data","sizeMB":64}"#).await;
    assert_ne!(mine["volumeID"], theirs["volumeID"]);
    // Team b's is there still, and only its own.
    let b_list = call(&node, keyed(&b_key, "GET", "/volumes", "")).await;
    assert_eq!(
        b_list.json,
        serde_json::json!([{"volumeID": id, "name": "data", "sizeMB": 64}])
    );
}

#[tokio::test]
async fn a_mounted_volume_is_not_deleted() {
    let node = node(&[]);
    let v = new_volume(&node, KEY, r#"{"name":"data","sizeMB":64}"#).await;
    let id = v["volumeID"].as_str().unwrap().to_owned();
    let disk = node
        .dir
        .path()
        .join("volumes")
        .join(&id)
        .join("volume.layer");
    // A paused sandbox mounts it.
    let store = node.manager.store();
    store
        .put_sandbox(&SandboxRecord {
            volume_mounts: vec![server::node::store::VolumeMount {
                volume_id: id.clone(),
                name: "data".into(),
                slot: 0,
                path: "/data".into(),
                read_only: false,
                disk,
                copy: false,
            }],
            ..record("user1", now_ms(), SandboxState::Paused, "x")
        })
        .unwrap();
    // Its detail and the list name the mount as E2B's `volumeMounts`.
    let mounts = serde_json::json!([{"name": "data", "path": "/data"}]);
    let a = node.authed("GET", "/sandboxes/user1", "").await;
    assert_eq!(a.json["volumeMounts"], mounts, "{}", a.json);
    let a = node.authed("GET", "/v2/sandboxes?state=paused", "").await;
    assert_eq!(a.json[0]["sandboxID"], "user1", "{}", a.json);
    assert_eq!(a.json[0]["volumeMounts"], mounts, "{}", a.json);
    volume_delete_refused(&node, &id, "user1").await;
    assert_eq!(volume_dirs(&node), [id.as_str()]);
    // Once the sandbox is gone, it goes.
    store.remove_sandbox("user1").unwrap();
    let a = node.authed("DELETE", &format!("/volumes/{id}"), "").await;
    assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.json);
    assert!(volume_dirs(&node).is_empty());
}

/// A snapshot of a sandbox with a volume keeps the volume's sealed layer
/// (its record names it): no delete of the volume while the snapshot
/// exists; a deleted snapshot lets it go. A create from it takes no more
/// volumes.
#[tokio::test]
async fn a_volume_a_snapshot_keeps_is_not_deleted_until_the_snapshot_is() {
    let node = node(&[]);
    let v = new_volume(&node, KEY, r#"{"name":"data","sizeMB":64}"#).await;
    let id = v["volumeID"].as_str().unwrap().to_owned();
    let disk = node
        .dir
        .path()
        .join("volumes")
        .join(&id)
        .join("volume.layer");
    let mut snap = snapshot(node.dir.path(), "isnapvol", "isource", now_ms());
    snap.volume_slots = 2;
    snap.volume_mounts = vec![server::node::store::VolumeMount {
        volume_id: id.clone(),
        name: "data".into(),
        slot: 0,
        path: "/data".into(),
        read_only: false,
        disk,
        copy: false,
    }];
    node.manager.store().put_template(&snap).unwrap();
    volume_delete_refused(&node, &id, "isnapvol").await;
    // Its copies take the snapshot's slots: more volumes are refused.
    let other = new_volume(&node, KEY, r#"{"name":"more","sizeMB":64}"#).await;
    let body = serde_json::json!({
        "templateID": "isnapvol",
        "volumeMounts": [{"name": "more", "path": "/more"}],
    });
    node.refuses(
        "POST",
        "/v2/sandboxes",
        &body.to_string(),
        StatusCode::BAD_REQUEST,
    )
    .await;
    let a = node.authed("DELETE", "/templates/isnapvol", "").await;
    assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.json);
    for v in [id.as_str(), other["volumeID"].as_str().unwrap()] {
        let a = node.authed("DELETE", &format!("/volumes/{v}"), "").await;
        assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.json);
    }
    assert!(volume_dirs(&node).is_empty());
}

#[tokio::test]
async fn volumes_survive_a_restart_and_unrecorded_directories_do_not() {
    let node = node(&[]);
    let a = new_volume(&node, KEY, r#"{"name":"a","sizeMB":64}"#).await;
    let b = new_volume(&node, KEY, r#"{"name":"b","sizeMB":128}"#).await;
    // What a create cut short by a crash leaves: a directory, no record.
    std::fs::create_dir_all(node.dir.path().join("volumes/cut-short")).unwrap();
    let listed = node.authed("GET", "/volumes", "").await.json;

    let node = node.restarted();
    assert_eq!(node.authed("GET", "/volumes", "").await.json, listed);
    for v in [&a, &b] {
        let id = v["volumeID"].as_str().unwrap();
        let got = node.authed("GET", &format!("/volumes/{id}"), "").await;
        assert_eq!(&got.json, v);
    }
    let mut ids = vec![
        a["volumeID"].as_str().unwrap().to_owned(),
        b["volumeID"].as_str().unwrap().to_owned(),
    ];
    ids.sort();
    assert_eq!(volume_dirs(&node), ids);
    // Names are still taken; a delete still works.
    node.refuses("POST", "/volumes", r#"{"name":"a"}"#, StatusCode::CONFLICT)
        .await;
    let id = a["volumeID"].as_str().unwrap();
    let gone = node.authed("DELETE", &format!("/volumes/{id}"), "").await;
    assert_eq!(gone.status, StatusCode::NO_CONTENT, "{}", gone.json);
}

/// `GET /metrics` with the node's key as a bearer token, as Prometheus
/// sends it: the OpenMetrics text.
async fn scrape(node: &Node) -> String {
    let req = Request::builder()
        .uri("/metrics")
        .header("authorization", format!("Bearer {KEY}"))
        .body(Body::empty())
        .unwrap();
    let response = node.app.clone().oneshot(req).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text"),
        "{:?}",
        response.headers()
    );
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// The value of the sample `series` (name and labels as written) in `text`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.parse().unwrap())
}

#[tokio::test]
async fn metrics_take_the_nodes_own_key() {
    let node = node(&[]);
    let get = |auth: Option<(&str, String)>| {
        let mut req = Request::builder().uri("/metrics");
        if let Some((name, value)) = auth {
            req = req.header(name, value);
        }
        call(&node, req.body(Body::empty()).unwrap())
    };
    assert_error(&get(None).await, StatusCode::UNAUTHORIZED);
    let wrong = ("authorization", "Bearer e2b_wrong".to_owned());
    assert_error(&get(Some(wrong)).await, StatusCode::UNAUTHORIZED);
    // A team's key may not list every team's sandboxes.
    let (_, team_key) = team(&node, r#"{"name":"a"}"#).await;
    let a = get(Some(("authorization", format!("Bearer {team_key}")))).await;
    assert_error(&a, StatusCode::FORBIDDEN);
    let response = node
        .app
        .clone()
        .oneshot(authed("GET", "/metrics", ""))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let text = scrape(&node).await;
    assert!(text.ends_with("# EOF\n"), "{text}");
}

#[tokio::test]
async fn metrics_follow_refusals_kills_and_the_records() {
    let node = small_node(|_| ());
    let text = scrape(&node).await;
    let running = r#"sandfork_sandboxes{state="running",team="default",template="base"}"#;
    let paused = r#"sandfork_sandboxes{state="paused",team="default",template="base"}"#;
    assert_eq!(sample(&text, running), Some(1.0), "{text}");
    assert_eq!(sample(&text, paused), Some(1.0), "{text}");
    assert_eq!(
        sample(&text, r#"sandfork_capacity_vcpus{kind="total"}"#),
        Some(2.0),
        "{text}"
    );
    assert_eq!(sample(&text, "sandfork_warm_pool_target"), Some(0.0));
    assert!(
        sample(&text, "sandfork_host_memory_available_bytes").is_some_and(|b| b > 0.0),
        "{text}"
    );
    for family in [
        "sandfork_lifecycle_events",
        "sandfork_operation_duration_seconds",
        "sandfork_fork_duration_seconds",
        "sandfork_fork_children",
        "sandfork_admission_refusals",
        "sandfork_cross_node_fork_children",
        "sandfork_template_build_duration_seconds",
        "sandfork_template_builds",
        "sandfork_sandboxes_memory_pss_bytes",
        "sandfork_network_slots",
        "sandfork_vmm_exits",
    ] {
        assert!(
            text.contains(&format!("# TYPE {family} ")),
            "{family}: {text}"
        );
    }
    // A team at its count limit, and a fork over the node's vCPUs: each
    // refused by its reason, and an error of its operation by its status.
    let (_, a_key) = team(&node, r#"{"name":"a","maxSandboxes":0}"#).await;
    let a = call(&node, keyed(&a_key, "POST", "/v2/sandboxes", "{}")).await;
    assert_error(&a, StatusCode::TOO_MANY_REQUESTS);
    let a = call(
        &node,
        authed("POST", "/sandboxes/run/fork", r#"{"count":3}"#),
    )
    .await;
    assert_error(&a, StatusCode::SERVICE_UNAVAILABLE);
    let text = scrape(&node).await;
    for (series, value) in [
        (
            r#"sandfork_admission_refusals_total{reason="team_sandboxes"}"#,
            1.0,
        ),
        (r#"sandfork_admission_refusals_total{reason="vcpus"}"#, 1.0),
        (
            r#"sandfork_operation_errors_total{operation="create",reason="429"}"#,
            1.0,
        ),
        (
            r#"sandfork_operation_errors_total{operation="fork",reason="503"}"#,
            1.0,
        ),
        (
            r#"sandfork_operation_duration_seconds_count{operation="create",outcome="error"}"#,
            1.0,
        ),
    ] {
        assert_eq!(sample(&text, series), Some(value), "{series}: {text}");
    }
    // A refused fork is no fork of N.
    assert_eq!(sample(&text, "sandfork_fork_children_count"), Some(0.0));
    // A kill: an operation, a lifecycle fact, one sandbox fewer.
    let a = node.authed("DELETE", "/sandboxes/run", "").await;
    assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.json);
    let text = scrape(&node).await;
    assert_eq!(sample(&text, running), None, "{text}");
    assert_eq!(
        sample(&text, r#"sandfork_lifecycle_events_total{kind="killed"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            r#"sandfork_operation_duration_seconds_count{operation="kill",outcome="ok"}"#
        ),
        Some(1.0),
        "{text}"
    );
}

#[tokio::test]
async fn metrics_count_builds_by_kind_and_status() {
    let node = node(&[]);
    let now = now_ms();
    let build = |id: &str, source: &str, status, finished: Option<u64>| BuildRecord {
        template_id: format!("t-{id}"),
        build_id: id.into(),
        name: id.into(),
        source: source.into(),
        vcpus: 1,
        mem_mib: 256,
        status,
        reason: None,
        started_at_ms: now,
        finished_at_ms: finished,
        log: Vec::new(),
        reason_step: None,
        e2b: None,
    };
    let store = node.manager.store();
    store
        .put_build(&build(
            "b1",
            "debian packages jq",
            BuildStatus::Building,
            None,
        ))
        .unwrap();
    store
        .put_build(&build(
            "b2",
            "image registry:5000/app:1",
            BuildStatus::Error,
            Some(now + 2500),
        ))
        .unwrap();
    for _ in 0..2 {
        // Scraped twice: a finished build is counted once.
        let text = scrape(&node).await;
        assert_eq!(
            sample(
                &text,
                r#"sandfork_template_builds{kind="build",status="building"}"#
            ),
            Some(1.0),
            "{text}"
        );
        assert_eq!(
            sample(
                &text,
                r#"sandfork_template_builds{kind="image",status="error"}"#
            ),
            Some(1.0),
            "{text}"
        );
        assert_eq!(
            sample(
                &text,
                r#"sandfork_template_build_duration_seconds_sum{kind="image",outcome="error"}"#
            ),
            Some(2.5),
            "{text}"
        );
    }
}

/// Every metric the Grafana dashboard in `deploy/grafana/` queries is a
/// family a node's or a gateway's scrape has.
#[tokio::test]
async fn the_grafana_dashboard_queries_only_families_scrapes_have() {
    let node = node(&[record("run", now_ms(), SandboxState::Running, "x")]);
    // The families whose labels come with their first event (an error's
    // status, a request's target) have one.
    node.refuses("DELETE", "/sandboxes/gone", "", StatusCode::NOT_FOUND)
        .await;
    let gateway = server::http::gateway::GatewayMetrics::new();
    gateway.request("create", 201, std::time::Duration::from_millis(5));
    let scraped = scrape(&node).await + &gateway.scrape_with(1, 0, true);
    let families: std::collections::HashSet<&str> = scraped
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next())
        .collect();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/grafana/sandfork.json"
    );
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut exprs = Vec::new();
    fn walk<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::Object(map) => {
                for (k, v) in map {
                    match (k.as_str(), v) {
                        ("expr" | "query", Value::String(s)) => out.push(s),
                        _ => walk(v, out),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|i| walk(i, out)),
            _ => {}
        }
    }
    walk(&dashboard, &mut exprs);
    assert!(exprs.len() >= 10, "{exprs:?}");
    let mut queried = 0;
    for expr in exprs {
        for name in expr
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .filter(|t| t.starts_with("sandfork_"))
        {
            let family = ["_bucket", "_count", "_sum", "_total"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .filter(|f| families.contains(f))
                .unwrap_or(name);
            assert!(
                families.contains(family),
                "the dashboard queries {name}, which no scrape has: {expr}"
            );
            queried += 1;
        }
    }
    assert!(queried >= 10, "{queried}");
}

/// A template with `volume_slots` slots, for creates that mount volumes.
fn slotted(data: &std::path::Path) -> TemplateRecord {
    TemplateRecord {
        volume_slots: 2,
        ..built(data, "slotted", "slotted", now_ms())
    }
}

/// `record` mounting volume `id` at `/data` (its copy, as a fork child's,
/// when `copy`).
fn mounting(record: SandboxRecord, id: &str, copy: bool) -> SandboxRecord {
    SandboxRecord {
        volume_mounts: vec![server::node::store::VolumeMount {
            volume_id: id.into(),
            name: "data".into(),
            slot: 0,
            path: "/data".into(),
            read_only: false,
            disk: "/nonexistent/volume.layer".into(),
            copy,
        }],
        ..record
    }
}

/// A create's `volumeMounts` (E2B's `{name, path}`) that cannot be
/// mounted as asked is refused before any guest starts: 400 for what the
/// request gets wrong, 409 for a volume another sandbox mounts (one writer
/// per volume; a fork child's copy is not the volume). One that passes the
/// checks gets as far as the template's files (this node has none).
#[tokio::test]
async fn a_create_mounts_free_volumes_of_its_team_in_its_templates_slots() {
    let node = node_with(&[], &[&slotted]);
    let data = new_volume(&node, KEY, r#"{"name":"data","sizeMB":64}"#).await;
    new_volume(&node, KEY, r#"{"name":"logs","sizeMB":64}"#).await;
    new_volume(&node, KEY, r#"{"name":"more","sizeMB":64}"#).await;
    let (_, b_key) = team(&node, r#"{"name":"b"}"#).await;
    new_volume(&node, &b_key, r#"{"name":"theirs","sizeMB":64}"#).await;
    let create = |template: &str, mounts: &str, extra: &str| {
        format!(r#"{{"templateID":"{template}","volumeMounts":{mounts}{extra}}}"#)
    };
    for (body, says) in [
        (
            create("slotted", r#"[{"name":"nope","path":"/data"}]"#, ""),
            "no volume named \"nope\"",
        ),
        (
            create("slotted", r#"[{"name":"theirs","path":"/data"}]"#, ""),
            "no volume named \"theirs\"",
        ),
        (
            create(
                "slotted",
                r#"[{"name":"data","path":"/a"},{"name":"data","path":"/b"}]"#,
                "",
            ),
            "named twice",
        ),
        (
            create(
                "slotted",
                r#"[{"name":"data","path":"/a"},{"name":"logs","path":"/a/"}]"#,
                "",
            ),
            "two volumes at /a",
        ),
        (
            create("slotted", r#"[{"name":"data","path":"data"}]"#, ""),
            "invalid path",
        ),
        (
            create("slotted", r#"[{"name":"data","path":"/"}]"#, ""),
            "invalid path",
        ),
        (
            create("slotted", r#"[{"name":"data","path":"/x/../etc"}]"#, ""),
            "invalid path",
        ),
        (
            create(
                "slotted",
                r#"[{"name":"data","path":"/a"},{"name":"logs","path":"/b"},{"name":"more","path":"/c"}]"#,
                "",
            ),
            "at most 2 volumes",
        ),
        (
            create("base", r#"[{"name":"data","path":"/data"}]"#, ""),
            "rebuild it",
        ),
        (
            create(
                "slotted",
                r#"[{"name":"data","path":"/data"}]"#,
                r#","autoPauseMemory":false"#,
            ),
            "autoPauseMemory",
        ),
        (
            r#"{"templateID":"slotted","volumeMounts":[{"name":"data"}]}"#.to_owned(),
            "path",
        ),
    ] {
        let a = node
            .refuses("POST", "/v2/sandboxes", &body, StatusCode::BAD_REQUEST)
            .await;
        let message = a.json["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
    }

    // Another sandbox, even paused, mounts it: 409 naming it.
    let id = data["volumeID"].as_str().unwrap();
    let mount = create("slotted", r#"[{"name":"data","path":"/data"}]"#, "");
    node.manager
        .store()
        .put_sandbox(&mounting(
            record("holder", now_ms(), SandboxState::Paused, "x"),
            id,
            false,
        ))
        .unwrap();
    let a = node
        .refuses("POST", "/v2/sandboxes", &mount, StatusCode::CONFLICT)
        .await;
    assert!(
        a.json["message"].as_str().unwrap().contains("holder"),
        "{}",
        a.json
    );
    // A fork child's copy of it leaves it free.
    node.manager.store().remove_sandbox("holder").unwrap();
    node.manager
        .store()
        .put_sandbox(&mounting(
            record("child", now_ms(), SandboxState::Running, "x"),
            id,
            true,
        ))
        .unwrap();
    // Past the checks: it fails at the template's files (this node has none).
    let a = node.authed("POST", "/v2/sandboxes", &mount).await;
    assert_error(&a, StatusCode::INTERNAL_SERVER_ERROR);
    // Nothing of the failed create stays to hold the volume.
    let holders: Vec<String> = node
        .manager
        .list()
        .unwrap()
        .into_iter()
        .filter(|s| !s.volume_mounts.is_empty())
        .map(|s| s.id)
        .collect();
    assert_eq!(holders, ["child"]);
}

/// Until snapshots and cold boots carry volumes, a sandbox that mounts one
/// refuses what would lose them (409 saying so). A fork of it paused copies
/// them (the SDK suite's `test_volumes.py`).
#[tokio::test]
async fn a_sandbox_with_volumes_refuses_what_would_lose_them() {
    let running = mounting(
        record("run", now_ms(), SandboxState::Running, "x"),
        "v1",
        false,
    );
    let paused = mounting(
        record("held", now_ms(), SandboxState::Paused, "x"),
        "v2",
        false,
    );
    let node = node(&[running, paused]);
    for (path, body) in [
        // A memory snapshot keeps them; a filesystem-only one cannot yet.
        ("/sandboxes/run/snapshots", r#"{"memory":false}"#),
        ("/sandboxes/run/pause", r#"{"memory":false}"#),
        // Paused without memory (a record made so): only a cold boot resumes it.
        ("/sandboxes/held/connect", r#"{"timeout":60}"#),
    ] {
        let a = node.refuses("POST", path, body, StatusCode::CONFLICT).await;
        assert!(
            a.json["message"]
                .as_str()
                .unwrap()
                .contains("mounting volumes"),
            "{path}: {}",
            a.json
        );
    }
    assert_eq!(
        node.manager.get("run").unwrap().state,
        SandboxState::Running
    );
    assert_eq!(
        node.manager.get("held").unwrap().state,
        SandboxState::Paused
    );
}

/// A filesystem-only snapshot (E2B's `memory: false`) has no memory to
/// restore: a fork of it is a 400 saying so, and so is a create of it with
/// volumes (its sandboxes cold-boot, which attaches none yet).
#[tokio::test]
async fn a_filesystem_only_snapshot_is_neither_forked_nor_given_volumes() {
    let fs_only = |d: &std::path::Path| TemplateRecord {
        filesystem_only: true,
        volume_slots: 2,
        ..snapshot(d, "fsnap", "gone", 10)
    };
    let node = node_with(&[], &[&fs_only]);
    new_volume(&node, KEY, r#"{"name":"data","sizeMB":64}"#).await;
    let a = node
        .refuses(
            "POST",
            "/snapshots/fsnap/fork",
            "{}",
            StatusCode::BAD_REQUEST,
        )
        .await;
    let message = a.json["message"].as_str().unwrap();
    assert!(message.contains("filesystem-only"), "{message}");
    let a = node
        .refuses(
            "POST",
            "/v2/sandboxes",
            r#"{"templateID":"fsnap","volumeMounts":[{"name":"data","path":"/data"}]}"#,
            StatusCode::BAD_REQUEST,
        )
        .await;
    let message = a.json["message"].as_str().unwrap();
    assert!(message.contains("filesystem-only snapshot"), "{message}");
}

#[tokio::test]
async fn the_console_is_served_without_a_key_and_its_data_takes_one() {
    let node = node(&[
        record("abc", 1, SandboxState::Running, "x"),
        record("def", 2, SandboxState::Paused, "x"),
    ]);
    let raw = |uri: &str| {
        let app = node.app.clone();
        let req = Request::get(uri).body(Body::empty()).unwrap();
        async move { app.oneshot(req).await.unwrap() }
    };
    let page = raw("/console/").await;
    assert_eq!(page.status(), StatusCode::OK);
    assert!(
        page.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    let policy = page.headers()["content-security-policy"].to_str().unwrap();
    assert!(policy.contains("script-src 'self'") && policy.contains("frame-ancestors 'none'"));
    let html = page.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&html).contains("/console/console.js"));
    for (uri, kind) in [
        ("/console/console.js", "text/javascript"),
        ("/console/console.css", "text/css"),
    ] {
        let a = raw(uri).await;
        assert_eq!(a.status(), StatusCode::OK, "{uri}");
        assert!(
            a.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with(kind)
        );
    }
    let bare = raw("/console").await;
    assert_eq!(bare.status(), StatusCode::PERMANENT_REDIRECT);
    assert_eq!(bare.headers()["location"], "/console/");
    // Nothing else under /console, and no data without the key.
    assert_eq!(
        raw("/console/api-key").await.status(),
        StatusCode::NOT_FOUND
    );
    assert_error(
        &call(
            &node,
            Request::get("/v1/sandboxes/abc/lineage")
                .body(Body::empty())
                .unwrap(),
        )
        .await,
        StatusCode::UNAUTHORIZED,
    );

    // A sandbox no fork made is its own root (its template from its record).
    let a = node.authed("GET", "/v1/sandboxes/def/lineage", "").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json);
    assert_eq!(
        a.json,
        serde_json::json!({"rootID": "def", "sandboxID": "def", "nodes": [
            {"sandboxID": "def", "parentID": null, "branch": null, "state": "paused", "templateID": "base"}]})
    );
    node.refuses(
        "GET",
        "/v1/sandboxes/nosuch/lineage",
        "",
        StatusCode::NOT_FOUND,
    )
    .await;
    // A killed one stays known, gone, while its event is among the node's last.
    let killed = node.authed("DELETE", "/sandboxes/abc", "").await;
    assert_eq!(killed.status, StatusCode::NO_CONTENT);
    let mut state = Value::Null;
    for _ in 0..100 {
        let a = node.authed("GET", "/v1/sandboxes/abc/lineage", "").await;
        if a.status == StatusCode::OK {
            state = a.json["nodes"][0]["state"].clone();
            assert_eq!(a.json["nodes"][0]["templateID"], "base", "{}", a.json);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(state, "gone");

    // Another team's key sees neither, live nor gone: as unknown ones.
    let (_, b_key) = team(&node, r#"{"name":"b"}"#).await;
    for id in ["abc", "def"] {
        let uri = format!("/v1/sandboxes/{id}/lineage");
        assert_error(
            &call(&node, keyed(&b_key, "GET", &uri, "")).await,
            StatusCode::NOT_FOUND,
        );
    }
}

// ---- A gateway's gathered answers ---------------------------------------------

/// A gateway's list, gathered from every node of a real etcd's map, lists
/// what the nodes that answered hold and names in a header those that did
/// not (a node crashed before its lease ran out): a client can tell a
/// partial list from a whole one.
#[tokio::test]
async fn a_gateways_list_names_the_nodes_that_did_not_answer() {
    use sandfork_cluster::Registration;
    use sandfork_cluster::keyspace::NodeCapacity;
    let etcd = sandfork_cluster::harness::Etcd::start().unwrap();
    let cluster = sandfork_cluster::Cluster::connect(&etcd.endpoints())
        .await
        .unwrap();
    // A node that answers: this file's node (no VMM: a list needs none).
    let node = node(&[record("live1", now_ms(), SandboxState::Running, "x")]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let live = listener.local_addr().unwrap().to_string();
    let app = node.app.clone();
    tokio::spawn(async move { axum::serve(listener, app).await });
    // And one whose port nobody listens on any more.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let capacity = NodeCapacity {
        max_sandboxes: 16,
        vcpus: 16,
        memory_mib: 16 << 10,
    };
    let ttl = std::time::Duration::from_secs(60);
    let _registered = [
        Registration::start(cluster.clone(), "n-live", &live, capacity, ttl)
            .await
            .unwrap(),
        Registration::start(cluster.clone(), "n-dead", &dead, capacity, ttl)
            .await
            .unwrap(),
    ];
    let gateway = server::http::gateway::router(cluster, Default::default());
    for uri in ["/v2/sandboxes", "/sandboxes"] {
        let a = gateway
            .clone()
            .oneshot(authed("GET", uri, ""))
            .await
            .unwrap();
        assert_eq!(a.status(), StatusCode::OK, "{uri}");
        assert_eq!(
            a.headers()[server::wire::UNREACHABLE_NODES_HEADER],
            "n-dead",
            "{uri}"
        );
        let body = a.into_body().collect().await.unwrap().to_bytes();
        let listed: Vec<Value> = serde_json::from_slice(&body).unwrap();
        let ids: Vec<&str> = listed
            .iter()
            .filter_map(|s| s["sandboxID"].as_str())
            .collect();
        assert_eq!(ids, ["live1"], "{uri}");
    }
}

/// A stand-in node for a gateway's placement: it notes each create it is
/// sent (by its name) and answers 201, or 503 "being built" with
/// [`server::wire::BUILDING_HEADER`] when `building` (a node waiting for
/// the cluster's one conversion of an image).
async fn placement_node(
    name: &'static str,
    got: Arc<std::sync::Mutex<Vec<&'static str>>>,
    building: Arc<std::sync::atomic::AtomicBool>,
) -> String {
    use axum::response::IntoResponse;
    let app = axum::Router::new().fallback(move || {
        let (got, building) = (got.clone(), building.clone());
        async move {
            got.lock().unwrap().push(name);
            if building.load(std::sync::atomic::Ordering::Relaxed) {
                let mut r = (StatusCode::SERVICE_UNAVAILABLE, "being built").into_response();
                r.headers_mut()
                    .insert(server::wire::BUILDING_HEADER, "1".parse().unwrap());
                return r;
            }
            (StatusCode::CREATED, "{}").into_response()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// A gateway places a create that names a registry image (as its template
/// id, or under the image metadata key) on a node that has the image's
/// template (published in its load), though another is a little freer;
/// else on the node converting it (its claim in etcd), so the cluster
/// converts it once; else on the freest. A "being built" answer to a create
/// of an image is the answer (no other node is tried: it would wait for the
/// same conversion).
#[tokio::test]
async fn a_gateway_places_an_image_where_its_template_is_or_is_being_converted() {
    use sandfork_cluster::keyspace::{NodeCapacity, NodeLoad};
    use sandfork_cluster::{ImageConversion, Registration};
    use std::sync::atomic::{AtomicBool, Ordering};
    const HELD: &str = "127.0.0.1:5000/task/held:v1";
    const NEW: &str = "127.0.0.1:5000/task/new:v1";
    let etcd = sandfork_cluster::harness::Etcd::start().unwrap();
    let cluster = sandfork_cluster::Cluster::connect(&etcd.endpoints())
        .await
        .unwrap();
    let got = Arc::new(std::sync::Mutex::new(Vec::new()));
    let building: Vec<Arc<AtomicBool>> = (0..3).map(|_| Arc::default()).collect();
    let capacity = NodeCapacity {
        max_sandboxes: 16,
        vcpus: 16,
        memory_mib: 16 << 10,
    };
    let ttl = std::time::Duration::from_secs(60);
    let mut nodes = Vec::new();
    for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
        let addr = placement_node(name, got.clone(), building[i].clone()).await;
        nodes.push(
            Registration::start(cluster.clone(), name, &addr, capacity, ttl)
                .await
                .unwrap(),
        );
    }
    // a is the freest; b, a little fuller, has HELD's template; c, fuller
    // still, converts NEW.
    let load = |sandboxes: u64, templates: &[&str]| NodeLoad {
        sandboxes,
        templates: templates.iter().map(|t| t.to_string()).collect(),
        ..NodeLoad::default()
    };
    nodes[1].set_load(load(1, &["base", HELD]));
    nodes[2].set_load(load(2, &["base", "t9"]));
    assert_eq!(
        nodes[2].claim_image(NEW).await.unwrap(),
        ImageConversion::Claimed
    );
    let gateway = server::http::gateway::router(
        cluster,
        server::http::gateway::GatewayOptions {
            image_metadata_key: Some("image".into()),
            ..Default::default()
        },
    );
    // Where one create lands (the gateway's view follows etcd within
    // moments: until then it may place as any create).
    let placed = async |body: String, want: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            got.lock().unwrap().clear();
            let a = gateway
                .clone()
                .oneshot(authed("POST", "/sandboxes", &body))
                .await
                .unwrap();
            let went = got.lock().unwrap().clone();
            if went.first() == Some(&want) || std::time::Instant::now() > deadline {
                return (a.status(), went);
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    };
    // Held: b, by its template id (unnormalised) or the metadata key.
    let (status, went) = placed(format!(r#"{{"templateID":"{HELD}"}}"#), "b").await;
    assert_eq!((status, &went[..]), (StatusCode::CREATED, &["b"][..]));
    let by_key = format!(r#"{{"metadata":{{"image":"{HELD}"}}}}"#);
    assert_eq!(placed(by_key, "b").await.1, ["b"]);
    // Being converted: c.
    let new = format!(r#"{{"templateID":"{NEW}"}}"#);
    assert_eq!(placed(new.clone(), "c").await.1, ["c"]);
    // Neither: the freest, a.
    let other = r#"{"templateID":"127.0.0.1:5000/task/other:v1"}"#.to_owned();
    assert_eq!(placed(other, "a").await.1, ["a"]);
    // c is still converting it: its "being built" is the answer, at once.
    building[2].store(true, Ordering::Relaxed);
    let (status, went) = placed(new.clone(), "c").await;
    assert_eq!(
        (status, &went[..]),
        (StatusCode::SERVICE_UNAVAILABLE, &["c"][..])
    );
    // A template's build (not an image's) there: a refusal, the next tried.
    let (status, went) = placed(r#"{"templateID":"t9"}"#.into(), "c").await;
    assert_eq!((status, &went[..]), (StatusCode::CREATED, &["c", "a"][..]));
    // Its claim given back (its template stored): placed as any create.
    assert!(nodes[2].release_image(NEW).await.unwrap());
    let (status, went) = placed(new, "a").await;
    assert_eq!((status, &went[..]), (StatusCode::CREATED, &["a"][..]));
}

//! The node's HTTP API in-process: any method, a route with fuzzed ids or a
//! fuzzed path, E2B's headers (the API key, the proxy's sandbox routing
//! headers, a fuzzed Host) and a fuzzed JSON body, through the real router
//! and handlers over a real store. Its VMM binary does not exist, so nothing
//! here starts a microVM.
#![no_main]

use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::http::{Method, Request};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use sandfork_fuzz::{Cursor, scratch_dir};
use server::http::api::{AppState, router};
use server::node::config::Config;
use server::node::keys::ApiKeys;
use server::node::pool::Pool;
use server::node::sandbox::Manager;
use server::node::store::{Store, TemplateRecord};
use server::node::template::Templates;
use server::node::webhooks::Webhooks;
use tower::ServiceExt;

const KEY: &str = "e2b_0123456789abcdef0123456789abcdef01234567";

const ROUTES: &[&str] = &[
    "/health",
    "/sandboxes",
    "/v2/sandboxes",
    "/sandboxes/{}",
    "/sandboxes/{}/timeout",
    "/sandboxes/{}/refreshes",
    "/sandboxes/metrics?sandbox_ids={}",
    "/sandboxes/{}/pause",
    "/sandboxes/{}/resume",
    "/sandboxes/{}/connect",
    "/v2/sandboxes/{}/connect",
    "/sandboxes/{}/fork",
    "/sandboxes/{}/snapshots",
    "/snapshots?{}",
    "/sandboxes/{}/metrics",
    "/sandboxes/{}/logs?{}",
    "/v2/sandboxes/{}/logs",
    "/v1/node",
    "/v1/sandboxes/{}/diagnostics",
    "/templates",
    "/templates/{}",
    "/templates/{}/builds/{}/status",
    "/v2/sandboxes?{}",
    "/files?{}",
    "/process.Process/Start",
    "/events/webhooks",
    "/events/webhooks/{}",
    "/events/webhooks/{}/deliveries",
    "/events/sandboxes?{}",
];
const METHODS: &[Method] = &[
    Method::GET,
    Method::POST,
    Method::DELETE,
    Method::PATCH,
    Method::PUT,
];

struct Node {
    runtime: tokio::runtime::Runtime,
    app: axum::Router,
}

fn node() -> &'static Node {
    static NODE: OnceLock<Node> = OnceLock::new();
    NODE.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let dir = scratch_dir().join("node");
        std::fs::create_dir_all(&dir).expect("node dir");
        let mut config = Config::new(
            "127.0.0.1:0".parse().expect("addr"),
            "/nonexistent/vmlinux".into(),
            "/nonexistent/rootfs.ext4".into(),
            "/nonexistent/sandfork-vmm".into(),
        );
        config.data_dir = dir.clone();
        config.run_dir = Some(dir.join("run"));
        config.pool_size = 0;
        std::fs::create_dir_all(config.sandboxes_dir()).expect("sandboxes dir");
        let store = Store::open(&dir.join("s.redb")).expect("store");
        let template = TemplateRecord {
            id: "base".into(),
            dir: dir.join("templates/base"),
            snapshot: dir.join("templates/base/vm.state"),
            mem: dir.join("templates/base/vm.mem"),
            root_layer: dir.join("templates/base/root.layer"),
            root_drive_id: "rootfs".into(),
            kernel: config.kernel.clone(),
            rootfs: config.rootfs.clone(),
            vcpus: 1,
            mem_mib: 256,
            disk_size_mb: 2048,
            ..Default::default()
        };
        let app = runtime.block_on(async {
            let pool = Pool::start(config.vmm.clone(), config.run_dir(), 0);
            let manager = Manager::new(config, store, pool, template);
            let templates = Templates::new(manager.clone());
            let webhooks = Webhooks::start(&manager, Default::default());
            router(Arc::new(AppState {
                manager,
                templates,
                webhooks,
                keys: ApiKeys::for_key(KEY),
                guests: Default::default(),
                cluster: Default::default(),
                creates: Default::default(),
            }))
        });
        Node { runtime, app }
    })
}

fuzz_target!(|data: &[u8]| {
    let node = node();
    let mut c = Cursor::new(data);
    let method = METHODS[usize::from(c.u8()) % METHODS.len()].clone();
    let route = c.u8();
    let flags = c.u8();
    let id_len = usize::from(c.u8() % 64);
    let id = String::from_utf8_lossy(c.bytes(id_len)).into_owned();
    let path = match ROUTES.get(usize::from(route)) {
        Some(r) => r.replace("{}", &id),
        None => format!("/{id}"),
    };
    let mut request = Request::builder().method(method).uri(path);
    if flags & 1 != 0 {
        request = request.header("X-API-Key", KEY);
    }
    if flags & 2 != 0 {
        request = request
            .header("E2b-Sandbox-Id", id.as_str())
            .header("E2b-Sandbox-Port", "49983");
    }
    if flags & 4 != 0 {
        request = request.header("Host", format!("49983-{id}.sandfork.test"));
    }
    if flags & 8 != 0 {
        request = request.header("X-Access-Token", id.as_str());
    }
    let Ok(request) = request.body(Body::from(c.rest().to_vec())) else {
        return;
    };
    let app = node.app.clone();
    node.runtime.block_on(async move {
        let response = app.oneshot(request).await.expect("infallible");
        let _ = response.into_body().collect().await;
    });
});

//! The VMM's Firecracker-style HTTP API in-process: any method, a route with
//! fuzzed path ids or a fuzzed path, and a fuzzed JSON body, through the real
//! router (body limits, JSON parsing, validation, path-id checks). No
//! controller runs, so valid requests end in its "not running" answer.
#![no_main]

use std::sync::OnceLock;

use axum::body::Body;
use axum::http::{Method, Request};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use sandfork_fuzz::Cursor;
use tower::ServiceExt;

const ROUTES: &[&str] = &[
    "/",
    "/machine-config",
    "/boot-source",
    "/drives/{}",
    "/vsock",
    "/network-interfaces/{}",
    "/actions",
    "/vm",
    "/vm/config",
    "/snapshot/create",
    "/snapshot/load",
    "/fork",
    "/vcpus",
    "/devices",
];
const METHODS: &[Method] = &[
    Method::GET,
    Method::PUT,
    Method::PATCH,
    Method::POST,
    Method::DELETE,
];

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    })
}

fuzz_target!(|data: &[u8]| {
    let mut c = Cursor::new(data);
    let method = METHODS[usize::from(c.u8()) % METHODS.len()].clone();
    let route = c.u8();
    let id_len = usize::from(c.u8() % 64);
    let id = String::from_utf8_lossy(c.bytes(id_len)).into_owned();
    let path = match ROUTES.get(usize::from(route)) {
        Some(r) => r.replace("{}", &id),
        None => format!("/{id}"),
    };
    let body = c.rest().to_vec();
    let Ok(request) = Request::builder()
        .method(method)
        .uri(path)
        .body(Body::from(body))
    else {
        return;
    };
    let (sender, receiver) = vmm::api_server::api_channel().expect("api channel");
    drop(receiver);
    let router = vmm::api_server::router(sender);
    runtime().block_on(async move {
        let response = router.oneshot(request).await.expect("infallible");
        let _ = response.into_body().collect().await;
    });
});

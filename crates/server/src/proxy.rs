//! The envd proxy: requests for a sandbox (by `E2b-Sandbox-Id` and
//! `E2b-Sandbox-Port` headers, or a `<port>-<id>.<domain>` host name) go to
//! that guest port over the sandbox's vsock socket, bodies streamed both ways.
//! Everything else is the control plane and never reaches a guest.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{self, HeaderMap, HeaderName};
use axum::http::{StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use vmm_api::process::AGENT_PORT;
use vmm_api::vsock_connect::{self, VsockConnectError};

use crate::api::Shared;
use crate::ids;

pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
pub const SANDBOX_PORT_HEADER: &str = "e2b-sandbox-port";

/// Where a request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    Sandbox { id: String, port: u32 },
    ControlPlane,
}

/// Paths of the control plane: never proxied, whatever headers they carry
/// (some SDK versions send routing headers on `POST /sandboxes/{id}/connect`).
fn is_control_path(path: &str) -> bool {
    const PREFIXES: &[&str] = &[
        "/sandboxes",
        "/v2/",
        "/v3/",
        "/snapshots",
        "/templates",
        "/volumes",
        "/secrets",
        "/teams",
        "/nodes",
        "/access-tokens",
        "/api-keys",
    ];
    PREFIXES.iter().any(|p| {
        path.strip_prefix(p)
            .is_some_and(|rest| p.ends_with('/') || rest.is_empty() || rest.starts_with('/'))
    })
}

/// `<port>-<id>.<anything>` (the port of the host header is ignored).
pub fn parse_host(host: &str) -> Option<(u32, String)> {
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    };
    let (label, rest) = name.split_once('.')?;
    if rest.is_empty() {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    let port: u32 = port.parse().ok().filter(|p| (1..=65535).contains(p))?;
    let id = id.to_ascii_lowercase();
    ids::is_sandbox_id(&id).then_some((port, id))
}

/// Decides where a request goes: a sandbox host name wins; then routing
/// headers, unless the path belongs to the control plane.
pub fn route(headers: &HeaderMap, uri: &Uri) -> Route {
    let host = uri.authority().map(|a| a.as_str().to_owned()).or_else(|| {
        headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .map(str::to_owned)
    });
    if let Some((port, id)) = host.as_deref().and_then(parse_host) {
        return Route::Sandbox { id, port };
    }
    let Some(id) = headers.get(SANDBOX_ID_HEADER).and_then(|v| v.to_str().ok()) else {
        return Route::ControlPlane;
    };
    if is_control_path(uri.path()) {
        return Route::ControlPlane;
    }
    let port = headers
        .get(SANDBOX_PORT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or(AGENT_PORT);
    Route::Sandbox {
        id: id.trim().to_owned(),
        port,
    }
}

/// Middleware in front of every route: proxies sandbox traffic, passes the rest on.
pub async fn dispatch(State(state): State<Shared>, req: Request, next: Next) -> Response {
    match route(req.headers(), req.uri()) {
        Route::ControlPlane => next.run(req).await,
        Route::Sandbox { id, port } => forward(&state, &id, port, req).await,
    }
}

/// E2B's proxy answer for a sandbox it does not know: the SDKs read "was not
/// found" as "not running".
fn not_found(id: &str) -> Response {
    let body = serde_json::json!({
        "sandboxId": id,
        "message": "The sandbox was not found",
        "code": 502,
    });
    (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
}

fn port_closed(id: &str, port: u32, why: &str) -> Response {
    let body = serde_json::json!({
        "sandboxId": id,
        "port": port,
        "message": format!("The sandbox is running but port is not open ({why})"),
        "code": 502,
    });
    (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
}

/// Headers that belong to one connection, not to the message.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::PROXY_AUTHORIZATION,
        header::PROXY_AUTHENTICATE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
}

async fn forward(state: &Shared, id: &str, port: u32, mut req: Request) -> Response {
    let Some(uds) = state.manager.vsock_path(id) else {
        return not_found(id);
    };
    let stream = match vsock_connect::connect(&uds, port).await {
        Ok(s) => s,
        Err(VsockConnectError::Connect { .. }) => return not_found(id),
        Err(e) => return port_closed(id, port, &e.to_string()),
    };
    let (mut sender, connection) =
        match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await {
            Ok(pair) => pair,
            Err(e) => return port_closed(id, port, &e.to_string()),
        };
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!("proxied connection: {e}");
        }
    });
    // Origin form towards the guest; the body goes on as it arrives.
    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .parse()
        .unwrap_or_else(|_| Uri::from_static("/"));
    *req.uri_mut() = path;
    strip_hop_by_hop(req.headers_mut());
    match sender.send_request(req).await {
        Ok(response) => {
            let (mut parts, body) = response.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            Response::from_parts(parts, Body::new(body))
        }
        Err(e) => port_closed(id, port, &e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn sandbox(id: &str, port: u32) -> Route {
        Route::Sandbox {
            id: id.into(),
            port,
        }
    }

    #[test]
    fn host_names_name_port_and_sandbox() {
        assert_eq!(
            parse_host("49983-abc123.sandfork.example:3000"),
            Some((49983, "abc123".into()))
        );
        assert_eq!(parse_host("8080-abc.localhost"), Some((8080, "abc".into())));
        for not in [
            "localhost:3000",
            "127.0.0.1:3000",
            "sandbox.example.com",
            "49983-abc",
            "x-abc.example",
            "0-abc.example",
            "70000-abc.example",
            "49983-a-b.example",
            "49983-.example",
            "[::1]:3000",
        ] {
            assert_eq!(parse_host(not), None, "{not}");
        }
    }

    #[test]
    fn headers_route_envd_paths_only() {
        let h = headers(&[("host", "localhost:3000"), ("e2b-sandbox-id", "abc")]);
        for path in [
            "/process.Process/Start",
            "/filesystem.Filesystem/Stat",
            "/files?path=/a",
            "/health",
            "/envs",
            "/execute",
        ] {
            assert_eq!(
                route(&h, &path.parse().unwrap()),
                sandbox("abc", 49983),
                "{path}"
            );
        }
        for path in [
            "/sandboxes",
            "/sandboxes/abc/connect",
            "/v2/sandboxes",
            "/v2/sandboxes/abc/connect",
            "/templates/x",
            "/snapshots",
        ] {
            assert_eq!(
                route(&h, &path.parse().unwrap()),
                Route::ControlPlane,
                "{path}"
            );
        }
        // A path that only starts like a control-plane one is not one.
        assert_eq!(
            route(&h, &"/sandboxesx".parse().unwrap()),
            sandbox("abc", 49983)
        );
        let h = headers(&[("e2b-sandbox-id", "abc"), ("e2b-sandbox-port", "49999")]);
        assert_eq!(
            route(&h, &"/execute".parse().unwrap()),
            sandbox("abc", 49999)
        );
    }

    #[test]
    fn without_routing_the_control_plane_answers() {
        let h = headers(&[("host", "localhost:3000")]);
        assert_eq!(route(&h, &"/health".parse().unwrap()), Route::ControlPlane);
        assert_eq!(route(&h, &"/files".parse().unwrap()), Route::ControlPlane);
        // Host names win over headers, for every path.
        let h = headers(&[("host", "49983-xyz.example.com"), ("e2b-sandbox-id", "abc")]);
        assert_eq!(
            route(&h, &"/sandboxes".parse().unwrap()),
            sandbox("xyz", 49983)
        );
    }

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut h = headers(&[
            ("connection", "keep-alive, x-private"),
            ("x-private", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("content-type", "application/connect+json"),
            ("x-access-token", "t"),
        ]);
        strip_hop_by_hop(&mut h);
        let mut names: Vec<_> = h.keys().map(|k| k.as_str().to_owned()).collect();
        names.sort();
        assert_eq!(names, ["content-type", "x-access-token"]);
    }
}

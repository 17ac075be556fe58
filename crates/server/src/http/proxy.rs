//! The envd proxy: requests for a sandbox (by `E2b-Sandbox-Id` and
//! `E2b-Sandbox-Port` headers, or a `<port>-<id>.<domain>` host name) go to
//! that guest port over the sandbox's vsock socket, bodies streamed both ways.
//! A guest port other than envd's is guarded as the sandbox's E2B ingress
//! settings say ([`Ingress`]: traffic token, masked host).
//! Everything else is the control plane and never reaches a guest.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use axum::http::{StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use vmm_driver::vsock_connect::VsockConnectError;

use crate::http::state::Shared;
use crate::node::ids;
pub use crate::wire::UNROUTED_METHOD_HEADER;
use crate::wire::{self, ACCESS_TOKEN_HEADER, SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER};

mod connections;
mod guest_tls;
mod stream_end;
pub use crate::node::ingress::{Ingress, IngressError, Refusal};
pub use connections::{ForwardError, GuestConnections, Unanswered};

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
        .unwrap_or(envd_proto::PORT);
    Route::Sandbox {
        id: id.trim().to_owned(),
        port,
    }
}

/// Paths only envd serves (a request for them that names no sandbox is
/// looked up by its token or URL signature).
pub fn is_envd_path(path: &str) -> bool {
    path == "/files"
        || path == "/files/compose"
        || path == "/envs"
        || path.starts_with("/process.Process/")
        || path.starts_with("/filesystem.Filesystem/")
}

/// `"v1_" + base64_nopad(sha256("<path>:<op>:<username>:<token>[:<expiration>]"))`,
/// the envd file-URL signature (spec §3.2).
pub fn file_signature(
    path: &str,
    write: bool,
    username: &str,
    token: &str,
    expiration: Option<&str>,
) -> String {
    use base64::Engine;
    use sha2::{Digest, Sha256};
    let op = if write { "write" } else { "read" };
    let mut text = format!("{path}:{op}:{username}:{token}");
    if let Some(exp) = expiration {
        text.push(':');
        text.push_str(exp);
    }
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(text.as_bytes()))
    )
}

/// How the proxy finds a sandbox by its access token: the manager's
/// in-memory index (a list in tests).
pub trait SandboxTokens {
    /// The sandbox taking traffic whose access token is `token`.
    fn by_token(&self, token: &str) -> Option<String>;
    /// Every sandbox taking traffic with a token: (id, token).
    fn all(&self) -> Vec<(String, String)>;
}

impl SandboxTokens for crate::node::sandbox::Manager {
    fn by_token(&self, token: &str) -> Option<String> {
        self.serving_by_token(token)
            .or_else(|| self.paused_by_pressure_with_token(token))
    }

    fn all(&self) -> Vec<(String, String)> {
        self.serving_tokens()
    }
}

impl SandboxTokens for [(String, String)] {
    fn by_token(&self, token: &str) -> Option<String> {
        self.iter()
            .find(|(_, t)| crate::node::keys::same_secret(t.as_bytes(), token.as_bytes()))
            .map(|(id, _)| id.clone())
    }

    fn all(&self) -> Vec<(String, String)> {
        self.to_vec()
    }
}

/// For requests with no routing (older SDKs after `connect`, signed file
/// URLs under `E2B_SANDBOX_URL`): the sandbox whose access token the request
/// carries, or whose token signs its `/files` URL.
pub fn find_unrouted(
    headers: &HeaderMap,
    method: &axum::http::Method,
    uri: &Uri,
    tokens: &(impl SandboxTokens + ?Sized),
) -> Option<String> {
    if !is_envd_path(uri.path()) {
        return None;
    }
    let header_token = headers
        .get(ACCESS_TOKEN_HEADER)
        .and_then(|v| v.to_str().ok());
    let query: Vec<(String, String)> = form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
        .into_owned()
        .collect();
    let get = |k: &str| query.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let signature = get("signature");
    if header_token.is_none() && (uri.path() != "/files" || signature.is_none()) {
        return None;
    }
    if let Some(t) = header_token {
        return tokens.by_token(t);
    }
    let (path, username) = (get("path").unwrap_or(""), get("username").unwrap_or(""));
    let expiration = get("signature_expiration").filter(|e| !e.is_empty());
    let write = method == axum::http::Method::POST;
    tokens
        .all()
        .into_iter()
        .find(|(_, tok)| {
            Some(file_signature(path, write, username, tok, expiration).as_str()) == signature
        })
        .map(|(id, _)| id)
}

/// Where a gateway asks a node which of its sandboxes an envd request that
/// names none belongs to ([`unrouted_owner`]): this prefix, then the
/// request's path and query; its method in [`UNROUTED_METHOD_HEADER`], its
/// `X-Access-Token` as it came.
pub const UNROUTED_PREFIX: &str = "/v1/unrouted";

/// `GET /v1/unrouted/<envd path>?<query>`: 200 [`wire::SandboxOwner`] when a
/// sandbox here has the request's access token or signed its file URL, else
/// 404. No API key: the token or signature is the credential, and all it
/// tells is the id of the sandbox they belong to.
pub async fn unrouted_owner(State(state): State<Shared>, req: Request) -> Response {
    let path = req.uri().path().strip_prefix(UNROUTED_PREFIX).unwrap_or("");
    let target = match req.uri().query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_owned(),
    };
    let method = req
        .headers()
        .get(UNROUTED_METHOD_HEADER)
        .and_then(|m| axum::http::Method::from_bytes(m.as_bytes()).ok())
        .unwrap_or(axum::http::Method::GET);
    let owner = target
        .parse::<Uri>()
        .ok()
        .and_then(|uri| find_unrouted(req.headers(), &method, &uri, &*state.manager));
    match owner {
        Some(sandbox_id) => axum::Json(wire::SandboxOwner { sandbox_id }).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// `/files` with a `signature` and no `X-Access-Token`: a signed file URL.
fn is_signed_files_request(headers: &HeaderMap, uri: &Uri) -> bool {
    uri.path() == "/files"
        && !headers.contains_key(ACCESS_TOKEN_HEADER)
        && form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
            .any(|(k, v)| k == "signature" && !v.is_empty())
}

/// Middleware in front of every route: proxies sandbox traffic, passes the rest on.
pub async fn dispatch(State(state): State<Shared>, req: Request, next: Next) -> Response {
    match route(req.headers(), req.uri()) {
        Route::Sandbox { id, port } => forward(&state, &id, port, req).await,
        Route::ControlPlane => {
            match find_unrouted(req.headers(), req.method(), req.uri(), &*state.manager) {
                Some(id) => forward(&state, &id, envd_proto::PORT, req).await,
                // A signed file URL no running sandbox signed: envd's answer
                // to a wrong signature (clients compare the text), not the
                // node's "no such route".
                None if is_signed_files_request(req.headers(), req.uri()) => {
                    error(StatusCode::UNAUTHORIZED, "invalid signature")
                }
                None => next.run(req).await,
            }
        }
    }
}

/// An E2B Error body (`{"code", "message"}`) with its status.
fn error(status: StatusCode, message: &str) -> Response {
    let body = wire::Error {
        code: status.as_u16(),
        message: message.to_owned(),
        error_code: None,
    };
    (status, axum::Json(body)).into_response()
}

/// E2B's proxy answer about sandbox `id` (on `port`, when it is not envd's
/// as a whole): its status is the body's `code`.
fn proxy_error(status: StatusCode, id: &str, port: Option<u32>, message: String) -> Response {
    let body = wire::ProxyError {
        sandbox_id: id.to_owned(),
        port,
        message,
        code: status.as_u16(),
    };
    (status, axum::Json(body)).into_response()
}

/// E2B's proxy answer for a sandbox it does not know: the SDKs read "was not
/// found" as "not running".
pub(crate) fn not_found(id: &str) -> Response {
    proxy_error(
        StatusCode::BAD_GATEWAY,
        id,
        None,
        "The sandbox was not found".to_owned(),
    )
}

fn port_closed(id: &str, port: u32, why: &str) -> Response {
    proxy_error(
        StatusCode::BAD_GATEWAY,
        id,
        Some(port),
        format!("The sandbox is running but port is not open ({why})"),
    )
}

/// A request refused for its traffic token: E2B's 403.
fn refused(refusal: Refusal, id: &str) -> Response {
    proxy_error(StatusCode::FORBIDDEN, id, None, refusal.message())
}

/// Headers that belong to one connection, not to the message (the envd proxy
/// and the cluster gateway both forward).
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
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
    // Counted before the guest is looked up: a memory pressure pause that
    // starts now sees it and gives way (see `Manager::pause_for`). Held
    // until the answer's body ends.
    let in_use = state.manager.in_use(id);
    let uds = match state.manager.vsock_path(id) {
        Some(uds) => uds,
        // Paused by the node for memory pressure: it resumes transparently,
        // for a request its guest would take.
        None => match refuse_wake(state, id, port, &req) {
            Some(refused) => return refused,
            None => match state.manager.wake(id).await {
                Ok(Some(uds)) => uds,
                Ok(None) => return not_found(id),
                Err(e) => return not_woken(id, &e),
            },
        },
    };
    // The guest's own ports: a private sandbox's token, its masked host,
    // TLS to its `httpsPorts`.
    let mut tls = false;
    if port != envd_proto::PORT
        && let Some(ingress) = state.manager.ingress(id)
    {
        if let Err(refusal) = ingress.admit(req.headers()) {
            return refused(refusal, id);
        }
        let uri = req.uri().clone();
        ingress.mask(port, &uri, req.headers_mut());
        tls = ingress.is_https(port);
    }
    // Origin form towards the guest; the body goes on as it arrives.
    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .parse()
        .unwrap_or_else(|_| Uri::from_static("/"));
    *req.uri_mut() = path;
    let upgrade = requested_upgrade(req.headers());
    let client = upgrade.is_some().then(|| hyper::upgrade::on(&mut req));
    strip_hop_by_hop(req.headers_mut());
    if let Some(protocol) = upgrade {
        keep_upgrade(req.headers_mut(), protocol);
    }
    // A guest that stopped answering ends the wait for its answer (the
    // observer decides; see `sandbox::observe`): never a request hanging on.
    let sent = state.guests.send(&uds, port, tls, req);
    let answer = match state.manager.unresponsive_watch(id) {
        Some(stuck) => tokio::select! {
            answer = sent => answer,
            () = until_unresponsive(stuck, UNRESPONSIVE_GRACE) => return unresponsive(id),
        },
        None => sent.await,
    };
    match answer {
        Ok(mut response) => {
            if let Some(in_use) = &in_use {
                in_use.heard();
            }
            let switched = response.status() == StatusCode::SWITCHING_PROTOCOLS;
            let upgraded = match client {
                Some(client) if switched => {
                    splice_upgrades(client, hyper::upgrade::on(&mut response));
                    requested_upgrade(response.headers())
                }
                _ => None,
            };
            let (mut parts, body) = response.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            if let Some(protocol) = upgraded {
                keep_upgrade(&mut parts.headers, protocol);
            }
            // The guard goes when the body does.
            let body = body.map_frame(move |frame| {
                if let Some(in_use) = &in_use {
                    in_use.heard();
                }
                frame
            });
            let body = if is_connect_stream(&parts) {
                Body::new(stream_end::EndedStream::new(body, id))
            } else {
                Body::new(body)
            };
            Response::from_parts(parts, body)
        }
        Err(Unanswered { error, unsent }) => {
            // The client may still be sending the body: read it before the
            // answer ends the connection, which would otherwise reach the
            // client as a reset rather than as this answer.
            if let Some(req) = unsent {
                drain(req.into_body()).await;
            }
            match error {
                ForwardError::Connect(VsockConnectError::Connect { .. }) => not_found(id),
                e => {
                    if matches!(e, ForwardError::Gave { .. }) {
                        tracing::warn!("sandbox {id}: proxied request to port {port}: {e}");
                    }
                    port_closed(id, port, &e.to_string())
                }
            }
        }
    }
}

/// The most of an unanswered request's body read before its error answer,
/// and for how long.
const DRAIN_MAX: usize = 1 << 20;
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// Reads what is left of a request body the guest never got, up to a bound:
/// hyper answers and then closes a connection whose request body was not
/// read to its end, and data arriving at a closed socket resets it, which
/// can lose the answer (likely what a client behind QEMU's user network saw
/// as "Connection reset by peer" where a fork child's 502 was sent).
async fn drain(body: Body) {
    let read = async {
        let mut body = body;
        let mut seen = 0usize;
        while seen < DRAIN_MAX {
            match body.frame().await {
                Some(Ok(frame)) => seen += frame.data_ref().map_or(0, |d| d.len()),
                Some(Err(_)) | None => break,
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIME, read).await;
}

/// The refusal of a request that would wake a sandbox the node paused for
/// memory pressure but that its guest would refuse: without its envd access
/// token (or a signed file URL, which its agent checks) on envd's port, or
/// without its traffic token on a private sandbox's other ports. Only its
/// owner's requests resume it; the answer is the guest's own.
fn refuse_wake(state: &Shared, id: &str, port: u32, req: &Request) -> Option<Response> {
    let record = state.manager.get(id).ok()?;
    if record.state != crate::node::store::SandboxState::Paused
        || record.pause_reason != Some(crate::node::store::PauseReason::MemoryPressure)
    {
        return None;
    }
    if port != envd_proto::PORT {
        let ingress = state.manager.ingress(id)?;
        return ingress.admit(req.headers()).err().map(|r| refused(r, id));
    }
    let token = record.access_token?;
    let given = req.headers().get(ACCESS_TOKEN_HEADER).map(|v| v.as_bytes());
    if given.is_some_and(|g| crate::node::keys::same_secret(g, token.as_bytes()))
        || (given.is_none() && is_signed_files_request(req.headers(), req.uri()))
    {
        return None;
    }
    Some(error(
        StatusCode::UNAUTHORIZED,
        "unauthorized access, please provide a valid access token or method signing if supported",
    ))
}

/// A request to a sandbox the node paused for memory pressure that could not
/// resume it (the node is full, its snapshot failed to load): 503, saying
/// why, rather than "not found" (the sandbox is there).
fn not_woken(id: &str, e: &crate::node::sandbox::SandboxError) -> Response {
    tracing::warn!("sandbox {id}: resuming it for a request after a memory pressure pause: {e}");
    proxy_error(
        StatusCode::SERVICE_UNAVAILABLE,
        id,
        None,
        format!(
            "The sandbox was paused by its node for memory pressure and could not be resumed: {e}"
        ),
    )
}

/// How long a request to a guest already found unresponsive may wait for
/// its answer (the guest may have come back since the last probe): as long
/// as the node waits before it calls a silent guest unresponsive. A guest
/// starved on a loaded node comes back (in the lab, 9 of 10 children of a
/// fork of 100 found so answered in 48 s); a stuck one still ends the wait.
const UNRESPONSIVE_GRACE: Duration = crate::node::sandbox::STUCK_AFTER;

/// Resolves once the guest is unresponsive: at once plus `grace` when it is
/// already, else when the observer finds it so; never when the sandbox goes
/// (its connection then fails by itself).
async fn until_unresponsive(mut stuck: tokio::sync::watch::Receiver<bool>, grace: Duration) {
    if *stuck.borrow_and_update() {
        tokio::time::sleep(grace).await;
        return;
    }
    if stuck.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The answer for a request to a guest that stopped answering.
fn unresponsive(id: &str) -> Response {
    proxy_error(
        StatusCode::BAD_GATEWAY,
        id,
        None,
        format!(
            "The sandbox's guest has stopped answering (no answer from its agent for at least \
             {} s); see GET /v1/sandboxes/{id}/diagnostics",
            crate::node::sandbox::STUCK_AFTER.as_secs()
        ),
    )
}

/// A Connect server-stream answer (process output, directory watches): one
/// that must end with an end-stream envelope.
fn is_connect_stream(parts: &axum::http::response::Parts) -> bool {
    parts.status == StatusCode::OK
        && parts
            .headers
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/connect+"))
}

/// The protocol a message asks to switch to (`Connection: upgrade` and an
/// `Upgrade` header), e.g. a WebSocket handshake.
fn requested_upgrade(headers: &HeaderMap) -> Option<HeaderValue> {
    let asks = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    asks.then(|| headers.get(header::UPGRADE).cloned())
        .flatten()
}

/// Puts back the two hop-by-hop headers an upgrade needs on the next hop.
fn keep_upgrade(headers: &mut HeaderMap, protocol: HeaderValue) {
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(header::UPGRADE, protocol);
}

/// Once both sides have switched protocols, copies bytes between the client
/// and the guest until both are done.
fn splice_upgrades(client: hyper::upgrade::OnUpgrade, guest: hyper::upgrade::OnUpgrade) {
    tokio::spawn(async move {
        let (client, guest) = match (client.await, guest.await) {
            (Ok(c), Ok(g)) => (c, g),
            (Err(e), _) | (_, Err(e)) => {
                tracing::debug!("proxied upgrade: {e}");
                return;
            }
        };
        let (mut client, mut guest) = (TokioIo::new(client), TokioIo::new(guest));
        if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut guest).await {
            tracing::debug!("proxied upgraded stream: {e}");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::wire::header_map as headers;

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
    fn signatures_match_the_reference_example() {
        assert_eq!(
            file_signature("/home/user/a.txt", false, "", "tok_envd_secret", None),
            "v1_aV6X1LHWPB4q7tmf5ETpqDSWAM58F6MZXorj0dYU79k"
        );
    }

    #[test]
    fn unrouted_requests_are_found_by_token_or_signature() {
        let tokens = &[
            ("aaa".to_string(), "ta".to_string()),
            ("bbb".to_string(), "tb".to_string()),
        ][..];
        let get = axum::http::Method::GET;
        let post = axum::http::Method::POST;
        let uri = |s: &str| s.parse::<Uri>().unwrap();
        let by_token = headers(&[("x-access-token", "tb")]);
        assert_eq!(
            find_unrouted(&by_token, &post, &uri("/process.Process/List"), tokens),
            Some("bbb".into())
        );
        // Never for control-plane paths, nor for unknown tokens.
        assert_eq!(
            find_unrouted(&by_token, &get, &uri("/sandboxes"), tokens),
            None
        );
        let unknown = headers(&[("x-access-token", "zz")]);
        assert_eq!(
            find_unrouted(&unknown, &get, &uri("/files?path=/a"), tokens),
            None
        );

        let none = HeaderMap::new();
        let sig = file_signature("/home/user/a b", true, "root", "ta", Some("1999999999"));
        // Base64 has `+` and `/`: the SDKs percent-encode query values.
        let sig: String = form_urlencoded::byte_serialize(sig.as_bytes()).collect();
        let signed = format!(
            "/files?path=%2Fhome%2Fuser%2Fa+b&username=root&signature={sig}&signature_expiration=1999999999"
        );
        assert_eq!(
            find_unrouted(&none, &post, &uri(&signed), tokens),
            Some("aaa".into())
        );
        // A read signature does not sign a write, and no signature finds nothing.
        let read_sig: String =
            form_urlencoded::byte_serialize(file_signature("/x", false, "", "tb", None).as_bytes())
                .collect();
        assert_eq!(
            find_unrouted(
                &none,
                &post,
                &uri(&format!("/files?path=/x&signature={read_sig}")),
                tokens
            ),
            None
        );
        assert_eq!(
            find_unrouted(
                &none,
                &get,
                &uri(&format!("/files?path=/x&signature={read_sig}")),
                tokens
            ),
            Some("bbb".into())
        );
        assert_eq!(
            find_unrouted(&none, &get, &uri("/files?path=/x"), tokens),
            None
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

    #[test]
    fn upgrades_are_recognised() {
        let ws = headers(&[
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "websocket"),
        ]);
        assert_eq!(requested_upgrade(&ws).unwrap(), "websocket");
        let no_protocol = headers(&[("connection", "upgrade")]);
        assert_eq!(requested_upgrade(&no_protocol), None);
        let not_asked = headers(&[("upgrade", "websocket")]);
        assert_eq!(requested_upgrade(&not_asked), None);
        let mut kept = HeaderMap::new();
        keep_upgrade(&mut kept, HeaderValue::from_static("websocket"));
        assert_eq!(requested_upgrade(&kept).unwrap(), "websocket");
    }

    /// A request waiting on a guest ends when the guest is found
    /// unresponsive, after a grace when it already was; never while the
    /// guest answers or once its sandbox is gone.
    #[tokio::test]
    async fn waits_on_a_guest_end_when_it_is_found_unresponsive() {
        use tokio::sync::watch;
        let grace = Duration::from_millis(300);
        // Found so while waiting: at once.
        let (tx, rx) = watch::channel(false);
        let waiting = tokio::spawn(until_unresponsive(rx, grace));
        tokio::time::sleep(grace * 2).await;
        assert!(!waiting.is_finished(), "ended while the guest answered");
        tx.send_replace(true);
        tokio::time::timeout(grace / 2, waiting)
            .await
            .unwrap()
            .unwrap();
        // Already so: after the grace, not before.
        let started = std::time::Instant::now();
        until_unresponsive(tx.subscribe(), grace).await;
        assert!(started.elapsed() >= grace);
        // The sandbox went: only the request's own connection ends it.
        let (tx, rx) = watch::channel(false);
        drop(tx);
        assert!(
            tokio::time::timeout(grace * 2, until_unresponsive(rx, grace))
                .await
                .is_err()
        );
        assert_eq!(unresponsive("sbx1").status(), StatusCode::BAD_GATEWAY);
    }
}

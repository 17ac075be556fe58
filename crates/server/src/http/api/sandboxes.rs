//! Sandbox routes: create (v1, v2), get, list (v1, v2), kill, timeout.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;

use super::extract::{JsonBody, SandboxId};
use super::list::ListQuery;
use super::{ApiError, ClientGone, Shared};
use crate::node::clock::{now_ms, rfc3339};
use crate::node::idempotent::{self, Begun, IdempotencyError};
use crate::node::sandbox::{CreateParams, PauseMode, Phase, ResumeMode};
use crate::node::store::{IdempotentAnswer, SandboxRecord, SandboxState};
use crate::node::template;
use crate::node::tenants::Caller;
use crate::wire;

/// E2B's clientID is a node id the SDKs require but never use.
const CLIENT_ID: &str = "sandfork";
/// v2 creates without a timeout get E2B's SDK default.
const V2_DEFAULT_TIMEOUT: i64 = 300;
/// v1's spec default (v1 SDKs always send one).
const V1_DEFAULT_TIMEOUT: i64 = 15;

/// A sandbox lifetime as create and `POST /sandboxes/{id}/timeout` take it:
/// 0 is allowed and means "end now" (E2B: the sandbox is killed, or paused
/// with `autoPause`, as soon as the timeout reaper sees it); negative is a
/// 400 (the spec's minimum is 0).
fn lifetime_secs(value: i64) -> Result<Duration, ApiError> {
    u64::try_from(value)
        .map(Duration::from_secs)
        .map_err(|_| ApiError::bad_request("Timeout must be greater than or equal to 0"))
}

/// The lifetime a create asks for: above the node's maximum is E2B's 400.
fn create_timeout(value: i64, max: Duration) -> Result<Duration, ApiError> {
    let t = lifetime_secs(value)?;
    if t > max {
        return Err(ApiError::bad_request(format!(
            "Timeout cannot be greater than {} hours",
            max.as_secs() / 3600
        )));
    }
    Ok(t)
}

/// The timeout of fork, resume and connect: E2B refuses 0 and below there
/// ("Timeout must be greater than 0"), as a child or a resumed sandbox that
/// ends at once is never what a caller means.
fn timeout_secs(value: i64, max: Duration) -> Result<Duration, ApiError> {
    if value <= 0 {
        return Err(ApiError::bad_request("Timeout must be greater than 0"));
    }
    create_timeout(value, max)
}

/// Ends sandboxes whose time is up now rather than at the reaper's next
/// tick, after a request that may have ended one (timeout 0).
fn reap_soon(state: &Shared) {
    let manager = state.manager.clone();
    tokio::spawn(async move { manager.reap_expired().await });
}

impl From<&SandboxRecord> for wire::SandboxNames {
    fn from(r: &SandboxRecord) -> wire::SandboxNames {
        wire::SandboxNames {
            sandbox_id: r.id.clone(),
            template_id: r.template_id.clone(),
            alias: r.alias.clone(),
            client_id: CLIENT_ID.to_owned(),
        }
    }
}

/// The Sandbox object of create, connect and resume answers.
impl From<&SandboxRecord> for wire::Sandbox {
    fn from(r: &SandboxRecord) -> wire::Sandbox {
        wire::Sandbox {
            names: r.into(),
            envd_version: envd_proto::ENVD_VERSION.to_owned(),
            envd_access_token: r.access_token.clone().map(String::from),
            traffic_access_token: r
                .network
                .ingress
                .traffic_access_token
                .clone()
                .map(String::from),
            domain: None,
        }
    }
}

/// A ListedSandbox.
impl From<&SandboxRecord> for wire::ListedSandbox {
    fn from(r: &SandboxRecord) -> wire::ListedSandbox {
        wire::ListedSandbox {
            names: r.into(),
            started_at: rfc3339(r.started_at_ms),
            end_at: rfc3339(r.end_at_ms),
            cpu_count: r.cpu_count,
            memory_mb: r.memory_mb,
            disk_size_mb: r.disk_size_mb,
            state: r.state.as_str().to_owned(),
            envd_version: envd_proto::ENVD_VERSION.to_owned(),
            metadata: r.metadata.clone(),
            envd_unresponsive_at_pause: (r.state == SandboxState::Paused
                && r.envd_unresponsive_at_pause)
                .then_some(true),
            volume_mounts: r
                .volume_mounts
                .iter()
                .map(|m| wire::SandboxVolumeMount {
                    // A record from before names kept only the id.
                    name: if m.name.is_empty() {
                        m.volume_id.clone()
                    } else {
                        m.name.clone()
                    },
                    path: m.path.clone(),
                })
                .collect(),
        }
    }
}

/// The SandboxDetail of `GET /sandboxes/{id}`, without what only a live
/// sandbox tells (`guestUnresponsive`, `vmmPageFaults`).
impl From<&SandboxRecord> for wire::SandboxDetail {
    fn from(r: &SandboxRecord) -> wire::SandboxDetail {
        wire::SandboxDetail {
            listed: r.into(),
            envd_access_token: r.access_token.clone().map(String::from),
            domain: None,
            lifecycle: wire::Lifecycle {
                on_timeout: if r.auto_pause { "pause" } else { "kill" }.to_owned(),
                auto_resume: false,
            },
            allow_internet_access: r.network.allow_internet_access,
            network: super::network::detail(&r.network),
            pause_mode: (r.state == SandboxState::Paused).then(|| {
                if r.snapshot.is_some() {
                    "full"
                } else {
                    "filesystem"
                }
                .to_owned()
            }),
            pause_reason: r
                .pause_reason
                .filter(|_| r.state == SandboxState::Paused)
                .map(|reason| reason.as_str().to_owned()),
            guest_unresponsive: false,
            vmm_page_faults: None,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<i64>,
    metadata: Option<BTreeMap<String, String>>,
    #[serde(rename = "envVars")]
    env_vars: Option<BTreeMap<String, String>>,
    /// v1 only; v2 sandboxes are always secure.
    secure: Option<bool>,
    /// false: all egress denied (E2B's `denyOut: ["0.0.0.0/0"]`).
    allow_internet_access: Option<bool>,
    network: Option<super::network::NetworkBody>,
    #[serde(rename = "autoPause")]
    auto_pause: Option<bool>,
    /// `false`: the timeout's pause keeps the filesystem only.
    #[serde(rename = "autoPauseMemory")]
    auto_pause_memory: Option<bool>,
    // E2B's that this node does not offer: read so that asking for them is
    // refused, never ignored (see `NewSandbox::refuse_unavailable`).
    #[serde(rename = "autoResume")]
    auto_resume: Option<AutoResume>,
    iam: Option<Iam>,
    mcp: Option<serde_json::Value>,
    /// Volumes of the caller's team (by name) and where the guest mounts
    /// them.
    #[serde(rename = "volumeMounts")]
    volume_mounts: Option<Vec<wire::SandboxVolumeMount>>,
}

#[derive(Debug, Deserialize)]
struct AutoResume {
    enabled: bool,
}

#[derive(Debug, Deserialize)]
struct Iam {
    #[serde(default)]
    tokens: BTreeMap<String, IamToken>,
}

/// Read for its shape only (E2B's `SandboxIamToken`).
#[derive(Debug, Deserialize)]
struct IamToken {
    #[serde(rename = "audience")]
    _audience: String,
    #[serde(rename = "tokenType")]
    _token_type: String,
}

impl NewSandbox {
    /// A 400 naming the field for what E2B offers and this node does not,
    /// when asked for: a client must not believe it has it. Absent, empty
    /// or off, each is accepted.
    fn refuse_unavailable(&self) -> Result<(), ApiError> {
        if self.auto_resume.as_ref().is_some_and(|a| a.enabled) {
            return Err(ApiError::bad_request(
                "autoResume: a paused sandbox is not resumed by traffic on this node; \
                 resume it with connect",
            ));
        }
        if let Some(name) = self.iam.as_ref().and_then(|i| i.tokens.keys().next()) {
            return Err(ApiError::bad_request(format!(
                "iam.tokens ({name}): workload identity is not available on this node \
                 (it issues no workload tokens)"
            )));
        }
        if self.mcp.as_ref().is_some_and(|m| !m.is_null()) {
            return Err(ApiError::bad_request(
                "mcp: this node runs no MCP gateway in sandboxes",
            ));
        }
        Ok(())
    }
}

/// `POST /sandboxes` (`V2` false) and `POST /v2/sandboxes`.
pub async fn create<const V2: bool>(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    gone: ClientGone,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: NewSandbox = JsonBody::parse(&body)?;
    let Some(key) = headers.get(wire::IDEMPOTENCY_KEY_HEADER) else {
        let made = create_now(&state, caller, &gone, req, V2, false).await?;
        return Ok((StatusCode::CREATED, Json(made)).into_response());
    };
    let key = key.to_str().map_err(|_| IdempotencyError::Malformed)?;
    idempotent::check_key(key)?;
    let json: serde_json::Value = JsonBody::parse(&body)?;
    let route = if V2 {
        "POST /v2/sandboxes"
    } else {
        "POST /sandboxes"
    };
    let begun = state
        .creates
        .begin(
            state.manager.store(),
            format!("{}/{key}", caller.team),
            idempotent::fingerprint(route, &json),
            now_ms(),
        )
        .await?;
    let claim = match begun {
        Begun::Replay(answer) => return Ok(replay(answer)),
        Begun::First(claim) => claim,
    };
    let made = create_now(&state, caller, &gone, req, V2, true).await?;
    let answer = IdempotentAnswer {
        body: serde_json::to_string(&made)
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?,
    };
    // Not recorded, the sandbox stays: the caller has its answer now, and
    // a replay after a lost record makes another, as without a key.
    if let Err(e) = claim.finish(answer.clone()) {
        tracing::warn!(
            "sandbox {}: recording its idempotency key: {e}",
            made.names.sandbox_id
        );
    }
    Ok(replay(answer))
}

/// A create's 201, the first time or replayed (the same bytes).
fn replay(answer: IdempotentAnswer) -> Response {
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        answer.body,
    )
        .into_response()
}

/// Creates the sandbox `req` asks for. `keyed`: the request has an
/// idempotency key, so its client means to retry with it when it loses the
/// answer; the sandbox is kept for that retry even if the client is gone.
async fn create_now(
    state: &Shared,
    caller: Caller,
    gone: &ClientGone,
    req: NewSandbox,
    v2: bool,
    keyed: bool,
) -> Result<wire::Sandbox, ApiError> {
    req.refuse_unavailable()?;
    let max = state.manager.config().max_timeout;
    let default_timeout = if v2 {
        V2_DEFAULT_TIMEOUT
    } else {
        V1_DEFAULT_TIMEOUT
    };
    // Checked before an image is pulled for it.
    let timeout = create_timeout(req.timeout.unwrap_or(default_timeout), max)?;
    let network = super::network::from_create(req.allow_internet_access, req.network)?;
    let metadata = req.metadata.unwrap_or_default();
    let image = template::image_of_create(
        req.template_id.as_deref(),
        &metadata,
        state.manager.config().image_metadata_key.as_deref(),
    )?;
    // An image is converted into a template of its own first (once).
    let template_id = match image {
        // In a cluster, one conversion of it across the nodes.
        Some(image) => match &state.cluster {
            Some(cluster) => {
                cluster
                    .ensure_image(&state.templates, &caller, &image)
                    .await?
            }
            None => state.templates.ensure_image(&image).await?,
        },
        None => req
            .template_id
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| template::BASE.to_owned()),
    };
    // Made on another node of the cluster: taken in first.
    if let Some(cluster) = &state.cluster {
        cluster.take_in_template_for(&caller, &template_id).await?;
    }
    super::tenancy::check_template(state, &caller, &template_id)?;
    let params = CreateParams {
        template_id,
        timeout,
        metadata,
        env_vars: req.env_vars.unwrap_or_default(),
        secure: v2 || req.secure.unwrap_or(false),
        auto_pause: req.auto_pause.unwrap_or(false),
        auto_pause_memory: req.auto_pause_memory.unwrap_or(true),
        network,
        team: caller.stored_team(),
        volume_mounts: req.volume_mounts.unwrap_or_default(),
        forked_from: None,
    };
    let ends_now = params.timeout.is_zero();
    // The code interpreter is built on its first create.
    state.templates.ensure_builtin(&params.template_id).await?;
    let record = state.manager.create(params).await?;
    if !keyed {
        remove_if_gone(state, gone, [record.id.as_str()]).await?;
    }
    if ends_now {
        reap_soon(state);
    }
    Ok(wire::Sandbox::from(&record))
}

pub async fn get_one(
    State(state): State<Shared>,
    SandboxId(id): SandboxId,
) -> Result<Json<wire::SandboxDetail>, ApiError> {
    let mut detail = wire::SandboxDetail::from(&state.manager.get(&id)?);
    // Sandfork's: whether its guest answers (see `sandbox::observe`).
    detail.guest_unresponsive = state.manager.unresponsive(&id);
    // Sandfork's: its VMM's page faults so far (while it runs), to see
    // what a first command costs (see `sandbox::working_set`).
    detail.vmm_page_faults = state.manager.vmm_faults(&id).map(|f| wire::PageFaults {
        minor: f.minor,
        major: f.major,
    });
    Ok(Json(detail))
}

/// `GET /sandboxes` (`V2` false: running ones, one page) and
/// `GET /v2/sandboxes`.
pub async fn list<const V2: bool>(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    uri: Uri,
) -> Result<Response, ApiError> {
    let mut query = ListQuery::parse(uri.query())?;
    if !V2 {
        // v1 lists running sandboxes, in one page.
        query.states = vec![SandboxState::Running];
        query.next_token = None;
        query.limit = usize::MAX;
    }
    let own = super::tenancy::own_sandboxes(&caller, state.manager.list()?);
    let (page, next) = query.page(own);
    let body: Vec<wire::ListedSandbox> = page.iter().map(wire::ListedSandbox::from).collect();
    Ok(super::list::page_answer(body, next))
}

pub async fn kill(
    State(state): State<Shared>,
    SandboxId(id): SandboxId,
) -> Result<StatusCode, ApiError> {
    state.manager.kill(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct NewTimeout {
    timeout: Option<i64>,
}

pub async fn set_timeout(
    State(state): State<Shared>,
    SandboxId(id): SandboxId,
    JsonBody(req): JsonBody<NewTimeout>,
) -> Result<StatusCode, ApiError> {
    let secs = req
        .timeout
        .ok_or_else(|| ApiError::bad_request("timeout is required"))?;
    // Above the node's maximum is clamped to it, as E2B clamps to the
    // team's longest sandbox lifetime (no error).
    let timeout = lifetime_secs(secs)?.min(state.manager.config().max_timeout);
    state.manager.set_timeout(&id, timeout)?;
    if timeout.is_zero() {
        reap_soon(&state);
    }
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Refresh {
    duration: Option<u64>,
}

/// Longest extension one refresh may ask for (E2B's limit).
const MAX_REFRESH_SECS: u64 = 3600;
/// E2B's default and shortest refresh (its default sandbox timeout).
const MIN_REFRESH_SECS: u64 = 15;

/// `POST /sandboxes/{id}/refreshes` `{"duration": s}`: keeps a running
/// sandbox alive at least `duration` more seconds (never shortens it; at
/// least 15, E2B's floor, which is also its default); 204.
pub async fn refresh(
    State(state): State<Shared>,
    SandboxId(id): SandboxId,
    JsonBody(req): JsonBody<Refresh>,
) -> Result<StatusCode, ApiError> {
    let secs = req.duration.unwrap_or(MIN_REFRESH_SECS);
    if secs > MAX_REFRESH_SECS {
        return Err(ApiError::bad_request(format!(
            "duration must be at most {MAX_REFRESH_SECS} seconds"
        )));
    }
    state
        .manager
        .extend_timeout(&id, Duration::from_secs(secs.max(MIN_REFRESH_SECS)))?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct PauseBody {
    /// `false` asks for a filesystem-only pause (E2B's default: true).
    memory: Option<bool>,
    /// Refuse (503) a memory pause while the guest agent does not answer; a
    /// filesystem-only pause always needs it to answer.
    #[serde(rename = "requireHealthyGuest")]
    require_healthy_guest: Option<bool>,
    /// `false`: in a cluster with an object store, the pause stays on this
    /// node only (not stored; lost with the node). Default: stored.
    durable: Option<bool>,
}

/// `POST /sandboxes/{id}/pause`: 204, or 409 when already paused.
pub async fn pause(
    State(state): State<Shared>,
    SandboxId(id): SandboxId,
    JsonBody(req): JsonBody<PauseBody>,
) -> Result<Response, ApiError> {
    let mode = match req.memory.unwrap_or(true) {
        true => PauseMode::Full,
        false => PauseMode::Filesystem,
    };
    if mode == PauseMode::Full
        && req.require_healthy_guest == Some(true)
        && state.manager.phase(&id) == Some(Phase::Running)
        && !state.manager.guest_answers(&id).await
    {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("sandbox {id}: its guest agent does not answer; it was not paused"),
        ));
    }
    let (_, told) = state
        .manager
        .pause(&id, mode, req.durable == Some(false))
        .await?;
    let mut answer = StatusCode::NO_CONTENT.into_response();
    if let Some(durable) = told.durable {
        answer.headers_mut().insert(
            crate::wire::DURABLE_HEADER,
            axum::http::HeaderValue::from_static(if durable { "true" } else { "false" }),
        );
    }
    Ok(answer)
}

#[derive(Debug, Default, Deserialize)]
struct ConnectBody {
    timeout: Option<i64>,
    /// `false`: a paused sandbox cold-boots from its disk, whatever memory
    /// it kept (E2B's `on_resume="reboot"`).
    memory: Option<bool>,
    #[serde(rename = "autoPause")]
    #[allow(dead_code)]
    auto_pause: Option<bool>,
}

async fn resume_or_connect(
    state: Shared,
    id: String,
    headers: &axum::http::HeaderMap,
    body: Bytes,
    connect: bool,
) -> Result<Response, ApiError> {
    let id = SandboxId::parse(&id)?;
    // A gateway sent it here because the sandbox's node is gone: the
    // sandbox is taken in from the object store first.
    if headers.contains_key(crate::wire::TAKE_IN_HEADER)
        && let Some(cluster) = &state.cluster
    {
        cluster.take_in(&id).await?;
    }
    let req: ConnectBody = JsonBody::parse(&body)?;
    let timeout = timeout_secs(
        req.timeout.unwrap_or(V2_DEFAULT_TIMEOUT),
        state.manager.config().max_timeout,
    )?;
    if !connect && state.manager.get(&id)?.state == SandboxState::Running {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already running"),
        ));
    }
    let mode = match req.memory.unwrap_or(true) {
        true => ResumeMode::Restore,
        false => ResumeMode::Reboot,
    };
    let (record, resumed) = state.manager.resume(&id, timeout, mode).await?;
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(wire::Sandbox::from(&record))).into_response())
}

/// `POST /sandboxes/{id}/connect` and `POST /v2/sandboxes/{id}/connect`:
/// 201 when it resumed the sandbox, 200 when it was running.
pub async fn connect(
    State(state): State<Shared>,
    Path(id): Path<String>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    resume_or_connect(state, id, &headers, body, true).await
}

/// `POST /sandboxes/{id}/resume` (older SDKs): 201, or 409 when running.
pub async fn resume(
    State(state): State<Shared>,
    Path(id): Path<String>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    resume_or_connect(state, id, &headers, body, false).await
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RollbackBody {
    #[serde(rename = "snapshotID")]
    snapshot_id: Option<String>,
}

/// `POST /sandboxes/{id}/rollback` (sandfork's; CubeSandbox has the same
/// route): body `{"snapshotID": ...}`, one of the sandbox's own snapshots
/// (its id or name). 200 with the sandbox's detail: the same id, token and
/// timeout, its guest as the snapshot left it. 404 unknown sandbox or
/// snapshot, 409 a snapshot of another sandbox or a sandbox not running.
pub async fn rollback(
    State(state): State<Shared>,
    SandboxId(id): SandboxId,
    JsonBody(req): JsonBody<RollbackBody>,
) -> Result<Json<wire::SandboxDetail>, ApiError> {
    let checkpoint = req
        .snapshot_id
        .filter(|s| !s.is_empty())
        .ok_or_else(|| ApiError::bad_request("snapshotID is required"))?;
    let record = state.manager.rollback(&id, &checkpoint).await?;
    Ok(Json(wire::SandboxDetail::from(&record)))
}

/// The most children one fork request makes (E2B's limit).
pub const MAX_FORK_COUNT: i64 = 100;

#[derive(Debug, Default, Deserialize)]
pub(super) struct ForkBody {
    timeout: Option<i64>,
    count: Option<i64>,
    /// A snapshot's children only (a sandbox's keep its metadata).
    pub(super) metadata: Option<BTreeMap<String, String>>,
}

/// A fork's timeout and count, checked in E2B's order and with its texts
/// (the timeout, then the count; the source is looked up after).
pub(super) fn fork_request(state: &Shared, req: &ForkBody) -> Result<(Duration, u32), ApiError> {
    fork_request_on(state, req, false)
}

/// [`fork_request`]; `spread`: children may go to other nodes too (a
/// running sandbox's fork on a node of a cluster), so the node's own
/// limit does not bound the count.
fn fork_request_on(
    state: &Shared,
    req: &ForkBody,
    spread: bool,
) -> Result<(Duration, u32), ApiError> {
    let timeout = timeout_secs(
        req.timeout.unwrap_or(V2_DEFAULT_TIMEOUT),
        state.manager.config().max_timeout,
    )?;
    let count = req.count.unwrap_or(1);
    if count < 1 {
        return Err(ApiError::bad_request("Count must be at least 1"));
    }
    if count > MAX_FORK_COUNT {
        return Err(ApiError::bad_request(format!(
            "Count cannot be greater than {MAX_FORK_COUNT}"
        )));
    }
    // The forked sandbox keeps its slot: as many children as the node runs
    // sandboxes could never all start (E2B checks its concurrency limit so).
    let max = state.manager.capacity().limits().sandboxes;
    if !spread && usize::try_from(count).is_ok_and(|c| c >= max) {
        return Err(ApiError::bad_request(format!(
            "Count must be lower than the maximum number of concurrent sandboxes ({max})"
        )));
    }
    Ok((timeout, count as u32))
}

/// `POST /sandboxes/{id}/fork`: 201 with one `{"sandbox": ...}` or
/// `{"error": {code, message}}` per child, in order. A paused sandbox is
/// forked from its paused state and stays paused (E2B's RL RFC, infra #3424).
/// On a node of a cluster, a running sandbox's children that do not fit
/// here are made on other nodes (see [`crate::cluster::fork_across`]),
/// after this node's in the answer.
pub async fn fork(
    State(state): State<Shared>,
    SandboxId(id): SandboxId,
    gone: ClientGone,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: ForkBody = JsonBody::parse(&body)?;
    // The body first, as E2B checks it (then the sandbox).
    let (timeout, count) = fork_request_on(&state, &req, state.cluster.as_ref().is_some())?;
    let record = state.manager.get(&id)?;
    let cluster = state
        .cluster
        .as_ref()
        .filter(|_| record.state == SandboxState::Running);
    if cluster.is_none() {
        // Every child on this node: its own bound.
        fork_request(&state, &req)?;
    }
    // Other nodes admit their children as the caller's.
    let key = headers
        .get(crate::node::keys::HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let (results, times, elsewhere) = match (record.state, cluster) {
        (SandboxState::Paused, _) => (
            state.manager.fork_paused(&id, count, timeout).await?,
            None,
            Default::default(),
        ),
        (SandboxState::Running, None) => {
            let forked = state.manager.fork(&id, count, timeout).await?;
            (forked.children, Some(forked.times), Default::default())
        }
        (SandboxState::Running, Some(node)) => {
            let elsewhere = async |frozen: Result<crate::node::sandbox::Frozen, _>, n: u32| {
                crate::cluster::fork_across::elsewhere(node, frozen, n, timeout, key).await
            };
            let (forked, remote) = state
                .manager
                .fork_spread(&id, count, timeout, Some(elsewhere))
                .await?;
            (
                forked.children,
                Some(forked.times),
                remote.unwrap_or_default(),
            )
        }
    };
    if gone.is_gone() {
        elsewhere.undo(key).await;
    }
    remove_if_gone(&state, &gone, made(&results)).await?;
    let parent_paused = times.as_ref().map(|t| t.parent_paused);
    let mut answer = fork_answer_with(results, elsewhere.entries, parent_paused);
    if let Some(times) = times {
        // Beside the body, as the parent's pause: a header that does not
        // fit is left out rather than failing the fork.
        let phases = serde_json::to_string(&fork_phases(&times)).ok();
        if let Some(value) = phases.and_then(|p| axum::http::HeaderValue::from_str(&p).ok()) {
            answer.headers_mut().insert(wire::FORK_PHASES_HEADER, value);
        }
    }
    Ok(answer)
}

/// A fork's times as its answer's header says them, in milliseconds.
fn fork_phases(t: &crate::node::sandbox::ForkTimes) -> wire::ForkPhases {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let us = |us: u64| us as f64 / 1e3;
    let spread = |of: fn(&(crate::node::launch::LaunchTimes, Duration)) -> Duration| {
        let mut v: Vec<f64> = t.per_child.iter().map(|c| ms(of(c))).collect();
        v.sort_by(f64::total_cmp);
        wire::Spread {
            median: v.get(v.len() / 2).copied().unwrap_or_default(),
            max: v.last().copied().unwrap_or_default(),
        }
    };
    wire::ForkPhases {
        children: t.children_here,
        admitted_ms: ms(t.admitted),
        vmms_taken_ms: ms(t.vmms_taken),
        fork_call_ms: ms(t.fork_call),
        parent_paused_ms: ms(t.parent_paused),
        recorded_ms: ms(t.recorded),
        children_ms: ms(t.children),
        total_ms: ms(t.total),
        vmm: t.vmm.map(|v| wire::VmmForkPhases {
            disks_prepared_ms: us(v.disks_prepared_us),
            freeze_ms: us(v.freeze_us),
            state_saved_ms: us(v.state_saved_us),
            memory_ms: us(v.memory_us),
            memory_bytes: v.memory_bytes,
            disks_ms: us(v.disks_us),
            resume_ms: us(v.resume_us),
            children_disks_ms: us(v.children_disks_us),
            state_written_ms: us(v.state_written_us),
        }),
        child: wire::ChildPhases {
            confined_ms: spread(|c| c.0.confined),
            loaded_ms: spread(|c| c.0.loaded),
            agent_ready_ms: spread(|c| c.0.ready),
            recorded_ms: spread(|c| c.0.recorded),
            ready_at_ms: spread(|c| c.1),
        },
    }
}

/// The sandboxes a fork made.
pub(super) fn made(results: &crate::node::sandbox::ForkResults) -> impl Iterator<Item = &str> {
    results
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .map(|r| r.id.as_str())
}

/// Kills what a create or fork made when its client went away before the
/// answer (see [`ClientGone`]): nobody knows their ids, and they would hold
/// the node's capacity until their timeout. A client that goes while the
/// answer is being written still leaves them to their timeout.
pub(super) async fn remove_if_gone<'a>(
    state: &Shared,
    gone: &ClientGone,
    made: impl IntoIterator<Item = &'a str>,
) -> Result<(), ApiError> {
    if !gone.is_gone() {
        return Ok(());
    }
    let made: Vec<&str> = made.into_iter().collect();
    for id in &made {
        if let Err(e) = state.manager.kill(id).await {
            tracing::warn!("sandbox {id}: removing it after its client went away: {e}");
        }
    }
    tracing::info!(
        "the client went away before the answer: removed the {} sandbox(es) made for it: {}",
        made.len(),
        made.join(", ")
    );
    Err(ClientGone::answer("what it made was removed"))
}

/// The 201 of a fork: one `{"sandbox": ...}` or `{"error": ...}` per child,
/// and how long a running parent stopped for the freeze.
pub(crate) fn fork_answer(
    results: crate::node::sandbox::ForkResults,
    parent_paused: Option<Duration>,
) -> Response {
    fork_answer_with(results, Vec::new(), parent_paused)
}

/// [`fork_answer`] with `more` entries after this node's children's (those
/// other nodes made).
fn fork_answer_with(
    results: crate::node::sandbox::ForkResults,
    more: Vec<wire::ForkEntry>,
    parent_paused: Option<Duration>,
) -> Response {
    let body: Vec<wire::ForkEntry> = results
        .into_iter()
        .map(|r| match r {
            Ok(record) => wire::ForkEntry::Sandbox((&record).into()),
            Err(e) => {
                let e = ApiError::from(e);
                wire::ForkEntry::error(e.status.as_u16(), e.message)
            }
        })
        .chain(more)
        .collect();
    let children = u32::try_from(body.len()).unwrap_or(u32::MAX);
    // The body is E2B's (a list); how long the parent stopped goes beside it.
    let mut answer = (StatusCode::CREATED, Json(body)).into_response();
    answer
        .extensions_mut()
        .insert(crate::node::metrics::ForkChildren(children));
    if let Some(paused) = parent_paused {
        let ms = format!("{:.3}", paused.as_secs_f64() * 1000.0);
        if let Ok(value) = axum::http::HeaderValue::from_str(&ms) {
            answer
                .headers_mut()
                .insert(wire::PARENT_PAUSED_HEADER, value);
        }
    }
    answer
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::node::launch::LaunchTimes;
    use crate::node::sandbox::ForkTimes;

    #[test]
    fn a_forks_phases_are_milliseconds_with_each_childs_median_and_max() {
        let child = |loaded_ms, ready_at_ms| {
            (
                LaunchTimes {
                    loaded: Duration::from_millis(loaded_ms),
                    ready: Duration::from_millis(2),
                    ..LaunchTimes::default()
                },
                Duration::from_millis(ready_at_ms),
            )
        };
        let times = ForkTimes {
            children_here: 3,
            vmms_taken: Duration::from_micros(1500),
            parent_paused: Duration::from_millis(4),
            total: Duration::from_millis(40),
            vmm: Some(vmm_api::ForkPhases {
                disks_prepared_us: 1200,
                freeze_us: 250,
                memory_bytes: 8192,
                children_disks_us: 3500,
                ..Default::default()
            }),
            per_child: vec![child(30, 35), child(10, 12), child(20, 25)],
            ..ForkTimes::default()
        };
        let p = super::fork_phases(&times);
        assert_eq!(
            (p.vmms_taken_ms, p.parent_paused_ms, p.total_ms),
            (1.5, 4.0, 40.0)
        );
        let vmm = p.vmm.unwrap();
        assert_eq!((vmm.freeze_ms, vmm.memory_bytes), (0.25, 8192));
        assert_eq!((vmm.disks_prepared_ms, vmm.children_disks_ms), (1.2, 3.5));
        assert_eq!(
            (p.child.loaded_ms.median, p.child.loaded_ms.max),
            (20.0, 30.0)
        );
        assert_eq!(
            (p.child.ready_at_ms.median, p.child.ready_at_ms.max),
            (25.0, 35.0)
        );
        assert_eq!(p.child.agent_ready_ms.max, 2.0);
        // As the header carries it: camelCase, one line.
        let json = serde_json::to_string(&p).unwrap();
        assert!(
            json.contains(r#""loadedMs":{"median":20.0,"max":30.0}"#),
            "{json}"
        );
        assert!(
            json.contains(r#""vmmsTakenMs":1.5"#) && !json.contains('\n'),
            "{json}"
        );
        // No children here (all made elsewhere): zeros, not a failure.
        let none = super::fork_phases(&ForkTimes::default());
        assert_eq!(none.child, crate::wire::ChildPhases::default());
        assert!(none.vmm.is_none());
    }
}

//! Lifecycle webhooks, as E2B has them (`/events/webhooks`): a team
//! registers URLs for some of its sandboxes' lifecycle events, and each
//! such event is POSTed to each as JSON ([`wire::SandboxEvent`]), signed
//! with the webhook's secret as E2B signs ([`signature`]).
//!
//! One subscriber of the manager's [`Lifecycle`] facts ([`Webhooks::start`])
//! turns each into a delivery per matching webhook of the sandbox's team,
//! recorded in the store before its first attempt and after each (so
//! `GET .../deliveries` shows it, and a restart goes on with the ones still
//! pending). A delivery is tried up to [`Policy::attempts`] times, waiting
//! [`Policy::first_retry`] doubling (to [`Policy::max_retry`]) between
//! tries; a 2xx answer is delivered, anything else (another status, no
//! connection, no answer within [`Policy::attempt_timeout`]) is tried again.
//! Redirects are not followed. Deliveries are kept [`KEPT`], then forgotten.
//!
//! A delivery goes only to a public address unless the node's operator
//! allows a network ([`Destinations`]): a URL naming an address outside
//! them is refused at registration, and a host name is resolved at each
//! try and connected to at an address that passed (so a name that later
//! resolves inward is refused, not followed).
//!
//! Registrations and deliveries persist in the store; the secret is kept
//! there in the clear (it must sign). The node also keeps the last
//! [`RECENT`] events in memory for `GET /events/sandboxes`.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Uri;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::broadcast::error::RecvError;

use crate::node::clock::{now_ms, rfc3339};
use crate::node::events::{Lifecycle, LifecycleKind};
use crate::node::ids;
use crate::node::sandbox::Manager;
use crate::node::store::{Store, StoreError};
use crate::wire;

/// How long deliveries are kept (E2B's week).
pub const KEPT: Duration = Duration::from_secs(7 * 24 * 3600);
/// Events kept in memory for `GET /events/sandboxes`, the node's last.
pub const RECENT: usize = 1000;
/// Webhooks a team may have.
pub const MAX_PER_TEAM: usize = 100;
/// The longest URL, name and secret taken.
const MAX_URL: usize = 2048;
const MAX_NAME: usize = 255;
const MAX_SECRET: usize = 1024;
/// E2B's event types that this node never sends (no configuration updates,
/// no checkpoints), accepted in registrations so that E2B's own examples
/// register here as they are.
const NEVER_SENT: [&str; 2] = [
    "sandbox.lifecycle.updated",
    "sandbox.lifecycle.checkpointed",
];

/// How deliveries are tried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Tries per delivery, the first included.
    pub attempts: u32,
    /// The wait before the second try; each later wait doubles it.
    pub first_retry: Duration,
    pub max_retry: Duration,
    /// One try's connect, request and answer's head.
    pub attempt_timeout: Duration,
    /// Tries under way at once, across all webhooks.
    pub concurrent: usize,
    /// Where deliveries may go.
    pub destinations: Destinations,
}

impl Default for Policy {
    /// 5 tries over about 30 s (2, 4, 8, 16 s apart), 10 s each.
    fn default() -> Policy {
        Policy {
            attempts: 5,
            first_retry: Duration::from_secs(2),
            max_retry: Duration::from_secs(60),
            attempt_timeout: Duration::from_secs(10),
            concurrent: 32,
            destinations: Destinations::default(),
        }
    }
}

impl Policy {
    /// The wait before try `n` (0-based; none before the first).
    fn wait_before(&self, n: u32) -> Duration {
        if n == 0 {
            return Duration::ZERO;
        }
        let factor = 1u32.checked_shl(n - 1).unwrap_or(u32::MAX);
        self.first_retry
            .checked_mul(factor)
            .unwrap_or(self.max_retry)
            .min(self.max_retry)
    }
}

/// The addresses deliveries may reach: public ones, and those of the
/// networks the operator allows (`serve --webhook-allow-net`). Without it a
/// team could make the node POST to its own loopback, its cluster's
/// private network or a cloud's metadata address.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Destinations {
    pub allowed: Vec<ipnet::IpNet>,
}

impl Destinations {
    pub fn allows(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        is_public(ip) || self.allowed.iter().any(|net| net.contains(&ip))
    }

    /// Why `ip` is refused, for the error a team sees.
    fn refusal(&self, ip: IpAddr) -> String {
        format!(
            "{ip} is not a public address, and the node's operator has not allowed its network \
             (sandfork serve --webhook-allow-net)"
        )
    }
}

/// Reachable on the internet: not loopback, private, link-local (a
/// cloud's metadata address), shared (CGNAT), unspecified, multicast,
/// broadcast, documentation, benchmarking or reserved space.
fn is_public(ip: IpAddr) -> bool {
    static NOT_PUBLIC: std::sync::LazyLock<Vec<ipnet::IpNet>> = std::sync::LazyLock::new(|| {
        [
            "0.0.0.0/8",
            "10.0.0.0/8",
            "100.64.0.0/10",
            "127.0.0.0/8",
            "169.254.0.0/16",
            "172.16.0.0/12",
            "192.0.0.0/24",
            "192.0.2.0/24",
            "192.168.0.0/16",
            "198.18.0.0/15",
            "198.51.100.0/24",
            "203.0.113.0/24",
            // multicast, reserved and broadcast
            "224.0.0.0/3",
            // unspecified and loopback
            "::/127",
            "64:ff9b:1::/48",
            "100::/64",
            "2001:db8::/32",
            "fc00::/7",
            "fe80::/10",
            "ff00::/8",
        ]
        .iter()
        .filter_map(|net| net.parse().ok())
        .collect()
    });
    !NOT_PUBLIC.iter().any(|net| net.contains(&ip))
}

/// A webhook as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WebhookRecord {
    pub id: String,
    pub team: String,
    pub name: String,
    pub url: String,
    /// E2B's event types, each once.
    pub events: Vec<String>,
    pub enabled: bool,
    pub secret: String,
    pub created_at_ms: u64,
}

impl WebhookRecord {
    fn wants(&self, kind: LifecycleKind) -> bool {
        self.enabled && self.events.iter().any(|e| e == kind.as_str())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeliveryStatus {
    Pending,
    Delivered,
    Failed,
}

impl DeliveryStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::Failed => "failed",
        }
    }
}

/// One event for one webhook, as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryRecord {
    pub id: String,
    pub webhook_id: String,
    pub event_id: String,
    pub event_type: String,
    pub sandbox_id: String,
    /// The JSON sent, the same bytes on every try.
    pub body: String,
    pub status: DeliveryStatus,
    pub attempts: u32,
    pub response_status: Option<u16>,
    pub error: Option<String>,
    pub created_at_ms: u64,
    pub last_attempt_at_ms: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// What the request asked cannot be a webhook (a 400).
    #[error("{0}")]
    Invalid(String),
    /// No webhook of the caller's team by that id.
    #[error("webhook {0} not found")]
    NotFound(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("generating an id: {0}")]
    Random(#[from] std::io::Error),
}

/// What a registration or an update gives (E2B's body, read by the HTTP
/// floor).
pub type WebhookBody = wire::WebhookBody;

/// The node's webhooks: registrations, the delivery of events to them, and
/// the last events.
#[derive(Debug)]
pub struct Webhooks {
    /// Whose store keeps the webhooks and deliveries.
    manager: Arc<Manager>,
    policy: Policy,
    recent: Mutex<VecDeque<Lifecycle>>,
    /// Tries under way at once.
    slots: tokio::sync::Semaphore,
    /// For `https` URLs, made when first needed.
    tls: OnceLock<Result<Arc<rustls::ClientConfig>, String>>,
    /// Where a loopback URL's receiver is reached when the node runs in a
    /// VM (the KVM lab) on behalf of its host, whose loopback its users
    /// mean: the same address image pulls take (`SANDFORK_REGISTRY_LOOPBACK_VIA`).
    loopback_via: Option<String>,
}

impl Webhooks {
    /// Webhooks of `manager`'s node, told its lifecycle events from now on;
    /// deliveries a restart interrupted go on, and deliveries older than
    /// [`KEPT`] are forgotten now and hourly.
    pub fn start(manager: &Arc<Manager>, policy: Policy) -> Arc<Webhooks> {
        let concurrent = policy.concurrent.max(1);
        let webhooks = Arc::new(Webhooks {
            manager: manager.clone(),
            policy,
            recent: Mutex::new(VecDeque::new()),
            slots: tokio::sync::Semaphore::new(concurrent),
            tls: OnceLock::new(),
            loopback_via: template_build::registry::PullOptions::loopback_via_from_env(),
        });
        let mut events = manager.subscribe();
        // Weak: the webhooks go with the node's state, and these tasks then
        // end (the manager's sender goes, and the channel closes).
        let me = Arc::downgrade(&webhooks);
        tokio::spawn(async move {
            loop {
                let event = events.recv().await;
                let Some(webhooks) = me.upgrade() else { return };
                match event {
                    Ok(event) => webhooks.saw(event),
                    Err(RecvError::Lagged(lost)) => {
                        tracing::warn!("webhooks: {lost} lifecycle events lost (too far behind)")
                    }
                    Err(RecvError::Closed) => return,
                }
            }
        });
        match webhooks.store().deliveries() {
            Ok(all) => {
                for d in all
                    .into_iter()
                    .filter(|d| d.status == DeliveryStatus::Pending)
                {
                    tokio::spawn(webhooks.clone().deliver(d));
                }
            }
            Err(e) => tracing::warn!("webhooks: reading pending deliveries: {e}"),
        }
        let me = Arc::downgrade(&webhooks);
        tokio::spawn(async move {
            let mut hourly = tokio::time::interval(Duration::from_secs(3600));
            loop {
                hourly.tick().await;
                let Some(webhooks) = me.upgrade() else { return };
                let before = now_ms().saturating_sub(KEPT.as_millis() as u64);
                if let Err(e) = webhooks.store().remove_deliveries_before(before) {
                    tracing::warn!("webhooks: forgetting old deliveries: {e}");
                }
            }
        });
        webhooks
    }

    fn store(&self) -> &Store {
        self.manager.store()
    }

    /// Registers a webhook of `team`.
    pub fn create(&self, team: &str, body: WebhookBody) -> Result<WebhookRecord, WebhookError> {
        let url = body
            .url
            .ok_or_else(|| WebhookError::Invalid("url is required".into()))?;
        let events = body
            .events
            .ok_or_else(|| WebhookError::Invalid("events is required".into()))?;
        let secret = body
            .signature_secret
            .ok_or_else(|| WebhookError::Invalid("signatureSecret is required".into()))?;
        if self.list(team)?.len() >= MAX_PER_TEAM {
            return Err(WebhookError::Invalid(format!(
                "a team may have at most {MAX_PER_TEAM} webhooks"
            )));
        }
        let record = WebhookRecord {
            id: ids::random_uuid()?,
            team: team.to_owned(),
            name: check_name(body.name.unwrap_or_default())?,
            url: check_url(url, &self.policy.destinations)?,
            events: check_events(events)?,
            enabled: body.enabled.unwrap_or(true),
            secret: check_secret(secret)?,
            created_at_ms: now_ms(),
        };
        self.store().put_webhook(&record)?;
        Ok(record)
    }

    /// `team`'s webhooks, oldest first.
    pub fn list(&self, team: &str) -> Result<Vec<WebhookRecord>, WebhookError> {
        let mut all: Vec<WebhookRecord> = self
            .store()
            .webhooks()?
            .into_iter()
            .filter(|w| w.team == team)
            .collect();
        all.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(all)
    }

    /// `team`'s webhook `id`; another team's is not found, as an unknown one.
    pub fn get(&self, team: &str, id: &str) -> Result<WebhookRecord, WebhookError> {
        self.store()
            .webhook(id)?
            .filter(|w| w.team == team)
            .ok_or_else(|| WebhookError::NotFound(id.to_owned()))
    }

    /// Changes what `body` names of `team`'s webhook `id`.
    pub fn update(
        &self,
        team: &str,
        id: &str,
        body: WebhookBody,
    ) -> Result<WebhookRecord, WebhookError> {
        let mut w = self.get(team, id)?;
        if let Some(name) = body.name {
            w.name = check_name(name)?;
        }
        if let Some(url) = body.url {
            w.url = check_url(url, &self.policy.destinations)?;
        }
        if let Some(events) = body.events {
            w.events = check_events(events)?;
        }
        if let Some(enabled) = body.enabled {
            w.enabled = enabled;
        }
        if let Some(secret) = body.signature_secret {
            w.secret = check_secret(secret)?;
        }
        self.store().put_webhook(&w)?;
        Ok(w)
    }

    /// Removes `team`'s webhook `id` and its deliveries (tries under way stop).
    pub fn delete(&self, team: &str, id: &str) -> Result<(), WebhookError> {
        self.get(team, id)?;
        self.store().remove_webhook(id)?;
        Ok(())
    }

    /// The deliveries of `team`'s webhook `id`, newest first.
    pub fn deliveries(&self, team: &str, id: &str) -> Result<Vec<DeliveryRecord>, WebhookError> {
        self.get(team, id)?;
        let mut all: Vec<DeliveryRecord> = self
            .store()
            .deliveries()?
            .into_iter()
            .filter(|d| d.webhook_id == id)
            .collect();
        all.sort_by(|a, b| (b.created_at_ms, &b.id).cmp(&(a.created_at_ms, &a.id)));
        Ok(all)
    }

    /// The node's last events of `team`'s sandboxes (of `sandbox` only, when
    /// given), oldest first.
    pub fn recent(&self, team: &str, sandbox: Option<&str>) -> Vec<Lifecycle> {
        self.recent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|e| e.team == team && sandbox.is_none_or(|s| e.sandbox_id == s))
            .cloned()
            .collect()
    }

    /// One lifecycle event: remembered, and a delivery to each webhook of
    /// its team that wants it.
    fn saw(self: Arc<Self>, event: Lifecycle) {
        {
            let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
            if recent.len() >= RECENT {
                recent.pop_front();
            }
            recent.push_back(event.clone());
        }
        let webhooks = match self.store().webhooks() {
            Ok(all) => all,
            Err(e) => {
                tracing::warn!("webhooks: reading them for event {}: {e}", event.id);
                return;
            }
        };
        let targets = webhooks
            .into_iter()
            .filter(|w| w.team == event.team && w.wants(event.kind));
        let mut body = None;
        for webhook in targets {
            let body = body.get_or_insert_with(|| {
                // A struct of strings, numbers and string maps always serializes.
                serde_json::to_string(&payload(&event)).unwrap_or_default()
            });
            let id = match ids::random_uuid() {
                Ok(id) => id,
                Err(e) => {
                    tracing::warn!("webhooks: no delivery id for event {}: {e}", event.id);
                    continue;
                }
            };
            let delivery = DeliveryRecord {
                id,
                webhook_id: webhook.id,
                event_id: event.id.clone(),
                event_type: event.kind.as_str().to_owned(),
                sandbox_id: event.sandbox_id.clone(),
                body: body.clone(),
                status: DeliveryStatus::Pending,
                attempts: 0,
                response_status: None,
                error: None,
                created_at_ms: now_ms(),
                last_attempt_at_ms: None,
            };
            if let Err(e) = self.store().put_delivery(&delivery) {
                tracing::warn!("webhooks: recording delivery {}: {e}", delivery.id);
            }
            tokio::spawn(self.clone().deliver(delivery));
        }
    }

    /// Tries `d` until it is delivered or out of tries, recording each try.
    async fn deliver(self: Arc<Self>, mut d: DeliveryRecord) {
        while d.attempts < self.policy.attempts {
            tokio::time::sleep(self.policy.wait_before(d.attempts)).await;
            // Read again each time: a deleted webhook stops its deliveries,
            // a changed one is tried at its new URL with its new secret.
            let webhook = match self.store().webhook(&d.webhook_id) {
                Ok(Some(w)) => w,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!("webhooks: reading webhook {}: {e}", d.webhook_id);
                    return;
                }
            };
            let tried = {
                let _slot = self.slots.acquire().await;
                tokio::time::timeout(self.policy.attempt_timeout, self.post(&webhook, &d)).await
            };
            d.attempts += 1;
            d.last_attempt_at_ms = Some(now_ms());
            match tried {
                Ok(Ok(status)) => {
                    d.response_status = Some(status);
                    if (200..300).contains(&status) {
                        d.status = DeliveryStatus::Delivered;
                        d.error = None;
                    } else {
                        d.error = Some(format!("the receiver answered {status}"));
                    }
                }
                Ok(Err(TryError::Again(e))) => {
                    d.response_status = None;
                    d.error = Some(e);
                }
                Ok(Err(TryError::Refused(e))) => {
                    d.response_status = None;
                    d.error = Some(e);
                    d.status = DeliveryStatus::Failed;
                }
                Err(_) => {
                    d.response_status = None;
                    d.error = Some(format!(
                        "no answer within {} s",
                        self.policy.attempt_timeout.as_secs_f64()
                    ));
                }
            }
            if d.status == DeliveryStatus::Pending && d.attempts >= self.policy.attempts {
                d.status = DeliveryStatus::Failed;
            }
            // Not if the webhook went meanwhile (its deliveries went with it).
            if self
                .store()
                .webhook(&d.webhook_id)
                .is_ok_and(|w| w.is_some())
                && let Err(e) = self.store().put_delivery(&d)
            {
                tracing::warn!("webhooks: recording delivery {}: {e}", d.id);
            }
            if d.status != DeliveryStatus::Pending {
                return;
            }
        }
    }

    /// One try: the receiver's status, or why there was none.
    async fn post(&self, webhook: &WebhookRecord, d: &DeliveryRecord) -> Result<u16, TryError> {
        let uri: Uri = webhook
            .url
            .parse()
            .map_err(|e| format!("the URL does not parse: {e}"))?;
        let target = Target::of(&uri)?;
        let request = hyper::Request::post(target.path_and_query.as_str())
            .header(hyper::header::HOST, target.authority.as_str())
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(hyper::header::USER_AGENT, "sandfork-webhooks")
            .header(wire::WEBHOOK_ID_HEADER, webhook.id.as_str())
            .header(wire::DELIVERY_ID_HEADER, d.id.as_str())
            .header(wire::SIGNATURE_VERSION_HEADER, wire::SIGNATURE_VERSION)
            .header(
                wire::SIGNATURE_HEADER,
                signature(&webhook.secret, d.body.as_bytes()),
            )
            .body(Full::new(Bytes::from(d.body.clone())))
            .map_err(|e| format!("building the request: {e}"))?;
        let address = destination(
            &self.policy.destinations,
            self.loopback_via.as_deref(),
            &target,
        )
        .await?;
        let tcp = tokio::net::TcpStream::connect(address)
            .await
            .map_err(|e| format!("connecting to {} ({address}): {e}", target.authority))?;
        if !target.tls {
            return Ok(exchange(tcp, request).await?);
        }
        let config = self
            .tls
            .get_or_init(tls_config)
            .clone()
            .map_err(|e| format!("TLS: {e}"))?;
        let name = rustls::pki_types::ServerName::try_from(target.host.clone())
            .map_err(|e| format!("TLS server name {}: {e}", target.host))?;
        let stream = tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS with {}: {e}", target.authority))?;
        Ok(exchange(stream, request).await?)
    }
}

/// The address a try at `target` connects to: the first its host resolves
/// to that `destinations` allow. A loopback one is reached through
/// `loopback_via` when the node runs in a VM for its host.
async fn destination(
    destinations: &Destinations,
    loopback_via: Option<&str>,
    target: &Target,
) -> Result<SocketAddr, TryError> {
    let resolved: Vec<SocketAddr> = tokio::net::lookup_host((target.host.as_str(), target.port))
        .await
        .map_err(|e| TryError::Again(format!("resolving {}: {e}", target.host)))?
        .collect();
    let Some(address) = resolved.iter().find(|a| destinations.allows(a.ip())) else {
        return Err(match resolved.first() {
            Some(a) => {
                TryError::Refused(format!("{}: {}", target.host, destinations.refusal(a.ip())))
            }
            None => TryError::Again(format!("{} resolves to no address", target.host)),
        });
    };
    match loopback_via {
        Some(via) if address.ip().is_loopback() => tokio::net::lookup_host((via, target.port))
            .await
            .map_err(|e| TryError::Again(format!("resolving {via}: {e}")))?
            .next()
            .ok_or_else(|| TryError::Again(format!("{via} resolves to no address"))),
        _ => Ok(*address),
    }
}

/// Why a try got no answer: worth trying again, or refused for good (the
/// destination is not allowed: the webhook must change first).
#[derive(Debug)]
enum TryError {
    Again(String),
    Refused(String),
}

impl From<String> for TryError {
    fn from(e: String) -> TryError {
        TryError::Again(e)
    }
}

/// Where a webhook's URL points.
struct Target {
    tls: bool,
    host: String,
    port: u16,
    authority: String,
    path_and_query: String,
}

impl Target {
    fn of(uri: &Uri) -> Result<Target, String> {
        let tls = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err("not an http(s) URL".into()),
        };
        let authority = uri.authority().ok_or("the URL names no host")?;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        Ok(Target {
            tls,
            host,
            port: authority.port_u16().unwrap_or(if tls { 443 } else { 80 }),
            authority: authority.as_str().to_owned(),
            path_and_query: uri
                .path_and_query()
                .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned()),
        })
    }
}

/// Sends `request` over `io` (HTTP/1.1); the answer's status.
async fn exchange<S>(io: S, request: hyper::Request<Full<Bytes>>) -> Result<u16, String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| format!("HTTP handshake: {e}"))?;
    tokio::spawn(conn);
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("sending: {e}"))?;
    let status = response.status().as_u16();
    // Read (and drop) the body, so the receiver is not cut off mid-answer.
    let _ = response.into_body().collect().await;
    Ok(status)
}

/// A client configuration trusting the system's CA certificates.
fn tls_config() -> Result<Arc<rustls::ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(config))
}

/// E2B's `e2b-signature`: base64 (standard alphabet, unpadded) of SHA-256
/// of `secret` followed by `body`.
pub fn signature(secret: &str, body: &[u8]) -> String {
    let mut hash = Sha256::new();
    hash.update(secret.as_bytes());
    hash.update(body);
    base64::engine::general_purpose::STANDARD_NO_PAD.encode(hash.finalize())
}

/// `event` as E2B sends it.
pub fn payload(event: &Lifecycle) -> wire::SandboxEvent {
    let execution =
        matches!(event.kind, LifecycleKind::Killed | LifecycleKind::Paused).then(|| {
            wire::Execution {
                started_at: rfc3339(event.started_at_ms),
                vcpu_count: event.cpu_count,
                memory_mb: event.memory_mb,
                execution_time: event.at_ms.saturating_sub(event.started_at_ms),
            }
        });
    wire::SandboxEvent {
        version: wire::EVENT_VERSION.to_owned(),
        id: event.id.clone(),
        event_type: event.kind.as_str().to_owned(),
        event_data: wire::SandboxEventData {
            sandbox_metadata: event.metadata.clone(),
            execution,
            parent_sandbox_id: event.parent_id.clone(),
        },
        // No builds apart from templates here: the template names both.
        sandbox_build_id: event.template_id.clone(),
        sandbox_execution_id: format!("{}-{}", event.sandbox_id, event.run),
        sandbox_id: event.sandbox_id.clone(),
        sandbox_team_id: event.team.clone(),
        sandbox_template_id: event.template_id.clone(),
        timestamp: rfc3339(event.at_ms),
    }
}

/// An `http` or `https` URL with a host and no credentials, whose host, if
/// an address, is one `destinations` allows (a name is checked as it
/// resolves at each try).
fn check_url(url: String, destinations: &Destinations) -> Result<String, WebhookError> {
    let invalid = |why: &str| WebhookError::Invalid(format!("url {url:?}: {why}"));
    if url.len() > MAX_URL {
        return Err(invalid("longer than 2048 bytes"));
    }
    let uri: Uri = url.parse().map_err(|_| invalid("not a URL"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(invalid("only http and https URLs are delivered to"));
    }
    let authority = uri.authority().ok_or_else(|| invalid("no host"))?;
    if authority.as_str().contains('@') {
        return Err(invalid("credentials in the URL are not taken"));
    }
    if authority.host().is_empty() {
        return Err(invalid("no host"));
    }
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    if let Ok(ip) = host.parse::<IpAddr>()
        && !destinations.allows(ip)
    {
        return Err(invalid(&destinations.refusal(ip)));
    }
    Ok(url)
}

/// Each event type once, in the order given; at least one, all E2B's.
fn check_events(events: Vec<String>) -> Result<Vec<String>, WebhookError> {
    if events.is_empty() {
        return Err(WebhookError::Invalid(
            "events must name at least one event type".into(),
        ));
    }
    let mut out: Vec<String> = Vec::new();
    for e in events {
        if LifecycleKind::parse(&e).is_none() && !NEVER_SENT.contains(&e.as_str()) {
            let known: Vec<&str> = LifecycleKind::ALL.iter().map(|k| k.as_str()).collect();
            return Err(WebhookError::Invalid(format!(
                "unknown event type {e:?} (known: {})",
                known.join(", ")
            )));
        }
        if !out.contains(&e) {
            out.push(e);
        }
    }
    Ok(out)
}

fn check_name(name: String) -> Result<String, WebhookError> {
    if name.len() > MAX_NAME {
        return Err(WebhookError::Invalid(format!(
            "name is longer than {MAX_NAME} bytes"
        )));
    }
    Ok(name)
}

fn check_secret(secret: String) -> Result<String, WebhookError> {
    if secret.is_empty() || secret.len() > MAX_SECRET {
        return Err(WebhookError::Invalid(format!(
            "signatureSecret must be 1 to {MAX_SECRET} bytes"
        )));
    }
    Ok(secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_e2bs_unpadded_base64_of_sha256_of_secret_then_body() {
        // printf 'sbody' | openssl dgst -sha256 -binary | base64 | tr -d =
        let expected = {
            let digest = Sha256::digest(b"sbody");
            base64::engine::general_purpose::STANDARD
                .encode(digest)
                .trim_end_matches('=')
                .to_owned()
        };
        assert_eq!(signature("s", b"body"), expected);
        assert!(!signature("s", b"body").ends_with('='));
        assert_ne!(signature("t", b"body"), expected);
    }

    #[test]
    fn retries_wait_doubling_up_to_the_cap() {
        let p = Policy {
            first_retry: Duration::from_secs(2),
            max_retry: Duration::from_secs(10),
            ..Policy::default()
        };
        let waits: Vec<u64> = (0..6).map(|n| p.wait_before(n).as_secs()).collect();
        assert_eq!(waits, [0, 2, 4, 8, 10, 10]);
        assert_eq!(p.wait_before(u32::MAX), Duration::from_secs(10));
    }

    fn loopback() -> Destinations {
        Destinations {
            allowed: vec!["127.0.0.0/8".parse().unwrap(), "::1/128".parse().unwrap()],
        }
    }

    #[test]
    fn only_public_addresses_are_destinations_unless_a_network_is_allowed() {
        let none = Destinations::default();
        for inward in [
            "127.0.0.1",
            "10.1.2.3",
            "172.20.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.100.100.200",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
        ] {
            let ip: IpAddr = inward.parse().unwrap();
            assert!(!none.allows(ip), "{inward}");
        }
        for public in [
            "1.1.1.1",
            "93.184.216.34",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
        ] {
            assert!(none.allows(public.parse().unwrap()), "{public}");
        }
        let lab = Destinations {
            allowed: vec!["10.0.2.0/24".parse().unwrap()],
        };
        assert!(lab.allows("10.0.2.2".parse().unwrap()));
        assert!(!lab.allows("10.0.3.2".parse().unwrap()));
    }

    #[test]
    fn a_url_at_an_address_not_allowed_is_refused_naming_the_flag() {
        for url in [
            "http://127.0.0.1:8080/hook",
            "http://169.254.169.254/latest/meta-data",
            "http://[::1]/x",
            "http://[::ffff:10.0.0.1]/x",
        ] {
            match check_url(url.into(), &Destinations::default()) {
                Err(WebhookError::Invalid(why)) => {
                    assert!(why.contains("--webhook-allow-net"), "{why}")
                }
                other => panic!("{url}: {other:?}"),
            }
        }
        // A name is checked as it resolves, at each try.
        assert!(
            check_url(
                "http://localhost:8080/hook".into(),
                &Destinations::default()
            )
            .is_ok()
        );
    }

    #[tokio::test]
    async fn a_name_resolving_inward_is_refused_for_good_and_an_allowed_one_connects() {
        let target = Target::of(&"http://localhost:8080/hook".parse().unwrap()).unwrap();
        match destination(&Destinations::default(), None, &target).await {
            Err(TryError::Refused(why)) => assert!(why.starts_with("localhost: "), "{why}"),
            other => panic!("{other:?}"),
        }
        let to = destination(&loopback(), None, &target).await.unwrap();
        assert!(to.ip().is_loopback() && to.port() == 8080, "{to}");
        // In the lab, loopback is the host's, through the VM's gateway.
        let via = destination(&loopback(), Some("10.0.2.2"), &target)
            .await
            .unwrap();
        assert_eq!(via, "10.0.2.2:8080".parse().unwrap());
    }

    #[test]
    fn urls_must_be_http_with_a_host_and_no_credentials() {
        for ok in [
            "http://127.0.0.1:8080/hook",
            "https://example.com",
            "http://[::1]/x?y=1",
        ] {
            assert!(check_url(ok.into(), &loopback()).is_ok(), "{ok}");
        }
        for bad in [
            "ftp://example.com/",
            "file:///etc/passwd",
            "example.com/hook",
            "/hook",
            "http://user:pw@example.com/",
            "gopher://x",
            "",
        ] {
            assert!(
                matches!(
                    check_url(bad.into(), &loopback()),
                    Err(WebhookError::Invalid(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn event_types_are_e2bs_each_once() {
        let events = check_events(vec![
            "sandbox.lifecycle.killed".into(),
            "sandbox.lifecycle.updated".into(),
            "sandbox.lifecycle.killed".into(),
        ])
        .unwrap_or_default();
        assert_eq!(
            events,
            ["sandbox.lifecycle.killed", "sandbox.lifecycle.updated"]
        );
        assert!(check_events(vec![]).is_err());
        assert!(check_events(vec!["sandbox.lifecycle.exploded".into()]).is_err());
    }
}

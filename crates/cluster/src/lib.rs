//! The sandfork cluster layer on etcd v3: the keyspace and its records,
//! a node's registration under a lease, and the sandbox-to-node map whose
//! every change is a transaction checked against the record's revision and
//! the owning node's lease (so a node whose lease is gone writes nothing).
//!
//! Nodes and gateways use [`Cluster`]; a node holds a [`Registration`].
//! [`harness`] starts a real etcd member for tests.

pub mod files;
pub mod harness;
pub mod images;
pub mod keyspace;
mod membership;
pub mod objects;
pub mod peer;
pub mod quota;
pub mod store_gc;
pub mod tenants;
pub mod view;

use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp};

pub use images::ImageConversion;
pub use keyspace::{
    DurablePause, ImageClaim, NodeCapacity, NodeLoad, NodeRecord, RunningSlot, SandboxRoute,
    TeamQuota,
};
pub use membership::{LocalSandbox, Reconciled, Registration};
pub use objects::ObjectStore;
pub use quota::Claim;
pub use store_gc::{Collector, GcEpoch};
pub use tenants::{TenantChange, TenantRecords, Tenants};
pub use view::View;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error("record {key}: {source}")]
    Record {
        key: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("no etcd endpoints given")]
    NoEndpoints,
}

/// A record read from etcd with the revision it was last changed at (what
/// a transaction compares against).
#[derive(Debug, Clone, PartialEq)]
pub struct Versioned<T> {
    pub value: T,
    pub mod_revision: i64,
}

/// A handle on the cluster's etcd (cheap to clone: one gRPC channel).
#[derive(Clone)]
pub struct Cluster {
    client: Client,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The etcd client prints nothing of use (nor its credentials).
        f.debug_struct("Cluster").finish_non_exhaustive()
    }
}

/// How long one etcd request may take before it counts as failed (a lost
/// quorum must not hang a create).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

impl Cluster {
    pub async fn connect(endpoints: &[String]) -> Result<Cluster, ClusterError> {
        Cluster::connect_with(endpoints, None).await
    }

    /// [`Cluster::connect`], through TLS with the part's certificate when
    /// `tls` is given (the endpoints are then `https://`).
    pub async fn connect_with(
        endpoints: &[String],
        tls: Option<&sandfork_tls::ClusterTls>,
    ) -> Result<Cluster, ClusterError> {
        if endpoints.is_empty() {
            return Err(ClusterError::NoEndpoints);
        }
        let mut options = ConnectOptions::new()
            .with_connect_timeout(REQUEST_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT);
        if let Some(tls) = tls {
            options = options.with_tls(etcd_tls(tls));
        }
        let client = Client::connect(endpoints, Some(options)).await?;
        Ok(Cluster { client })
    }

    pub(crate) fn client(&self) -> Client {
        self.client.clone()
    }

    /// Every key under `prefix`, as one read at one revision would give
    /// them, read in pages of [`PAGE_KEYS`] (each retried as [`retried`]
    /// does): one answer of a large map would pass the 4 MiB a gRPC answer
    /// may hold (tonic's default, which etcd-client keeps), and a gateway
    /// or a node's reconciler reading 50,000 routes at once failed on it.
    pub(crate) async fn get_prefix(&self, prefix: &str) -> Result<Listed, etcd_client::Error> {
        self.read_prefix(prefix, true).await
    }

    /// [`Cluster::get_prefix`] with each page asked once: for a caller that
    /// must learn at once that etcd cannot answer (a gateway's view falls
    /// back on its last copy then).
    pub(crate) async fn get_prefix_once(&self, prefix: &str) -> Result<Listed, etcd_client::Error> {
        self.read_prefix(prefix, false).await
    }

    async fn read_prefix(&self, prefix: &str, retry: bool) -> Result<Listed, etcd_client::Error> {
        let end = prefix_end(prefix.as_bytes());
        let mut listed = Listed::default();
        let mut from = prefix.as_bytes().to_vec();
        loop {
            let mut options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(PAGE_KEYS);
            if listed.revision > 0 {
                // The later pages as of the first one's revision.
                options = options.with_revision(listed.revision);
            }
            let ask = || {
                let (mut client, from, options) = (self.client(), from.clone(), options.clone());
                async move { client.get(from, Some(options)).await }
            };
            let mut page = match retry {
                true => retried(ask).await?,
                false => ask().await?,
            };
            if listed.revision == 0 {
                listed.revision = page.header().map_or(0, |h| h.revision());
            }
            let more = page.more();
            let kvs = page.take_kvs();
            match kvs.last() {
                Some(last) if more => {
                    // The next page starts just after the last key.
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => {
                    listed.kvs.extend(kvs);
                    return Ok(listed);
                }
            }
            listed.kvs.extend(kvs);
        }
    }

    /// The registered (lease-alive) nodes.
    pub async fn nodes(&self) -> Result<Vec<NodeRecord>, ClusterError> {
        let resp = self.get_prefix(keyspace::NODES).await?;
        resp.kvs()
            .iter()
            .map(|kv| decode(kv.key(), kv.value()))
            .collect()
    }

    /// Where a sandbox runs, if the map has it.
    pub async fn sandbox(&self, id: &str) -> Result<Option<Versioned<SandboxRoute>>, ClusterError> {
        let key = keyspace::sandbox_key(id);
        let resp = retried(|| {
            let (mut client, key) = (self.client(), key.clone());
            async move { client.get(key, None).await }
        })
        .await?;
        resp.kvs()
            .first()
            .map(|kv| {
                Ok(Versioned {
                    value: decode(kv.key(), kv.value())?,
                    mod_revision: kv.mod_revision(),
                })
            })
            .transpose()
    }

    /// The whole sandbox-to-node map, by sandbox ID.
    pub async fn sandboxes(&self) -> Result<Vec<(String, Versioned<SandboxRoute>)>, ClusterError> {
        let resp = self.get_prefix(keyspace::SANDBOXES).await?;
        resp.kvs()
            .iter()
            .filter_map(|kv| {
                let id = keyspace::sandbox_id(kv.key())?;
                Some(decode(kv.key(), kv.value()).map(|value| {
                    (
                        id.to_owned(),
                        Versioned {
                            value,
                            mod_revision: kv.mod_revision(),
                        },
                    )
                }))
            })
            .collect()
    }
}

/// Keys one page of [`Cluster::get_prefix`] asks for: about 0.3 MiB of
/// routes, well under a gRPC answer's 4 MiB.
const PAGE_KEYS: i64 = 2_000;

/// What [`Cluster::get_prefix`] read: the keys, in key order, and the
/// revision they were read at.
#[derive(Debug, Default)]
pub(crate) struct Listed {
    kvs: Vec<etcd_client::KeyValue>,
    revision: i64,
}

impl Listed {
    pub(crate) fn kvs(&self) -> &[etcd_client::KeyValue] {
        &self.kvs
    }

    pub(crate) fn revision(&self) -> i64 {
        self.revision
    }
}

/// The end of the range of keys that start with `prefix` (etcd's own rule:
/// the prefix with its last byte below 0xff raised by one, what follows it
/// dropped; all keys from `prefix` on when every byte is 0xff).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    match prefix.iter().rposition(|&b| b < 0xff) {
        Some(i) => {
            let mut end = prefix[..=i].to_vec();
            end[i] += 1;
            end
        }
        None => vec![0],
    }
}

/// How long a kill of a lost sandbox is remembered for its node's return.
const KILLED_TTL_SECS: i64 = 24 * 3600;

impl Cluster {
    /// Kills `id`, lost with its node: its record goes as with
    /// [`Cluster::forget_orphan`], and a tombstone naming the node stays for
    /// a day, so that the node, back with the sandbox (its link healed),
    /// removes its copy instead of claiming it again.
    pub async fn kill_lost(
        &self,
        id: &str,
        seen: &Versioned<SandboxRoute>,
    ) -> Result<bool, ClusterError> {
        let lease = retried(|| {
            let mut client = self.client();
            async move { client.lease_grant(KILLED_TTL_SECS, None).await }
        })
        .await?
        .id();
        let key = keyspace::sandbox_key(id);
        let txn = Txn::new().when(orphaned(&key, seen)).and_then([
            TxnOp::delete(key, None),
            TxnOp::put(
                keyspace::killed_key(id),
                seen.value.node_id.clone(),
                Some(PutOptions::new().with_lease(lease)),
            ),
        ]);
        send_txn(&mut self.client(), txn).await
    }

    /// The sandboxes killed through a gateway while `node_id` was gone.
    pub async fn killed_on(
        &self,
        node_id: &str,
    ) -> Result<std::collections::BTreeSet<String>, ClusterError> {
        let answer = self.get_prefix(keyspace::KILLED).await?;
        Ok(answer
            .kvs()
            .iter()
            .filter(|kv| kv.value() == node_id.as_bytes())
            .filter_map(|kv| {
                let key = std::str::from_utf8(kv.key()).ok()?;
                Some(key.strip_prefix(keyspace::KILLED)?.to_owned())
            })
            .collect())
    }

    /// Forgets `id`'s tombstone (its node removed its copy, or has none).
    pub async fn clear_killed(&self, id: &str) -> Result<(), ClusterError> {
        retried(|| {
            let mut client = self.client();
            async move { client.delete(keyspace::killed_key(id), None).await }
        })
        .await?;
        Ok(())
    }

    /// Deletes `id`'s record if it is unchanged since `seen` and its node
    /// no longer holds the lease it claimed under (a sandbox lost with its
    /// node, or paused on a node that is gone, being killed).
    pub async fn forget_orphan(
        &self,
        id: &str,
        seen: &Versioned<SandboxRoute>,
    ) -> Result<bool, ClusterError> {
        let key = keyspace::sandbox_key(id);
        let txn = Txn::new()
            .when(orphaned(&key, seen))
            .and_then([TxnOp::delete(key, None)]);
        send_txn(&mut self.client(), txn).await
    }
}

/// A watch quiet this long ends (its caller loads anew and watches again:
/// a member cut off without a reset would otherwise hold it forever).
const WATCH_QUIET_LIMIT: Duration = Duration::from_secs(60);

/// Watches the keys under `prefix` from `revision` on, handing each event's
/// kind and key-value to `apply`, until the watch ends, is cancelled or
/// stays quiet for [`WATCH_QUIET_LIMIT`] (`what` names it in the log).
pub(crate) async fn follow_prefix(
    cluster: &Cluster,
    prefix: &str,
    revision: i64,
    what: &str,
    mut apply: impl FnMut(etcd_client::EventType, &etcd_client::KeyValue),
) -> Result<(), ClusterError> {
    let options = etcd_client::WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision);
    let mut stream = cluster.client().watch(prefix, Some(options)).await?;
    loop {
        let message = match tokio::time::timeout(WATCH_QUIET_LIMIT, stream.message()).await {
            Ok(message) => message?,
            Err(_) => return Ok(()),
        };
        let Some(response) = message else {
            return Ok(());
        };
        if response.canceled() {
            tracing::warn!("{what}: watch cancelled: {}", response.cancel_reason());
            return Ok(());
        }
        for event in response.events() {
            if let Some(kv) = event.kv() {
                apply(event.event_type(), kv);
            }
        }
    }
}

/// The fencing compare: the node's own key is still held by the lease the
/// caller registered with (a node whose lease expired, or that re-registered
/// since, fails it).
/// `seen` (the record at `key`) is unchanged and the node incarnation that
/// wrote it is gone: its node no longer holds that lease (a missing node
/// key compares as lease 0).
fn orphaned(key: &str, seen: &Versioned<SandboxRoute>) -> [Compare; 2] {
    [
        Compare::mod_revision(key, CompareOp::Equal, seen.mod_revision),
        Compare::lease(
            keyspace::node_key(&seen.value.node_id),
            CompareOp::NotEqual,
            seen.value.incarnation,
        ),
    ]
}

pub(crate) fn node_holds(node_id: &str, lease: i64) -> Compare {
    Compare::lease(keyspace::node_key(node_id), CompareOp::Equal, lease)
}

/// Deletes `id`'s record (and gives back its team's slot) if it is
/// unchanged since `mod_revision` and its node still holds the lease it was
/// written under.
pub(crate) async fn release(
    client: &mut Client,
    id: &str,
    seen: &Versioned<SandboxRoute>,
) -> Result<bool, ClusterError> {
    let key = keyspace::sandbox_key(id);
    let mut then = vec![TxnOp::delete(key.clone(), None)];
    then.extend(seen.value.running.as_ref().map(|s| quota::free_slot(s, id)));
    let txn = Txn::new()
        .when([
            Compare::mod_revision(key, CompareOp::Equal, seen.mod_revision),
            node_holds(&seen.value.node_id, seen.value.incarnation),
        ])
        .and_then(then);
    send_txn(client, txn).await
}

/// Rewrites `id`'s record as `route` if it is unchanged since `seen` and
/// its node (the one `seen` names) still holds its lease; a slot `seen`
/// held and `route` does not goes back.
pub(crate) async fn update(
    client: &mut Client,
    id: &str,
    seen: &Versioned<SandboxRoute>,
    route: &SandboxRoute,
) -> Result<bool, ClusterError> {
    let key = keyspace::sandbox_key(id);
    let value = encode(&key, route)?;
    let mut then = vec![TxnOp::put(key.clone(), value, None)];
    if let Some(slot) = &seen.value.running
        && route.running.as_ref() != Some(slot)
    {
        then.push(quota::free_slot(slot, id));
    }
    let txn = Txn::new()
        .when([
            Compare::mod_revision(key, CompareOp::Equal, seen.mod_revision),
            node_holds(&seen.value.node_id, seen.value.incarnation),
        ])
        .and_then(then);
    send_txn(client, txn).await
}

/// Moves `id` to `route`'s node: only if the record is unchanged since
/// `seen`, the node it names no longer holds the lease it claimed under
/// (gone, or registered anew), and the new node holds its own.
pub(crate) async fn take_over(
    client: &mut Client,
    id: &str,
    seen: &Versioned<SandboxRoute>,
    route: &SandboxRoute,
) -> Result<bool, ClusterError> {
    let key = keyspace::sandbox_key(id);
    let value = encode(&key, route)?;
    let txn = Txn::new()
        .when(
            orphaned(&key, seen)
                .into_iter()
                .chain([node_holds(&route.node_id, route.incarnation)])
                .collect::<Vec<_>>(),
        )
        .and_then([TxnOp::put(key, value, None)]);
    send_txn(client, txn).await
}

/// etcd-client balances requests over every endpoint and goes on choosing
/// a member that died until its reconnects fail: a request sent there fails
/// with `Unavailable` without reaching etcd. Sent again, it finds a live
/// member. A leader election answers `Unavailable` ("leader changed", "no
/// leader") or outlasts the request's timeout (`Cancelled`, or the
/// server's `DeadlineExceeded`): sent again until [`RETRY_WINDOW`] has
/// passed, a request rides out an election of up to twice the timeout,
/// while without a quorum it still fails within about that. Safe for
/// transactions too: each is conditional on the record's revision or
/// absence, so one that did apply before its answer was lost fails its
/// compare the second time instead of applying twice (and its caller reads
/// back what it finds, e.g. a claim finding its own route).
pub(crate) async fn retried<T, F, Fut>(mut request: F) -> Result<T, etcd_client::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    let started = tokio::time::Instant::now();
    let mut attempt = 1;
    loop {
        match request().await {
            Err(etcd_client::Error::GRpcStatus(status))
                if transient(status.code()) && started.elapsed() < RETRY_WINDOW =>
            {
                tracing::debug!(
                    "etcd request failed (attempt {attempt}, {:?}): {}",
                    status.code(),
                    status.message()
                );
                tokio::time::sleep(Duration::from_millis(100) * attempt.min(10)).await;
                attempt += 1;
            }
            answer => return answer,
        }
    }
}

/// How long after its first attempt a request failing with a transient
/// error is sent again (a new attempt may start until then).
const RETRY_WINDOW: Duration = Duration::from_secs(6);

/// Errors a request sent again may not meet: a member gone or without a
/// leader, a request that timed out during an election.
fn transient(code: tonic::Code) -> bool {
    matches!(
        code,
        tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::DeadlineExceeded
    )
}

/// Sends a conditional transaction (see [`retried`]): whether it applied.
pub(crate) async fn send_txn(client: &mut Client, txn: Txn) -> Result<bool, ClusterError> {
    Ok(send(client, txn).await?.succeeded())
}

/// Sends a transaction (see [`retried`]): its answer.
pub(crate) async fn send(
    client: &mut Client,
    txn: Txn,
) -> Result<etcd_client::TxnResponse, ClusterError> {
    Ok(retried(|| {
        let (mut client, txn) = (client.clone(), txn.clone());
        async move { client.txn(txn).await }
    })
    .await?)
}

pub(crate) fn encode<T: serde::Serialize>(key: &str, value: &T) -> Result<Vec<u8>, ClusterError> {
    serde_json::to_vec(value).map_err(|source| ClusterError::Record {
        key: key.to_owned(),
        source,
    })
}

pub(crate) fn decode<T: serde::de::DeserializeOwned>(
    key: &[u8],
    value: &[u8],
) -> Result<T, ClusterError> {
    serde_json::from_slice(value).map_err(|source| ClusterError::Record {
        key: String::from_utf8_lossy(key).into_owned(),
        source,
    })
}

/// etcd's client options for a part under TLS: its certificate, the CA's
/// trust (etcd's own certificate must name the address in `--etcd`).
pub fn etcd_tls(tls: &sandfork_tls::ClusterTls) -> etcd_client::TlsOptions {
    etcd_client::TlsOptions::new()
        .ca_certificate(etcd_client::Certificate::from_pem(tls.ca_pem()))
        .identity(etcd_client::Identity::from_pem(
            tls.cert_pem(),
            tls.key_pem(),
        ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_where_its_last_byte_is_raised() {
        assert_eq!(prefix_end(b"/sandfork/v1/"), b"/sandfork/v10");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }
}

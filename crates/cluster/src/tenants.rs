//! Teams and their API keys, kept in etcd so every node of a cluster
//! accepts the same keys and counts the same teams. The node owns the
//! records' shape: they are stored as the bytes it gives (its JSON), next
//! to what the cluster itself needs (a team's quota, its unique name).
//!
//! A node loads them all at start, then follows a watch ([`Tenants`]); an
//! admin change made through any node is written here first and reaches
//! every node's copy through that watch.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, EventType, Txn, TxnOp};
use tokio::task::JoinHandle;

use crate::keyspace::{self, TeamQuota};
use crate::{Cluster, ClusterError, encode, retried, send_txn};

/// Pause before loading again after etcd failed.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// Every team and key record, by team ID and by key hash (hex).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantRecords {
    pub teams: BTreeMap<String, Vec<u8>>,
    pub keys: BTreeMap<String, Vec<u8>>,
}

/// A change a node applies to its copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantChange {
    /// Everything, loaded anew: replaces the copy.
    Loaded(TenantRecords),
    Team {
        id: String,
        record: Vec<u8>,
    },
    Key {
        hash: String,
        record: Vec<u8>,
    },
    KeyRevoked {
        hash: String,
    },
}

impl Cluster {
    /// Writes a new team with its quota, unless a team named `name` exists:
    /// false then. Names are unique across the cluster.
    pub async fn create_team(
        &self,
        id: &str,
        name: &str,
        record: &[u8],
        quota: &TeamQuota,
    ) -> Result<bool, ClusterError> {
        let name_key = keyspace::team_name_key(name);
        let quota_key = keyspace::team_quota_key(id);
        let txn = Txn::new()
            .when([Compare::create_revision(
                name_key.clone(),
                CompareOp::Equal,
                0,
            )])
            .and_then([
                TxnOp::put(name_key, id, None),
                TxnOp::put(keyspace::team_record_key(id), record, None),
                TxnOp::put(quota_key.clone(), encode(&quota_key, quota)?, None),
            ]);
        send_txn(&mut self.client(), txn).await
    }

    /// Rewrites team `id`'s record and its quota together.
    pub async fn put_team(
        &self,
        id: &str,
        record: &[u8],
        quota: &TeamQuota,
    ) -> Result<(), ClusterError> {
        let quota_key = keyspace::team_quota_key(id);
        let txn = Txn::new().and_then([
            TxnOp::put(keyspace::team_record_key(id), record, None),
            TxnOp::put(quota_key.clone(), encode(&quota_key, quota)?, None),
        ]);
        send_txn(&mut self.client(), txn).await?;
        Ok(())
    }

    /// Writes the record of the key whose SHA-256 is `hash` (hex).
    pub async fn put_key(&self, hash: &str, record: &[u8]) -> Result<(), ClusterError> {
        let key = keyspace::api_key_key(hash);
        let record = record.to_vec();
        retried(|| {
            let (mut client, key, record) = (self.client(), key.clone(), record.clone());
            async move { client.put(key, record, None).await }
        })
        .await?;
        Ok(())
    }

    /// Removes the key whose SHA-256 is `hash`: false if there was none.
    pub async fn revoke_key(&self, hash: &str) -> Result<bool, ClusterError> {
        let key = keyspace::api_key_key(hash);
        let answer = retried(|| {
            let (mut client, key) = (self.client(), key.clone());
            async move { client.delete(key, None).await }
        })
        .await?;
        Ok(answer.deleted() > 0)
    }

    /// Every team and key record, and the revision they were read at.
    async fn tenant_records(&self) -> Result<(TenantRecords, i64), ClusterError> {
        let loaded = self.get_prefix(keyspace::TENANTS).await?;
        let revision = loaded.revision();
        let mut records = TenantRecords::default();
        for kv in loaded.kvs() {
            match change(kv.key(), kv.value()) {
                Some(TenantChange::Team { id, record }) => {
                    records.teams.insert(id, record);
                }
                Some(TenantChange::Key { hash, record }) => {
                    records.keys.insert(hash, record);
                }
                _ => {}
            }
        }
        Ok((records, revision))
    }
}

/// What a put of `key` changes (None: not a team or key record).
fn change(key: &[u8], value: &[u8]) -> Option<TenantChange> {
    let key = std::str::from_utf8(key).ok()?;
    if let Some(id) = key.strip_prefix(keyspace::TENANT_TEAMS) {
        return Some(TenantChange::Team {
            id: id.to_owned(),
            record: value.to_vec(),
        });
    }
    key.strip_prefix(keyspace::TENANT_KEYS)
        .map(|hash| TenantChange::Key {
            hash: hash.to_owned(),
            record: value.to_vec(),
        })
}

/// A node's copy of the teams and keys, kept by a watch; dropping it stops
/// the watch.
#[derive(Debug)]
pub struct Tenants {
    task: JoinHandle<()>,
}

impl Tenants {
    /// Loads every record and hands it to `apply` before returning (so a
    /// node serves no request with a copy older than its start), then
    /// follows each change in a task. After a broken watch it loads
    /// everything again (a [`TenantChange::Loaded`]).
    pub async fn start(
        cluster: Cluster,
        apply: impl Fn(TenantChange) + Send + Sync + 'static,
    ) -> Result<Tenants, ClusterError> {
        let apply = Arc::new(apply);
        let (records, revision) = cluster.tenant_records().await?;
        apply(TenantChange::Loaded(records));
        let task = tokio::spawn(async move {
            let mut from = revision + 1;
            loop {
                if let Err(e) = follow(&cluster, from, &*apply).await {
                    tracing::warn!("cluster: following teams and keys: {e}; loading again");
                }
                tokio::time::sleep(RETRY_AFTER).await;
                match cluster.tenant_records().await {
                    Ok((records, revision)) => {
                        apply(TenantChange::Loaded(records));
                        from = revision + 1;
                    }
                    Err(e) => tracing::warn!("cluster: loading teams and keys: {e}"),
                }
            }
        });
        Ok(Tenants { task })
    }
}

impl Drop for Tenants {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Applies the changes from `revision` on until the watch ends.
async fn follow(
    cluster: &Cluster,
    revision: i64,
    apply: &(dyn Fn(TenantChange) + Send + Sync),
) -> Result<(), ClusterError> {
    crate::follow_prefix(
        cluster,
        keyspace::TENANTS,
        revision,
        "cluster: teams and keys",
        |kind, kv| {
            let changed = match kind {
                EventType::Put => change(kv.key(), kv.value()),
                EventType::Delete => std::str::from_utf8(kv.key())
                    .ok()
                    .and_then(|k| k.strip_prefix(keyspace::TENANT_KEYS))
                    .map(|hash| TenantChange::KeyRevoked {
                        hash: hash.to_owned(),
                    }),
            };
            if let Some(changed) = changed {
                apply(changed);
            }
        },
    )
    .await
}

//! Team quotas that hold across the cluster: however many nodes and
//! gateways create at once, a team never runs more than its
//! `max_sandboxes`.
//!
//! A counter key would do, but every claim of a team would then compare
//! and rewrite the one key, and a count that drifted (a node dead between
//! two writes) stays wrong. Instead a team with a quota of N has N slots,
//! `teams/{team}/running/{0..N}`: a sandbox that runs holds one, taken in
//! the same transaction as its route (which names the slot) only if the
//! slot key does not exist, and given back with the route. Slot keys live
//! under their node's lease, so the slots of a node that died free
//! themselves; its sandboxes are lost anyway. Claimers start at a slot
//! picked from the sandbox ID, so a burst rarely races for the same one.

use std::collections::BTreeMap;

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};

use crate::keyspace::{self, RunningSlot, TeamQuota};
use crate::{Cluster, ClusterError, Versioned, decode, encode, retried};

/// How a claim ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// The sandbox is this node's (now, or already).
    Claimed,
    /// Another record holds the sandbox ID, or the node's lease is gone.
    Refused,
    /// Its team runs `limit` sandboxes already.
    TeamFull { limit: u64 },
}

/// What a team's slots looked like at one revision.
pub(crate) struct Slots {
    /// The team's quota and its key's revision (0: none set).
    pub quota: Versioned<TeamQuota>,
    /// Slot index to the sandbox holding it.
    pub held: BTreeMap<u64, String>,
}

impl Slots {
    /// A free slot below the quota for sandbox `id`, or why there is none;
    /// None when the team has no quota (nothing to take).
    pub fn free_for(&self, id: &str) -> Option<Result<u64, Claim>> {
        let limit = self.quota.value.max_sandboxes?;
        // A lowered quota leaves slots above it held until they end.
        if self.held.len() as u64 >= limit {
            return Some(Err(Claim::TeamFull { limit }));
        }
        let start = spread(id) % limit;
        let slot = (0..limit)
            .map(|i| (start + i) % limit)
            .find(|s| !self.held.contains_key(s));
        Some(slot.ok_or(Claim::TeamFull { limit }))
    }

    /// The compare that holds while the team's quota is as read.
    pub fn quota_unchanged(&self, team: &str) -> Compare {
        Compare::mod_revision(
            keyspace::team_quota_key(team),
            CompareOp::Equal,
            self.quota.mod_revision,
        )
    }
}

/// FNV-1a of the ID: any well-spread number will do.
fn spread(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

impl Cluster {
    /// Team `team`'s quota (the default, no limit, when none is set).
    pub async fn team_quota(&self, team: &str) -> Result<TeamQuota, ClusterError> {
        Ok(self.slots(team).await?.quota.value)
    }

    /// Sets team `team`'s quota. Sandboxes running above a lowered one run
    /// on; no new one starts until the team is below it.
    pub async fn set_team_quota(&self, team: &str, quota: &TeamQuota) -> Result<(), ClusterError> {
        let key = keyspace::team_quota_key(team);
        let value = encode(&key, quota)?;
        retried(|| {
            let (mut client, key, value) = (self.client(), key.clone(), value.clone());
            async move { client.put(key, value, None).await }
        })
        .await?;
        Ok(())
    }

    /// The sandboxes holding team `team`'s slots, by slot.
    pub async fn running_slots(&self, team: &str) -> Result<BTreeMap<u64, String>, ClusterError> {
        Ok(self.slots(team).await?.held)
    }

    /// `Some(limit)` when team `team` runs as many sandboxes as its quota
    /// allows (one read; a claim may still lose the last slot to another).
    pub async fn team_full(&self, team: &str) -> Result<Option<u64>, ClusterError> {
        let slots = self.slots(team).await?;
        Ok(slots
            .quota
            .value
            .max_sandboxes
            .filter(|limit| slots.held.len() as u64 >= *limit))
    }

    /// The team's quota and slots, read at one revision.
    pub(crate) async fn slots(&self, team: &str) -> Result<Slots, ClusterError> {
        let prefix = keyspace::team_slots_prefix(team);
        let quota_key = keyspace::team_quota_key(team);
        let txn = Txn::new().and_then([
            TxnOp::get(quota_key.clone(), None),
            TxnOp::get(prefix.clone(), Some(GetOptions::new().with_prefix())),
        ]);
        let response = retried(|| {
            let (mut client, txn) = (self.client(), txn.clone());
            async move { client.txn(txn).await }
        })
        .await?;
        let mut quota = Versioned {
            value: TeamQuota::default(),
            mod_revision: 0,
        };
        let mut held = BTreeMap::new();
        for (i, op) in response.op_responses().into_iter().enumerate() {
            let etcd_client::TxnOpResponse::Get(get) = op else {
                continue;
            };
            for kv in get.kvs() {
                if i == 0 {
                    quota = Versioned {
                        value: decode(kv.key(), kv.value())?,
                        mod_revision: kv.mod_revision(),
                    };
                } else if let Some(slot) = std::str::from_utf8(kv.key())
                    .ok()
                    .and_then(|k| k.strip_prefix(&prefix))
                    .and_then(|s| s.parse().ok())
                {
                    held.insert(slot, String::from_utf8_lossy(kv.value()).into_owned());
                }
            }
        }
        Ok(Slots { quota, held })
    }
}

/// Takes `slot` for sandbox `id` under lease `lease`: only if it is free.
pub(crate) fn take_slot(slot: &RunningSlot, id: &str, lease: i64) -> (Compare, TxnOp) {
    let key = slot.key();
    (
        Compare::create_revision(key.clone(), CompareOp::Equal, 0),
        TxnOp::put(key, id, Some(PutOptions::new().with_lease(lease))),
    )
}

/// Gives `slot` back if sandbox `id` still holds it (its lease may have
/// freed it, and another sandbox taken it, since).
pub(crate) fn free_slot(slot: &RunningSlot, id: &str) -> TxnOp {
    let key = slot.key();
    TxnOp::txn(
        Txn::new()
            .when([Compare::value(key.clone(), CompareOp::Equal, id)])
            .and_then([TxnOp::delete(key, None)]),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(limit: Option<u64>, held: &[u64]) -> Slots {
        Slots {
            quota: Versioned {
                value: TeamQuota {
                    max_sandboxes: limit,
                },
                mod_revision: 1,
            },
            held: held.iter().map(|s| (*s, format!("sbx{s}"))).collect(),
        }
    }

    #[test]
    fn a_free_slot_is_below_the_quota_and_none_when_it_is_reached() {
        assert_eq!(slots(None, &[0, 1]).free_for("a"), None);
        for id in ["a", "b", "c", "dd"] {
            let Some(Ok(slot)) = slots(Some(4), &[0, 2]).free_for(id) else {
                panic!("no slot for {id}");
            };
            assert!(slot == 1 || slot == 3, "{id}: {slot}");
        }
        assert_eq!(
            slots(Some(2), &[0, 1]).free_for("a"),
            Some(Err(Claim::TeamFull { limit: 2 }))
        );
        // Lowered below what runs: full, though slot 0 is free.
        assert_eq!(
            slots(Some(2), &[1, 5, 7]).free_for("a"),
            Some(Err(Claim::TeamFull { limit: 2 }))
        );
        assert_eq!(
            slots(Some(0), &[]).free_for("a"),
            Some(Err(Claim::TeamFull { limit: 0 }))
        );
    }

    #[test]
    fn ids_start_at_different_slots() {
        let starts: std::collections::BTreeSet<u64> =
            (0..64).map(|i| spread(&format!("sbx{i}")) % 16).collect();
        assert!(starts.len() > 8, "{starts:?}");
    }
}

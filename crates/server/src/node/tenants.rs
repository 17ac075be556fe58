//! Teams: who owns what on a node. Every API key belongs to one team; every
//! sandbox, template and snapshot is owned by one. A request sees only its
//! team's things: another team's id answers exactly as an unknown id does
//! (404, as E2B answers for a foreign sandbox), lists hold only the caller's.
//! The node's own key (the bootstrap key: `SANDFORK_API_KEY` or the generated
//! `<data-dir>/api-key`) is the default team's and the only admin key; the
//! admin routes (`/admin/...`, [`crate::http::api`]) make teams and their keys.
//! Records from before teams existed belong to the default team, and the
//! `base` template is every team's.
//!
//! Keys are `e2b_` and 40 hex digits (160 random bits), stored as their
//! SHA-256 only (a slow hash adds nothing to a key that cannot be guessed)
//! and looked up by it. Each key's requests are rate-limited by a token
//! bucket ([`RateLimiter`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::node::capacity::TeamLimits;

/// The team of the node's own key, and of every record without a team.
pub const DEFAULT_TEAM: &str = "default";

/// A record's team: `team`, or the default team when it has none.
pub fn team_or_default(team: Option<&str>) -> &str {
    team.unwrap_or(DEFAULT_TEAM)
}

/// What a record stores for `team`: nothing for the default team (so records
/// of a node without teams stay as they were).
pub fn stored_team(team: Option<&str>) -> Option<String> {
    team.filter(|t| *t != DEFAULT_TEAM).map(str::to_owned)
}

/// A team as the store keeps it (keyed by id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TeamRecord {
    /// `team_` and 16 hex digits, or [`DEFAULT_TEAM`].
    pub id: String,
    /// Unique on the node.
    pub name: String,
    pub created_at_ms: u64,
    #[serde(default)]
    pub limits: TeamLimits,
    /// Each of its keys' requests per second (a burst of twice that); None:
    /// the node's default (`serve --key-rate-limit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_second: Option<u32>,
}

/// A team's API key as the store keeps it, keyed by the hex SHA-256 of the
/// key (the key itself is never stored).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KeyRecord {
    /// The first 16 hex digits of the key's hash: names it for `revoke`
    /// without being it.
    pub id: String,
    pub team: String,
    #[serde(default)]
    pub name: String,
    /// `e2b_` and the key's first and last 4 digits, for people.
    pub mask: String,
    pub created_at_ms: u64,
}

/// Who sent a request (put in its extensions by the API key check).
#[derive(Debug, Clone)]
pub struct Caller {
    pub team: Arc<str>,
    /// The node's own key: may use the admin routes.
    pub admin: bool,
}

impl Caller {
    /// The default team's admin (what the node's own key is).
    pub fn admin() -> Caller {
        Caller {
            team: Arc::from(DEFAULT_TEAM),
            admin: true,
        }
    }

    /// Whether a thing owned by `owner` (None: the default team) is the caller's.
    pub fn owns(&self, owner: Option<&str>) -> bool {
        *self.team == *team_or_default(owner)
    }

    /// What records store for this caller's team.
    pub fn stored_team(&self) -> Option<String> {
        stored_team(Some(&self.team))
    }
}

/// `e2b_abcd…wxyz`.
pub fn mask(key: &str) -> String {
    let hex = key.strip_prefix("e2b_").unwrap_or(key);
    if hex.len() < 12 {
        return "e2b_…".into();
    }
    format!("e2b_{}…{}", &hex[..4], &hex[hex.len() - 4..])
}

/// Token buckets, one per key: `rate` requests a second on average, up to
/// `2 × rate` at once. Only keys that authenticated get one, so the map is
/// as large as the node's live keys.
#[derive(Debug, Default)]
pub struct RateLimiter {
    buckets: Mutex<HashMap<[u8; 32], Bucket>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl RateLimiter {
    /// Takes one request from `key`'s bucket at `rate` per second; else how
    /// long until one is there.
    pub fn take(&self, key: &[u8; 32], rate: u32, now: Instant) -> Result<(), Duration> {
        if rate == 0 {
            return Ok(());
        }
        let rate = f64::from(rate);
        let burst = 2.0 * rate;
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let bucket = buckets.entry(*key).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * rate).min(burst);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - bucket.tokens) / rate))
        }
    }

    /// Forgets `key` (revoked).
    pub fn forget(&self, key: &[u8; 32]) {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        buckets.remove(key);
    }
}

/// The store's key for the owner of template (or snapshot, or build) `id`.
pub fn template_owner_key(id: &str) -> String {
    format!("template/{id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_allow_a_burst_then_the_rate() {
        let limiter = RateLimiter::default();
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let t0 = Instant::now();
        for _ in 0..20 {
            limiter.take(&a, 10, t0).unwrap();
        }
        let wait = limiter.take(&a, 10, t0).unwrap_err();
        assert!(wait > Duration::ZERO && wait <= Duration::from_millis(100));
        // Another key has its own bucket.
        limiter.take(&b, 10, t0).unwrap();
        // A tenth of a second later one more request is allowed, not two.
        let t1 = t0 + Duration::from_millis(100);
        limiter.take(&a, 10, t1).unwrap();
        assert!(limiter.take(&a, 10, t1).is_err());
        // No limit at rate 0.
        for _ in 0..1000 {
            limiter.take(&a, 0, t1).unwrap();
        }
    }

    #[test]
    fn masks_show_only_the_ends() {
        let key = "e2b_0123456789abcdef0123456789abcdef01234567";
        assert_eq!(mask(key), "e2b_0123…4567");
        assert_eq!(mask("e2b_12"), "e2b_…");
    }

    #[test]
    fn the_default_team_is_stored_as_none() {
        assert_eq!(stored_team(Some(DEFAULT_TEAM)), None);
        assert_eq!(stored_team(None), None);
        assert_eq!(stored_team(Some("team_1")), Some("team_1".into()));
        let c = Caller::admin();
        assert!(c.owns(None));
        assert!(c.owns(Some(DEFAULT_TEAM)));
        assert!(!c.owns(Some("team_1")));
    }
}

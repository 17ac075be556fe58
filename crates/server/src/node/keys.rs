//! The control plane's API keys: `X-API-KEY: e2b_<40 hex>`. Only their
//! SHA-256 is stored. The node's own key (the bootstrap key) is shown once,
//! in a 0600 file in the data dir; it is the default team's and the admin's.
//! Teams' keys are made through the admin routes (see [`crate::node::tenants`]).
//!
//! On a node in a cluster, teams and keys are the cluster's: written to etcd
//! (not the node's store) and followed there by every node's copy
//! ([`ApiKeys::apply`]), so a key made through one node works on all.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::node::capacity::TeamLimits;
use crate::node::clock::now_ms;
use crate::node::events::BoxFuture;
use crate::node::ids;
use crate::node::store::{Store, StoreError};
use crate::node::tenants::{Caller, DEFAULT_TEAM, KeyRecord, RateLimiter, TeamRecord};

/// The request header carrying the key (named in the wire contract; kept
/// here under its old name for the node's callers).
pub use crate::wire::API_KEY_HEADER as HEADER;
const META_KEY: &str = "api_key_sha256";
/// The key file's name in the data dir.
pub const KEY_FILE: &str = "api-key";

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("writing the API key to {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("generating an API key: {0}")]
    Random(#[source] std::io::Error),
    #[error("no team {0}")]
    NoTeam(String),
    #[error("a team named {0} exists")]
    TeamExists(String),
    #[error("no API key {0}")]
    NoKey(String),
    #[error("{0}")]
    Invalid(String),
    /// Where teams and keys are shared (a cluster's etcd) failed.
    #[error("the cluster's teams and keys: {0}")]
    Shared(String),
    #[error("a team or key record: {0}")]
    Record(#[from] serde_json::Error),
}

/// What the server accepts: the node's own key, and each team's keys. Clones
/// share one directory.
#[derive(Clone)]
pub struct ApiKeys {
    inner: Arc<Directory>,
}

struct Directory {
    /// The node's own key's hash: the default team's, and the admin's.
    admin: [u8; 32],
    /// Teams' keys by hash.
    keys: RwLock<HashMap<[u8; 32], KeyEntry>>,
    /// Teams by id (the default team only when it has settings).
    teams: RwLock<BTreeMap<String, TeamRecord>>,
    /// One change of teams or keys at a time (names stay unique on the
    /// node; etcd keeps them unique in a cluster).
    changing: tokio::sync::Mutex<()>,
    /// Set when the node shares its teams and keys (in a cluster): changes
    /// are written there.
    shared: OnceLock<Arc<dyn SharedTenants>>,
    limiter: RateLimiter,
    /// Requests per second of each key of a team that sets none (0: none).
    default_rate: u32,
}

#[derive(Debug, Clone)]
struct KeyEntry {
    team: Arc<str>,
    record: KeyRecord,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKeys(..)")
    }
}

pub fn hash(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// A new key in E2B's format: `e2b_` and 40 lowercase hex digits.
pub fn generate() -> Result<String, AuthError> {
    Ok(format!(
        "e2b_{}",
        ids::hex(&ids::random_bytes(20).map_err(AuthError::Random)?)
    ))
}

impl ApiKeys {
    /// Only the node's own `key`, no teams, no rate limit.
    pub fn for_key(key: &str) -> ApiKeys {
        ApiKeys::with_hash(hash(key), 0)
    }

    fn with_hash(admin: [u8; 32], default_rate: u32) -> ApiKeys {
        ApiKeys {
            inner: Arc::new(Directory {
                admin,
                keys: RwLock::default(),
                teams: RwLock::default(),
                changing: tokio::sync::Mutex::default(),
                shared: OnceLock::new(),
                limiter: RateLimiter::default(),
                default_rate,
            }),
        }
    }

    /// These keys, each limited to `per_second` requests a second (a burst
    /// of twice that) unless its team sets its own; 0: no limit.
    pub fn with_rate_limit(self, per_second: u32) -> ApiKeys {
        let admin = self.inner.admin;
        let teams = self.read_teams().clone();
        let keys = self.read_keys().clone();
        let out = ApiKeys::with_hash(admin, per_second);
        *out.inner.teams.write().unwrap_or_else(|p| p.into_inner()) = teams;
        *out.inner.keys.write().unwrap_or_else(|p| p.into_inner()) = keys;
        out
    }

    fn read_keys(&self) -> std::sync::RwLockReadGuard<'_, HashMap<[u8; 32], KeyEntry>> {
        self.inner.keys.read().unwrap_or_else(|p| p.into_inner())
    }

    fn read_teams(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, TeamRecord>> {
        self.inner.teams.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `key` is one of the node's.
    pub fn accepts(&self, key: &str) -> bool {
        self.authenticate(key).is_some()
    }

    /// Who `key` is. The node's own key is compared in constant time; a
    /// team's key is found by its hash (a table lookup by SHA-256: its timing
    /// tells nothing about the key).
    pub fn authenticate(&self, key: &str) -> Option<Caller> {
        let candidate = hash(key);
        if same_secret(&candidate, &self.inner.admin) {
            return Some(Caller::admin());
        }
        self.read_keys().get(&candidate).map(|k| Caller {
            team: k.team.clone(),
            admin: false,
        })
    }

    /// Takes one request of `key`'s rate (its team's, else the node's); else
    /// how long until it may send the next.
    pub fn admit(&self, key: &str, caller: &Caller) -> Result<(), Duration> {
        let rate = self
            .read_teams()
            .get(&*caller.team)
            .and_then(|t| t.requests_per_second)
            .unwrap_or(self.inner.default_rate);
        self.inner.limiter.take(&hash(key), rate, Instant::now())
    }

    /// Loads the teams and keys `store` holds.
    pub fn load(&self, store: &Store) -> Result<(), AuthError> {
        let teams: BTreeMap<String, TeamRecord> = store
            .teams()?
            .into_iter()
            .map(|t| (t.id.clone(), t))
            .collect();
        let mut keys = HashMap::new();
        for (hex, record) in store.keys()? {
            let Some(h) = unhex32(&hex) else {
                tracing::warn!(
                    "API key {}: its stored hash is malformed; ignored",
                    record.id
                );
                continue;
            };
            keys.insert(
                h,
                KeyEntry {
                    team: Arc::from(record.team.as_str()),
                    record,
                },
            );
        }
        *self.inner.teams.write().unwrap_or_else(|p| p.into_inner()) = teams;
        *self.inner.keys.write().unwrap_or_else(|p| p.into_inner()) = keys;
        Ok(())
    }

    /// Every team, the default one first.
    pub fn teams(&self) -> Vec<TeamRecord> {
        let teams = self.read_teams();
        let default = teams
            .get(DEFAULT_TEAM)
            .cloned()
            .unwrap_or_else(default_team);
        std::iter::once(default)
            .chain(teams.values().filter(|t| t.id != DEFAULT_TEAM).cloned())
            .collect()
    }

    /// The team with id or name `wanted`.
    pub fn team(&self, wanted: &str) -> Option<TeamRecord> {
        self.teams()
            .into_iter()
            .find(|t| t.id == wanted)
            .or_else(|| self.teams().into_iter().find(|t| t.name == wanted))
    }

    /// From now on, teams and keys are changed in `shared` (whose records
    /// [`ApiKeys::apply`] follows) instead of the node's store.
    pub fn share(&self, shared: Arc<dyn SharedTenants>) {
        if self.inner.shared.set(shared).is_err() {
            tracing::warn!("the API keys were shared twice; the first place is kept");
        }
    }

    /// Applies a change of the shared teams and keys to this copy.
    pub fn apply(&self, update: TenantUpdate) {
        match update {
            TenantUpdate::Loaded { teams, keys } => {
                let teams = teams.into_iter().map(|t| (t.id.clone(), t)).collect();
                let keys = keys
                    .into_iter()
                    .filter_map(|(hex, record)| key_entry(&hex, record))
                    .collect();
                *self.inner.teams.write().unwrap_or_else(|p| p.into_inner()) = teams;
                *self.inner.keys.write().unwrap_or_else(|p| p.into_inner()) = keys;
            }
            TenantUpdate::Team(team) => self.insert_team(team),
            TenantUpdate::Key { hash, record } => {
                if let Some((h, entry)) = key_entry(&hash, record) {
                    self.inner
                        .keys
                        .write()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(h, entry);
                }
            }
            TenantUpdate::KeyRevoked { hash } => {
                if let Some(h) = unhex32(&hash) {
                    self.forget_key(&h);
                }
            }
        }
    }

    fn insert_team(&self, team: TeamRecord) {
        let mut teams = self.inner.teams.write().unwrap_or_else(|p| p.into_inner());
        teams.insert(team.id.clone(), team);
    }

    fn forget_key(&self, h: &[u8; 32]) {
        self.inner
            .keys
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(h);
        self.inner.limiter.forget(h);
    }

    /// Writes `team` where teams are kept (the store, or the cluster with
    /// its quota); `new`: only if no team has its name (in the cluster).
    async fn put_team(&self, store: &Store, team: &TeamRecord, new: bool) -> Result<(), AuthError> {
        let Some(shared) = self.inner.shared.get() else {
            return Ok(store.put_team(team)?);
        };
        if shared
            .put_team(team, new)
            .await
            .map_err(AuthError::Shared)?
        {
            Ok(())
        } else {
            Err(AuthError::TeamExists(team.name.clone()))
        }
    }

    /// Makes a team named `name` (unique; letters, digits, `-`, `_`, `.`).
    pub async fn create_team(
        &self,
        store: &Store,
        name: &str,
        limits: TeamLimits,
        requests_per_second: Option<u32>,
    ) -> Result<TeamRecord, AuthError> {
        check_team_name(name)?;
        let _one = self.inner.changing.lock().await;
        if self.team(name).is_some() {
            return Err(AuthError::TeamExists(name.to_owned()));
        }
        let id = format!(
            "team_{}",
            ids::hex(&ids::random_bytes(8).map_err(AuthError::Random)?)
        );
        let team = TeamRecord {
            id,
            name: name.to_owned(),
            created_at_ms: now_ms(),
            limits,
            requests_per_second,
        };
        self.put_team(store, &team, true).await?;
        self.insert_team(team.clone());
        Ok(team)
    }

    /// Changes team `wanted`'s limits and rate (the default team's too).
    pub async fn update_team(
        &self,
        store: &Store,
        wanted: &str,
        change: impl FnOnce(&mut TeamRecord),
    ) -> Result<TeamRecord, AuthError> {
        let _one = self.inner.changing.lock().await;
        let mut team = self
            .team(wanted)
            .ok_or_else(|| AuthError::NoTeam(wanted.to_owned()))?;
        change(&mut team);
        self.put_team(store, &team, false).await?;
        self.insert_team(team.clone());
        Ok(team)
    }

    /// A new key for team `wanted`: the key (shown once) and its record.
    pub async fn create_key(
        &self,
        store: &Store,
        wanted: &str,
        name: &str,
    ) -> Result<(String, KeyRecord), AuthError> {
        let team = self
            .team(wanted)
            .ok_or_else(|| AuthError::NoTeam(wanted.to_owned()))?;
        let _one = self.inner.changing.lock().await;
        let key = generate()?;
        let h = hash(&key);
        let hex = ids::hex(&h);
        let record = KeyRecord {
            id: hex[..16].to_owned(),
            team: team.id.clone(),
            name: name.to_owned(),
            mask: crate::node::tenants::mask(&key),
            created_at_ms: now_ms(),
        };
        match self.inner.shared.get() {
            Some(shared) => shared
                .put_key(&hex, &record)
                .await
                .map_err(AuthError::Shared)?,
            None => store.put_key(&hex, &record)?,
        }
        let mut keys = self.inner.keys.write().unwrap_or_else(|p| p.into_inner());
        keys.insert(
            h,
            KeyEntry {
                team: Arc::from(team.id.as_str()),
                record: record.clone(),
            },
        );
        Ok((key, record))
    }

    /// The keys of team `team` (an id), oldest first; every team's with None.
    pub fn keys(&self, team: Option<&str>) -> Vec<KeyRecord> {
        let mut out: Vec<KeyRecord> = self
            .read_keys()
            .values()
            .filter(|k| team.is_none_or(|t| *k.team == *t))
            .map(|k| k.record.clone())
            .collect();
        out.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        out
    }

    /// Revokes the key whose id is `id`: its next request is refused (401).
    pub async fn revoke_key(&self, store: &Store, id: &str) -> Result<KeyRecord, AuthError> {
        let _one = self.inner.changing.lock().await;
        let found = self
            .read_keys()
            .iter()
            .find(|(_, k)| k.record.id == id)
            .map(|(h, k)| (*h, k.record.clone()));
        let (h, record) = found.ok_or_else(|| AuthError::NoKey(id.to_owned()))?;
        match self.inner.shared.get() {
            Some(shared) => {
                shared
                    .revoke_key(&ids::hex(&h))
                    .await
                    .map_err(AuthError::Shared)?;
            }
            None => {
                store.remove_key(&ids::hex(&h))?;
            }
        }
        self.forget_key(&h);
        Ok(record)
    }
}

fn default_team() -> TeamRecord {
    TeamRecord {
        id: DEFAULT_TEAM.into(),
        name: DEFAULT_TEAM.into(),
        created_at_ms: 0,
        limits: TeamLimits::default(),
        requests_per_second: None,
    }
}

/// A record as the cluster keeps it; a malformed one is left out (with a
/// warning: a node must not stop over another's bad write).
fn key_entry(hex: &str, record: KeyRecord) -> Option<([u8; 32], KeyEntry)> {
    let Some(h) = unhex32(hex) else {
        tracing::warn!("shared API key record {hex}: not a SHA-256; ignored");
        return None;
    };
    Some((
        h,
        KeyEntry {
            team: Arc::from(record.team.as_str()),
            record,
        },
    ))
}

/// A change of the shared teams and keys, as [`ApiKeys::apply`] takes it.
#[derive(Debug)]
pub enum TenantUpdate {
    /// Every team and key (by its hash, in hex), replacing what was known.
    Loaded {
        teams: Vec<TeamRecord>,
        keys: Vec<(String, KeyRecord)>,
    },
    Team(TeamRecord),
    Key {
        hash: String,
        record: KeyRecord,
    },
    KeyRevoked {
        hash: String,
    },
}

/// Where teams and keys are written when nodes share them (a cluster). Its
/// errors are told to the client as they are (503).
pub trait SharedTenants: Send + Sync {
    /// Writes `team`; `new`: only if no team has its name (false if one has).
    fn put_team<'a>(
        &'a self,
        team: &'a TeamRecord,
        new: bool,
    ) -> BoxFuture<'a, Result<bool, String>>;
    /// Writes key record `record` under its hash `hash` (hex).
    fn put_key<'a>(
        &'a self,
        hash: &'a str,
        record: &'a KeyRecord,
    ) -> BoxFuture<'a, Result<(), String>>;
    /// Revokes the key whose hash is `hash` (hex).
    fn revoke_key<'a>(&'a self, hash: &'a str) -> BoxFuture<'a, Result<(), String>>;
}

fn check_team_name(name: &str) -> Result<(), AuthError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok && !name.starts_with("team_") {
        Ok(())
    } else {
        Err(AuthError::Invalid(format!(
            "team name {name:?}: 1 to 64 letters, digits, '-', '_' or '.', not starting with team_"
        )))
    }
}

fn unhex32(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Whether two secrets are equal, in time that depends only on their
/// lengths (a token's length is not secret: they are all one length).
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Decides the accepted key. `env_key` (`SANDFORK_API_KEY`) wins; else the
/// stored hash; else a new key is generated, written to `<data_dir>/api-key`
/// (0600, written then renamed) and its hash stored. Returns the key file's
/// path unless the key came from the environment.
/// The teams and their keys are loaded from the store.
pub fn setup(
    store: &Store,
    data_dir: &Path,
    env_key: Option<&str>,
) -> Result<(ApiKeys, Option<PathBuf>), AuthError> {
    let (keys, path) = setup_key(store, data_dir, env_key)?;
    keys.load(store)?;
    Ok((keys, path))
}

fn setup_key(
    store: &Store,
    data_dir: &Path,
    env_key: Option<&str>,
) -> Result<(ApiKeys, Option<PathBuf>), AuthError> {
    if let Some(key) = env_key {
        return Ok((ApiKeys::for_key(key), None));
    }
    let path = data_dir.join(KEY_FILE);
    if let Some(stored) = store.meta(META_KEY)?
        && let Ok(hash) = <[u8; 32]>::try_from(stored.as_slice())
    {
        return Ok((ApiKeys::with_hash(hash, 0), Some(path)));
    }
    let key = generate()?;
    write_key_file(&path, &key)?;
    store.put_meta(META_KEY, &hash(&key))?;
    Ok((ApiKeys::for_key(&key), Some(path)))
}

fn write_key_file(path: &Path, key: &str) -> Result<(), AuthError> {
    let err = |source| AuthError::Write {
        path: path.to_owned(),
        source,
    };
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(err)?;
    file.write_all(format!("{key}\n").as_bytes()).map_err(err)?;
    file.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn generated_keys_have_e2b_format_and_differ() {
        let a = generate().unwrap();
        let b = generate().unwrap();
        assert_ne!(a, b);
        let hex = a.strip_prefix("e2b_").unwrap();
        assert_eq!(hex.len(), 40);
        assert!(
            hex.bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
        );
    }

    #[test]
    fn keys_check_by_hash() {
        let keys = ApiKeys::for_key("e2b_00ff");
        assert!(keys.accepts("e2b_00ff"));
        assert!(!keys.accepts("e2b_00fe"));
        assert!(!keys.accepts(""));
    }

    #[test]
    fn first_start_writes_a_private_key_file_and_later_starts_reuse_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.redb")).unwrap();
        let (keys, file) = setup(&store, dir.path(), None).unwrap();
        let file = file.unwrap();
        let key = std::fs::read_to_string(&file).unwrap().trim().to_string();
        assert!(keys.accepts(&key));
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // Only the hash is stored.
        let stored = store.meta(META_KEY).unwrap().unwrap();
        assert_eq!(stored, hash(&key));
        assert!(!String::from_utf8_lossy(&stored).contains(&key));

        // A restart accepts the same key, without writing a new one.
        std::fs::remove_file(&file).unwrap();
        let (again, _) = setup(&store, dir.path(), None).unwrap();
        assert!(again.accepts(&key));
        assert!(!file.exists());

        // The environment's key wins.
        let (env, none) = setup(&store, dir.path(), Some("e2b_abc")).unwrap();
        assert!(none.is_none());
        assert!(env.accepts("e2b_abc"));
        assert!(!env.accepts(&key));
    }

    #[tokio::test]
    async fn teams_and_keys_are_stored_hashed_and_load_again() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.redb")).unwrap();
        let keys = ApiKeys::for_key("e2b_admin");
        assert!(keys.authenticate("e2b_admin").unwrap().admin);
        let limits = TeamLimits {
            max_sandboxes: Some(2),
            max_memory_mb: None,
        };
        let team = keys
            .create_team(&store, "a", limits, Some(7))
            .await
            .unwrap();
        assert!(matches!(
            keys.create_team(&store, "a", limits, None).await,
            Err(AuthError::TeamExists(_))
        ));
        let (key, record) = keys.create_key(&store, "a", "ci").await.unwrap();
        let caller = keys.authenticate(&key).unwrap();
        assert_eq!((&*caller.team, caller.admin), (team.id.as_str(), false));
        assert!(store.keys().unwrap().iter().all(|(h, r)| {
            h.len() == 64
                && !h.contains(&key[4..])
                && !serde_json::to_string(r).unwrap().contains(&key[4..])
        }));
        // The team's rate: 7 a second, a burst of 14.
        for _ in 0..14 {
            keys.admit(&key, &caller).unwrap();
        }
        assert!(keys.admit(&key, &caller).is_err());

        let again = ApiKeys::for_key("e2b_admin");
        again.load(&store).unwrap();
        assert_eq!(again.team("a"), Some(team.clone()));
        assert_eq!(again.team(&team.id), Some(team.clone()));
        assert_eq!(&*again.authenticate(&key).unwrap().team, team.id.as_str());
        assert_eq!(again.keys(Some(&team.id)), vec![record.clone()]);
        // The default team is listed first, changeable, and stored once changed.
        assert_eq!(again.teams()[0].id, DEFAULT_TEAM);
        again
            .update_team(&store, DEFAULT_TEAM, |t| t.limits.max_sandboxes = Some(1))
            .await
            .unwrap();
        again.revoke_key(&store, &record.id).await.unwrap();
        assert!(again.authenticate(&key).is_none());
        let third = ApiKeys::for_key("e2b_admin");
        third.load(&store).unwrap();
        assert!(third.authenticate(&key).is_none());
        assert_eq!(third.teams()[0].limits.max_sandboxes, Some(1));
        assert!(matches!(
            third.revoke_key(&store, &record.id).await,
            Err(AuthError::NoKey(_))
        ));
    }
}

//! Idempotent creates (E2B's `Idempotency-Key`): a create retried with the
//! same key and the same request answers what the first one answered, once
//! and for all, across restarts of the node; the same key with another
//! request is refused. Keys are scoped to a team.
//!
//! Only a create that made a sandbox is recorded: a refused one (a team at
//! its limit, a full node) leaves no record, so the SDKs' own retry of a 429
//! or 503, which sends the same key again, gets a new attempt rather than
//! the refusal replayed. A replay does not look at the sandbox: one killed
//! since is answered all the same, as E2B does (the caller's next request to
//! it says it is gone).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::node::store::{IdempotentAnswer, IdempotentCreate, Store, StoreError};

/// How long a key is remembered (E2B's retention is a day too).
pub const RETENTION: Duration = Duration::from_secs(24 * 3600);

/// The longest key the SDKs send.
pub const MAX_KEY_LEN: usize = 255;

#[derive(Debug, thiserror::Error)]
pub enum IdempotencyError {
    #[error(
        "Idempotency-Key must be 1 to {MAX_KEY_LEN} characters of lowercase ASCII letters, \
         digits and hyphens"
    )]
    Malformed,
    #[error("Idempotency-Key was already used with a different request")]
    Mismatch,
    #[error(
        "the create first made with this Idempotency-Key was interrupted (the node restarted) \
         and its outcome is unknown; it was not run again: list the sandboxes, or create with \
         a new key"
    )]
    OutcomeUnknown,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Checks a key as the SDKs make them (`[a-z0-9-]{1,255}`).
pub fn check_key(key: &str) -> Result<(), IdempotencyError> {
    let fits = (1..=MAX_KEY_LEN).contains(&key.len())
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if fits {
        Ok(())
    } else {
        Err(IdempotencyError::Malformed)
    }
}

/// What identifies a request: its route and its JSON (`Value`'s own order,
/// so that the spacing of the body does not count).
pub fn fingerprint(route: &str, body: &serde_json::Value) -> String {
    let mut hash = Sha256::new();
    hash.update(route.as_bytes());
    hash.update(b"\n");
    hash.update(body.to_string().as_bytes());
    crate::node::ids::hex(&hash.finalize())
}

/// The creates under way with a key, on this node: a replay waits for its
/// first rather than making a second sandbox.
#[derive(Debug, Default)]
pub struct Creates {
    running: Mutex<HashMap<String, Running>>,
}

#[derive(Debug)]
struct Running {
    fingerprint: String,
    /// Wakes the waiters when the first create ends (its sender drops).
    ended: watch::Receiver<()>,
}

/// What [`Creates::begin`] found.
#[derive(Debug)]
pub enum Begun<'a> {
    /// Answer this, as the first create did.
    Replay(IdempotentAnswer),
    /// This request is the first: create, then [`Claim::finish`].
    First(Claim<'a>),
}

/// The first create with a key, under way. Dropped unfinished (the create
/// failed), the key is forgotten and the next request with it runs anew.
#[derive(Debug)]
pub struct Claim<'a> {
    creates: &'a Creates,
    store: &'a Store,
    key: String,
    fingerprint: String,
    expires_at_ms: u64,
    finished: bool,
    _ended: watch::Sender<()>,
}

impl Creates {
    /// Looks up `key` (already scoped to its team) for a request of
    /// `fingerprint` at `now_ms`; waits while a create with it is under way.
    pub async fn begin<'a>(
        &'a self,
        store: &'a Store,
        key: String,
        fingerprint: String,
        now_ms: u64,
    ) -> Result<Begun<'a>, IdempotencyError> {
        loop {
            let mut ended = {
                let mut running = self.lock();
                match running.get(&key) {
                    Some(r) if r.fingerprint != fingerprint => {
                        return Err(IdempotencyError::Mismatch);
                    }
                    Some(r) => r.ended.clone(),
                    None => {
                        let known = store
                            .idempotent_create(&key)?
                            .filter(|c| c.expires_at_ms > now_ms);
                        match known {
                            Some(c) if c.fingerprint != fingerprint => {
                                return Err(IdempotencyError::Mismatch);
                            }
                            Some(c) => {
                                return c
                                    .answer
                                    .map(Begun::Replay)
                                    .ok_or(IdempotencyError::OutcomeUnknown);
                            }
                            None => {}
                        }
                        let expires_at_ms = now_ms.saturating_add(
                            u64::try_from(RETENTION.as_millis()).unwrap_or(u64::MAX),
                        );
                        // Recorded before the create starts: a restart in
                        // the middle must not let a replay make another.
                        store.put_idempotent_create(
                            &key,
                            &IdempotentCreate {
                                fingerprint: fingerprint.clone(),
                                expires_at_ms,
                                answer: None,
                            },
                        )?;
                        let (sender, ended) = watch::channel(());
                        running.insert(
                            key.clone(),
                            Running {
                                fingerprint: fingerprint.clone(),
                                ended,
                            },
                        );
                        return Ok(Begun::First(Claim {
                            creates: self,
                            store,
                            key,
                            fingerprint,
                            expires_at_ms,
                            finished: false,
                            _ended: sender,
                        }));
                    }
                }
            };
            // Err once the first create's claim is gone: look again.
            let _ = ended.changed().await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Running>> {
        // A poisoned map is still a map of plain values.
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Claim<'_> {
    /// Records `answer` for the replays to come.
    pub fn finish(mut self, answer: IdempotentAnswer) -> Result<(), StoreError> {
        self.finished = true;
        self.store.put_idempotent_create(
            &self.key,
            &IdempotentCreate {
                fingerprint: self.fingerprint.clone(),
                expires_at_ms: self.expires_at_ms,
                answer: Some(answer),
            },
        )
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.finished
            && let Err(e) = self.store.remove_idempotent_create(&self.key)
        {
            tracing::warn!("forgetting the idempotency key of a failed create: {e}");
        }
        self.creates.lock().remove(&self.key);
    }
}

/// Forgets the keys expired at `now_ms`.
pub fn collect(store: &Store, now_ms: u64) {
    match store.remove_expired_idempotent_creates(now_ms) {
        Ok(0) => {}
        Ok(n) => tracing::info!("forgot {n} expired idempotency key(s)"),
        Err(e) => tracing::warn!("forgetting expired idempotency keys: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn answer(id: &str) -> IdempotentAnswer {
        IdempotentAnswer {
            body: format!(r#"{{"sandboxID":"{id}"}}"#),
        }
    }

    #[test]
    fn keys_are_the_sdks() {
        assert!(check_key("0f8fad5b-d9cb-469f-a165-70867728950e").is_ok());
        for bad in ["", "Upper", "a_b", "é", &"a".repeat(256)] {
            assert!(check_key(bad).is_err(), "{bad}");
        }
        assert!(check_key(&"a".repeat(255)).is_ok());
    }

    #[test]
    fn the_fingerprint_is_the_json_not_its_spacing() {
        let a: serde_json::Value = serde_json::from_str(r#"{"a": 1, "b": [2]}"#).unwrap();
        let b: serde_json::Value = serde_json::from_str(r#"{"a":1,"b":[2]}"#).unwrap();
        let c: serde_json::Value = serde_json::from_str(r#"{"a":2,"b":[2]}"#).unwrap();
        assert_eq!(fingerprint("r", &a), fingerprint("r", &b));
        assert_ne!(fingerprint("r", &a), fingerprint("r", &c));
        assert_ne!(fingerprint("r", &a), fingerprint("s", &a));
    }

    #[tokio::test]
    async fn a_replay_waits_for_the_first_and_answers_what_it_answered() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(&dir.path().join("s.redb")).unwrap());
        let creates = Arc::new(Creates::default());
        let Begun::First(claim) = creates
            .begin(&store, "t/k".into(), "f".into(), 1)
            .await
            .unwrap()
        else {
            panic!("not first")
        };
        let replay = {
            let (creates, store) = (creates.clone(), store.clone());
            tokio::spawn(async move {
                match creates.begin(&store, "t/k".into(), "f".into(), 2).await {
                    Ok(Begun::Replay(a)) => a,
                    other => panic!("{other:?}"),
                }
            })
        };
        // Another request with the key is refused at once, while it runs.
        assert!(matches!(
            creates.begin(&store, "t/k".into(), "g".into(), 2).await,
            Err(IdempotencyError::Mismatch)
        ));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!replay.is_finished());
        claim.finish(answer("s1")).unwrap();
        assert_eq!(replay.await.unwrap(), answer("s1"));
        // Another team's key is its own.
        assert!(matches!(
            creates.begin(&store, "u/k".into(), "g".into(), 3).await,
            Ok(Begun::First(_))
        ));
    }

    #[tokio::test]
    async fn a_failed_create_is_forgotten_and_a_waiting_replay_runs_anew() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(&dir.path().join("s.redb")).unwrap());
        let creates = Arc::new(Creates::default());
        let first = creates.begin(&store, "t/k".into(), "f".into(), 1).await;
        let replay = {
            let (creates, store) = (creates.clone(), store.clone());
            tokio::spawn(async move {
                matches!(
                    creates.begin(&store, "t/k".into(), "f".into(), 2).await,
                    Ok(Begun::First(_))
                )
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(first);
        assert!(replay.await.unwrap());
        assert_eq!(store.idempotent_create("t/k").unwrap(), None);
    }

    #[tokio::test]
    async fn answers_survive_a_restart_until_they_expire() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.redb");
        {
            let store = Store::open(&path).unwrap();
            let creates = Creates::default();
            let Ok(Begun::First(claim)) = creates.begin(&store, "t/k".into(), "f".into(), 1).await
            else {
                panic!("not first")
            };
            claim.finish(answer("s1")).unwrap();
            // One interrupted by the restart: never finished nor dropped.
            let Ok(Begun::First(claim)) = creates.begin(&store, "t/j".into(), "f".into(), 1).await
            else {
                panic!("not first")
            };
            std::mem::forget(claim);
        }
        let store = Store::open(&path).unwrap();
        let creates = Creates::default();
        let day = u64::try_from(RETENTION.as_millis()).unwrap();
        match creates.begin(&store, "t/k".into(), "f".into(), day).await {
            Ok(Begun::Replay(a)) => assert_eq!(a, answer("s1")),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            creates.begin(&store, "t/j".into(), "f".into(), day).await,
            Err(IdempotencyError::OutcomeUnknown)
        ));
        collect(&store, day + 1);
        assert_eq!(store.idempotent_create("t/k").unwrap(), None);
        assert!(matches!(
            creates
                .begin(&store, "t/k".into(), "f".into(), day + 1)
                .await,
            Ok(Begun::First(_))
        ));
    }
}

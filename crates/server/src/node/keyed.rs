//! Work done once per key at a time: a second caller for a key waits for
//! the first, then usually finds the work done (a template taken in, an
//! image's template booted) and does nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

/// One lock per key, made on first use and dropped once nobody holds or
/// waits for it.
#[derive(Default, Debug)]
pub struct KeyedLocks {
    locks: Mutex<HashMap<String, Arc<AsyncMutex<()>>>>,
}

/// `key`'s lock, held until dropped.
#[derive(Debug)]
pub struct KeyedGuard<'a> {
    owner: &'a KeyedLocks,
    key: String,
    held: Option<OwnedMutexGuard<()>>,
}

impl KeyedLocks {
    /// Waits for `key`'s lock.
    pub async fn lock(&self, key: &str) -> KeyedGuard<'_> {
        let lock = self.map().entry(key.to_owned()).or_default().clone();
        KeyedGuard {
            owner: self,
            key: key.to_owned(),
            held: Some(lock.lock_owned().await),
        }
    }

    /// How many keys have a lock now (held or waited for).
    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<AsyncMutex<()>>>> {
        self.locks.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for KeyedGuard<'_> {
    fn drop(&mut self) {
        let mut map = self.owner.map();
        // Released under the map's lock, so no caller takes the Arc between
        // the count and the removal.
        drop(self.held.take());
        // The map's own reference is the last one: nobody waits.
        if map
            .get(&self.key)
            .is_some_and(|l| Arc::strong_count(l) == 1)
        {
            map.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn one_holder_per_key_and_nothing_kept_after() {
        let locks = Arc::new(KeyedLocks::default());
        let inside = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let (locks, inside, most) = (locks.clone(), inside.clone(), most.clone());
                tokio::spawn(async move {
                    let key = if i % 2 == 0 { "a" } else { "b" };
                    let _held = locks.lock(key).await;
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        // Two keys: at most two at once, never two of one key.
        assert_eq!(most.load(Ordering::SeqCst), 2);
        assert!(locks.is_empty(), "{} locks kept", locks.len());
    }

    #[tokio::test]
    async fn a_waiter_keeps_the_lock_it_waits_for() {
        let locks = Arc::new(KeyedLocks::default());
        let first = locks.lock("k").await;
        let waiting = {
            let locks = locks.clone();
            tokio::spawn(async move {
                let _second = locks.lock("k").await;
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(first);
        // Still there for the waiter, which holds its clone.
        waiting.await.unwrap();
        assert!(locks.is_empty());
    }
}

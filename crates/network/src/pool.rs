//! The pool: slots made ahead of need by a worker thread, taken in O(1), given back to be
//! reset and reused; at start, stale slots of a previous run are removed and the slots of
//! sandboxes that still run are adopted.

use std::collections::{HashSet, VecDeque};
use std::fs;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::host::{Host, HostConfig};
use crate::plan::{ANCHOR_PREFIX, HOST_VETH_PREFIX, slot_id_from_name};
use crate::policy::EgressPolicy;
use crate::slot::{self, Slot};

#[derive(Clone, Debug)]
pub struct PoolConfig {
    pub host: HostConfig,
    /// Ready slots the worker keeps (a fork burst's worth); refilled when fewer.
    pub ready_target: usize,
    /// How long a given-back slot rests before reuse, so requests still in flight to its
    /// host address (the proxy's) cannot reach the next sandbox (E2B waits 3 s).
    pub release_delay: std::time::Duration,
}

impl PoolConfig {
    pub fn new(host: HostConfig) -> Self {
        PoolConfig {
            host,
            ready_target: 32,
            release_delay: std::time::Duration::from_secs(3),
        }
    }
}

/// A slot still in use by a sandbox that outlived a restart, with the policy stored for it.
#[derive(Clone, Debug)]
pub struct InUse {
    pub id: u32,
    pub policy: EgressPolicy,
}

#[derive(Default)]
struct State {
    ready: VecDeque<Slot>,
    /// Given back, waiting out the drain delay, then a reset (oldest first).
    returned: VecDeque<(Instant, Slot)>,
    /// Ids with no slot made (lowest first).
    unmade: Vec<u32>,
    in_use: HashSet<u32>,
    /// Slots the worker is making or resetting right now.
    busy: usize,
    stop: bool,
    /// Errors the worker met, for the server's log; the worker retries later.
    last_error: Option<String>,
}

struct Inner {
    host: Host,
    state: Mutex<State>,
    wake: Condvar,
    ready_target: usize,
    release_delay: std::time::Duration,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        crate::lock(&self.state)
    }
}

pub struct Pool {
    inner: Arc<Inner>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (ready, in_use) = self.counts();
        f.debug_struct("Pool")
            .field("ready", &ready)
            .field("in_use", &in_use)
            .finish_non_exhaustive()
    }
}

/// What start found.
#[derive(Debug, Default)]
pub struct Reclaimed {
    /// Slots of `in_use` that were adopted (give them to their sandboxes).
    pub adopted: Vec<Slot>,
    /// Ids of `in_use` whose slot was gone.
    pub missing: Vec<u32>,
    /// Stale slots removed.
    pub removed: Vec<u32>,
}

impl Pool {
    /// Checks and prepares the host, reclaims what a previous run left and starts the worker.
    pub fn start(cfg: PoolConfig, in_use: &[InUse]) -> Result<(Pool, Reclaimed)> {
        let host = Host::open(&cfg.host)?;
        let mut rec = Reclaimed::default();
        let mut adopted_ids = HashSet::new();
        for u in in_use {
            match slot::adopt(&host, u.id, u.policy.clone()) {
                Ok(s) => {
                    adopted_ids.insert(u.id);
                    rec.adopted.push(s);
                }
                Err(_) => rec.missing.push(u.id),
            }
        }
        // Stale anchors and host veths: everything of ours not adopted.
        let mut stale = HashSet::new();
        for e in fs::read_dir(&host.anchor_dir).map_err(|e| Error::sys("read anchor dir", e))? {
            let e = e.map_err(|e| Error::sys("read anchor dir", e))?;
            if let Some(id) = e
                .file_name()
                .to_str()
                .and_then(|n| slot_id_from_name(n, ANCHOR_PREFIX))
            {
                stale.insert(id);
            }
        }
        for l in crate::lock(&host.rtnl).links()? {
            if let Some(id) = slot_id_from_name(&l.name, HOST_VETH_PREFIX) {
                stale.insert(id);
            }
        }
        for id in stale {
            if adopted_ids.contains(&id) {
                continue;
            }
            let addrs = host.plan.slot(id);
            match addrs {
                Ok(a) => slot::remove_parts(&host, &a)?,
                Err(_) => {
                    // An id beyond the current plan: remove by name.
                    let name = format!("{HOST_VETH_PREFIX}{id}");
                    let mut hr = crate::lock(&host.rtnl);
                    if let Ok(i) = hr.index(&name) {
                        hr.del_link(i)?;
                    }
                    drop(hr);
                    crate::netns::remove_anchor(
                        &host.anchor_dir.join(format!("{ANCHOR_PREFIX}{id}")),
                    )?;
                }
            }
            rec.removed.push(id);
        }
        rec.removed.sort();
        let unmade: Vec<u32> = (1..=host.plan.slots)
            .rev()
            .filter(|id| !adopted_ids.contains(id))
            .collect();
        let inner = Arc::new(Inner {
            host,
            state: Mutex::new(State {
                unmade,
                in_use: adopted_ids,
                ..Default::default()
            }),
            wake: Condvar::new(),
            ready_target: cfg.ready_target,
            release_delay: cfg.release_delay,
        });
        let w = Arc::clone(&inner);
        let worker = std::thread::Builder::new()
            .name("net-slots".into())
            .spawn(move || worker(&w))
            .map_err(|e| Error::sys("spawn slot worker", e))?;
        Ok((
            Pool {
                inner,
                worker: Some(worker),
            },
            rec,
        ))
    }

    /// A ready slot for a new sandbox (create, restore, fork child), with `policy` applied.
    /// When none is ready one is made on the spot; when every id is in use: `Exhausted`.
    pub fn take(&self, policy: &EgressPolicy) -> Result<Slot> {
        enum Got {
            Ready(Slot),
            Returned(Slot),
            Make(u32),
        }
        let got = {
            let mut st = self.inner.lock();
            let got = loop {
                let now = Instant::now();
                if let Some(s) = st.ready.pop_front() {
                    break Got::Ready(s);
                } else if let Some((_, s)) = st.returned.pop_front_if(|(t, _)| *t <= now) {
                    break Got::Returned(s);
                } else if let Some(id) = st.unmade.pop() {
                    break Got::Make(id);
                } else if st.busy == 0 {
                    // Slots resting after release do not count: they are not free yet.
                    return Err(Error::Exhausted(self.inner.host.plan.slots));
                }
                // The worker holds the last slot(s): wait for it rather than fail.
                st = self
                    .inner
                    .wake
                    .wait(st)
                    .unwrap_or_else(PoisonError::into_inner);
            };
            let id = match &got {
                Got::Ready(s) | Got::Returned(s) => s.id(),
                Got::Make(id) => *id,
            };
            st.in_use.insert(id);
            self.inner.wake.notify_all();
            got
        };
        let mut slot = match got {
            Got::Ready(s) => s,
            Got::Returned(mut s) => match slot::reset(&mut s) {
                Ok(()) => s,
                Err(e) => {
                    self.give_up(s.id(), Some(s));
                    return Err(e);
                }
            },
            Got::Make(id) => match slot::create(&self.inner.host, id) {
                Ok(s) => s,
                Err(e) => {
                    if let Ok(a) = self.inner.host.plan.slot(id) {
                        let _ = slot::remove_parts(&self.inner.host, &a);
                    }
                    self.give_up(id, None);
                    return Err(e);
                }
            },
        };
        if *policy != EgressPolicy::default()
            && let Err(e) = slot::set_policy(&mut slot, policy.clone())
        {
            self.release(slot);
            return Err(e);
        }
        Ok(slot)
    }

    fn give_up(&self, id: u32, slot: Option<Slot>) {
        let mut st = self.inner.lock();
        st.in_use.remove(&id);
        match slot {
            Some(s) => st.returned.push_back((Instant::now(), s)),
            None => st.unmade.push(id),
        }
        self.inner.wake.notify_all();
    }

    /// Replaces a slot's policy in one transaction (`PUT /sandboxes/{id}/network`).
    pub fn set_policy(&self, slot: &mut Slot, policy: EgressPolicy) -> Result<()> {
        slot::set_policy(slot, policy)
    }

    /// Gives a slot back once its sandbox is gone: the worker resets and reuses it.
    pub fn release(&self, slot: Slot) {
        let mut st = self.inner.lock();
        st.in_use.remove(&slot.id());
        st.returned
            .push_back((Instant::now() + self.inner.release_delay, slot));
        self.inner.wake.notify_all();
    }

    /// Removes a slot for good (its id can be made again later).
    pub fn destroy(&self, slot: Slot) -> Result<()> {
        let id = slot.id();
        let r = slot::remove(&self.inner.host, slot);
        let mut st = self.inner.lock();
        st.in_use.remove(&id);
        st.unmade.push(id);
        st.unmade.sort_by(|a, b| b.cmp(a));
        r
    }

    /// (ready, in use) counts.
    pub fn counts(&self) -> (usize, usize) {
        let st = self.inner.lock();
        (st.ready.len() + st.returned.len(), st.in_use.len())
    }

    /// Waits until `n` slots are ready (tests, start-up); false on timeout.
    pub fn wait_ready(&self, n: usize, timeout: std::time::Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.inner.lock();
        while st.ready.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self
                .inner
                .wake
                .wait_timeout(st, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    /// The last error the worker met.
    pub fn last_error(&self) -> Option<String> {
        self.inner.lock().last_error.clone()
    }

    /// Problems of the host found at start, for the log (see `HostConfig`).
    pub fn warnings(&self) -> &[String] {
        &self.inner.host.warnings
    }

    /// The destinations no policy opens (the egress proxy checks them too).
    pub fn always_deny(&self) -> &[crate::plan::Cidr4] {
        &self.inner.host.always_deny
    }

    /// The uplink the host table masquerades out of.
    pub fn uplink(&self) -> &str {
        &self.inner.host.uplink
    }

    /// Stops the worker. With `remove_ready`, also removes every slot not in use (a clean
    /// stop), and the host table when none is in use; slots in use stay for the next start.
    pub fn shutdown(mut self, remove_ready: bool) -> Result<()> {
        self.stop_worker();
        if !remove_ready {
            return Ok(());
        }
        let (slots, none_in_use) = {
            let mut st = self.inner.lock();
            let mut v: Vec<Slot> = st.ready.drain(..).collect();
            v.extend(st.returned.drain(..).map(|(_, s)| s));
            (v, st.in_use.is_empty())
        };
        let mut first_err = None;
        for s in slots {
            if let Err(e) = slot::remove(&self.inner.host, s) {
                first_err.get_or_insert(e);
            }
        }
        if none_in_use && let Err(e) = self.inner.host.remove_table() {
            first_err.get_or_insert(e);
        }
        first_err.map_or(Ok(()), Err)
    }

    fn stop_worker(&mut self) {
        self.inner.lock().stop = true;
        self.inner.wake.notify_all();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.stop_worker();
    }
}

/// Resets returned slots first (they are the cheapest ready slots), then makes new ones until
/// `ready_target` are ready.
fn worker(inner: &Inner) {
    loop {
        enum Job {
            Reset(Slot),
            Make(u32),
        }
        let job = {
            let mut st = inner.lock();
            loop {
                if st.stop {
                    return;
                }
                let now = Instant::now();
                if let Some((_, s)) = st.returned.pop_front_if(|(t, _)| *t <= now) {
                    st.busy += 1;
                    break Job::Reset(s);
                }
                if st.ready.len() < inner.ready_target
                    && let Some(id) = st.unmade.pop()
                {
                    st.busy += 1;
                    break Job::Make(id);
                }
                st = match st.returned.front() {
                    Some((t, _)) => {
                        let left = t.saturating_duration_since(now);
                        inner
                            .wake
                            .wait_timeout(st, left)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0
                    }
                    None => inner.wake.wait(st).unwrap_or_else(PoisonError::into_inner),
                };
            }
        };
        let done = match job {
            Job::Reset(mut s) => match slot::reset(&mut s) {
                Ok(()) => Ok(s),
                Err(e) => {
                    // A slot that cannot be reset is removed and its id made anew later.
                    let id = s.id();
                    let _ = slot::remove(&inner.host, s);
                    Err((id, e))
                }
            },
            Job::Make(id) => slot::create(&inner.host, id).map_err(|e| {
                if let Ok(a) = inner.host.plan.slot(id) {
                    let _ = slot::remove_parts(&inner.host, &a);
                }
                (id, e)
            }),
        };
        let mut st = inner.lock();
        st.busy -= 1;
        match done {
            Ok(s) => st.ready.push_back(s),
            Err((id, e)) => {
                st.last_error = Some(format!("slot {id}: {e}"));
                st.unmade.insert(0, id); // retried last
                drop(st);
                inner.wake.notify_all();
                std::thread::sleep(std::time::Duration::from_millis(100));
                continue;
            }
        }
        inner.wake.notify_all();
    }
}

//! One object per sandbox this node holds, running or paused: its guest
//! (VMM and capacity, while it runs), what the node observed of it, and a
//! small state machine behind its own lock. The [`Registry`] holds them,
//! with the token index the envd proxy looks sandboxes up by.
//!
//! A change (pause, resume, fork, snapshot, kill) holds the sandbox's
//! `guest` lock from start to end and is the only writer of its phase, so
//! two changes never overlap: pause, fork and snapshot refuse when another
//! change holds it (409), resume and kill wait for it. Readers that must
//! not wait (the proxy, the observer, diagnostics) read the phase and the
//! VMM's probe from `status`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use vmm_driver::process::VmmProbe;

use super::SandboxError;
use super::observe::Observed;
use crate::node::ingress::Ingress;
use crate::node::launch::Launched;

/// Where a sandbox is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Its guest is being launched (create, fork child).
    Starting,
    Running,
    /// Its memory is being written out; the proxy answers "not found".
    Pausing,
    /// No VMM; its memory and disk are on disk.
    Paused,
    /// Its paused state is being restored.
    Resuming,
    /// A fork or snapshot freezes it for a moment; it serves meanwhile.
    Forking,
    /// A guest restored from one of its checkpoints replaces the one
    /// running; the proxy answers "not found" meanwhile.
    RollingBack,
    /// Being killed.
    Stopping,
    /// Killed, or its launch failed: out of the registry.
    Gone,
}

impl Phase {
    /// Whether the proxy may send it traffic.
    pub fn serves(self) -> bool {
        matches!(self, Phase::Running | Phase::Forking)
    }

    /// Whether `next` may follow this phase. Each change is one of these
    /// paths: launch (Starting → Running | Gone), pause (Running → Pausing →
    /// Paused | Running), resume (Paused → Resuming → Running | Paused), fork
    /// and snapshot (Running → Forking → Running), rollback (Running →
    /// RollingBack → Running), kill (any → Stopping → Gone).
    pub fn may_become(self, next: Phase) -> bool {
        use Phase::*;
        matches!(
            (self, next),
            (Starting, Running | Gone)
                | (Running, Pausing | Forking)
                | (Pausing, Paused | Running)
                | (Paused, Resuming)
                | (Resuming, Running | Paused)
                | (Forking, Running)
                | (Running, RollingBack)
                | (RollingBack, Running)
                | (Stopping, Gone)
        ) || (next == Stopping && !matches!(self, Stopping | Gone))
    }

    /// Why a change that needs a running sandbox cannot start now.
    pub fn refusal(self, id: &str) -> SandboxError {
        match self {
            Phase::Paused => SandboxError::Conflict {
                id: id.to_owned(),
                state: "paused",
            },
            Phase::Gone => SandboxError::NotFound(id.to_owned()),
            _ => busy(id),
        }
    }
}

/// Another change of sandbox `id` is under way.
pub fn busy(id: &str) -> SandboxError {
    SandboxError::Conflict {
        id: id.to_owned(),
        state: "changing state",
    }
}

#[derive(Debug)]
struct Status {
    phase: Phase,
    /// The VMM while one exists (to read it by without its lock).
    probe: Option<VmmProbe>,
}

/// One sandbox.
#[derive(Debug)]
pub struct Sandbox {
    pub id: String,
    /// The envd access token (fixed for the sandbox's life).
    pub token: Option<crate::node::ids::Token>,
    /// What the port proxy demands of requests to its guest's own ports
    /// (fixed for the sandbox's life).
    pub ingress: Ingress,
    status: Mutex<Status>,
    /// The running guest; held for the whole of a change.
    pub guest: tokio::sync::Mutex<Option<Launched>>,
    observed: Mutex<Observed>,
    /// True while its guest agent has stopped answering (the observer's
    /// probes decide; see [`super::observe`]); requests waiting on the
    /// guest watch it so they end with an error rather than never.
    unresponsive: tokio::sync::watch::Sender<bool>,
    /// Proxied requests under way (their answers' bodies included) and when
    /// the last one ended or began: what the pressure monitor calls use.
    in_flight: AtomicUsize,
    last_used_ms: AtomicU64,
    /// When its guest last answered a proxied request (or sent a part of
    /// an answer): a guest that answers is not unresponsive, whatever the
    /// observer's probes found.
    last_heard_ms: AtomicU64,
}

/// A proxied request to a sandbox, from its start to the end of its
/// answer's body: the sandbox is in use while one is held.
#[derive(Debug)]
pub struct InUse(Arc<Sandbox>);

impl InUse {
    /// Its guest answered (a response, a part of one's body).
    pub fn heard(&self) {
        self.0
            .last_heard_ms
            .fetch_max(crate::node::clock::now_ms(), Ordering::Relaxed);
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Sandbox {
    pub fn new(
        id: String,
        token: Option<crate::node::ids::Token>,
        ingress: Ingress,
        phase: Phase,
    ) -> Arc<Sandbox> {
        Arc::new(Sandbox {
            id,
            token,
            ingress,
            status: Mutex::new(Status { phase, probe: None }),
            guest: tokio::sync::Mutex::new(None),
            observed: Mutex::new(Observed::default()),
            unresponsive: tokio::sync::watch::Sender::new(false),
            in_flight: AtomicUsize::new(0),
            last_used_ms: AtomicU64::new(crate::node::clock::now_ms()),
            last_heard_ms: AtomicU64::new(0),
        })
    }

    /// The sandbox `record` describes, in `phase`.
    pub fn of_record(record: &crate::node::store::SandboxRecord, phase: Phase) -> Arc<Sandbox> {
        Sandbox::new(
            record.id.clone(),
            record.access_token.clone(),
            record.network.ingress.clone(),
            phase,
        )
    }

    /// Counts a proxied request from now until the guard drops.
    pub fn in_use(self: &Arc<Self>) -> InUse {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.touch();
        InUse(self.clone())
    }

    /// Marks it used now.
    pub fn touch(&self) {
        self.last_used_ms
            .fetch_max(crate::node::clock::now_ms(), Ordering::Relaxed);
    }

    /// Proxied requests under way.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    pub fn last_used_ms(&self) -> u64 {
        self.last_used_ms.load(Ordering::Relaxed)
    }

    /// When its guest last answered a proxied request (0: never).
    pub fn last_heard_ms(&self) -> u64 {
        self.last_heard_ms.load(Ordering::Relaxed)
    }

    pub fn phase(&self) -> Phase {
        lock(&self.status).phase
    }

    /// Moves to `next` (by the holder of `guest` only). A move the machine
    /// does not allow is a bug: logged, and refused.
    pub fn set_phase(&self, next: Phase) -> Result<(), SandboxError> {
        let mut status = lock(&self.status);
        if !status.phase.may_become(next) {
            tracing::error!(
                "sandbox {}: refused a move from {:?} to {next:?}",
                self.id,
                status.phase
            );
            return Err(busy(&self.id));
        }
        status.phase = next;
        if matches!(next, Phase::Paused | Phase::Gone) {
            status.probe = None;
        }
        Ok(())
    }

    /// Puts `launched` in as the running guest (by the holder of `guest`).
    pub fn run(
        &self,
        guest: &mut Option<Launched>,
        launched: Launched,
    ) -> Result<(), SandboxError> {
        let probe = launched.probe();
        *guest = Some(launched);
        // A new guest (a resume's, a launch's) is judged afresh.
        lock(&self.observed).probed(true, 0);
        self.touch();
        self.set_unresponsive(false);
        self.set_phase(Phase::Running)?;
        lock(&self.status).probe = Some(probe);
        Ok(())
    }

    /// The VMM, while one exists.
    pub fn probe(&self) -> Option<VmmProbe> {
        lock(&self.status).probe.clone()
    }

    /// The vsock socket, while the sandbox takes traffic.
    pub fn serving_vsock(&self) -> Option<PathBuf> {
        let status = lock(&self.status);
        status
            .phase
            .serves()
            .then(|| status.probe.as_ref().map(VmmProbe::vsock_path))
            .flatten()
    }

    pub fn observed(&self) -> MutexGuard<'_, Observed> {
        lock(&self.observed)
    }

    /// Whether its guest agent has stopped answering.
    pub fn unresponsive(&self) -> bool {
        *self.unresponsive.borrow()
    }

    pub fn set_unresponsive(&self, stuck: bool) {
        self.unresponsive.send_replace(stuck);
    }

    /// Follows [`Sandbox::unresponsive`] (for requests waiting on the guest).
    pub fn unresponsive_watch(&self) -> tokio::sync::watch::Receiver<bool> {
        self.unresponsive.subscribe()
    }
}

/// The sandboxes of this node, by id and by access token.
#[derive(Debug, Default)]
pub struct Registry {
    by_id: HashMap<String, Arc<Sandbox>>,
    /// token → id. A lookup by the token itself: the map's hasher is keyed
    /// at random, so its timing says nothing about near guesses, and the
    /// match found is compared again in constant time.
    by_token: HashMap<crate::node::ids::Token, String>,
}

impl Registry {
    /// Adds `sandbox`; false (and nothing added) when its id is taken.
    pub fn insert(&mut self, sandbox: Arc<Sandbox>) -> bool {
        if self.by_id.contains_key(&sandbox.id) {
            return false;
        }
        if let Some(token) = &sandbox.token {
            self.by_token.insert(token.clone(), sandbox.id.clone());
        }
        self.by_id.insert(sandbox.id.clone(), sandbox);
        true
    }

    pub fn remove(&mut self, id: &str) -> Option<Arc<Sandbox>> {
        let sandbox = self.by_id.remove(id)?;
        if let Some(token) = &sandbox.token {
            self.by_token.remove(token.as_str());
        }
        Some(sandbox)
    }

    pub fn get(&self, id: &str) -> Option<Arc<Sandbox>> {
        self.by_id.get(id).cloned()
    }

    pub fn contains(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }

    pub fn all(&self) -> Vec<Arc<Sandbox>> {
        self.by_id.values().cloned().collect()
    }

    /// The sandbox whose access token is `token`.
    pub fn by_token(&self, token: &str) -> Option<Arc<Sandbox>> {
        let id = self.by_token.get(token)?;
        let sandbox = self.by_id.get(id)?;
        let same = sandbox
            .token
            .as_deref()
            .is_some_and(|t| crate::node::keys::same_secret(t.as_bytes(), token.as_bytes()));
        same.then(|| sandbox.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_change_follows_its_path() {
        use Phase::*;
        assert!(Starting.may_become(Running));
        assert!(Running.may_become(Pausing) && Pausing.may_become(Paused));
        assert!(Paused.may_become(Resuming) && Resuming.may_become(Running));
        assert!(Running.may_become(Forking) && Forking.may_become(Running));
        // No second restore, no pause of a paused sandbox, no way back.
        assert!(!Resuming.may_become(Resuming));
        assert!(!Paused.may_become(Pausing));
        assert!(!Paused.may_become(Running));
        assert!(!Gone.may_become(Running));
        assert!(!Gone.may_become(Stopping) && !Stopping.may_become(Stopping));
        assert!(Running.may_become(RollingBack) && RollingBack.may_become(Running));
        assert!(!Paused.may_become(RollingBack) && !RollingBack.may_become(Paused));
        for p in [
            Starting,
            Running,
            Pausing,
            Paused,
            Resuming,
            Forking,
            RollingBack,
        ] {
            assert!(p.may_become(Stopping), "{p:?}");
        }
        assert!(Running.serves() && Forking.serves() && !Pausing.serves());
    }

    #[test]
    fn tokens_find_their_sandbox_until_it_leaves() {
        let mut r = Registry::default();
        assert!(r.insert(Sandbox::new(
            "a".into(),
            Some("tok-a".into()),
            Ingress::default(),
            Phase::Running
        )));
        assert!(!r.insert(Sandbox::new(
            "a".into(),
            None,
            Ingress::default(),
            Phase::Running
        )));
        assert!(r.insert(Sandbox::new(
            "b".into(),
            None,
            Ingress::default(),
            Phase::Running
        )));
        assert_eq!(r.by_token("tok-a").map(|s| s.id.clone()), Some("a".into()));
        assert!(r.by_token("tok-").is_none() && r.by_token("").is_none());
        r.remove("a");
        assert!(r.by_token("tok-a").is_none());
        assert!(r.contains("b") && !r.contains("a"));
    }

    #[test]
    fn a_request_keeps_it_in_use_until_its_guard_drops() {
        let s = Sandbox::new("a".into(), None, Default::default(), Phase::Running);
        let started = s.last_used_ms();
        let (one, two) = (s.in_use(), s.in_use());
        assert_eq!(s.in_flight(), 2);
        drop(one);
        assert_eq!(s.in_flight(), 1);
        std::thread::sleep(std::time::Duration::from_millis(5));
        drop(two);
        assert_eq!(s.in_flight(), 0);
        assert!(s.last_used_ms() > started);
    }
}

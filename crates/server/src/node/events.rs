//! The node's two seams to what sits above it (a cluster): it asks before a
//! client's operation takes room or changes what runs here ([`Hooks::admit`]),
//! and it tells what happened once the change is recorded and before the
//! answer leaves ([`Hooks::told`]), so the next request, through any node,
//! finds the change. The node never knows who listens: a lone node has no
//! hooks, and every call here is then a no-op.
//!
//! Only operations a client asked for are asked and told (creates, forks,
//! pauses, resumes, kills through the API; templates made ready or
//! deleted); what the node does by itself (a timeout, memory pressure, a
//! build's own sandbox) is found by the listener's own reconciling.
//!
//! Beside the hooks, a second seam that only listens: [`Lifecycle`] facts,
//! one per change in a sandbox's life as its owner sees it, the node's own
//! changes included (a kill or pause at its timeout), sent to any number of
//! subscribers ([`crate::node::sandbox::Manager::subscribe`]) and never
//! awaited: webhooks and the event history read them.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;

/// A boxed future, so the hooks stay object-safe.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a client's operation is about to do here.
#[derive(Debug, Clone, Copy)]
pub enum Ask<'a> {
    /// A create, or a fork's children, of `team`.
    Create { team: &'a str },
    /// A pause of sandbox `id`.
    Pause { id: &'a str },
    /// A resume (or connect) of paused sandbox `id` of `team`.
    Resume { id: &'a str, team: &'a str },
}

/// What happened, told after the node recorded it.
#[derive(Debug, Clone, Copy)]
pub enum Event<'a> {
    /// Sandbox `id` of `team` runs here: made by a create or a fork. A
    /// [`Denial`] undoes it (the sandbox is killed).
    Created { id: &'a str, team: &'a str },
    /// Sandbox `id` paused, as its client asked.
    Paused { id: &'a str },
    /// Sandbox `id` runs again (a resume or connect).
    Resumed { id: &'a str },
    /// A resume of sandbox `id` failed after it was admitted: still paused.
    NotResumed { id: &'a str },
    /// Sandbox `id` was killed, as its client asked.
    Killed { id: &'a str },
    /// Template `id` (a build's or a snapshot) is ready for use.
    TemplateReady { id: &'a str },
    /// Templates `ids` were deleted.
    TemplatesDeleted { ids: &'a [String] },
}

/// What a listener adds to the operation's answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Told {
    /// For a pause: whether it is kept beyond this node (None: nobody keeps
    /// pauses anywhere else).
    pub durable: Option<bool>,
}

/// Why something above the node said no. The HTTP floor turns each into a
/// status code (E2B's 429 for a team at its limit, 503 when the state the
/// answer depends on cannot be read).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Denial {
    /// The team already runs as many sandboxes as it may, counted across
    /// the cluster.
    #[error(
        "you have reached the maximum number of concurrent sandboxes ({limit}) of your team \
         across the cluster"
    )]
    TeamFull { limit: u64 },
    /// The shared state could not be read or written (etcd): every node
    /// would answer the same.
    #[error("cluster state: {0}")]
    ClusterState(String),
    /// The sandbox is elsewhere, or moved meanwhile.
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    NotFound(String),
    /// Not possible here now (another node may do it).
    #[error("{0}")]
    Unavailable(String),
}

impl Denial {
    /// The refusal this is, as the metrics name it.
    pub fn refusal(&self) -> crate::node::metrics::Refusal {
        use crate::node::metrics::Refusal;
        match self {
            Denial::TeamFull { .. } => Refusal::ClusterTeam,
            Denial::ClusterState(_) => Refusal::ClusterState,
            Denial::Conflict(_) | Denial::NotFound(_) | Denial::Unavailable(_) => Refusal::Cluster,
        }
    }
}

/// Held by an admitted operation until it ends (dropped, whatever its
/// outcome): what a listener keeps for the operation's length.
pub type Permit = Option<Box<dyn Send + Sync>>;

/// What sits above the node. Both calls are awaited inside the operation,
/// so their order against the node's own steps is fixed: an admission
/// before any room is taken, a telling before the answer leaves.
pub trait Hooks: std::fmt::Debug + Send + Sync {
    fn admit<'a>(&'a self, ask: Ask<'a>) -> BoxFuture<'a, Result<Permit, Denial>>;
    fn told<'a>(&'a self, event: Event<'a>) -> BoxFuture<'a, Result<Told, Denial>>;
}

/// What happened to a sandbox, as E2B names it in its lifecycle events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LifecycleKind {
    /// Made by a create.
    Created,
    /// Ended: by its owner, at its timeout, or its VMM gone.
    Killed,
    /// Paused: by its owner, or at its timeout with `autoPause`.
    Paused,
    /// Running again after a pause.
    Resumed,
    /// Made by a fork (one per child, naming its parent).
    Forked,
}

impl LifecycleKind {
    pub const ALL: [LifecycleKind; 5] = [
        LifecycleKind::Created,
        LifecycleKind::Killed,
        LifecycleKind::Paused,
        LifecycleKind::Resumed,
        LifecycleKind::Forked,
    ];

    /// E2B's event type.
    pub fn as_str(self) -> &'static str {
        match self {
            LifecycleKind::Created => "sandbox.lifecycle.created",
            LifecycleKind::Killed => "sandbox.lifecycle.killed",
            LifecycleKind::Paused => "sandbox.lifecycle.paused",
            LifecycleKind::Resumed => "sandbox.lifecycle.resumed",
            LifecycleKind::Forked => "sandbox.lifecycle.forked",
        }
    }

    pub fn parse(name: &str) -> Option<LifecycleKind> {
        LifecycleKind::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

/// One change in a sandbox's life, told to every subscriber once the node
/// recorded it. What the sandbox was then is copied in: a killed one's
/// record is gone by the time a subscriber reads this.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lifecycle {
    /// This event's own id (random, hex).
    pub id: String,
    pub kind: LifecycleKind,
    pub sandbox_id: String,
    /// The owning team ([`crate::node::tenants::DEFAULT_TEAM`] for none).
    pub team: String,
    pub template_id: String,
    pub metadata: BTreeMap<String, String>,
    /// For [`LifecycleKind::Forked`]: the sandbox (or snapshot) forked.
    pub parent_id: Option<String>,
    /// Which run of the sandbox (its pause count): each resume starts another.
    pub run: u32,
    pub started_at_ms: u64,
    pub cpu_count: u32,
    pub memory_mb: u64,
    pub at_ms: u64,
}

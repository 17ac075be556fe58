//! A node's registration: its record under a lease kept alive by a task,
//! rewritten when its load changes, made anew (a new incarnation) if the
//! lease is lost; and the node's side of the sandbox map.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{
    Client, Compare, CompareOp, LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn, TxnOp,
    TxnOpResponse,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::keyspace::{self, NodeCapacity, NodeLoad, NodeRecord, RunningSlot, SandboxRoute};
use crate::quota::{self, Claim};
use crate::{Cluster, ClusterError, Versioned};

/// A sandbox as the node holds it, for [`Registration::reconcile`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalSandbox {
    pub id: String,
    /// Its team (the quota it counts against while it runs).
    pub team: String,
    pub running: bool,
    /// Its pause's number (a paused sandbox's; see [`Reconciled::unstored`]).
    pub pause_generation: u32,
    /// Its pause was asked to stay on the node: never unstored.
    pub kept_local: bool,
}

/// What one [`Registration::reconcile`] did and found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// Sandboxes the node holds that it mapped to itself.
    pub claimed: usize,
    /// Routes of this node to sandboxes it no longer holds, removed.
    pub released: usize,
    /// Sandboxes the node holds whose route names another node: they moved
    /// there (a durable pause resumed elsewhere while this node was cut
    /// off), so the copy here is stale and must not serve. Each with the
    /// node that has it now.
    pub moved: Vec<(String, String)>,
    /// Sandboxes the node holds that were killed through a gateway while
    /// the node was gone ([`Cluster::kill_lost`]): not claimed again; the
    /// node removes its copy and then the tombstone
    /// ([`Cluster::clear_killed`]).
    pub killed: Vec<String>,
    /// Sandboxes paused here whose pause the route does not record as
    /// stored (paused without the API: at their timeout, for memory
    /// pressure; or their store failed): the node stores them, so that they
    /// outlive it too.
    pub unstored: Vec<String>,
}

/// A registered node. Dropping it stops the keep-alive (the lease then
/// expires); [`Registration::leave`] deletes the record at once.
#[derive(Debug)]
pub struct Registration {
    cluster: Cluster,
    record: Arc<Mutex<NodeRecord>>,
    load: watch::Sender<NodeLoad>,
    task: JoinHandle<()>,
}

impl Registration {
    /// Grants a lease of `ttl` and writes the node's record under it.
    pub async fn start(
        cluster: Cluster,
        node_id: &str,
        api_addr: &str,
        capacity: NodeCapacity,
        ttl: Duration,
    ) -> Result<Registration, ClusterError> {
        Self::start_with_cpu_template(cluster, node_id, api_addr, capacity, None, ttl).await
    }

    /// [`Registration::start`] for a node that boots its guests under CPU
    /// template `cpu_template` (None: the host's CPU), which its record
    /// publishes.
    pub async fn start_with_cpu_template(
        cluster: Cluster,
        node_id: &str,
        api_addr: &str,
        capacity: NodeCapacity,
        cpu_template: Option<String>,
        ttl: Duration,
    ) -> Result<Registration, ClusterError> {
        let mut record = NodeRecord {
            node_id: node_id.to_owned(),
            incarnation: 0,
            api_addr: api_addr.to_owned(),
            capacity,
            load: NodeLoad::default(),
            cpu_template,
        };
        let mut client = cluster.client();
        register(&mut client, &mut record, ttl).await?;
        tracing::info!(
            "cluster: registered node {node_id} at {api_addr} (lease {:x})",
            record.incarnation
        );
        let record = Arc::new(Mutex::new(record));
        let (load, load_rx) = watch::channel(NodeLoad::default());
        let task = tokio::spawn(keep(client, record.clone(), load_rx, ttl));
        Ok(Registration {
            cluster,
            record,
            load,
            task,
        })
    }

    pub fn node_id(&self) -> String {
        self.lock().node_id.clone()
    }

    /// The lease the node's record is held by now.
    pub fn incarnation(&self) -> i64 {
        self.lock().incarnation
    }

    /// Publishes the node's load (written only when it changed).
    pub fn set_load(&self, load: NodeLoad) {
        self.load.send_if_modified(|old| {
            let changed = *old != load;
            *old = load;
            changed
        });
    }

    /// Maps `id` to this node; false if another record exists or the node's
    /// lease no longer holds its key. Claiming again what this incarnation
    /// already holds is true (the reconciler may have been first).
    pub async fn claim(&self, id: &str) -> Result<bool, ClusterError> {
        Ok(self.claim_in_team(id, None).await? == Claim::Claimed)
    }

    /// [`Registration::claim`] for a sandbox of `team` (None: counted in
    /// no team): when the team has a quota, the route takes one of its
    /// slots in the same transaction, or the claim is refused as
    /// [`Claim::TeamFull`].
    pub async fn claim_in_team(&self, id: &str, team: Option<&str>) -> Result<Claim, ClusterError> {
        let route = {
            let record = self.lock();
            SandboxRoute {
                node_id: record.node_id.clone(),
                incarnation: record.incarnation,
                created_at_ms: now_ms(),
                paused: None,
                running: None,
            }
        };
        self.with_slot(id, team, route, None).await
    }

    /// Writes `route` for `id` if its record is still at `seen` (its mod
    /// revision; None: no record) and this node holds its lease, taking a
    /// slot of `team` if it has a quota; tried again while only the slot was
    /// lost to another sandbox (or the quota changed).
    async fn with_slot(
        &self,
        id: &str,
        team: Option<&str>,
        mut route: SandboxRoute,
        seen: Option<i64>,
    ) -> Result<Claim, ClusterError> {
        // Each lost try is a slot another sandbox won: a burst ends in
        // a full team long before this.
        const ATTEMPTS: u32 = 32;
        let key = keyspace::sandbox_key(id);
        let node_key = keyspace::node_key(&route.node_id);
        let mut client = self.cluster.client();
        for _ in 0..ATTEMPTS {
            let unchanged = match seen {
                None => Compare::create_revision(key.clone(), CompareOp::Equal, 0),
                Some(rev) => Compare::mod_revision(key.clone(), CompareOp::Equal, rev),
            };
            let mut when = vec![
                unchanged,
                crate::node_holds(&route.node_id, route.incarnation),
            ];
            let mut then = Vec::new();
            route.running = None;
            if let Some(team) = team {
                let slots = self.cluster.slots(team).await?;
                // A quota set meanwhile counts this sandbox too.
                when.push(slots.quota_unchanged(team));
                match slots.free_for(id) {
                    None => {}
                    Some(Err(full)) => {
                        // Unless it already runs here in one of them.
                        let running = self
                            .own(id)
                            .await?
                            .is_some_and(|r| r.value.running.is_some());
                        return Ok(if running { Claim::Claimed } else { full });
                    }
                    Some(Ok(slot)) => {
                        let slot = RunningSlot {
                            team: team.to_owned(),
                            slot,
                        };
                        let (free, take) = quota::take_slot(&slot, id, route.incarnation);
                        when.push(free);
                        then.push(take);
                        route.running = Some(slot);
                    }
                }
            }
            then.push(TxnOp::put(key.clone(), crate::encode(&key, &route)?, None));
            // When it fails: why, from the route and the node's key.
            let txn = Txn::new().when(when).and_then(then).or_else([
                TxnOp::get(key.clone(), None),
                TxnOp::get(node_key.clone(), None),
            ]);
            let answer = crate::send(&mut client, txn).await?;
            if answer.succeeded() {
                return Ok(Claim::Claimed);
            }
            let found = |i: usize| match answer.op_responses().get(i) {
                Some(TxnOpResponse::Get(get)) => get.kvs().first().cloned(),
                _ => None,
            };
            if found(1).is_none_or(|node| node.lease() != route.incarnation) {
                return Ok(Claim::Refused);
            }
            // The record changed: claimed meanwhile (by this incarnation,
            // the reconciler, or by another node), or rewritten.
            let now = found(0);
            if now.as_ref().map(|kv| kv.mod_revision()) != seen {
                let ours = match &now {
                    Some(kv) => {
                        let now: SandboxRoute = crate::decode(kv.key(), kv.value())?;
                        now.node_id == route.node_id && now.incarnation == route.incarnation
                    }
                    None => false,
                };
                return Ok(if ours { Claim::Claimed } else { Claim::Refused });
            }
        }
        tracing::warn!("cluster: sandbox {id}: no slot of its team taken in {ATTEMPTS} tries");
        Ok(Claim::Refused)
    }

    /// `id`, which this node owns, stops running (a pause): its team's slot
    /// goes back. False if the node does not own it (any more).
    pub async fn stop_running(&self, id: &str) -> Result<bool, ClusterError> {
        let Some(seen) = self.own(id).await? else {
            return Ok(false);
        };
        if seen.value.running.is_none() {
            return Ok(true);
        }
        let route = SandboxRoute {
            running: None,
            ..seen.value.clone()
        };
        crate::update(&mut self.cluster.client(), id, &seen, &route).await
    }

    /// `id`, which this node owns, runs again (a resume): it takes a slot
    /// of `team` if the team has a quota, or is refused as
    /// [`Claim::TeamFull`].
    pub async fn start_running(&self, id: &str, team: Option<&str>) -> Result<Claim, ClusterError> {
        let Some(seen) = self.own(id).await? else {
            return Ok(Claim::Refused);
        };
        if seen.value.running.is_some() {
            return Ok(Claim::Claimed);
        }
        self.with_slot(id, team, seen.value.clone(), Some(seen.mod_revision))
            .await
    }

    /// `id`'s route if this incarnation owns it; a route of this node's
    /// earlier incarnation is moved to this one first (the node holds the
    /// sandbox: its callers change sandboxes it holds).
    async fn own(&self, id: &str) -> Result<Option<Versioned<SandboxRoute>>, ClusterError> {
        let (node_id, incarnation) = {
            let record = self.lock();
            (record.node_id.clone(), record.incarnation)
        };
        let ours = |seen: &Versioned<SandboxRoute>| {
            seen.value.node_id == node_id && seen.value.incarnation == incarnation
        };
        let Some(seen) = self.cluster.sandbox(id).await? else {
            return Ok(None);
        };
        if ours(&seen) {
            return Ok(Some(seen));
        }
        if seen.value.node_id != node_id || !self.adopt_earlier(id, &seen).await? {
            return Ok(None);
        }
        Ok(self.cluster.sandbox(id).await?.filter(ours))
    }

    /// Moves `seen`, a route of this node's earlier incarnation (it
    /// restarted, or registered anew after its lease lapsed), to this one,
    /// once that lease is gone. Its team's slot was held under the old
    /// lease: the route takes none (the reconciler gives it one if it runs).
    async fn adopt_earlier(
        &self,
        id: &str,
        seen: &Versioned<SandboxRoute>,
    ) -> Result<bool, ClusterError> {
        let route = SandboxRoute {
            running: None,
            ..self.moved_here(&seen.value)
        };
        crate::take_over(&mut self.cluster.client(), id, seen, &route).await
    }

    /// `route` as this incarnation's.
    fn moved_here(&self, route: &SandboxRoute) -> SandboxRoute {
        let record = self.lock();
        SandboxRoute {
            node_id: record.node_id.clone(),
            incarnation: record.incarnation,
            ..route.clone()
        }
    }

    /// Removes `id` from the map if this node owns it; false if it does not
    /// (no record, another node's, or changed meanwhile).
    pub async fn release(&self, id: &str) -> Result<bool, ClusterError> {
        let Some(seen) = self.cluster.sandbox(id).await? else {
            return Ok(false);
        };
        if seen.value.node_id != self.node_id() {
            return Ok(false);
        }
        crate::release(&mut self.cluster.client(), id, &seen).await
    }

    /// Records that `id`, which this node owns, is paused with its snapshot
    /// in the object store (Some), or not (None: running, or paused only
    /// here). False if the node does not own it (any more).
    pub async fn set_paused(
        &self,
        id: &str,
        paused: Option<crate::DurablePause>,
    ) -> Result<bool, ClusterError> {
        let Some(seen) = self.own(id).await? else {
            return Ok(false);
        };
        if seen.value.paused == paused {
            return Ok(true);
        }
        let route = SandboxRoute {
            paused,
            ..seen.value.clone()
        };
        crate::update(&mut self.cluster.client(), id, &seen, &route).await
    }

    /// Moves `id`, durably paused on a node that is gone, to this node: true
    /// if this node now owns it (keeping its `paused`), false if the record
    /// changed since `seen` or its node still holds the lease it had.
    pub async fn take_over(
        &self,
        id: &str,
        seen: &crate::Versioned<SandboxRoute>,
    ) -> Result<bool, ClusterError> {
        let route = self.moved_here(&seen.value);
        crate::take_over(&mut self.cluster.client(), id, seen, &route).await
    }

    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// Makes the map agree with the sandboxes the node holds: claims those
    /// it lacks, releases this node's records of those gone, and gives each
    /// team's slots to the sandboxes that run (a sandbox paused or resumed
    /// without the API: its timeout, memory pressure); names those another
    /// node has taken ([`Reconciled::moved`]; only a durable pause moves,
    /// and only once this node's lease is gone, so its copy is the older)
    /// and those killed through a gateway while it was gone
    /// ([`Reconciled::killed`], not claimed again).
    /// Records of an earlier incarnation of this node are moved to this
    /// one (or removed, for a sandbox it no longer holds and whose pause is
    /// not stored) once that lease is gone. A sandbox that runs with its
    /// team at its quota (one adopted after a restart) is still claimed,
    /// without a slot, and reported: the map must name it to serve it. The slots of sandboxes
    /// `changing` names (a create, pause or resume the node is making, or
    /// made since it listed them) are left to that change, and so are
    /// their routes when the list lacks them.
    pub async fn reconcile(
        &self,
        local: &[LocalSandbox],
        changing: impl Fn(&str) -> bool,
    ) -> Result<Reconciled, ClusterError> {
        let node_id = self.node_id();
        let incarnation = self.incarnation();
        let local: BTreeMap<&str, &LocalSandbox> =
            local.iter().map(|s| (s.id.as_str(), s)).collect();
        let mut client = self.cluster.client();
        let killed = self.cluster.killed_on(&node_id).await?;
        let mut mapped = BTreeSet::new();
        let mut done = Reconciled::default();
        let mut quotas = BTreeMap::new();
        for (id, seen) in self.cluster.sandboxes().await? {
            if seen.value.node_id != node_id {
                if local.contains_key(id.as_str()) {
                    mapped.insert(id.clone());
                    // A take-in under way holds its copy before the route
                    // moves here.
                    if !changing(&id) {
                        done.moved.push((id, seen.value.node_id));
                    }
                }
                continue;
            }
            let current = seen.value.incarnation == incarnation;
            if let (Some(sandbox), true) = (local.get(id.as_str()), current) {
                mapped.insert(id.clone());
                if changing(&id) {
                    continue;
                }
                // Against the route as read: one changed since is left alone.
                let stored = seen.value.paused.as_ref().map(|p| p.generation);
                if !sandbox.running
                    && !sandbox.kept_local
                    && stored != Some(sandbox.pause_generation)
                {
                    done.unstored.push(id.clone());
                }
                match (sandbox.running, seen.value.running.is_some()) {
                    // Resumed without the API (a request woke it): what the
                    // store holds is out of date, and no other node may
                    // take it in. (Its slot follows on the next pass.)
                    (true, _) if stored.is_some() => {
                        let route = SandboxRoute {
                            paused: None,
                            ..seen.value.clone()
                        };
                        crate::update(&mut client, &id, &seen, &route).await?;
                    }
                    (false, true) => {
                        let route = SandboxRoute {
                            running: None,
                            ..seen.value.clone()
                        };
                        crate::update(&mut client, &id, &seen, &route).await?;
                    }
                    (true, false) if self.has_quota(&sandbox.team, &mut quotas).await? => {
                        let team = Some(sandbox.team.as_str());
                        let claim = self
                            .with_slot(&id, team, seen.value.clone(), Some(seen.mod_revision))
                            .await?;
                        if let Claim::TeamFull { limit } = claim {
                            tracing::warn!(
                                "cluster: sandbox {id} runs beyond its team {}'s quota of {limit}",
                                sandbox.team
                            );
                        }
                    }
                    _ => {}
                }
                continue;
            }
            if current {
                // A create that claimed its route after the node's list
                // was taken: the next pass lists it (released now, the
                // route would be missing until then).
                if changing(&id) {
                    continue;
                }
                if crate::release(&mut client, &id, &seen).await? {
                    done.released += 1;
                }
                continue;
            }
            // An earlier incarnation's route (the node restarted, or
            // registered anew after its lease lapsed): moved to this one if
            // the node holds the sandbox, removed if not (unless its pause is
            // stored: any node may take that in), each only once the old
            // lease is gone.
            if local.contains_key(id.as_str()) {
                mapped.insert(id.clone());
                if changing(&id) {
                    continue;
                }
                if self.adopt_earlier(&id, &seen).await? {
                    done.claimed += 1;
                }
            } else if seen.value.paused.is_none() && self.cluster.forget_orphan(&id, &seen).await? {
                done.released += 1;
            }
        }
        for id in &killed {
            if !local.contains_key(id.as_str()) {
                self.cluster.clear_killed(id).await?;
            }
        }
        for (id, sandbox) in local {
            if mapped.contains(id) {
                continue;
            }
            if killed.contains(id) {
                if !changing(id) {
                    done.killed.push(id.to_string());
                }
                continue;
            }
            let team = sandbox.running.then_some(sandbox.team.as_str());
            let claim = match self.claim_in_team(id, team).await? {
                Claim::TeamFull { limit } => {
                    tracing::warn!(
                        "cluster: sandbox {id} runs beyond its team {}'s quota of {limit}",
                        sandbox.team
                    );
                    self.claim_in_team(id, None).await?
                }
                claim => claim,
            };
            if claim == Claim::Claimed {
                done.claimed += 1;
            }
        }
        Ok(done)
    }

    /// Whether `team` has a quota, asked of etcd once per reconcile.
    async fn has_quota(
        &self,
        team: &str,
        known: &mut BTreeMap<String, bool>,
    ) -> Result<bool, ClusterError> {
        if let Some(has) = known.get(team) {
            return Ok(*has);
        }
        let has = self.cluster.team_quota(team).await?.max_sandboxes.is_some();
        known.insert(team.to_owned(), has);
        Ok(has)
    }

    /// Deletes the node's record and revokes its lease.
    pub async fn leave(&self) {
        self.task.abort();
        let lease = self.incarnation();
        if let Err(e) = self.cluster.client().lease_revoke(lease).await {
            tracing::warn!("cluster: revoking lease {lease:x}: {e}");
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, NodeRecord> {
        self.record.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A new lease and the record under it.
async fn register(
    client: &mut Client,
    record: &mut NodeRecord,
    ttl: Duration,
) -> Result<(), ClusterError> {
    let ttl = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
    record.incarnation = client.lease_grant(ttl, None).await?.id();
    put(client, record).await
}

async fn put(client: &mut Client, record: &NodeRecord) -> Result<(), ClusterError> {
    let key = keyspace::node_key(&record.node_id);
    let value = crate::encode(&key, record)?;
    client
        .put(
            key,
            value,
            Some(PutOptions::new().with_lease(record.incarnation)),
        )
        .await?;
    Ok(())
}

/// Keeps the lease alive (three refreshes per TTL), rewrites the record on
/// a load change, registers anew when etcd says the lease is gone.
async fn keep(
    mut client: Client,
    record: Arc<Mutex<NodeRecord>>,
    mut load: watch::Receiver<NodeLoad>,
    ttl: Duration,
) {
    let every = (ttl / 3).max(Duration::from_millis(200));
    loop {
        let lease = snapshot(&record).incarnation;
        let lost = match client.lease_keep_alive(lease).await {
            Ok((keeper, stream)) => {
                match refresh(&mut client, &record, &mut load, keeper, stream, every).await {
                    Some(lost) => lost,
                    // The registration was dropped: the node stops.
                    None => return,
                }
            }
            Err(e) => {
                tracing::warn!("cluster: keep-alive of lease {lease:x}: {e}");
                // A node cut off from etcd for longer than the TTL comes back
                // to a lease that expired: its keep-alive is refused for good.
                let expired = client
                    .lease_time_to_live(lease, None)
                    .await
                    .is_ok_and(|left| left.ttl() <= 0);
                if !expired {
                    tokio::time::sleep(every).await;
                }
                expired
            }
        };
        if lost {
            let mut now = snapshot(&record);
            tracing::warn!(
                "cluster: lease {:x} of node {} expired; registering again",
                now.incarnation,
                now.node_id
            );
            match register(&mut client, &mut now, ttl).await {
                Ok(()) => *record.lock().unwrap_or_else(|p| p.into_inner()) = now,
                Err(e) => tracing::warn!("cluster: registering again: {e}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn snapshot(record: &Mutex<NodeRecord>) -> NodeRecord {
    record.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Refreshes the lease every `every` and writes load changes until the
/// keep-alive fails: whether etcd said the lease is gone (None: the load's
/// sender was dropped, the node is stopping).
async fn refresh(
    client: &mut Client,
    record: &Mutex<NodeRecord>,
    load: &mut watch::Receiver<NodeLoad>,
    mut keeper: LeaseKeeper,
    mut stream: LeaseKeepAliveStream,
    every: Duration,
) -> Option<bool> {
    let lease = keeper.id();
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Err(e) = keeper.keep_alive().await {
                    tracing::warn!("cluster: keep-alive of lease {lease:x}: {e}");
                    return Some(false);
                }
                match stream.message().await {
                    Ok(Some(r)) if r.ttl() > 0 => {}
                    Ok(Some(_)) => return Some(true),
                    Ok(None) => return Some(false),
                    Err(e) => {
                        tracing::warn!("cluster: keep-alive of lease {lease:x}: {e}");
                        return Some(false);
                    }
                }
            }
            changed = load.changed() => {
                if changed.is_err() {
                    return None;
                }
                let mut now = snapshot(record);
                now.load = load.borrow_and_update().clone();
                record.lock().unwrap_or_else(|p| p.into_inner()).load = now.load.clone();
                if let Err(e) = put(client, &now).await {
                    tracing::warn!("cluster: writing the node's load: {e}");
                }
            }
        }
    }
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

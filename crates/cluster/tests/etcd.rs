//! The cluster layer against a real etcd member (Debian's etcd-server, on
//! loopback, started by the harness).

#![cfg(test)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sandfork_cluster::harness::Etcd;
use std::sync::Arc;

use sandfork_cluster::{
    Claim, Cluster, LocalSandbox, NodeCapacity, NodeLoad, Registration, TeamQuota,
};

const CAPACITY: NodeCapacity = NodeCapacity {
    max_sandboxes: 4,
    vcpus: 2,
    memory_mib: 1024,
};

/// Node `id` registered with address 127.0.0.1:`port`.
async fn register(cluster: &Cluster, id: &str, port: u16, ttl: Duration) -> Registration {
    Registration::start(
        cluster.clone(),
        id,
        &format!("127.0.0.1:{port}"),
        CAPACITY,
        ttl,
    )
    .await
    .unwrap()
}

/// A sandbox a node holds, of team `default`, in its first pause generation.
fn held(id: &str, running: bool) -> LocalSandbox {
    LocalSandbox {
        id: id.into(),
        team: "default".into(),
        running,
        pause_generation: 1,
        kept_local: false,
    }
}

/// Running sandboxes a node holds.
fn running(ids: &[&str]) -> Vec<LocalSandbox> {
    ids.iter().map(|id| held(id, true)).collect()
}

async fn connect(etcd: &Etcd) -> Cluster {
    Cluster::connect(&etcd.endpoints()).await.expect("connect")
}

async fn eventually<F: AsyncFnMut() -> bool>(what: &str, within: Duration, mut check: F) {
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Three members with a leader elected.
async fn three_members() -> Etcd {
    let etcd = Etcd::start_members(3).unwrap();
    etcd.elected(Duration::from_secs(60)).await.unwrap();
    etcd
}

#[tokio::test]
async fn nodes_register_under_a_lease_and_vanish_with_it() {
    let etcd = Etcd::start().unwrap();
    let cluster = connect(&etcd).await;
    let ttl = Duration::from_secs(2);
    let a = register(&cluster, "a", 1, ttl).await;
    let b = register(&cluster, "b", 2, ttl).await;
    assert_ne!(a.incarnation(), b.incarnation());
    let nodes = cluster.nodes().await.unwrap();
    let ids: Vec<&str> = nodes.iter().map(|n| n.node_id.as_str()).collect();
    assert_eq!(ids, ["a", "b"]);
    assert_eq!(nodes[1].api_addr, "127.0.0.1:2");
    assert_eq!(nodes[1].capacity, CAPACITY);

    // Kept alive past several TTLs.
    tokio::time::sleep(ttl * 3).await;
    assert_eq!(cluster.nodes().await.unwrap().len(), 2);

    // Load changes reach the record.
    let load = NodeLoad {
        sandboxes: 3,
        vcpus: 3,
        memory_mib: 600,
        templates: vec!["base".into(), "tmpl1".into()],
    };
    b.set_load(load.clone());
    eventually("b's load written", Duration::from_secs(5), async || {
        cluster
            .nodes()
            .await
            .unwrap()
            .iter()
            .any(|n| n.load == load)
    })
    .await;

    // A node that stops refreshing is gone within its TTL (plus etcd's
    // lease checking); one that leaves is gone at once.
    drop(a);
    b.leave().await;
    drop(b);
    let gone = Instant::now();
    assert!(
        cluster
            .nodes()
            .await
            .unwrap()
            .iter()
            .all(|n| n.node_id != "b")
    );
    eventually("a's record expired", ttl * 3, async || {
        cluster.nodes().await.unwrap().is_empty()
    })
    .await;
    assert!(
        gone.elapsed() >= Duration::from_millis(500),
        "expired at once"
    );
}

#[tokio::test]
async fn a_sandbox_is_claimed_once_and_released_only_by_its_owner() {
    let etcd = Etcd::start().unwrap();
    let cluster = connect(&etcd).await;
    let ttl = Duration::from_secs(5);
    let a = register(&cluster, "a", 1, ttl).await;
    let b = register(&cluster, "b", 2, ttl).await;

    assert!(a.claim("sbx1").await.unwrap());
    // Exactly once: a second claim, by either node, fails.
    assert!(!b.claim("sbx1").await.unwrap());
    // Claiming what it already holds is no conflict for the owner.
    assert!(a.claim("sbx1").await.unwrap());
    let route = cluster.sandbox("sbx1").await.unwrap().unwrap();
    assert_eq!(route.value.node_id, "a");
    assert_eq!(route.value.incarnation, a.incarnation());

    // Only the owner releases it.
    assert!(!b.release("sbx1").await.unwrap());
    assert!(a.release("sbx1").await.unwrap());
    assert!(cluster.sandbox("sbx1").await.unwrap().is_none());
    assert!(!a.release("sbx1").await.unwrap());

    // Concurrent claims of one ID: one winner.
    let (x, y) = tokio::join!(a.claim("race"), b.claim("race"));
    assert!(x.unwrap() ^ y.unwrap());
}

/// The team slot sandbox `id`'s route holds.
async fn running_slot(cluster: &Cluster, id: &str) -> Option<sandfork_cluster::RunningSlot> {
    cluster.sandbox(id).await.unwrap().unwrap().value.running
}

#[tokio::test]
async fn a_team_quota_holds_across_nodes_claiming_at_once() {
    let etcd = Etcd::start().unwrap();
    let cluster = connect(&etcd).await;
    let mut nodes = Vec::new();
    for (i, ttl) in [5, 5, 2].into_iter().enumerate() {
        let node = Registration::start(
            cluster.clone(),
            &format!("n{i}"),
            &format!("127.0.0.1:{}", i + 1),
            CAPACITY,
            Duration::from_secs(ttl),
        )
        .await
        .unwrap();
        nodes.push(Arc::new(node));
    }
    let quota = |n| TeamQuota {
        max_sandboxes: Some(n),
    };
    cluster.set_team_quota("red", &quota(5)).await.unwrap();
    assert_eq!(cluster.team_quota("red").await.unwrap(), quota(5));
    assert_eq!(
        cluster.team_quota("blue").await.unwrap(),
        TeamQuota::default()
    );

    // 30 creates at once through three nodes: exactly 5 run.
    let mut burst = tokio::task::JoinSet::new();
    for i in 0..30 {
        let node = nodes[i % 3].clone();
        burst.spawn(async move {
            let id = format!("s{i:02}");
            let claim = node.claim_in_team(&id, Some("red")).await.unwrap();
            (id, claim)
        });
    }
    let mut claimed = Vec::new();
    while let Some(done) = burst.join_next().await {
        match done.unwrap() {
            (id, Claim::Claimed) => claimed.push(id),
            (id, other) => assert_eq!(other, Claim::TeamFull { limit: 5 }, "{id}"),
        }
    }
    claimed.sort();
    assert_eq!(claimed.len(), 5, "{claimed:?}");
    let slots = cluster.running_slots("red").await.unwrap();
    let mut holders: Vec<String> = slots.values().cloned().collect();
    holders.sort();
    assert_eq!(holders, claimed);
    assert_eq!(cluster.team_full("red").await.unwrap(), Some(5));
    assert_eq!(cluster.team_full("nobody").await.unwrap(), None);
    for (slot, id) in &slots {
        let route = cluster.sandbox(id).await.unwrap().unwrap().value;
        assert_eq!(
            route.running.map(|r| (r.team, r.slot)),
            Some(("red".into(), *slot))
        );
    }
    // Refused ones left no route; other teams and sandboxes of no team
    // are not held back.
    assert_eq!(cluster.sandboxes().await.unwrap().len(), 5);
    assert_eq!(
        nodes[0].claim_in_team("b1", Some("blue")).await.unwrap(),
        Claim::Claimed
    );
    assert!(nodes[0].claim("plain").await.unwrap());

    // A kill gives its slot back; the next create takes it.
    let owner = |id: &str| {
        let n: usize = id[1..].parse().unwrap();
        nodes[n % 3].clone()
    };
    assert!(owner(&claimed[0]).release(&claimed[0]).await.unwrap());
    assert_eq!(cluster.running_slots("red").await.unwrap().len(), 4);
    assert_eq!(cluster.team_full("red").await.unwrap(), None);
    assert_eq!(
        nodes[1].claim_in_team("t1", Some("red")).await.unwrap(),
        Claim::Claimed
    );
    assert_eq!(
        nodes[1].claim_in_team("t2", Some("red")).await.unwrap(),
        Claim::TeamFull { limit: 5 }
    );

    // A pause gives its slot back and keeps its route; its resume needs a
    // free slot again.
    let paused = &claimed[1];
    assert!(owner(paused).stop_running(paused).await.unwrap());
    assert!(running_slot(&cluster, paused).await.is_none());
    assert_eq!(
        nodes[1].claim_in_team("t2", Some("red")).await.unwrap(),
        Claim::Claimed
    );
    assert_eq!(
        owner(paused)
            .start_running(paused, Some("red"))
            .await
            .unwrap(),
        Claim::TeamFull { limit: 5 }
    );
    assert!(nodes[1].release("t2").await.unwrap());
    assert_eq!(
        owner(paused)
            .start_running(paused, Some("red"))
            .await
            .unwrap(),
        Claim::Claimed
    );
    assert!(running_slot(&cluster, paused).await.is_some());

    // A lowered quota: what runs runs on, nothing new starts until the team
    // is below it.
    cluster.set_team_quota("red", &quota(3)).await.unwrap();
    assert!(nodes[1].release("t1").await.unwrap());
    assert_eq!(cluster.running_slots("red").await.unwrap().len(), 4);
    assert_eq!(
        nodes[0].claim_in_team("t3", Some("red")).await.unwrap(),
        Claim::TeamFull { limit: 3 }
    );

    // A node that dies takes its slots with it (its sandboxes are lost):
    // the team may run as many elsewhere.
    cluster.set_team_quota("red", &quota(5)).await.unwrap();
    assert_eq!(
        nodes[2].claim_in_team("d1", Some("red")).await.unwrap(),
        Claim::Claimed
    );
    let running = cluster.running_slots("red").await.unwrap();
    assert_eq!(running.len(), 5);
    let on_n2 = running
        .values()
        .filter(|id| *id == "d1" || owner(id).node_id() == "n2")
        .count();
    assert_eq!(
        nodes[0].claim_in_team("t4", Some("red")).await.unwrap(),
        Claim::TeamFull { limit: 5 }
    );
    drop(nodes.pop());
    eventually("n2's slots freed", Duration::from_secs(8), async || {
        cluster.running_slots("red").await.unwrap().len() == 5 - on_n2
    })
    .await;
    assert_eq!(
        nodes[0].claim_in_team("t4", Some("red")).await.unwrap(),
        Claim::Claimed
    );
}

#[tokio::test]
async fn a_node_without_its_lease_changes_nothing() {
    let etcd = Etcd::start().unwrap();
    let cluster = connect(&etcd).await;
    let a = Registration::start(
        cluster.clone(),
        "a",
        "127.0.0.1:1",
        CAPACITY,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert!(a.claim("kept").await.unwrap());
    let seen = cluster.sandbox("kept").await.unwrap().unwrap();

    // Another process takes the node's key with a new lease (the node
    // re-registered elsewhere, or an operator replaced it): the old
    // incarnation's writes fail the lease compare.
    let b = Registration::start(
        cluster.clone(),
        "a",
        "127.0.0.1:9",
        CAPACITY,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert_ne!(a.incarnation(), b.incarnation());
    assert!(!a.claim("new").await.unwrap());
    assert!(cluster.sandbox("new").await.unwrap().is_none());
    assert!(!a.release("kept").await.unwrap());
    assert_eq!(cluster.sandbox("kept").await.unwrap(), Some(seen));
    drop(b);
}

#[tokio::test]
async fn reconcile_makes_the_map_match_the_node() {
    let etcd = Etcd::start().unwrap();
    let cluster = connect(&etcd).await;
    let ttl = Duration::from_secs(5);
    let a = register(&cluster, "a", 1, ttl).await;
    let b = register(&cluster, "b", 2, ttl).await;
    assert!(a.claim("gone").await.unwrap());
    assert!(a.claim("kept").await.unwrap());
    assert!(b.claim("theirs").await.unwrap());

    // a holds "kept" and "forked" now; "gone" timed out; "theirs" is b's,
    // so a's copy of it is stale (named, not claimed), unless a is taking
    // it in.
    let done = a
        .reconcile(&running(&["kept", "forked", "theirs"]), |_| false)
        .await
        .unwrap();
    assert_eq!((done.claimed, done.released), (1, 1));
    assert_eq!(done.moved, [("theirs".to_owned(), "b".to_owned())]);
    let map = cluster.sandboxes().await.unwrap();
    let owners: Vec<(&str, &str)> = map
        .iter()
        .map(|(id, r)| (id.as_str(), r.value.node_id.as_str()))
        .collect();
    assert_eq!(owners, [("forked", "a"), ("kept", "a"), ("theirs", "b")]);
    // Nothing to do the second time.
    let again = a
        .reconcile(&running(&["kept", "forked", "theirs"]), |id| id == "theirs")
        .await
        .unwrap();
    assert_eq!(again, sandfork_cluster::Reconciled::default());
}

#[tokio::test]
async fn a_route_claimed_after_the_node_listed_its_sandboxes_stays() {
    let etcd = Etcd::start().unwrap();
    let cluster = connect(&etcd).await;
    let a = register(&cluster, "a", 1, Duration::from_secs(5)).await;
    // A create claims its route after the pass's list was taken (which
    // lacks it): the pass leaves the route, the next one lists it.
    assert!(a.claim("new").await.unwrap());
    let done = a.reconcile(&[], |id| id == "new").await.unwrap();
    assert_eq!(done, sandfork_cluster::Reconciled::default());
    assert!(cluster.sandbox("new").await.unwrap().is_some());
}

#[tokio::test]
async fn a_node_back_under_a_new_lease_takes_its_routes_over() {
    let etcd = Etcd::start().unwrap();
    let cluster = connect(&etcd).await;
    let ttl = Duration::from_secs(5);
    let before = register(&cluster, "a", 1, ttl).await;
    for id in ["kept", "gone", "stored"] {
        assert!(before.claim(id).await.unwrap());
    }
    let pause = sandfork_cluster::DurablePause {
        manifest: "sandboxes/stored/1.json".into(),
        generation: 1,
        cpu_template: None,
    };
    assert!(before.set_paused("stored", Some(pause)).await.unwrap());
    drop(before);
    // Back (a restart, or a link that came back after the lease lapsed):
    // it holds "kept" still, "gone" not; "stored" is in the object store.
    let a = register(&cluster, "a", 1, ttl).await;
    let done = a.reconcile(&running(&["kept"]), |_| false).await.unwrap();
    assert_eq!((done.claimed, done.released), (1, 1));
    let kept = cluster.sandbox("kept").await.unwrap().unwrap();
    assert_eq!(kept.value.incarnation, a.incarnation());
    assert!(cluster.sandbox("gone").await.unwrap().is_none());
    let stored = cluster.sandbox("stored").await.unwrap().unwrap();
    assert_ne!(stored.value.incarnation, a.incarnation());
    // This incarnation can change what it took over, and what it did not
    // take over yet (a pause stored meanwhile).
    let again = register(&cluster, "a", 1, ttl).await;
    drop(a);
    let stored_again = sandfork_cluster::DurablePause {
        manifest: "sandboxes/kept/2.json".into(),
        generation: 2,
        cpu_template: None,
    };
    assert!(
        again
            .set_paused("kept", Some(stored_again.clone()))
            .await
            .unwrap()
    );
    let kept = cluster.sandbox("kept").await.unwrap().unwrap();
    assert_eq!(kept.value.incarnation, again.incarnation());
    assert_eq!(kept.value.paused, Some(stored_again));
    let a = again;
    assert!(a.set_paused("kept", None).await.unwrap());
    assert!(a.release("kept").await.unwrap());
    assert_eq!(
        a.reconcile(&[], |_| false).await.unwrap(),
        sandfork_cluster::Reconciled::default()
    );
}

#[tokio::test]
async fn a_sandbox_killed_while_its_node_was_away_is_not_claimed_when_it_is_back() {
    let etcd = Etcd::start().unwrap();
    let cluster = connect(&etcd).await;
    let ttl = Duration::from_secs(1);
    let before = register(&cluster, "a", 1, ttl).await;
    for id in ["killed", "kept", "gone"] {
        assert!(before.claim(id).await.unwrap());
    }
    let seen = |id: &'static str| {
        let cluster = cluster.clone();
        async move { cluster.sandbox(id).await.unwrap().unwrap() }
    };
    let (killed, gone) = (seen("killed").await, seen("gone").await);
    // Not while its node holds it.
    assert!(!cluster.kill_lost("killed", &killed).await.unwrap());
    drop(before);
    eventually("a's lease ends", Duration::from_secs(10), async || {
        !cluster
            .nodes()
            .await
            .unwrap()
            .iter()
            .any(|n| n.node_id == "a")
    })
    .await;
    // Killed through a gateway while a is away.
    assert!(cluster.kill_lost("killed", &killed).await.unwrap());
    assert!(cluster.kill_lost("gone", &gone).await.unwrap());
    assert!(cluster.sandbox("killed").await.unwrap().is_none());
    let marked = cluster.killed_on("a").await.unwrap();
    assert_eq!(
        marked.iter().map(String::as_str).collect::<Vec<_>>(),
        ["gone", "killed"]
    );
    assert!(cluster.killed_on("b").await.unwrap().is_empty());

    // a is back holding "killed" and "kept" ("gone" it lost meanwhile).
    let a = register(&cluster, "a", 1, ttl).await;
    let done = a
        .reconcile(&running(&["killed", "kept"]), |_| false)
        .await
        .unwrap();
    assert_eq!(done.killed, ["killed"]);
    assert_eq!(done.claimed, 1);
    assert!(cluster.sandbox("killed").await.unwrap().is_none());
    assert_eq!(seen("kept").await.value.incarnation, a.incarnation());
    // The tombstone of one a does not hold went; a's copy gone, so does the other.
    let marked = cluster.killed_on("a").await.unwrap();
    assert_eq!(
        marked.iter().map(String::as_str).collect::<Vec<_>>(),
        ["killed"]
    );
    cluster.clear_killed("killed").await.unwrap();
    let done = a.reconcile(&running(&["kept"]), |_| false).await.unwrap();
    assert_eq!(done, sandfork_cluster::Reconciled::default());
    assert!(cluster.killed_on("a").await.unwrap().is_empty());
}

#[tokio::test]
async fn reconcile_gives_team_slots_to_what_runs_and_takes_them_from_what_paused() {
    let etcd = Etcd::start().unwrap();
    let cluster = connect(&etcd).await;
    let a = Registration::start(
        cluster.clone(),
        "a",
        "127.0.0.1:1",
        CAPACITY,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let quota = TeamQuota {
        max_sandboxes: Some(2),
    };
    cluster.set_team_quota("t", &quota).await.unwrap();
    let local = |states: &[(&str, bool)]| {
        states
            .iter()
            .map(|(id, running)| LocalSandbox {
                team: "t".into(),
                ..held(id, *running)
            })
            .collect::<Vec<_>>()
    };
    // Claimed by the reconciler: the running ones take slots, the paused
    // one none; a third running one is over the quota and still mapped.
    let first = local(&[("r1", true), ("p1", false), ("r2", true), ("r3", true)]);
    let done = a.reconcile(&first, |_| false).await.unwrap();
    assert_eq!((done.claimed, done.released), (4, 0));
    let held = cluster.running_slots("t").await.unwrap();
    assert_eq!(held.len(), 2, "{held:?}");
    assert!(running_slot(&cluster, "p1").await.is_none());
    assert!(cluster.sandbox("r3").await.unwrap().is_some());
    // r1 paused by its timeout: its slot goes back and r3 takes it (the
    // routes are gone through in ID order).
    let second = local(&[("r1", false), ("p1", false), ("r2", true), ("r3", true)]);
    a.reconcile(&second, |_| false).await.unwrap();
    assert!(running_slot(&cluster, "r1").await.is_none());
    assert!(running_slot(&cluster, "r3").await.is_some());
    // A sandbox some request is changing is left alone.
    let third = local(&[("r1", true), ("p1", false), ("r2", false), ("r3", true)]);
    a.reconcile(&third, |id| id == "r2").await.unwrap();
    assert!(running_slot(&cluster, "r2").await.is_some());
    assert!(running_slot(&cluster, "r1").await.is_none());
}

/// A pause made without the API (at a timeout, for memory pressure) or
/// whose store failed is named until its route records it stored at its
/// generation; a sandbox that runs again loses its stored pause (the
/// store's copy is out of date, and no other node may take it in). Those a
/// change is under way on are left to it.
#[tokio::test]
async fn reconcile_names_pauses_not_stored_and_clears_the_stored_pause_of_one_running() {
    let etcd = Etcd::start().unwrap();
    let cluster = connect(&etcd).await;
    let a = register(&cluster, "a", 1, Duration::from_secs(5)).await;
    let pause = |id: &str, generation| sandfork_cluster::DurablePause {
        manifest: format!("sandboxes/{id}/{generation}.json"),
        generation,
        cpu_template: None,
    };
    for id in [
        "timed-out",
        "stored",
        "paused-again",
        "woken",
        "busy",
        "kept-local",
    ] {
        assert!(a.claim(id).await.unwrap());
    }
    for id in ["stored", "paused-again", "woken"] {
        assert!(a.set_paused(id, Some(pause(id, 1))).await.unwrap());
    }
    let held = |id: &str, running, pause_generation| LocalSandbox {
        pause_generation,
        ..held(id, running)
    };
    // Paused on the node only, as asked: never stored.
    let kept = LocalSandbox {
        kept_local: true,
        ..held("kept-local", false, 1)
    };
    let local = [
        held("timed-out", false, 1),
        held("stored", false, 1),
        held("paused-again", false, 2),
        held("woken", true, 1),
        held("busy", false, 1),
        kept,
    ];
    let done = a.reconcile(&local, |id| id == "busy").await.unwrap();
    assert_eq!(done.unstored, ["paused-again", "timed-out"]);
    let paused = async |id| cluster.sandbox(id).await.unwrap().unwrap().value.paused;
    assert_eq!(paused("woken").await, None);
    assert_eq!(paused("stored").await, Some(pause("stored", 1)));
    // Once stored, nothing more to do.
    assert!(
        a.set_paused("timed-out", Some(pause("timed-out", 1)))
            .await
            .unwrap()
    );
    assert!(
        a.set_paused("paused-again", Some(pause("paused-again", 2)))
            .await
            .unwrap()
    );
    let done = a.reconcile(&local, |id| id == "busy").await.unwrap();
    assert_eq!(done, sandfork_cluster::Reconciled::default());
}

#[tokio::test]
async fn teams_and_keys_reach_every_follower_and_names_stay_unique() {
    use std::sync::Mutex;

    use sandfork_cluster::{TenantChange, TenantRecords, Tenants};

    let etcd = Etcd::start().unwrap();
    let cluster = connect(&etcd).await;
    let quota = TeamQuota {
        max_sandboxes: Some(3),
    };
    assert!(
        cluster
            .create_team("team_1", "red", b"{\"v\":1}", &quota)
            .await
            .unwrap()
    );
    // A node's copy: what it was handed, applied as a node does.
    let copy = Arc::new(Mutex::new(TenantRecords::default()));
    let follower = {
        let copy = copy.clone();
        Tenants::start(cluster.clone(), move |change| {
            let mut copy = copy.lock().unwrap();
            match change {
                TenantChange::Loaded(all) => *copy = all,
                TenantChange::Team { id, record } => {
                    copy.teams.insert(id, record);
                }
                TenantChange::Key { hash, record } => {
                    copy.keys.insert(hash, record);
                }
                TenantChange::KeyRevoked { hash } => {
                    copy.keys.remove(&hash);
                }
            }
        })
        .await
        .unwrap()
    };
    // Loaded before start returns.
    assert_eq!(copy.lock().unwrap().teams.len(), 1);
    assert_eq!(cluster.team_quota("team_1").await.unwrap(), quota);
    // Another node making a team of the same name is refused.
    assert!(
        !cluster
            .create_team("team_2", "red", b"{}", &quota)
            .await
            .unwrap()
    );
    let lowered = TeamQuota {
        max_sandboxes: Some(1),
    };
    cluster
        .put_team("team_1", b"{\"v\":2}", &lowered)
        .await
        .unwrap();
    assert_eq!(cluster.team_quota("team_1").await.unwrap(), lowered);
    cluster
        .put_key("ab12", b"{\"team\":\"team_1\"}")
        .await
        .unwrap();
    cluster.put_key("cd34", b"{}").await.unwrap();
    eventually(
        "the follower sees the keys",
        Duration::from_secs(5),
        async || copy.lock().unwrap().keys.len() == 2,
    )
    .await;
    assert!(cluster.revoke_key("cd34").await.unwrap());
    assert!(!cluster.revoke_key("cd34").await.unwrap());
    eventually(
        "the follower sees the revocation",
        Duration::from_secs(5),
        async || {
            let copy = copy.lock().unwrap();
            copy.keys.keys().collect::<Vec<_>>() == ["ab12"]
                && copy.teams.get("team_1").map(Vec::as_slice) == Some(b"{\"v\":2}".as_slice())
        },
    )
    .await;
    drop(follower);
}

#[tokio::test]
async fn a_durable_pause_moves_only_once_its_node_is_gone() {
    let etcd = Etcd::start().unwrap();
    let cluster = connect(&etcd).await;
    let ttl = Duration::from_secs(2);
    let a = register(&cluster, "a", 1, ttl).await;
    let b = register(&cluster, "b", 2, ttl).await;
    let c = register(&cluster, "c", 3, ttl).await;
    assert!(a.claim("p").await.unwrap());
    let pause = sandfork_cluster::DurablePause {
        manifest: "sandboxes/p/1.json".into(),
        generation: 1,
        cpu_template: None,
    };
    // Only the owner records its pause.
    assert!(!b.set_paused("p", Some(pause.clone())).await.unwrap());
    assert!(a.set_paused("p", Some(pause.clone())).await.unwrap());
    let seen = cluster.sandbox("p").await.unwrap().unwrap();
    assert_eq!(seen.value.paused.as_ref(), Some(&pause));

    // While its node lives, nobody takes it.
    assert!(!b.take_over("p", &seen).await.unwrap());

    let a_incarnation = a.incarnation();
    drop(a);
    eventually("a's lease ends", Duration::from_secs(10), async || {
        !cluster
            .nodes()
            .await
            .unwrap()
            .iter()
            .any(|n| n.node_id == "a")
    })
    .await;
    // Two nodes race for it: one wins, with the pause kept.
    let (x, y) = tokio::join!(b.take_over("p", &seen), c.take_over("p", &seen));
    assert!(x.unwrap() ^ y.unwrap());
    let moved = cluster.sandbox("p").await.unwrap().unwrap();
    assert_ne!(moved.value.node_id, "a");
    assert_ne!(moved.value.incarnation, a_incarnation);
    assert_eq!(moved.value.paused, Some(pause));
    // A stale view changes nothing.
    assert!(!b.take_over("p", &seen).await.unwrap());
    // a comes back (its link healed) with its copy: told it moved, and the
    // route stays with the new owner.
    let a = register(&cluster, "a", 1, ttl).await;
    let done = a.reconcile(&[held("p", false)], |_| false).await.unwrap();
    assert_eq!(done.moved, [("p".to_owned(), moved.value.node_id.clone())]);
    assert_eq!((done.claimed, done.released), (0, 0));
    assert_eq!(cluster.sandbox("p").await.unwrap(), Some(moved.clone()));
    assert_eq!(a.start_running("p", None).await.unwrap(), Claim::Refused);
    // The new owner resumes it: no longer durably paused.
    let owner = if moved.value.node_id == "b" { &b } else { &c };
    assert!(owner.set_paused("p", None).await.unwrap());
    assert!(
        cluster
            .sandbox("p")
            .await
            .unwrap()
            .unwrap()
            .value
            .paused
            .is_none()
    );
}

/// Claims every ID of `ids` for `node`, retrying a claim that failed (a
/// leader election or a lost quorum answers with errors) until `within`:
/// what each claim finally answered.
async fn claim_all(
    node: &Registration,
    ids: &[String],
    within: Duration,
    progress: &AtomicUsize,
) -> Vec<bool> {
    let deadline = Instant::now() + within;
    let mut answers = Vec::with_capacity(ids.len());
    for id in ids {
        let answer = loop {
            match node.claim(id).await {
                Ok(answer) => break answer,
                Err(e) => {
                    assert!(Instant::now() < deadline, "claiming {id}: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        answers.push(answer);
        progress.fetch_add(1, Ordering::Relaxed);
    }
    answers
}

#[tokio::test]
async fn claims_racing_through_a_leader_loss_land_exactly_once() {
    let mut etcd = three_members().await;
    let cluster = connect(&etcd).await;
    let ttl = Duration::from_secs(5);
    let a = register(&cluster, "a", 1, ttl).await;
    let b = register(&cluster, "b", 2, ttl).await;
    let ids: Vec<String> = (0..240).map(|i| format!("sbx{i:03}")).collect();

    // Both nodes claim every ID, in opposite orders so they meet in the
    // middle, and the leader is killed a quarter into the burst.
    let reversed: Vec<String> = ids.iter().rev().cloned().collect();
    let old_leader = etcd.leader().await.unwrap();
    let within = Duration::from_secs(60);
    let progress = AtomicUsize::new(0);
    let (by_a, by_b, ()) = tokio::join!(
        claim_all(&a, &ids, within, &progress),
        claim_all(&b, &reversed, within, &progress),
        async {
            while progress.load(Ordering::Relaxed) < ids.len() / 2 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            etcd.kill(old_leader);
        }
    );
    let new_leader = etcd.leader().await.unwrap();
    assert_ne!(new_leader, old_leader);

    // Exactly one node was told yes for each ID, and the map says that node.
    let map = cluster.sandboxes().await.unwrap();
    assert_eq!(map.len(), ids.len());
    for (i, (id, route)) in map.iter().enumerate() {
        assert_eq!(id, &ids[i]);
        let (yes_a, yes_b) = (by_a[i], by_b[ids.len() - 1 - i]);
        assert!(yes_a ^ yes_b, "{id}: a said {yes_a}, b said {yes_b}");
        assert_eq!(route.value.node_id, if yes_a { "a" } else { "b" }, "{id}");
    }
    // Both leases outlived the election.
    assert_eq!(cluster.nodes().await.unwrap().len(), 2);
    assert_eq!(
        map.iter()
            .filter(|(_, r)| r.value.incarnation == a.incarnation())
            .count(),
        by_a.iter().filter(|y| **y).count()
    );
}

#[tokio::test]
async fn without_a_quorum_requests_fail_in_bounded_time_and_work_once_it_returns() {
    let mut etcd = three_members().await;
    let cluster = connect(&etcd).await;
    let a = Registration::start(
        cluster.clone(),
        "a",
        "127.0.0.1:1",
        CAPACITY,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert!(a.claim("before").await.unwrap());

    etcd.kill(1);
    etcd.kill(2);
    let asked = Instant::now();
    assert!(a.claim("during").await.is_err());
    assert!(
        asked.elapsed() < Duration::from_secs(12),
        "a claim without quorum took {:?}",
        asked.elapsed()
    );

    etcd.restart(1).unwrap();
    etcd.restart(2).unwrap();
    let by_a = claim_all(
        &a,
        &["during".to_owned()],
        Duration::from_secs(60),
        &AtomicUsize::new(0),
    )
    .await;
    assert_eq!(by_a, [true]);
    // What was acknowledged before the loss is still there.
    assert_eq!(
        cluster
            .sandbox("before")
            .await
            .unwrap()
            .unwrap()
            .value
            .node_id,
        "a"
    );
    eventually("a registered", Duration::from_secs(20), async || {
        cluster
            .nodes()
            .await
            .is_ok_and(|n| n.iter().any(|n| n.node_id == "a"))
    })
    .await;
}

#[tokio::test]
async fn a_node_cut_off_past_its_lease_registers_again_when_it_is_back() {
    let mut etcd = three_members().await;
    let endpoints = etcd.endpoints();
    // The node reaches etcd through member 0 only: killing it cuts the node
    // off while the other two keep the quorum (and expire its lease).
    let cut = Cluster::connect(&endpoints[..1]).await.unwrap();
    let others = Cluster::connect(&endpoints[1..]).await.unwrap();
    let a = Registration::start(cut, "a", "127.0.0.1:1", CAPACITY, Duration::from_secs(2))
        .await
        .unwrap();
    let before = a.incarnation();
    etcd.kill(0);
    eventually("a's lease expires", Duration::from_secs(30), async || {
        others
            .nodes()
            .await
            .is_ok_and(|n| !n.iter().any(|n| n.node_id == "a"))
    })
    .await;
    etcd.restart(0).unwrap();
    eventually("a registers again", Duration::from_secs(30), async || {
        others.nodes().await.is_ok_and(|n| {
            n.iter()
                .any(|n| n.node_id == "a" && n.incarnation != before)
        })
    })
    .await;
    assert_ne!(a.incarnation(), before);
}

#[tokio::test]
async fn the_view_follows_nodes_and_routes_as_they_change() {
    let etcd = Etcd::start().unwrap();
    let cluster = connect(&etcd).await;
    let ttl = Duration::from_secs(5);
    let a = register(&cluster, "a", 1, ttl).await;
    assert!(a.claim("early").await.unwrap());

    // What was there before it started, loaded.
    let view = sandfork_cluster::View::start(cluster.clone());
    eventually("the view in step", Duration::from_secs(5), async || {
        view.in_step()
    })
    .await;
    assert_eq!(view.nodes().unwrap().len(), 1);
    assert_eq!(view.sandbox("early").unwrap().value.node_id, "a");
    assert!(view.sandbox("unknown").is_none());

    // Changes after, followed: a second node, a claim, a load, a release.
    let b = register(&cluster, "b", 2, ttl).await;
    assert!(b.claim("later").await.unwrap());
    let load = NodeLoad {
        sandboxes: 1,
        vcpus: 1,
        memory_mib: 64,
        ..NodeLoad::default()
    };
    b.set_load(load.clone());
    assert!(a.release("early").await.unwrap());
    eventually("the view follows", Duration::from_secs(5), async || {
        let nodes = view.nodes().unwrap_or_default();
        nodes.len() == 2
            && nodes[1].load == load
            && view.sandbox("early").is_none()
            && view
                .sandbox("later")
                .is_some_and(|r| r.value.node_id == "b")
    })
    .await;
    // Its revisions are etcd's: a transaction checked against one applies.
    let seen = view.sandbox("later").unwrap();
    assert_eq!(cluster.sandbox("later").await.unwrap(), Some(seen));

    // A node leaving is gone from it too.
    b.leave().await;
    eventually("b gone from the view", Duration::from_secs(5), async || {
        view.nodes().is_some_and(|n| n.len() == 1)
    })
    .await;
}

/// A map larger than one gRPC answer may hold (4 MiB) is read whole, in
/// pages at one revision: by the listing, the gateway's view and a node's
/// reconcile pass (each failed on it at 50,000 routes in the cluster-scale
/// bench, the view never in step).
#[tokio::test]
async fn a_map_past_one_answer_s_size_is_read_in_pages() {
    use etcd_client::{Txn, TxnOp};
    use sandfork_cluster::{SandboxRoute, keyspace};
    // IDs of 64 characters: ~170 bytes a route, 6.5 MiB in all.
    const ROUTES: usize = 40_000;
    let etcd = Etcd::start().unwrap();
    let cluster = connect(&etcd).await;
    let a = register(&cluster, "a", 1, Duration::from_secs(60)).await;
    let route = serde_json::to_vec(&SandboxRoute {
        node_id: "a".into(),
        incarnation: a.incarnation(),
        created_at_ms: 1,
        paused: None,
        running: None,
    })
    .unwrap();
    let ids: Vec<String> = (0..ROUTES).map(|n| format!("{n:0>64}")).collect();
    let mut client = etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .unwrap();
    // etcd's most operations in one transaction.
    for chunk in ids.chunks(128) {
        let puts: Vec<TxnOp> = chunk
            .iter()
            .map(|id| TxnOp::put(keyspace::sandbox_key(id), route.clone(), None))
            .collect();
        client.txn(Txn::new().and_then(puts)).await.unwrap();
    }

    let listed = cluster.sandboxes().await.unwrap();
    assert_eq!(listed.len(), ROUTES);
    assert!(
        listed.iter().map(|(id, _)| id).eq(ids.iter()),
        "in key order, once each"
    );

    let view = sandfork_cluster::View::start(cluster.clone());
    eventually(
        "the view in step with every route",
        Duration::from_secs(30),
        async || view.in_step() && view.sizes().1 == ROUTES,
    )
    .await;
    assert_eq!(view.sandbox(&ids[ROUTES - 1]).unwrap().value.node_id, "a");

    let local: Vec<LocalSandbox> = ids.iter().map(|id| held(id, true)).collect();
    let done = a.reconcile(&local, |_| false).await.unwrap();
    assert_eq!((done.claimed, done.released), (0, 0), "{done:?}");
    assert!(done.moved.is_empty() && done.killed.is_empty(), "{done:?}");
}

/// One conversion of an image per cluster: of nodes claiming it at once,
/// one holds it; the others are told which node converts it, as the
/// gateway's view is; only its holder gives it back, and it goes with its
/// holder's lease when that node dies, so another node may claim it.
#[tokio::test]
async fn an_image_conversion_is_claimed_by_one_node_and_goes_with_its_lease() {
    use sandfork_cluster::ImageConversion;
    const IMAGE: &str = "127.0.0.1:5000/task/a:v1";
    let etcd = Etcd::start().unwrap();
    let cluster = connect(&etcd).await;
    let ttl = Duration::from_secs(2);
    let (a, b, c) = (
        register(&cluster, "a", 1, ttl).await,
        register(&cluster, "b", 2, ttl).await,
        register(&cluster, "c", 3, ttl).await,
    );
    let view = sandfork_cluster::View::start(cluster.clone());
    eventually("the view in step", Duration::from_secs(5), async || {
        view.in_step()
    })
    .await;
    assert_eq!(view.image_claim(IMAGE), None);

    let (ca, cb, cc) = tokio::join!(
        a.claim_image(IMAGE),
        b.claim_image(IMAGE),
        c.claim_image(IMAGE)
    );
    let answers = [ca.unwrap(), cb.unwrap(), cc.unwrap()];
    let holders: Vec<usize> = (0..3)
        .filter(|&i| answers[i] == ImageConversion::Claimed)
        .collect();
    assert_eq!(holders.len(), 1, "{answers:?}");
    let holder = ["a", "b", "c"][holders[0]];
    for answer in &answers {
        if let ImageConversion::Converting(claim) = answer {
            assert_eq!(
                (claim.node_id.as_str(), claim.image.as_str()),
                (holder, IMAGE)
            );
        }
    }
    let claim = cluster.image_claim(IMAGE).await.unwrap().unwrap();
    assert_eq!(claim.node_id, holder);
    eventually(
        "the view sees the claim",
        Duration::from_secs(5),
        async || view.image_claim(IMAGE).is_some_and(|c| c.node_id == holder),
    )
    .await;
    // Another image is another key.
    assert_eq!(
        a.claim_image("127.0.0.1:5000/task/a:v2").await.unwrap(),
        ImageConversion::Claimed
    );

    // Asked again, its holder holds it still; the others do not release it.
    let nodes = [&a, &b, &c];
    let holding = nodes[holders[0]];
    assert_eq!(
        holding.claim_image(IMAGE).await.unwrap(),
        ImageConversion::Claimed
    );
    for (i, other) in nodes.iter().enumerate() {
        if i != holders[0] {
            assert!(!other.release_image(IMAGE).await.unwrap());
        }
    }
    assert!(cluster.image_claim(IMAGE).await.unwrap().is_some());
    // Given back: the next claim is another node's.
    assert!(holding.release_image(IMAGE).await.unwrap());
    assert_eq!(cluster.image_claim(IMAGE).await.unwrap(), None);
    eventually(
        "the view sees it gone",
        Duration::from_secs(5),
        async || view.image_claim(IMAGE).is_none(),
    )
    .await;
    let (first, second) = if holders[0] == 0 { (&b, &c) } else { (&a, &b) };
    assert_eq!(
        first.claim_image(IMAGE).await.unwrap(),
        ImageConversion::Claimed
    );
    let first_id = first.node_id();
    assert!(matches!(
        second.claim_image(IMAGE).await.unwrap(),
        ImageConversion::Converting(c) if c.node_id == first_id
    ));

    // Its holder dies (its lease runs out): the claim goes with it.
    if first_id == "a" {
        drop(a);
    } else {
        drop(b);
    }
    eventually("the dead node's claim gone", ttl * 4, async || {
        cluster.image_claim(IMAGE).await.unwrap().is_none()
    })
    .await;
    assert_eq!(
        c.claim_image(IMAGE).await.unwrap(),
        ImageConversion::Claimed
    );
}

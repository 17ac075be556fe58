//! The object store's collector against a real etcd member and a real S3
//! server (SeaweedFS), both started by the harness: what a pass removes and
//! keeps is read back from the store's own listing.

#![cfg(test)]

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use sandfork_cluster::files::{self, StoredFile};
use sandfork_cluster::harness::{Etcd, ForeignPass, SeaweedFs};
use sandfork_cluster::store_gc::{self, Collector};
use sandfork_cluster::{Cluster, DurablePause, NodeCapacity, ObjectStore, Registration};
use serde_json::json;
use sha2::{Digest, Sha256};

const GRACE: Duration = Duration::from_secs(2);

/// A file of `chunks` 4 MiB chunks, each filled with its own byte from `fill`.
fn file(dir: &Path, name: &str, fill: u8, chunks: u8) -> std::path::PathBuf {
    let path = dir.join(name);
    let mut bytes = Vec::new();
    for i in 0..chunks {
        bytes.extend(std::iter::repeat_n(
            fill.wrapping_add(i),
            files::CHUNK as usize,
        ));
    }
    std::fs::write(&path, bytes).unwrap();
    path
}

fn digests(stored: &StoredFile) -> Vec<String> {
    stored.chunks.iter().flatten().cloned().collect()
}

/// The keys under `prefix`, as the store lists them.
async fn keys(store: &ObjectStore, prefix: &str) -> BTreeSet<String> {
    let listed = store.list(prefix).await.unwrap();
    listed.into_iter().map(|o| o.key).collect()
}

fn chunk_keys(d: &[String]) -> BTreeSet<String> {
    d.iter().map(|d| files::chunk_key(d)).collect()
}

/// A manifest as the node writes them: a guest's files (memory and disk).
fn manifest(memory: &[&StoredFile], disk: &[&StoredFile]) -> serde_json::Value {
    json!({ "version": 1, "record": { "id": "x" }, "memory": memory, "disk": disk })
}

async fn setup() -> (Etcd, SeaweedFs, Cluster, ObjectStore) {
    let etcd = Etcd::start().unwrap();
    let weed = SeaweedFs::start().unwrap();
    let cluster = Cluster::connect(&etcd.endpoints()).await.unwrap();
    let store = ObjectStore::new(&weed.url, None, "us-east-1".into()).unwrap();
    store.ensure_bucket().await.unwrap();
    (etcd, weed, cluster, store)
}

/// A template stored, a snapshot of it and two pauses over it: once the
/// snapshot is deleted, a pass removes its own chunks but not the base
/// template's, which a pause still names; the pause manifests no route
/// names (a sandbox resumed, one killed) go with their own chunks, the one
/// its route names stays; what is younger than the grace stays until a later
/// pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_removes_what_no_manifest_names_and_keeps_what_one_does() {
    let (_etcd, _weed, cluster, store) = setup().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let node = Registration::start(
        cluster.clone(),
        "n1",
        "127.0.0.1:1",
        NodeCapacity::default(),
        Duration::from_secs(10),
    )
    .await
    .unwrap();

    // A file of `chunks` chunks from `byte` on, stored.
    let upload = async |name: &str, byte: u8, chunks: u8| {
        files::upload(&store, &file(dir, name, byte, chunks))
            .await
            .unwrap()
            .0
    };
    let base = upload("base.mem", 0x10, 2).await;
    let snap = upload("snap.mem", 0x20, 2).await;
    let paused = upload("a.mem", 0x30, 1).await;
    let resumed = upload("b.mem", 0x40, 1).await;
    let killed = upload("c.mem", 0x50, 1).await;
    // A chunk the snapshot shares with the pause that stays.
    let shared = upload("shared.layer", 0x60, 1).await;
    let put = async |key: &str, value: serde_json::Value| {
        files::put_json(&store, key, &value).await.unwrap();
    };
    put("templates/base.json", manifest(&[&base], &[])).await;
    put("templates/snap.json", manifest(&[&base, &snap], &[&shared])).await;
    let pause_a = store_gc::pause_manifest_key("ia", 1);
    put(&pause_a, manifest(&[&base, &paused], &[&shared])).await;
    let pause_b = store_gc::pause_manifest_key("ib", 1);
    put(&pause_b, manifest(&[&base, &resumed], &[])).await;
    let pause_c = store_gc::pause_manifest_key("ic", 2);
    put(&pause_c, manifest(&[&base, &killed], &[])).await;
    // ia is paused and its route names its pause; ib runs again (its route
    // names none); ic was killed (no route).
    assert!(node.claim("ia").await.unwrap());
    let stored = DurablePause {
        manifest: pause_a.clone(),
        generation: 1,
        cpu_template: None,
    };
    assert!(node.set_paused("ia", Some(stored)).await.unwrap());
    assert!(node.claim("ib").await.unwrap());

    tokio::time::sleep(GRACE + Duration::from_secs(2)).await;
    // The snapshot is deleted; a chunk and a pause manifest come now, named
    // by nothing (an upload under way).
    store.delete("templates/snap.json").await.unwrap();
    let young = vec![0x77u8; 4096];
    let young_digest = hex(&Sha256::digest(&young));
    store
        .put(&files::chunk_key(&young_digest), young.into())
        .await
        .unwrap();
    let pause_d = store_gc::pause_manifest_key("id", 1);
    put(&pause_d, manifest(&[&base], &[])).await;

    let collector = Collector::new(store.clone(), cluster.clone(), "n1").with_grace(GRACE);
    let swept = collector.pass().await.unwrap().expect("a pass");

    let mut kept: Vec<String> = [&base, &paused, &shared]
        .into_iter()
        .flat_map(digests)
        .collect();
    kept.push(young_digest.clone());
    let gone: Vec<String> = [&snap, &resumed, &killed]
        .into_iter()
        .flat_map(digests)
        .collect();
    let now = keys(&store, store_gc::CHUNKS).await;
    assert_eq!(now, chunk_keys(&kept));
    assert!(chunk_keys(&gone).is_disjoint(&now));
    assert_eq!(
        keys(&store, "").await.difference(&now).collect::<Vec<_>>(),
        [&pause_a, &pause_d, &"templates/base.json".to_owned()]
    );
    assert_eq!(swept.manifests, [pause_b.clone(), pause_c.clone()]);
    assert_eq!(swept.chunks, gone.len());
    assert_eq!(swept.bytes, gone.len() as u64 * files::CHUNK);
    assert_eq!((swept.young, swept.kept), (1, kept.len()));

    // Once old, the unnamed chunk and pause go too.
    tokio::time::sleep(GRACE + Duration::from_secs(1)).await;
    let swept = collector.pass().await.unwrap().expect("a pass");
    assert_eq!(swept.manifests, [pause_d]);
    assert_eq!(swept.chunks, 1);
    kept.pop();
    assert_eq!(keys(&store, store_gc::CHUNKS).await, chunk_keys(&kept));
}

/// A pass held by another node (its key under its lease) keeps the others
/// off: they remove nothing. Two collectors at once remove each chunk once
/// between them; an upload that met a pass learns it from the epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_one_node_runs_a_pass_at_a_time() {
    let (_etcd, _weed, cluster, store) = setup().await;
    let tmp = tempfile::tempdir().unwrap();
    let (orphan, _) = files::upload(&store, &file(tmp.path(), "o.mem", 0x90, 3))
        .await
        .unwrap();
    tokio::time::sleep(GRACE + Duration::from_secs(2)).await;

    // Another node's pass under way.
    let elsewhere = ForeignPass::start(&cluster, "elsewhere").await.unwrap();
    let before = cluster.store_gc_epoch().await.unwrap();
    assert!(before.under_way);
    let a = Collector::new(store.clone(), cluster.clone(), "a").with_grace(GRACE);
    let b = Collector::new(store.clone(), cluster.clone(), "b").with_grace(GRACE);
    assert_eq!(a.pass().await.unwrap(), None);
    assert_eq!(b.pass().await.unwrap(), None);
    assert_eq!(
        keys(&store, store_gc::CHUNKS).await,
        chunk_keys(&digests(&orphan))
    );
    elsewhere.end().await.unwrap();

    let idle = cluster.store_gc_epoch().await.unwrap();
    assert!(!idle.under_way);
    let (one, two) = tokio::join!(a.pass(), b.pass());
    let ran: Vec<_> = [one.unwrap(), two.unwrap()].into_iter().flatten().collect();
    assert!(!ran.is_empty());
    assert_eq!(ran.iter().map(|s| s.chunks).sum::<usize>(), 3);
    assert!(keys(&store, store_gc::CHUNKS).await.is_empty());
    // An upload whose window held those passes must check its chunks.
    let after = cluster.store_gc_epoch().await.unwrap();
    assert!(!after.under_way);
    assert!(idle.met_a_pass(&after));
    assert!(!after.met_a_pass(&cluster.store_gc_epoch().await.unwrap()));
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

//! Files in a real S3 server (SeaweedFS on loopback, started by the harness).

#![cfg(test)]

use std::os::unix::fs::FileExt;

use sandfork_cluster::files::{self, CHUNK};
use sandfork_cluster::harness::SeaweedFs;
use sandfork_cluster::objects::ObjectStore;

#[tokio::test]
async fn files_round_trip_and_shared_chunks_are_stored_once() {
    let weed = SeaweedFs::start().unwrap();
    let store = ObjectStore::new(&weed.url, None, "us-east-1".into()).unwrap();
    store.ensure_bucket().await.unwrap();
    store.ensure_bucket().await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    // Sparse: data in chunks 0 and 2, a hole in 1, a short tail chunk.
    let path = dir.path().join("mem");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(3 * CHUNK + 100).unwrap();
    let data: Vec<u8> = (0..CHUNK as usize).map(|i| (i % 251) as u8).collect();
    f.write_all_at(&data, 0).unwrap();
    f.write_all_at(b"tail", 2 * CHUNK + 9).unwrap();
    f.write_all_at(b"end", 3 * CHUNK + 90).unwrap();
    drop(f);

    let (stored, sent) = files::upload(&store, &path).await.unwrap();
    assert_eq!(stored.len, 3 * CHUNK + 100);
    assert_eq!(stored.chunks.len(), 4);
    assert!(stored.chunks[1].is_none());
    assert_eq!(sent.chunks, 3);

    // The same content again sends nothing.
    let copy = dir.path().join("copy");
    std::fs::copy(&path, &copy).unwrap();
    let (again, sent) = files::upload(&store, &copy).await.unwrap();
    assert_eq!(again, stored);
    assert_eq!(sent.chunks, 0);

    let back = dir.path().join("back");
    files::download(&store, &stored, &back).await.unwrap();
    assert_eq!(std::fs::read(&back).unwrap(), std::fs::read(&path).unwrap());

    // JSON objects, and what is missing.
    files::put_json(&store, "manifests/x.json", &stored)
        .await
        .unwrap();
    let read: Option<files::StoredFile> =
        files::get_json(&store, "manifests/x.json").await.unwrap();
    assert_eq!(read, Some(stored.clone()));
    let none: Option<files::StoredFile> = files::get_json(&store, "manifests/none.json")
        .await
        .unwrap();
    assert!(none.is_none());
    // A deleted object is gone; deleting what is not there is no error.
    store.delete("manifests/x.json").await.unwrap();
    assert!(!store.exists("manifests/x.json").await.unwrap());
    store.delete("manifests/x.json").await.unwrap();
    let mut broken = stored.clone();
    broken.chunks[0] = Some("00".repeat(32));
    assert!(matches!(
        files::download(&store, &broken, &dir.path().join("broken")).await,
        Err(files::FileError::Missing(_))
    ));
    assert!(!dir.path().join("broken").exists());
}

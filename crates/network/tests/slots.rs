//! Slots for real, in namespaces the tests make (see `common`). Skipped without root.

mod common;

use std::time::Duration;

use common::*;
use sandfork_network::{EgressPolicy, Pool};

#[test]
fn guest_reaches_internet_but_not_forbidden_targets() {
    if !privileged() {
        return;
    }
    let w = World::new();
    let (pool, _) = Pool::start(w.pool_config(1, 8), &[]).unwrap();
    let slot = pool.take(&EgressPolicy::default()).unwrap();
    let g = Guest::attach(&w, "g1", &slot);
    let a = g.ask(WEB_A, "hi").expect("internet reachable");
    assert!(a.starts_with("203.0.113.10 hi 198.51.100.1:"), "{a}");
    assert_eq!(g.ask(PRIVATE, "x"), None, "private range reached");
    assert_eq!(g.ask(METADATA, "x"), None, "metadata reached");
    drop(g);
    pool.release(slot);
    pool.shutdown(true).unwrap();
    std::thread::sleep(Duration::from_millis(10));
}

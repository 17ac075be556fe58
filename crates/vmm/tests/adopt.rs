//! A VMM started in a kept directory outlives the handle that released it
//! and is adopted again by another; dropping an owned handle stops it and
//! removes its directory. Runs on any host: no guest is started.

#![cfg(test)]

use std::path::PathBuf;

use vmm_api::InstanceState;
use vmm_driver::process::{ProcessError, ProcessIdentity, VmmProcess};

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sandfork-vmm"))
}

#[tokio::test]
async fn a_released_vmm_keeps_running_and_is_adopted() {
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join("vm");
    let vm = VmmProcess::spawn_in(&binary(), dir.clone()).await.unwrap();
    let pid = vm.pid();
    vm.release();

    let identity = ProcessIdentity::read(&dir).expect("an identity file");
    assert_eq!(identity.pid, pid);
    assert!(identity.is_alive(), "released, not killed");

    let mut adopted = VmmProcess::adopt(&dir).await.unwrap();
    assert_eq!(adopted.pid(), pid);
    assert!(adopted.is_running());
    let info = adopted.api().get_instance_info().await.unwrap();
    assert_eq!(info.state, InstanceState::NotStarted);

    drop(adopted);
    // An adopted VMM is not our child: its parent (this test) reaps it.
    for _ in 0..100 {
        if !identity.is_alive() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(!identity.is_alive(), "dropping the adopted handle kills it");
    assert!(!dir.exists(), "and removes its directory");
}

#[tokio::test]
async fn adoption_refuses_what_is_not_that_vmm() {
    let scratch = tempfile::tempdir().unwrap();
    let empty = scratch.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let err = VmmProcess::adopt(&empty).await.expect_err("refused");
    assert!(matches!(err, ProcessError::NotAdoptable { .. }), "{err}");

    // A VMM that is gone, its directory left behind.
    let dir = scratch.path().join("vm");
    let vm = VmmProcess::spawn_in(&binary(), dir.clone()).await.unwrap();
    let identity = ProcessIdentity::read(&dir).unwrap();
    vm.release();
    identity.kill();
    for _ in 0..100 {
        if !identity.is_alive() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let err = VmmProcess::adopt(&dir).await.expect_err("refused");
    assert!(err.to_string().contains("gone"), "{err}");
}

#[tokio::test]
async fn a_kept_directory_must_be_new() {
    let scratch = tempfile::tempdir().unwrap();
    let err = VmmProcess::spawn_in(&binary(), scratch.path().to_owned())
        .await
        .expect_err("an existing directory is refused");
    assert!(
        err.to_string().contains("creating the VM directory"),
        "{err}"
    );
    assert!(scratch.path().exists(), "and left alone");
}

//! Debian-package templates over the real base tree. Slow (debootstrap when
//! the base is not cached, apt from the network mirror): run with
//! `cargo test -p sandfork-template-build --test debian -- --ignored`.

#![cfg(test)]

mod common;

use std::fs;

use common::{assert_cached, base_builder, build_logged, debugfs};
use template_build::{BuildError, Source};

/// Scratch on another filesystem than the cache when the machine has one
/// (tmpfs), as in the lab, so the image is copied into the cache.
fn scratch() -> tempfile::TempDir {
    match tempfile::tempdir_in("/dev/shm") {
        Ok(d) => d,
        Err(_) => tempfile::tempdir().unwrap(),
    }
}

#[test]
#[ignore = "slow: needs the base tree and the Debian mirror"]
fn debian_packages_are_installed_over_the_base() {
    let tmp = tempfile::tempdir().unwrap();
    let scratch = scratch();
    let b = base_builder(tmp.path(), scratch.path());
    let (t, lines) = build_logged(&b, &Source::DebianPackages(vec!["jq".into()]));
    assert!(!t.cached);
    assert!(lines.iter().any(|l| l.contains("apt-get install")));
    assert!(t.rootfs.starts_with(tmp.path().join("cache/templates")));
    let stat = debugfs(&t.rootfs, "stat /usr/bin/jq");
    assert!(
        stat.contains("Type: regular"),
        "jq missing from the image: {stat}"
    );
    // the base's accounts are there, apt's lists and the build's files are not
    assert!(debugfs(&t.rootfs, "cat /etc/passwd").contains("user:x:1000:1000"));
    for gone in [
        "/usr/sbin/policy-rc.d",
        "/etc/apt/apt.conf.d/00sandfork-build",
    ] {
        assert!(
            !debugfs(&t.rootfs, &format!("stat {gone}")).contains("Type:"),
            "{gone} left in the image"
        );
    }
    // the base tarball kept device nodes and file capabilities
    assert!(debugfs(&t.rootfs, "stat /dev/null").contains("Type: character special"));
    assert!(
        debugfs(&t.rootfs, "ea_list /usr/bin/ping").contains("security.capability"),
        "ping lost its capability"
    );
    // nothing is left in the scratch directory
    let left: Vec<_> = fs::read_dir(scratch.path()).unwrap().flatten().collect();
    assert!(left.is_empty(), "{left:?}");
    assert_cached(
        &b,
        &Source::DebianPackages(vec!["jq".into(), "jq".into()]),
        &t,
    );
}

#[test]
#[ignore = "slow: needs the base tree and the Debian mirror"]
fn a_missing_package_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let scratch = scratch();
    let err = base_builder(tmp.path(), scratch.path())
        .build(
            &Source::DebianPackages(vec!["sandfork-no-such-package".into()]),
            &mut |_| {},
        )
        .unwrap_err();
    match err {
        BuildError::MissingPackage(name) => assert_eq!(name, "sandfork-no-such-package"),
        other => panic!("expected MissingPackage, got {other}"),
    }
}

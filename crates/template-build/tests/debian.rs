//! Debian-package templates over the real base tree. Slow (debootstrap when
//! the base is not cached, apt from the network mirror): run with
//! `cargo test -p sandfork-template-build --test debian -- --ignored`.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use template_build::{BuildError, Builder, Source};

fn builder(dir: &std::path::Path) -> Builder {
    let agent = dir.join("agent");
    fs::write(&agent, b"#!/bin/sh\nexit 0\n").unwrap();
    fs::set_permissions(&agent, fs::Permissions::from_mode(0o755)).unwrap();
    // the shared cache: the base tree is reused from images/rootfs/build.sh
    Builder::new(agent)
}

#[test]
#[ignore = "slow: needs the base tree and the Debian mirror"]
fn debian_packages_are_installed_over_the_base() {
    let tmp = tempfile::tempdir().unwrap();
    let b = builder(tmp.path());
    let mut lines = Vec::new();
    let t = b
        .build(&Source::DebianPackages(vec!["jq".into()]), &mut |l| {
            eprintln!("{l}");
            lines.push(l.to_owned())
        })
        .unwrap();
    assert!(lines.iter().any(|l| l.contains("apt-get install")));
    let out = Command::new("debugfs")
        .args(["-R", "stat /usr/bin/jq"])
        .arg(&t.rootfs)
        .output()
        .unwrap();
    let stat = String::from_utf8_lossy(&out.stdout);
    assert!(
        stat.contains("Type: regular"),
        "jq missing from the image: {stat}"
    );
    // the base's accounts are there, apt's lists and the build's policy are not
    let out = Command::new("debugfs")
        .args(["-R", "cat /etc/passwd"])
        .arg(&t.rootfs)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("user:x:1000:1000"));
    let out = Command::new("debugfs")
        .args(["-R", "stat /usr/sbin/policy-rc.d"])
        .arg(&t.rootfs)
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&out.stdout).contains("Type:"));
    let again = b
        .build(
            &Source::DebianPackages(vec!["jq".into(), "jq".into()]),
            &mut |_| {},
        )
        .unwrap();
    assert!(again.cached && again.key == t.key);
}

#[test]
#[ignore = "slow: needs the base tree and the Debian mirror"]
fn a_missing_package_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let err = builder(tmp.path())
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

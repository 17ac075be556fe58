//! Python venv templates over the real base tree: pip in a chroot, from the
//! package index. Slow (the base tree when not cached, pip from the network):
//! run with `cargo test -p sandfork-template-build --test venv -- --ignored`.

#![cfg(test)]

mod common;

use std::fs;

use common::{assert_cached, base_builder, build_logged, debugfs};
use template_build::{BuildError, Builder, ImageFile, PythonVenv, Source};

fn venv(requirements: &str, file: &str) -> PythonVenv {
    PythonVenv {
        dir: "/opt/t/venv".into(),
        requirements: requirements.into(),
        files: vec![ImageFile {
            path: "/opt/t/app.py".into(),
            contents: file.as_bytes().to_vec(),
            mode: 0o755,
        }],
    }
}

#[test]
#[ignore = "slow: needs the base tree and the Python package index"]
fn a_venv_is_made_by_pip_and_cached_apart_from_the_files() {
    let tmp = tempfile::tempdir().unwrap();
    let b = base_builder(tmp.path(), &tmp.path().join("scratch"));
    let source = Source::PythonVenv(venv("six==1.17.0\n", "print('one')\n"));
    let (t, lines) = build_logged(&b, &source);
    assert!(!t.cached);
    assert!(
        lines
            .iter()
            .any(|l| l.contains("pip install into /opt/t/venv"))
    );
    let site = debugfs(&t.rootfs, "ls -l /opt/t/venv/lib/python3.11/site-packages");
    assert!(site.contains("six.py"), "six missing: {site}");
    assert!(debugfs(&t.rootfs, "stat /opt/t/venv/bin/python").contains("Type: symlink"));
    let app = debugfs(&t.rootfs, "stat /opt/t/app.py");
    assert!(app.contains("Mode:  0755"), "{app}");
    assert_eq!(debugfs(&t.rootfs, "cat /opt/t/app.py"), "print('one')\n");
    // the build's requirements file is not left behind
    assert!(!debugfs(&t.rootfs, "stat /tmp/.sandfork-requirements.txt").contains("Type:"));

    // other files: a new image, the venv from the cache (no pip)
    let two = Source::PythonVenv(venv("six==1.17.0\n", "print('two')\n"));
    let (t2, again) = build_logged(&b, &two);
    assert!(!t2.cached && t2.key != t.key);
    assert!(again.iter().any(|l| l.contains("cached")), "{again:?}");
    assert!(
        !again.iter().any(|l| l.contains("pip install")),
        "{again:?}"
    );
    assert_eq!(debugfs(&t2.rootfs, "cat /opt/t/app.py"), "print('two')\n");
    assert!(debugfs(&t2.rootfs, "ls /opt/t/venv/lib/python3.11/site-packages").contains("six.py"));

    // the same inputs: the image itself from the cache
    assert_cached(&b, &two, &t2);
}

#[test]
#[ignore = "slow: needs the base tree and the Python package index"]
fn a_failing_pip_install_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let b = base_builder(tmp.path(), &tmp.path().join("scratch"));
    let e = b
        .build(
            &Source::PythonVenv(venv("no-such-package-sandfork-test==0.0.1\n", "")),
            &mut |_| {},
        )
        .unwrap_err();
    match e {
        BuildError::Command { what, tail, .. } => {
            assert_eq!(what, "pip install");
            assert!(tail.contains("no-such-package-sandfork-test"), "{tail}");
        }
        other => panic!("{other}"),
    }
    // nothing cached
    assert!(
        fs::read_dir(tmp.path().join("cache/venvs"))
            .map(|d| d.count())
            .unwrap_or(0)
            == 0
    );
}

#[test]
fn paths_outside_the_image_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let agent = tmp.path().join("agent");
    fs::write(&agent, b"#!/bin/sh\n").unwrap();
    let b = Builder::new(agent).cache_dir(tmp.path());
    let mut v = venv("six==1.17.0\n", "");
    v.files[0].path = "/opt/../etc/passwd".into();
    let e = b.build(&Source::PythonVenv(v), &mut |_| {}).unwrap_err();
    assert!(matches!(e, BuildError::UnsafePath(_)), "{e}");
}

//! Debian-package templates: the cached base tarball unpacked into the
//! scratch directory, with more packages installed by apt in a chroot (in a
//! private mount namespace, so the /proc and /dev mounts it needs vanish with
//! it). apt resolves and reaches the mirror as the host does: the host's
//! `/etc/resolv.conf` and its apt proxy settings are used for the build.

use std::fs;
use std::path::Path;
use std::process::Command;

use crate::error::{BuildError, Result};
use crate::run;

/// Checks the names and returns them sorted and deduplicated (the cache key
/// must not depend on their order).
pub fn normalize(packages: &[String]) -> Result<Vec<String>> {
    let mut out = Vec::with_capacity(packages.len());
    for p in packages {
        let p = p.trim();
        let (name, version) = match p.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (p, None),
        };
        let name_ok = name.len() >= 2
            && name
                .bytes()
                .next()
                .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.".contains(&b));
        let version_ok = version.is_none_or(|v| {
            !v.is_empty()
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"+-.~:".contains(&b))
        });
        if !name_ok || !version_ok {
            return Err(BuildError::InvalidPackageName(p.to_owned()));
        }
        out.push(p.to_owned());
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// apt settings for the build only, removed after it.
const BUILD_APT_CONF: &str = "etc/apt/apt.conf.d/00sandfork-build";

/// The host's apt proxy settings (`Acquire::http::Proxy` and the like), as
/// apt.conf lines; empty without any. Proxy environment variables reach apt
/// in the chroot by themselves.
fn host_apt_proxy() -> String {
    let Ok(out) = Command::new("apt-config").arg("dump").output() else {
        return String::new();
    };
    proxy_lines(&String::from_utf8_lossy(&out.stdout))
}

/// The proxy lines of an `apt-config dump`.
fn proxy_lines(dump: &str) -> String {
    dump.lines()
        .filter(|l| {
            let name = l.split_whitespace().next().unwrap_or("");
            let lower = name.to_ascii_lowercase();
            [
                "acquire::http::proxy",
                "acquire::https::proxy",
                "acquire::ftp::proxy",
            ]
            .iter()
            .any(|p| lower == *p || lower.starts_with(&format!("{p}::")))
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

/// The package apt could not find, from its error lines.
fn missing_package(lines: &[String]) -> Option<String> {
    for l in lines {
        if let Some(rest) = l.strip_prefix("E: Unable to locate package ") {
            return Some(rest.trim().to_owned());
        }
        if let Some((name, _)) = l
            .strip_prefix("E: Package '")
            .and_then(|rest| rest.split_once('\''))
        {
            return Some(name.to_owned());
        }
        if let Some(rest) = l.strip_prefix("E: Version '") {
            // E: Version 'V' for 'NAME' was not found
            if let Some(name) = rest.split('\'').nth(2) {
                return Some(name.to_owned());
            }
        }
    }
    None
}

/// Unpacks the base tarball `base` into `tree`.
pub(crate) fn unpack_base(base: &Path, tree: &Path, log: &mut dyn FnMut(&str)) -> Result<()> {
    log(&format!("unpacking the base tree {}", base.display()));
    let start = std::time::Instant::now();
    fs::create_dir_all(tree)
        .map_err(|e| BuildError::io(format!("creating {}", tree.display()), e))?;
    // the same options images/rootfs/build.sh packs it with: owners, modes,
    // xattrs (file capabilities), hard links and device nodes as they were
    run::run_ok(
        "unpacking the base tree",
        Command::new("tar")
            .arg("--extract")
            .arg("--file")
            .arg(base)
            .args(["--numeric-owner", "--xattrs", "--xattrs-include=*", "-C"])
            .arg(tree),
        log,
    )?;
    log(&format!(
        "base tree unpacked in {:.1} s",
        start.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// Unpacks the base tarball `base` into `tree` and installs `packages` into it.
pub(crate) fn install(
    base: &Path,
    tree: &Path,
    packages: &[String],
    log: &mut dyn FnMut(&str),
) -> Result<()> {
    unpack_base(base, tree, log)?;
    let put = |rel: &str, text: &[u8], mode: u32| -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let p = tree.join(rel);
        let _ = fs::remove_file(&p);
        fs::write(&p, text).map_err(|e| BuildError::io(format!("writing {}", p.display()), e))?;
        fs::set_permissions(&p, fs::Permissions::from_mode(mode))
            .map_err(|e| BuildError::io(format!("chmod {}", p.display()), e))
    };
    // no daemons started by package scripts inside the build
    put("usr/sbin/policy-rc.d", b"#!/bin/sh\nexit 101\n", 0o755)?;
    // the build resolves names like the host (finish.sh puts the sandbox's back)
    let resolv = fs::read("/etc/resolv.conf").unwrap_or_default();
    put("etc/resolv.conf", &resolv, 0o644)?;
    // and goes through the host's apt proxy, if it has one
    let proxy = host_apt_proxy();
    if !proxy.is_empty() {
        log("using the host's apt proxy settings");
    }
    put(BUILD_APT_CONF, proxy.as_bytes(), 0o644)?;

    log(&format!("apt-get install {}", packages.join(" ")));
    let script = r#"set -e
t=$1; shift
mount -t proc proc "$t/proc"
mount --rbind /dev "$t/dev"
export DEBIAN_FRONTEND=noninteractive LC_ALL=C
chroot "$t" apt-get update -q
chroot "$t" apt-get install -y -q --no-install-recommends -- "$@"
chroot "$t" apt-get clean
"#;
    let mut cmd = run::in_private_mounts(script);
    cmd.arg(tree).args(packages);
    let out = run::run("apt-get install", &mut cmd, log)?;
    if !out.success {
        let lines: Vec<String> = out.tail.iter().cloned().collect();
        if let Some(name) = missing_package(&lines) {
            return Err(BuildError::MissingPackage(name));
        }
        if out.mentions_no_space() {
            return Err(BuildError::NoSpace("installing packages".into()));
        }
        return Err(BuildError::Command {
            what: "apt-get install".into(),
            status: out.status.clone(),
            tail: out.tail_text(),
        });
    }
    fs::remove_file(tree.join("usr/sbin/policy-rc.d"))
        .map_err(|e| BuildError::io("removing policy-rc.d", e))?;
    fs::remove_file(tree.join(BUILD_APT_CONF))
        .map_err(|e| BuildError::io("removing the build's apt settings", e))?;
    let lists = tree.join("var/lib/apt/lists");
    if let Ok(rd) = fs::read_dir(&lists) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_file()) {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_names_are_checked_sorted_and_deduplicated() {
        let v = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            normalize(&v(&["jq", "curl", "jq", "g++", "libc6=2.36-9"])).unwrap(),
            v(&["curl", "g++", "jq", "libc6=2.36-9"])
        );
        for bad in ["", "a", "-rf", "Jq", "jq;rm", "jq=", "x y", "../x"] {
            assert!(
                matches!(
                    normalize(&v(&[bad])),
                    Err(BuildError::InvalidPackageName(_))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn proxy_settings_are_taken_from_the_apt_config() {
        let dump = "APT \"\";\nAPT::Architecture \"amd64\";\n\
            Acquire::http::Proxy \"http://proxy.test:3128\";\n\
            Acquire::http::Proxy::mirror.test \"DIRECT\";\n\
            Acquire::https::Proxy \"http://proxy.test:3128\";\n\
            Acquire::Check-Valid-Until \"false\";\n";
        assert_eq!(
            proxy_lines(dump),
            "Acquire::http::Proxy \"http://proxy.test:3128\";\n\
             Acquire::http::Proxy::mirror.test \"DIRECT\";\n\
             Acquire::https::Proxy \"http://proxy.test:3128\";\n"
        );
        assert_eq!(proxy_lines("APT::Architecture \"amd64\";\n"), "");
    }

    #[test]
    fn missing_packages_are_found_in_apt_errors() {
        let l = |s: &str| vec![String::from("Reading package lists..."), s.to_owned()];
        assert_eq!(
            missing_package(&l("E: Unable to locate package nosuchpkg")).as_deref(),
            Some("nosuchpkg")
        );
        assert_eq!(
            missing_package(&l("E: Package 'virtual' has no installation candidate")).as_deref(),
            Some("virtual")
        );
        assert_eq!(
            missing_package(&l("E: Version '9.9' for 'jq' was not found")).as_deref(),
            Some("jq")
        );
        assert_eq!(
            missing_package(&l(
                "E: Sub-process /usr/bin/dpkg returned an error code (1)"
            )),
            None
        );
    }
}

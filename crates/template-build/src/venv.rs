//! Python templates: a virtual environment made with pip (wheels only) in a
//! chroot of the base tree, plus files, over the base image.
//!
//! The venv is cached on its own, as a tarball keyed by the base tree, its
//! directory and the requirements (`<cache>/venvs/<key>/venv.tar`): pip runs
//! once per machine for a given requirements file, and a new agent or new
//! files only remake the image from the base tree, that tarball and the
//! files. pip reaches the package index as the host does (the host's
//! `/etc/resolv.conf`, its proxy variables).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use crate::error::{BuildError, Result};
use crate::{debian, run, scripts};

/// A file put into the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageFile {
    /// Absolute path in the image.
    pub path: String,
    pub contents: Vec<u8>,
    pub mode: u32,
}

/// A Python virtual environment and files over the base image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PythonVenv {
    /// Where the venv goes in the image (absolute).
    pub dir: String,
    /// pip's requirements file (pinned versions, so the key says what is in it).
    pub requirements: String,
    /// Written after the venv (parents made as needed, owned by root).
    pub files: Vec<ImageFile>,
}

/// Makes the venv (runs in `sh`; `$1` the tree, `$2` the venv directory).
const MAKE_VENV: &str = r#"set -e
t=$1 dir=$2
mount -t proc proc "$t/proc"
mount --rbind /dev "$t/dev"
export LC_ALL=C.UTF-8 HOME=/root PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# the host's trust store: it may hold the CA of a TLS-inspecting proxy
if [ -s "$t/tmp/.sandfork-host-ca.pem" ]; then
  export PIP_CERT=/tmp/.sandfork-host-ca.pem SSL_CERT_FILE=/tmp/.sandfork-host-ca.pem REQUESTS_CA_BUNDLE=/tmp/.sandfork-host-ca.pem
  unset SSL_CERT_DIR
fi
chroot "$t" python3 -m venv "$dir"
chroot "$t" "$dir/bin/pip" install --only-binary :all: --progress-bar off -r /tmp/.sandfork-requirements.txt
"#;
const REQUIREMENTS_IN_TREE: &str = "tmp/.sandfork-requirements.txt";
const HOST_CA_IN_TREE: &str = "tmp/.sandfork-host-ca.pem";
/// The host's pip settings (its index), used for the build only.
const PIP_CONF: &str = "etc/pip.conf";

/// The host's CA bundle pip should trust: `$PIP_CERT` (or the variables
/// requests and OpenSSL read), else the system's.
fn host_ca() -> Option<Vec<u8>> {
    ["PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"]
        .iter()
        .filter_map(|v| std::env::var_os(v).map(std::path::PathBuf::from))
        .chain([std::path::PathBuf::from(
            "/etc/ssl/certs/ca-certificates.crt",
        )])
        .find_map(|p| fs::read(p).ok())
}

/// An absolute path without `..`, `.`, empty parts or odd bytes.
fn check_abs(path: &str, what: &str) -> Result<()> {
    let ok = path.strip_prefix('/').is_some_and(|rest| {
        rest.split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
    }) && !path.contains(['\n', '\0', '\\']);
    if ok {
        Ok(())
    } else {
        Err(BuildError::UnsafePath(format!("{what} {path}")))
    }
}

impl PythonVenv {
    pub(crate) fn check(&self) -> Result<()> {
        check_abs(&self.dir, "venv directory")?;
        for f in &self.files {
            check_abs(&f.path, "file")?;
        }
        Ok(())
    }

    /// The venv's cache key, from the base tree's key.
    pub(crate) fn venv_key(&self, base_key: &str) -> String {
        key(&format!(
            "venv 1\nbase {base_key}\ndir {}\nscript {}\n{}",
            self.dir,
            scripts::sha256_hex(MAKE_VENV.as_bytes()),
            self.requirements
        ))
    }

    /// What the files add to the template's key.
    pub(crate) fn files_digest(&self) -> String {
        let mut text = String::new();
        for f in &self.files {
            text.push_str(&format!(
                "{} {:o} {}\n",
                f.path,
                f.mode,
                scripts::sha256_hex(&f.contents)
            ));
        }
        text
    }

    /// Fills `tree`: the base tarball, the venv (from the cache, or made and
    /// cached), the files.
    pub(crate) fn make(
        &self,
        venvs: &Path,
        venv_key: &str,
        base: &Path,
        tree: &Path,
        log: &mut dyn FnMut(&str),
    ) -> Result<()> {
        debian::unpack_base(base, tree, log)?;
        let entry = venvs.join(venv_key);
        let cached = entry.join("venv.tar");
        let rel = self.dir.trim_start_matches('/');
        if cached.is_file() {
            log(&format!("venv {venv_key} cached: {}", cached.display()));
            run::run_ok(
                "unpacking the cached venv",
                Command::new("tar")
                    .args(["--extract", "--numeric-owner", "--file"])
                    .arg(&cached)
                    .arg("-C")
                    .arg(tree),
                log,
            )?;
        } else {
            self.pip_install(tree, log)?;
            log(&format!("caching the venv as {}", cached.display()));
            fs::create_dir_all(&entry)
                .map_err(|e| BuildError::io(format!("creating {}", entry.display()), e))?;
            let tmp = entry.join(format!(".venv.tar.{}", std::process::id()));
            run::run_ok(
                "packing the venv",
                Command::new("tar")
                    .args(["--create", "--numeric-owner", "--file"])
                    .arg(&tmp)
                    .arg("-C")
                    .arg(tree)
                    .arg(rel),
                log,
            )?;
            fs::File::open(&tmp)
                .and_then(|f| f.sync_all())
                .and_then(|()| fs::rename(&tmp, &cached))
                .map_err(|e| BuildError::io(format!("storing {}", cached.display()), e))?;
        }
        for f in &self.files {
            let p = tree.join(f.path.trim_start_matches('/'));
            if let Some(parent) = p.parent() {
                fs::create_dir_all(parent)
                    .map_err(|e| BuildError::io(format!("creating {}", parent.display()), e))?;
            }
            fs::write(&p, &f.contents)
                .map_err(|e| BuildError::io(format!("writing {}", p.display()), e))?;
            fs::set_permissions(&p, fs::Permissions::from_mode(f.mode))
                .map_err(|e| BuildError::io(format!("chmod {}", p.display()), e))?;
        }
        Ok(())
    }

    fn pip_install(&self, tree: &Path, log: &mut dyn FnMut(&str)) -> Result<()> {
        let start = std::time::Instant::now();
        let put = |rel: &str, text: &[u8]| -> Result<()> {
            let p = tree.join(rel);
            let _ = fs::remove_file(&p);
            fs::write(&p, text).map_err(|e| BuildError::io(format!("writing {}", p.display()), e))
        };
        // pip resolves names like the host (finish.sh puts the sandbox's back)
        put(
            "etc/resolv.conf",
            &fs::read("/etc/resolv.conf").unwrap_or_default(),
        )?;
        put(REQUIREMENTS_IN_TREE, self.requirements.as_bytes())?;
        if let Some(ca) = host_ca() {
            put(HOST_CA_IN_TREE, &ca)?;
        }
        let had_pip_conf = tree.join(PIP_CONF).exists();
        if !had_pip_conf && let Ok(conf) = fs::read("/etc/pip.conf") {
            put(PIP_CONF, &conf)?;
        }
        log(&format!("pip install into {} (wheels only)", self.dir));
        let mut cmd = run::in_private_mounts(MAKE_VENV);
        cmd.arg(tree).arg(&self.dir);
        let out = run::run("pip install", &mut cmd, log)?;
        let _ = fs::remove_file(tree.join(REQUIREMENTS_IN_TREE));
        let _ = fs::remove_file(tree.join(HOST_CA_IN_TREE));
        if !had_pip_conf {
            let _ = fs::remove_file(tree.join(PIP_CONF));
        }
        if !out.success {
            if out.mentions_no_space() {
                return Err(BuildError::NoSpace("installing Python packages".into()));
            }
            return Err(BuildError::Command {
                what: "pip install".into(),
                status: out.status.clone(),
                tail: out.tail_text(),
            });
        }
        log(&format!(
            "venv made in {:.1} s",
            start.elapsed().as_secs_f64()
        ));
        Ok(())
    }
}

fn key(text: &str) -> String {
    scripts::sha256_hex(text.as_bytes())[..16].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn venv(dir: &str, files: &[(&str, &str)]) -> PythonVenv {
        PythonVenv {
            dir: dir.into(),
            requirements: "six==1.16.0\n".into(),
            files: files
                .iter()
                .map(|(p, c)| ImageFile {
                    path: (*p).into(),
                    contents: c.as_bytes().to_vec(),
                    mode: 0o644,
                })
                .collect(),
        }
    }

    #[test]
    fn paths_must_stay_in_the_image() {
        venv("/opt/v", &[("/opt/a.py", "")]).check().unwrap();
        for bad in [
            "",
            "/",
            "opt/v",
            "/opt/../etc",
            "/opt/./v",
            "/opt//v",
            "/a\nb",
        ] {
            assert!(venv(bad, &[]).check().is_err(), "{bad:?}");
            assert!(venv("/opt/v", &[(bad, "")]).check().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn keys_follow_what_goes_in() {
        let a = venv("/opt/v", &[("/opt/a.py", "1")]);
        let b = venv("/opt/v", &[("/opt/a.py", "2")]);
        // the venv is the same whatever the files...
        assert_eq!(a.venv_key("base1"), b.venv_key("base1"));
        assert_ne!(a.files_digest(), b.files_digest());
        // ...and changes with the base, the directory and the requirements
        assert_ne!(a.venv_key("base1"), a.venv_key("base2"));
        assert_ne!(a.venv_key("base1"), venv("/opt/w", &[]).venv_key("base1"));
        let mut c = a.clone();
        c.requirements.push_str("idna==3.7\n");
        assert_ne!(a.venv_key("base1"), c.venv_key("base1"));
    }
}

//! The image scripts of `images/rootfs`, built into the library so a server
//! binary needs no checkout: written out once per content into the cache and
//! run from there. Keys they compute from their own text stay the same, so
//! the base tree cached by `images/rootfs/build.sh` is shared.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{BuildError, Result};

pub(crate) const BUILD_SH: &str = include_str!("../../../images/rootfs/build.sh");
pub(crate) const BASE_SH: &str = include_str!("../../../images/rootfs/base.sh");
pub(crate) const FINISH_SH: &str = include_str!("../../../images/rootfs/finish.sh");
pub(crate) const PACKAGES_TXT: &str = include_str!("../../../images/rootfs/packages.txt");

const FILES: [(&str, &str, u32); 4] = [
    ("build.sh", BUILD_SH, 0o755),
    ("base.sh", BASE_SH, 0o755),
    ("finish.sh", FINISH_SH, 0o755),
    ("packages.txt", PACKAGES_TXT, 0o644),
];

pub(crate) fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The directory holding the scripts under `cache`, written if missing.
pub(crate) fn materialize(cache: &Path) -> Result<PathBuf> {
    let mut h = Sha256::new();
    for (name, text, _) in FILES {
        h.update(name.as_bytes());
        h.update(text.as_bytes());
    }
    let dir = cache.join(format!("scripts-{}", &hex(&h.finalize())[..16]));
    if dir.join("packages.txt").exists() {
        return Ok(dir);
    }
    let tmp = cache.join(format!(".scripts-tmp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)
        .map_err(|e| BuildError::io(format!("creating {}", tmp.display()), e))?;
    for (name, text, mode) in FILES {
        let p = tmp.join(name);
        fs::write(&p, text).map_err(|e| BuildError::io(format!("writing {}", p.display()), e))?;
        fs::set_permissions(&p, fs::Permissions::from_mode(mode))
            .map_err(|e| BuildError::io(format!("chmod {}", p.display()), e))?;
    }
    match fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // another process won the race with the same content
        Err(_) if dir.join("packages.txt").exists() => {
            let _ = fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(BuildError::io(format!("renaming to {}", dir.display()), e)),
    }
}

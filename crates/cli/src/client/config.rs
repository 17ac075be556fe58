//! Where the CLI finds its node and key: `SANDFORK_API_URL`/`SANDFORK_API_KEY`,
//! else the config file `sandfork auth login` writes, else
//! `E2B_API_URL`/`E2B_API_KEY` (so a shell set up for the SDKs works too),
//! else the URL `sandfork serve` listens on by default.

use std::fmt;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// `sandfork serve`'s default address.
pub const DEFAULT_URL: &str = "http://127.0.0.1:3000";

/// The config file: `{"url": "...", "key": "..."}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "neither XDG_CONFIG_HOME nor HOME is set: set SANDFORK_CONFIG to the config file's path"
    )]
    NoHome,
    #[error("reading {0}: {1}")]
    Read(PathBuf, std::io::Error),
    #[error("{0} is not valid config JSON ({1}); fix it or run `sandfork auth login` again")]
    Parse(PathBuf, serde_json::Error),
    #[error(
        "{path} holds an API key and is readable by others (mode {mode:03o}); run `chmod 600 {path}`"
    )]
    Open { path: PathBuf, mode: u32 },
    #[error("writing {0}: {1}")]
    Write(PathBuf, std::io::Error),
}

/// The config file's path: `$SANDFORK_CONFIG`, else
/// `$XDG_CONFIG_HOME/sandfork/config.json`, else `~/.config/sandfork/config.json`.
pub fn path() -> Result<PathBuf, ConfigError> {
    if let Some(p) = env("SANDFORK_CONFIG") {
        return Ok(PathBuf::from(p));
    }
    let base = match (env("XDG_CONFIG_HOME"), env("HOME")) {
        (Some(x), _) => PathBuf::from(x),
        (None, Some(home)) => Path::new(&home).join(".config"),
        (None, None) => return Err(ConfigError::NoHome),
    };
    Ok(base.join("sandfork").join("config.json"))
}

/// A non-empty environment variable.
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// The file's contents, None when there is no file. A file others can read
/// is refused: it holds the key.
pub fn load(path: &Path) -> Result<Option<FileConfig>, ConfigError> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ConfigError::Read(path.to_owned(), e)),
    };
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(ConfigError::Open {
            path: path.to_owned(),
            mode,
        });
    }
    let text = std::fs::read(path).map_err(|e| ConfigError::Read(path.to_owned(), e))?;
    serde_json::from_slice(&text)
        .map(Some)
        .map_err(|e| ConfigError::Parse(path.to_owned(), e))
}

/// Writes the file with mode 0600 (its directory 0700) through a temporary
/// sibling, so a reader never sees half a file or a moment of wider mode.
pub fn save(path: &Path, config: &FileConfig) -> Result<(), ConfigError> {
    let err = |e| ConfigError::Write(path.to_owned(), e);
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(err)?;
    }
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let mut json = serde_json::to_vec_pretty(config).map_err(|e| err(e.into()))?;
    json.push(b'\n');
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(&json)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(err(e));
    }
    Ok(())
}

/// Where a setting came from (for `auth status` and error messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Env(&'static str),
    File(PathBuf),
    Default,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Env(name) => write!(f, "${name}"),
            Source::File(p) => write!(f, "{}", p.display()),
            Source::Default => write!(f, "default"),
        }
    }
}

/// The settings in effect.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub url: String,
    pub url_from: Source,
    pub key: Option<(String, Source)>,
    pub file: PathBuf,
}

pub fn resolve() -> Result<Resolved, ConfigError> {
    let file_path = path()?;
    let file = load(&file_path)?.unwrap_or_default();
    let from_file = |v: &Option<String>| {
        v.clone()
            .filter(|v| !v.trim().is_empty())
            .map(|v| (v, Source::File(file_path.clone())))
    };
    let pick = |ours: &'static str, theirs: &'static str, in_file: &Option<String>| {
        env(ours)
            .map(|v| (v, Source::Env(ours)))
            .or_else(|| from_file(in_file))
            .or_else(|| env(theirs).map(|v| (v, Source::Env(theirs))))
    };
    let (url, url_from) = pick("SANDFORK_API_URL", "E2B_API_URL", &file.url)
        .unwrap_or_else(|| (DEFAULT_URL.to_owned(), Source::Default));
    let key = pick("SANDFORK_API_KEY", "E2B_API_KEY", &file.key);
    Ok(Resolved {
        url,
        url_from,
        key,
        file: file_path,
    })
}

/// The key with most of it hidden: `e2b_1234…cdef`.
pub fn mask(key: &str) -> String {
    let chars: Vec<char> = key.chars().collect();
    if chars.len() <= 12 {
        return "*".repeat(chars.len());
    }
    let head: String = chars[..8].iter().collect();
    let tail: String = chars[chars.len() - 4..].iter().collect();
    format!("{head}…{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_file_is_private_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/config.json");
        let config = FileConfig {
            url: Some("http://127.0.0.1:3000".into()),
            key: Some("e2b_abc".into()),
        };
        save(&path, &config).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dir_mode = std::fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dir_mode, 0o700);
        assert_eq!(load(&path).unwrap(), Some(config.clone()));
        // Saving again replaces it (no leftover temporary file).
        save(&path, &FileConfig::default()).unwrap();
        assert_eq!(load(&path).unwrap(), Some(FileConfig::default()));
        assert_eq!(
            std::fs::read_dir(path.parent().unwrap()).unwrap().count(),
            1
        );
    }

    #[test]
    fn readable_or_broken_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        assert_eq!(load(&path).unwrap(), None);
        std::fs::write(&path, "{\"key\": \"k\"}").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = load(&path).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&path, "not json").unwrap();
        assert!(matches!(load(&path), Err(ConfigError::Parse(..))));
    }

    #[test]
    fn masks_keys() {
        assert_eq!(mask("e2b_0123456789abcdef"), "e2b_0123…cdef");
        assert_eq!(mask("short"), "*****");
    }
}

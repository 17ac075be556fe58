//! The control plane's API key: `X-API-KEY: e2b_<40 hex>`. Only its SHA-256
//! is stored; the key itself is shown once, in a 0600 file in the data dir.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::ids;
use crate::store::{Store, StoreError};

/// The request header carrying the key.
pub const HEADER: &str = "x-api-key";
const META_KEY: &str = "api_key_sha256";
/// The key file's name in the data dir.
pub const KEY_FILE: &str = "api-key";

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("writing the API key to {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("generating an API key: {0}")]
    Random(#[source] std::io::Error),
}

/// What the server accepts.
#[derive(Clone)]
pub struct ApiKeys {
    hash: [u8; 32],
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKeys(..)")
    }
}

pub fn hash(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// A new key in E2B's format: `e2b_` and 40 lowercase hex digits.
pub fn generate() -> Result<String, AuthError> {
    Ok(format!(
        "e2b_{}",
        ids::hex(&ids::random_bytes(20).map_err(AuthError::Random)?)
    ))
}

impl ApiKeys {
    pub fn for_key(key: &str) -> ApiKeys {
        ApiKeys { hash: hash(key) }
    }

    /// Compares hashes in constant time, so the answer's timing says nothing
    /// about how much of a guess matched.
    pub fn accepts(&self, key: &str) -> bool {
        let candidate = hash(key);
        candidate
            .iter()
            .zip(self.hash.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// Whether two secrets are equal, in time that depends only on their
/// lengths (a token's length is not secret: they are all one length).
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Decides the accepted key. `env_key` (`SANDFORK_API_KEY`) wins; else the
/// stored hash; else a new key is generated, written to `<data_dir>/api-key`
/// (0600, written then renamed) and its hash stored. Returns the key file's
/// path unless the key came from the environment.
pub fn setup(
    store: &Store,
    data_dir: &Path,
    env_key: Option<&str>,
) -> Result<(ApiKeys, Option<PathBuf>), AuthError> {
    if let Some(key) = env_key {
        return Ok((ApiKeys::for_key(key), None));
    }
    let path = data_dir.join(KEY_FILE);
    if let Some(stored) = store.meta(META_KEY)?
        && let Ok(hash) = <[u8; 32]>::try_from(stored.as_slice())
    {
        return Ok((ApiKeys { hash }, Some(path)));
    }
    let key = generate()?;
    write_key_file(&path, &key)?;
    store.put_meta(META_KEY, &hash(&key))?;
    Ok((ApiKeys::for_key(&key), Some(path)))
}

fn write_key_file(path: &Path, key: &str) -> Result<(), AuthError> {
    let err = |source| AuthError::Write {
        path: path.to_owned(),
        source,
    };
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(err)?;
    file.write_all(format!("{key}\n").as_bytes()).map_err(err)?;
    file.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn generated_keys_have_e2b_format_and_differ() {
        let a = generate().unwrap();
        let b = generate().unwrap();
        assert_ne!(a, b);
        let hex = a.strip_prefix("e2b_").unwrap();
        assert_eq!(hex.len(), 40);
        assert!(
            hex.bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
        );
    }

    #[test]
    fn keys_check_by_hash() {
        let keys = ApiKeys::for_key("e2b_00ff");
        assert!(keys.accepts("e2b_00ff"));
        assert!(!keys.accepts("e2b_00fe"));
        assert!(!keys.accepts(""));
    }

    #[test]
    fn first_start_writes_a_private_key_file_and_later_starts_reuse_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.redb")).unwrap();
        let (keys, file) = setup(&store, dir.path(), None).unwrap();
        let file = file.unwrap();
        let key = std::fs::read_to_string(&file).unwrap().trim().to_string();
        assert!(keys.accepts(&key));
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // Only the hash is stored.
        let stored = store.meta(META_KEY).unwrap().unwrap();
        assert_eq!(stored, hash(&key));
        assert!(!String::from_utf8_lossy(&stored).contains(&key));

        // A restart accepts the same key, without writing a new one.
        std::fs::remove_file(&file).unwrap();
        let (again, _) = setup(&store, dir.path(), None).unwrap();
        assert!(again.accepts(&key));
        assert!(!file.exists());

        // The environment's key wins.
        let (env, none) = setup(&store, dir.path(), Some("e2b_abc")).unwrap();
        assert!(none.is_none());
        assert!(env.accepts("e2b_abc"));
        assert!(!env.accepts(&key));
    }
}

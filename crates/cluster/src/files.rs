//! Files in the object store, content-addressed: a file is cut into 4 MiB
//! chunks, each stored once under `chunks/<sha256>` (a chunk already there,
//! from any file of any node, is not sent again), and described by a
//! [`StoredFile`]: its length and its chunks' digests, none for a chunk of
//! zeros (holes of sparse memory files and disk layers cost nothing).
//! A [`StoredFile`]'s own digest names the file's content, so a node keeps
//! one local copy of what many sandboxes share (template memory and layers).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::task::JoinSet;

use crate::objects::{ObjectError, ObjectStore};

pub const CHUNK: u64 = 4 << 20;
/// Chunks sent or fetched at once.
const PARALLEL: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] ObjectError),
    #[error("chunk {0} is missing from where it was fetched (object store or node)")]
    Missing(String),
    #[error("chunk {0} as fetched does not match its digest")]
    Corrupt(String),
    #[error("node {node}: {reason}")]
    Peer { node: String, reason: String },
    #[error("a blocking task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> FileError + 'a {
    move |source| FileError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

/// A file in the object store: its length and, per [`CHUNK`], the sha256
/// of the chunk's bytes (hex), or None for zeros.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredFile {
    pub len: u64,
    pub chunks: Vec<Option<String>>,
}

impl StoredFile {
    /// The content's name: the sha256 of the description (hex).
    pub fn digest(&self) -> String {
        let mut h = Sha256::new();
        h.update(self.len.to_le_bytes());
        for c in &self.chunks {
            h.update(c.as_deref().unwrap_or("-").as_bytes());
            h.update(b"\n");
        }
        hex(&h.finalize())
    }

    /// Bytes stored for it (chunks other files share counted too).
    pub fn stored_bytes(&self) -> u64 {
        let last = self.len % CHUNK;
        self.chunks
            .iter()
            .enumerate()
            .filter(|(_, c)| c.is_some())
            .map(|(i, _)| {
                if i + 1 == self.chunks.len() && last != 0 {
                    last
                } else {
                    CHUNK
                }
            })
            .sum()
    }
}

/// Where a download's chunks come from: the object store, or the node
/// that holds the file ([`crate::peer`]).
pub trait ChunkSource: Clone + Send + Sync + 'static {
    /// The chunk `digest` names, None if the source does not have it.
    fn chunk(
        &self,
        digest: &str,
    ) -> impl std::future::Future<Output = Result<Option<Bytes>, FileError>> + Send;
}

impl ChunkSource for ObjectStore {
    async fn chunk(&self, digest: &str) -> Result<Option<Bytes>, FileError> {
        Ok(self.get(&chunk_key(digest)).await?)
    }
}

pub fn chunk_key(digest: &str) -> String {
    format!("chunks/{digest}")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What one upload did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Sent {
    /// Chunks sent (the rest were in the store already, or zeros).
    pub chunks: u64,
    pub bytes: u64,
}

/// Reads chunk `index` of `file`: None when it holds only zeros (a hole is
/// skipped without reading it).
fn read_chunk(
    file: &File,
    path: &Path,
    index: u64,
    len: u64,
) -> Result<Option<Vec<u8>>, FileError> {
    let start = index * CHUNK;
    let end = (start + CHUNK).min(len);
    match rustix::fs::seek(file, rustix::fs::SeekFrom::Data(start)) {
        Ok(data) if data >= end => return Ok(None),
        Err(rustix::io::Errno::NXIO) => return Ok(None),
        _ => {}
    }
    let mut buf = vec![0u8; (end - start) as usize];
    file.read_exact_at(&mut buf, start)
        .map_err(io("reading", path))?;
    Ok(buf.iter().any(|&b| b != 0).then_some(buf))
}

/// Whether chunk `index` meets the byte ranges `used` (all are, without).
fn in_use(used: Option<&[(u64, u64)]>, index: u64) -> bool {
    let (start, end) = (index * CHUNK, (index + 1) * CHUNK);
    used.is_none_or(|used| used.iter().any(|&(a, b)| a < end && b > start))
}

/// Stores the file at `path`: each chunk not in the store yet is sent.
pub async fn upload(store: &ObjectStore, path: &Path) -> Result<(StoredFile, Sent), FileError> {
    upload_ranges(store, path, None).await
}

/// [`upload`], where only the chunks meeting `used` (byte ranges, sorted)
/// are read when given: the rest is stored as zeros (a disk layer's
/// unallocated clusters, the pages a memory overlay does not cover).
pub async fn upload_ranges(
    store: &ObjectStore,
    path: &Path,
    used: Option<&[(u64, u64)]>,
) -> Result<(StoredFile, Sent), FileError> {
    let file = Arc::new(File::open(path).map_err(io("opening", path))?);
    let len = file
        .metadata()
        .map_err(io("reading the size of", path))?
        .len();
    let count = len.div_ceil(CHUNK);
    let mut chunks = Vec::with_capacity(count as usize);
    let mut tasks: JoinSet<Result<Option<u64>, FileError>> = JoinSet::new();
    let mut sent = Sent::default();
    for index in 0..count {
        if !in_use(used, index) {
            chunks.push(None);
            continue;
        }
        let (f, p) = (file.clone(), path.to_owned());
        let read = tokio::task::spawn_blocking(move || {
            let data = read_chunk(&f, &p, index, len)?;
            Ok::<_, FileError>(data.map(|d| {
                let digest = hex(&Sha256::digest(&d));
                (digest, d)
            }))
        })
        .await??;
        let Some((digest, data)) = read else {
            chunks.push(None);
            continue;
        };
        chunks.push(Some(digest.clone()));
        while tasks.len() >= PARALLEL {
            if let Some(done) = tasks.join_next().await
                && let Some(n) = done??
            {
                sent.chunks += 1;
                sent.bytes += n;
            }
        }
        let store = store.clone();
        tasks.spawn(async move {
            let key = chunk_key(&digest);
            if store.exists(&key).await? {
                return Ok(None);
            }
            let n = data.len() as u64;
            store.put(&key, Bytes::from(data)).await?;
            Ok(Some(n))
        });
    }
    while let Some(done) = tasks.join_next().await {
        if let Some(n) = done?? {
            sent.chunks += 1;
            sent.bytes += n;
        }
    }
    Ok((StoredFile { len, chunks }, sent))
}

/// Where each chunk of a described file lies in it: its digest, offset and
/// length.
pub type ChunkPlaces = Vec<(String, u64, u64)>;

/// [`upload_ranges`] without the upload: the file's description and where
/// each of its non-zero chunks lies, for a node that serves the file
/// itself (see [`crate::peer`]).
pub async fn describe(
    path: &Path,
    used: Option<&[(u64, u64)]>,
) -> Result<(StoredFile, ChunkPlaces), FileError> {
    let (path, used) = (path.to_owned(), used.map(<[_]>::to_vec));
    tokio::task::spawn_blocking(move || {
        let file = File::open(&path).map_err(io("opening", &path))?;
        let len = file
            .metadata()
            .map_err(io("reading the size of", &path))?
            .len();
        let count = len.div_ceil(CHUNK);
        let mut chunks = Vec::with_capacity(count as usize);
        let mut places = Vec::new();
        for index in 0..count {
            if !in_use(used.as_deref(), index) {
                chunks.push(None);
                continue;
            }
            let (start, end) = (index * CHUNK, ((index + 1) * CHUNK).min(len));
            match read_chunk(&file, &path, index, len)? {
                Some(data) => {
                    let digest = hex(&Sha256::digest(&data));
                    places.push((digest.clone(), start, end - start));
                    chunks.push(Some(digest));
                }
                None => chunks.push(None),
            }
        }
        Ok((StoredFile { len, chunks }, places))
    })
    .await?
}

/// Writes the stored file to `to` (through a temporary sibling renamed into
/// place, so `to` is whole or absent), each chunk checked against its digest.
pub async fn download<S: ChunkSource>(
    store: &S,
    stored: &StoredFile,
    to: &Path,
) -> Result<(), FileError> {
    let mut name = to.file_name().unwrap_or_default().to_owned();
    name.push(".part");
    let tmp = to.with_file_name(name);
    let file = File::create(&tmp).map_err(io("creating", &tmp))?;
    file.set_len(stored.len).map_err(io("sizing", &tmp))?;
    let file = Arc::new(file);
    let fetched = async {
        let mut tasks: JoinSet<Result<(), FileError>> = JoinSet::new();
        for (index, digest) in stored.chunks.iter().enumerate() {
            let Some(digest) = digest.clone() else {
                continue;
            };
            while tasks.len() >= PARALLEL {
                if let Some(done) = tasks.join_next().await {
                    done??;
                }
            }
            let (store, file, tmp) = (store.clone(), file.clone(), tmp.clone());
            tasks.spawn(async move {
                let data = store
                    .chunk(&digest)
                    .await?
                    .ok_or_else(|| FileError::Missing(digest.clone()))?;
                tokio::task::spawn_blocking(move || {
                    if hex(&Sha256::digest(&data)) != digest {
                        return Err(FileError::Corrupt(digest));
                    }
                    file.write_all_at(&data, index as u64 * CHUNK)
                        .map_err(io("writing", &tmp))
                })
                .await?
            });
        }
        while let Some(done) = tasks.join_next().await {
            done??;
        }
        file.sync_all().map_err(io("syncing", &tmp))?;
        std::fs::rename(&tmp, to).map_err(io("renaming", &tmp))
    }
    .await;
    if fetched.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    fetched
}

/// Stores `value` as JSON under `key`.
pub async fn put_json<T: Serialize>(
    store: &ObjectStore,
    key: &str,
    value: &T,
) -> Result<(), ObjectError> {
    let bytes = serde_json::to_vec(value).map_err(|e| ObjectError::Http {
        url: key.to_owned(),
        reason: format!("encoding: {e}"),
    })?;
    store.put(key, Bytes::from(bytes)).await
}

/// The JSON object under `key`, None if there is none.
pub async fn get_json<T: serde::de::DeserializeOwned>(
    store: &ObjectStore,
    key: &str,
) -> Result<Option<T>, ObjectError> {
    let Some(bytes) = store.get(key).await? else {
        return Ok(None);
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| ObjectError::Http {
            url: key.to_owned(),
            reason: format!("decoding: {e}"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_chunks_are_not_stored_and_the_digest_names_the_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let file = File::create(&path).unwrap();
        file.set_len(3 * CHUNK + 5).unwrap();
        file.write_all_at(b"x", CHUNK + 7).unwrap();
        let f = File::open(&path).unwrap();
        assert!(read_chunk(&f, &path, 0, 3 * CHUNK + 5).unwrap().is_none());
        assert!(read_chunk(&f, &path, 1, 3 * CHUNK + 5).unwrap().is_some());
        let last = read_chunk(&f, &path, 3, 3 * CHUNK + 5).unwrap();
        assert!(last.is_none());
        let a = StoredFile {
            len: 3 * CHUNK + 5,
            chunks: vec![None, Some("ab".into()), None, Some("cd".into())],
        };
        assert_eq!(a.stored_bytes(), CHUNK + 5);
        let mut b = a.clone();
        assert_eq!(a.digest(), b.digest());
        b.chunks[0] = Some("ef".into());
        assert_ne!(a.digest(), b.digest());
    }
}

//! A fork's files across nodes: the node that froze a fork made across
//! nodes ([`super::fork_across`]) describes its files content-addressed (as
//! a durable pause's, [`sandfork_cluster::files`]) and serves their chunks, read-only,
//! to the nodes making its other children while the fork is under way
//! (`GET /internal/forks/{export}/chunks/{digest}`). A request names an
//! export and a digest, never a path: only the chunks of that fork's files
//! are served, to a caller whose API key is of the fork's team (or the
//! admin's) and who presents the export's own token.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sandfork_cluster::files::{self, ChunkPlaces, FileError, StoredFile};
use serde::{Deserialize, Serialize};

use super::guest_files::{GuestFiles, Known};
use crate::node::sandbox::Frozen;
use crate::node::store::SandboxRecord;
use crate::node::tenants::Caller;

/// The route of a fork's chunks.
pub const CHUNK_ROUTE: &str = "/internal/forks/{export}/chunks/{digest}";

/// A frozen fork as another node makes children of it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ForkManifest {
    /// The node that froze it.
    pub node_id: String,
    /// The parent's record there.
    pub parent: SandboxRecord,
    /// Its disk's top layer is the sealed one the children stack on.
    #[serde(flatten)]
    pub files: GuestFiles,
}

/// One fork's files, while it is served.
#[derive(Debug)]
struct Export {
    team: String,
    token: crate::node::ids::Token,
    /// Digest -> (file, offset, length).
    chunks: HashMap<String, (PathBuf, u64, u64)>,
}

/// The forks this node serves the files of, and what it has described.
#[derive(Debug, Default)]
pub struct Exports {
    live: Mutex<HashMap<String, Arc<Export>>>,
    /// Files that do not change once written (memory files, sealed layers),
    /// by path: a template's are read once, not at every fork.
    described: Known<(StoredFile, ChunkPlaces)>,
}

/// A fork being served: its name, token and description.
#[derive(Debug)]
pub struct Exported {
    pub id: String,
    pub token: crate::node::ids::Token,
    pub manifest: ForkManifest,
}

/// Why a chunk is not served.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// No such fork or chunk (or not the caller's team's: not told apart).
    NotFound,
    /// The fork's token is missing or wrong.
    Forbidden,
    /// The file could not be read here.
    Unreadable(String),
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Exports {
    /// Describes `frozen`'s files and serves them until [`Exports::remove`].
    pub async fn export(&self, frozen: &Frozen, node_id: &str) -> Result<Exported, FileError> {
        let mut chunks = HashMap::new();
        let mut add = |places: ChunkPlaces, path: &Path| {
            for (digest, offset, len) in places {
                chunks.insert(digest, (path.to_owned(), offset, len));
            }
        };
        // The state is new at every fork.
        let (state, places) = files::describe(&frozen.state, None).await?;
        add(places, &frozen.state);
        let mut memory = Vec::new();
        for (path, ranges) in &frozen.memory {
            let (stored, places) = self.describe_immutable(path, ranges.clone()).await?;
            add(places, path);
            memory.push(stored);
        }
        let mut disk = Vec::new();
        for path in &frozen.disk {
            let used = {
                let path = path.clone();
                tokio::task::spawn_blocking(move || disk_layers::used_ranges(&path)).await?
            }
            .map_err(|e| FileError::Io {
                what: "reading the used ranges of",
                path: path.clone(),
                source: std::io::Error::other(e.to_string()),
            })?;
            let (stored, places) = self.describe_immutable(path, Some(used)).await?;
            add(places, path);
            disk.push(stored);
        }
        let id = crate::node::ids::sandbox_id().map_err(|e| FileError::Io {
            what: "naming the export of",
            path: frozen.state.clone(),
            source: e,
        })?;
        let token = crate::node::ids::token().map_err(|e| FileError::Io {
            what: "making a token for",
            path: frozen.state.clone(),
            source: e,
        })?;
        lock(&self.live).insert(
            id.clone(),
            Arc::new(Export {
                team: frozen.parent.team().to_owned(),
                token: token.clone(),
                chunks,
            }),
        );
        Ok(Exported {
            id,
            token,
            manifest: ForkManifest {
                node_id: node_id.to_owned(),
                parent: frozen.parent.clone(),
                files: GuestFiles {
                    state: Some(state),
                    memory,
                    disk,
                    raw_base_size: frozen.raw_base.as_ref().map(|(_, size)| *size),
                },
            },
        })
    }

    /// Stops serving the fork `id` (its files stay: the parent's).
    pub fn remove(&self, id: &str) {
        lock(&self.live).remove(id);
    }

    async fn describe_immutable(
        &self,
        path: &Path,
        used: Option<Vec<(u64, u64)>>,
    ) -> Result<(StoredFile, ChunkPlaces), FileError> {
        let described = self
            .described
            .get_or_make(path, async || files::describe(path, used.as_deref()).await)
            .await?;
        Ok(described)
    }

    /// Where chunk `digest` of export `id` lies, for `caller` showing `token`.
    pub fn place(
        &self,
        id: &str,
        token: Option<&str>,
        caller: &Caller,
        digest: &str,
    ) -> Result<(PathBuf, u64, u64), Refused> {
        let export = lock(&self.live).get(id).cloned().ok_or(Refused::NotFound)?;
        if !caller.admin && *caller.team != *export.team {
            return Err(Refused::NotFound);
        }
        let token = token.ok_or(Refused::Forbidden)?;
        if !crate::node::keys::same_secret(token.as_bytes(), export.token.as_bytes()) {
            return Err(Refused::Forbidden);
        }
        export.chunks.get(digest).cloned().ok_or(Refused::NotFound)
    }
}

impl Exports {
    /// Chunk `digest` of export `export`, for `caller` presenting `token`.
    pub async fn read_chunk(
        &self,
        export: &str,
        token: Option<&str>,
        caller: &Caller,
        digest: &str,
    ) -> Result<Vec<u8>, Refused> {
        let (path, offset, len) = self.place(export, token, caller, digest)?;
        tokio::task::spawn_blocking(move || {
            let file = std::fs::File::open(&path)?;
            let mut buf = vec![0u8; len as usize];
            file.read_exact_at(&mut buf, offset)?;
            Ok::<_, std::io::Error>(buf)
        })
        .await
        .map_err(|e| Refused::Unreadable(e.to_string()))?
        .map_err(|e| Refused::Unreadable(format!("reading the fork's file: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use axum::extract::Path as UrlPath;
    use axum::http::{HeaderMap, StatusCode};

    use super::*;

    fn caller(team: &str, admin: bool) -> Caller {
        Caller {
            team: Arc::from(team),
            admin,
        }
    }

    /// Only the chunks of a live export are served, to its team (or the
    /// admin) with its token; a request names no path.
    #[test]
    fn chunks_are_served_only_to_the_fork_team_with_its_token() {
        let exports = Exports::default();
        let mut chunks = HashMap::new();
        chunks.insert("ab12".to_owned(), (PathBuf::from("/f/mem"), 4096, 10));
        lock(&exports.live).insert(
            "x1".into(),
            Arc::new(Export {
                team: "red".into(),
                token: "secret".into(),
                chunks,
            }),
        );
        let red = caller("red", false);
        assert_eq!(
            exports.place("x1", Some("secret"), &red, "ab12"),
            Ok((PathBuf::from("/f/mem"), 4096, 10))
        );
        let admin = caller("default", true);
        assert!(exports.place("x1", Some("secret"), &admin, "ab12").is_ok());
        assert_eq!(
            exports.place("x1", Some("wrong"), &red, "ab12"),
            Err(Refused::Forbidden)
        );
        assert_eq!(
            exports.place("x1", None, &red, "ab12"),
            Err(Refused::Forbidden)
        );
        let blue = caller("blue", false);
        assert_eq!(
            exports.place("x1", Some("secret"), &blue, "ab12"),
            Err(Refused::NotFound)
        );
        for digest in ["cd34", "../../etc/passwd", "/f/mem", ""] {
            assert_eq!(
                exports.place("x1", Some("secret"), &red, digest),
                Err(Refused::NotFound),
                "{digest}"
            );
        }
        assert_eq!(
            exports.place("x2", Some("secret"), &red, "ab12"),
            Err(Refused::NotFound)
        );
        exports.remove("x1");
        assert_eq!(
            exports.place("x1", Some("secret"), &red, "ab12"),
            Err(Refused::NotFound)
        );
    }

    /// An export describes the files as the object store would hold them
    /// (zero chunks none), and each non-zero chunk's place reads back the
    /// bytes its digest names.
    #[tokio::test]
    async fn an_export_places_every_chunk_of_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        std::fs::write(&state, b"vmm state").unwrap();
        let mem = dir.path().join("mem");
        let f = std::fs::File::create(&mem).unwrap();
        f.set_len(3 * files::CHUNK).unwrap();
        f.write_all_at(b"page", files::CHUNK + 8).unwrap();
        let frozen = Frozen {
            parent: SandboxRecord::default(),
            state: state.clone(),
            memory: vec![(mem.clone(), None)],
            disk: Vec::new(),
            raw_base: None,
        };
        let exports = Exports::default();
        let exported = exports.export(&frozen, "n1").await.unwrap();
        let m = &exported.manifest.files;
        assert_eq!(m.memory[0].chunks.len(), 3);
        assert!(m.memory[0].chunks[0].is_none() && m.memory[0].chunks[2].is_none());
        let admin = caller("default", true);
        let state = m.state.as_ref().unwrap();
        for digest in state.chunks.iter().chain(&m.memory[0].chunks).flatten() {
            let (path, offset, len) = exports
                .place(&exported.id, Some(&exported.token), &admin, digest)
                .unwrap();
            let mut buf = vec![0u8; len as usize];
            std::fs::File::open(&path)
                .unwrap()
                .read_exact_at(&mut buf, offset)
                .unwrap();
            use sha2::Digest;
            let hex: String = sha2::Sha256::digest(&buf)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            assert_eq!(&hex, digest);
        }
        // Described again from its identity, not read again.
        assert!(exports.described.knows(&mem));
    }

    /// Another node fetches an export's files over HTTP as the fork's
    /// children do (chunk by chunk, each checked against its digest), and
    /// gets nothing with a wrong token.
    #[tokio::test]
    async fn a_peer_downloads_the_exported_files_with_the_token_only() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        std::fs::write(&state, b"vmm state").unwrap();
        let mem = dir.path().join("mem");
        let f = std::fs::File::create(&mem).unwrap();
        f.set_len(2 * files::CHUNK + 100).unwrap();
        f.write_all_at(b"first", 3).unwrap();
        f.write_all_at(b"last", 2 * files::CHUNK + 50).unwrap();
        let frozen = Frozen {
            parent: SandboxRecord::default(),
            state,
            memory: vec![(mem.clone(), None)],
            disk: Vec::new(),
            raw_base: None,
        };
        let exports = Arc::new(Exports::default());
        let exported = exports.export(&frozen, "n1").await.unwrap();
        // The route as the node serves it, its key check left out (the
        // caller is the default team's).
        let app =
            axum::Router::new().route(
                CHUNK_ROUTE,
                axum::routing::get({
                    let exports = exports.clone();
                    move |UrlPath((export, digest)): UrlPath<(String, String)>,
                          headers: HeaderMap| async move {
                        let token = headers
                            .get(crate::wire::FORK_TOKEN_HEADER)
                            .and_then(|v| v.to_str().ok());
                        match exports
                            .read_chunk(&export, token, &caller("default", false), &digest)
                            .await
                        {
                            Ok(data) => (StatusCode::OK, data),
                            Err(Refused::Forbidden) => (StatusCode::FORBIDDEN, Vec::new()),
                            Err(_) => (StatusCode::NOT_FOUND, Vec::new()),
                        }
                    }
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let peer = |token: &str| {
            sandfork_cluster::peer::PeerChunks::new(
                addr.clone(),
                format!("/internal/forks/{}/chunks", exported.id),
                "unused here".into(),
                token.into(),
                sandfork_tls::Dialer::plain(),
            )
        };
        let copy = dir.path().join("copy");
        let memory = &exported.manifest.files.memory[0];
        files::download(&peer(&exported.token), memory, &copy)
            .await
            .unwrap();
        assert_eq!(std::fs::read(&copy).unwrap(), std::fs::read(&mem).unwrap());
        let refused = dir.path().join("refused");
        let e = files::download(&peer("wrong"), memory, &refused)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("403"), "{e}");
        assert!(!refused.exists());
    }
}

//! Local container images: an OCI image layout directory, or a `docker save`
//! tarball (the classic `manifest.json` form, or the OCI layout newer Docker
//! writes inside it). Yields the layers in order, the image config and a
//! content key.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::ImageConfig;
use crate::error::{BuildError, Result};
use crate::layers::{Layer, clean_relative};
use crate::scripts::{hex, sha256_hex};

/// An image opened from disk: what `build` needs to make a root tree.
#[derive(Debug)]
pub struct OciImage {
    /// Content identity: the manifest digest (layout) or the tarball's hash.
    pub key: String,
    pub layers: Vec<Layer>,
    pub config: ImageConfig,
}

/// An OCI content descriptor (also read by [`crate::registry`]).
#[derive(Deserialize)]
pub(crate) struct Descriptor {
    #[serde(rename = "mediaType", default)]
    pub(crate) media_type: String,
    pub(crate) digest: String,
    #[serde(default)]
    pub(crate) size: Option<u64>,
    #[serde(default)]
    pub(crate) platform: Option<Platform>,
}

#[derive(Deserialize)]
pub(crate) struct Platform {
    #[serde(default)]
    pub(crate) architecture: String,
    #[serde(default)]
    pub(crate) os: String,
}

#[derive(Deserialize)]
struct Index {
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct Manifest {
    config: Descriptor,
    layers: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct DockerManifestEntry {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

#[derive(Deserialize, Default)]
struct ConfigFile {
    #[serde(default)]
    config: Option<RunConfig>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "PascalCase")]
struct RunConfig {
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
}

fn parse_config(path: &Path, bytes: &[u8]) -> Result<ImageConfig> {
    let file: ConfigFile = serde_json::from_slice(bytes)
        .map_err(|e| BuildError::unreadable(path, format!("image config: {e}")))?;
    let c = file.config.unwrap_or_default();
    let env = c
        .env
        .unwrap_or_default()
        .into_iter()
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) => (k.to_owned(), v.to_owned()),
            None => (kv, String::new()),
        })
        .collect();
    let nonempty = |s: Option<String>| s.filter(|s| !s.is_empty());
    Ok(ImageConfig {
        env,
        working_dir: nonempty(c.working_dir),
        user: nonempty(c.user),
        entrypoint: c.entrypoint.unwrap_or_default(),
        cmd: c.cmd.unwrap_or_default(),
    })
}

const INDEX_TYPES: [&str; 2] = [
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];

impl OciImage {
    /// Opens an OCI image layout directory (`oci-layout`, `index.json`,
    /// `blobs/sha256/...`). Picks linux/amd64 from a multi-platform index.
    pub fn open_layout(dir: &Path) -> Result<OciImage> {
        let index_path = dir.join("index.json");
        let bytes = fs::read(&index_path)
            .map_err(|e| BuildError::unreadable(dir, format!("index.json: {e}")))?;
        let mut index: Index = serde_json::from_slice(&bytes)
            .map_err(|e| BuildError::unreadable(dir, format!("index.json: {e}")))?;
        // indexes may nest (an index pointing at a per-platform index)
        for _ in 0..4 {
            let desc = pick(dir, index.manifests)?;
            let bytes = read_blob(dir, &desc.digest)?;
            if INDEX_TYPES.contains(&desc.media_type.as_str()) {
                index = serde_json::from_slice(&bytes).map_err(|e| {
                    BuildError::unreadable(dir, format!("index {}: {e}", desc.digest))
                })?;
                continue;
            }
            return Self::from_manifest(dir, &desc.digest, &bytes);
        }
        Err(BuildError::UnsupportedImage {
            path: dir.into(),
            reason: "image indexes nested too deep".into(),
        })
    }

    /// Opens the image whose (platform) manifest is blob `digest` of the
    /// blob store `dir` (`dir/blobs/sha256/...`, an image layout's blobs,
    /// with or without its `index.json`).
    pub fn open_manifest(dir: &Path, digest: &str) -> Result<OciImage> {
        let bytes = read_blob(dir, digest)?;
        Self::from_manifest(dir, digest, &bytes)
    }

    fn from_manifest(dir: &Path, digest: &str, bytes: &[u8]) -> Result<OciImage> {
        let manifest: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| BuildError::unreadable(dir, format!("manifest {digest}: {e}")))?;
        let config_bytes = read_blob(dir, &manifest.config.digest)?;
        let config = parse_config(dir, &config_bytes)?;
        let layers = manifest
            .layers
            .iter()
            .map(|l| {
                let hex = sha256_of(dir, &l.digest)?;
                Ok(Layer {
                    path: dir.join("blobs/sha256").join(&hex),
                    sha256: Some(hex),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(OciImage {
            key: format!("oci-manifest {digest}"),
            layers,
            config,
        })
    }

    /// Opens a `docker save` tarball, unpacking it under `scratch` (which the
    /// caller removes). `key` is the tarball's hash, computed beforehand.
    pub fn open_docker_archive(archive: &Path, scratch: &Path, key: String) -> Result<OciImage> {
        let file =
            fs::File::open(archive).map_err(|e| BuildError::unreadable(archive, e.to_string()))?;
        extract_plain(archive, file, scratch)?;
        if scratch.join("index.json").exists() && !scratch.join("manifest.json").exists() {
            let mut image = Self::open_layout(scratch)?;
            image.key = key;
            return Ok(image);
        }
        let bytes = fs::read(scratch.join("manifest.json")).map_err(|e| {
            BuildError::unreadable(archive, format!("no manifest.json or index.json: {e}"))
        })?;
        let entries: Vec<DockerManifestEntry> = serde_json::from_slice(&bytes)
            .map_err(|e| BuildError::unreadable(archive, format!("manifest.json: {e}")))?;
        let [entry] = <[DockerManifestEntry; 1]>::try_from(entries).map_err(|v| {
            BuildError::UnsupportedImage {
                path: archive.into(),
                reason: format!("the archive holds {} images; save exactly one", v.len()),
            }
        })?;
        let inside = |p: &str| -> Result<PathBuf> {
            let rel = clean_relative(Path::new(p))?.ok_or_else(|| {
                BuildError::unreadable(archive, format!("bad path {p:?} in manifest.json"))
            })?;
            Ok(scratch.join(rel))
        };
        let config_path = inside(&entry.config)?;
        let config_bytes = fs::read(&config_path)
            .map_err(|e| BuildError::unreadable(archive, format!("{}: {e}", entry.config)))?;
        let config = parse_config(archive, &config_bytes)?;
        let layers = entry
            .layers
            .iter()
            .map(|l| {
                Ok(Layer {
                    path: inside(l)?,
                    sha256: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(OciImage {
            key,
            layers,
            config,
        })
    }
}

fn pick(dir: &Path, manifests: Vec<Descriptor>) -> Result<Descriptor> {
    if manifests.len() <= 1 {
        return manifests
            .into_iter()
            .next()
            .ok_or_else(|| BuildError::unreadable(dir, "the index lists no manifest"));
    }
    manifests
        .into_iter()
        .find(|m| {
            m.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
        })
        .ok_or_else(|| BuildError::UnsupportedImage {
            path: dir.into(),
            reason: "no linux/amd64 image in the index".into(),
        })
}

/// The hex of a `sha256:...` digest, checked to be a plain hex name.
fn sha256_of(dir: &Path, digest: &str) -> Result<String> {
    let hex = digest
        .strip_prefix("sha256:")
        .ok_or_else(|| BuildError::UnsupportedImage {
            path: dir.into(),
            reason: format!("digest {digest:?} is not sha256"),
        })?;
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(BuildError::unreadable(
            dir,
            format!("bad digest {digest:?}"),
        ));
    }
    Ok(hex.to_ascii_lowercase())
}

/// Reads a small blob (index, manifest, config) and checks its digest.
fn read_blob(dir: &Path, digest: &str) -> Result<Vec<u8>> {
    let hex = sha256_of(dir, digest)?;
    let path = dir.join("blobs/sha256").join(&hex);
    let bytes =
        fs::read(&path).map_err(|e| BuildError::unreadable(dir, format!("blob {digest}: {e}")))?;
    if sha256_hex(&bytes) != hex {
        return Err(BuildError::unreadable(
            dir,
            format!("blob {digest} does not match its digest"),
        ));
    }
    Ok(bytes)
}

/// The sha256 of a file, streamed.
pub(crate) fn hash_file(path: &Path) -> std::io::Result<String> {
    let mut f = fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

/// Unpacks an archive of plain files and directories (what `docker save`
/// writes; its layers stay tarballs) under `dest`.
fn extract_plain(archive: &Path, reader: impl Read, dest: &Path) -> Result<()> {
    let bad =
        |e: std::io::Error| BuildError::unreadable(archive, format!("not a readable tar: {e}"));
    let mut tar = tar::Archive::new(reader);
    for entry in tar.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        let kind = entry.header().entry_type();
        if !(kind.is_file() || kind.is_dir() || kind.is_symlink()) {
            continue;
        }
        // unpack_in refuses paths that leave `dest`, links included
        entry
            .unpack_in(dest)
            .map_err(|e| BuildError::io(format!("unpacking {}", archive.display()), e))?;
    }
    Ok(())
}

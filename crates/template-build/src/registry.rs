//! Pulls images from OCI and Docker registries (the distribution API v2)
//! into a content-addressed blob store (`<store>/blobs/sha256/<hex>`, the
//! layout of an OCI image layout's blobs), from which
//! [`crate::Source::OciBlobs`] builds a template.
//!
//! What it speaks: anonymous pulls; HTTP basic credentials; the token flow
//! (`WWW-Authenticate: Bearer realm=...`, a token fetched from the realm with
//! the credentials, if any); manifest lists and OCI indexes resolved to
//! linux/amd64; every blob checked against its digest (and size) before it
//! is renamed into the store, so the store holds only whole, verified blobs
//! and a second pull of the same digest downloads none of them (a pull by
//! digest whose manifest is stored makes no request at all).
//!
//! Registries are reached over HTTPS (rustls, see [`tls`]), and so are
//! token realms and the hosts blob downloads are redirected to; as Docker
//! does, plain HTTP is allowed only for loopback registries (`localhost`,
//! `127.0.0.0/8`, `::1`) and the hosts given in [`PullOptions::insecure`]
//! (`host` for any port, or `host:port`). Those are asked over plain HTTP
//! first and over TLS when the answer shows a TLS server; an insecure
//! registry's certificate is not checked, a loopback one's is.
//! Redirects are followed across hosts; the registry's `Authorization`
//! goes only to the registry's own scheme and host.
//!
//! The client is small and on the HTTP stack the workspace already has
//! (hyper); a registry crate would have brought its own HTTP and TLS stack.

mod tls;

pub use tls::NoVerify;

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::oci::Descriptor;
use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use crate::scripts::hex;

/// The registry short names resolve to, as Docker resolves them.
pub const DEFAULT_REGISTRY: &str = "docker.io";
/// Largest manifest or index accepted.
const MAX_MANIFEST: usize = 4 << 20;
/// Largest token response accepted.
const MAX_TOKEN: usize = 1 << 20;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for a response's headers or any piece of its body.
const IDLE_TIMEOUT: Duration = Duration::from_secs(120);

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// What went wrong pulling an image; the messages are meant for the user.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("image reference {reference:?}: {reason}")]
    BadReference { reference: String, reason: String },
    #[error("{registry}: {reason}")]
    Unauthorized { registry: String, reason: String },
    #[error("{reference}: not found in the registry ({detail})")]
    NotFound { reference: String, detail: String },
    #[error("{reference}: {reason}")]
    Unsupported { reference: String, reason: String },
    /// The image's blobs add up to more than [`PullOptions::max_bytes`]
    /// (told before any layer is fetched).
    #[error(
        "{reference}: the image is {bytes} bytes (compressed, as the registry serves it), more \
         than the {max} bytes this node converts"
    )]
    TooLarge {
        reference: String,
        bytes: u64,
        max: u64,
    },
    /// The node's credentials file ([`AUTH_VAR`]) could not be read.
    #[error("the registry credentials file {path}: {reason}")]
    AuthFile { path: PathBuf, reason: String },
    #[error("{what}: the registry answered {status}: {message}")]
    Http {
        what: String,
        status: StatusCode,
        message: String,
    },
    #[error("{what}: {reason}")]
    Transport { what: String, reason: String },
    /// A TLS handshake failed (an untrusted certificate, a registry that
    /// does not speak TLS) or TLS could not be set up (the CA file).
    #[error("{what}: {reason}")]
    Tls { what: String, reason: String },
    #[error("{what}: the content does not match its digest {digest} ({detail})")]
    DigestMismatch {
        what: String,
        digest: String,
        detail: String,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> RegistryError {
    let context = context.into();
    move |source| RegistryError::Io { context, source }
}

/// An image reference, normalised as Docker normalises it: `alpine` is
/// `docker.io/library/alpine:latest`, `host:5000/a/b@sha256:...` keeps its
/// registry and digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// `docker.io`, `host`, `host:port`.
    pub registry: String,
    /// `library/alpine`, `a/b`.
    pub repository: String,
    pub tag: Option<String>,
    /// `sha256:<64 hex>`.
    pub digest: Option<String>,
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

fn valid_component(c: &str) -> bool {
    let b = c.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|&x| x.is_ascii_lowercase() || x.is_ascii_digit() || b"._-".contains(&x))
}

fn valid_tag(t: &str) -> bool {
    let b = t.as_bytes();
    (1..=128).contains(&b.len())
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter()
            .all(|&x| x.is_ascii_alphanumeric() || b"_.-".contains(&x))
}

fn valid_host(h: &str) -> bool {
    let port_ok = |p: Option<&str>| p.is_none_or(|p| p.parse::<u16>().is_ok_and(|p| p > 0));
    if let Some(rest) = h.strip_prefix('[') {
        let Some((v6, after)) = rest.split_once(']') else {
            return false;
        };
        let port = match after {
            "" => None,
            a => match a.strip_prefix(':') {
                Some(p) => Some(p),
                None => return false,
            },
        };
        return v6.parse::<std::net::Ipv6Addr>().is_ok() && port_ok(port);
    }
    let (host, port) = match h.split_once(':') {
        Some((a, b)) => (a, Some(b)),
        None => (h, None),
    };
    port_ok(port)
        && !host.is_empty()
        && host.split('.').all(|l| {
            !l.is_empty()
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// `sha256:<64 lowercase hex>` (the only digest algorithm accepted).
fn check_digest(d: &str) -> Option<&str> {
    let hex = d.strip_prefix("sha256:")?;
    (hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))).then_some(hex)
}

impl Reference {
    /// Parses `[registry/]name[:tag][@digest]` the way Docker does: the
    /// first component is a registry when it has a `.` or a `:` or is
    /// `localhost`; otherwise the registry is `docker.io`, where one-component
    /// names are under `library/`. No tag and no digest means `latest`.
    pub fn parse(s: &str) -> Result<Reference, RegistryError> {
        let bad = |reason: &str| RegistryError::BadReference {
            reference: s.to_owned(),
            reason: reason.to_owned(),
        };
        if s.is_empty() || s.len() > 512 || s.bytes().any(|b| b.is_ascii_whitespace() || b < 0x20) {
            return Err(bad("not an image name"));
        }
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => {
                if check_digest(d).is_none() {
                    return Err(bad(
                        "the digest must be sha256: and 64 lowercase hex digits",
                    ));
                }
                (r, Some(d.to_owned()))
            }
            None => (s, None),
        };
        let (name, tag) = match rest.rfind(':') {
            Some(i) if !rest[i + 1..].contains('/') => (&rest[..i], Some(&rest[i + 1..])),
            _ => (rest, None),
        };
        if let Some(t) = tag
            && !valid_tag(t)
        {
            return Err(bad(
                "a tag is 1 to 128 letters, digits, '_', '.' or '-', not starting with '.' or '-'",
            ));
        }
        let (registry, path) = match name.split_once('/') {
            Some((first, path))
                if first.contains(['.', ':']) || first == "localhost" || first.starts_with('[') =>
            {
                if !valid_host(first) {
                    return Err(bad("the registry is not a valid host[:port]"));
                }
                (first.to_owned(), path.to_owned())
            }
            _ => (DEFAULT_REGISTRY.to_owned(), name.to_owned()),
        };
        let registry = if registry == "index.docker.io" {
            DEFAULT_REGISTRY.to_owned()
        } else {
            registry
        };
        if path.is_empty() || !path.split('/').all(valid_component) {
            return Err(bad(
                "the repository is lowercase letters, digits and '.', '_', '-' between them, \
                 in components separated by '/'",
            ));
        }
        let repository = if registry == DEFAULT_REGISTRY && !path.contains('/') {
            format!("library/{path}")
        } else {
            path
        };
        if repository.len() > 255 {
            return Err(bad("the repository name is longer than 255 characters"));
        }
        let tag = match (tag, &digest) {
            (Some(t), _) => Some(t.to_owned()),
            (None, None) => Some("latest".to_owned()),
            (None, Some(_)) => None,
        };
        Ok(Reference {
            registry,
            repository,
            tag,
            digest,
        })
    }

    /// The host (and port) the registry API is served on: the registry's
    /// name, except that `docker.io` is served where
    /// `SANDFORK_DOCKER_HUB_API` says (Docker maps it to its API host; the
    /// project keeps registry host names out of its code).
    pub fn api_host(&self) -> String {
        if self.registry == DEFAULT_REGISTRY
            && let Ok(api) = std::env::var("SANDFORK_DOCKER_HUB_API")
            && !api.is_empty()
        {
            return api;
        }
        self.registry.clone()
    }

    /// The digest or the tag, as the manifest URL names it.
    fn manifest_ref(&self) -> &str {
        self.digest
            .as_deref()
            .or(self.tag.as_deref())
            .unwrap_or("latest")
    }
}

/// Whether `host[:port]` is a loopback address or name.
pub fn is_loopback(host: &str) -> bool {
    if host
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
    {
        return true;
    }
    let h = match host.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) && !h.is_empty() => h,
        _ => host,
    };
    let h = h.trim_start_matches('[').trim_end_matches(']');
    h == "localhost"
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The host of `host[:port]` (`[v6]` keeps its brackets).
fn bare_host(authority: &str) -> &str {
    if authority.starts_with('[') {
        return authority.find(']').map_or(authority, |i| &authority[..=i]);
    }
    authority.split_once(':').map_or(authority, |(h, _)| h)
}

/// User name and password for a registry (HTTP basic, or to get a token).
#[derive(Clone)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<hidden>")
            .finish()
    }
}

/// How to pull.
#[derive(Debug, Clone, Default)]
pub struct PullOptions {
    pub credentials: Option<Credentials>,
    /// Registries (`host` or `host:port`) reached over plain HTTP besides
    /// loopback ones.
    pub insecure: Vec<String>,
    /// Where loopback registries are really reached: set when this node
    /// runs inside a VM (the KVM lab) whose users' loopback is its host's,
    /// reached from inside at this address (the `Host` header and the
    /// image's name keep the loopback address).
    pub loopback_via: Option<String>,
    /// A PEM file of CA certificates trusted besides the system's (for
    /// registries with certificates of a private CA).
    pub ca_file: Option<PathBuf>,
    /// The most bytes the image's config and layers may add up to (their
    /// sizes in the manifest); None: no bound.
    pub max_bytes: Option<u64>,
}

/// The variable naming the node's registry credentials file: Docker's
/// `config.json` shape (as `docker login`, podman and skopeo write it),
/// `{"auths": {"host[:port]": {"auth": "<base64 of user:password>"}}}`
/// (or `"username"` and `"password"` instead of `"auth"`).
pub const AUTH_VAR: &str = "SANDFORK_REGISTRY_AUTH";

#[derive(Deserialize)]
struct AuthFile {
    #[serde(default)]
    auths: std::collections::BTreeMap<String, AuthEntry>,
}

#[derive(Deserialize)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

impl Credentials {
    /// The credentials for `registry` (`host[:port]`) in the file
    /// [`AUTH_VAR`] names; None when it names none or has none for it.
    /// Read at each pull, so that changed credentials need no restart.
    pub fn from_env(registry: &str) -> Result<Option<Credentials>, RegistryError> {
        match std::env::var_os(AUTH_VAR).filter(|v| !v.is_empty()) {
            Some(path) => Credentials::from_file(Path::new(&path), registry),
            None => Ok(None),
        }
    }

    /// The credentials for `registry` in the auth file `path` (see
    /// [`AUTH_VAR`]). A key matches with or without a scheme and a path
    /// (`https://host:5000/v1/`), as Docker writes them.
    pub fn from_file(path: &Path, registry: &str) -> Result<Option<Credentials>, RegistryError> {
        let bad = |reason: String| RegistryError::AuthFile {
            path: path.to_owned(),
            reason,
        };
        let text = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        let file: AuthFile = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
        let host_of = |key: &str| -> String {
            let key = key
                .strip_prefix("https://")
                .or_else(|| key.strip_prefix("http://"))
                .unwrap_or(key);
            let host = key.split('/').next().unwrap_or(key);
            if host == "index.docker.io" {
                DEFAULT_REGISTRY.to_owned()
            } else {
                host.to_owned()
            }
        };
        let Some((key, entry)) = file.auths.iter().find(|(k, _)| host_of(k) == registry) else {
            return Ok(None);
        };
        let (username, password) = match (&entry.auth, &entry.username) {
            (Some(auth), _) if !auth.is_empty() => {
                let decoded = base64::engine::general_purpose::STANDARD
                    .decode(auth.trim())
                    .ok()
                    .and_then(|b| String::from_utf8(b).ok())
                    .ok_or_else(|| {
                        bad(format!("the auth of {key} is not base64 of user:password"))
                    })?;
                let (u, p) = decoded.split_once(':').ok_or_else(|| {
                    bad(format!("the auth of {key} is not base64 of user:password"))
                })?;
                (u.to_owned(), p.to_owned())
            }
            (_, Some(u)) => (u.clone(), entry.password.clone().unwrap_or_default()),
            _ => return Err(bad(format!("{key} has neither auth nor username"))),
        };
        Ok(Some(Credentials { username, password }))
    }
}

impl PullOptions {
    /// Insecure registries from `SANDFORK_INSECURE_REGISTRIES` (comma- or
    /// space-separated `host[:port]`s).
    pub fn insecure_from_env() -> Vec<String> {
        std::env::var("SANDFORK_INSECURE_REGISTRIES")
            .unwrap_or_default()
            .split([',', ' '])
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// The loopback address from `SANDFORK_REGISTRY_LOOPBACK_VIA` (see
    /// [`PullOptions::loopback_via`]).
    pub fn loopback_via_from_env() -> Option<String> {
        std::env::var("SANDFORK_REGISTRY_LOOPBACK_VIA")
            .ok()
            .filter(|v| !v.is_empty())
    }

    /// The extra CA file from `SANDFORK_REGISTRY_CA` (see
    /// [`PullOptions::ca_file`]).
    pub fn ca_file_from_env() -> Option<PathBuf> {
        std::env::var_os(tls::CA_VAR)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    }
}

/// What one pull did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PullStats {
    /// HTTP requests made (token requests included).
    pub requests: u32,
    /// Blobs downloaded (configs and layers).
    pub blobs_fetched: u32,
    pub bytes_fetched: u64,
    /// Blobs already in the store.
    pub blobs_cached: u32,
}

/// A pulled image: its platform manifest is `<store>/blobs/sha256/<hex of
/// manifest_digest>`, and every blob it names is in the store.
#[derive(Debug, Clone)]
pub struct Pulled {
    pub store: PathBuf,
    pub manifest_digest: String,
    pub stats: PullStats,
}

#[derive(Deserialize)]
struct AnyManifest {
    #[serde(rename = "schemaVersion", default)]
    schema_version: u32,
    #[serde(rename = "mediaType", default)]
    media_type: String,
    #[serde(default)]
    manifests: Option<Vec<Descriptor>>,
    #[serde(default)]
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Option<Vec<Descriptor>>,
}

/// An image's platform manifest, as [`resolve`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The linux/amd64 manifest's digest (`sha256:...`): the image's
    /// identity, whichever tag named it.
    pub manifest_digest: String,
    /// HTTP requests made (token requests included).
    pub requests: u32,
}

/// What `reference` names: its linux/amd64 manifest's digest, the
/// manifest (and an index on the way) stored in `store` (created if
/// missing), no layer fetched. A tag costs a manifest request or two; a
/// digest already stored, none.
pub async fn resolve(
    store: &Path,
    reference: &Reference,
    opts: &PullOptions,
    log: &mut (dyn FnMut(&str) + Send),
) -> Result<Resolved, RegistryError> {
    let blobs = open_store(store).await?;
    let mut client = Client::new(reference, opts)?;
    let mut stats = PullStats::default();
    let (manifest_digest, _) =
        platform_manifest(&blobs, reference, &mut client, &mut stats, log).await?;
    Ok(Resolved {
        manifest_digest,
        requests: stats.requests,
    })
}

/// `store`'s blob directory, the store made an OCI layout when new.
async fn open_store(store: &Path) -> Result<PathBuf, RegistryError> {
    let blobs = store.join("blobs/sha256");
    tokio::fs::create_dir_all(&blobs)
        .await
        .map_err(io_err(format!("creating {}", blobs.display())))?;
    let layout = store.join("oci-layout");
    if tokio::fs::metadata(&layout).await.is_err() {
        let _ = tokio::fs::write(&layout, br#"{"imageLayoutVersion":"1.0.0"}"#).await;
    }
    Ok(blobs)
}

/// `reference`'s linux/amd64 manifest (through an index when it names
/// one) and its digest, stored in `blobs`.
async fn platform_manifest(
    blobs: &Path,
    reference: &Reference,
    client: &mut Client,
    stats: &mut PullStats,
    log: &mut (dyn FnMut(&str) + Send),
) -> Result<(String, AnyManifest), RegistryError> {
    let what = reference.to_string();
    // The manifest: from the store when pulled by a digest already there.
    let mut digest = reference.digest.clone();
    let mut bytes = match digest.as_deref().and_then(check_digest) {
        Some(hex) => read_stored(blobs, hex).await,
        None => None,
    };
    if bytes.is_some() {
        log(&format!("{what}: manifest cached"));
    }
    let mut manifest: AnyManifest;
    let mut depth = 0;
    loop {
        let body = match bytes.take() {
            Some(b) => b,
            None => {
                let asked = digest
                    .clone()
                    .unwrap_or_else(|| reference.manifest_ref().to_owned());
                log(&format!("{what}: fetching manifest {asked}"));
                let (body, header_digest) = client.manifest(&asked, &what, stats).await?;
                let got = format!("sha256:{}", hex(&Sha256::digest(&body)));
                if let Some(want) = digest.as_deref().or(header_digest.as_deref())
                    && want.starts_with("sha256:")
                    && want != got
                {
                    return Err(RegistryError::DigestMismatch {
                        what: format!("{what}: manifest"),
                        digest: want.to_owned(),
                        detail: format!("got {got}"),
                    });
                }
                store_bytes(blobs, &got, &body).await?;
                digest = Some(got);
                body
            }
        };
        manifest = serde_json::from_slice(&body).map_err(|e| RegistryError::Unsupported {
            reference: what.clone(),
            reason: format!("the manifest is not valid JSON: {e}"),
        })?;
        if manifest.schema_version == 1 {
            return Err(RegistryError::Unsupported {
                reference: what.clone(),
                reason: "Docker schema 1 manifests are not supported (push the image again with \
                         a current client)"
                    .into(),
            });
        }
        let Some(list) = manifest.manifests.take() else {
            break;
        };
        depth += 1;
        if depth > 3 {
            return Err(RegistryError::Unsupported {
                reference: what.clone(),
                reason: "image indexes nested too deep".into(),
            });
        }
        let pick = list
            .into_iter()
            .find(|m| {
                m.platform
                    .as_ref()
                    .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
            })
            .ok_or_else(|| RegistryError::Unsupported {
                reference: what.clone(),
                reason: "the image has no linux/amd64 variant".into(),
            })?;
        let hex = check_digest(&pick.digest).ok_or_else(|| RegistryError::Unsupported {
            reference: what.clone(),
            reason: format!("digest {:?} is not sha256", pick.digest),
        })?;
        log(&format!("{what}: linux/amd64 is {}", pick.digest));
        bytes = read_stored(blobs, hex).await;
        digest = Some(pick.digest);
    }
    if ![OCI_MANIFEST, DOCKER_MANIFEST, ""].contains(&manifest.media_type.as_str())
        && manifest.config.is_none()
    {
        return Err(RegistryError::Unsupported {
            reference: what.clone(),
            reason: format!("manifest type {:?} is not an image", manifest.media_type),
        });
    }
    Ok((digest.unwrap_or_default(), manifest))
}

/// Pulls `reference` into `store` (created if missing), logging progress.
pub async fn pull(
    store: &Path,
    reference: &Reference,
    opts: &PullOptions,
    log: &mut (dyn FnMut(&str) + Send),
) -> Result<Pulled, RegistryError> {
    let blobs = open_store(store).await?;
    let mut client = Client::new(reference, opts)?;
    let mut stats = PullStats::default();
    let what = reference.to_string();
    let (manifest_digest, manifest) =
        platform_manifest(&blobs, reference, &mut client, &mut stats, log).await?;
    let (Some(config), Some(layers)) = (manifest.config, manifest.layers) else {
        return Err(RegistryError::Unsupported {
            reference: what.clone(),
            reason: "the manifest has no config or no layers".into(),
        });
    };
    let bytes: u64 = std::iter::once(&config)
        .chain(&layers)
        .filter_map(|d| d.size)
        .fold(0, u64::saturating_add);
    if let Some(max) = opts.max_bytes
        && bytes > max
    {
        return Err(RegistryError::TooLarge {
            reference: what.clone(),
            bytes,
            max,
        });
    }
    let total = layers.len();
    for (i, d) in std::iter::once(config).chain(layers).enumerate() {
        let hex = check_digest(&d.digest).ok_or_else(|| RegistryError::Unsupported {
            reference: what.clone(),
            reason: format!("digest {:?} is not sha256", d.digest),
        })?;
        let name = if i == 0 {
            "config".to_owned()
        } else {
            format!("layer {i}/{total}")
        };
        if tokio::fs::metadata(blobs.join(hex)).await.is_ok() {
            stats.blobs_cached += 1;
            log(&format!("{what}: {name} {} cached", d.digest));
            continue;
        }
        log(&format!(
            "{what}: fetching {name} {}{}",
            d.digest,
            d.size
                .map(|s| format!(" ({:.1} MiB)", s as f64 / 1048576.0))
                .unwrap_or_default()
        ));
        let _ = &d.media_type;
        let n = client
            .blob(&blobs, hex, d.size, &format!("{what}: {name}"), &mut stats)
            .await?;
        stats.blobs_fetched += 1;
        stats.bytes_fetched += n;
    }
    log(&format!(
        "{what}: pulled {manifest_digest} ({} blobs fetched, {:.1} MiB; {} cached; {} requests)",
        stats.blobs_fetched,
        stats.bytes_fetched as f64 / 1048576.0,
        stats.blobs_cached,
        stats.requests
    ));
    Ok(Pulled {
        store: store.to_owned(),
        manifest_digest,
        stats,
    })
}

/// A stored blob's bytes, when it is there (and small enough to be a
/// manifest).
async fn read_stored(blobs: &Path, hex: &str) -> Option<Vec<u8>> {
    let path = blobs.join(hex);
    let meta = tokio::fs::metadata(&path).await.ok()?;
    if meta.len() > MAX_MANIFEST as u64 {
        return None;
    }
    tokio::fs::read(&path).await.ok()
}

/// Writes `bytes` (already checked to be `digest`) into the store.
async fn store_bytes(blobs: &Path, digest: &str, bytes: &[u8]) -> Result<(), RegistryError> {
    let hex = check_digest(digest).unwrap_or_default();
    let path = blobs.join(hex);
    if tokio::fs::metadata(&path).await.is_ok() {
        return Ok(());
    }
    let tmp = temp_name(blobs, hex);
    let written = async {
        let mut f = tokio::fs::File::create(&tmp).await?;
        f.write_all(bytes).await?;
        f.sync_all().await?;
        tokio::fs::rename(&tmp, &path).await
    }
    .await;
    if written.is_err() {
        let _ = tokio::fs::remove_file(&tmp).await;
    }
    written.map_err(io_err(format!("writing {}", path.display())))
}

fn temp_name(blobs: &Path, hex: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    blobs.join(format!(
        ".tmp-{hex}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// An absolute URL split into what a request needs.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Url {
    https: bool,
    /// `host[:port]` as written.
    authority: String,
    host: String,
    port: u16,
    /// Path and query.
    path: String,
}

impl Url {
    fn parse(s: &str) -> Option<Url> {
        let uri: Uri = s.parse().ok()?;
        let https = match uri.scheme_str()? {
            "https" => true,
            "http" => false,
            _ => return None,
        };
        let auth = uri.authority()?;
        if auth.as_str().contains('@') {
            return None;
        }
        let host = auth.host().trim_start_matches('[').trim_end_matches(']');
        Some(Url {
            https,
            authority: auth.as_str().to_owned(),
            host: host.to_owned(),
            port: auth.port_u16().unwrap_or(if https { 443 } else { 80 }),
            path: uri
                .path_and_query()
                .map(|p| p.as_str().to_owned())
                .unwrap_or_else(|| "/".into()),
        })
    }
}

/// Percent-encodes a query value (RFC 3986 unreserved kept).
fn query_escape(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A `WWW-Authenticate` challenge: its scheme and parameters.
#[derive(Debug, PartialEq, Eq)]
struct Challenge {
    scheme: String,
    params: Vec<(String, String)>,
}

impl Challenge {
    fn param(&self, key: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v.as_str())
    }
}

/// Parses one challenge: `Scheme k="v", k2=v2`.
fn parse_challenge(h: &str) -> Option<Challenge> {
    let h = h.trim();
    let (scheme, mut rest) = match h.split_once(' ') {
        Some((s, r)) => (s, r.trim_start()),
        None => (h, ""),
    };
    if scheme.is_empty() {
        return None;
    }
    let mut params = Vec::new();
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=')?;
        let key = key.trim().to_owned();
        let after = after.trim_start();
        let (value, next) = if let Some(q) = after.strip_prefix('"') {
            let mut value = String::new();
            let mut chars = q.char_indices();
            let mut end = None;
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, c)) = chars.next() {
                            value.push(c);
                        }
                    }
                    '"' => {
                        end = Some(i + 1);
                        break;
                    }
                    c => value.push(c),
                }
            }
            (value, &q[end?..])
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (after[..end].trim().to_owned(), &after[end..])
        };
        params.push((key, value));
        rest = next.trim_start().trim_start_matches(',').trim_start();
    }
    Some(Challenge {
        scheme: scheme.to_owned(),
        params,
    })
}

/// The registry's JSON error body: its first message.
fn error_message(body: &[u8]) -> String {
    #[derive(Deserialize)]
    struct Errors {
        errors: Vec<ErrorItem>,
    }
    #[derive(Deserialize)]
    struct ErrorItem {
        #[serde(default)]
        code: String,
        #[serde(default)]
        message: String,
    }
    match serde_json::from_slice::<Errors>(body) {
        Ok(e) if !e.errors.is_empty() => e
            .errors
            .iter()
            .map(|e| format!("{} {}", e.code, e.message).trim().to_owned())
            .collect::<Vec<_>>()
            .join("; "),
        _ => String::from_utf8_lossy(&body[..body.len().min(200)])
            .trim()
            .to_owned(),
    }
}

struct Client {
    base: Url,
    /// Where the registry's own host is connected to (see
    /// [`PullOptions::loopback_via`]).
    connect_host: String,
    registry: String,
    repository: String,
    credentials: Option<Credentials>,
    /// The `Authorization` header value in use.
    auth: Option<String>,
    /// See [`PullOptions::insecure`].
    insecure: Vec<String>,
    tls: tls::Tls,
    /// Until the registry's first answer: whether it is reached over plain
    /// HTTP but may turn out to speak TLS (a loopback or insecure one).
    may_be_tls: bool,
}

/// A request's outcome once connected: hyper's error when the answer was
/// not HTTP.
type Exchange = Result<Response<Incoming>, hyper::Error>;

impl Client {
    fn new(reference: &Reference, opts: &PullOptions) -> Result<Client, RegistryError> {
        let host = reference.api_host();
        let host = host.as_str();
        let bare = bare_host(host);
        let plain = is_loopback(host) || opts.insecure.iter().any(|h| h == host || h == bare);
        let scheme = if plain { "http" } else { "https" };
        let base = Url::parse(&format!("{scheme}://{host}/")).ok_or_else(|| {
            RegistryError::BadReference {
                reference: reference.to_string(),
                reason: "the registry is not a valid host[:port]".into(),
            }
        })?;
        let connect_host = match &opts.loopback_via {
            Some(via) if is_loopback(host) => via.clone(),
            _ => base.host.clone(),
        };
        Ok(Client {
            connect_host,
            base,
            registry: reference.registry.clone(),
            repository: reference.repository.clone(),
            credentials: opts.credentials.clone(),
            auth: None,
            insecure: opts.insecure.clone(),
            tls: tls::Tls::new(opts.ca_file.as_deref()),
            may_be_tls: plain,
        })
    }

    fn url(&self, path: &str) -> Url {
        Url {
            path: path.to_owned(),
            ..self.base.clone()
        }
    }

    /// Whether `authority` is listed insecure (by host or host and port).
    fn listed_insecure(&self, authority: &str) -> bool {
        let bare = bare_host(authority);
        self.insecure.iter().any(|h| h == authority || h == bare)
    }

    /// One request on a new connection. The first request to a registry
    /// reached over plain HTTP goes over TLS again when the answer shows a
    /// TLS server (Go's answers plain HTTP with a 400 naming HTTPS, others
    /// with bytes that are not HTTP).
    async fn send(
        &mut self,
        url: &Url,
        accept: Option<&str>,
        auth: Option<&str>,
        what: &str,
        stats: &mut PullStats,
    ) -> Result<Response<Incoming>, RegistryError> {
        let transport = |reason: String| RegistryError::Transport {
            what: what.to_owned(),
            reason,
        };
        if !url.https && !is_loopback(&url.authority) && !self.listed_insecure(&url.authority) {
            return Err(transport(format!(
                "refusing plain HTTP to {}: only loopback registries and those listed in \
                 SANDFORK_INSECURE_REGISTRIES are reached without TLS",
                url.authority
            )));
        }
        let http_err = |e: hyper::Error| transport(format!("HTTP with {}: {e}", url.authority));
        let probe = self.may_be_tls && !url.https && url.authority == self.base.authority;
        if !probe {
            stats.requests += 1;
            return self
                .exchange(url, accept, auth, what)
                .await?
                .map_err(http_err);
        }
        self.may_be_tls = false;
        let over_tls = Url {
            https: true,
            ..url.clone()
        };
        match self.exchange(url, accept, auth, what).await? {
            Ok(resp) if resp.status() == StatusCode::BAD_REQUEST => {
                let body = read_limited(resp, 64 << 10, what).await?;
                stats.requests += 1;
                if String::from_utf8_lossy(&body).contains("HTTPS") {
                    self.base.https = true;
                    return self
                        .exchange(&over_tls, accept, auth, what)
                        .await?
                        .map_err(http_err);
                }
                Err(RegistryError::Http {
                    what: what.to_owned(),
                    status: StatusCode::BAD_REQUEST,
                    message: error_message(&body),
                })
            }
            Ok(resp) => {
                stats.requests += 1;
                Ok(resp)
            }
            Err(e) if e.is_parse() || e.is_incomplete_message() => {
                stats.requests += 1;
                match self.exchange(&over_tls, accept, auth, what).await {
                    Ok(Ok(resp)) => {
                        self.base.https = true;
                        Ok(resp)
                    }
                    Ok(Err(tls_err)) => Err(transport(format!(
                        "HTTP with {0}: {e}; over TLS: {tls_err}",
                        url.authority
                    ))),
                    Err(tls_err) => Err(transport(format!(
                        "HTTP with {}: {e} (and over TLS: {tls_err})",
                        url.authority
                    ))),
                }
            }
            Err(e) => Err(http_err(e)),
        }
    }

    /// Connects (over TLS for an https URL) and sends one request, with a
    /// deadline for the answer's headers.
    async fn exchange(
        &mut self,
        url: &Url,
        accept: Option<&str>,
        auth: Option<&str>,
        what: &str,
    ) -> Result<Exchange, RegistryError> {
        let transport = |reason: String| RegistryError::Transport {
            what: what.to_owned(),
            reason,
        };
        let host = if url.authority == self.base.authority {
            self.connect_host.as_str()
        } else {
            url.host.as_str()
        };
        let stream = tokio::time::timeout(
            CONNECT_TIMEOUT,
            tokio::net::TcpStream::connect((host, url.port)),
        )
        .await
        .map_err(|_| transport(format!("connecting to {} timed out", url.authority)))?
        .map_err(|e| transport(format!("connecting to {}: {e}", url.authority)))?;
        let mut req = Request::get(url.path.as_str())
            .header(hyper::header::HOST, url.authority.as_str())
            .header(hyper::header::USER_AGENT, "sandfork");
        if let Some(a) = accept {
            req = req.header(hyper::header::ACCEPT, a);
        }
        if let Some(a) = auth {
            req = req.header(hyper::header::AUTHORIZATION, a);
        }
        let req = req
            .body(Empty::<Bytes>::new())
            .map_err(|e| transport(format!("building the request: {e}")))?;
        if !url.https {
            return request_over(stream, req, &url.authority, what).await;
        }
        let verify = !self.listed_insecure(&url.authority);
        let stream = tokio::time::timeout(
            CONNECT_TIMEOUT,
            self.tls
                .connect(stream, &url.host, &url.authority, verify, what),
        )
        .await
        .map_err(|_| {
            transport(format!(
                "the TLS handshake with {} timed out (does it speak TLS on that port?)",
                url.authority
            ))
        })??;
        request_over(stream, req, &url.authority, what).await
    }

    /// GETs a registry path, answering an auth challenge once and following
    /// redirects (without credentials to another scheme or host).
    async fn get(
        &mut self,
        path: &str,
        accept: Option<&str>,
        what: &str,
        stats: &mut PullStats,
    ) -> Result<Response<Incoming>, RegistryError> {
        let mut redirected: Option<Url> = None;
        let mut challenged = false;
        let mut redirects = 0;
        loop {
            // The registry's scheme may change with its first answer.
            let url = redirected.clone().unwrap_or_else(|| self.url(path));
            let same_origin = url.authority == self.base.authority && url.https == self.base.https;
            let auth = if same_origin { self.auth.clone() } else { None };
            let resp = self
                .send(&url, accept, auth.as_deref(), what, stats)
                .await?;
            let status = resp.status();
            if status == StatusCode::UNAUTHORIZED && same_origin && !challenged {
                challenged = true;
                let header = resp
                    .headers()
                    .get(hyper::header::WWW_AUTHENTICATE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned();
                self.auth = Some(self.answer(&header, stats).await?);
                continue;
            }
            if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
                let body = read_limited(resp, 64 << 10, what).await.unwrap_or_default();
                return Err(RegistryError::Unauthorized {
                    registry: self.registry.clone(),
                    reason: format!(
                        "{what}: {} ({}){}",
                        if self.credentials.is_some() {
                            "the registry refused the credentials"
                        } else {
                            "the registry needs credentials (fromImageRegistry username and \
                             password)"
                        },
                        status,
                        match error_message(&body) {
                            m if m.is_empty() => String::new(),
                            m => format!(": {m}"),
                        }
                    ),
                });
            }
            if status.is_redirection() {
                redirects += 1;
                let location = resp
                    .headers()
                    .get(hyper::header::LOCATION)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                let next = if location.starts_with('/') {
                    Some(Url {
                        path: location.to_owned(),
                        ..url.clone()
                    })
                } else {
                    Url::parse(location)
                };
                redirected = match next {
                    Some(u) if redirects <= 5 => Some(u),
                    _ => {
                        return Err(RegistryError::Transport {
                            what: what.to_owned(),
                            reason: format!("bad or too many redirects (to {location:?})"),
                        });
                    }
                };
                continue;
            }
            return Ok(resp);
        }
    }

    /// The `Authorization` value answering a challenge.
    async fn answer(
        &mut self,
        header: &str,
        stats: &mut PullStats,
    ) -> Result<String, RegistryError> {
        let registry = self.registry.clone();
        let unauthorized = |reason: String| RegistryError::Unauthorized {
            registry: registry.clone(),
            reason,
        };
        let basic = self.credentials.as_ref().map(|c| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD
                    .encode(format!("{}:{}", c.username, c.password))
            )
        });
        let challenge = parse_challenge(header);
        match challenge {
            Some(c) if c.scheme.eq_ignore_ascii_case("basic") => basic.ok_or_else(|| {
                unauthorized(
                    "the registry needs credentials (fromImageRegistry username and password)"
                        .into(),
                )
            }),
            Some(c) if c.scheme.eq_ignore_ascii_case("bearer") => {
                let realm = c
                    .param("realm")
                    .ok_or_else(|| unauthorized("a Bearer challenge without a realm".into()))?;
                let mut url = Url::parse(realm).ok_or_else(|| {
                    unauthorized(format!("the token realm {realm:?} is not an http(s) URL"))
                })?;
                let mut query = Vec::new();
                if let Some(s) = c.param("service") {
                    query.push(format!("service={}", query_escape(s)));
                }
                let scope = c
                    .param("scope")
                    .map(str::to_owned)
                    .unwrap_or_else(|| format!("repository:{}:pull", self.repository));
                query.push(format!("scope={}", query_escape(&scope)));
                url.path
                    .push(if url.path.contains('?') { '&' } else { '?' });
                url.path.push_str(&query.join("&"));
                let what = format!("getting a token from {}", url.authority);
                let resp = self
                    .send(
                        &url,
                        Some("application/json"),
                        basic.as_deref(),
                        &what,
                        stats,
                    )
                    .await?;
                let status = resp.status();
                let body = read_limited(resp, MAX_TOKEN, &what).await?;
                if !status.is_success() {
                    return Err(unauthorized(format!(
                        "{what}: {status}: {}{}",
                        error_message(&body),
                        if self.credentials.is_some() {
                            " (the registry refused the credentials)"
                        } else {
                            " (it may need credentials)"
                        }
                    )));
                }
                #[derive(Deserialize)]
                struct Token {
                    #[serde(default)]
                    token: Option<String>,
                    #[serde(default)]
                    access_token: Option<String>,
                }
                let t: Token = serde_json::from_slice(&body)
                    .map_err(|e| unauthorized(format!("{what}: not a token response: {e}")))?;
                let token = t
                    .token
                    .or(t.access_token)
                    .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_graphic()))
                    .ok_or_else(|| unauthorized(format!("{what}: no token in the answer")))?;
                Ok(format!("Bearer {token}"))
            }
            _ => Err(unauthorized(format!(
                "unsupported authentication challenge {header:?}"
            ))),
        }
    }

    /// The manifest named by `reference` (tag or digest): its bytes and the
    /// digest the registry gave for it.
    async fn manifest(
        &mut self,
        reference: &str,
        what: &str,
        stats: &mut PullStats,
    ) -> Result<(Vec<u8>, Option<String>), RegistryError> {
        let path = format!("/v2/{}/manifests/{reference}", self.repository);
        let accept = [OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST].join(", ");
        let resp = self
            .get(&path, Some(&accept), &format!("{what}: manifest"), stats)
            .await?;
        let status = resp.status();
        let digest = resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = read_limited(resp, MAX_MANIFEST, what).await?;
        if status == StatusCode::NOT_FOUND {
            return Err(RegistryError::NotFound {
                reference: what.to_owned(),
                detail: error_message(&body),
            });
        }
        if !status.is_success() {
            return Err(RegistryError::Http {
                what: format!("{what}: manifest"),
                status,
                message: error_message(&body),
            });
        }
        Ok((body, digest))
    }

    /// Streams blob `hex` into the store, checking size and digest; returns
    /// its size.
    async fn blob(
        &mut self,
        blobs: &Path,
        hex_digest: &str,
        size: Option<u64>,
        what: &str,
        stats: &mut PullStats,
    ) -> Result<u64, RegistryError> {
        let path = format!("/v2/{}/blobs/sha256:{hex_digest}", self.repository);
        let resp = self.get(&path, None, what, stats).await?;
        let status = resp.status();
        if !status.is_success() {
            let body = read_limited(resp, 64 << 10, what).await.unwrap_or_default();
            if status == StatusCode::NOT_FOUND {
                return Err(RegistryError::NotFound {
                    reference: what.to_owned(),
                    detail: error_message(&body),
                });
            }
            return Err(RegistryError::Http {
                what: what.to_owned(),
                status,
                message: error_message(&body),
            });
        }
        let tmp = temp_name(blobs, hex_digest);
        let result = stream_to(resp, &tmp, hex_digest, size, what).await;
        let result = match result {
            Ok(n) => tokio::fs::rename(&tmp, blobs.join(hex_digest))
                .await
                .map(|()| n)
                .map_err(io_err(format!("storing {what}"))),
            Err(e) => Err(e),
        };
        if result.is_err() {
            let _ = tokio::fs::remove_file(&tmp).await;
        }
        result
    }
}

/// Sends `req` over `io` (plain or TLS).
async fn request_over<T>(
    io: T,
    req: Request<Empty<Bytes>>,
    authority: &str,
    what: &str,
) -> Result<Exchange, RegistryError>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(TokioIo::new(io)).await {
        Ok(h) => h,
        Err(e) => return Ok(Err(e)),
    };
    tokio::spawn(async move {
        let _ = conn.await;
    });
    tokio::time::timeout(IDLE_TIMEOUT, sender.send_request(req))
        .await
        .map_err(|_| RegistryError::Transport {
            what: what.to_owned(),
            reason: format!("{authority} did not answer in time"),
        })
}

async fn stream_to(
    mut resp: Response<Incoming>,
    tmp: &Path,
    hex_digest: &str,
    size: Option<u64>,
    what: &str,
) -> Result<u64, RegistryError> {
    let mut file = tokio::fs::File::create(tmp)
        .await
        .map_err(io_err(format!("creating {}", tmp.display())))?;
    let mut hash = Sha256::new();
    let mut n: u64 = 0;
    while let Some(frame) = tokio::time::timeout(IDLE_TIMEOUT, resp.body_mut().frame())
        .await
        .map_err(|_| RegistryError::Transport {
            what: what.to_owned(),
            reason: "the download stalled".into(),
        })?
    {
        let frame = frame.map_err(|e| RegistryError::Transport {
            what: what.to_owned(),
            reason: format!("reading the body: {e}"),
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        n += data.len() as u64;
        if size.is_some_and(|s| n > s) {
            return Err(RegistryError::DigestMismatch {
                what: what.to_owned(),
                digest: format!("sha256:{hex_digest}"),
                detail: format!(
                    "more than the {} bytes the manifest says",
                    size.unwrap_or(0)
                ),
            });
        }
        hash.update(&data);
        file.write_all(&data)
            .await
            .map_err(io_err(format!("writing {}", tmp.display())))?;
    }
    if let Some(s) = size
        && n != s
    {
        return Err(RegistryError::DigestMismatch {
            what: what.to_owned(),
            digest: format!("sha256:{hex_digest}"),
            detail: format!("{n} bytes, the manifest says {s}"),
        });
    }
    let got = hex(&hash.finalize());
    if got != hex_digest {
        return Err(RegistryError::DigestMismatch {
            what: what.to_owned(),
            digest: format!("sha256:{hex_digest}"),
            detail: format!("got sha256:{got}"),
        });
    }
    file.sync_all()
        .await
        .map_err(io_err(format!("syncing {}", tmp.display())))?;
    Ok(n)
}

/// Reads a whole body of at most `max` bytes.
async fn read_limited(
    mut resp: Response<Incoming>,
    max: usize,
    what: &str,
) -> Result<Vec<u8>, RegistryError> {
    let mut out = Vec::new();
    while let Some(frame) = tokio::time::timeout(IDLE_TIMEOUT, resp.body_mut().frame())
        .await
        .map_err(|_| RegistryError::Transport {
            what: what.to_owned(),
            reason: "the answer stalled".into(),
        })?
    {
        let frame = frame.map_err(|e| RegistryError::Transport {
            what: what.to_owned(),
            reason: format!("reading the answer: {e}"),
        })?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > max {
                return Err(RegistryError::Transport {
                    what: what.to_owned(),
                    reason: format!("the answer is larger than {max} bytes"),
                });
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> Reference {
        Reference::parse(s).unwrap()
    }

    #[test]
    fn references_normalise_as_docker_does() {
        let a = r("alpine");
        assert_eq!(
            (a.registry.as_str(), a.repository.as_str(), a.tag.as_deref()),
            ("docker.io", "library/alpine", Some("latest"))
        );
        assert_eq!(r("user/img:1.2").repository, "user/img");
        assert_eq!(r("docker.io/python:3.13").repository, "library/python");
        assert_eq!(r("index.docker.io/x").registry, "docker.io");
        let b = r("127.0.0.1:5000/img:tag");
        assert_eq!(
            (b.registry.as_str(), b.repository.as_str(), b.tag.as_deref()),
            ("127.0.0.1:5000", "img", Some("tag"))
        );
        assert_eq!(b.api_host(), "127.0.0.1:5000");
        let d = format!("sha256:{}", "a".repeat(64));
        let c = r(&format!("localhost/a/b@{d}"));
        assert_eq!(
            (c.registry.as_str(), c.repository.as_str()),
            ("localhost", "a/b")
        );
        assert_eq!((c.tag, c.digest.as_deref()), (None, Some(d.as_str())));
        assert_eq!(r(&format!("x:v1@{d}")).tag.as_deref(), Some("v1"));
        assert_eq!(r("[::1]:5000/x").registry, "[::1]:5000");
        assert_eq!(
            r("reg.example:443/a/b/c:t").to_string(),
            "reg.example:443/a/b/c:t"
        );
        for bad in [
            "",
            "Alpine",
            "a b",
            "a//b",
            "-a",
            "a:",
            "a:-x",
            "a@sha256:abc",
            "a@md5:00",
            "host:port/x",
            "127.0.0.1:99999/x",
            "a/",
            "/a",
            "a_",
        ] {
            assert!(Reference::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn loopback_is_recognised() {
        for h in [
            "127.0.0.1:5000",
            "127.1.2.3",
            "localhost:80",
            "[::1]:5000",
            "::1",
        ] {
            assert!(is_loopback(h), "{h}");
        }
        for h in [
            "10.0.0.1:5000",
            "example.org",
            "localhost.example:5000",
            "[::2]:1",
        ] {
            assert!(!is_loopback(h), "{h}");
        }
    }

    #[test]
    fn challenges_parse() {
        let c = parse_challenge(
            r#"Bearer realm="http://127.0.0.1:1/token",service="reg, one",scope="repository:a/b:pull""#,
        )
        .unwrap();
        assert_eq!(c.scheme, "Bearer");
        assert_eq!(c.param("realm"), Some("http://127.0.0.1:1/token"));
        assert_eq!(c.param("service"), Some("reg, one"));
        assert_eq!(c.param("scope"), Some("repository:a/b:pull"));
        let c = parse_challenge(r#"Basic realm="Registry Realm""#).unwrap();
        assert_eq!(
            (c.scheme.as_str(), c.param("REALM")),
            ("Basic", Some("Registry Realm"))
        );
        assert_eq!(parse_challenge("Basic").unwrap().params, vec![]);
        let c = parse_challenge(r#"Bearer realm=plain, error="invalid_token""#).unwrap();
        assert_eq!(c.param("realm"), Some("plain"));
        assert_eq!(c.param("error"), Some("invalid_token"));
        assert!(parse_challenge(r#"Bearer realm="unterminated"#).is_none());
        assert!(parse_challenge("").is_none());
    }

    #[test]
    fn urls_and_queries() {
        let u = Url::parse("http://127.0.0.1:8080/token?x=1").unwrap();
        assert_eq!(
            (u.https, u.host.as_str(), u.port, u.path.as_str()),
            (false, "127.0.0.1", 8080, "/token?x=1")
        );
        assert_eq!(Url::parse("https://[::1]/t").unwrap().port, 443);
        assert_eq!(Url::parse("https://[::1]/t").unwrap().host, "::1");
        assert!(Url::parse("ftp://h/x").is_none());
        assert!(Url::parse("http://u:p@h/x").is_none());
        assert_eq!(
            query_escape("repository:a/b:pull"),
            "repository%3Aa%2Fb%3Apull"
        );
    }

    #[test]
    fn registry_errors_read_as_messages() {
        assert_eq!(
            error_message(
                br#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}"#
            ),
            "MANIFEST_UNKNOWN manifest unknown"
        );
        assert_eq!(error_message(b"plain\n"), "plain");
    }

    #[test]
    fn hosts_of_authorities() {
        assert_eq!(bare_host("reg.example:5000"), "reg.example");
        assert_eq!(bare_host("reg.example"), "reg.example");
        assert_eq!(bare_host("[::1]:5000"), "[::1]");
        assert_eq!(bare_host("[::1]"), "[::1]");
    }

    /// A client of `registry` whose connections go to 127.0.0.1 (a
    /// registry that is not loopback by name, reached on loopback).
    fn client_via_loopback(registry: &str, insecure: &[&str]) -> Client {
        let opts = PullOptions {
            insecure: insecure.iter().map(|s| s.to_string()).collect(),
            ..PullOptions::default()
        };
        let mut c = Client::new(&r(&format!("{registry}/img")), &opts).unwrap();
        c.connect_host = "127.0.0.1".into();
        c
    }

    /// A server answering every connection in plain HTTP with a 400.
    async fn plain_http_server() -> u16 {
        use tokio::io::AsyncReadExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                    .await;
            }
        });
        port
    }

    #[tokio::test]
    async fn tls_to_a_plain_http_registry_says_so() {
        let port = plain_http_server().await;
        let mut c = client_via_loopback(&format!("plain.test:{port}"), &[]);
        let err = c
            .get("/v2/", None, "probe", &mut PullStats::default())
            .await
            .unwrap_err();
        assert!(
            matches!(err, RegistryError::Tls { .. })
                && err.to_string().contains("does not speak TLS")
                && err.to_string().contains("SANDFORK_INSECURE_REGISTRIES"),
            "{err}"
        );
        // listed insecure, it is spoken to in plain HTTP
        let mut c = client_via_loopback(&format!("plain.test:{port}"), &["plain.test"]);
        let err = c
            .get("/v2/", None, "probe", &mut PullStats::default())
            .await
            .unwrap_err();
        assert!(
            matches!(err, RegistryError::Http { status, .. } if status == StatusCode::BAD_REQUEST),
            "{err}"
        );
    }

    #[tokio::test]
    async fn plain_http_goes_only_to_loopback_and_insecure_hosts() {
        let mut c = client_via_loopback("reg.test", &["insecure.test"]);
        let mut stats = PullStats::default();
        let url = Url::parse("http://cdn.test/blob").unwrap();
        let err = c
            .send(&url, None, None, "a blob", &mut stats)
            .await
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("refusing plain HTTP to cdn.test: only loopback registries"),
            "{err}"
        );
        assert_eq!(stats.requests, 0, "refused before connecting");
        assert!(c.listed_insecure("insecure.test:5000"));
        assert!(!c.listed_insecure("reg.test"));
    }

    #[test]
    fn credentials_come_from_a_docker_style_auth_file() {
        let dir = std::env::temp_dir().join(format!("sandfork-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("auth.json");
        let b64 = base64::engine::general_purpose::STANDARD.encode("u1:p:1");
        std::fs::write(
            &file,
            format!(
                r#"{{"auths": {{"127.0.0.1:5000": {{"auth": "{b64}"}},
                  "https://reg.test/v1/": {{"username": "u2", "password": "p2"}},
                  "https://index.docker.io/v1/": {{"username": "hub", "password": "h"}}}}}}"#
            ),
        )
        .unwrap();
        let get = |r: &str| {
            Credentials::from_file(&file, r)
                .unwrap()
                .map(|c| (c.username, c.password))
        };
        assert_eq!(get("127.0.0.1:5000"), Some(("u1".into(), "p:1".into())));
        assert_eq!(get("reg.test"), Some(("u2".into(), "p2".into())));
        assert_eq!(get(DEFAULT_REGISTRY), Some(("hub".into(), "h".into())));
        assert_eq!(get("127.0.0.1:5001"), None);
        std::fs::write(&file, r#"{"auths": {"r": {"auth": "!!"}}}"#).unwrap();
        let err = Credentials::from_file(&file, "r").unwrap_err();
        assert!(matches!(err, RegistryError::AuthFile { .. }), "{err}");
        assert!(Credentials::from_file(&dir.join("none"), "r").is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn credentials_do_not_print_the_password() {
        let c = Credentials {
            username: "u".into(),
            password: "secret".into(),
        };
        assert!(!format!("{c:?}").contains("secret"));
    }
}

//! E2B's template builds as the unmodified SDK's `Template.build` drives
//! them (`POST /v3/templates`, upload links, `POST /v2/.../builds/{id}`):
//! the steps run in a real sandbox of the base template, through the guest
//! agent's envd services, and the sandbox is then snapshotted into the
//! template, as `--from-sandbox` builds are. The build itself is one of
//! [`super::Templates`]' builds (record, log, status), source
//! [`super::BuildSource::Steps`].
//!
//! **Waiting builds** (requested, not started) are build records in the
//! store (status `waiting`), so they and finished builds outlive a restart;
//! a build a restart interrupts ends `error` ([`Templates::recover`]). Upload
//! links are in memory (30 minutes; the SDK asks for a new one per build).
//! Uploaded files are kept by their `filesHash` under `<data_dir>/e2b-files/`,
//! so a second build finds them `present`.
//!
//! **Names and tags**: an E2B template (its `templateID`) is every build of
//! one alias. Each ready build is its own template record (the first one's
//! id is the `templateID`); its names are, per tag it holds, `alias:tag`
//! and `templateID:tag`, bare for the `default` tag, so sandbox creates
//! resolve `alias`, `alias:tag` and `templateID` through the ordinary
//! template lookup, and `alias:buildID` (or `templateID:buildID`) through
//! its build record. A ready build takes its tags from the builds that held
//! them; a build left without any stays, reachable by its build id, until
//! its template is deleted, or until [`KEEP_UNTAGGED`] newer untagged
//! builds of it are kept and no sandbox uses it (then a create naming it
//! answers 404, replaced). A build of a template while another one builds
//! is refused with 409, as E2B refuses a build already in flight.
//!
//! **ENV** steps set the build guest agent's sandbox-wide environment
//! (envd's `/init`), so every later step's process starts with it (its
//! `/proc/self/environ` has it: Harbor records that), and the template keeps
//! it as its sandboxes' environment (their `/init` and `GET /envs`; a
//! create's own `envVars` win). E2B's SDK documents ENV as build-only; this
//! node does as Docker does with ENV, which is what a Dockerfile-built
//! template's user expects. A template whose ENV sets `PATH` also gets
//! `/etc/profile.d/00-sandfork-path.sh`: the SDK runs commands in a login
//! bash, whose `/etc/profile` resets `PATH`, and the drop-in takes back
//! the `PATH` the shell was started with (the template's, or a caller's
//! own per command).
//!
//! **Step cache**: after each step that changes the guest, the build
//! sandbox is snapshotted (a snapshot runs on: the guest pauses only while
//! its memory is frozen) and the snapshot recorded under the key of the
//! steps so far: a hash chained from the base template's identity over each
//! step as the SDK sends it (type, args, `filesHash`, which covers a COPY's
//! files' paths, modes and bytes). An ENV step changes only the build's
//! context, so its entry points at the previous step's snapshot. A build
//! starts from the snapshot of the longest cached prefix of its steps, with
//! the context (user, workdir, env) recorded with it, and runs only the
//! rest. Per step rather than per whole build, because builds that share a
//! prefix (a changed last step, an added step) then reuse it, as Docker's
//! layers are reused. `force` (`skip_cache`) on the build runs every step,
//! on a step runs that one and those after it; both still record their
//! snapshots. The cache index is in the store's meta table; at most
//! [`CACHE_ENTRIES`] entries, the least recently used go first.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use vmm_driver::agent_client::{AgentClient, AgentInit};

use super::boot::{Prepare, shell_quote};
use super::build::{BuildLog, Templates};
use crate::node::clock::now_ms;
use crate::node::ids;
use crate::node::net::SandboxNetwork;
use crate::node::sandbox::{CreateParams, SandboxError, SnapshotParams};
use crate::node::store::{BuildRecord, BuildStatus, E2bBuild, StoreError, TemplateRecord};

/// The image the SDK asks for when no base is named (`from_base_image`).
pub const E2B_BASE_IMAGE: &str = "e2bdev/base";
/// How long an upload link works.
pub const LINK_TTL: Duration = Duration::from_secs(30 * 60);
/// Largest upload (one COPY step's archive).
pub const MAX_UPLOAD: usize = 512 << 20;
/// Entries of the step cache kept.
pub const CACHE_ENTRIES: usize = 200;
/// The store's meta key of the step cache's index.
const CACHE_META: &str = "e2b.step-cache";
/// Changes when what a cached step means changes (so old entries miss).
const CACHE_KEY_VERSION: &str = "sandfork-e2b-step-cache/1";
/// Untagged builds of one E2B template a node keeps at least (see
/// [`Templates::drop_untagged`]).
pub const KEEP_UNTAGGED: usize = 8;
/// E2B's tag every build gets when it names none.
pub const DEFAULT_TAG: &str = "default";
/// The metadata key naming a build's sandbox's template.
pub const BUILD_SANDBOX_KEY: &str = "sandfork.templateBuild";
/// A build's sandbox lives at most this long.
const BUILD_SANDBOX_TIMEOUT: Duration = Duration::from_secs(2 * 3600);
/// One RUN step may take this long.
const RUN_TIMEOUT: Duration = Duration::from_secs(3600);
/// Where steps run when nothing set a WORKDIR or USER (the base template's
/// agent runs as root in `/`).
const DEFAULT_USER: &str = "root";
const DEFAULT_WORKDIR: &str = "/";

/// One build step, as the SDK sends it (`type`, `args`, `filesHash`).
/// Serialized only into the step cache's keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Step {
    Run {
        cmd: String,
        user: Option<String>,
    },
    Copy {
        src: String,
        dest: String,
        owner: Option<String>,
        mode: Option<u32>,
        files_hash: String,
    },
    Env(Vec<(String, String)>),
    Workdir(String),
    User {
        name: String,
        sudo: bool,
    },
}

/// What an E2B build runs: its base template and its steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepsPlan {
    /// The base template; unused (empty) when the base is an image to pull.
    pub base: String,
    pub steps: Vec<Step>,
    /// The build's `force` (`skip_cache`): no step comes from the cache.
    pub force: bool,
    /// The first step sent with `force`: it and the later ones run.
    pub forced_from: Option<usize>,
    /// `fromImage` from a registry: pulled and made a template first.
    pub pull: Option<ImagePull>,
}

/// An image to pull as a build's base, with its registry credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct ImagePull {
    pub image: String,
    pub username: Option<String>,
    pub password: Option<String>,
}

impl std::fmt::Debug for ImagePull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImagePull")
            .field("image", &self.image)
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

/// The base of an E2B build: a template, or an image to pull.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Base {
    Template(String),
    Image(ImagePull),
}

/// `fromImageRegistry`: `{type: "registry", username, password}`; the
/// `aws` and `gcp` types are refused.
fn registry_credentials(
    registry: Option<&serde_json::Value>,
) -> Result<(Option<String>, Option<String>), String> {
    let Some(r) = registry.filter(|r| !r.is_null()) else {
        return Ok((None, None));
    };
    let field = |k: &str| r.get(k).and_then(|v| v.as_str()).map(str::to_owned);
    match field("type").as_deref() {
        Some("registry") => {
            let (user, pass) = (field("username"), field("password"));
            if user.as_deref().is_none_or(str::is_empty) {
                return Err("fromImageRegistry of type registry needs a username".into());
            }
            Ok((user, pass))
        }
        Some(t @ ("aws" | "gcp")) => Err(format!(
            "fromImageRegistry type {t:?} is not supported by this node: pull from a registry \
             with a username and password (type \"registry\")"
        )),
        other => Err(format!(
            "fromImageRegistry type {other:?}: expected \"registry\" (with username and password)"
        )),
    }
}

impl StepsPlan {
    /// How many leading steps may come from the cache.
    pub fn cacheable(&self) -> usize {
        if self.force {
            0
        } else {
            self.forced_from.unwrap_or(self.steps.len())
        }
    }
}

/// A step as sent; unknown fields (`forceUpload`, ...) ignored.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RawStep {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub files_hash: Option<String>,
    #[serde(default)]
    pub force: bool,
}

/// `filesHash`: 64 lowercase hex digits (E2B's rule).
pub fn check_files_hash(hash: &str) -> Result<(), String> {
    if hash.len() == 64 && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(())
    } else {
        Err(format!(
            "filesHash {hash:?} must be 64 lowercase hexadecimal digits"
        ))
    }
}

/// A tag: lowercase letters, digits, `-`, `_`, `.` (E2B's rule), not a UUID.
pub fn check_tag(tag: &str) -> Result<(), String> {
    let ok = !tag.is_empty()
        && tag.len() <= 64
        && tag
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b));
    let uuid_like = tag.len() == 36
        && tag.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_hexdigit(),
        });
    if ok && !uuid_like {
        Ok(())
    } else {
        Err(format!(
            "tag {tag:?} must be lowercase letters, digits, '-', '_' or '.', and not a UUID"
        ))
    }
}

/// The names a template record holding `tags` of E2B template `template_id`
/// (alias `alias`) answers to: per tag `alias:tag` and `template_id:tag`,
/// the bare alias and id for the default tag.
pub fn tag_names(alias: &str, template_id: &str, tags: &[String]) -> Vec<String> {
    let mut names = Vec::new();
    for tag in tags {
        for base in [alias, template_id] {
            let n = if tag == DEFAULT_TAG {
                base.to_owned()
            } else {
                format!("{base}:{tag}")
            };
            if !names.contains(&n) {
                names.push(n);
            }
        }
    }
    names
}

/// A tag of an E2B template and the build it names. The node keeps no
/// history of a tag's moves: a tag has this one assignment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagAssignment {
    pub tag: String,
    /// A UUID named by the template, the tag and the build: the same
    /// assignment keeps its id.
    pub assignment_id: String,
    pub build_id: String,
    /// When the template record holding the tag was made ready.
    pub ready_at_ms: u64,
    pub build_started_at_ms: u64,
    pub build_finished_at_ms: Option<u64>,
}

fn assignment_id(template_id: &str, tag: &str, build_id: &str) -> String {
    let digest = Sha256::digest(format!("{template_id}\n{tag}\n{build_id}").as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&digest[..16]);
    crate::node::ids::uuid_text(&b)
}

/// The tag a template name stands for, if it is one of `template_id`'s or
/// `alias`'s (see [`tag_names`]).
pub fn tag_of<'a>(name: &'a str, alias: &str, template_id: &str) -> Option<&'a str> {
    if name == alias || name == template_id {
        return Some(DEFAULT_TAG);
    }
    let (base, tag) = name.split_once(':')?;
    (base == alias || base == template_id).then_some(tag)
}

/// The E2B template id a build belongs to.
pub fn e2b_template_id(b: &BuildRecord) -> &str {
    b.e2b
        .as_ref()
        .map_or(b.template_id.as_str(), |e| e.template_id.as_str())
}

/// The cache key of a base template: its id and when it was made (a base
/// rebuilt under the same id is another base).
pub fn base_key(base: &TemplateRecord) -> String {
    key_of_base(&base.id, base.created_at_ms)
}

fn key_of_base(id: &str, created_at_ms: u64) -> String {
    let mut h = Sha256::new();
    h.update(CACHE_KEY_VERSION);
    h.update([0]);
    h.update(id);
    h.update([0]);
    h.update(created_at_ms.to_le_bytes());
    ids::hex(&h.finalize())
}

/// The cache keys of every prefix of `steps` on the base keyed `base`:
/// `keys[i]` stands for the base and `steps[..=i]`.
pub fn prefix_keys(base: &str, steps: &[Step]) -> Vec<String> {
    let mut prev = base.to_owned();
    steps
        .iter()
        .map(|step| {
            let mut h = Sha256::new();
            h.update(&prev);
            h.update([0]);
            // Plain strings, numbers and options: always serializes.
            h.update(serde_json::to_vec(step).unwrap_or_default());
            prev = ids::hex(&h.finalize());
            prev.clone()
        })
        .collect()
}

/// The id of the node's base booted as `vcpus` and `mem_mib`.
fn sized_base_id(base: &TemplateRecord, vcpus: u8, mem_mib: u64) -> String {
    format!(
        "{}-{vcpus}c{mem_mib}m-{}",
        base.id,
        &key_of_base(&base.id, base.created_at_ms)[..12]
    )
}

/// Expands `$NAME`, `${NAME}`, `${NAME:-word}` and `${NAME:+word}` in an
/// ENV value as Docker does (`\$` is a literal `$`; unset names expand to
/// nothing; a `$` not followed by a name stays).
pub fn expand(value: &str, lookup: &dyn Fn(&str) -> Option<String>) -> String {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::new();
    let mut chars = value.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'$') => {
                chars.next();
                out.push('$');
            }
            '$' => match chars.peek().copied() {
                Some('{') => {
                    chars.next();
                    let mut inner = String::new();
                    let mut closed = false;
                    for c in chars.by_ref() {
                        if c == '}' {
                            closed = true;
                            break;
                        }
                        inner.push(c);
                    }
                    if !closed {
                        out.push_str("${");
                        out.push_str(&inner);
                        continue;
                    }
                    let (name, op) = match inner.find(":-").or_else(|| inner.find(":+")) {
                        Some(i) => (&inner[..i], Some((&inner[i..i + 2], &inner[i + 2..]))),
                        None => (inner.as_str(), None),
                    };
                    let val = lookup(name).filter(|v| !v.is_empty());
                    match op {
                        None => out.push_str(&val.unwrap_or_default()),
                        Some((":-", word)) => match val {
                            Some(v) => out.push_str(&v),
                            None => out.push_str(&expand(word, lookup)),
                        },
                        Some((_, word)) => {
                            if val.is_some() {
                                out.push_str(&expand(word, lookup));
                            }
                        }
                    }
                }
                Some(c) if is_name(c) && !c.is_ascii_digit() => {
                    let mut name = String::new();
                    while let Some(&c) = chars.peek() {
                        if !is_name(c) {
                            break;
                        }
                        name.push(c);
                        chars.next();
                    }
                    out.push_str(&lookup(&name).unwrap_or_default());
                }
                _ => out.push('$'),
            },
            c => out.push(c),
        }
    }
    out
}

fn check_user(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 32
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "user {name:?} must be lowercase letters, digits, '_' or '-', starting with a letter or '_'"
        ))
    }
}

/// `user` or `user:group`, each checked.
fn check_owner(owner: &str) -> Result<(), String> {
    let mut parts = owner.splitn(2, ':');
    for p in parts.by_ref() {
        check_user(p)?;
    }
    Ok(())
}

/// A relative COPY source: no absolute path, no `..`.
fn check_src(src: &str) -> Result<(), String> {
    if src.is_empty() || src.starts_with('/') || src.split('/').any(|c| c == "..") {
        return Err(format!(
            "COPY source {src:?} must be a path relative to the build context, without '..'"
        ));
    }
    if src.contains(['\n', '\0']) {
        return Err("COPY source has a newline or NUL".into());
    }
    Ok(())
}

/// Checks and converts the SDK's steps; `Err` names the 1-based step.
pub fn parse_steps(raw: Vec<RawStep>) -> Result<Vec<Step>, String> {
    raw.into_iter()
        .enumerate()
        .map(|(i, s)| parse_step(s).map_err(|e| format!("step {}: {e}", i + 1)))
        .collect()
}

fn parse_step(s: RawStep) -> Result<Step, String> {
    let args = s.args;
    let kind = s.kind.to_ascii_uppercase();
    match kind.as_str() {
        "RUN" => match args.as_slice() {
            [cmd] => Ok(Step::Run {
                cmd: cmd.clone(),
                user: None,
            }),
            [cmd, user] => {
                let user = (!user.is_empty()).then(|| user.clone());
                if let Some(u) = &user {
                    check_user(u)?;
                }
                Ok(Step::Run {
                    cmd: cmd.clone(),
                    user,
                })
            }
            _ => Err("RUN takes [command] or [command, user]".into()),
        },
        "COPY" | "ADD" => {
            let [src, dest, rest @ ..] = args.as_slice() else {
                return Err("COPY takes [src, dest, owner, mode]".into());
            };
            if rest.len() > 2 {
                return Err("COPY takes [src, dest, owner, mode]".into());
            }
            check_src(src)?;
            if dest.is_empty() || dest.contains(['\n', '\0']) {
                return Err("COPY needs a destination (without newline or NUL)".into());
            }
            let owner = rest.first().filter(|o| !o.is_empty()).cloned();
            if let Some(o) = &owner {
                check_owner(o)?;
            }
            let mode = match rest.get(1).map(String::as_str) {
                None | Some("") => None,
                Some(m) => Some(
                    u32::from_str_radix(m.trim_start_matches("0o"), 8)
                        .ok()
                        .filter(|m| *m <= 0o7777)
                        .ok_or_else(|| format!("COPY mode {m:?} is not an octal file mode"))?,
                ),
            };
            let files_hash = s
                .files_hash
                .ok_or("COPY needs its filesHash (upload the files first)")?;
            check_files_hash(&files_hash)?;
            Ok(Step::Copy {
                src: src.clone(),
                dest: dest.clone(),
                owner,
                mode,
                files_hash,
            })
        }
        "ENV" | "ARG" => {
            if args.is_empty() || !args.len().is_multiple_of(2) {
                return Err("ENV takes [key, value, key, value, ...]".into());
            }
            let pairs: Vec<(String, String)> = args
                .chunks(2)
                .map(|kv| (kv[0].clone(), kv[1].clone()))
                .collect();
            for (k, _) in &pairs {
                let ok = k
                    .bytes()
                    .next()
                    .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
                    && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
                if !ok {
                    return Err(format!("ENV name {k:?} is not a valid variable name"));
                }
            }
            Ok(Step::Env(pairs))
        }
        "WORKDIR" => match args.as_slice() {
            [dir] if !dir.is_empty() && !dir.contains(['\n', '\0']) => {
                Ok(Step::Workdir(dir.clone()))
            }
            _ => Err("WORKDIR takes [path]".into()),
        },
        "USER" => match args.as_slice() {
            [name] | [name, _] => {
                check_user(name)?;
                Ok(Step::User {
                    name: name.clone(),
                    sudo: args.get(1).is_some_and(|s| s == "true"),
                })
            }
            _ => Err("USER takes [name] or [name, \"true\"]".into()),
        },
        other => Err(format!(
            "unknown step type {other:?} (RUN, COPY, ENV, WORKDIR or USER)"
        )),
    }
}

/// The base an E2B build's `fromTemplate`/`fromImage` names. E2B's own
/// base image (the SDK's default) maps to the `base` template; other images
/// are pulled from their registries (`fromImageRegistry` credentials).
pub fn map_base(
    from_template: Option<&str>,
    from_image: Option<&str>,
    registry: Option<&serde_json::Value>,
) -> Result<Base, String> {
    let (username, password) = registry_credentials(registry)?;
    match (from_template, from_image) {
        (Some(_), Some(_)) => Err("give fromTemplate or fromImage, not both".into()),
        (Some(_), None) if username.is_some() => {
            Err("fromImageRegistry goes with fromImage, not fromTemplate".into())
        }
        (Some(t), None) if !t.is_empty() => Ok(Base::Template(t.to_owned())),
        (None, Some(img)) => {
            let repo = img.split([':', '@']).next().unwrap_or("");
            if username.is_none()
                && (repo == E2B_BASE_IMAGE || repo == format!("docker.io/{E2B_BASE_IMAGE}"))
            {
                return Ok(Base::Template(super::BASE.to_owned()));
            }
            template_build::registry::Reference::parse(img).map_err(|e| e.to_string())?;
            Ok(Base::Image(ImagePull {
                image: img.to_owned(),
                username,
                password,
            }))
        }
        _ => Err("fromTemplate or fromImage is required".into()),
    }
}

#[derive(Debug)]
struct Link {
    template_id: String,
    hash: String,
    expires: Instant,
}

/// Upload links and the uploaded files; the step cache's lock.
#[derive(Debug)]
pub struct E2bState {
    links: Mutex<HashMap<String, Link>>,
    files_dir: PathBuf,
    /// Held across a read, change and write of the cache index.
    cache: Mutex<()>,
    /// Held while a base of another machine size is looked up or made.
    sized: tokio::sync::Mutex<()>,
}

impl E2bState {
    pub fn new(data_dir: &Path) -> E2bState {
        E2bState {
            links: Mutex::new(HashMap::new()),
            files_dir: data_dir.join("e2b-files"),
            cache: Mutex::new(()),
            sized: tokio::sync::Mutex::new(()),
        }
    }

    pub fn file_path(&self, hash: &str) -> PathBuf {
        self.files_dir.join(format!("{hash}.tar"))
    }

    pub fn has_file(&self, hash: &str) -> bool {
        self.file_path(hash).is_file()
    }

    /// A new upload link's token for `hash` of `template_id`.
    pub fn new_link(&self, template_id: &str, hash: &str) -> Result<String, std::io::Error> {
        let token = ids::hex(&ids::random_bytes(24)?);
        let mut links = lock(&self.links);
        let now = Instant::now();
        links.retain(|_, l| l.expires > now);
        links.insert(
            token.clone(),
            Link {
                template_id: template_id.to_owned(),
                hash: hash.to_owned(),
                expires: now + LINK_TTL,
            },
        );
        Ok(token)
    }

    /// The `(template_id, hash)` a live link's token stands for.
    pub fn link(&self, token: &str) -> Option<(String, String)> {
        let links = lock(&self.links);
        links
            .get(token)
            .filter(|l| l.expires > Instant::now())
            .map(|l| (l.template_id.clone(), l.hash.clone()))
    }

    /// Stores an upload: a temporary file, synced, renamed into place.
    pub fn store_file(&self, hash: &str, bytes: &[u8]) -> Result<(), std::io::Error> {
        use std::io::Write;
        std::fs::create_dir_all(&self.files_dir)?;
        let tmp = self
            .files_dir
            .join(format!(".{hash}.{}.tmp", ids::hex(&ids::random_bytes(6)?)));
        let written = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, self.file_path(hash))?;
            super::sync_dir(&self.files_dir).map_err(std::io::Error::other)
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One cached prefix of steps: the snapshot of the build sandbox after it
/// and the context the next step runs in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheEntry {
    pub template: String,
    pub context: Context,
    pub used_ms: u64,
}

/// The cache index: entries by prefix key.
pub type CacheIndex = BTreeMap<String, CacheEntry>;

/// Drops the least recently used entries past `max`; returns the templates
/// no remaining entry points at (to delete), never `keep`.
pub fn evict(index: &mut CacheIndex, max: usize, keep: &str) -> Vec<String> {
    let mut dropped = HashSet::new();
    while index.len() > max {
        let Some(oldest) = index
            .iter()
            .min_by_key(|(k, e)| (e.used_ms, (*k).clone()))
            .map(|(k, _)| k.clone())
        else {
            break;
        };
        if let Some(e) = index.remove(&oldest) {
            dropped.insert(e.template);
        }
    }
    let mut out: Vec<String> = dropped
        .into_iter()
        .filter(|t| t != keep && !index.values().any(|e| &e.template == t))
        .collect();
    out.sort();
    out
}

/// Why a build failed, and at which E2B step (`"base"`, `"1"`..., `"finalize"`).
#[derive(Debug)]
pub struct Failure {
    pub step: Option<String>,
    pub message: String,
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure {
            step: None,
            message,
        }
    }
}

fn at(step: impl Into<String>) -> impl FnOnce(String) -> Failure {
    let step = step.into();
    move |message| Failure {
        step: Some(step),
        message,
    }
}

/// Where steps run: the state RUN, COPY, ENV, WORKDIR and USER change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Context {
    user: String,
    workdir: String,
    /// Set by ENV steps: the environment every later step's process
    /// starts with (the build agent's), kept by the template.
    env: BTreeMap<String, String>,
    /// The build guest's own environment (`PATH`, ...), for expanding ENV
    /// values only.
    #[serde(default)]
    guest_env: BTreeMap<String, String>,
    /// Whether a USER or WORKDIR step ran: the template's sandboxes then
    /// run commands as that user, in that directory, by default.
    #[serde(default)]
    user_set: bool,
    #[serde(default)]
    workdir_set: bool,
}

impl Context {
    fn new(guest_env: BTreeMap<String, String>) -> Context {
        Context {
            user: DEFAULT_USER.into(),
            workdir: DEFAULT_WORKDIR.into(),
            env: BTreeMap::new(),
            guest_env,
            user_set: false,
            workdir_set: false,
        }
    }

    /// `path` resolved against the working directory.
    fn resolve(&self, path: &str) -> String {
        if path.starts_with('/') {
            path.to_owned()
        } else {
            format!("{}/{path}", self.workdir.trim_end_matches('/'))
        }
    }

    /// `cmd` under `sh -c` in the working directory. The ENV steps' env is
    /// the agent's (see [`set_agent_env`]), so the shell starts with it.
    fn script(&self, cmd: &str) -> String {
        format!("cd {} || exit 1\n{cmd}", shell_quote(&self.workdir))
    }

    /// Applies an ENV step: every value expanded against the environment
    /// before the step (Docker's rule), then set.
    fn set_env(&mut self, pairs: &[(String, String)]) {
        let expanded: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| {
                let lookup = |name: &str| {
                    self.env
                        .get(name)
                        .or_else(|| self.guest_env.get(name))
                        .cloned()
                };
                (k.clone(), expand(v, &lookup))
            })
            .collect();
        self.env.extend(expanded);
    }
}

/// Makes `env` the build guest agent's sandbox-wide environment (envd's
/// `/init`, which adds to what it has): every process it starts from now
/// on starts with it, and the snapshots of the guest keep it.
async fn set_agent_env(root: &AgentClient, env: &BTreeMap<String, String>) -> Result<(), String> {
    let init = AgentInit {
        env_vars: Some(env.clone()),
        ..AgentInit::default()
    };
    root.init(&init)
        .await
        .map_err(|e| format!("setting the build's environment: {e}"))
}

/// Where a template whose ENV sets `PATH` puts [`PATH_DROPIN`].
pub const PATH_DROPIN_FILE: &str = "/etc/profile.d/00-sandfork-path.sh";

/// Sourced by login shells after `/etc/profile` set its own `PATH`: puts
/// back the `PATH` the shell was started with, from its environment as
/// exec'd (the template's ENV, or what the caller passed for the command).
pub const PATH_DROPIN: &str = r#"# Written by sandfork's template build: this template's ENV sets PATH, and
# /etc/profile has just replaced it. Use the PATH this shell was started with.
if [ -r "/proc/$$/environ" ]; then
    sandfork_start_path=$(tr '\000' '\n' <"/proc/$$/environ" | sed -n 's/^PATH=//p' | head -n 1)
    if [ -n "$sandfork_start_path" ]; then
        PATH=$sandfork_start_path
        export PATH
    fi
    unset sandfork_start_path
fi
"#;

/// `env -0` output as a map.
fn parse_env0(out: &str) -> BTreeMap<String, String> {
    out.split('\0')
        .filter_map(|kv| kv.split_once('='))
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// The shell script a COPY step runs as root: the archive extracted into a
/// temporary directory, the matches of `src` copied with Docker's rules
/// (a directory's contents merge into `dest`; a trailing `/` or an existing
/// directory takes files by name), each copied entry chowned and chmodded.
fn copy_script(archive: &str, src: &str, dest: &str, owner: &str, mode: Option<u32>) -> String {
    let chmod = match mode {
        Some(m) => format!("[ -L \"$1\" ] || chmod {m:o} \"$1\""),
        None => ":".into(),
    };
    format!(
        r#"set -e
archive={archive}; src={src}; dest={dest}; owner={owner}
fix() {{ chown -h "$owner" "$1"; {chmod}; }}
t=$(mktemp -d)
trap 'rm -rf "$t" "$archive"' EXIT
tar -xf "$archive" -C "$t"
cd "$t"
n=0
IFS=
for s in ./$src; do
  [ -e "$s" ] || [ -L "$s" ] || continue
  n=$((n+1))
  if [ -d "$s" ] && [ ! -L "$s" ]; then
    if [ ! -e "$dest" ]; then mkdir -p "$dest"; fix "$dest"; fi
    cp -a "$s"/. "$dest"/
    (cd "$s" && find . -mindepth 1) | while IFS= read -r r; do fix "$dest/$r"; done
  else
    case "$dest" in
      */) mkdir -p "$dest"; d="$dest$(basename "$s")" ;;
      *) if [ -d "$dest" ]; then d="$dest/$(basename "$s")"; else mkdir -p "$(dirname "$dest")"; d="$dest"; fi ;;
    esac
    cp -a "$s" "$d"
    fix "$d"
  fi
done
if [ "$n" = 0 ]; then echo "no files match $src in the upload" >&2; exit 1; fi
"#,
        archive = shell_quote(archive),
        src = shell_quote(src),
        dest = shell_quote(dest),
        owner = shell_quote(owner),
    )
}

/// The last lines of a command's output, for the error message.
fn tail(s: &str, lines: usize) -> String {
    let all: Vec<&str> = s.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

impl Templates {
    /// Creates a sandbox of the plan's base (or of the snapshot of its
    /// longest cached prefix of steps), runs the other steps and the start
    /// and ready commands in it, snapshots it as the template, kills it.
    /// Returns the template, named, for the caller to record with the build.
    pub(super) async fn build_from_steps(
        &self,
        record: &BuildRecord,
        plan: &StepsPlan,
        start_cmd: Option<String>,
        ready_cmd: Option<String>,
        log: &Arc<BuildLog>,
    ) -> Result<Option<TemplateRecord>, Failure> {
        let manager = self.manager();
        let base_name = match &plan.pull {
            Some(pull) => self.image_base(pull, log).await.map_err(at("base"))?,
            None => plan.base.clone(),
        };
        let mut base = manager
            .resolve_template(&base_name)
            .map_err(|e| e.to_string())
            .map_err(at("base"))?;
        if (base.vcpus, base.mem_mib) != (record.vcpus, record.mem_mib) {
            if base.id != manager.template().id {
                return Err(at("base")(format!(
                    "template {} has {} vCPUs and {} MiB: a build on it keeps them (give no \
                     cpuCount and memoryMB, or build on the base template)",
                    base_name, base.vcpus, base.mem_mib
                )));
            }
            base = self
                .sized_base(record.vcpus, record.mem_mib, log)
                .await
                .map_err(at("base"))?;
        }
        let keys = prefix_keys(&base_key(&base), &plan.steps);
        if plan.force {
            log.push("skip cache: every step runs");
        }
        let hit = self.cache_hit(&keys[..plan.cacheable()]);
        let (from, done, cx) = match hit {
            Some((n, e)) => {
                log.push(&format!("{n} of {} steps from the cache", plan.steps.len()));
                (e.template, n, Some(e.context))
            }
            None => (base.id.clone(), 0, None),
        };
        log.push(&format!("starting a sandbox of template {from}"));
        let created = manager
            .create_unannounced(CreateParams {
                template_id: from.clone(),
                timeout: BUILD_SANDBOX_TIMEOUT,
                metadata: BTreeMap::from([(
                    BUILD_SANDBOX_KEY.to_owned(),
                    record.template_id.clone(),
                )]),
                env_vars: BTreeMap::new(),
                secure: false,
                auto_pause: false,
                auto_pause_memory: false,
                network: SandboxNetwork::default(),
                // The team the template is built for (see `crate::node::tenants`).
                team: manager
                    .store()
                    .owner(&crate::node::tenants::template_owner_key(e2b_template_id(
                        record,
                    )))
                    .ok()
                    .flatten(),
                volume_mounts: Vec::new(),
                forked_from: None,
            })
            .await
            .map_err(|e| e.to_string())
            .map_err(at("base"))?;
        let sandbox = created.id.clone();
        log.push(&format!("build sandbox {sandbox}"));
        // Its steps reach its agent directly, not through the proxy: in use
        // for the memory pressure monitor all along.
        let _in_use = manager.in_use(&sandbox);
        let run = StepsRun {
            sandbox: &sandbox,
            keys: &keys,
            done,
            from,
        };
        let result = self
            .run_steps(run, cx, plan, start_cmd, ready_cmd, record, log)
            .await;
        if result.is_ok() {
            crate::node::crash::point("template.snapshotted");
        }
        if let Err(e) = manager.kill_unannounced(&sandbox).await
            && !matches!(e, SandboxError::NotFound(_))
        {
            tracing::warn!(
                "template {}: killing build sandbox {sandbox}: {e}",
                record.template_id
            );
        }
        result.map(Some)
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_steps(
        &self,
        run: StepsRun<'_>,
        cx: Option<Context>,
        plan: &StepsPlan,
        start_cmd: Option<String>,
        ready_cmd: Option<String>,
        record: &BuildRecord,
        log: &Arc<BuildLog>,
    ) -> Result<TemplateRecord, Failure> {
        let manager = self.manager();
        let sandbox = run.sandbox;
        let vsock = manager
            .vsock_path(sandbox)
            .ok_or_else(|| format!("build sandbox {sandbox} is not running"))
            .map_err(at("base"))?;
        let root = AgentClient::new(&vsock).with_timeout(RUN_TIMEOUT);
        let mut cx = match cx {
            Some(cx) => cx,
            None => {
                let env = root
                    .run_argv("/usr/bin/env", &["-0"])
                    .await
                    .ok()
                    .filter(|o| o.exit_code == 0)
                    .map(|o| parse_env0(&o.stdout))
                    .unwrap_or_default();
                Context::new(env)
            }
        };
        // A cached snapshot's agent may predate its ENV (or hold less).
        if !cx.env.is_empty() {
            set_agent_env(&root, &cx.env).await.map_err(at("base"))?;
        }
        let total = plan.steps.len();
        let mut last = run.from.clone();
        for (i, step) in plan.steps.iter().enumerate() {
            let n = (i + 1).to_string();
            if i < run.done {
                log.push(&format!("[{n}/{total}] CACHED {}", describe(step)));
                continue;
            }
            log.push(&format!("[{n}/{total}] {}", describe(step)));
            self.run_step(&root, &mut cx, step, log)
                .await
                .map_err(|e| format!("step {n} ({}): {e}", describe(step)))
                .map_err(at(n))?;
            // The cache's checkpoint: a failed one costs only reuse.
            if !matches!(step, Step::Env(_)) {
                match manager.snapshot(sandbox, SnapshotParams::default()).await {
                    Ok(t) => last = t.id,
                    Err(e) => {
                        log.push(&format!("step {}: not cached ({e})", i + 1));
                        continue;
                    }
                }
            }
            self.cache_put(&run.keys[i], &last, &cx).await;
        }
        if cx.env.contains_key("PATH") {
            let script = format!(
                "mkdir -p /etc/profile.d && printf '%s' {} > {PATH_DROPIN_FILE} && chmod 0644 \
                 {PATH_DROPIN_FILE}",
                shell_quote(PATH_DROPIN)
            );
            let out = root
                .run_argv("/bin/sh", &["-c", &script])
                .await
                .map_err(|e| e.to_string())
                .map_err(at("finalize"))?;
            if out.exit_code != 0 {
                return Err(at("finalize")(format!(
                    "writing {PATH_DROPIN_FILE}: {}",
                    out.stderr.trim()
                )));
            }
        }
        // The template's sandboxes run commands as the last USER, in the
        // last WORKDIR (E2B's defaults), and start there.
        if cx.user_set || cx.workdir_set {
            let init = AgentInit {
                default_user: cx.user_set.then(|| cx.user.clone()),
                default_workdir: cx.workdir_set.then(|| cx.workdir.clone()),
                ..AgentInit::default()
            };
            root.init(&init)
                .await
                .map_err(|e| format!("setting the default user and workdir: {e}"))
                .map_err(at("finalize"))?;
        }
        let prepare = Prepare {
            env_vars: cx.env.clone(),
            workdir: Some(cx.workdir.clone()),
            start_cmd,
            ready_cmd,
        };
        let push = |line: &str| log.push(line);
        prepare
            .run(&root, &push)
            .await
            .map_err(|e| e.to_string())
            .map_err(at("finalize"))?;
        log.push(&format!("snapshotting build sandbox {sandbox}"));
        let mut template = manager
            .snapshot(
                sandbox,
                SnapshotParams {
                    name: None,
                    id: Some(record.template_id.clone()),
                    filesystem_only: false,
                },
            )
            .await
            .map_err(|e| e.to_string())
            .map_err(at("finalize"))?;
        template.names = self.names_of(record);
        // Its sandboxes' environment (their `/init`, a cold boot's too),
        // over the base's.
        template.env_vars.extend(cx.env);
        Ok(template)
    }

    async fn run_step(
        &self,
        root: &AgentClient,
        cx: &mut Context,
        step: &Step,
        log: &Arc<BuildLog>,
    ) -> Result<(), String> {
        let sh = |agent: &AgentClient, script: String| {
            let agent = agent.clone();
            async move {
                agent
                    .run_argv("/bin/sh", &["-c", &script])
                    .await
                    .map_err(|e| e.to_string())
            }
        };
        let checked = |out: vmm_driver::agent_client::CommandOutput| {
            for l in out.stdout.lines().chain(out.stderr.lines()) {
                log.push(l);
            }
            if out.exit_code == 0 {
                Ok(())
            } else {
                Err(format!(
                    "exited {}: {}",
                    out.exit_code,
                    tail(&out.stderr, 5).trim()
                ))
            }
        };
        match step {
            Step::Run { cmd, user } => {
                let user = user.as_deref().unwrap_or(&cx.user);
                let agent = root.clone().with_user(user);
                checked(sh(&agent, cx.script(cmd)).await?)
            }
            Step::Copy {
                src,
                dest,
                owner,
                mode,
                files_hash,
            } => {
                let path = self.e2b().file_path(files_hash);
                let bytes = tokio::fs::read(&path)
                    .await
                    .map_err(|e| format!("the uploaded files {}: {e}", path.display()))?;
                let archive = format!("/tmp/.sandfork-copy-{files_hash}.tar");
                root.write_file(&archive, bytes)
                    .await
                    .map_err(|e| e.to_string())?;
                let owner = match owner {
                    Some(o) if o.contains(':') => o.clone(),
                    Some(o) => format!("{o}:{o}"),
                    None => format!("{0}:{0}", cx.user),
                };
                let dest = cx.resolve(dest);
                checked(sh(root, copy_script(&archive, src, &dest, &owner, *mode)).await?)
            }
            Step::Env(pairs) => {
                cx.set_env(pairs);
                set_agent_env(root, &cx.env).await
            }
            Step::Workdir(dir) => {
                let dir = cx.resolve(dir);
                let u = shell_quote(&cx.user);
                let d = shell_quote(&dir);
                checked(
                    sh(
                        root,
                        format!("[ -d {d} ] || {{ mkdir -p {d} && chown {u}:{u} {d}; }}"),
                    )
                    .await?,
                )?;
                cx.workdir = dir;
                cx.workdir_set = true;
                Ok(())
            }
            Step::User { name, sudo } => {
                let u = shell_quote(name);
                let mut script = format!(
                    "id -u {u} >/dev/null 2>&1 || useradd --create-home --shell /bin/bash {u}"
                );
                if *sudo {
                    script.push_str(&format!(
                        " && mkdir -p /etc/sudoers.d && echo {} > /etc/sudoers.d/{name}",
                        shell_quote(&format!("{name} ALL=(ALL:ALL) NOPASSWD: ALL"))
                    ));
                }
                checked(sh(root, script).await?)?;
                cx.user = name.clone();
                cx.user_set = true;
                Ok(())
            }
        }
    }

    /// The node's base image booted with another machine (E2B's `cpuCount`
    /// and `memoryMB`; a restored snapshot keeps its machine): a template of
    /// its own, made once per size and base, kept out of listings.
    async fn sized_base(
        &self,
        vcpus: u8,
        mem_mib: u64,
        log: &Arc<BuildLog>,
    ) -> Result<TemplateRecord, String> {
        let manager = self.manager();
        let base = manager.template().clone();
        let id = sized_base_id(&base, vcpus, mem_mib);
        let _g = self.e2b().sized.lock().await;
        // Recorded only after its boot: the collector keeps off meanwhile.
        let _writing = manager.writing_template(&id);
        let store = manager.store();
        if let Some(t) = store.template(&id).map_err(|e| e.to_string())?
            && t.files_whole()
        {
            return Ok(t);
        }
        log.push(&format!(
            "booting the base image with {vcpus} vCPUs and {mem_mib} MiB (once per size)"
        ));
        let spec = super::BootSpec {
            rootfs: manager.config().rootfs.clone(),
            vcpus,
            mem_mib,
            prepare: Prepare::default(),
        };
        let push = |line: &str| log.push(line);
        let t = super::boot::build_on(manager, &id, &spec, &push)
            .await
            .map_err(|e| e.to_string())?;
        store.put_template(&t).map_err(|e| e.to_string())?;
        Ok(t)
    }

    /// The step cache's index (empty when unreadable: a cache miss).
    fn cache_index(&self) -> CacheIndex {
        match self.manager().store().meta(CACHE_META) {
            Ok(Some(bytes)) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                tracing::warn!("the step cache's index is unreadable ({e}): starting afresh");
                CacheIndex::new()
            }),
            Ok(None) => CacheIndex::new(),
            Err(e) => {
                tracing::warn!("reading the step cache: {e}");
                CacheIndex::new()
            }
        }
    }

    fn save_cache_index(&self, index: &CacheIndex) -> Result<(), StoreError> {
        // Strings and numbers: always serializes.
        let bytes = serde_json::to_vec(index).unwrap_or_default();
        self.manager().store().put_meta(CACHE_META, &bytes)
    }

    /// The templates the step cache holds and the bases of other sizes
    /// (kept out of listings).
    pub fn cache_templates(&self) -> HashSet<String> {
        let mut out: HashSet<String> = self
            .cache_index()
            .into_values()
            .map(|e| e.template)
            .filter(|t| t != crate::node::ids::BASE_TEMPLATE)
            .collect();
        let prefix = format!("{}-", crate::node::ids::BASE_TEMPLATE);
        for t in self.manager().store().templates().into_iter().flatten() {
            if t.id.starts_with(&prefix) && t.names.is_empty() && !t.is_snapshot() {
                out.insert(t.id);
            }
        }
        out
    }

    /// The longest of `keys`' prefixes cached with its snapshot still
    /// there: how many steps it covers and its entry (marked used).
    fn cache_hit(&self, keys: &[String]) -> Option<(usize, CacheEntry)> {
        let _g = lock(&self.e2b().cache);
        let mut index = self.cache_index();
        let store = self.manager().store();
        let found = keys.iter().enumerate().rev().find_map(|(i, k)| {
            let e = index.get(k)?;
            let there = e.template == self.manager().template().id
                || store.template(&e.template).ok().flatten().is_some();
            there.then(|| (i + 1, k.clone()))
        })?;
        let entry = index.get_mut(&found.1)?;
        entry.used_ms = now_ms();
        let entry = entry.clone();
        if let Err(e) = self.save_cache_index(&index) {
            tracing::warn!("updating the step cache: {e}");
        }
        Some((found.0, entry))
    }

    /// Records `key` as the snapshot `template` with the context `cx`; the
    /// least recently used entries past [`CACHE_ENTRIES`] go, and their
    /// snapshots with them.
    async fn cache_put(&self, key: &str, template: &str, cx: &Context) {
        let unused = {
            let _g = lock(&self.e2b().cache);
            let mut index = self.cache_index();
            index.insert(
                key.to_owned(),
                CacheEntry {
                    template: template.to_owned(),
                    context: cx.clone(),
                    used_ms: now_ms(),
                },
            );
            let unused = evict(&mut index, CACHE_ENTRIES, &self.manager().template().id);
            if let Err(e) = self.save_cache_index(&index) {
                tracing::warn!("recording a step in the cache: {e}");
                return;
            }
            unused
        };
        for t in unused {
            if let Err(e) = self.manager().delete_template(&t).await {
                tracing::warn!("step cache: deleting snapshot {t}: {e}");
            }
        }
    }

    /// The names a ready build's template takes: E2B's per tag, else its name.
    pub(super) fn names_of(&self, record: &BuildRecord) -> Vec<String> {
        match &record.e2b {
            Some(e) => tag_names(&record.name, &e.template_id, &e.tags),
            None => vec![record.name.clone()],
        }
    }

    /// Takes `template`'s names from every other template that has them.
    /// Returns the E2B builds left without a name (for
    /// [`Templates::drop_untagged`] once `template` is recorded).
    pub(super) fn take_names(&self, template: &TemplateRecord) -> Result<Vec<String>, StoreError> {
        let store = self.manager().store();
        let mut emptied = Vec::new();
        for mut t in store.templates()? {
            if t.id == template.id || !t.names.iter().any(|n| template.names.contains(n)) {
                continue;
            }
            t.names.retain(|n| !template.names.contains(n));
            store.put_template(&t)?;
            let e2b = store.build(&t.id)?.is_some_and(|b| b.e2b.is_some());
            if t.names.is_empty() && e2b {
                emptied.push(t.id);
            }
        }
        Ok(emptied)
    }

    /// Builds `ids` lost their last tag. They stay, as E2B keeps every
    /// build until its template is deleted: a client may hold one by its
    /// build id (Harbor creates by `<name>:<buildID>`, and a rebuild under
    /// the same tag must not pull it away). Only past [`KEEP_UNTAGGED`]
    /// untagged builds of one template do the oldest that no sandbox uses
    /// go; their build records stay, so a create naming one answers that it
    /// was replaced rather than that it never was.
    pub(super) async fn drop_untagged(&self, ids: Vec<String>) {
        let store = self.manager().store();
        let mut templates: Vec<String> = Vec::new();
        for id in &ids {
            if let Ok(Some(b)) = store.build(id) {
                let t = e2b_template_id(&b).to_owned();
                if !templates.contains(&t) {
                    templates.push(t);
                }
            }
        }
        let mut deleted = Vec::new();
        for t in templates {
            let old = match self.untagged_past_the_cap(&t) {
                Ok(old) => old,
                Err(e) => {
                    tracing::warn!("template {t}: listing its untagged builds: {e}");
                    continue;
                }
            };
            for mut b in old {
                match self.manager().delete_template(&b.template_id).await {
                    Ok(_) | Err(SandboxError::TemplateNotFound(_)) => {
                        b.reason = Some(format!(
                            "replaced by newer builds of {} (a node keeps the {KEEP_UNTAGGED} \
                             newest untagged builds of a template)",
                            b.name
                        ));
                        if let Err(e) = store.put_build(&b) {
                            tracing::warn!(
                                "template {}: recording its removal: {e}",
                                b.template_id
                            );
                        }
                        deleted.push(b.template_id);
                    }
                    Err(e) => tracing::warn!(
                        "template {}: deleting an old untagged build: {e}",
                        b.template_id
                    ),
                }
            }
        }
        self.told_deleted(&deleted).await;
    }

    /// The ready builds of E2B template `template_id` that no tag names,
    /// past the newest [`KEEP_UNTAGGED`], that no sandbox uses.
    fn untagged_past_the_cap(&self, template_id: &str) -> Result<Vec<BuildRecord>, SandboxError> {
        let store = self.manager().store();
        let untagged_records: HashSet<String> = store
            .templates()?
            .into_iter()
            .filter(|t| t.names.is_empty())
            .map(|t| t.id)
            .collect();
        let used: HashSet<String> = store
            .sandboxes()?
            .into_iter()
            .flat_map(|s| s.uses_snapshots.into_iter().chain([s.template_id]))
            .collect();
        let mut untagged: Vec<BuildRecord> = store
            .builds()?
            .into_iter()
            .filter(|b| {
                b.status == BuildStatus::Ready
                    && e2b_template_id(b) == template_id
                    && untagged_records.contains(&b.template_id)
            })
            .collect();
        untagged.sort_by_key(|b| std::cmp::Reverse(b.started_at_ms));
        Ok(untagged
            .into_iter()
            .skip(KEEP_UNTAGGED)
            .filter(|b| !used.contains(&b.template_id))
            .collect())
    }

    /// The E2B template `alias` names (its newest build's), if any.
    pub fn e2b_template_of_alias(&self, alias: &str) -> Result<Option<String>, SandboxError> {
        let store = self.manager().store();
        let newest = store
            .builds()?
            .into_iter()
            .filter(|b| b.name == alias || e2b_template_id(b) == alias)
            .max_by_key(|b| b.started_at_ms);
        if let Some(b) = newest {
            return Ok(Some(e2b_template_id(&b).to_owned()));
        }
        match self.manager().resolve_template(alias) {
            Ok(t) => Ok(Some(
                store
                    .build(&t.id)?
                    .map_or(t.id, |b| e2b_template_id(&b).to_owned()),
            )),
            Err(SandboxError::TemplateNotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Records a requested E2B build (`waiting`) of `alias`: a build of the
    /// alias's template when it has one, else of a new template.
    pub fn e2b_request(
        &self,
        alias: &str,
        tags: Vec<String>,
        vcpus: u8,
        mem_mib: u64,
    ) -> Result<BuildRecord, SandboxError> {
        let base = crate::node::ids::BASE_TEMPLATE;
        let existing = self.e2b_template_of_alias(alias)?;
        if existing.as_deref() == Some(base) || alias == base {
            return Err(SandboxError::Invalid(format!(
                "{alias} is the node's built-in template and is not rebuilt"
            )));
        }
        if let Some(t) = &existing
            && let Some(b) = self.e2b_in_flight(t)?
        {
            return Err(in_flight(alias, &b));
        }
        let store = self.manager().store();
        let new_id = || {
            ids::sandbox_id().map_err(|source| SandboxError::Io {
                what: "generating a template id".into(),
                source,
            })
        };
        let template_id = match existing {
            Some(t) => t,
            None => new_id()?,
        };
        // The first build's record is the template's id; later ones their own.
        let record_id =
            if store.template(&template_id)?.is_none() && store.build(&template_id)?.is_none() {
                template_id.clone()
            } else {
                new_id()?
            };
        let record = BuildRecord {
            template_id: record_id,
            build_id: super::build::uuid()?,
            name: alias.to_owned(),
            source: "E2B build steps".into(),
            vcpus,
            mem_mib,
            status: BuildStatus::Waiting,
            reason: None,
            started_at_ms: now_ms(),
            finished_at_ms: None,
            log: Vec::new(),
            reason_step: None,
            e2b: Some(E2bBuild { template_id, tags }),
        };
        store.put_build(&record)?;
        Ok(record)
    }

    /// Build `build_id` of template `id` (E2B's template id, a build's own
    /// id, or an alias).
    pub fn e2b_build(&self, id: &str, build_id: &str) -> Result<Option<BuildRecord>, SandboxError> {
        Ok(self.manager().store().builds()?.into_iter().find(|b| {
            b.build_id == build_id
                && (e2b_template_id(b) == id || b.template_id == id || b.name == id)
        }))
    }

    /// The build of E2B template `template_id` under way, if one is.
    pub fn e2b_in_flight(&self, template_id: &str) -> Result<Option<BuildRecord>, SandboxError> {
        Ok(self
            .manager()
            .store()
            .builds()?
            .into_iter()
            .find(|b| b.status == BuildStatus::Building && e2b_template_id(b) == template_id))
    }

    /// Whether E2B template `id` has a build waiting for its start.
    pub fn e2b_waiting(&self, id: &str) -> Result<bool, SandboxError> {
        Ok(self
            .manager()
            .store()
            .builds()?
            .iter()
            .any(|b| b.status == BuildStatus::Waiting && e2b_template_id(b) == id))
    }

    /// The template `target` (`name`, `name:tag`, an id) resolves to, as E2B
    /// names it: `(alias, templateID, record)`.
    fn e2b_target(&self, target: &str) -> Result<(String, String, TemplateRecord), SandboxError> {
        let t = self.manager().resolve_template(target)?;
        if t.id == self.manager().template().id {
            return Err(SandboxError::Invalid(format!(
                "{target} is the node's built-in template: it has no tags"
            )));
        }
        let build = self.manager().store().build(&t.id)?;
        let (alias, template_id) = match &build {
            Some(b) => (b.name.clone(), e2b_template_id(b).to_owned()),
            None => {
                let alias = t.names.first().cloned().unwrap_or_else(|| t.id.clone());
                (alias, t.id.clone())
            }
        };
        Ok((alias, template_id, t))
    }

    /// `POST /templates/tags`: gives `target`'s build the `tags` (taken from
    /// the builds that had them). Returns its build id.
    pub async fn assign_tags(&self, target: &str, tags: &[String]) -> Result<String, SandboxError> {
        let (alias, template_id, mut t) = self.e2b_target(target)?;
        let store = self.manager().store();
        for n in tag_names(&alias, &template_id, tags) {
            if !t.names.contains(&n) {
                t.names.push(n);
            }
        }
        let emptied = self.take_names(&t)?;
        store.put_template(&t)?;
        self.drop_untagged(emptied).await;
        // Stored again: the cluster's names follow.
        self.made_ready(&t.id).await;
        Ok(store
            .build(&t.id)?
            .map(|b| b.build_id)
            .unwrap_or_else(|| t.id.clone()))
    }

    /// `DELETE /templates/tags`: `name`'s template loses `tags` (its builds
    /// stay, reachable by their other tags).
    pub async fn remove_tags(&self, name: &str, tags: &[String]) -> Result<(), SandboxError> {
        let template_id = self
            .e2b_template_of_alias(name)?
            .ok_or_else(|| SandboxError::TemplateNotFound(name.to_owned()))?;
        let store = self.manager().store();
        let alias = store
            .builds()?
            .into_iter()
            .find(|b| e2b_template_id(b) == template_id)
            .map_or_else(|| name.to_owned(), |b| b.name);
        let gone = tag_names(&alias, &template_id, tags);
        for mut t in store.templates()? {
            if t.names.iter().any(|n| gone.contains(n)) {
                t.names.retain(|n| !gone.contains(n));
                store.put_template(&t)?;
                // Stored again: the cluster lets go of the names too.
                self.made_ready(&t.id).await;
            }
        }
        Ok(())
    }

    /// The tags of E2B template `id` (by id or alias), each with the build
    /// it names now, by tag.
    pub fn tags_of(&self, id: &str) -> Result<Vec<TagAssignment>, SandboxError> {
        let template_id = self
            .e2b_template_of_alias(id)?
            .ok_or_else(|| SandboxError::TemplateNotFound(id.to_owned()))?;
        let store = self.manager().store();
        let builds: HashMap<String, BuildRecord> = store
            .builds()?
            .into_iter()
            .map(|b| (b.template_id.clone(), b))
            .collect();
        let alias = builds
            .values()
            .find(|b| e2b_template_id(b) == template_id)
            .map_or_else(|| id.to_owned(), |b| b.name.clone());
        let mut out: Vec<TagAssignment> = Vec::new();
        for t in store.templates()? {
            let build = builds.get(&t.id);
            for n in &t.names {
                if let Some(tag) = tag_of(n, &alias, &template_id)
                    && !out.iter().any(|o| o.tag == tag)
                {
                    let build_id = build.map_or_else(|| t.id.clone(), |b| b.build_id.clone());
                    out.push(TagAssignment {
                        tag: tag.to_owned(),
                        assignment_id: assignment_id(&template_id, tag, &build_id),
                        build_id,
                        ready_at_ms: t.created_at_ms,
                        build_started_at_ms: build.map_or(t.created_at_ms, |b| b.started_at_ms),
                        build_finished_at_ms: build
                            .map_or(Some(t.created_at_ms), |b| b.finished_at_ms),
                    });
                }
            }
        }
        out.sort_by(|a, b| a.tag.cmp(&b.tag));
        Ok(out)
    }

    /// Every template record of E2B template `id` (by id or alias).
    pub fn e2b_records(&self, id: &str) -> Result<Vec<String>, SandboxError> {
        let Some(template_id) = self.e2b_template_of_alias(id)? else {
            return Ok(Vec::new());
        };
        let store = self.manager().store();
        let mut out: Vec<String> = store
            .builds()?
            .into_iter()
            .filter(|b| e2b_template_id(b) == template_id)
            .map(|b| b.template_id)
            .collect();
        if !out.contains(&template_id) {
            out.push(template_id);
        }
        Ok(out)
    }
}

/// The 409 for a build of `alias` while its build `b` runs (E2B answers a
/// build already in flight with 409; Harbor then waits for its tag).
pub(super) fn in_flight(alias: &str, b: &BuildRecord) -> SandboxError {
    SandboxError::InUse {
        id: alias.to_owned(),
        users: format!(
            "its build {}, still running (one build of a template at a time)",
            b.build_id
        ),
    }
}

/// Where a build's steps run and what the cache gave it.
struct StepsRun<'a> {
    sandbox: &'a str,
    /// The cache key after each step.
    keys: &'a [String],
    /// Steps the cache covers.
    done: usize,
    /// The template the sandbox was made from.
    from: String,
}

/// A step as the build log shows it.
pub fn describe(step: &Step) -> String {
    match step {
        Step::Run { cmd, user: None } => format!("RUN {cmd}"),
        Step::Run { cmd, user: Some(u) } => format!("RUN (as {u}) {cmd}"),
        Step::Copy { src, dest, .. } => format!("COPY {src} {dest}"),
        Step::Env(pairs) => format!(
            "ENV {}",
            pairs
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" ")
        ),
        Step::Workdir(d) => format!("WORKDIR {d}"),
        Step::User { name, .. } => format!("USER {name}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(kind: &str, args: &[&str], hash: Option<&str>) -> RawStep {
        RawStep {
            kind: kind.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            files_hash: hash.map(str::to_owned),
            force: false,
        }
    }

    const H: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn the_sdk_steps_parse() {
        let steps = parse_steps(vec![
            raw("RUN", &["echo hi"], None),
            raw("RUN", &["id", "user"], None),
            raw("COPY", &["files/", "/app/", "user", "0755"], Some(H)),
            raw("COPY", &["a.txt", "b", "", ""], Some(H)),
            raw("ENV", &["A", "1", "B", "two"], None),
            raw("WORKDIR", &["/app"], None),
            raw("USER", &["alice", "true"], None),
        ])
        .unwrap();
        assert_eq!(
            steps[1],
            Step::Run {
                cmd: "id".into(),
                user: Some("user".into())
            }
        );
        assert_eq!(
            steps[2],
            Step::Copy {
                src: "files/".into(),
                dest: "/app/".into(),
                owner: Some("user".into()),
                mode: Some(0o755),
                files_hash: H.into()
            }
        );
        assert!(matches!(
            &steps[3],
            Step::Copy {
                owner: None,
                mode: None,
                ..
            }
        ));
        assert_eq!(
            steps[4],
            Step::Env(vec![("A".into(), "1".into()), ("B".into(), "two".into())])
        );
        assert_eq!(
            steps[6],
            Step::User {
                name: "alice".into(),
                sudo: true
            }
        );
    }

    #[test]
    fn bad_steps_name_their_step() {
        for (bad, why) in [
            (raw("RUN", &[], None), "RUN takes"),
            (raw("COPY", &["a", "/b", "", ""], None), "filesHash"),
            (
                raw("COPY", &["a", "/b", "", ""], Some("ABC")),
                "hexadecimal",
            ),
            (raw("COPY", &["../a", "/b", "", ""], Some(H)), "relative"),
            (raw("COPY", &["/etc", "/b", "", ""], Some(H)), "relative"),
            (raw("COPY", &["a", "/b", "", "999"], Some(H)), "octal"),
            (raw("COPY", &["a", "/b", "x;rm", ""], Some(H)), "user"),
            (raw("ENV", &["A"], None), "ENV takes"),
            (raw("ENV", &["1A", "x"], None), "variable name"),
            (raw("USER", &["Bob"], None), "user"),
            (raw("WORKDIR", &[], None), "WORKDIR takes"),
            (raw("EXPOSE", &["80"], None), "unknown step type"),
        ] {
            let e = parse_steps(vec![raw("RUN", &["true"], None), bad]).unwrap_err();
            assert!(e.starts_with("step 2: "), "{e}");
            assert!(e.contains(why), "{e} lacks {why}");
        }
    }

    #[test]
    fn files_hashes_are_checked() {
        check_files_hash(H).unwrap();
        for bad in [
            "",
            "abc",
            &H.to_uppercase(),
            &format!("{H}0"),
            &H.replace('0', "g"),
        ] {
            assert!(check_files_hash(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bases_map_to_templates_or_images() {
        let t = |s: &str| Ok(Base::Template(s.to_owned()));
        let img = |i: &str, u: Option<&str>, p: Option<&str>| {
            Ok(Base::Image(ImagePull {
                image: i.into(),
                username: u.map(Into::into),
                password: p.map(Into::into),
            }))
        };
        let creds = serde_json::json!({"type": "registry", "username": "u", "password": "p"});
        assert_eq!(map_base(Some("base"), None, None), t("base"));
        assert_eq!(map_base(Some("mine"), None, None), t("mine"));
        assert_eq!(map_base(None, Some("e2bdev/base"), None), t("base"));
        assert_eq!(map_base(None, Some("e2bdev/base:latest"), None), t("base"));
        assert_eq!(
            map_base(None, Some("python:3.12"), None),
            img("python:3.12", None, None)
        );
        assert_eq!(
            map_base(None, Some("127.0.0.1:5000/a/b:v1"), Some(&creds)),
            img("127.0.0.1:5000/a/b:v1", Some("u"), Some("p"))
        );
        // with credentials even E2B's base image is pulled
        assert_eq!(
            map_base(None, Some("e2bdev/base"), Some(&creds)),
            img("e2bdev/base", Some("u"), Some("p"))
        );
        assert_eq!(
            map_base(None, Some("x"), Some(&serde_json::Value::Null)),
            img("x", None, None)
        );
        for (from_template, from_image, registry, why) in [
            (Some("a"), Some("e2bdev/base"), None, "not both"),
            (None, None, None, "required"),
            (None, Some("Bad Name"), None, "image reference"),
            (Some("a"), None, Some(creds.clone()), "goes with fromImage"),
            (
                None,
                Some("x"),
                Some(serde_json::json!({"type": "aws", "awsRegion": "r"})),
                "not supported",
            ),
            (
                None,
                Some("x"),
                Some(serde_json::json!({"type": "gcp", "serviceAccountJson": "{}"})),
                "not supported",
            ),
            (
                None,
                Some("x"),
                Some(serde_json::json!({"type": "registry"})),
                "username",
            ),
            (None, Some("x"), Some(serde_json::json!({})), "expected"),
        ] {
            let e = map_base(from_template, from_image, registry.as_ref()).unwrap_err();
            assert!(e.contains(why), "{e}: {why}");
        }
    }

    #[test]
    fn links_work_until_they_expire() {
        let dir = std::env::temp_dir().join(format!("e2b-state-{}", std::process::id()));
        let state = E2bState::new(&dir);
        let token = state.new_link("tpl", H).unwrap();
        assert_eq!(state.link(&token), Some(("tpl".into(), H.into())));
        assert_eq!(state.link("nope"), None);
        lock(&state.links).get_mut(&token).unwrap().expires = Instant::now();
        assert_eq!(state.link(&token), None);
        assert!(!state.has_file(H));
        state.store_file(H, b"tar").unwrap();
        assert!(state.has_file(H));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn contexts_resolve_and_quote() {
        let cx = Context {
            workdir: "/app/".into(),
            env: BTreeMap::from([("A".into(), "it's".into())]),
            ..Context::new(BTreeMap::new())
        };
        assert_eq!(cx.resolve("x"), "/app/x");
        assert_eq!(cx.resolve("/y"), "/y");
        // No export lines: the ENV is the agent's (the shell starts with it).
        assert_eq!(cx.script("echo"), "cd '/app/' || exit 1\necho");
    }

    #[test]
    fn the_path_dropin_takes_back_the_path_the_shell_started_with() {
        let file = std::env::temp_dir().join(format!("sandfork-dropin-{}", std::process::id()));
        std::fs::write(&file, PATH_DROPIN).unwrap();
        // As /etc/profile does: PATH assigned, then the drop-in sourced.
        let out = std::process::Command::new("/usr/bin/env")
            .args(["-i", "PATH=/opt/tool/bin:/usr/bin:/bin", "/bin/sh", "-c"])
            .arg(r#"PATH=/usr/bin:/bin; . "$0"; printf %s "$PATH""#)
            .arg(&file)
            .output()
            .unwrap();
        let _ = std::fs::remove_file(&file);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "/opt/tool/bin:/usr/bin:/bin",
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn env_values_expand_as_docker_expands_them() {
        let vars = BTreeMap::from([
            ("A".to_owned(), "1".to_owned()),
            ("PATH".to_owned(), "/bin".to_owned()),
            ("EMPTY".to_owned(), String::new()),
        ]);
        let lookup = |n: &str| vars.get(n).cloned();
        for (input, want) in [
            ("plain", "plain"),
            ("$A", "1"),
            ("${A}x", "1x"),
            ("$Ax", ""),
            ("/opt/bin:$PATH", "/opt/bin:/bin"),
            ("${NOPE:-dflt}", "dflt"),
            ("${EMPTY:-dflt}", "dflt"),
            ("${A:-dflt}", "1"),
            ("${A:+set}", "set"),
            ("${NOPE:+set}", ""),
            ("${NOPE:-$A}", "1"),
            (r"\$A", "$A"),
            ("cost $5", "cost $5"),
            ("$", "$"),
            ("${A", "${A"),
            ("$(id) `id`", "$(id) `id`"),
            ("it's \"q\"", "it's \"q\""),
        ] {
            assert_eq!(expand(input, &lookup), want, "{input}");
        }
    }

    #[test]
    fn env_steps_expand_against_the_env_before_them() {
        let mut cx = Context::new(BTreeMap::from([("PATH".into(), "/bin".into())]));
        cx.set_env(&[("A".into(), "x".into())]);
        cx.set_env(&[
            ("A".into(), "y".into()),
            ("B".into(), "$A".into()),
            ("PATH".into(), "/opt:$PATH".into()),
        ]);
        assert_eq!(cx.env["A"], "y");
        assert_eq!(cx.env["B"], "x");
        assert_eq!(cx.env["PATH"], "/opt:/bin");
        assert_eq!(
            parse_env0("A=1\0B=x=y\0junk\0"),
            BTreeMap::from([("A".into(), "1".into()), ("B".into(), "x=y".into())])
        );
    }

    #[test]
    fn cache_keys_chain_over_the_steps() {
        let run = |c: &str| Step::Run {
            cmd: c.into(),
            user: None,
        };
        let base = "b0";
        let a = prefix_keys(base, &[run("a"), run("b"), run("c")]);
        let b = prefix_keys(base, &[run("a"), run("b"), run("d")]);
        assert_eq!(a.len(), 3);
        assert_eq!(a[..2], b[..2], "a shared prefix shares its keys");
        assert_ne!(a[2], b[2]);
        assert_ne!(prefix_keys("b1", &[run("a")])[0], a[0], "another base");
        let as_user = Step::Run {
            cmd: "a".into(),
            user: Some("user".into()),
        };
        assert_ne!(prefix_keys(base, &[as_user])[0], a[0]);
        let copy = |h: &str| Step::Copy {
            src: "f".into(),
            dest: "/f".into(),
            owner: None,
            mode: None,
            files_hash: h.into(),
        };
        assert_ne!(
            prefix_keys(base, &[copy(H)])[0],
            prefix_keys(base, &[copy(&H.replace('0', "1"))])[0],
            "other files"
        );
        // The order matters.
        assert_ne!(
            prefix_keys(base, &[run("a"), run("b")])[1],
            prefix_keys(base, &[run("b"), run("a")])[1]
        );
        assert_ne!(key_of_base("base", 1), key_of_base("base", 2));
        assert_ne!(key_of_base("base", 1), key_of_base("other", 1));
    }

    #[test]
    fn the_cache_evicts_the_least_recently_used() {
        let cx = Context::new(BTreeMap::new());
        let e = |t: &str, used| CacheEntry {
            template: t.into(),
            context: cx.clone(),
            used_ms: used,
        };
        let mut index = CacheIndex::from([
            ("k1".into(), e("s1", 1)),
            ("k2".into(), e("s2", 2)),
            ("k3".into(), e("s2", 3)),
            ("k4".into(), e("base", 0)),
            ("k5".into(), e("s5", 5)),
        ]);
        // k4 (base, never deleted) and k1 go; s2 is still used by k3.
        assert_eq!(evict(&mut index, 3, "base"), vec!["s1".to_owned()]);
        assert_eq!(index.len(), 3);
        assert_eq!(evict(&mut index, 1, "base"), vec!["s2".to_owned()]);
        assert_eq!(index.keys().collect::<Vec<_>>(), vec!["k5"]);
        assert!(evict(&mut index, 5, "base").is_empty());
    }

    #[test]
    fn tags_are_names() {
        let tags = vec!["default".to_owned(), "v1".to_owned()];
        assert_eq!(
            tag_names("web", "t123", &tags),
            vec!["web", "t123", "web:v1", "t123:v1"]
        );
        assert_eq!(tag_of("web", "web", "t123"), Some("default"));
        assert_eq!(tag_of("t123:v1", "web", "t123"), Some("v1"));
        assert_eq!(tag_of("other:v1", "web", "t123"), None);
        check_tag("v1.2_x-y").unwrap();
        for bad in [
            "",
            "V1",
            "a b",
            "a:b",
            "0f8fad5b-d9cb-469f-a165-70867728950e",
        ] {
            assert!(check_tag(bad).is_err(), "{bad}");
        }
    }
}

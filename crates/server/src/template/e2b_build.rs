//! E2B's template builds as the unmodified SDK's `Template.build` drives
//! them (`POST /v3/templates`, upload links, `POST /v2/.../builds/{id}`):
//! the steps run in a real sandbox of the base template, through the guest
//! agent's envd services, and the sandbox is then snapshotted into the
//! template, as `--from-sandbox` builds are. The build itself is one of
//! [`super::Templates`]' builds (record, log, status), source
//! [`super::BuildSource::Steps`].
//!
//! State between the request and the start (the waiting build, its upload
//! links) is in memory: a restart forgets waiting builds, as E2B's own
//! waiting builds time out. Uploaded files are kept by their `filesHash`
//! under `<data_dir>/e2b-files/`, so a second build finds them `present`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmm_driver::agent_client::AgentClient;

use super::boot::{Prepare, shell_quote};
use super::build::{BuildLog, Templates};
use crate::ids;
use crate::net::SandboxNetwork;
use crate::sandbox::{CreateParams, SandboxError, SnapshotParams};
use crate::store::TemplateRecord;

/// The image the SDK asks for when no base is named (`from_base_image`).
pub const E2B_BASE_IMAGE: &str = "e2bdev/base";
/// How long an upload link works.
pub const LINK_TTL: Duration = Duration::from_secs(30 * 60);
/// Largest upload (one COPY step's archive).
pub const MAX_UPLOAD: usize = 512 << 20;
/// A build's sandbox lives at most this long.
const BUILD_SANDBOX_TIMEOUT: Duration = Duration::from_secs(2 * 3600);
/// One RUN step may take this long.
const RUN_TIMEOUT: Duration = Duration::from_secs(3600);
/// Where steps run when nothing set a WORKDIR or USER (the base template's
/// agent runs as root in `/`).
const DEFAULT_USER: &str = "root";
const DEFAULT_WORKDIR: &str = "/";

/// One build step, as the SDK sends it (`type`, `args`, `filesHash`).
#[derive(Debug, Clone, PartialEq, Eq)]
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

/// A step as sent; unknown fields (`force`, `forceUpload`, ...) ignored.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RawStep {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub files_hash: Option<String>,
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

/// A build requested (`POST /v3/templates`) and not yet started.
#[derive(Debug, Clone)]
pub struct Waiting {
    pub build_id: String,
    pub name: String,
}

struct Link {
    template_id: String,
    hash: String,
    expires: Instant,
}

/// Waiting builds, upload links and the uploaded files.
pub struct E2bState {
    waiting: Mutex<HashMap<String, Waiting>>,
    links: Mutex<HashMap<String, Link>>,
    files_dir: PathBuf,
}

impl E2bState {
    pub fn new(data_dir: &Path) -> E2bState {
        E2bState {
            waiting: Mutex::new(HashMap::new()),
            links: Mutex::new(HashMap::new()),
            files_dir: data_dir.join("e2b-files"),
        }
    }

    pub fn add_waiting(&self, template_id: &str, w: Waiting) {
        lock(&self.waiting).insert(template_id.to_owned(), w);
    }

    pub fn waiting(&self, template_id: &str) -> Option<Waiting> {
        lock(&self.waiting).get(template_id).cloned()
    }

    pub fn take_waiting(&self, template_id: &str) -> Option<Waiting> {
        lock(&self.waiting).remove(template_id)
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
#[derive(Debug, Clone)]
struct Context {
    user: String,
    workdir: String,
    env: BTreeMap<String, String>,
}

impl Context {
    /// `path` resolved against the working directory.
    fn resolve(&self, path: &str) -> String {
        if path.starts_with('/') {
            path.to_owned()
        } else {
            format!("{}/{path}", self.workdir.trim_end_matches('/'))
        }
    }

    /// `cmd` under `sh -c` in the working directory with the build's env.
    fn script(&self, cmd: &str) -> String {
        let mut s = String::new();
        for (k, v) in &self.env {
            s.push_str(&format!("export {k}={}\n", shell_quote(v)));
        }
        s.push_str(&format!(
            "cd {} || exit 1\n{cmd}",
            shell_quote(&self.workdir)
        ));
        s
    }
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
    /// Creates a sandbox of the plan's base, runs the steps and the start
    /// and ready commands in it, snapshots it as the template, kills it.
    pub(super) async fn build_from_steps(
        &self,
        template_id: &str,
        name: &str,
        plan: &StepsPlan,
        start_cmd: Option<String>,
        ready_cmd: Option<String>,
        log: &Arc<BuildLog>,
    ) -> Result<Option<TemplateRecord>, Failure> {
        let manager = self.manager();
        let base = match &plan.pull {
            Some(pull) => self.image_base(pull, log).await.map_err(at("base"))?,
            None => plan.base.clone(),
        };
        log.push(&format!("starting a sandbox of template {base}"));
        let created = manager
            .create(CreateParams {
                template_id: base,
                timeout: BUILD_SANDBOX_TIMEOUT,
                metadata: BTreeMap::from([(
                    "sandfork.templateBuild".to_owned(),
                    template_id.to_owned(),
                )]),
                env_vars: BTreeMap::new(),
                secure: false,
                auto_pause: false,
                auto_pause_memory: false,
                network: SandboxNetwork::default(),
            })
            .await
            .map_err(|e| e.to_string())
            .map_err(at("base"))?;
        let sandbox = created.id.clone();
        log.push(&format!("build sandbox {sandbox}"));
        // Its steps reach its agent directly, not through the proxy: in use
        // for the memory pressure monitor all along.
        let _in_use = manager.in_use(&sandbox);
        let result = self
            .run_steps(&sandbox, name, template_id, plan, start_cmd, ready_cmd, log)
            .await;
        if let Err(e) = manager.kill(&sandbox).await
            && !matches!(e, SandboxError::NotFound(_))
        {
            tracing::warn!("template {template_id}: killing build sandbox {sandbox}: {e}");
        }
        result.map(|()| None)
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_steps(
        &self,
        sandbox: &str,
        name: &str,
        template_id: &str,
        plan: &StepsPlan,
        start_cmd: Option<String>,
        ready_cmd: Option<String>,
        log: &Arc<BuildLog>,
    ) -> Result<(), Failure> {
        let manager = self.manager();
        let vsock = manager
            .vsock_path(sandbox)
            .ok_or_else(|| format!("build sandbox {sandbox} is not running"))
            .map_err(at("base"))?;
        let root = AgentClient::new(&vsock).with_timeout(RUN_TIMEOUT);
        let mut cx = Context {
            user: DEFAULT_USER.into(),
            workdir: DEFAULT_WORKDIR.into(),
            env: BTreeMap::new(),
        };
        let total = plan.steps.len();
        for (i, step) in plan.steps.iter().enumerate() {
            let n = (i + 1).to_string();
            log.push(&format!("[{n}/{total}] {}", describe(step)));
            self.run_step(&root, &mut cx, step, log)
                .await
                .map_err(|e| format!("step {n} ({}): {e}", describe(step)))
                .map_err(at(n))?;
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
        manager
            .snapshot(
                sandbox,
                SnapshotParams {
                    name: Some(name.to_owned()),
                    id: Some(template_id.to_owned()),
                },
            )
            .await
            .map_err(|e| e.to_string())
            .map_err(at("finalize"))?;
        Ok(())
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
                cx.env.extend(pairs.iter().cloned());
                Ok(())
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
                Ok(())
            }
        }
    }
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
            user: "root".into(),
            workdir: "/app/".into(),
            env: BTreeMap::from([("A".into(), "it's".into())]),
        };
        assert_eq!(cx.resolve("x"), "/app/x");
        assert_eq!(cx.resolve("/y"), "/y");
        assert_eq!(
            cx.script("echo"),
            "export A='it'\\''s'\ncd '/app/' || exit 1\necho"
        );
    }
}

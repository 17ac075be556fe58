//! Template builds: turns (a) a list of Debian packages on top of the
//! sandfork base image, or (b) a local OCI image (a layout directory or a
//! `docker save` tarball) into an ext4 root filesystem with the guest agent
//! as `/sbin/init`, cached by content hash under
//! `$SANDFORK_CACHE/templates/<key>/` (`rootfs.ext4`, `template.json`).
//!
//! The base tree and the final touches come from `images/rootfs` (`build.sh
//! --base-only`, `finish.sh`), built into this library; OCI layers are applied
//! here, with whiteouts, owners and modes. Builds run as root.
//!
//! Where the work happens: trees (the unpacked base, apt's changes, OCI
//! layers) and the image made from them live in a *scratch* directory, and
//! only the finished `rootfs.ext4` and `template.json` go into the cache, as a
//! temporary entry renamed into place. The scratch directory must be a local
//! filesystem that holds device nodes, owners and xattrs; the cache need not
//! (in the KVM lab it is a 9p share, which can hold none of those and is slow
//! for many small files). By default the scratch is the cache itself (no
//! copy of the image), or the system's temporary directory when the cache is
//! on 9p; `SANDFORK_BUILD_SCRATCH` or [`Builder::scratch_dir`] choose another.
//! The base tree is cached as one tarball (`rootfs-base/<key>/tree.tar`) for
//! the same reason: a tarball survives any filesystem and is read in one
//! sequential stream.
//!
//! ```no_run
//! use template_build::{Builder, Source};
//! let builder = Builder::new("/path/to/sandfork-agent");
//! let t = builder.build(&Source::DebianPackages(vec!["jq".into()]), &mut |line| eprintln!("{line}"))?;
//! println!("{} {:?}", t.rootfs.display(), t.config.cmd);
//! # Ok::<(), template_build::BuildError>(())
//! ```

mod debian;
mod error;
pub mod layer_store;
pub mod layers;
pub mod oci;
pub mod registry;
mod run;
mod scripts;
mod venv;

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

pub use debian::normalize as normalize_packages;
pub use error::{BuildError, Result};
pub use layer_store::{LayeredTemplate, StoredLayer};
pub use layers::{Layer, apply_layers};
pub use oci::OciImage;
pub use venv::{ImageFile, PythonVenv};

/// Bumped when the way templates are built changes, so old cache entries
/// are not reused.
const FORMAT: &str = "sandfork-template 1";
const MIB: u64 = 1 << 20;

/// What to build a template from.
#[derive(Debug, Clone)]
pub enum Source {
    /// Debian packages (names, optionally `name=version`) installed with apt
    /// on top of the base image.
    DebianPackages(Vec<String>),
    /// An OCI image layout directory.
    OciLayout(PathBuf),
    /// A `docker save` tarball.
    DockerArchive(PathBuf),
    /// An image in a blob store (`<dir>/blobs/sha256/...`, as
    /// [`registry::pull`] fills it), named by its platform manifest's digest.
    OciBlobs { dir: PathBuf, manifest: String },
    /// A Python virtual environment made with pip, and files, over the base
    /// image (the venv cached apart, under `venvs/`).
    PythonVenv(PythonVenv),
}

/// The image's run settings (OCI config `Env`, `WorkingDir`, `User`,
/// `Entrypoint`, `Cmd`): the defaults for commands in its sandboxes and its
/// start command. Empty for Debian-package templates.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    pub env: Vec<(String, String)>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

/// A built template.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Template {
    /// Content key: the cache entry's name.
    pub key: String,
    /// The ext4 root filesystem (sparse).
    pub rootfs: PathBuf,
    pub config: ImageConfig,
    /// True when it came from the cache without building.
    #[serde(skip)]
    pub cached: bool,
}

/// Builds templates with one guest agent into one cache.
#[derive(Debug, Clone)]
pub struct Builder {
    cache: PathBuf,
    agent: PathBuf,
    image_size: u64,
    /// The disk size of image chains ([`layer_store`]).
    layer_disk_size: u64,
    /// Where trees and images are made; see [`Builder::scratch_dir`].
    scratch: Option<PathBuf>,
}

/// The build cache: `$SANDFORK_CACHE`, default `/var/cache/sandfork`.
pub fn default_cache_dir() -> PathBuf {
    std::env::var_os("SANDFORK_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/sandfork"))
}

/// Where builds with the cache `cache` keep the images they pull.
pub fn images_in(cache: &Path) -> PathBuf {
    cache.join("images")
}

/// Where builds with the cache `cache` put the templates they make.
pub fn templates_in(cache: &Path) -> PathBuf {
    cache.join("templates")
}

impl Builder {
    /// A builder installing `agent` (the static guest agent binary), caching
    /// under `$SANDFORK_CACHE` (default `/var/cache/sandfork`), working in
    /// `$SANDFORK_BUILD_SCRATCH` when set, with images of at least 2 GiB
    /// (sparse).
    pub fn new(agent: impl Into<PathBuf>) -> Builder {
        Builder {
            cache: default_cache_dir(),
            agent: agent.into(),
            image_size: 2048 * MIB,
            layer_disk_size: layer_store::DEFAULT_DISK_SIZE,
            scratch: std::env::var_os("SANDFORK_BUILD_SCRATCH")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
        }
    }

    /// Makes trees and images under `dir` (a local filesystem with room for
    /// a root tree and its image, about 1 GiB for the base with a few
    /// packages) instead of the default: the cache, or the system's
    /// temporary directory when the cache is on 9p.
    pub fn scratch_dir(mut self, dir: impl Into<PathBuf>) -> Builder {
        self.scratch = Some(dir.into());
        self
    }

    /// The directory builds work in (see [`Builder::scratch_dir`]).
    pub fn scratch_root(&self) -> PathBuf {
        if let Some(dir) = &self.scratch {
            return dir.clone();
        }
        let templates = self.templates_dir();
        if is_9p(&templates) {
            std::env::temp_dir().join("sandfork-build")
        } else {
            templates
        }
    }

    /// Uses `dir` instead of `$SANDFORK_CACHE` (templates go to `dir/templates`;
    /// the base tree is looked up and built in `dir` too).
    pub fn cache_dir(mut self, dir: impl Into<PathBuf>) -> Builder {
        self.cache = dir.into();
        self
    }

    /// The least image size in bytes; the image grows past it to hold the
    /// tree with room to spare.
    pub fn image_size(mut self, bytes: u64) -> Builder {
        self.image_size = bytes;
        self
    }

    /// Where images pulled from registries are kept: a blob store shared by
    /// all pulls, for [`registry::pull`] and [`Source::OciBlobs`].
    pub fn images_dir(&self) -> PathBuf {
        images_in(&self.cache)
    }

    /// Where templates are cached.
    pub fn templates_dir(&self) -> PathBuf {
        templates_in(&self.cache)
    }

    /// The agent's content hash: part of every template's cache key.
    pub(crate) fn agent_sum(&self) -> Result<String> {
        oci::hash_file(&self.agent)
            .map_err(|e| BuildError::io(format!("reading the agent {}", self.agent.display()), e))
    }

    /// Builds `source` (or finds it in the cache), sending progress lines to
    /// `log`. Concurrent builds of the same template wait for one another.
    pub fn build(&self, source: &Source, log: &mut dyn FnMut(&str)) -> Result<Template> {
        let dir = self.templates_dir();
        fs::create_dir_all(&dir)
            .map_err(|e| BuildError::io(format!("creating {}", dir.display()), e))?;
        let agent_sum = self.agent_sum()?;
        let scripts = scripts::materialize(&dir)?;
        let common = format!(
            "{FORMAT}\nagent {agent_sum}\nsize {}\nfinish {}\n",
            self.image_size,
            scripts::sha256_hex(scripts::FINISH_SH.as_bytes())
        );
        match source {
            Source::DebianPackages(packages) => {
                let packages = debian::normalize(packages)?;
                let base = self.base_tree(&scripts, log)?;
                let base_key = base
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let key = key_of(&format!(
                    "{common}debian {base_key}\n{}\n",
                    packages.join("\n")
                ));
                self.cached_or(&key, log, |work, log| {
                    let tree = work.join("tree");
                    debian::install(&base.join("tree.tar"), &tree, &packages, log)?;
                    Ok((tree, ImageConfig::default()))
                })
            }
            Source::OciLayout(path) => {
                let image = OciImage::open_layout(path)?;
                let key = key_of(&format!("{common}{}\n", image.key));
                self.cached_or(&key, log, |work, log| {
                    let tree = work.join("tree");
                    make_root(&tree)?;
                    apply_layers(&tree, &image.layers, log)?;
                    Ok((tree, image.config.clone()))
                })
            }
            Source::OciBlobs { dir, manifest } => {
                let image = OciImage::open_manifest(dir, manifest)?;
                let key = key_of(&format!("{common}{}\n", image.key));
                self.cached_or(&key, log, |work, log| {
                    let tree = work.join("tree");
                    make_root(&tree)?;
                    apply_layers(&tree, &image.layers, log)?;
                    Ok((tree, image.config.clone()))
                })
            }
            Source::PythonVenv(venv) => {
                venv.check()?;
                let base = self.base_tree(&scripts, log)?;
                let base_key = base
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let venv_key = venv.venv_key(&base_key);
                let key = key_of(&format!(
                    "{common}python-venv {base_key} {venv_key}\n{}",
                    venv.files_digest()
                ));
                let venvs = self.cache.join("venvs");
                self.cached_or(&key, log, |work, log| {
                    let tree = work.join("tree");
                    venv.make(&venvs, &venv_key, &base.join("tree.tar"), &tree, log)?;
                    Ok((tree, ImageConfig::default()))
                })
            }
            Source::DockerArchive(path) => {
                log(&format!("hashing {}", path.display()));
                let sum = oci::hash_file(path)
                    .map_err(|e| BuildError::unreadable(path, e.to_string()))?;
                let key = key_of(&format!("{common}docker-archive {sum}\n"));
                self.cached_or(&key, log, |work, log| {
                    let scratch = work.join("archive");
                    make_root(&scratch)?;
                    let image = OciImage::open_docker_archive(path, &scratch, sum.clone())?;
                    let tree = work.join("tree");
                    make_root(&tree)?;
                    apply_layers(&tree, &image.layers, log)?;
                    fs::remove_dir_all(&scratch)
                        .map_err(|e| BuildError::io("removing the unpacked archive", e))?;
                    Ok((tree, image.config))
                })
            }
        }
    }

    /// The cached base tree's entry directory (`<entry>/tree.tar`), built by
    /// `images/rootfs/build.sh --base-only` (in the scratch directory) when
    /// missing.
    fn base_tree(&self, scripts: &Path, log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
        let mut cmd = Command::new(scripts.join("build.sh"));
        cmd.arg("--base-only")
            .env("SANDFORK_CACHE", &self.cache)
            .env("SANDFORK_BUILD_SCRATCH", self.scratch_root());
        let out = run::run_ok(
            "building the base tree (images/rootfs/build.sh --base-only)",
            &mut cmd,
            log,
        )?;
        let dir = out.tail.back().map(PathBuf::from).unwrap_or_default();
        if !dir.join("tree.tar").is_file() {
            return Err(BuildError::Command {
                what: "build.sh --base-only".into(),
                status: "no base tree printed".into(),
                tail: out.tail_text(),
            });
        }
        Ok(dir)
    }

    /// Returns the cached template `key`, or makes it: `make` fills a tree in
    /// the work directory it is given (under the scratch directory), the tree
    /// is finished into an image there, and the image moved into a temporary
    /// entry in the cache that is renamed into place.
    fn cached_or(
        &self,
        key: &str,
        log: &mut dyn FnMut(&str),
        make: impl FnOnce(&Path, &mut dyn FnMut(&str)) -> Result<(PathBuf, ImageConfig)>,
    ) -> Result<Template> {
        let dir = self.templates_dir();
        let entry = dir.join(key);
        if let Some(t) = read_entry(&entry, key) {
            log(&format!("template {key} cached: {}", entry.display()));
            return Ok(t);
        }
        let lock_path = dir.join(format!(".{key}.lock"));
        let lock_file = fs::File::create(&lock_path)
            .map_err(|e| BuildError::io(format!("creating {}", lock_path.display()), e))?;
        let _lock = nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| {
                BuildError::io(format!("locking {}", lock_path.display()), e.into())
            })?;
        if let Some(t) = read_entry(&entry, key) {
            log(&format!(
                "template {key} built meanwhile: {}",
                entry.display()
            ));
            return Ok(t);
        }
        let start = std::time::Instant::now();
        let tmp = dir.join(format!(".tmp-{key}"));
        remove_tree(&tmp)?;
        fs::create_dir(&tmp)
            .map_err(|e| BuildError::io(format!("creating {}", tmp.display()), e))?;
        let scratch = self.scratch_root();
        fs::create_dir_all(&scratch)
            .map_err(|e| BuildError::io(format!("creating {}", scratch.display()), e))?;
        remove_stale_work(&scratch, key);
        let work = scratch.join(format!("{WORK_PREFIX}{key}-{}", std::process::id()));
        remove_tree(&work)?;
        make_root(&work)?;
        log(&format!("working in {}", work.display()));
        let result = self.make_entry(key, &work, &tmp, &entry, log, make);
        let _ = remove_tree(&work);
        if result.is_err() {
            let _ = remove_tree(&tmp);
        }
        let t = result?;
        log(&format!(
            "template {key} built in {:.1} s",
            start.elapsed().as_secs_f64()
        ));
        Ok(t)
    }

    fn make_entry(
        &self,
        key: &str,
        work: &Path,
        tmp: &Path,
        entry: &Path,
        log: &mut dyn FnMut(&str),
        make: impl FnOnce(&Path, &mut dyn FnMut(&str)) -> Result<(PathBuf, ImageConfig)>,
    ) -> Result<Template> {
        let (tree, config) = make(work, log)?;
        let used = tree_bytes(&tree)?;
        // room for the tree and ext4's own structures, plus free space
        let size = self
            .image_size
            .max((used + used / 4 + 512 * MIB).div_ceil(MIB) * MIB);
        log(&format!(
            "tree holds {} MiB; image of {} MiB",
            used / MIB,
            size / MIB
        ));
        let scripts = scripts::materialize(&self.templates_dir())?;
        let made = work.join("rootfs.ext4");
        let mut cmd = Command::new(scripts.join("finish.sh"));
        cmd.arg("--agent")
            .arg(&self.agent)
            .arg("--tree")
            .arg(&tree)
            .arg("--image")
            .arg(&made)
            .arg("--size")
            .arg(size.to_string())
            .arg("--key")
            .arg(key);
        run::run_ok("making the ext4 image (finish.sh)", &mut cmd, log)?;
        remove_tree(&tree)?;
        move_image(&made, &tmp.join("rootfs.ext4"), log)?;
        let template = Template {
            key: key.to_owned(),
            rootfs: entry.join("rootfs.ext4"),
            config,
            cached: false,
        };
        let json = serde_json::to_vec_pretty(&template)
            .map_err(|e| BuildError::io("encoding template.json", e.into()))?;
        fs::write(tmp.join("template.json"), json)
            .map_err(|e| BuildError::io("writing template.json", e))?;
        remove_tree(entry)?;
        fs::rename(tmp, entry)
            .map_err(|e| BuildError::io(format!("renaming to {}", entry.display()), e))?;
        Ok(template)
    }
}

/// Prefix of work directories under the scratch directory.
const WORK_PREFIX: &str = ".work-";

/// Whether `path` is on a 9p filesystem.
fn is_9p(path: &Path) -> bool {
    // Not statfs: over 9p2000.L it reports the type of the server's
    // filesystem. The mount table says what the path is mounted as.
    let Ok(path) = fs::canonicalize(path) else {
        return false;
    };
    let table = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    mount_type(&table, &path).is_some_and(|t| t == "9p")
}

/// The filesystem type of the mount holding `path` (canonical) in a
/// `/proc/self/mountinfo` table: the last of the longest mount points that
/// contain it.
fn mount_type(mountinfo: &str, path: &Path) -> Option<String> {
    let mut best: Option<(usize, String)> = None;
    for m in cgroup::mountinfo::parse(mountinfo) {
        let len = m.point.components().count();
        if path.starts_with(&m.point) && best.as_ref().is_none_or(|(l, _)| len >= *l) {
            best = Some((len, m.fs_type));
        }
    }
    best.map(|(_, t)| t)
}

/// Removes work directories of `key` left by builds whose process is gone
/// (a crash, a kill); those of running processes (another cache sharing the
/// scratch directory) stay.
fn remove_stale_work(scratch: &Path, key: &str) {
    let prefix = format!("{WORK_PREFIX}{key}-");
    for e in fs::read_dir(scratch).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(&prefix) else {
            continue;
        };
        if !Path::new("/proc").join(pid).exists() {
            let _ = remove_tree(&e.path());
        }
    }
}

/// Moves the finished image into the cache: a rename on the same
/// filesystem, else a sparse copy (the scratch directory is local, the cache
/// may be a share).
fn move_image(from: &Path, to: &Path, log: &mut dyn FnMut(&str)) -> Result<()> {
    match fs::rename(from, to) {
        Ok(()) => return Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {}
        Err(e) => {
            return Err(BuildError::io(
                format!("moving the image to {}", to.display()),
                e,
            ));
        }
    }
    log(&format!(
        "copying the image into the cache {}",
        to.display()
    ));
    let start = std::time::Instant::now();
    run::run_ok(
        "copying the image into the cache",
        Command::new("cp").arg("--sparse=always").arg(from).arg(to),
        log,
    )?;
    fs::File::open(to)
        .and_then(|f| f.sync_all())
        .map_err(|e| BuildError::io(format!("syncing {}", to.display()), e))?;
    remove_tree(from)?;
    log(&format!(
        "image copied in {:.1} s",
        start.elapsed().as_secs_f64()
    ));
    Ok(())
}

fn key_of(text: &str) -> String {
    scripts::sha256_hex(text.as_bytes())[..16].to_owned()
}

fn read_entry(entry: &Path, key: &str) -> Option<Template> {
    let bytes = fs::read(entry.join("template.json")).ok()?;
    let mut t: Template = serde_json::from_slice(&bytes).ok()?;
    if t.key != key || !entry.join("rootfs.ext4").is_file() {
        return None;
    }
    t.rootfs = entry.join("rootfs.ext4");
    t.cached = true;
    Some(t)
}

/// A root directory as images expect it: 0755, owned by root.
fn make_root(dir: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::create_dir_all(dir)
        .map_err(|e| BuildError::io(format!("creating {}", dir.display()), e))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755))
        .map_err(|e| BuildError::io(format!("chmod {}", dir.display()), e))
}

/// Bytes the tree takes on disk (hard links counted once per name; a safe
/// over-estimate).
fn tree_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let rd =
            fs::read_dir(&d).map_err(|e| BuildError::io(format!("reading {}", d.display()), e))?;
        for e in rd {
            let e = e.map_err(|e| BuildError::io(format!("reading {}", d.display()), e))?;
            let m = fs::symlink_metadata(e.path())
                .map_err(|err| BuildError::io(format!("stat {}", e.path().display()), err))?;
            total += m.blocks() * 512 + 4096; // an inode's worth each
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    Ok(total)
}

fn remove_tree(path: &Path) -> Result<()> {
    match fs::symlink_metadata(path) {
        Err(_) => Ok(()),
        Ok(m) if m.is_dir() => fs::remove_dir_all(path)
            .map_err(|e| BuildError::io(format!("removing {}", path.display()), e)),
        Ok(_) => fs::remove_file(path)
            .map_err(|e| BuildError::io(format!("removing {}", path.display()), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mount_holding_a_path_is_found() {
        let table = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
40 27 0:40 / /tmp rw - tmpfs tmpfs rw
41 27 0:41 / /var/cache/sandfork ro - 9p hostroot ro
42 41 0:42 / /var/cache/sandfork/lab\\040rw rw - 9p rw0 rw
43 27 0:43 / /var/cache/sandfork/lab rw - tmpfs tmpfs rw
";
        let t = |p: &str| mount_type(table, Path::new(p));
        assert_eq!(t("/var/cache/sandfork/lab rw/x").as_deref(), Some("9p"));
        assert_eq!(t("/var/cache/sandfork/lab/x").as_deref(), Some("tmpfs"));
        assert_eq!(t("/var/cache/sandfork/labx").as_deref(), Some("9p"));
        assert_eq!(t("/var/cache/sandfork").as_deref(), Some("9p"));
        assert_eq!(t("/tmp/a").as_deref(), Some("tmpfs"));
        assert_eq!(t("/tmpfoo").as_deref(), Some("ext4"));
        assert_eq!(t("/").as_deref(), Some("ext4"));
    }

    #[test]
    fn nine_p_is_not_this_hosts_tmp() {
        assert!(!is_9p(&std::env::temp_dir()));
    }
}

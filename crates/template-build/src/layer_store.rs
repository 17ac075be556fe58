//! Images stored once per layer: an image's root filesystem as a chain of
//! sealed disk layers (the `disk-layers` format the VMM opens), one per OCI
//! layer, kept in a store (`<cache>/layers/<key>.layer`) by a chain key:
//! the key of the layer below and the layer's blob digest, so the role of
//! the OCI chain id. An image whose first k layers another image has
//! converted reuses those k layers' files and converts only the rest.
//!
//! A chain, bottom up: the empty ext4 filesystem (one per disk size, shared
//! by every image), one layer per OCI layer, and the image's finish (the
//! guest agent as `/sbin/init`, its host files, the journal). A layer holds
//! only the 4 KiB blocks whose content differs from the chain below it:
//! the filesystem is one disk image (`disk.raw`, in the scratch directory)
//! that each OCI layer is applied to in place, mounted through a loop
//! device, so that files the layer leaves alone keep their blocks; after
//! each, the image's blocks are compared with the chain so far. `mkfs.ext4
//! -d` of each prefix instead would place every file anew.
//!
//! Every layer of a chain describes a disk of one size (the filesystem's,
//! [`DEFAULT_DISK_SIZE`] unless the builder says otherwise): images share
//! layers only at one size. The layers are sealed *shared*, so that a fork
//! whose chain grows deep folds its own layers and never an image's
//! (`disk_layers::compact`). Builds take the store's lock (one at a time
//! per store); a layer appears under its name only sealed and whole (made
//! under a temporary name, renamed).

use std::fs;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use disk_layers::LayeredDisk;

use crate::error::{BuildError, Result};
use crate::layers::apply_layer;
use crate::oci::OciImage;
use crate::{
    Builder, ImageConfig, Template, WORK_PREFIX, remove_stale_work, remove_tree, run, scripts,
};

/// The disk size of image chains unless a builder says otherwise: room for
/// realistic task images (1-4 GiB) and the sandbox's own files, sparse.
/// Every open disk's index costs 2 bytes per 4 KiB of it (4 MiB here).
pub const DEFAULT_DISK_SIZE: u64 = 8 << 30;
/// Bumped when the way chains are made changes, so old layers are not
/// stacked on.
const FORMAT: &str = "sandfork-image-layers 1";
const BLOCK: usize = 4096;
const CHUNK: usize = 1 << 20;
/// What the empty filesystem is made with: no journal while layers are
/// applied (it would carry each layer's metadata again), inode tables
/// zeroed now (a guest would otherwise zero them into its own layer).
const MKFS_ARGS: [&str; 8] = [
    "-q",
    "-F",
    "-L",
    "sandfork-root",
    "-O",
    "^has_journal",
    "-E",
    "lazy_itable_init=0,nodiscard",
];
/// Every image chain's filesystem has this UUID (it is made once per size).
const UUID: &str = "5a4df04b-0000-4000-8000-000000000001";

/// One layer of an image's chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredLayer {
    /// Its chain key (its file is `<store>/<key>.layer`).
    pub key: String,
    pub path: PathBuf,
    /// What it holds: `filesystem`, `layer sha256:...`, `finish`.
    pub what: String,
    /// Made by this build (false: found in the store).
    pub made: bool,
    /// Bytes its file takes on disk.
    pub bytes: u64,
}

/// An image converted into a chain of stored layers.
#[derive(Debug, Clone)]
pub struct LayeredTemplate {
    /// Its `rootfs` is the chain's top layer (a sealed layer, which a
    /// template's root layer stacks on).
    pub template: Template,
    /// The chain, bottom first.
    pub layers: Vec<StoredLayer>,
}

#[derive(Debug, Clone)]
enum Step {
    Filesystem,
    Layer(usize),
    Finish,
}

#[derive(Debug, Clone)]
struct Planned {
    key: String,
    step: Step,
    what: String,
}

/// Where the store of builds with the cache `cache` is.
pub fn layers_in(cache: &Path) -> PathBuf {
    cache.join("layers")
}

/// The store's file of the layer of chain key `key`.
pub fn layer_path(store: &Path, key: &str) -> PathBuf {
    store.join(format!("{key}.layer"))
}

fn key_of(text: &str) -> String {
    scripts::sha256_hex(text.as_bytes())[..32].to_owned()
}

/// The chain of `image`, bottom first, with its keys.
fn plan(size: u64, image: &OciImage, agent_sum: &str) -> Result<Vec<Planned>> {
    let mut key = key_of(&format!(
        "{FORMAT}\nsize {size}\nmkfs {} {UUID}\n",
        MKFS_ARGS.join(" ")
    ));
    let mut out = vec![Planned {
        key: key.clone(),
        step: Step::Filesystem,
        what: "filesystem".into(),
    }];
    for (n, layer) in image.layers.iter().enumerate() {
        let Some(sum) = &layer.sha256 else {
            return Err(BuildError::UnsupportedImage {
                path: layer.path.clone(),
                reason: "a layer without a digest cannot be stored by layer".into(),
            });
        };
        key = key_of(&format!("{key}\nlayer sha256:{sum}\n"));
        out.push(Planned {
            key: key.clone(),
            step: Step::Layer(n),
            what: format!("layer sha256:{sum}"),
        });
    }
    key = key_of(&format!(
        "{key}\nfinish agent {agent_sum} script {}\n",
        scripts::sha256_hex(scripts::FINISH_SH.as_bytes())
    ));
    out.push(Planned {
        key,
        step: Step::Finish,
        what: "finish".into(),
    });
    Ok(out)
}

fn disk_bytes(path: &Path) -> u64 {
    fs::metadata(path).map_or(0, |m| m.blocks() * 512)
}

impl Builder {
    /// Where image layers are stored (see [`crate::layer_store`]).
    pub fn layers_dir(&self) -> PathBuf {
        layers_in(&self.cache)
    }

    /// The disk size of the image chains this builder makes (default
    /// [`DEFAULT_DISK_SIZE`]); chains of different sizes share nothing.
    pub fn layer_disk_size(mut self, bytes: u64) -> Builder {
        self.layer_disk_size = bytes;
        self
    }

    /// Converts the image whose platform manifest is blob `manifest` of the
    /// blob store `dir` into a chain of stored layers (see the module's
    /// documentation), reusing the layers the store has.
    pub fn build_layered(
        &self,
        dir: &Path,
        manifest: &str,
        log: &mut dyn FnMut(&str),
    ) -> Result<LayeredTemplate> {
        let image = OciImage::open_manifest(dir, manifest)?;
        let store = self.layers_dir();
        fs::create_dir_all(&store)
            .map_err(|e| BuildError::io(format!("creating {}", store.display()), e))?;
        let agent_sum = self.agent_sum()?;
        let steps = plan(self.layer_disk_size, &image, &agent_sum)?;
        if let Some(done) = stored(&store, &steps, &image.config) {
            log(&format!("image layers cached: {}", done.template.key));
            return Ok(done);
        }
        let lock_path = store.join(".lock");
        let lock_file = fs::File::create(&lock_path)
            .map_err(|e| BuildError::io(format!("creating {}", lock_path.display()), e))?;
        let _lock = nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| {
                BuildError::io(format!("locking {}", lock_path.display()), e.into())
            })?;
        if let Some(done) = stored(&store, &steps, &image.config) {
            log(&format!(
                "image layers made meanwhile: {}",
                done.template.key
            ));
            return Ok(done);
        }
        let top = steps.last().map(|s| s.key.clone()).unwrap_or_default();
        let scratch = self.scratch_root();
        fs::create_dir_all(&scratch)
            .map_err(|e| BuildError::io(format!("creating {}", scratch.display()), e))?;
        remove_stale_work(&scratch, &top);
        let work = scratch.join(format!("{WORK_PREFIX}{top}-{}", std::process::id()));
        remove_tree(&work)?;
        fs::create_dir_all(work.join("mnt"))
            .map_err(|e| BuildError::io(format!("creating {}", work.display()), e))?;
        let start = std::time::Instant::now();
        let made = self.make_chain(&store, &work, &steps, &image, log);
        let _ = remove_tree(&work);
        let layers = made?;
        let made_bytes: u64 = layers.iter().filter(|l| l.made).map(|l| l.bytes).sum();
        log(&format!(
            "image layers made in {:.1} s: {} of {} new, {} KiB",
            start.elapsed().as_secs_f64(),
            layers.iter().filter(|l| l.made).count(),
            layers.len(),
            made_bytes >> 10
        ));
        Ok(LayeredTemplate {
            template: Template {
                key: top.clone(),
                rootfs: layer_path(&store, &top),
                config: image.config,
                cached: false,
            },
            layers,
        })
    }

    fn make_chain(
        &self,
        store: &Path,
        work: &Path,
        steps: &[Planned],
        image: &OciImage,
        log: &mut dyn FnMut(&str),
    ) -> Result<Vec<StoredLayer>> {
        let raw = work.join("disk.raw");
        let mnt = work.join("mnt");
        let present = steps
            .iter()
            .take_while(|s| layer_path(store, &s.key).is_file())
            .count();
        let mut out: Vec<StoredLayer> = steps[..present]
            .iter()
            .map(|s| {
                let path = layer_path(store, &s.key);
                StoredLayer {
                    key: s.key.clone(),
                    bytes: disk_bytes(&path),
                    path,
                    what: s.what.clone(),
                    made: false,
                }
            })
            .collect();
        if present > 0 {
            log(&format!(
                "{present} of {} image layers stored already",
                steps.len()
            ));
        }
        match out.last() {
            None => {
                let f = fs::File::create(&raw)
                    .map_err(|e| BuildError::io(format!("creating {}", raw.display()), e))?;
                f.set_len(self.layer_disk_size)
                    .map_err(|e| BuildError::io(format!("sizing {}", raw.display()), e))?;
                drop(f);
                let mut cmd = Command::new("mkfs.ext4");
                cmd.args(MKFS_ARGS).args(["-U", UUID]).arg(&raw);
                run::run_ok("making the empty filesystem (mkfs.ext4)", &mut cmd, log)?;
            }
            Some(below) => materialize(&below.path, &raw, self.layer_disk_size)?,
        }
        for s in &steps[present..] {
            match s.step {
                Step::Filesystem => {}
                Step::Layer(n) => {
                    let layer = &image.layers[n];
                    log(&format!(
                        "layer {}/{}: {}",
                        n + 1,
                        image.layers.len(),
                        layer.path.display()
                    ));
                    let mounted = Mounted::new(&raw, &mnt, log)?;
                    let applied = apply_layer(&mnt, layer);
                    mounted.unmount(log)?;
                    applied.map_err(|e| match e {
                        BuildError::NoSpace(what) => BuildError::NoSpace(format!(
                            "{what} (image chains hold {} MiB)",
                            self.layer_disk_size >> 20
                        )),
                        e => e,
                    })?;
                }
                Step::Finish => {
                    let mounted = Mounted::new(&raw, &mnt, log)?;
                    let scripts = scripts::materialize(&self.templates_dir())?;
                    let mut cmd = Command::new(scripts.join("finish.sh"));
                    cmd.arg("--agent")
                        .arg(&self.agent)
                        .arg("--tree")
                        .arg(&mnt)
                        .arg("--key")
                        .arg(&s.key);
                    let finished = run::run_ok("finishing the image (finish.sh)", &mut cmd, log);
                    mounted.unmount(log)?;
                    finished?;
                    let mut cmd = Command::new("tune2fs");
                    cmd.args(["-O", "has_journal"]).arg(&raw);
                    run::run_ok("adding the journal (tune2fs)", &mut cmd, log)?;
                }
            }
            let path = layer_path(store, &s.key);
            let parent = out.last().map(|l| l.path.clone());
            let bytes = store_layer(&raw, parent.as_deref(), &path, self.layer_disk_size)?;
            log(&format!(
                "stored {} as {} ({} KiB)",
                s.what,
                s.key,
                bytes >> 10
            ));
            out.push(StoredLayer {
                key: s.key.clone(),
                path,
                what: s.what.clone(),
                made: true,
                bytes,
            });
        }
        Ok(out)
    }
}

/// The chain `steps` when all its layers are stored.
fn stored(store: &Path, steps: &[Planned], config: &ImageConfig) -> Option<LayeredTemplate> {
    let layers: Vec<StoredLayer> = steps
        .iter()
        .map(|s| {
            let path = layer_path(store, &s.key);
            path.is_file().then(|| StoredLayer {
                key: s.key.clone(),
                bytes: disk_bytes(&path),
                path,
                what: s.what.clone(),
                made: false,
            })
        })
        .collect::<Option<_>>()?;
    let top = layers.last()?;
    Some(LayeredTemplate {
        template: Template {
            key: top.key.clone(),
            rootfs: top.path.clone(),
            config: config.clone(),
            cached: true,
        },
        layers,
    })
}

/// The filesystem image `raw` (of `size` bytes) as the chain whose top is
/// `top` reads.
fn materialize(top: &Path, raw: &Path, size: u64) -> Result<()> {
    let disk = LayeredDisk::open(top).map_err(|e| layer_err(top, e))?;
    let f = fs::File::create(raw)
        .map_err(|e| BuildError::io(format!("creating {}", raw.display()), e))?;
    f.set_len(size)
        .map_err(|e| BuildError::io(format!("sizing {}", raw.display()), e))?;
    let mut buf = vec![0u8; CHUNK];
    for (start, len) in disk.held_ranges() {
        let mut pos = start;
        while pos < start + len {
            let n = (start + len - pos).min(CHUNK as u64) as usize;
            disk.read_at(&mut buf[..n], pos)
                .map_err(|e| layer_err(top, e))?;
            f.write_all_at(&buf[..n], pos)
                .map_err(|e| BuildError::io(format!("writing {}", raw.display()), e))?;
            pos += n as u64;
        }
    }
    Ok(())
}

fn layer_err(path: &Path, e: disk_layers::Error) -> BuildError {
    BuildError::io(
        format!("image layer {}", path.display()),
        std::io::Error::other(e),
    )
}

/// Stores the blocks of `raw` that differ from the chain whose top is
/// `parent` (nothing: from zeros) as a new shared sealed layer at `path`;
/// returns the bytes it takes. Made under a temporary name, renamed.
fn store_layer(raw: &Path, parent: Option<&Path>, path: &Path, size: u64) -> Result<u64> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    let made = (|| {
        let disk = match parent {
            Some(p) => LayeredDisk::create(p, &tmp),
            None => LayeredDisk::create_blank(&tmp, size),
        }
        .map_err(|e| layer_err(&tmp, e))?;
        let f = fs::File::open(raw)
            .map_err(|e| BuildError::io(format!("opening {}", raw.display()), e))?;
        // What the image holds, and what the chain below holds (a block it
        // holds may have become a hole; it reads as zeros now).
        let mut ranges = data_ranges(&f, size)
            .map_err(|e| BuildError::io(format!("reading the extents of {}", raw.display()), e))?;
        ranges.extend(disk.held_ranges().into_iter().map(|(s, l)| (s, s + l)));
        let (mut new, mut old) = (vec![0u8; CHUNK], vec![0u8; CHUNK]);
        for (start, end) in merge(ranges) {
            let mut pos = start;
            while pos < end {
                let n = (end - pos).min(CHUNK as u64) as usize;
                f.read_exact_at(&mut new[..n], pos)
                    .map_err(|e| BuildError::io(format!("reading {}", raw.display()), e))?;
                disk.read_at(&mut old[..n], pos)
                    .map_err(|e| layer_err(&tmp, e))?;
                // Runs of changed blocks, each one write.
                let mut b = 0;
                while b < n {
                    let differs = |at: usize| {
                        let hi = (at + BLOCK).min(n);
                        new[at..hi] != old[at..hi]
                    };
                    if !differs(b) {
                        b += BLOCK;
                        continue;
                    }
                    let mut e = b + BLOCK;
                    while e < n && differs(e) {
                        e += BLOCK;
                    }
                    let e = e.min(n);
                    disk.write_at(&new[b..e], pos + b as u64)
                        .map_err(|err| layer_err(&tmp, err))?;
                    b = e;
                }
                pos += n as u64;
            }
        }
        disk.seal_shared().map_err(|e| layer_err(&tmp, e))?;
        drop(disk);
        fs::rename(&tmp, path)
            .map_err(|e| BuildError::io(format!("renaming to {}", path.display()), e))?;
        if let Some(dir) = path.parent() {
            fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| BuildError::io(format!("syncing {}", dir.display()), e))?;
        }
        Ok(disk_bytes(path))
    })();
    if made.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    made
}

/// The `(start, end)` byte ranges of `f` (of `size` bytes) that hold data
/// (not holes), block-aligned.
fn data_ranges(f: &fs::File, size: u64) -> std::io::Result<Vec<(u64, u64)>> {
    use nix::unistd::{Whence, lseek};
    let mut out = Vec::new();
    let mut pos: i64 = 0;
    let end = i64::try_from(size).map_err(std::io::Error::other)?;
    while pos < end {
        let start = match lseek(f, pos, Whence::SeekData) {
            Ok(s) => s,
            // No data past `pos`.
            Err(nix::errno::Errno::ENXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let stop = lseek(f, start, Whence::SeekHole)?.min(end);
        let block = BLOCK as u64;
        out.push((
            (start as u64) / block * block,
            (stop as u64).div_ceil(block) * block,
        ));
        pos = stop;
    }
    Ok(out)
}

/// `(start, end)` ranges sorted, overlapping and adjacent ones merged.
fn merge(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (s, e) in ranges {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// A filesystem image mounted through a loop device; unmounted when
/// dropped (a failed build), or by [`Mounted::unmount`], which says whether
/// it worked.
struct Mounted {
    point: PathBuf,
    mounted: bool,
}

impl Mounted {
    fn new(image: &Path, point: &Path, log: &mut dyn FnMut(&str)) -> Result<Mounted> {
        let mut cmd = Command::new("mount");
        // No atime writes: reading a file must not change its blocks.
        cmd.args(["-t", "ext4", "-o", "loop,noatime"])
            .arg(image)
            .arg(point);
        run::run_ok("mounting the image (mount -o loop)", &mut cmd, log)?;
        Ok(Mounted {
            point: point.to_owned(),
            mounted: true,
        })
    }

    fn unmount(mut self, log: &mut dyn FnMut(&str)) -> Result<()> {
        self.mounted = false;
        let mut cmd = Command::new("umount");
        cmd.arg(&self.point);
        run::run_ok("unmounting the image", &mut cmd, log).map(drop)
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new("umount").arg(&self.point).status();
        }
    }
}

//! `LayeredDisk`: a writable top layer over a shared chain, with positioned reads
//! and writes, flush, and seal-and-branch.

use std::collections::BTreeSet;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::chain::{Chain, MAX_DEPTH, RawBase};
use crate::error::{Error, Result, io_err};
use crate::format::{
    BITMAP_OFFSET, Header, MAX_CLUSTER_SHIFT, MAX_DISK_SIZE, MIN_CLUSTER_SHIFT, Parent, SLOT_SIZE,
};
use crate::layer::{LayerFile, bit, is_layer, random_id, record_parent, set_bit, sync_dir};

/// The cluster size of layers made over a raw base unless told otherwise: the ext4
/// block size, so the guest's usual 4 KiB writes never copy data up from below.
pub const DEFAULT_CLUSTER_SIZE: u64 = 4096;

/// Bitmap words per flushed bitmap page.
const WORDS_PER_PAGE: u64 = SLOT_SIZE / 8;
/// Clusters whose bits share one bitmap page.
const CLUSTERS_PER_PAGE: u64 = SLOT_SIZE * 8;

/// A disk made of a raw base, sealed layers shared with other disks, and one
/// writable top layer of its own.
///
/// All methods take `&self` and may be called from several threads: reads run in
/// parallel, writes and metadata changes are serialised. A [`flush`](Self::flush)
/// lets reads and writes go on while it waits for the disk.
#[derive(Debug)]
pub struct LayeredDisk {
    /// Serialises flushes (bitmap pages must reach the file in order) and keeps them
    /// out of a seal or a chain reload. Taken before `state`.
    flush_lock: Mutex<()>,
    state: RwLock<State>,
    size: u64,
    cluster_shift: u32,
}

#[derive(Debug)]
struct State {
    chain: Chain,
    /// `None` when the disk was opened on a sealed layer: it is then read-only and
    /// that layer is the last of `chain.sealed`.
    top: Option<Top>,
    /// Cluster -> where it lives: 0 base (or zeros), k <= chain.sealed.len() the
    /// k-th sealed layer, chain.sealed.len() + 1 the top.
    index: Vec<u16>,
}

#[derive(Debug)]
struct Top {
    layer: LayerFile,
    /// The same file, shared so a flush can wait on it without holding the state lock.
    sync: Arc<File>,
    /// Bitmap pages with bits set since the last flush.
    dirty_pages: BTreeSet<u64>,
}

impl Top {
    fn new(layer: LayerFile) -> Result<Top> {
        let sync = layer
            .file
            .try_clone()
            .map_err(io_err("cannot duplicate the handle of", &layer.path))?;
        Ok(Top {
            layer,
            sync: Arc::new(sync),
            dirty_pages: BTreeSet::new(),
        })
    }

    /// The bytes of the dirty bitmap pages, taking them off the dirty list.
    fn take_dirty_pages(&mut self) -> Vec<(u64, Vec<u8>)> {
        let bm = &self.layer.bitmap;
        let pages = std::mem::take(&mut self.dirty_pages);
        pages
            .into_iter()
            .map(|p| {
                let lo = (p * WORDS_PER_PAGE) as usize;
                let hi = (lo + WORDS_PER_PAGE as usize).min(bm.len());
                let bytes = bm[lo..hi].iter().flat_map(|w| w.to_le_bytes()).collect();
                (p, bytes)
            })
            .collect()
    }
}

/// Data first, then the bitmap pages that point at it: a bit reaches the disk only
/// after its cluster's data did, so a crash never exposes unwritten data.
fn write_back(file: &File, pages: &[(u64, Vec<u8>)]) -> io::Result<()> {
    file.sync_data()?;
    if pages.is_empty() {
        return Ok(());
    }
    for (p, bytes) in pages {
        file.write_all_at(bytes, BITMAP_OFFSET + p * SLOT_SIZE)?;
    }
    file.sync_data()
}

impl LayeredDisk {
    /// Creates a new writable layer file at `top` over `base` and opens the disk.
    ///
    /// `base` is either a raw image (the disk then has its size) or a sealed layer
    /// (whose chain is opened and verified). A raw base gets
    /// [`DEFAULT_CLUSTER_SIZE`]; a layer base imposes its own.
    pub fn create(base: &Path, top: &Path) -> Result<LayeredDisk> {
        Self::create_inner(base, top, None)
    }

    /// As [`create`](Self::create) with a chosen cluster size (a power of two from
    /// 4 KiB to 2 MiB). Over a layer it must equal that layer's.
    pub fn create_with_cluster_size(
        base: &Path,
        top: &Path,
        cluster_size: u64,
    ) -> Result<LayeredDisk> {
        Self::create_inner(base, top, Some(cluster_size))
    }

    fn create_inner(base: &Path, top: &Path, cluster_size: Option<u64>) -> Result<LayeredDisk> {
        let shift = match cluster_size {
            Some(cs) => {
                let shift = cs.trailing_zeros();
                if !cs.is_power_of_two()
                    || !(MIN_CLUSTER_SHIFT..=MAX_CLUSTER_SHIFT).contains(&shift)
                {
                    return Err(Error::InvalidArgument(format!(
                        "cluster size {cs} is not a power of two from 4 KiB to 2 MiB"
                    )));
                }
                Some(shift)
            }
            None => None,
        };
        let (chain, parent, cluster_shift, size) = if is_layer(base)? {
            let parent = LayerFile::open(base, false)?;
            if !parent.header.sealed {
                return Err(Error::ParentNotSealed {
                    layer: top.to_owned(),
                    parent: base.to_owned(),
                });
            }
            let h = parent.header.clone();
            if shift.is_some_and(|s| s != h.cluster_shift) {
                return Err(Error::Geometry {
                    path: top.to_owned(),
                    reason: format!(
                        "asked for {}-byte clusters over a layer of {}-byte clusters",
                        cluster_size.unwrap_or_default(),
                        1u64 << h.cluster_shift
                    ),
                });
            }
            let mut chain = Chain::open_below(base, &h)?;
            if chain.sealed.len() >= MAX_DEPTH {
                return Err(Error::ChainTooLong {
                    depth: chain.sealed.len() + 1,
                    max: MAX_DEPTH,
                });
            }
            chain.sealed.push(Arc::new(parent));
            let recorded = Parent::Layer {
                path: record_parent(top, base)?,
                id: h.id,
            };
            (chain, recorded, h.cluster_shift, h.disk_size)
        } else {
            let file = File::open(base).map_err(io_err("cannot open base image", base))?;
            let size = file
                .metadata()
                .map_err(io_err("cannot stat base image", base))?
                .len();
            if size == 0 || size > MAX_DISK_SIZE {
                return Err(Error::InvalidArgument(format!(
                    "base image {} has {size} bytes; a disk needs 1 byte to 64 TiB",
                    base.display()
                )));
            }
            let chain = Chain {
                base: Some(Arc::new(RawBase {
                    path: base.to_owned(),
                    file,
                    size,
                })),
                sealed: Vec::new(),
            };
            let recorded = Parent::Raw {
                path: record_parent(top, base)?,
                size,
            };
            let shift = shift.unwrap_or(DEFAULT_CLUSTER_SIZE.trailing_zeros());
            (chain, recorded, shift, size)
        };
        let header = Header {
            generation: 1,
            sealed: false,
            shared: false,
            cluster_shift,
            disk_size: size,
            id: random_id()?,
            parent,
            bitmap_crc: 0,
            allocated: 0,
        };
        let layer = LayerFile::create(top, header, true)?;
        let header = layer.header.clone();
        Self::assemble(chain, Some(Top::new(layer)?), &header)
    }

    /// Creates a new writable layer at `top` over nothing (never-written clusters
    /// read as zeros) for a disk of `disk_size` bytes, in [`DEFAULT_CLUSTER_SIZE`]
    /// clusters: the bottom of a chain that has no raw base, e.g. an image's
    /// layers (its first layer holds the empty filesystem).
    pub fn create_blank(top: &Path, disk_size: u64) -> Result<LayeredDisk> {
        if disk_size == 0 || disk_size > MAX_DISK_SIZE {
            return Err(Error::InvalidArgument(format!(
                "a disk of {disk_size} bytes; a disk needs 1 byte to 64 TiB"
            )));
        }
        let header = Header {
            generation: 1,
            sealed: false,
            shared: false,
            cluster_shift: DEFAULT_CLUSTER_SIZE.trailing_zeros(),
            disk_size,
            id: random_id()?,
            parent: Parent::None,
            bitmap_crc: 0,
            allocated: 0,
        };
        let layer = LayerFile::create(top, header, true)?;
        let header = layer.header.clone();
        Self::assemble(Chain::default(), Some(Top::new(layer)?), &header)
    }

    /// Opens the disk whose top layer is `top`, verifying every layer of its chain
    /// (headers, bitmaps, lengths, parent identities). A sealed `top` opens read-only.
    pub fn open(top: &Path) -> Result<LayeredDisk> {
        let layer = match LayerFile::open(top, true) {
            // A sealed layer may have lost its write permission; it needs none.
            Err(Error::Io { source, .. }) if source.kind() == io::ErrorKind::PermissionDenied => {
                LayerFile::open(top, false)?
            }
            other => other?,
        };
        let mut chain = Chain::open_below(top, &layer.header)?;
        let header = layer.header.clone();
        let top = if layer.header.sealed {
            chain.sealed.push(Arc::new(layer));
            None
        } else {
            Some(Top::new(layer)?)
        };
        Self::assemble(chain, top, &header)
    }

    /// `header` is the topmost layer's: `top`'s, or the last sealed one's without a top.
    fn assemble(chain: Chain, top: Option<Top>, header: &Header) -> Result<LayeredDisk> {
        let (size, cluster_shift) = (header.disk_size, header.cluster_shift);
        let clusters = header.layout().clusters;
        let index = chain.index(clusters, top.as_ref().map(|t| &t.layer.bitmap[..]));
        Ok(LayeredDisk {
            flush_lock: Mutex::new(()),
            state: RwLock::new(State { chain, top, index }),
            size,
            cluster_shift,
        })
    }

    /// The disk size in bytes.
    pub fn len(&self) -> u64 {
        self.size
    }

    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_shift
    }

    /// Whether the top is sealed (the disk was opened on a sealed layer).
    pub fn is_read_only(&self) -> bool {
        self.read().top.is_none()
    }

    /// The files of the chain, top first: the top layer, the sealed layers, the raw
    /// base (if any), as they were opened.
    pub fn chain_paths(&self) -> Vec<PathBuf> {
        let st = self.read();
        let mut out: Vec<PathBuf> = st.top.iter().map(|t| t.layer.path.clone()).collect();
        out.extend(st.chain.sealed.iter().rev().map(|l| l.path.clone()));
        out.extend(st.chain.base.iter().map(|b| b.path.clone()));
        out
    }

    /// Number of layers (sealed and top), the raw base not counted.
    pub fn depth(&self) -> usize {
        let st = self.read();
        st.chain.sealed.len() + usize::from(st.top.is_some())
    }

    /// Layers compaction may fold: the top and the sealed layers above the
    /// topmost shared one (all of them when none is shared).
    pub fn foldable_depth(&self) -> usize {
        let st = self.read();
        let above = st
            .chain
            .sealed
            .iter()
            .rev()
            .take_while(|l| !l.header.shared)
            .count();
        above + usize::from(st.top.is_some())
    }

    /// Clusters held by the top layer.
    pub fn top_allocated_clusters(&self) -> u64 {
        self.read().top.as_ref().map_or(0, |t| t.layer.allocated())
    }

    fn read(&self) -> RwLockReadGuard<'_, State> {
        // A panic under the lock cannot leave the state half-changed in a way reads
        // care about (bits are set only after data is written), so carry on.
        self.state.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(PoisonError::into_inner)
    }

    fn flush_guard(&self) -> MutexGuard<'_, ()> {
        self.flush_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn check(&self, offset: u64, len: usize) -> Result<u64> {
        let len = len as u64;
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(end),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                size: self.size,
            }),
        }
    }

    /// Fills `buf` from byte `offset` of the disk. Each run of clusters that live in
    /// the same layer is one `pread`, found in the merged index whatever the depth.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let end = self.check(offset, buf.len())?;
        let st = self.read();
        let shift = self.cluster_shift;
        let mut pos = offset;
        let mut rest = buf;
        while pos < end {
            let first = pos >> shift;
            let last = (end - 1) >> shift;
            let src = st.index[first as usize];
            let mut c = first + 1;
            while c <= last && st.index[c as usize] == src {
                c += 1;
            }
            let run_end = (c << shift).min(end);
            let (now, later) = rest.split_at_mut((run_end - pos) as usize);
            st.read_src(src, now, pos)?;
            rest = later;
            pos = run_end;
        }
        Ok(())
    }

    /// Writes `buf` at byte `offset` of the disk into the top layer. A cluster written
    /// only in part for the first time is first copied up whole from below.
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let end = self.check(offset, buf.len())?;
        let mut guard = self.write();
        let State { chain, top, index } = &mut *guard;
        let Some(top) = top.as_mut() else {
            return Err(Error::ReadOnly {
                path: chain
                    .sealed
                    .last()
                    .map(|l| l.path.clone())
                    .unwrap_or_default(),
            });
        };
        if buf.is_empty() {
            return Ok(());
        }
        let shift = self.cluster_shift;
        let size = self.size;
        let cluster_end = |c: u64| ((c + 1) << shift).min(size);
        // Only the first and the last cluster of a request can be partial.
        let partial_new = |top: &Top, c: u64| {
            let (lo, hi) = ((c << shift).max(offset), cluster_end(c).min(end));
            !bit(&top.layer.bitmap, c) && (lo > c << shift || hi < cluster_end(c))
        };
        let first = offset >> shift;
        let last = (end - 1) >> shift;
        let mut direct = (offset, end);
        if partial_new(top, first) {
            copy_up(chain, top, index, first, buf, offset)?;
            direct.0 = cluster_end(first).min(end);
        }
        if last > first && partial_new(top, last) {
            copy_up(chain, top, index, last, buf, offset)?;
            direct.1 = last << shift;
        }
        if direct.0 < direct.1 {
            let data = &buf[(direct.0 - offset) as usize..(direct.1 - offset) as usize];
            top.layer
                .file
                .write_all_at(data, top.layer.layout.data_start + direct.0)
                .map_err(io_err("cannot write layer", &top.layer.path))?;
        }
        // Only now that the data is in the file may the index point at it.
        let top_k = chain.sealed.len() as u16 + 1;
        for c in first..=last {
            if !bit(&top.layer.bitmap, c) {
                set_bit(&mut top.layer.bitmap, c);
                index[c as usize] = top_k;
                top.dirty_pages.insert(c / CLUSTERS_PER_PAGE);
            }
        }
        Ok(())
    }

    /// Makes every write that returned before this call durable: the data with
    /// `fdatasync`, then the allocation bitmap, synced again. Reads and writes go on
    /// while it waits; writes that race with it may or may not be covered.
    pub fn flush(&self) -> Result<()> {
        let _serial = self.flush_guard();
        let (file, path, pages) = {
            let mut st = self.write();
            let Some(top) = st.top.as_mut() else {
                return Ok(());
            };
            (
                top.sync.clone(),
                top.layer.path.clone(),
                top.take_dirty_pages(),
            )
        };
        write_back(&file, &pages).map_err(|e| {
            // Put the pages back so the next flush writes them again.
            if let Some(top) = self.write().top.as_mut() {
                top.dirty_pages.extend(pages.iter().map(|(p, _)| *p));
            }
            io_err("cannot flush layer", path)(e)
        })
    }

    /// Seals the current top and stacks fresh writable layers on it: this disk
    /// continues in a new top at `continue_at`, and one new disk is returned per
    /// path in `children`, in order. All share the sealed layers (and their open
    /// files) and see the same content at this instant; then they diverge.
    ///
    /// The new files are made first, the seal last, so a failure leaves this disk
    /// as it was (writable, its top unsealed) and removes what was created. A crash
    /// in between leaves new layers whose parent is not sealed: they are refused on
    /// open ([`Error::ParentNotSealed`]) and are garbage for [`crate::unreferenced`].
    ///
    /// Reads and writes that returned before this call are in the sealed layer;
    /// those that start after it go to the new top. Calls that race with it wait for
    /// it. To fork a consistent guest, the caller stops the guest's I/O (drains the
    /// virtqueues) before sealing, as it does for the memory snapshot.
    pub fn seal_and_branch(
        &self,
        continue_at: &Path,
        children: &[PathBuf],
    ) -> Result<Vec<LayeredDisk>> {
        let mut all: Vec<&Path> = vec![continue_at];
        all.extend(children.iter().map(PathBuf::as_path));
        for (i, p) in all.iter().enumerate() {
            if all[..i].contains(p) {
                return Err(Error::InvalidArgument(format!(
                    "{} is named twice",
                    p.display()
                )));
            }
        }
        let _serial = self.flush_guard();
        let mut st = self.write();
        let depth = st.chain.sealed.len() + usize::from(st.top.is_some());
        if depth > MAX_DEPTH {
            return Err(Error::ChainTooLong {
                depth,
                max: MAX_DEPTH,
            });
        }
        let (parent_path, parent_header) = {
            let l = st.top_layer()?;
            (l.path.clone(), l.header.clone())
        };

        let created = create_children(
            &parent_path,
            parent_header.id,
            (self.cluster_shift, self.size),
            &all,
        )?;
        let sealed = (|| {
            if let Some(top) = st.top.as_mut() {
                let pages = top.take_dirty_pages();
                if let Err(e) = write_back(&top.sync, &pages) {
                    top.dirty_pages.extend(pages.iter().map(|(p, _)| *p));
                    return Err(io_err("cannot flush layer", &top.layer.path)(e));
                }
                top.layer.seal(false)?;
            }
            Ok(())
        })();
        if let Err(e) = sealed {
            for l in &created {
                let _ = std::fs::remove_file(&l.path);
            }
            return Err(e);
        }

        if let Some(old) = st.top.take() {
            st.chain.sealed.push(Arc::new(old.layer));
        }
        let mut states = Vec::with_capacity(created.len());
        for layer in created {
            states.push(State {
                chain: st.chain.clone(),
                top: Some(Top::new(layer)?),
                index: st.index.clone(),
            });
        }
        let mut states = states.into_iter();
        if let Some(own) = states.next() {
            *st = own;
        }
        Ok(states
            .map(|state| LayeredDisk {
                flush_lock: Mutex::new(()),
                state: RwLock::new(state),
                size: self.size,
                cluster_shift: self.cluster_shift,
            })
            .collect())
    }
}

/// A writable layer made ahead of a seal for a disk to continue in
/// ([`LayeredDisk::prepare_continuation`]), so that the seal itself
/// ([`LayeredDisk::seal_and_continue`]) creates no file. Dropped unused, its
/// file is removed.
#[derive(Debug)]
pub struct Continuation {
    top: Option<Top>,
    /// The id of the top it was made to stack on.
    parent_id: [u8; 16],
}

impl Continuation {
    /// Where the new layer is.
    pub fn path(&self) -> &Path {
        self.top
            .as_ref()
            .map_or(Path::new(""), |t| t.layer.path.as_path())
    }
}

impl Drop for Continuation {
    fn drop(&mut self) {
        if let Some(top) = self.top.take() {
            let _ = std::fs::remove_file(&top.layer.path);
        }
    }
}

/// A layer a seal made read-only, as children stack on it
/// ([`SealedLayer::stack`]): no open disk is needed for that.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealedLayer {
    pub path: PathBuf,
    pub id: [u8; 16],
    cluster_shift: u32,
    disk_size: u64,
}

impl SealedLayer {
    /// Creates one new writable layer per path in `children` on this sealed
    /// layer, durable when it returns (made together, synced together, one
    /// directory sync per directory). The children see the disk as it was at
    /// the seal, whatever the disk that was sealed writes afterwards (it
    /// writes to its own new top). Nothing is opened but the new files: a
    /// child's index is built when it opens its layer. On failure every file
    /// made here is removed.
    pub fn stack(&self, children: &[PathBuf]) -> Result<()> {
        for (i, p) in children.iter().enumerate() {
            if children[..i].contains(p) || *p == self.path {
                return Err(Error::InvalidArgument(format!(
                    "{} is named twice",
                    p.display()
                )));
            }
        }
        let paths: Vec<&Path> = children.iter().map(PathBuf::as_path).collect();
        create_children(
            &self.path,
            self.id,
            (self.cluster_shift, self.disk_size),
            &paths,
        )?;
        Ok(())
    }
}

/// Creates one new writable layer per path in `paths` on the layer at
/// `parent` (id `parent_id`), of `(cluster_shift, disk_size)`, durable when
/// it returns; on failure every file made here is removed.
fn create_children(
    parent: &Path,
    parent_id: [u8; 16],
    (cluster_shift, disk_size): (u32, u64),
    paths: &[&Path],
) -> Result<Vec<LayerFile>> {
    let mut created: Vec<LayerFile> = Vec::with_capacity(paths.len());
    let made = (|| {
        for p in paths {
            let header = Header {
                generation: 1,
                sealed: false,
                shared: false,
                cluster_shift,
                disk_size,
                id: random_id()?,
                parent: Parent::Layer {
                    path: record_parent(p, parent)?,
                    id: parent_id,
                },
                bitmap_crc: 0,
                allocated: 0,
            };
            created.push(LayerFile::create_unsynced(p, header)?);
        }
        // Their contents durable all at once rather than one after the
        // other: a journalling filesystem then commits them together
        // instead of once per child (a forked VM may stand still).
        sync_all(&created)?;
        // One directory sync for all the new entries of a directory.
        let mut synced: Vec<&Path> = Vec::new();
        for p in paths {
            let dir = p.parent().unwrap_or(Path::new(""));
            if !synced.contains(&dir) {
                sync_dir(p).map_err(io_err("cannot sync the directory of", *p))?;
                synced.push(dir);
            }
        }
        Ok(())
    })();
    if let Err(e) = made {
        for l in &created {
            let _ = std::fs::remove_file(&l.path);
        }
        return Err(e);
    }
    Ok(created)
}

impl LayeredDisk {
    /// Makes (durably) the writable layer at `at` this disk will continue in
    /// after its next [`seal_and_continue`](Self::seal_and_continue): stacked
    /// on the current top, which is not touched. The guest may go on writing
    /// meanwhile; this is the part of a fork that needs no pause.
    pub fn prepare_continuation(&self, at: &Path) -> Result<Continuation> {
        let (parent_path, parent_id, depth) = {
            let st = self.read();
            let Some(top) = st.top.as_ref() else {
                return Err(Error::ReadOnly {
                    path: st.top_layer()?.path.clone(),
                });
            };
            let depth = st.chain.sealed.len() + 1;
            (top.layer.path.clone(), top.layer.header.id, depth)
        };
        if depth > MAX_DEPTH {
            return Err(Error::ChainTooLong {
                depth,
                max: MAX_DEPTH,
            });
        }
        if at == parent_path {
            return Err(Error::InvalidArgument(format!(
                "{} is the disk's top",
                at.display()
            )));
        }
        let header = Header {
            generation: 1,
            sealed: false,
            shared: false,
            cluster_shift: self.cluster_shift,
            disk_size: self.size,
            id: random_id()?,
            parent: Parent::Layer {
                path: record_parent(at, &parent_path)?,
                id: parent_id,
            },
            bitmap_crc: 0,
            allocated: 0,
        };
        let layer = LayerFile::create(at, header, true)?;
        let top = match Top::new(layer) {
            Ok(top) => top,
            Err(e) => {
                let _ = std::fs::remove_file(at);
                return Err(e);
            }
        };
        Ok(Continuation {
            top: Some(top),
            parent_id,
        })
    }

    /// Seals the current top and continues in `next` (made for this top by
    /// [`prepare_continuation`](Self::prepare_continuation)): the flush of
    /// what was written, the seal, and a switch in memory; no file is made.
    /// Returns the sealed layer, for children to [stack](SealedLayer::stack)
    /// on later. On failure the disk is as it was and `next` is removed.
    ///
    /// As with [`seal_and_branch`](Self::seal_and_branch), the caller stops
    /// the guest's I/O first so that the seal is a consistent point.
    pub fn seal_and_continue(&self, mut next: Continuation) -> Result<SealedLayer> {
        // Every early return drops `next`, which removes its file.
        let _serial = self.flush_guard();
        let mut st = self.write();
        let Some(top) = st.top.as_mut() else {
            let path = st.top_layer().map(|l| l.path.clone()).unwrap_or_default();
            return Err(Error::ReadOnly { path });
        };
        if top.layer.header.id != next.parent_id {
            return Err(Error::InvalidArgument(format!(
                "{} was made for another top than {}",
                next.path().display(),
                top.layer.path.display()
            )));
        }
        let Some(new_top) = next.top.take() else {
            return Err(Error::NoLayer);
        };
        let pages = top.take_dirty_pages();
        let sealed = write_back(&top.sync, &pages)
            .map_err(io_err("cannot flush layer", &top.layer.path))
            .and_then(|()| top.layer.seal(false));
        if let Err(e) = sealed {
            top.dirty_pages.extend(pages.iter().map(|(p, _)| *p));
            next.top = Some(new_top);
            return Err(e);
        }
        let old = std::mem::replace(top, new_top);
        let sealed = SealedLayer {
            path: old.layer.path.clone(),
            id: old.layer.header.id,
            cluster_shift: self.cluster_shift,
            disk_size: self.size,
        };
        // The index stays right: the old top's clusters (k = sealed + 1) are
        // now the last sealed layer's, and the new top holds none yet.
        st.chain.sealed.push(Arc::new(old.layer));
        Ok(sealed)
    }
}

/// At most this many threads sync a branch's new layers.
const SYNC_THREADS: usize = 16;

/// Syncs every layer of `layers`, several at once.
fn sync_all(layers: &[LayerFile]) -> Result<()> {
    let per_thread = layers.len().div_ceil(SYNC_THREADS).max(1);
    std::thread::scope(|scope| {
        let threads: Vec<_> = layers
            .chunks(per_thread)
            .map(|chunk| scope.spawn(|| chunk.iter().try_for_each(LayerFile::sync_data)))
            .collect();
        threads.into_iter().try_for_each(|t| {
            t.join()
                .unwrap_or_else(|_| Err(Error::InvalidArgument("a sync thread panicked".into())))
        })
    })
}

impl LayeredDisk {
    /// Seals the top layer in place: what was written is flushed, the layer is
    /// sealed (it may be stacked on from now) and the disk is read-only. A disk
    /// opened read-only is left as it is.
    pub fn seal(&self) -> Result<()> {
        self.seal_top(false)
    }

    /// As [`seal`](Self::seal), marking the layer part of a shared base:
    /// [`crate::compact`] folds the layers above it and never it nor what lies
    /// beneath, so chains that stack on it keep sharing it (an image's layers,
    /// stored once per node).
    pub fn seal_shared(&self) -> Result<()> {
        self.seal_top(true)
    }

    fn seal_top(&self, shared: bool) -> Result<()> {
        let _serial = self.flush_guard();
        let mut st = self.write();
        let Some(mut top) = st.top.take() else {
            return Ok(());
        };
        let pages = top.take_dirty_pages();
        let sealed = write_back(&top.sync, &pages)
            .map_err(io_err("cannot flush layer", &top.layer.path))
            .and_then(|()| top.layer.seal(shared));
        if let Err(e) = sealed {
            top.dirty_pages.extend(pages.iter().map(|(p, _)| *p));
            st.top = Some(top);
            return Err(e);
        }
        st.chain.sealed.push(Arc::new(top.layer));
        Ok(())
    }

    /// The byte ranges `(offset, len)` of the disk that some layer holds (the
    /// rest reads from the raw base, or as zeros without one), adjacent
    /// clusters merged, in order.
    pub fn held_ranges(&self) -> Vec<(u64, u64)> {
        let st = self.read();
        let shift = self.cluster_shift;
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (c, &src) in st.index.iter().enumerate() {
            if src == 0 {
                continue;
            }
            let start = (c as u64) << shift;
            let len = (1u64 << shift).min(self.size - start);
            match out.last_mut() {
                Some(last) if last.0 + last.1 == start => last.1 += len,
                _ => out.push((start, len)),
            }
        }
        out
    }

    /// Re-opens the chain below the top from the files now at its paths, so a disk
    /// picks up a compaction ([`crate::compact`]) done since it was opened. The content
    /// is the same (a compacted layer keeps the id of the one it replaces and the
    /// ids are checked), only the chain is shorter. Safe at any time.
    pub fn reload_chain(&self) -> Result<()> {
        let _serial = self.flush_guard();
        let mut st = self.write();
        let chain = match &st.top {
            Some(t) => Chain::open_below(&t.layer.path, &t.layer.header)?,
            None => {
                // A read-only disk: its top is the last sealed layer.
                let old = st.chain.sealed.last().ok_or(Error::NoLayer)?;
                let fresh = LayerFile::open(&old.path, false)?;
                if fresh.header.id != old.header.id {
                    return Err(Error::ParentMismatch {
                        layer: old.path.clone(),
                        parent: old.path.clone(),
                        expected: format!("layer {}", crate::chain::hex(&old.header.id)),
                        found: format!("layer {}", crate::chain::hex(&fresh.header.id)),
                    });
                }
                let mut chain = Chain::open_below(&fresh.path, &fresh.header)?;
                chain.sealed.push(Arc::new(fresh));
                chain
            }
        };
        let clusters = self.size.div_ceil(self.cluster_size());
        st.index = chain.index(clusters, st.top.as_ref().map(|t| &t.layer.bitmap[..]));
        st.chain = chain;
        Ok(())
    }
}

impl State {
    /// The topmost layer: the writable top, or the sealed layer a read-only disk was
    /// opened on.
    fn top_layer(&self) -> Result<&LayerFile> {
        match (&self.top, self.chain.sealed.last()) {
            (Some(t), _) => Ok(&t.layer),
            (None, Some(l)) => Ok(l),
            (None, None) => Err(Error::NoLayer),
        }
    }

    fn read_src(&self, src: u16, buf: &mut [u8], pos: u64) -> Result<()> {
        match &self.top {
            Some(top) if usize::from(src) == self.chain.sealed.len() + 1 => top
                .layer
                .file
                .read_exact_at(buf, top.layer.layout.data_start + pos)
                .map_err(io_err("cannot read layer", &top.layer.path)),
            _ => self.chain.read_from(src, buf, pos).map_err(|e| {
                let path = match src {
                    0 => self.chain.base.as_ref().map(|b| b.path.clone()),
                    k => Some(self.chain.sealed[usize::from(k) - 1].path.clone()),
                };
                io_err("cannot read", path.unwrap_or_default())(e)
            }),
        }
    }
}

/// Writes cluster `c` whole into the top: the part of `buf` (written at `offset`)
/// that falls in it, the rest read from the layer that holds it now.
fn copy_up(chain: &Chain, top: &Top, index: &[u16], c: u64, buf: &[u8], offset: u64) -> Result<()> {
    let shift = top.layer.header.cluster_shift;
    let start = c << shift;
    let disk_end = (start + (1 << shift)).min(top.layer.header.disk_size);
    let mut data = vec![0u8; (disk_end - start) as usize];
    let src = index[c as usize];
    chain
        .read_from(src, &mut data, start)
        .map_err(|e| io_err("cannot copy up from below", top.layer.path.clone())(e))?;
    let lo = start.max(offset);
    let hi = disk_end.min(offset + buf.len() as u64);
    data[(lo - start) as usize..(hi - start) as usize]
        .copy_from_slice(&buf[(lo - offset) as usize..(hi - offset) as usize]);
    top.layer
        .file
        .write_all_at(&data, top.layer.layout.data_start + start)
        .map_err(io_err("cannot write layer", &top.layer.path))
}

impl Drop for LayeredDisk {
    /// A clean close keeps what was written, as closing a file does; a crash keeps
    /// what the last [`flush`](Self::flush) made durable.
    fn drop(&mut self) {
        // Nowhere to report a failure; what the last explicit flush covered is safe.
        let _ = self.flush();
    }
}

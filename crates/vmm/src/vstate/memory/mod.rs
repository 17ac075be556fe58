//! Guest physical memory and how it is backed.
//!
//! A booted VM's RAM is one memfd, mapped shared. A snapshot writes RAM to a
//! flat file (region after region, holes where nothing was ever written) and
//! then *maps the VM onto that file* privately: pages the guest has not written
//! since are page-cache pages shared with every VM restored from the same file,
//! and the pages it writes afterwards become private copies, which
//! `/proc/self/pagemap` lists. A diff snapshot writes only those into a new
//! sparse file and maps them from there in turn, so a VM's memory is a stack of
//! layers: a base file and overlays that each cover some page ranges.

mod discard;
mod file_ranges;
mod pagemap;
mod prefetch;

use std::ffi::CStr;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap};

pub use discard::{DiscardError, discard};
pub use file_ranges::Range;

use crate::arch::x86_64::layout::ram_ranges;
pub use prefetch::read_ranges as read_working_set;

/// Guest memory as every part of the VMM sees it.
pub type GuestMemory = vm_memory::GuestMemoryMmap<()>;

/// A diff snapshot after this many layers writes a full image instead, so a
/// restore never maps more than a few files.
pub const MAX_LAYERS: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("creating the guest memory file: {0}")]
    Memfd(#[source] std::io::Error),
    #[error("sizing the guest memory file to {size} bytes: {source}")]
    Resize {
        size: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("mapping guest memory: {0}")]
    Map(#[from] vm_memory::mmap::FromRangesError),
    #[error("mapping guest memory: {0}")]
    MapRegion(String),
    #[error("memory file {}: {source}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("memory file {} holds {actual} bytes, the snapshot's memory is {expected}", path.display())]
    FileSize {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("reading which guest pages were written: {0}")]
    Pagemap(#[source] std::io::Error),
    #[error(
        "a diff snapshot needs a memory file to diff against: take a full snapshot of this VM first"
    )]
    NoBaseForDiff,
    #[error(
        "{}: this VM's memory is mapped from that file; a snapshot needs a new path",
        path.display()
    )]
    InUse { path: PathBuf },
    #[error("the snapshot's memory layout is invalid: {0}")]
    Layout(String),
}

fn file_err(path: &Path) -> impl FnOnce(std::io::Error) -> MemoryError + '_ {
    move |source| MemoryError::File {
        path: path.to_owned(),
        source,
    }
}

/// One stretch of guest RAM and where it sits in the flat memory file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionLayout {
    pub guest_addr: u64,
    pub len: u64,
    pub file_offset: u64,
}

/// One memory file of a snapshot. `ranges: None` is the base, which covers all
/// of memory; an overlay covers only its ranges (offsets in the flat file).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryLayer {
    pub path: PathBuf,
    pub ranges: Option<Vec<Range>>,
}

/// What a snapshot records about guest memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryState {
    pub regions: Vec<RegionLayout>,
    /// Base first, then overlays in the order they were written.
    pub layers: Vec<MemoryLayer>,
}

impl MemoryState {
    /// Total bytes of guest RAM, which is also the size of every memory file.
    /// Saturates: a state file's lengths may add up past `u64` (`validate`
    /// refuses those).
    pub fn size(&self) -> u64 {
        self.regions
            .iter()
            .fold(0u64, |total, r| total.saturating_add(r.len))
    }

    fn validate(&self) -> Result<(), MemoryError> {
        let bad = |m: &str| Err(MemoryError::Layout(m.into()));
        let mut offset = 0u64;
        for r in &self.regions {
            if r.file_offset != offset || r.len == 0 || r.len % 4096 != 0 {
                return bad("regions are not laid out back to back in whole pages");
            }
            let Some(end) = offset.checked_add(r.len) else {
                return bad("regions end past the 64-bit range");
            };
            offset = end;
        }
        match self.layers.split_first() {
            Some((base, overlays))
                if base.ranges.is_none() && overlays.iter().all(|o| o.ranges.is_some()) => {}
            _ => return bad("the first memory layer must be the only full one"),
        }
        let size = self.size();
        for layer in &self.layers[1..] {
            for &(start, end) in layer.ranges.iter().flatten() {
                if start >= end || end > size || start % 4096 != 0 || end % 4096 != 0 {
                    return bad("an overlay range is outside memory or not page aligned");
                }
            }
        }
        Ok(())
    }
}

/// Where the guest's pages come from now.
enum Backing {
    /// Booted: one memfd, mapped shared; the memfd holds every page.
    Memfd(File),
    /// Restored or snapshotted: layers mapped privately; written pages are
    /// private copies on top.
    Layers(Vec<(MemoryLayer, File)>),
}

/// Guest RAM with its backing.
pub struct GuestRam {
    mem: GuestMemory,
    regions: Vec<RegionLayout>,
    backing: Backing,
}

impl std::fmt::Debug for GuestRam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestRam")
            .field("mem", &self.mem)
            .field("regions", &self.regions)
            .finish_non_exhaustive()
    }
}

/// How much a snapshot of memory wrote.
#[derive(Clone, Copy, Debug, Default)]
pub struct MemoryWritten {
    pub bytes: u64,
}

/// Which memory a snapshot writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemorySnapshotKind {
    Full,
    Diff,
}

fn layout(size: u64) -> Vec<RegionLayout> {
    let mut offset = 0;
    ram_ranges(size)
        .into_iter()
        .map(|(guest_addr, len)| {
            let r = RegionLayout {
                guest_addr,
                len,
                file_offset: offset,
            };
            offset += len;
            r
        })
        .collect()
}

fn new_memfd() -> Result<File, MemoryError> {
    const NAME: &CStr = c"sandfork-guest-mem";
    // SAFETY: the name is a valid NUL-terminated string; the returned fd is
    // checked before use and owned by the File below.
    let fd = unsafe { libc::memfd_create(NAME.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(MemoryError::Memfd(std::io::Error::last_os_error()));
    }
    // SAFETY: fd is a freshly created, valid descriptor nobody else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Maps `[file_offset, file_offset + len)` of `file` privately over the host
/// range at `host`, replacing what was mapped there.
fn map_fixed_private(host: *mut u8, len: u64, file: &File, file_offset: u64) -> Result<(), String> {
    // SAFETY: `host..host+len` lies inside a guest memory mapping this process
    // owns (callers compute it from a region's bounds); MAP_FIXED replaces those
    // pages atomically, and the VM is paused so nothing uses them meanwhile.
    let p = unsafe {
        libc::mmap(
            host.cast(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
            file.as_raw_fd(),
            file_offset as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error().to_string());
    }
    Ok(())
}

impl GuestRam {
    /// Allocates `size` bytes of guest RAM in one memfd, mapped shared.
    pub fn new(size: u64) -> Result<Self, MemoryError> {
        let file = new_memfd()?;
        file.set_len(size)
            .map_err(|source| MemoryError::Resize { size, source })?;
        let regions = layout(size);
        let mut ranges = Vec::new();
        for r in &regions {
            let fo = FileOffset::new(file.try_clone().map_err(MemoryError::Memfd)?, r.file_offset);
            ranges.push((GuestAddress(r.guest_addr), r.len as usize, Some(fo)));
        }
        let mem = GuestMemory::from_ranges_with_files(ranges)?;
        Ok(GuestRam {
            mem,
            regions,
            backing: Backing::Memfd(file),
        })
    }

    /// Maps a snapshot's memory: its base file privately, then each overlay's
    /// ranges over it. Nothing is read: pages come in as the guest touches them.
    pub fn restore(state: &MemoryState) -> Result<Self, MemoryError> {
        state.validate()?;
        let size = state.size();
        let mut layers = Vec::with_capacity(state.layers.len());
        for layer in &state.layers {
            let file = File::open(&layer.path).map_err(file_err(&layer.path))?;
            let actual = file.metadata().map_err(file_err(&layer.path))?.len();
            if actual != size {
                return Err(MemoryError::FileSize {
                    path: layer.path.clone(),
                    expected: size,
                    actual,
                });
            }
            layers.push((layer.clone(), file));
        }
        let base = &layers[0].1;
        let mut regions = Vec::with_capacity(state.regions.len());
        for r in &state.regions {
            let fo = FileOffset::new(
                base.try_clone().map_err(file_err(&state.layers[0].path))?,
                r.file_offset,
            );
            let mapping = MmapRegionBuilder::new(r.len as usize)
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
                .with_file_offset(fo)
                .build()
                .map_err(|e| MemoryError::MapRegion(e.to_string()))?;
            let region = GuestRegionMmap::new(mapping, GuestAddress(r.guest_addr))
                .ok_or_else(|| MemoryError::MapRegion("region past the address space".into()))?;
            regions.push(region);
        }
        let mem = GuestMemory::from_regions(regions)
            .map_err(|e| MemoryError::MapRegion(e.to_string()))?;
        let ram = GuestRam {
            mem,
            regions: state.regions.clone(),
            backing: Backing::Layers(Vec::new()),
        };
        for (layer, file) in &layers[1..] {
            ram.map_ranges(file, layer.ranges.as_deref().unwrap_or_default())?;
        }
        Ok(GuestRam {
            backing: Backing::Layers(layers),
            ..ram
        })
    }

    pub fn guest_memory(&self) -> &GuestMemory {
        &self.mem
    }

    pub fn size(&self) -> u64 {
        self.regions.iter().map(|r| r.len).sum()
    }

    /// The host address of flat-file offset `offset`, and the bytes left in its region.
    fn host_range(&self, offset: u64) -> Option<(*mut u8, u64)> {
        let r = self
            .regions
            .iter()
            .find(|r| (r.file_offset..r.file_offset + r.len).contains(&offset))?;
        let region = self.mem.find_region(GuestAddress(r.guest_addr))?;
        let host = region
            .get_host_address(vm_memory::MemoryRegionAddress(0))
            .ok()?;
        let within = offset - r.file_offset;
        // SAFETY: `within` is inside the region, whose mapping is `r.len` long.
        Some((unsafe { host.add(within as usize) }, r.len - within))
    }

    /// Maps flat ranges of `file` over guest memory, split at region ends.
    fn map_ranges(&self, file: &File, ranges: &[Range]) -> Result<(), MemoryError> {
        for &(start, end) in ranges {
            let mut at = start;
            while at < end {
                let (host, left) = self
                    .host_range(at)
                    .ok_or_else(|| MemoryError::Layout(format!("offset {at:#x} is not RAM")))?;
                let len = left.min(end - at);
                map_fixed_private(host, len, file, at).map_err(MemoryError::MapRegion)?;
                at += len;
            }
        }
        Ok(())
    }

    /// Flat ranges whose content differs from the layers (written since the
    /// last snapshot or restore); for a memfd-backed VM, every page with data.
    fn written_ranges(&self) -> Result<Vec<Range>, MemoryError> {
        let mut out = Vec::new();
        for r in &self.regions {
            let (host, _) = self
                .host_range(r.file_offset)
                .ok_or_else(|| MemoryError::Layout("region without a mapping".into()))?;
            let ranges = match &self.backing {
                Backing::Memfd(file) => {
                    file_ranges::data_ranges(file, r.file_offset, r.file_offset + r.len)
                        .map_err(MemoryError::Memfd)?
                }
                Backing::Layers(_) => pagemap::private_pages(host, r.len)
                    .map_err(MemoryError::Pagemap)?
                    .into_iter()
                    .map(|(s, e)| (s + r.file_offset, e + r.file_offset))
                    .collect(),
            };
            out.extend(ranges);
        }
        Ok(out)
    }

    /// Flat ranges a full image must hold: every page with data in any layer,
    /// plus the pages written since.
    fn populated_ranges(&self) -> Result<Vec<Range>, MemoryError> {
        let written = self.written_ranges()?;
        let Backing::Layers(layers) = &self.backing else {
            return Ok(written);
        };
        let mut all = written;
        for (layer, file) in layers {
            let in_file =
                file_ranges::data_ranges(file, 0, self.size()).map_err(file_err(&layer.path))?;
            all = file_ranges::union(&all, &in_file);
        }
        Ok(all)
    }

    /// Writes memory to a new file at `path` (through a temporary file renamed
    /// into place, so a reader never sees half a file and a file this VM maps
    /// is never truncated), then maps the VM onto it. The guest must be paused
    /// and devices quiesced. Returns the layers a restore needs.
    pub fn snapshot(
        &mut self,
        kind: MemorySnapshotKind,
        path: &Path,
    ) -> Result<(MemoryState, MemoryWritten), MemoryError> {
        // Its layers are named by path in the state: a new file put in the
        // place of one would be read for that layer's pages on a restore.
        if let Backing::Layers(layers) = &self.backing
            && layers.iter().any(|(layer, _)| layer.path == path)
        {
            return Err(MemoryError::InUse {
                path: path.to_owned(),
            });
        }
        let layer_count = match &self.backing {
            Backing::Memfd(_) if kind == MemorySnapshotKind::Diff => {
                return Err(MemoryError::NoBaseForDiff);
            }
            Backing::Memfd(_) => 0,
            Backing::Layers(l) => l.len(),
        };
        let full = kind == MemorySnapshotKind::Full || layer_count >= MAX_LAYERS;
        if kind == MemorySnapshotKind::Diff && full {
            tracing::info!(
                "memory has {layer_count} layers; writing a full image instead of a diff"
            );
        }
        let ranges = if full {
            self.populated_ranges()?
        } else {
            file_ranges::union(&self.written_ranges()?, &[])
        };

        let tmp = temp_path(path);
        let written = self.write_ranges(&tmp, &ranges);
        let file = match written {
            Ok(f) => f,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        };
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            file_err(path)(e)
        })?;

        let new_layer = MemoryLayer {
            path: path.to_owned(),
            ranges: (!full).then(|| ranges.clone()),
        };
        let old = std::mem::replace(&mut self.backing, Backing::Layers(Vec::new()));
        let mut layers = match &old {
            Backing::Layers(l) if !full => l
                .iter()
                .map(|(layer, f)| Ok((layer.clone(), f.try_clone()?)))
                .collect::<std::io::Result<Vec<_>>>()
                .map_err(file_err(path))?,
            _ => Vec::new(),
        };
        let remap: Vec<Range> = if full {
            self.regions
                .iter()
                .map(|r| (r.file_offset, r.file_offset + r.len))
                .collect()
        } else {
            ranges.clone()
        };
        let mapped = self.map_ranges(&file, &remap);
        if let (Ok(()), Backing::Memfd(memfd)) = (&mapped, &old) {
            // Nothing maps the memfd any more; its pages would otherwise stay
            // allocated for as long as vm-memory keeps the descriptor.
            let _ = memfd.set_len(0);
        }
        layers.push((new_layer, file));
        self.backing = Backing::Layers(layers);
        mapped?;
        Ok((
            self.state(),
            MemoryWritten {
                bytes: file_ranges::total(&ranges),
            },
        ))
    }

    fn write_ranges(&self, path: &Path, ranges: &[Range]) -> Result<File, MemoryError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(file_err(path))?;
        file.set_len(self.size()).map_err(file_err(path))?;
        for &(start, end) in ranges {
            let mut at = start;
            while at < end {
                let (host, left) = self
                    .host_range(at)
                    .ok_or_else(|| MemoryError::Layout(format!("offset {at:#x} is not RAM")))?;
                let len = left.min(end - at) as usize;
                // SAFETY: `host..host+len` is inside a live guest mapping (see
                // host_range); the guest is paused, so the bytes do not change
                // while this shared view of them exists.
                let bytes = unsafe { std::slice::from_raw_parts(host, len) };
                file.write_all_at(bytes, at).map_err(file_err(path))?;
                at += len as u64;
            }
        }
        Ok(file)
    }

    /// The layers as a snapshot records them (empty while memfd-backed).
    pub fn state(&self) -> MemoryState {
        let layers = match &self.backing {
            Backing::Memfd(_) => Vec::new(),
            Backing::Layers(l) => l.iter().map(|(layer, _)| layer.clone()).collect(),
        };
        MemoryState {
            regions: self.regions.clone(),
            layers,
        }
    }
}

/// A sibling of `path` for writing before the rename.
fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

#[cfg(test)]
mod tests;

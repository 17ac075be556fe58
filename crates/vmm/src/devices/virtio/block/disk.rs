//! The disk behind a virtio-blk device: opening it, its size, and positioned I/O
//! straight between the file and guest memory (no bounce buffer).

use std::fs::{File, Metadata, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use vm_memory::bitmap::BitmapSlice;
use vm_memory::{GuestAddress, GuestMemoryBackend, VolatileSlice};

use crate::vstate::memory::GuestMemory;

/// The unit of virtio-blk addressing: capacities and request offsets count these.
pub const SECTOR_SIZE: u64 = 512;

/// Why a disk could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("disk image {} does not exist", path.display())]
    NotFound { path: PathBuf },
    #[error("cannot access disk image {}: {source}", path.display())]
    Access {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("disk image {} is a {kind}, not a regular file or block device", path.display())]
    NotADisk { path: PathBuf, kind: &'static str },
    #[error("cannot open disk image {} {mode}: {source}", path.display())]
    Open {
        path: PathBuf,
        mode: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("cannot determine the size of disk image {}: {source}", path.display())]
    Size {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("disk layer {}: {source}", path.display())]
    Layer {
        path: PathBuf,
        #[source]
        source: disk_layers::Error,
    },
    #[error("drive {0} is a raw image: forking a writable drive needs a layered disk")]
    NotLayered(String),
}

/// Where the sectors live.
enum Backend {
    /// A raw image or block device: I/O goes straight between it and guest memory.
    Raw(File),
    /// A stack of copy-on-write layers (see the disk-layers crate).
    Layered(Box<disk_layers::LayeredDisk>),
}

/// A layered disk deeper than this (after a fork) gets its sealed layers
/// folded into one in the background, so reads and restores stay cheap.
pub const COMPACT_ABOVE_DEPTH: usize = 8;

/// An open disk image and its geometry.
pub struct Disk {
    backend: Backend,
    capacity: u64,
    read_only: bool,
    /// A background compaction is running.
    compacting: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disk")
            .field("layered", &matches!(self.backend, Backend::Layered(_)))
            .field("capacity", &self.capacity)
            .field("read_only", &self.read_only)
            .finish()
    }
}

impl Disk {
    /// Opens a regular file or block device, read-only (`O_RDONLY`) or read-write.
    ///
    /// The capacity is the size in whole 512-byte sectors: a size that is not a
    /// multiple of 512 is rounded down and its tail is never read or written.
    pub fn open(path: &Path, read_only: bool) -> Result<Disk, BlockError> {
        // Check the type before opening: opening a FIFO would block.
        let meta = std::fs::metadata(path).map_err(|source| match source.kind() {
            io::ErrorKind::NotFound => BlockError::NotFound {
                path: path.to_owned(),
            },
            _ => BlockError::Access {
                path: path.to_owned(),
                source,
            },
        })?;
        check_kind(path, &meta)?;
        let layer_err = |source| BlockError::Layer {
            path: path.to_owned(),
            source,
        };
        if meta.file_type().is_file() && disk_layers::is_layer(path).map_err(layer_err)? {
            let layered = disk_layers::LayeredDisk::open(path).map_err(layer_err)?;
            if !read_only && layered.is_read_only() {
                return Err(BlockError::Open {
                    path: path.to_owned(),
                    mode: "read-write",
                    source: io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        "the layer is sealed; stack a writable layer on it",
                    ),
                });
            }
            return Ok(Disk {
                capacity: layered.len() / SECTOR_SIZE,
                backend: Backend::Layered(Box::new(layered)),
                read_only,
                compacting: Default::default(),
            });
        }

        let mode = if read_only { "read-only" } else { "read-write" };
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(|source| BlockError::Open {
                path: path.to_owned(),
                mode,
                source,
            })?;

        // The path may have been swapped between stat and open; trust only the fd.
        let size_err = |source| BlockError::Size {
            path: path.to_owned(),
            source,
        };
        let meta = file.metadata().map_err(size_err)?;
        check_kind(path, &meta)?;
        let bytes = if meta.file_type().is_block_device() {
            // st_size is 0 for block devices; seeking to the end gives their size
            // without an ioctl. pread/pwrite ignore the file position afterwards.
            (&file).seek(SeekFrom::End(0)).map_err(size_err)?
        } else {
            meta.len()
        };

        Ok(Disk {
            backend: Backend::Raw(file),
            capacity: bytes / SECTOR_SIZE,
            read_only,
            compacting: Default::default(),
        })
    }

    pub fn is_layered(&self) -> bool {
        matches!(self.backend, Backend::Layered(_))
    }

    /// Makes the layer a layered disk continues in after its next
    /// [`Disk::switch`], at `at`; the disk goes on meanwhile.
    pub fn prepare_continuation(&self, at: &Path) -> Result<disk_layers::Continuation, BlockError> {
        let Backend::Layered(layered) = &self.backend else {
            return Err(BlockError::NotLayered(at.display().to_string()));
        };
        layered
            .prepare_continuation(at)
            .map_err(|source| BlockError::Layer {
                path: at.to_owned(),
                source,
            })
    }

    /// Seals a layered disk's top and continues in `next` (made for it by
    /// [`Disk::prepare_continuation`]); returns the sealed layer, for
    /// children to stack on. The device must be quiet.
    pub fn switch(
        &self,
        next: disk_layers::Continuation,
    ) -> Result<disk_layers::SealedLayer, BlockError> {
        let path = next.path().to_owned();
        let Backend::Layered(layered) = &self.backend else {
            return Err(BlockError::NotLayered(path.display().to_string()));
        };
        layered
            .seal_and_continue(next)
            .map_err(|source| BlockError::Layer { path, source })
    }

    /// Capacity in 512-byte sectors.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// Whether `sectors` sectors starting at `sector` lie inside the disk.
    pub fn contains(&self, sector: u64, sectors: u64) -> bool {
        sector
            .checked_add(sectors)
            .is_some_and(|end| end <= self.capacity)
    }

    /// Layers in the chain, the raw base not counted (0 for a raw disk).
    pub fn depth(&self) -> usize {
        match &self.backend {
            Backend::Raw(_) => 0,
            Backend::Layered(layered) => layered.depth(),
        }
    }

    /// When the chain is deeper than [`COMPACT_ABOVE_DEPTH`] above its shared
    /// base (an image's layers), folds its sealed layers above that base into
    /// one on a background thread, then switches this disk to the shorter
    /// chain. Other VMs sharing the old layers keep their open
    /// files; the folded layer replaces the old top-most sealed one by rename,
    /// with the same content. Returns the thread, if one was started.
    pub fn compact_in_background(
        self: &std::sync::Arc<Self>,
    ) -> Option<std::thread::JoinHandle<()>> {
        use std::sync::atomic::Ordering;
        let Backend::Layered(layered) = &self.backend else {
            return None;
        };
        // An image's shared layers are never folded (disk_layers::compact
        // stops above them), so only the layers above them count.
        if layered.foldable_depth() <= COMPACT_ABOVE_DEPTH
            || self.compacting.swap(true, Ordering::SeqCst)
        {
            return None;
        }
        // Top first: the top, then the sealed layers.
        let sealed = layered.chain_paths().get(1).cloned()?;
        let disk = self.clone();
        let spawned = std::thread::Builder::new()
            .name("disk-compact".into())
            .spawn(move || {
                let folded = disk_layers::compact(&sealed, usize::MAX);
                match (&disk.backend, folded) {
                    (Backend::Layered(layered), Ok(stats)) => match layered.reload_chain() {
                        Ok(()) => tracing::info!(
                            "disk {}: folded {} layers ({} bytes)",
                            sealed.display(),
                            stats.merged_layers,
                            stats.bytes
                        ),
                        Err(e) => {
                            tracing::warn!(
                                "disk {}: reloading after compaction: {e}",
                                sealed.display()
                            )
                        }
                    },
                    (_, Err(e)) => {
                        tracing::warn!("disk {}: compaction failed: {e}", sealed.display())
                    }
                    _ => {}
                }
                disk.compacting.store(false, Ordering::SeqCst);
            });
        match spawned {
            Ok(handle) => Some(handle),
            Err(e) => {
                tracing::warn!("cannot start a disk compaction: {e}");
                self.compacting.store(false, Ordering::SeqCst);
                None
            }
        }
    }

    /// Commits written data to stable storage (`fdatasync`).
    pub fn flush(&self) -> io::Result<()> {
        match &self.backend {
            Backend::Raw(file) => file.sync_data(),
            Backend::Layered(layered) => layered.flush().map_err(io::Error::other),
        }
    }

    /// Reads `len` bytes at byte `offset` of the disk into guest memory at `addr`.
    pub fn read_to_guest(
        &self,
        mem: &GuestMemory,
        addr: GuestAddress,
        len: usize,
        mut offset: u64,
    ) -> io::Result<()> {
        for slice in GuestMemoryBackend::get_slices(mem, addr, len) {
            let slice = slice.map_err(io::Error::other)?;
            match &self.backend {
                Backend::Raw(file) => pread_exact(file, &slice, offset)?,
                Backend::Layered(layered) => {
                    // The layers resolve clusters to files: bounce through a buffer.
                    let mut buf = vec![0u8; slice.len()];
                    layered
                        .read_at(&mut buf, offset)
                        .map_err(io::Error::other)?;
                    slice.copy_from(&buf);
                }
            }
            offset += slice.len() as u64;
        }
        Ok(())
    }

    /// Writes `len` bytes of guest memory at `addr` to byte `offset` of the disk.
    pub fn write_from_guest(
        &self,
        mem: &GuestMemory,
        addr: GuestAddress,
        len: usize,
        mut offset: u64,
    ) -> io::Result<()> {
        if self.read_only {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "the disk is read-only",
            ));
        }
        for slice in GuestMemoryBackend::get_slices(mem, addr, len) {
            let slice = slice.map_err(io::Error::other)?;
            match &self.backend {
                Backend::Raw(file) => pwrite_all(file, &slice, offset)?,
                Backend::Layered(layered) => {
                    let mut buf = vec![0u8; slice.len()];
                    slice.copy_to(&mut buf[..]);
                    layered.write_at(&buf, offset).map_err(io::Error::other)?;
                }
            }
            offset += slice.len() as u64;
        }
        Ok(())
    }
}

fn pread_exact<B: BitmapSlice>(
    file: &File,
    slice: &VolatileSlice<B>,
    offset: u64,
) -> io::Result<()> {
    let guard = slice.ptr_guard_mut();
    let mut done = 0;
    let result = loop {
        if done == slice.len() {
            break Ok(());
        }
        let pos = file_offset(offset, done)?;
        // SAFETY: `guard` covers `slice.len()` bytes of mapped guest memory that stay
        // mapped while it lives; the kernel writes at most `slice.len() - done` bytes
        // starting `done` bytes in, so it stays inside the slice. The fd is owned by
        // `file`, which outlives the call.
        let n = unsafe {
            libc::pread(
                file.as_raw_fd(),
                guard.as_ptr().add(done).cast(),
                slice.len() - done,
                pos,
            )
        };
        match n {
            0 => {
                break Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the disk image shrank under the device",
                ));
            }
            n if n < 0 => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    break Err(err);
                }
            }
            // n > 0 and at most the requested length, so it fits in usize.
            n => done += n.unsigned_abs(),
        }
    };
    // Mark the whole slice: after an error we do not know what the kernel wrote.
    slice.bitmap().mark_dirty(0, slice.len());
    result
}

fn pwrite_all<B: BitmapSlice>(
    file: &File,
    slice: &VolatileSlice<B>,
    offset: u64,
) -> io::Result<()> {
    let guard = slice.ptr_guard();
    let mut done = 0;
    while done < slice.len() {
        let pos = file_offset(offset, done)?;
        // SAFETY: `guard` covers `slice.len()` bytes of mapped guest memory that stay
        // mapped while it lives; the kernel reads at most `slice.len() - done` bytes
        // starting `done` bytes in. The fd is owned by `file`.
        let n = unsafe {
            libc::pwrite(
                file.as_raw_fd(),
                guard.as_ptr().add(done).cast(),
                slice.len() - done,
                pos,
            )
        };
        match n {
            0 => return Err(io::ErrorKind::WriteZero.into()),
            n if n < 0 => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
            n => done += n.unsigned_abs(),
        }
    }
    Ok(())
}

fn file_offset(offset: u64, done: usize) -> io::Result<libc::off_t> {
    offset
        .checked_add(done as u64)
        .and_then(|pos| libc::off_t::try_from(pos).ok())
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))
}

fn check_kind(path: &Path, meta: &Metadata) -> Result<(), BlockError> {
    let ft = meta.file_type();
    let kind = if ft.is_file() || ft.is_block_device() {
        return Ok(());
    } else if ft.is_dir() {
        "directory"
    } else if ft.is_char_device() {
        "character device"
    } else if ft.is_fifo() {
        "FIFO"
    } else if ft.is_socket() {
        "socket"
    } else {
        "special file"
    };
    Err(BlockError::NotADisk {
        path: path.to_owned(),
        kind,
    })
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use vm_memory::Bytes;

    use super::*;

    fn image(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        f.flush().unwrap();
        f
    }

    fn memory() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap()
    }

    #[test]
    fn a_layered_disk_keeps_guest_io_branches_and_compacts_deep_chains() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.img");
        std::fs::write(&base, vec![0u8; 1 << 20]).unwrap();
        let top = dir.path().join("top.layer");
        disk_layers::LayeredDisk::create(&base, &top).unwrap();
        let disk = std::sync::Arc::new(Disk::open(&top, false).unwrap());
        assert!(disk.is_layered());
        assert_eq!(disk.capacity(), 2048);

        let mem = memory();
        let mut last_sealed = None;
        // Each generation writes its number at its own sector, then forks.
        for generation in 0..=COMPACT_ABOVE_DEPTH as u8 {
            mem.write_slice(&[generation; 512], GuestAddress(0))
                .unwrap();
            disk.write_from_guest(&mem, GuestAddress(0), 512, u64::from(generation) * 512)
                .unwrap();
            let next = disk
                .prepare_continuation(&dir.path().join(format!("g{generation}.layer")))
                .unwrap();
            let child = dir.path().join(format!("c{generation}.layer"));
            let sealed = disk.switch(next).unwrap();
            sealed.stack(std::slice::from_ref(&child)).unwrap();
            last_sealed = Some(sealed);
        }
        assert_eq!(disk.depth(), COMPACT_ABOVE_DEPTH + 2);
        disk.compact_in_background()
            .expect("a deep chain is compacted")
            .join()
            .unwrap();
        assert_eq!(disk.depth(), 2, "the sealed layers are folded into one");
        for generation in 0..=COMPACT_ABOVE_DEPTH as u8 {
            disk.read_to_guest(&mem, GuestAddress(0x1000), 512, u64::from(generation) * 512)
                .unwrap();
            let mut back = [0u8; 512];
            mem.read_slice(&mut back, GuestAddress(0x1000)).unwrap();
            assert_eq!(back, [generation; 512]);
        }
        assert!(disk.compact_in_background().is_none(), "shallow now");
        // A child stacked on the last sealed layer after it was folded
        // (renamed over, with its id) sees every generation.
        let late = dir.path().join("late.layer");
        last_sealed
            .unwrap()
            .stack(std::slice::from_ref(&late))
            .unwrap();
        let late = disk_layers::LayeredDisk::open(&late).unwrap();
        for generation in 0..=COMPACT_ABOVE_DEPTH as u8 {
            let mut back = [0u8; 512];
            late.read_at(&mut back, u64::from(generation) * 512)
                .unwrap();
            assert_eq!(back, [generation; 512]);
        }
        // A raw image cannot be branched.
        let raw = Disk::open(&base, false).unwrap();
        assert!(matches!(
            raw.prepare_continuation(&dir.path().join("x")),
            Err(BlockError::NotLayered(_))
        ));
    }

    /// A disk over an image's layers (sealed shared) deeper than the
    /// bound: only the layers above them count, and a fold leaves them.
    #[test]
    fn an_images_shared_layers_are_never_folded() {
        let dir = tempfile::tempdir().unwrap();
        let layer = |n: usize| dir.path().join(format!("image{n}.layer"));
        let image = disk_layers::LayeredDisk::create_blank(&layer(0), 1 << 20).unwrap();
        image.seal_shared().unwrap();
        drop(image);
        for n in 1..=COMPACT_ABOVE_DEPTH + 2 {
            let image = disk_layers::LayeredDisk::create(&layer(n - 1), &layer(n)).unwrap();
            image.write_at(&[n as u8; 4096], n as u64 * 4096).unwrap();
            image.seal_shared().unwrap();
        }
        let top = dir.path().join("top.layer");
        disk_layers::LayeredDisk::create(&layer(COMPACT_ABOVE_DEPTH + 2), &top).unwrap();
        let disk = std::sync::Arc::new(Disk::open(&top, false).unwrap());
        assert_eq!(disk.depth(), COMPACT_ABOVE_DEPTH + 4);
        assert!(
            disk.compact_in_background().is_none(),
            "only shared layers below"
        );
        let files = disk_layers::chain_files(&top).unwrap();
        assert_eq!(files.len(), COMPACT_ABOVE_DEPTH + 4);
    }

    #[test]
    fn capacity_rounds_down_to_whole_sectors() {
        let f = image(&vec![7u8; 3 * 512 + 100]);
        let disk = Disk::open(f.path(), true).unwrap();
        assert_eq!(disk.capacity(), 3);
        assert!(disk.contains(0, 3));
        assert!(disk.contains(2, 1));
        assert!(!disk.contains(2, 2));
        assert!(!disk.contains(u64::MAX, 1));
    }

    #[test]
    fn missing_file_is_not_found() {
        let dir = tempfile::tempdir().unwrap();
        let err = Disk::open(&dir.path().join("nope.img"), false).unwrap_err();
        assert!(matches!(err, BlockError::NotFound { .. }), "{err}");
        assert!(err.to_string().contains("nope.img"));
    }

    #[test]
    fn directory_and_char_device_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = Disk::open(dir.path(), true).unwrap_err();
        assert!(
            matches!(
                err,
                BlockError::NotADisk {
                    kind: "directory",
                    ..
                }
            ),
            "{err}"
        );
        let err = Disk::open(Path::new("/dev/null"), true).unwrap_err();
        assert!(
            matches!(
                err,
                BlockError::NotADisk {
                    kind: "character device",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = Disk::open(&fifo, false).unwrap_err();
        assert!(
            matches!(err, BlockError::NotADisk { kind: "FIFO", .. }),
            "{err}"
        );
    }

    #[test]
    fn read_and_write_cross_guest_memory_directly() {
        let f = image(&(0..1024u32).map(|i| i as u8).collect::<Vec<_>>());
        let disk = Disk::open(f.path(), false).unwrap();
        let mem = memory();

        disk.read_to_guest(&mem, GuestAddress(0x100), 512, 512)
            .unwrap();
        let mut got = [0u8; 512];
        mem.read_slice(&mut got, GuestAddress(0x100)).unwrap();
        assert_eq!(
            got.to_vec(),
            (512..1024u32).map(|i| i as u8).collect::<Vec<_>>()
        );

        mem.write_slice(&[0xab; 512], GuestAddress(0x2000)).unwrap();
        disk.write_from_guest(&mem, GuestAddress(0x2000), 512, 0)
            .unwrap();
        let on_disk = std::fs::read(f.path()).unwrap();
        assert_eq!(&on_disk[..512], &[0xab; 512]);
        assert_eq!(on_disk[512], 0);
    }

    #[test]
    fn read_past_end_of_file_fails() {
        let f = image(&[1u8; 512]);
        let disk = Disk::open(f.path(), true).unwrap();
        let mem = memory();
        let err = disk
            .read_to_guest(&mem, GuestAddress(0), 1024, 0)
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn read_only_disk_refuses_writes() {
        let f = image(&[1u8; 512]);
        let disk = Disk::open(f.path(), true).unwrap();
        let mem = memory();
        let err = disk
            .write_from_guest(&mem, GuestAddress(0), 512, 0)
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        assert_eq!(std::fs::read(f.path()).unwrap(), vec![1u8; 512]);
    }

    #[test]
    fn guest_range_outside_memory_fails() {
        let f = image(&[1u8; 1024]);
        let disk = Disk::open(f.path(), false).unwrap();
        let mem = memory();
        assert!(
            disk.read_to_guest(&mem, GuestAddress(0x10000), 512, 0)
                .is_err()
        );
        assert!(
            disk.write_from_guest(&mem, GuestAddress(0xff00), 512, 0)
                .is_err()
        );
    }
}

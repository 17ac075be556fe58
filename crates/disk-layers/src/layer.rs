//! One layer file: creating it, opening and verifying it, and writing its metadata.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result, io_err};
use crate::format::{self, BITMAP_OFFSET, Header, Layout, MAGIC};

/// An open layer file with its verified header and bitmap.
#[derive(Debug)]
pub(crate) struct LayerFile {
    pub path: PathBuf,
    pub file: File,
    pub header: Header,
    pub layout: Layout,
    pub bitmap: Vec<u64>,
}

impl LayerFile {
    /// Opens and verifies a layer: a valid header slot, the full length, a bitmap with
    /// no bits past the disk end and, once sealed, matching its checksum and count.
    pub fn open(path: &Path, writable: bool) -> Result<LayerFile> {
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .open(path)
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => Error::NotFound {
                    path: path.to_owned(),
                },
                _ => io_err("cannot open layer", path)(e),
            })?;
        let actual = file
            .metadata()
            .map_err(io_err("cannot stat layer", path))?
            .len();
        let mut head = vec![0u8; BITMAP_OFFSET.min(actual) as usize];
        file.read_exact_at(&mut head, 0)
            .map_err(io_err("cannot read layer header", path))?;
        let header = Header::decode_slots(&head, path)?;
        let layout = header.layout();
        if actual < layout.file_len() {
            return Err(Error::Truncated {
                path: path.to_owned(),
                expected: layout.file_len(),
                actual,
            });
        }
        let mut raw = vec![0u8; layout.bitmap_bytes as usize];
        file.read_exact_at(&mut raw, BITMAP_OFFSET)
            .map_err(io_err("cannot read layer bitmap", path))?;
        let bitmap = format::bitmap_from_bytes(&raw, layout.clusters);
        let corrupt = |reason: String| Error::CorruptBitmap {
            path: path.to_owned(),
            reason,
        };
        if header.sealed {
            let crc = crc32fast::hash(&raw);
            if crc != header.bitmap_crc {
                return Err(corrupt(format!(
                    "checksum {crc:#010x}, header says {:#010x}",
                    header.bitmap_crc
                )));
            }
        }
        // Bits past the last cluster (in the last word or in padding) mean damage.
        let words = bitmap.len();
        let tail_bits = layout.clusters % 64;
        if tail_bits != 0 && words > 0 && bitmap[words - 1] >> tail_bits != 0 {
            return Err(corrupt(
                "clusters past the end of the disk are marked".into(),
            ));
        }
        if raw[words * 8..].iter().any(|&b| b != 0) {
            return Err(corrupt("bitmap padding is not zero".into()));
        }
        let allocated: u64 = bitmap.iter().map(|w| u64::from(w.count_ones())).sum();
        if header.sealed && allocated != header.allocated {
            return Err(corrupt(format!(
                "{allocated} clusters marked, header says {}",
                header.allocated
            )));
        }
        Ok(LayerFile {
            path: path.to_owned(),
            file,
            header,
            layout,
            bitmap,
        })
    }

    /// Creates a new, empty, writable layer at `path` (never replacing a file) and
    /// makes its content durable; its directory entry too if `sync_entry` (callers
    /// making several files in one directory sync it once with [`sync_dir`]).
    pub fn create(path: &Path, header: Header, sync_entry: bool) -> Result<LayerFile> {
        let layer = LayerFile::create_unsynced(path, header)?;
        let synced = layer.file.sync_data().and_then(|()| match sync_entry {
            true => sync_dir(path),
            false => Ok(()),
        });
        if let Err(e) = synced {
            let _ = std::fs::remove_file(path);
            return Err(io_err("cannot write new layer", path)(e));
        }
        Ok(layer)
    }

    /// [`LayerFile::create`] without making it durable: the caller syncs it
    /// ([`LayerFile::sync_data`]) before relying on it.
    pub(crate) fn create_unsynced(path: &Path, header: Header) -> Result<LayerFile> {
        let layout = header.layout();
        let bytes = header.encode().map_err(|reason| Error::CorruptHeader {
            path: path.to_owned(),
            reason,
        })?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| match e.kind() {
                io::ErrorKind::AlreadyExists => Error::Exists {
                    path: path.to_owned(),
                },
                _ => io_err("cannot create layer", path)(e),
            })?;
        let made = (|| {
            file.write_all_at(&bytes, header.slot_offset())?;
            // The whole data area as a hole: costs no space, fixes the length.
            file.set_len(layout.file_len())
        })();
        if let Err(e) = made {
            let _ = std::fs::remove_file(path);
            return Err(io_err("cannot write new layer", path)(e));
        }
        Ok(LayerFile {
            path: path.to_owned(),
            file,
            header,
            layout,
            bitmap: vec![0; layout.clusters.div_ceil(64) as usize],
        })
    }

    /// Makes what was written to the layer's file durable.
    pub(crate) fn sync_data(&self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(io_err("cannot write new layer", &self.path))
    }

    /// Writes `header` (with the next generation) to the other slot and syncs it.
    /// A crash mid-write leaves the previous slot valid.
    pub fn write_header(&mut self, mut header: Header) -> Result<()> {
        header.generation = self.header.generation + 1;
        let bytes = header.encode().map_err(|reason| Error::CorruptHeader {
            path: self.path.clone(),
            reason,
        })?;
        self.file
            .write_all_at(&bytes, header.slot_offset())
            .and_then(|()| self.file.sync_data())
            .map_err(io_err("cannot write layer header", &self.path))?;
        self.header = header;
        Ok(())
    }

    pub fn bitmap_bytes(&self) -> Vec<u8> {
        format::bitmap_to_bytes(&self.bitmap, self.layout.bitmap_bytes)
    }

    pub fn allocated(&self) -> u64 {
        self.bitmap.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// Seals the layer: bitmap, then a header with the sealed flag (and the shared
    /// one if `shared`) and the bitmap's checksum, each synced. The caller has
    /// flushed the data.
    pub fn seal(&mut self, shared: bool) -> Result<()> {
        let raw = self.bitmap_bytes();
        // All-zero pages are left as holes (a new layer's bitmap is one), so a
        // sealed layer costs only the pages its clusters are marked in.
        let written = (|| {
            for (i, page) in raw.chunks(format::SLOT_SIZE as usize).enumerate() {
                if page.iter().any(|&b| b != 0) {
                    let at = BITMAP_OFFSET + i as u64 * format::SLOT_SIZE;
                    self.file.write_all_at(page, at)?;
                }
            }
            self.file.sync_data()
        })();
        written.map_err(io_err("cannot write layer bitmap", &self.path))?;
        let header = Header {
            sealed: true,
            shared,
            bitmap_crc: crc32fast::hash(&raw),
            allocated: self.allocated(),
            ..self.header.clone()
        };
        self.write_header(header)
    }
}

pub(crate) fn bit(bitmap: &[u64], cluster: u64) -> bool {
    bitmap[(cluster / 64) as usize] & (1 << (cluster % 64)) != 0
}

pub(crate) fn set_bit(bitmap: &mut [u64], cluster: u64) {
    bitmap[(cluster / 64) as usize] |= 1 << (cluster % 64);
}

/// Calls `f` for every set bit.
pub(crate) fn for_each_bit(bitmap: &[u64], mut f: impl FnMut(u64)) {
    for (i, &w) in bitmap.iter().enumerate() {
        let mut w = w;
        while w != 0 {
            let b = w.trailing_zeros();
            f(i as u64 * 64 + u64::from(b));
            w &= w - 1;
        }
    }
}

/// Whether a file is a layer: the magic opens one of its two header slots.
/// Anything else is taken as a raw image.
pub fn is_layer(path: &Path) -> Result<bool> {
    let f = File::open(path).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => Error::NotFound {
            path: path.to_owned(),
        },
        _ => io_err("cannot open", path)(e),
    })?;
    for slot in 0..2 {
        let mut magic = [0u8; 8];
        match f.read_exact_at(&mut magic, slot * format::SLOT_SIZE) {
            Ok(()) if magic == MAGIC => return Ok(true),
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(false),
            Err(e) => return Err(io_err("cannot read", path)(e)),
        }
    }
    Ok(false)
}

/// Makes a new or renamed directory entry durable.
pub(crate) fn sync_dir(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

/// Where a parent recorded in `layer`'s header lives: relative paths are relative
/// to the layer's own directory, so a directory of layers can be moved whole.
pub(crate) fn resolve_parent(layer: &Path, recorded: &Path) -> PathBuf {
    if recorded.is_absolute() {
        return recorded.to_owned();
    }
    match layer.parent() {
        Some(d) => d.join(recorded),
        None => recorded.to_owned(),
    }
}

/// What to record for `parent` in a layer at `layer`: its file name when both share a
/// directory, its absolute path otherwise.
pub(crate) fn record_parent(layer: &Path, parent: &Path) -> Result<PathBuf> {
    let parent_abs = parent
        .canonicalize()
        .map_err(io_err("cannot resolve", parent))?;
    let layer_dir = match layer.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let layer_dir = layer_dir
        .canonicalize()
        .map_err(io_err("cannot resolve the directory of", layer))?;
    match (parent_abs.parent(), parent_abs.file_name()) {
        (Some(d), Some(name)) if d == layer_dir => Ok(PathBuf::from(name)),
        _ => Ok(parent_abs),
    }
}

/// Sixteen random bytes for a layer id.
pub(crate) fn random_id() -> Result<[u8; 16]> {
    let mut id = [0u8; 16];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut id))
        .map_err(io_err("cannot read", "/dev/urandom"))?;
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_set_and_iterate() {
        let mut bm = vec![0u64; 3];
        for c in [0, 63, 64, 130] {
            set_bit(&mut bm, c);
        }
        assert!(bit(&bm, 63) && bit(&bm, 64) && !bit(&bm, 65));
        let mut seen = Vec::new();
        for_each_bit(&bm, |c| seen.push(c));
        assert_eq!(seen, vec![0, 63, 64, 130]);
    }

    #[test]
    fn parents_in_the_same_directory_are_recorded_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.img");
        std::fs::write(&base, b"x").unwrap();
        let rec = record_parent(&dir.path().join("top.layer"), &base).unwrap();
        assert_eq!(rec, PathBuf::from("base.img"));
        let other = tempfile::tempdir().unwrap();
        let rec = record_parent(&other.path().join("top.layer"), &base).unwrap();
        assert!(rec.is_absolute());
        assert_eq!(
            resolve_parent(&dir.path().join("top.layer"), Path::new("base.img")),
            base
        );
    }
}

//! The on-disk layout of one layer file.
//!
//! ```text
//! 0          header slot 0 (4 KiB)  } two slots, written alternately; the valid one
//! 4096       header slot 1 (4 KiB)  } with the higher generation wins (torn-write safe)
//! 8192       allocation bitmap: bit c set = cluster c is held by this layer
//! data_start cluster c at data_start + c * cluster_size (sparse: holes cost nothing)
//! ```
//!
//! All integers little-endian. A slot ends with a CRC-32 of its first 4092 bytes.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

pub const MAGIC: [u8; 8] = *b"SFLAYER\0";
pub const VERSION: u32 = 1;
pub const SLOT_SIZE: u64 = 4096;
pub const BITMAP_OFFSET: u64 = 2 * SLOT_SIZE;
/// Longest parent path a header can hold.
pub const MAX_PARENT_PATH: usize = 3072;
pub const MIN_CLUSTER_SHIFT: u32 = 12;
pub const MAX_CLUSTER_SHIFT: u32 = 21;
/// Largest disk a layer describes (64 TiB); keeps every offset sum far from overflow.
pub const MAX_DISK_SIZE: u64 = 1 << 46;

const FLAG_SEALED: u32 = 1;
/// A shared base (an image's layer, used by many chains): compaction folds
/// the layers above it, never it.
const FLAG_SHARED: u32 = 2;
const CRC_AT: usize = SLOT_SIZE as usize - 4;
const PATH_AT: usize = 96;

/// What a layer sits on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parent {
    /// Nothing: never-written clusters read as zeros.
    None,
    /// A raw image (e.g. the ext4 base), identified by its size.
    Raw { path: PathBuf, size: u64 },
    /// A sealed layer, identified by its layer id.
    Layer { path: PathBuf, id: [u8; 16] },
}

impl Parent {
    pub fn path(&self) -> Option<&Path> {
        match self {
            Parent::None => None,
            Parent::Raw { path, .. } | Parent::Layer { path, .. } => Some(path),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub generation: u64,
    pub sealed: bool,
    /// Part of a shared base that [`crate::compact`] never folds (see
    /// [`crate::LayeredDisk::seal_shared`]); only sealed layers have it.
    pub shared: bool,
    pub cluster_shift: u32,
    pub disk_size: u64,
    /// Random at creation; children record it to detect a swapped parent. A compacted
    /// layer keeps the id of the layer it replaces because its content is the same.
    pub id: [u8; 16],
    pub parent: Parent,
    /// CRC-32 of the bitmap bytes; meaningful only once sealed.
    pub bitmap_crc: u32,
    /// Set bits in the bitmap; meaningful only once sealed.
    pub allocated: u64,
}

/// Where things are in a layer file of a given geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub cluster_size: u64,
    pub clusters: u64,
    pub bitmap_bytes: u64,
    pub data_start: u64,
}

impl Layout {
    pub fn new(cluster_shift: u32, disk_size: u64) -> Layout {
        let cluster_size = 1u64 << cluster_shift;
        let clusters = disk_size.div_ceil(cluster_size);
        // Whole 8-byte words (the in-memory form) rounded to pages (the flush unit).
        let bitmap_bytes = align_up(clusters.div_ceil(64) * 8, SLOT_SIZE);
        let data_start = align_up(BITMAP_OFFSET + bitmap_bytes, cluster_size.max(SLOT_SIZE));
        Layout {
            cluster_size,
            clusters,
            bitmap_bytes,
            data_start,
        }
    }

    /// The file length of a layer: the data area covers every cluster, as a hole
    /// until written, so a cut file is detected by its length alone.
    pub fn file_len(&self) -> u64 {
        self.data_start + self.clusters * self.cluster_size
    }

    pub fn cluster_offset(&self, cluster: u64) -> u64 {
        self.data_start + cluster * self.cluster_size
    }
}

pub fn align_up(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

impl Header {
    pub fn layout(&self) -> Layout {
        Layout::new(self.cluster_shift, self.disk_size)
    }

    /// The slot this header goes to: generations alternate between the two.
    pub fn slot_offset(&self) -> u64 {
        (self.generation % 2) * SLOT_SIZE
    }

    pub fn encode(&self) -> Result<Vec<u8>, String> {
        let mut b = vec![0u8; SLOT_SIZE as usize];
        b[0..8].copy_from_slice(&MAGIC);
        put32(&mut b, 8, VERSION);
        let flags =
            if self.sealed { FLAG_SEALED } else { 0 } | if self.shared { FLAG_SHARED } else { 0 };
        put32(&mut b, 12, flags);
        put64(&mut b, 16, self.generation);
        put32(&mut b, 24, self.cluster_shift);
        let (kind, parent_id, parent_size, path) = match &self.parent {
            Parent::None => (0, [0; 16], 0, &[][..]),
            Parent::Raw { path, size } => (1, [0; 16], *size, path.as_os_str().as_bytes()),
            Parent::Layer { path, id } => (2, *id, 0, path.as_os_str().as_bytes()),
        };
        put32(&mut b, 28, kind);
        put64(&mut b, 32, self.disk_size);
        b[40..56].copy_from_slice(&self.id);
        b[56..72].copy_from_slice(&parent_id);
        put64(&mut b, 72, parent_size);
        put32(&mut b, 80, self.bitmap_crc);
        if path.len() > MAX_PARENT_PATH {
            return Err(format!(
                "parent path of {} bytes exceeds {MAX_PARENT_PATH}",
                path.len()
            ));
        }
        put32(&mut b, 84, path.len() as u32);
        put64(&mut b, 88, self.allocated);
        b[PATH_AT..PATH_AT + path.len()].copy_from_slice(path);
        let crc = crc32fast::hash(&b[..CRC_AT]);
        put32(&mut b, CRC_AT, crc);
        Ok(b)
    }

    /// Decodes one slot. `Err(None)` = the slot holds no header at all (never written);
    /// `Err(Some(reason))` = it holds a damaged or unsupported one.
    fn decode(b: &[u8], path: &Path) -> Result<Header, SlotError> {
        if b.len() != SLOT_SIZE as usize {
            return Err(SlotError::Damaged("short slot".into()));
        }
        if b.iter().all(|&x| x == 0) {
            return Err(SlotError::Empty);
        }
        if b[0..8] != MAGIC {
            return Err(SlotError::Damaged(
                "bad magic (not a sandfork layer)".into(),
            ));
        }
        if crc32fast::hash(&b[..CRC_AT]) != get32(b, CRC_AT) {
            return Err(SlotError::Damaged("header checksum mismatch".into()));
        }
        let version = get32(b, 8);
        if version != VERSION {
            return Err(SlotError::Fatal(Error::UnsupportedVersion {
                path: path.to_owned(),
                version,
                supported: VERSION,
            }));
        }
        let flags = get32(b, 12);
        if flags & !(FLAG_SEALED | FLAG_SHARED) != 0 {
            return Err(SlotError::Damaged(format!("unknown flags {flags:#x}")));
        }
        let cluster_shift = get32(b, 24);
        if !(MIN_CLUSTER_SHIFT..=MAX_CLUSTER_SHIFT).contains(&cluster_shift) {
            return Err(SlotError::Damaged(format!(
                "cluster shift {cluster_shift} out of range"
            )));
        }
        let disk_size = get64(b, 32);
        if disk_size > MAX_DISK_SIZE {
            return Err(SlotError::Damaged(format!(
                "disk size {disk_size} too large"
            )));
        }
        let path_len = get32(b, 84) as usize;
        if path_len > MAX_PARENT_PATH {
            return Err(SlotError::Damaged(format!("parent path length {path_len}")));
        }
        let path_bytes = &b[PATH_AT..PATH_AT + path_len];
        // On Unix any byte string is a path.
        let parent_path = PathBuf::from(std::ffi::OsStr::from_bytes(path_bytes));
        let mut id = [0u8; 16];
        id.copy_from_slice(&b[40..56]);
        let mut parent_id = [0u8; 16];
        parent_id.copy_from_slice(&b[56..72]);
        let parent = match get32(b, 28) {
            0 if path_len == 0 => Parent::None,
            1 if path_len > 0 => Parent::Raw {
                path: parent_path,
                size: get64(b, 72),
            },
            2 if path_len > 0 => Parent::Layer {
                path: parent_path,
                id: parent_id,
            },
            kind => {
                return Err(SlotError::Damaged(format!(
                    "parent kind {kind} with a {path_len}-byte path"
                )));
            }
        };
        Ok(Header {
            generation: get64(b, 16),
            sealed: flags & FLAG_SEALED != 0,
            shared: flags & FLAG_SHARED != 0,
            cluster_shift,
            disk_size,
            id,
            parent,
            bitmap_crc: get32(b, 80),
            allocated: get64(b, 88),
        })
    }

    /// Picks the newest valid header of the two slots (the first 8 KiB of a layer).
    pub fn decode_slots(bytes: &[u8], path: &Path) -> Result<Header> {
        let corrupt = |reason: String| Error::CorruptHeader {
            path: path.to_owned(),
            reason,
        };
        if bytes.len() < BITMAP_OFFSET as usize {
            return Err(corrupt(format!("file is only {} bytes", bytes.len())));
        }
        let mut best: Option<Header> = None;
        let mut reasons = Vec::new();
        for slot in 0..2 {
            let at = slot * SLOT_SIZE as usize;
            match Header::decode(&bytes[at..at + SLOT_SIZE as usize], path) {
                Ok(h) if h.generation % 2 != slot as u64 => {
                    reasons.push(format!("slot {slot}: generation in the wrong slot"))
                }
                Ok(h) => {
                    if best.as_ref().is_none_or(|b| h.generation > b.generation) {
                        best = Some(h);
                    }
                }
                Err(SlotError::Empty) => reasons.push(format!("slot {slot}: empty")),
                Err(SlotError::Damaged(r)) => reasons.push(format!("slot {slot}: {r}")),
                Err(SlotError::Fatal(e)) => return Err(e),
            }
        }
        best.ok_or_else(|| corrupt(reasons.join("; ")))
    }
}

enum SlotError {
    Empty,
    Damaged(String),
    Fatal(Error),
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get32(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

fn get64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// The bitmap as stored: 64-bit little-endian words.
pub fn bitmap_to_bytes(words: &[u64], bitmap_bytes: u64) -> Vec<u8> {
    let mut out = vec![0u8; bitmap_bytes as usize];
    for (i, w) in words.iter().enumerate() {
        out[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    out
}

pub fn bitmap_from_bytes(bytes: &[u8], clusters: u64) -> Vec<u64> {
    let words = clusters.div_ceil(64) as usize;
    (0..words).map(|i| get64(bytes, i * 8)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            generation: 3,
            sealed: true,
            shared: true,
            cluster_shift: 16,
            disk_size: 5 << 30,
            id: [7; 16],
            parent: Parent::Layer {
                path: "parent.layer".into(),
                id: [9; 16],
            },
            bitmap_crc: 0xdead_beef,
            allocated: 42,
        }
    }

    fn slots(h: &Header) -> Vec<u8> {
        let mut bytes = vec![0u8; BITMAP_OFFSET as usize];
        let at = h.slot_offset() as usize;
        bytes[at..at + SLOT_SIZE as usize].copy_from_slice(&h.encode().unwrap());
        bytes
    }

    #[test]
    fn header_round_trips() {
        let h = header();
        assert_eq!(Header::decode_slots(&slots(&h), Path::new("x")).unwrap(), h);
        let raw = Header {
            parent: Parent::Raw {
                path: "/images/base.ext4".into(),
                size: 2 << 30,
            },
            generation: 2,
            ..h
        };
        assert_eq!(
            Header::decode_slots(&slots(&raw), Path::new("x")).unwrap(),
            raw
        );
    }

    #[test]
    fn newest_valid_slot_wins_and_a_torn_one_falls_back() {
        let new = header(); // generation 3, slot 1 as well
        let newer = Header {
            generation: 4,
            ..header()
        };
        let mut bytes = slots(&new);
        bytes[0..SLOT_SIZE as usize].copy_from_slice(&newer.encode().unwrap());
        assert_eq!(Header::decode_slots(&bytes, Path::new("x")).unwrap(), newer);
        // Tear slot 0 (the newer): slot 1 answers.
        bytes[100] ^= 0xff;
        assert_eq!(Header::decode_slots(&bytes, Path::new("x")).unwrap(), new);
    }

    #[test]
    fn damaged_headers_are_refused_with_reasons() {
        let mut bytes = slots(&header());
        bytes[4096 + 50] ^= 1;
        let err = Header::decode_slots(&bytes, Path::new("x")).unwrap_err();
        assert!(
            matches!(&err, Error::CorruptHeader { reason, .. } if reason.contains("checksum")),
            "{err}"
        );
        let err = Header::decode_slots(&[0u8; 8192], Path::new("x")).unwrap_err();
        assert!(matches!(&err, Error::CorruptHeader { reason, .. } if reason.contains("empty")));
        let err = Header::decode_slots(&[1u8; 100], Path::new("x")).unwrap_err();
        assert!(matches!(err, Error::CorruptHeader { .. }));
    }

    #[test]
    fn other_version_is_typed() {
        let mut b = header().encode().unwrap();
        put32(&mut b, 8, 99);
        let crc = crc32fast::hash(&b[..CRC_AT]);
        put32(&mut b, CRC_AT, crc);
        let mut bytes = vec![0u8; 8192];
        bytes[4096..].copy_from_slice(&b);
        let err = Header::decode_slots(&bytes, Path::new("x")).unwrap_err();
        assert!(matches!(err, Error::UnsupportedVersion { version: 99, .. }));
    }

    #[test]
    fn layout_aligns_data_to_clusters() {
        let l = Layout::new(16, 2 << 30);
        assert_eq!(l.clusters, 32768);
        assert_eq!(l.bitmap_bytes, 4096);
        assert_eq!(l.data_start, 65536);
        let l = Layout::new(12, 2 << 30);
        assert_eq!(l.bitmap_bytes, 65536);
        assert_eq!(l.data_start, 8192 + 65536);
        // A size that is not a whole number of clusters still gets its last cluster.
        let l = Layout::new(12, 4097);
        assert_eq!(l.clusters, 2);
        assert_eq!(l.file_len(), l.data_start + 8192);
    }
}

//! The read-only part of a disk: a raw base and the sealed layers over it, opened by
//! following parent references, and the merged index "cluster -> layer" built from
//! their bitmaps.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result, io_err};
use crate::format::{Header, Parent};
use crate::layer::{LayerFile, for_each_bit, resolve_parent};

/// Most sealed layers one chain may have; an index entry is a u16 and each layer
/// holds an open file, and a chain this deep is overdue for compaction anyway.
pub const MAX_DEPTH: usize = 1000;

/// A raw image at the bottom of a chain.
#[derive(Debug)]
pub(crate) struct RawBase {
    pub path: PathBuf,
    pub file: File,
    pub size: u64,
}

impl RawBase {
    /// Reads at `pos`; what lies past the end of the image reads as zeros.
    pub fn read_at(&self, buf: &mut [u8], pos: u64) -> io::Result<()> {
        let avail = self.size.saturating_sub(pos).min(buf.len() as u64) as usize;
        let (data, zeros) = buf.split_at_mut(avail);
        if !data.is_empty() {
            self.file.read_exact_at(data, pos)?;
        }
        zeros.fill(0);
        Ok(())
    }
}

/// The shared, immutable lower part of a disk. Cloning shares the open files.
#[derive(Clone, Debug, Default)]
pub(crate) struct Chain {
    pub base: Option<Arc<RawBase>>,
    /// Bottom to top; index value `k` (1-based) names `sealed[k - 1]`.
    pub sealed: Vec<Arc<LayerFile>>,
}

impl Chain {
    /// Opens everything below the layer at `path` whose header is `header`, checking
    /// each parent is the one recorded (layer id or raw size), sealed and of the same
    /// geometry.
    pub fn open_below(path: &Path, header: &Header) -> Result<Chain> {
        let mut chain = Chain::default();
        let mut child_path = path.to_owned();
        let mut child = header.clone();
        loop {
            match &child.parent {
                Parent::None => break,
                Parent::Raw {
                    path: recorded,
                    size,
                } => {
                    let p = resolve_parent(&child_path, recorded);
                    chain.base = Some(Arc::new(open_raw_parent(&child_path, &p, *size)?));
                    break;
                }
                Parent::Layer { path: recorded, id } => {
                    if chain.sealed.len() >= MAX_DEPTH {
                        return Err(Error::ChainTooLong {
                            depth: chain.sealed.len() + 1,
                            max: MAX_DEPTH,
                        });
                    }
                    let p = resolve_parent(&child_path, recorded);
                    let parent = LayerFile::open(&p, false).map_err(|e| match e {
                        Error::NotFound { .. } => Error::MissingParent {
                            layer: child_path.clone(),
                            parent: p.clone(),
                        },
                        e => e,
                    })?;
                    check_parent_layer(&child_path, &child, &parent, id)?;
                    child_path = p;
                    child = parent.header.clone();
                    chain.sealed.push(Arc::new(parent));
                }
            }
        }
        chain.sealed.reverse();
        Ok(chain)
    }

    /// The merged index: for every cluster, the topmost layer holding it (0 = the base
    /// or zeros). `top` is the bitmap of a writable layer above the chain, if any.
    pub fn index(&self, clusters: u64, top: Option<&[u64]>) -> Vec<u16> {
        let mut index = vec![0u16; clusters as usize];
        let bitmaps = self.sealed.iter().map(|l| &l.bitmap[..]).chain(top);
        for (k, bm) in bitmaps.enumerate() {
            // k + 1 <= MAX_DEPTH + 1, far below u16::MAX.
            let v = (k + 1) as u16;
            for_each_bit(bm, |c| index[c as usize] = v);
        }
        index
    }

    /// Reads `buf.len()` bytes at disk offset `pos` from the source `src` of the index
    /// (`src` never names a layer above the chain).
    pub fn read_from(&self, src: u16, buf: &mut [u8], pos: u64) -> io::Result<()> {
        match src {
            0 => match &self.base {
                Some(b) => b.read_at(buf, pos),
                None => {
                    buf.fill(0);
                    Ok(())
                }
            },
            k => {
                let l = &self.sealed[usize::from(k) - 1];
                l.file.read_exact_at(buf, l.layout.data_start + pos)
            }
        }
    }
}

fn open_raw_parent(child: &Path, path: &Path, size: u64) -> Result<RawBase> {
    let file = File::open(path).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => Error::MissingParent {
            layer: child.to_owned(),
            parent: path.to_owned(),
        },
        _ => io_err("cannot open base image", path)(e),
    })?;
    let found = file
        .metadata()
        .map_err(io_err("cannot stat base image", path))?
        .len();
    if found != size {
        return Err(Error::ParentMismatch {
            layer: child.to_owned(),
            parent: path.to_owned(),
            expected: format!("a raw image of {size} bytes"),
            found: format!("{found} bytes"),
        });
    }
    Ok(RawBase {
        path: path.to_owned(),
        file,
        size,
    })
}

fn check_parent_layer(
    child_path: &Path,
    child: &Header,
    parent: &LayerFile,
    id: &[u8; 16],
) -> Result<()> {
    if parent.header.id != *id {
        return Err(Error::ParentMismatch {
            layer: child_path.to_owned(),
            parent: parent.path.clone(),
            expected: format!("layer {}", hex(id)),
            found: format!("layer {}", hex(&parent.header.id)),
        });
    }
    if !parent.header.sealed {
        return Err(Error::ParentNotSealed {
            layer: child_path.to_owned(),
            parent: parent.path.clone(),
        });
    }
    if parent.header.cluster_shift != child.cluster_shift
        || parent.header.disk_size != child.disk_size
    {
        return Err(Error::Geometry {
            path: child_path.to_owned(),
            reason: format!(
                "{} bytes in {}-byte clusters over a parent of {} bytes in {}-byte clusters",
                child.disk_size,
                1u64 << child.cluster_shift,
                parent.header.disk_size,
                1u64 << parent.header.cluster_shift
            ),
        });
    }
    Ok(())
}

pub(crate) fn hex(id: &[u8; 16]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

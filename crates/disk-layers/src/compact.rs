//! Keeping chains short (compaction) and finding layer files nobody uses (for
//! garbage collection). Both work on files only, never on an open disk, so the
//! caller runs them on any thread while the disks keep serving I/O.

use std::collections::BTreeSet;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::chain::{Chain, MAX_DEPTH};
use crate::error::{Error, Result, io_err};
use crate::format::{BITMAP_OFFSET, Header, Parent};
use crate::layer::{
    LayerFile, for_each_bit, is_layer, record_parent, resolve_parent, set_bit, sync_dir,
};

/// Largest single copy during compaction.
const COPY_CHUNK: u64 = 1 << 20;

/// What a compaction did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompactStats {
    /// Sealed layers folded into the new file (1 = nothing to do).
    pub merged_layers: usize,
    /// Clusters written to the new file.
    pub clusters: u64,
    /// Bytes of cluster data copied.
    pub bytes: u64,
}

/// The file a compaction of `layer` writes before renaming it over `layer`.
pub fn compact_temp_path(layer: &Path) -> PathBuf {
    let mut name = layer.file_name().unwrap_or_default().to_os_string();
    name.push(".compact-tmp");
    layer.with_file_name(name)
}

/// Folds the sealed layer at `layer` and the `levels - 1` sealed layers beneath it
/// (fewer if the chain is shorter; `usize::MAX` = down to the raw base) into one
/// sealed layer that replaces `layer`. Layers sealed shared
/// ([`crate::LayeredDisk::seal_shared`]), and all beneath them, are never folded:
/// the fold stops above the topmost one.
///
/// The result is written to [`compact_temp_path`], synced, then renamed over
/// `layer`: no sealed layer is ever changed in place, and a crash leaves either the
/// old file or the new one (plus, at worst, a stale temporary file). The new layer
/// keeps the id of `layer`, whose content it has, so the layers stacked on it stay
/// valid. Disks that have the old files open keep reading them until they call
/// [`crate::LayeredDisk::reload_chain`]; the folded layers are then garbage unless
/// other chains still use them (ask [`unreferenced`]).
///
/// One compaction at a time per layer: the caller schedules them.
pub fn compact(layer: &Path, levels: usize) -> Result<CompactStats> {
    let target = LayerFile::open(layer, false)?;
    if !target.header.sealed {
        return Err(Error::NotSealed {
            path: layer.to_owned(),
        });
    }
    let chain = Chain::open_below(layer, &target.header)?;
    // What the bottom of the chain sits on: its raw base (resolved), or nothing.
    let base = chain.base.as_ref().map(|b| (b.path.clone(), b.size));
    let mut all = chain.sealed;
    let target_header = target.header.clone();
    let layout = target.layout;
    all.push(std::sync::Arc::new(target));
    // A shared base stays as it is: only the layers above it fold.
    let foldable = all.iter().rev().take_while(|l| !l.header.shared).count();
    let m = levels.min(foldable);
    if m < 2 {
        return Ok(CompactStats {
            merged_layers: 1,
            ..CompactStats::default()
        });
    }
    let merge = &all[all.len() - m..];
    // The new parent: the layer under the merged ones, or what the lowest one sat on.
    let parent = match all.len() - m {
        0 => match base {
            None => Parent::None,
            Some((path, size)) => Parent::Raw {
                path: record_parent(layer, &path)?,
                size,
            },
        },
        below => Parent::Layer {
            path: record_parent(layer, &all[below - 1].path)?,
            id: all[below - 1].header.id,
        },
    };

    let tmp = compact_temp_path(layer);
    // A leftover of a compaction that crashed: it was never renamed, nobody uses it.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(io_err("cannot remove stale", &tmp)(e));
        }
        _ => {}
    }
    let header = Header {
        generation: 1,
        sealed: false,
        shared: false,
        parent,
        bitmap_crc: 0,
        allocated: 0,
        ..target_header
    };
    let mut out = LayerFile::create(&tmp, header, false)?;
    let result = (|| {
        // Topmost holder of each cluster among the merged layers (0 = none of them).
        let mut src = vec![0u16; layout.clusters as usize];
        for (k, l) in merge.iter().enumerate() {
            for_each_bit(&l.bitmap, |c| src[c as usize] = k as u16 + 1);
        }
        let mut stats = CompactStats {
            merged_layers: m,
            ..CompactStats::default()
        };
        let chunk_clusters = (COPY_CHUNK / layout.cluster_size).max(1);
        let mut buf = vec![0u8; (chunk_clusters * layout.cluster_size) as usize];
        let mut c = 0u64;
        while c < layout.clusters {
            let k = src[c as usize];
            if k == 0 {
                c += 1;
                continue;
            }
            let mut n = 1;
            while n < chunk_clusters && c + n < layout.clusters && src[(c + n) as usize] == k {
                n += 1;
            }
            let l = &merge[usize::from(k) - 1];
            let bytes = &mut buf[..(n * layout.cluster_size) as usize];
            let at = layout.cluster_offset(c);
            l.file
                .read_exact_at(bytes, at)
                .map_err(io_err("cannot read layer", &l.path))?;
            out.file
                .write_all_at(bytes, at)
                .map_err(io_err("cannot write layer", &tmp))?;
            for i in c..c + n {
                set_bit(&mut out.bitmap, i);
            }
            stats.clusters += n;
            stats.bytes += bytes.len() as u64;
            c += n;
        }
        out.file
            .sync_data()
            .map_err(io_err("cannot sync layer", &tmp))?;
        out.seal(false)?;
        std::fs::rename(&tmp, layer).map_err(io_err("cannot rename compacted layer", &tmp))?;
        sync_dir(layer).map_err(io_err("cannot sync the directory of", layer))?;
        Ok(stats)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Every file the chain of the layer at `top` uses, top first, raw base last,
/// canonicalised. Reads headers only; a missing or damaged layer is an error (a
/// chain that cannot be walked must not lead to deletions).
pub fn chain_files(top: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut path = top.to_owned();
    loop {
        if out.len() > MAX_DEPTH + 1 {
            return Err(Error::ChainTooLong {
                depth: out.len(),
                max: MAX_DEPTH,
            });
        }
        let canon = path.canonicalize().map_err(|e| match e.kind() {
            io::ErrorKind::NotFound if out.is_empty() => Error::NotFound { path: path.clone() },
            io::ErrorKind::NotFound => Error::MissingParent {
                layer: out.last().cloned().unwrap_or_default(),
                parent: path.clone(),
            },
            _ => io_err("cannot resolve", &path)(e),
        })?;
        out.push(canon.clone());
        if out.len() > 1 && !is_layer(&canon)? {
            // A raw base ends the chain.
            break;
        }
        let header = read_header(&canon)?;
        match header.parent.path() {
            None => break,
            Some(recorded) => path = resolve_parent(&canon, recorded),
        }
    }
    Ok(out)
}

fn read_header(path: &Path) -> Result<Header> {
    let f = File::open(path).map_err(io_err("cannot open layer", path))?;
    let mut head = vec![0u8; BITMAP_OFFSET as usize];
    let n = read_up_to(&f, &mut head).map_err(io_err("cannot read layer header", path))?;
    Header::decode_slots(&head[..n], path)
}

fn read_up_to(f: &File, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Which of `candidates` (e.g. every file in the layer directory) no chain of
/// `live_tops` uses, in the order given: safe to delete once no open disk reads
/// them (an open disk keeps its files open, so even that is safe on Unix).
pub fn unreferenced(candidates: &[PathBuf], live_tops: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut used = BTreeSet::new();
    for top in live_tops {
        used.extend(chain_files(top)?);
    }
    let mut out = Vec::new();
    for c in candidates {
        let canon = c.canonicalize().map_err(io_err("cannot resolve", c))?;
        if !used.contains(&canon) {
            out.push(c.clone());
        }
    }
    Ok(out)
}

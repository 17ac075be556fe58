//! The memory files a VMM state file names, read and rewritten without the
//! VMM: a paused sandbox moving to another node takes its memory files
//! along, and the copy of its state must name where they landed.
//!
//! The state file is the VMM's (`sandfork-vmm`'s `snapshot::format`): a
//! 24-byte header (magic, format version, payload length, CRC-32 of the
//! payload), then a postcard payload that begins with the VMM version, the
//! vCPU count, the memory size and the memory layout: regions, then layers
//! (path, ranges), base first. Only that beginning is decoded here; the
//! rest is carried over byte for byte.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

const MAGIC: &[u8; 8] = b"SFRKSNAP";
const HEADER_LEN: usize = 24;
/// The VMM's state format version this reader knows.
const FORMAT_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}: not a sandfork VMM state file of format version {FORMAT_VERSION}")]
    Format(PathBuf),
    #[error("{0}: the state file is corrupted (length or checksum)")]
    Corrupt(PathBuf),
    #[error("{path}: its memory layout cannot be read: {reason}")]
    Decode { path: PathBuf, reason: String },
    #[error("{path}: names {found} memory files, {given} given")]
    LayerCount {
        path: PathBuf,
        found: usize,
        given: usize,
    },
}

/// The beginning of the VMM's `MicrovmState`, field for field.
#[derive(Serialize, Deserialize)]
struct Head {
    vmm_version: String,
    vcpu_count: u8,
    mem_size_mib: u64,
    regions: Vec<(u64, u64, u64)>,
    layers: Vec<Layer>,
}

#[derive(Serialize, Deserialize)]
struct Layer {
    path: PathBuf,
    ranges: Option<Vec<(u64, u64)>>,
}

fn read(path: &Path) -> Result<(Head, Vec<u8>), StateFileError> {
    let bytes = std::fs::read(path).map_err(|source| StateFileError::Io {
        path: path.to_owned(),
        source,
    })?;
    if bytes.len() < HEADER_LEN
        || &bytes[..8] != MAGIC
        || bytes[8..12] != FORMAT_VERSION.to_le_bytes()
    {
        return Err(StateFileError::Format(path.to_owned()));
    }
    let len = u64::from_le_bytes(bytes[12..20].try_into().unwrap_or_default());
    let crc = u32::from_le_bytes(bytes[20..24].try_into().unwrap_or_default());
    let payload = &bytes[HEADER_LEN..];
    if payload.len() as u64 != len || crc32fast::hash(payload) != crc {
        return Err(StateFileError::Corrupt(path.to_owned()));
    }
    let (head, rest) =
        postcard::take_from_bytes::<Head>(payload).map_err(|e| StateFileError::Decode {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
    Ok((head, rest.to_vec()))
}

/// The memory files the state at `path` maps, base first.
pub fn memory_files(path: &Path) -> Result<Vec<PathBuf>, StateFileError> {
    Ok(memory_layers(path)?.into_iter().map(|(p, _)| p).collect())
}

/// The memory files the state at `path` maps, base first, each with the
/// byte ranges of it the state reads (None: all of it, the base).
pub type MemoryLayer = (PathBuf, Option<Vec<(u64, u64)>>);

pub fn memory_layers(path: &Path) -> Result<Vec<MemoryLayer>, StateFileError> {
    Ok(read(path)?
        .0
        .layers
        .into_iter()
        .map(|l| (l.path, l.ranges))
        .collect())
}

/// Writes to `to` the state at `from` with its memory files renamed to
/// `files` (base first, one for each it names).
pub fn relocate(from: &Path, to: &Path, files: &[PathBuf]) -> Result<(), StateFileError> {
    let (mut head, rest) = read(from)?;
    if head.layers.len() != files.len() {
        return Err(StateFileError::LayerCount {
            path: from.to_owned(),
            found: head.layers.len(),
            given: files.len(),
        });
    }
    for (layer, file) in head.layers.iter_mut().zip(files) {
        layer.path = file.clone();
    }
    let mut payload = postcard::to_stdvec(&head).map_err(|e| StateFileError::Decode {
        path: from.to_owned(),
        reason: e.to_string(),
    })?;
    payload.extend_from_slice(&rest);
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    std::fs::write(to, out).map_err(|source| StateFileError::Io {
        path: to.to_owned(),
        source,
    })
}

/// Writing state files without a VMM, for tests here and in other crates.
/// Compiled always, not behind a feature: a feature only a dev-dependency
/// turned on would make `cargo test` relink the binaries `cargo build` made
/// (scripts/test.sh refuses a test build that does, as the lab runs them).
#[doc(hidden)]
pub mod test_support {
    use super::*;

    /// A state file as the VMM writes one: its head, then more state.
    pub fn state_file(path: &Path, layers: &[&str]) -> std::io::Result<()> {
        let head = Head {
            vmm_version: "0.1.0".into(),
            vcpu_count: 2,
            mem_size_mib: 256,
            regions: vec![(0, 256 << 20, 0)],
            layers: layers
                .iter()
                .enumerate()
                .map(|(i, p)| Layer {
                    path: p.into(),
                    ranges: (i > 0).then(|| vec![(4096, 8192)]),
                })
                .collect(),
        };
        let mut payload = postcard::to_stdvec(&head).map_err(std::io::Error::other)?;
        payload.extend_from_slice(b"the vcpus and devices");
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        out.extend_from_slice(&payload);
        std::fs::write(path, out)
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::state_file;
    use super::*;

    #[test]
    fn memory_files_are_read_and_renamed_the_rest_kept() {
        let dir = tempfile::tempdir().unwrap();
        let (from, to) = (dir.path().join("a.state"), dir.path().join("b.state"));
        state_file(
            &from,
            &["/n1/templates/base/vm.mem", "/n1/sandboxes/x/pause-1.mem"],
        )
        .unwrap();
        assert_eq!(
            memory_files(&from).unwrap(),
            [
                PathBuf::from("/n1/templates/base/vm.mem"),
                PathBuf::from("/n1/sandboxes/x/pause-1.mem")
            ]
        );
        let moved = [PathBuf::from("/n2/cache/aa"), PathBuf::from("/n2/cache/bb")];
        relocate(&from, &to, &moved).unwrap();
        assert_eq!(memory_files(&to).unwrap(), moved);
        let bytes = std::fs::read(&to).unwrap();
        assert!(bytes.ends_with(b"the vcpus and devices"));
        let (head, _) = read(&to).unwrap();
        assert_eq!(head.layers[1].ranges, Some(vec![(4096, 8192)]));
        assert!(matches!(
            relocate(&from, &to, &moved[..1]),
            Err(StateFileError::LayerCount { .. })
        ));
        // A flipped byte is refused.
        let mut bad = std::fs::read(&from).unwrap();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        std::fs::write(&from, bad).unwrap();
        assert!(matches!(
            memory_files(&from),
            Err(StateFileError::Corrupt(_))
        ));
    }
}

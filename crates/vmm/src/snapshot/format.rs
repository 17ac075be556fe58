//! The snapshot state file: a fixed header, then the state encoded with
//! postcard. The header carries a format version and a CRC32 of the payload,
//! so a file from another version, a truncated one or a corrupted one is
//! refused before anything is built from it.
//!
//! ```text
//! offset  size  field
//!      0     8  magic "SFRKSNAP"
//!      8     4  format version (little endian)
//!     12     8  payload length (little endian)
//!     20     4  CRC32 of the payload (little endian)
//!     24     n  payload
//! ```

use std::io::Write;
use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;

const MAGIC: &[u8; 8] = b"SFRKSNAP";
const HEADER_LEN: usize = 24;
/// Bump on any change to the state types (kvm-bindings structures are
/// encoded by layout, so a kvm-bindings upgrade counts too).
pub const FORMAT_VERSION: u32 = 1;
/// No state file comes near this; a larger length field means corruption.
const MAX_PAYLOAD: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{0}: not a sandfork snapshot (bad magic)")]
    Magic(String),
    #[error(
        "{path}: snapshot format version {found}, this VMM reads version {FORMAT_VERSION}; take the snapshot again with this version"
    )]
    Version { path: String, found: u32 },
    #[error("{path}: the snapshot is truncated ({actual} of {expected} bytes)")]
    Truncated {
        path: String,
        expected: u64,
        actual: u64,
    },
    #[error("{0}: the snapshot is corrupted (checksum mismatch)")]
    Checksum(String),
    #[error("{path}: the snapshot cannot be decoded: {reason}")]
    Decode { path: String, reason: String },
    #[error("encoding the snapshot: {0}")]
    Encode(String),
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Encodes `state` with its header.
pub fn encode<T: Serialize>(state: &T) -> Result<Vec<u8>, FormatError> {
    let payload = postcard::to_stdvec(state).map_err(|e| FormatError::Encode(e.to_string()))?;
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Checks the header and checksum of `bytes` (read from `path`) and decodes them.
pub fn decode<T: DeserializeOwned>(path: &str, bytes: &[u8]) -> Result<T, FormatError> {
    let truncated = |expected| FormatError::Truncated {
        path: path.to_owned(),
        expected,
        actual: bytes.len() as u64,
    };
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Err(FormatError::Magic(path.to_owned()));
    }
    let header = bytes
        .get(..HEADER_LEN)
        .ok_or(truncated(HEADER_LEN as u64))?;
    let field = |at: usize, len: usize| &header[at..at + len];
    let version = u32::from_le_bytes(field(8, 4).try_into().unwrap_or_default());
    if version != FORMAT_VERSION {
        return Err(FormatError::Version {
            path: path.to_owned(),
            found: version,
        });
    }
    let len = u64::from_le_bytes(field(12, 8).try_into().unwrap_or_default());
    let crc = u32::from_le_bytes(field(20, 4).try_into().unwrap_or_default());
    if len > MAX_PAYLOAD {
        return Err(FormatError::Checksum(path.to_owned()));
    }
    let expected = HEADER_LEN as u64 + len;
    if (bytes.len() as u64) < expected {
        return Err(truncated(expected));
    }
    if bytes.len() as u64 > expected {
        return Err(FormatError::Checksum(path.to_owned()));
    }
    let payload = &bytes[HEADER_LEN..];
    if crc32fast::hash(payload) != crc {
        return Err(FormatError::Checksum(path.to_owned()));
    }
    postcard::from_bytes(payload).map_err(|e| FormatError::Decode {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

/// Writes `bytes` to `path` through a temporary sibling renamed into place,
/// so `path` is either the old file or the whole new one.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), FormatError> {
    let io = |source| FormatError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(format!(".tmp-{}", std::process::id()));
    let tmp = path.with_file_name(name);
    let written = std::fs::File::create(&tmp).and_then(|mut f| f.write_all(bytes));
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    Ok(())
}

/// Reads and decodes the state file at `path`.
pub fn read<T: DeserializeOwned>(path: &Path) -> Result<T, FormatError> {
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| FormatError::Io {
        path: shown.clone(),
        source,
    })?;
    decode(&shown, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Sample {
        name: String,
        values: Vec<u64>,
    }

    fn sample() -> Sample {
        Sample {
            name: "vm".into(),
            values: vec![1, 2, u64::MAX],
        }
    }

    #[test]
    fn round_trips() {
        let bytes = encode(&sample()).unwrap();
        assert_eq!(decode::<Sample>("s", &bytes).unwrap(), sample());
    }

    #[test]
    fn every_single_byte_corruption_is_refused() {
        let bytes = encode(&sample()).unwrap();
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(
                decode::<Sample>("s", &bad).is_err(),
                "flip at byte {i} accepted"
            );
        }
    }

    #[test]
    fn truncation_and_trailing_bytes_are_refused() {
        let bytes = encode(&sample()).unwrap();
        for len in [0, 4, 8, 20, HEADER_LEN, bytes.len() - 1] {
            let err = decode::<Sample>("s", &bytes[..len]).unwrap_err();
            assert!(
                matches!(err, FormatError::Truncated { .. } | FormatError::Magic(_)),
                "{len}: {err}"
            );
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(matches!(
            decode::<Sample>("s", &long),
            Err(FormatError::Checksum(_))
        ));
    }

    #[test]
    fn another_version_is_refused_by_name() {
        let mut bytes = encode(&sample()).unwrap();
        bytes[8] = 99;
        let err = decode::<Sample>("snap", &bytes).unwrap_err();
        assert!(matches!(err, FormatError::Version { found: 99, .. }));
        assert!(err.to_string().contains("version 99"), "{err}");
    }

    #[test]
    fn a_huge_length_field_is_refused_without_allocating() {
        let mut bytes = encode(&sample()).unwrap();
        bytes[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode::<Sample>("s", &bytes).is_err());
    }

    #[test]
    fn writes_replace_the_file_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        write_atomically(&path, b"one").unwrap();
        write_atomically(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        let missing_dir = dir.path().join("no/such/dir/state");
        assert!(matches!(
            write_atomically(&missing_dir, b"x"),
            Err(FormatError::Io { .. })
        ));
    }
}

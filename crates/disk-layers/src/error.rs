//! Everything that can go wrong with a layered disk, typed so callers can tell a
//! missing file from a corrupt one from a guest asking for the impossible.

use std::io;
use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A layer or base image named on the command line does not exist.
    #[error("disk image {} does not exist", path.display())]
    NotFound { path: PathBuf },
    /// A layer names a parent (another layer or the base image) that is gone.
    #[error("layer {} names parent {}, which does not exist", layer.display(), parent.display())]
    MissingParent { layer: PathBuf, parent: PathBuf },
    /// The parent at the recorded path is not the image the layer was made over:
    /// another layer id, or a raw base of another size.
    #[error("layer {} expects parent {} to be {expected}, found {found}", layer.display(), parent.display())]
    ParentMismatch {
        layer: PathBuf,
        parent: PathBuf,
        expected: String,
        found: String,
    },
    /// Only sealed layers may have layers stacked on them.
    #[error("layer {} has parent {}, which is not sealed", layer.display(), parent.display())]
    ParentNotSealed { layer: PathBuf, parent: PathBuf },
    /// Neither header slot holds a valid header.
    #[error("layer {} has no valid header: {reason}", path.display())]
    CorruptHeader { path: PathBuf, reason: String },
    /// A sealed layer's allocation bitmap does not match its checksum, or a
    /// bitmap marks clusters past the end of the disk.
    #[error("layer {} has a corrupt allocation bitmap: {reason}", path.display())]
    CorruptBitmap { path: PathBuf, reason: String },
    /// The file is shorter than its header says (it was cut, e.g. by a failed copy).
    #[error("layer {} is truncated: {actual} bytes, expected {expected}", path.display())]
    Truncated {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("layer {} has format version {version}, this build reads version {supported}", path.display())]
    UnsupportedVersion {
        path: PathBuf,
        version: u32,
        supported: u32,
    },
    /// Layers in one chain must share the cluster size and the disk size.
    #[error("layer {} does not fit its parent: {reason}", path.display())]
    Geometry { path: PathBuf, reason: String },
    #[error("a chain of {depth} layers is too deep (at most {max}); compact it")]
    ChainTooLong { depth: usize, max: usize },
    /// The disk's top layer is sealed: it can be read and branched from, not written.
    #[error("layer {} is sealed and cannot be written", path.display())]
    ReadOnly { path: PathBuf },
    /// Compaction reads only sealed layers; a writable one is still changing.
    #[error("layer {} is not sealed", path.display())]
    NotSealed { path: PathBuf },
    /// A request reaches past the end of the disk (or overflows).
    #[error("{len} bytes at offset {offset} reach past the end of the {size}-byte disk")]
    OutOfBounds { offset: u64, len: u64, size: u64 },
    /// A new layer would overwrite an existing file.
    #[error("{} already exists; a new layer never replaces a file", path.display())]
    Exists { path: PathBuf },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The disk holds no layer at all: every open disk has one, so this is a bug.
    #[error("the disk has no layer")]
    NoLayer,
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Wraps an I/O error with what was being done and to which file.
pub(crate) fn io_err(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { op, path, source }
}

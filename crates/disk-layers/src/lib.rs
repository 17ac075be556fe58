//! Layered copy-on-write disks for sandfork microVMs.
//!
//! A disk is a read-only raw base image (the 2 GiB sparse ext4 root), zero or more
//! sealed layers shared by any number of disks, and one writable top layer per
//! disk. A fork or snapshot seals the top and stacks a fresh writable layer on it
//! for the parent and one for every child ([`LayeredDisk::seal_and_branch`]);
//! a fork of a running VM splits that in three: the parent's new top made ahead
//! ([`LayeredDisk::prepare_continuation`]), the seal and switch while the guest
//! stands still ([`LayeredDisk::seal_and_continue`]), the children's layers
//! after it runs again ([`SealedLayer::stack`]);
//! [`compact`] folds sealed layers together so chains stay short.
//!
//! # Format: our own, not qcow2
//!
//! qcow2 through `imago` (the maintained Rust crate, by a QEMU block maintainer) was
//! weighed and not taken:
//! - `imago` is async-first (tokio, async-trait); its sync API wraps a runtime, while
//!   the VMM's block worker is a plain thread doing positioned I/O.
//! - With qcow2 backing files, a read of a cluster walks the chain layer by layer
//!   (an L1/L2 lookup per layer): latency grows with depth. Here one merged
//!   in-memory index maps each cluster to the layer holding it, so a read is one
//!   `pread` whatever the depth (measured in `examples/bench.rs`).
//! - Sealing is a header flag here (O(metadata)); qcow2 has no sealed state and no
//!   id binding a child to its exact parent, only a backing file name.
//! - qcow2's refcounts, L2 allocation and its own crash-consistency rules are far
//!   more than we need; the format here fits in a page of code and is tested whole.
//! - What we give up: `qemu-img` cannot read our layers. The raw base stays a plain
//!   image, and a chain can be read out through [`LayeredDisk::read_at`] if an
//!   interoperable copy is ever needed.
//!
//! A layer file ([`mod@format`]): two 4 KiB header slots written alternately (magic,
//! version, generation, sealed flag, cluster size, disk size, random layer id, the
//! parent's path and identity, bitmap CRC-32, header CRC-32; the newest valid slot
//! wins, so a torn header write falls back), an allocation bitmap (one bit per
//! cluster), then the data area where cluster `c` sits at a fixed offset, as a hole
//! until written: the file costs only what was written.
//!
//! Cluster size: 4 KiB by default, the ext4 block size, so aligned guest writes never
//! copy up. With 64 KiB clusters the first 4 KiB write to a cluster copies 64 KiB
//! up: in `examples/bench.rs`, 20 000 random 4 KiB first writes took 42-48 us each
//! against 25-27 us, and the layer held 253 MiB instead of 67 MiB for 78 MiB
//! written. The cost of 4 KiB clusters is a bigger bitmap and index (64 KiB and
//! 1 MiB for a 2 GiB disk, the index shared by nothing, the bitmap pages sparse).
//!
//! A file is taken for a layer when the magic opens one of its header slots, for a
//! raw image otherwise (an ext4 image has no such bytes at 0 or 4096).
//!
//! # Durability and crashes
//!
//! - Writes go to the top layer's data area; the bit saying "this cluster is here"
//!   reaches the file only at [`LayeredDisk::flush`], after an `fdatasync` of the
//!   data, and is synced again. After a crash, a writable layer reads as of its
//!   last flush, plus possibly later writes (as a disk with a volatile cache).
//! - A sealed layer is never written again: compaction writes a new file and
//!   renames it over the old one. Sealing writes the final bitmap and then a header
//!   (with the bitmap's checksum) into the other slot. Opening verifies every layer:
//!   header checksums, bitmap checksum of sealed layers, file length, and that each
//!   parent is sealed, of the same geometry, and the one recorded (layer id, or
//!   raw size).
//!
//! # Who does what
//!
//! The disk's I/O methods run on the VMM's device worker. Sealing runs there too,
//! briefly, with the guest's I/O stopped. [`compact`] touches files only and runs on
//! any background thread the caller chooses; afterwards the caller calls
//! [`LayeredDisk::reload_chain`] on open disks and deletes what [`unreferenced`]
//! lists. Nothing here starts a thread.

mod chain;
mod compact;
mod disk;
mod error;
pub mod format;
mod layer;
mod rebase;

pub use chain::MAX_DEPTH;
pub use compact::{CompactStats, chain_files, compact, compact_temp_path, unreferenced};
pub use disk::{Continuation, DEFAULT_CLUSTER_SIZE, LayeredDisk, SealedLayer};
pub use error::{Error, Result};
pub use layer::is_layer;
pub use rebase::{set_parent_path, used_ranges};

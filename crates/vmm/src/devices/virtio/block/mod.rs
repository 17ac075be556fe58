//! virtio-blk (device ID 2) backed by a raw image file or a host block device.
//!
//! - [`device`]: the device model, its features and configuration space.
//! - [`disk`]: opening the image and positioned I/O between it and guest memory.
//! - [`persist`]: what a snapshot saves of the drive, and its restore.
//! - [`request`]: parsing a request out of a descriptor chain.
//! - [`worker`]: the thread that services the request queue (public for the fuzz
//!   targets, which drive it without the thread).

pub mod device;
pub mod disk;
pub mod persist;
pub mod request;
pub mod worker;

#[cfg(test)]
mod testing;
#[cfg(test)]
mod tests;

pub use device::{Block, BlockConfig, BlockState, CONFIG_SPACE_LEN, QUEUE_SIZE};
pub use disk::{BlockError, SECTOR_SIZE};
pub use persist::SavedBlock;

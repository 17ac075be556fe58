//! virtio-balloon (device ID 5): the guest gives memory back.
//!
//! - inflate/deflate: the VMM sets a target (`PATCH /balloon`); the guest
//!   allocates that many pages and sends their frame numbers, and the VMM
//!   returns them to the host. Deflating needs nothing from the host.
//! - free page reporting (`VIRTIO_BALLOON_F_REPORTING`): the guest hands over
//!   large free blocks (4 MiB with our kernel) a few seconds after it frees
//!   them, and the VMM returns them to the host: a guest that frees memory
//!   shrinks its VMM. See `vstate::memory::discard` for what "return" means
//!   for memory mapped from a snapshot.
//! - statistics (`VIRTIO_BALLOON_F_STATS_VQ`): the guest's memory counters,
//!   refreshed every `stats_polling_interval_s` (`GET /balloon/statistics`).
//!
//! Layout: [`device`] is the device model and the [`BalloonHandle`] the API
//! drives it with, [`worker`] its thread (public for the fuzz target, which
//! drives it without the thread), [`request`] what is read out of the
//! guest's buffers, [`persist`] what a snapshot saves.

pub mod device;
pub mod persist;
pub mod request;
pub mod worker;

#[cfg(test)]
mod tests;

pub use device::{Balloon, BalloonConfig, BalloonError, BalloonHandle};
pub use persist::SavedBalloon;

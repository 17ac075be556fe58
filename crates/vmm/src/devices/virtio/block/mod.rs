//! virtio-blk.

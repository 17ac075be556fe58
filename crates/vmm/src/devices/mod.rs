//! Device models: legacy PC devices and virtio devices.

pub mod virtio;

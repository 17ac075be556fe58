//! virtio-vsock with the Firecracker host-side model.

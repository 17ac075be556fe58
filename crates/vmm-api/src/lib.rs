//! Firecracker-compatible API types.

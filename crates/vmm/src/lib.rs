//! sandfork's virtual machine monitor: a Firecracker-style microVM on KVM.

pub mod api_server;
pub mod arch;
pub mod builder;
pub mod controller;
pub mod device_manager;
pub mod devices;
pub mod rate_limited;
pub mod seccomp;
pub mod snapshot;
pub mod vmm;
pub mod vstate;

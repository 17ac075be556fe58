//! sandfork's virtual machine monitor: a Firecracker-style microVM on KVM.

pub mod api_server;
pub mod devices;
pub mod vstate;

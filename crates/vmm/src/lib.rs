//! sandfork's virtual machine monitor: a Firecracker-style microVM on KVM.

pub mod devices;
pub mod vstate;

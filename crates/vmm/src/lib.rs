//! sandfork's virtual machine monitor: a Firecracker-style microVM on KVM.

pub mod arch;
pub mod devices;
pub mod vstate;

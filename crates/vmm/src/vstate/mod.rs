//! Thin wrappers over the KVM objects: the VM, its vCPUs and guest memory.

pub mod memory;
pub mod vcpu;
pub mod vcpu_state;
pub mod vm;

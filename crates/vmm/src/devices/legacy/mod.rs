//! Legacy PC devices on the port I/O bus.

pub mod console_budget;
pub mod i8042;
pub mod serial;

use vmm_sys_util::eventfd::EventFd;

/// Raises an interrupt line by signalling the KVM irqfd bound to it.
#[derive(Debug)]
pub struct EventFdTrigger(pub EventFd);

impl vm_superio::Trigger for EventFdTrigger {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

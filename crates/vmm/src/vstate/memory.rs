//! Guest physical memory.

/// Guest memory as every part of the VMM sees it.
pub type GuestMemory = vm_memory::GuestMemoryMmap<()>;

//! Architecture-specific parts of the VMM. Only x86_64 is supported.

pub mod x86_64;

//! The envd protocol.

pub mod filesystem;

//! The `filesystem.Filesystem` Connect service and the file operations behind it.

pub mod as_user;
pub mod entry;
pub mod error;
pub mod ops;
pub mod rpc;
pub mod watch;

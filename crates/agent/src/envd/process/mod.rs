//! The `process.Process` Connect service (spec §3.3).

pub mod output;
pub mod pty;
pub mod rpc;
pub mod spawn;
pub mod status;
pub mod table;

pub use rpc::router;
pub use table::ProcessTable;

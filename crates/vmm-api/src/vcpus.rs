//! `GET /vcpus` (sandfork extension): what each vCPU thread is doing, for
//! diagnosing a guest that stopped answering. Read without stopping the VM
//! for long: counters the vCPU threads keep, plus registers each thread
//! reads for itself when kicked (a thread that does not answer the kick is
//! itself the finding).

use serde::{Deserialize, Serialize};

/// Where a vCPU thread was when asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VcpuPhase {
    /// Inside `KVM_RUN`: the guest runs (or halts in KVM, waiting for an interrupt).
    InGuest,
    /// Handling an exit in the VMM (port or MMIO access, a request).
    InVmm,
    Paused,
    /// Stopped for good (reset, shutdown, fault).
    Exited,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuReport {
    pub id: u8,
    pub phase: VcpuPhase,
    /// `KVM_RUN` returns since the vCPU started, kicks included.
    pub exits: u64,
    /// The kind of the last return from `KVM_RUN` (`io_out`, `mmio_read`,
    /// `interrupted`, ...), `none` before the first.
    pub last_exit: String,
    /// How long ago it was, in milliseconds.
    pub ms_since_last_exit: Option<u64>,
    /// KVM's multiprocessing state (`runnable`, `halted`, `init_received`, ...),
    /// when the thread answered.
    pub mp_state: Option<String>,
    /// Where the vCPU was (rip, rsp, rflags, control registers), when the
    /// thread answered.
    pub registers: Option<String>,
    /// Why registers are missing, when they are.
    pub error: Option<String>,
}

impl std::fmt::Display for VcpuReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "vcpu{}: {:?}, {} exits, last {}",
            self.id, self.phase, self.exits, self.last_exit
        )?;
        if let Some(ms) = self.ms_since_last_exit {
            write!(f, " {ms} ms ago")?;
        }
        if let Some(mp) = &self.mp_state {
            write!(f, ", mp_state {mp}")?;
        }
        if let Some(regs) = &self.registers {
            write!(f, ", {regs}")?;
        }
        if let Some(e) = &self.error {
            write!(f, " ({e})")?;
        }
        Ok(())
    }
}

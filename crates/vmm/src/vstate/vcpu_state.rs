//! The architectural state of one vCPU, as a snapshot records it: everything
//! KVM holds for the vCPU, captured and restored in the order KVM needs.

use kvm_bindings::{
    CpuId, KVM_MAX_CPUID_ENTRIES, Msrs, kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state,
    kvm_mp_state, kvm_msr_entry, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use kvm_ioctls::{Kvm, VcpuFd};
use serde::{Deserialize, Serialize};

/// The TSC deadline timer is programmed relative to the TSC, so it must be set
/// after `MSR_IA32_TSC`; KVM ignores it when written earlier.
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

/// KVM_GET_MSRS/KVM_SET_MSRS take at most this many entries per call.
const MSRS_PER_CALL: usize = kvm_bindings::KVM_MAX_MSR_ENTRIES;

#[derive(Debug, thiserror::Error)]
pub enum VcpuStateError {
    #[error("KVM vCPU ioctl {0} failed: {1}")]
    Kvm(&'static str, #[source] kvm_ioctls::Error),
    #[error("building a KVM list of {0}: {1:?}")]
    Fam(&'static str, vmm_sys_util::fam::Error),
}

fn kvm(what: &'static str) -> impl Fn(kvm_ioctls::Error) -> VcpuStateError {
    move |e| VcpuStateError::Kvm(what, e)
}

/// Everything KVM keeps for one vCPU.
#[derive(Debug, Serialize, Deserialize)]
pub struct VcpuState {
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub msrs: Vec<kvm_msr_entry>,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    /// The legacy 4 KiB XSAVE area: enough for every component our CPUID
    /// offers (AMX tiles, which need more, are not offered).
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub lapic: kvm_lapic_state,
    pub mp_state: kvm_mp_state,
    pub events: kvm_vcpu_events,
    pub debug_regs: kvm_debugregs,
    /// The guest TSC frequency, so a restore on another host keeps it.
    pub tsc_khz: Option<u32>,
}

/// The MSRs KVM can save for this host: its index list, minus those the
/// vCPU refuses to read (KVM lists a few that depend on CPUID).
pub fn saveable_msrs(kvm_fd: &Kvm, vcpu: &VcpuFd) -> Result<Vec<u32>, VcpuStateError> {
    let listed = kvm_fd
        .get_msr_index_list()
        .map_err(kvm("GET_MSR_INDEX_LIST"))?;
    let mut readable = Vec::with_capacity(listed.as_slice().len());
    let mut pending: &[u32] = listed.as_slice();
    while !pending.is_empty() {
        let batch = &pending[..pending.len().min(MSRS_PER_CALL)];
        let read = read_msrs(vcpu, batch)?;
        readable.extend(read.iter().map(|e| e.index));
        // KVM stops at the first MSR it cannot read: skip that one.
        let consumed = (read.len() + 1).min(batch.len());
        if read.len() < batch.len() {
            tracing::debug!("MSR {:#x} is not readable; not saved", batch[read.len()]);
        }
        pending = &pending[consumed..];
    }
    Ok(readable)
}

/// Reads `indices`; returns the entries KVM read, which stop at the first failure.
fn read_msrs(vcpu: &VcpuFd, indices: &[u32]) -> Result<Vec<kvm_msr_entry>, VcpuStateError> {
    let entries: Vec<kvm_msr_entry> = indices
        .iter()
        .map(|&index| kvm_msr_entry {
            index,
            ..Default::default()
        })
        .collect();
    let mut msrs = Msrs::from_entries(&entries).map_err(|e| VcpuStateError::Fam("MSRs", e))?;
    let read = vcpu.get_msrs(&mut msrs).map_err(kvm("GET_MSRS"))?;
    Ok(msrs.as_slice()[..read].to_vec())
}

impl VcpuState {
    /// Captures the vCPU. It must not be running, and its last `KVM_RUN` must
    /// have returned for a signal, so no port or MMIO access is half done.
    pub fn save(vcpu: &VcpuFd, msr_indices: &[u32]) -> Result<Self, VcpuStateError> {
        // The MP state first: reading it makes KVM fold pending APIC events in.
        let mp_state = vcpu.get_mp_state().map_err(kvm("GET_MP_STATE"))?;
        let regs = vcpu.get_regs().map_err(kvm("GET_REGS"))?;
        let sregs = vcpu.get_sregs().map_err(kvm("GET_SREGS"))?;
        let xsave = vcpu.get_xsave().map_err(kvm("GET_XSAVE"))?;
        let xcrs = vcpu.get_xcrs().map_err(kvm("GET_XCRS"))?;
        let debug_regs = vcpu.get_debug_regs().map_err(kvm("GET_DEBUGREGS"))?;
        let lapic = vcpu.get_lapic().map_err(kvm("GET_LAPIC"))?;
        let mut msrs = Vec::with_capacity(msr_indices.len());
        for batch in msr_indices.chunks(MSRS_PER_CALL) {
            msrs.extend(read_msrs(vcpu, batch)?);
        }
        let cpuid = vcpu
            .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm("GET_CPUID2"))?
            .as_slice()
            .to_vec();
        let tsc_khz = vcpu.get_tsc_khz().ok();
        // Events last: the calls above may have queued some.
        let events = vcpu.get_vcpu_events().map_err(kvm("GET_VCPU_EVENTS"))?;
        Ok(VcpuState {
            cpuid,
            msrs,
            regs,
            sregs,
            xsave,
            xcrs,
            lapic,
            mp_state,
            events,
            debug_regs,
            tsc_khz,
        })
    }

    /// Loads the state into a freshly created vCPU.
    pub fn restore(&self, vcpu: &VcpuFd) -> Result<(), VcpuStateError> {
        let cpuid =
            CpuId::from_entries(&self.cpuid).map_err(|e| VcpuStateError::Fam("CPUID", e))?;
        vcpu.set_cpuid2(&cpuid).map_err(kvm("SET_CPUID2"))?;
        if let Some(khz) = self.tsc_khz
            && vcpu.get_tsc_khz().ok() != Some(khz)
        {
            vcpu.set_tsc_khz(khz).map_err(kvm("SET_TSC_KHZ"))?;
        }
        vcpu.set_mp_state(self.mp_state)
            .map_err(kvm("SET_MP_STATE"))?;
        vcpu.set_regs(&self.regs).map_err(kvm("SET_REGS"))?;
        vcpu.set_sregs(&self.sregs).map_err(kvm("SET_SREGS"))?;
        // SAFETY: `kvm_xsave` is the full legacy area KVM_SET_XSAVE reads.
        unsafe { vcpu.set_xsave(&self.xsave) }.map_err(kvm("SET_XSAVE"))?;
        vcpu.set_xcrs(&self.xcrs).map_err(kvm("SET_XCRS"))?;
        vcpu.set_debug_regs(&self.debug_regs)
            .map_err(kvm("SET_DEBUGREGS"))?;
        vcpu.set_lapic(&self.lapic).map_err(kvm("SET_LAPIC"))?;
        self.restore_msrs(vcpu)?;
        vcpu.set_vcpu_events(&self.events)
            .map_err(kvm("SET_VCPU_EVENTS"))?;
        Ok(())
    }

    fn restore_msrs(&self, vcpu: &VcpuFd) -> Result<(), VcpuStateError> {
        let (deadline, mut ordered): (Vec<_>, Vec<_>) = self
            .msrs
            .iter()
            .copied()
            .partition(|e| e.index == MSR_IA32_TSC_DEADLINE);
        ordered.extend(deadline);
        for batch in ordered.chunks(MSRS_PER_CALL) {
            let mut pending = batch;
            while !pending.is_empty() {
                let msrs =
                    Msrs::from_entries(pending).map_err(|e| VcpuStateError::Fam("MSRs", e))?;
                let set = vcpu.set_msrs(&msrs).map_err(kvm("SET_MSRS"))?;
                if set == pending.len() {
                    break;
                }
                // Saved on a host that allowed it; this one refuses it. The guest
                // keeps KVM's value, which is what a migration to this host gives.
                tracing::warn!("MSR {:#x} could not be restored", pending[set].index);
                pending = &pending[set + 1..];
            }
        }
        Ok(())
    }
}

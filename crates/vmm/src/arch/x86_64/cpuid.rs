//! The CPUID a vCPU reports: what KVM supports, with this vCPU's APIC ID and
//! the VM's CPU count filled in so the guest's topology matches the MP table.

use kvm_bindings::CpuId;

const LEAF_FEATURES: u32 = 0x1;
const LEAF_EXT_TOPOLOGY: u32 = 0xb;
const LEAF_EXT_TOPOLOGY_V2: u32 = 0x1f;

const EBX_CLFLUSH_SIZE_SHIFT: u32 = 8;
const EBX_CPU_COUNT_SHIFT: u32 = 16;
const EBX_APIC_ID_SHIFT: u32 = 24;
const ECX_HYPERVISOR: u32 = 1 << 31;
const EDX_HTT: u32 = 1 << 28;

/// Topology levels of leaf 0xB/0x1F (ECX[15:8]).
const LEVEL_TYPE_THREAD: u32 = 1;
const LEVEL_TYPE_CORE: u32 = 2;

/// Rewrites `cpuid` (from `KVM_GET_SUPPORTED_CPUID`) for vCPU `id` of `count`:
/// one socket, one thread per core, `count` cores.
pub fn normalize(cpuid: &mut CpuId, id: u8, count: u8) {
    // Bits needed to number the cores, as leaf 0xB's shift field wants it.
    let core_bits = u32::BITS - (u32::from(count).saturating_sub(1)).leading_zeros();
    for entry in cpuid.as_mut_slice() {
        match entry.function {
            LEAF_FEATURES => {
                entry.ebx = (u32::from(id) << EBX_APIC_ID_SHIFT)
                    | (u32::from(count) << EBX_CPU_COUNT_SHIFT)
                    | (8 << EBX_CLFLUSH_SIZE_SHIFT);
                entry.ecx |= ECX_HYPERVISOR;
                if count > 1 {
                    entry.edx |= EDX_HTT;
                } else {
                    entry.edx &= !EDX_HTT;
                }
            }
            LEAF_EXT_TOPOLOGY | LEAF_EXT_TOPOLOGY_V2 => {
                entry.edx = u32::from(id);
                match entry.index {
                    0 => {
                        entry.eax = 0;
                        entry.ebx = 1;
                        entry.ecx = (LEVEL_TYPE_THREAD << 8) | entry.index;
                    }
                    1 => {
                        entry.eax = core_bits;
                        entry.ebx = u32::from(count);
                        entry.ecx = (LEVEL_TYPE_CORE << 8) | entry.index;
                    }
                    _ => {
                        entry.eax = 0;
                        entry.ebx = 0;
                        entry.ecx = entry.index;
                    }
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            ..Default::default()
        }
    }

    #[test]
    fn apic_id_and_count_are_set() {
        let mut cpuid = CpuId::from_entries(&[entry(1, 0), entry(0xb, 0), entry(0xb, 1)]).unwrap();
        normalize(&mut cpuid, 3, 4);
        let e = cpuid.as_slice();
        assert_eq!(e[0].ebx >> 24, 3);
        assert_eq!((e[0].ebx >> 16) & 0xff, 4);
        assert_ne!(e[0].edx & EDX_HTT, 0);
        assert_eq!(e[1].edx, 3);
        assert_eq!(e[2].eax, 2);
        assert_eq!(e[2].ebx, 4);
    }
}

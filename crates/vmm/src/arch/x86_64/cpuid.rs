//! The CPUID a vCPU reports: what KVM supports, masked to the VM's CPU
//! template if it has one, with this vCPU's APIC ID and the VM's CPU count
//! filled in so the guest's topology matches the MP table.

use kvm_bindings::CpuId;

use super::cpu_template::CpuTemplate;

const LEAF_FEATURES: u32 = 0x1;
const LEAF_EXT_FEATURES: u32 = 0x7;
const LEAF_XSAVE: u32 = 0xd;
const LEAF_EXT_TOPOLOGY: u32 = 0xb;
const LEAF_EXT_TOPOLOGY_V2: u32 = 0x1f;

const EBX_CLFLUSH_SIZE_SHIFT: u32 = 8;
const EBX_CPU_COUNT_SHIFT: u32 = 16;
const EBX_APIC_ID_SHIFT: u32 = 24;
const ECX_TSC_DEADLINE: u32 = 1 << 24;
const ECX_HYPERVISOR: u32 = 1 << 31;
const EDX_HTT: u32 = 1 << 28;

/// Topology levels of leaf 0xB/0x1F (ECX[15:8]).
const LEVEL_TYPE_THREAD: u32 = 1;
const LEVEL_TYPE_CORE: u32 = 2;

/// XSAVE state components and the CPUID feature bit that must be advertised
/// for the component to be offered: (XCR0 bit, leaf, register, bit).
const XSAVE_DEPENDENCIES: [(u32, u32, Reg, u32); 8] = [
    (2, LEAF_FEATURES, Reg::Ecx, 28),      // AVX
    (3, LEAF_EXT_FEATURES, Reg::Ebx, 14),  // MPX bound registers
    (4, LEAF_EXT_FEATURES, Reg::Ebx, 14),  // MPX bound config
    (5, LEAF_EXT_FEATURES, Reg::Ebx, 16),  // AVX-512 opmask
    (6, LEAF_EXT_FEATURES, Reg::Ebx, 16),  // AVX-512 upper ZMM
    (7, LEAF_EXT_FEATURES, Reg::Ebx, 16),  // AVX-512 high ZMM
    (9, LEAF_EXT_FEATURES, Reg::Ecx, 3),   // PKRU
    (17, LEAF_EXT_FEATURES, Reg::Edx, 24), // AMX tile config (and data, below)
];

#[derive(Clone, Copy)]
enum Reg {
    Ebx,
    Ecx,
    Edx,
}

fn feature_bit(cpuid: &CpuId, leaf: u32, reg: Reg, bit: u32) -> bool {
    cpuid
        .as_slice()
        .iter()
        .find(|e| e.function == leaf && e.index == 0)
        .is_some_and(|e| {
            let value = match reg {
                Reg::Ebx => e.ebx,
                Reg::Ecx => e.ecx,
                Reg::Edx => e.edx,
            };
            value & (1 << bit) != 0
        })
}

/// Offers only the XSAVE state components whose CPU feature the vCPU also
/// advertises, and makes the sizes in leaf 0xD agree with that set. A
/// component offered without its feature bit (seen under nested emulation:
/// PKRU without PKU) makes Linux warn about an inconsistent XSAVE layout and
/// fall back to FXSAVE.
fn normalize_xsave(cpuid: &mut CpuId) {
    let mut dropped: u64 = 0;
    for (component, leaf, reg, bit) in XSAVE_DEPENDENCIES {
        if !feature_bit(cpuid, leaf, reg, bit) {
            dropped |= 1 << component;
            if component == 17 {
                dropped |= 1 << 18; // AMX tile data goes with tile config
            }
        }
    }
    let entries = cpuid.as_mut_slice();
    for entry in entries.iter_mut().filter(|e| e.function == LEAF_XSAVE) {
        if entry.index >= 2 && entry.index < 64 && dropped & (1 << entry.index) != 0 {
            entry.eax = 0;
            entry.ebx = 0;
            entry.ecx = 0;
            entry.edx = 0;
        }
    }
    let Some(main) = entries
        .iter()
        .position(|e| e.function == LEAF_XSAVE && e.index == 0)
    else {
        return;
    };
    let supported = (u64::from(entries[main].edx) << 32 | u64::from(entries[main].eax)) & !dropped;
    // The legacy area and XSAVE header, then each user component at its offset.
    let mut max_size: u32 = 512 + 64;
    for entry in entries.iter().filter(|e| e.function == LEAF_XSAVE) {
        if entry.index >= 2 && entry.index < 64 && supported & (1 << entry.index) != 0 {
            max_size = max_size.max(entry.ebx.saturating_add(entry.eax));
        }
    }
    let main = &mut entries[main];
    main.eax = supported as u32;
    main.edx = (supported >> 32) as u32;
    main.ecx = max_size;
}

/// Rewrites `cpuid` (from `KVM_GET_SUPPORTED_CPUID`) for vCPU `id` of `count`:
/// `template`'s features, one socket, one thread per core, `count` cores, and
/// an XSAVE layout consistent with the features left.
pub fn normalize(cpuid: &mut CpuId, template: Option<&CpuTemplate>, id: u8, count: u8) {
    if let Some(template) = template {
        template.apply(cpuid.as_mut_slice());
    }
    normalize_xsave(cpuid);
    // Bits needed to number the cores, as leaf 0xB's shift field wants it.
    let core_bits = u32::BITS - (u32::from(count).saturating_sub(1)).leading_zeros();
    for entry in cpuid.as_mut_slice() {
        match entry.function {
            LEAF_FEATURES => {
                entry.ebx = (u32::from(id) << EBX_APIC_ID_SHIFT)
                    | (u32::from(count) << EBX_CPU_COUNT_SHIFT)
                    | (8 << EBX_CLFLUSH_SIZE_SHIFT);
                // KVM emulates the TSC-deadline timer but leaves it out of
                // the supported CPUID. Without it the lab's guests ticked
                // from the PIT (clockevents broadcast device `pit`) and sent
                // each tick to their other vCPUs by IPI, idle or not: some
                // 300 timer interrupts a second per idle guest. With it each
                // vCPU arms its own timer with one MSR write
                // (`lapic-deadline`) and an idle guest takes 10-20.
                entry.ecx |= ECX_HYPERVISOR | ECX_TSC_DEADLINE;
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

    fn xsave(index: u32, eax: u32, ebx: u32, ecx: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function: LEAF_XSAVE,
            index,
            eax,
            ebx,
            ecx,
            ..Default::default()
        }
    }

    #[test]
    fn xsave_components_without_their_feature_are_dropped() {
        // What the lab's emulated CPU reports: x87, SSE, AVX and PKRU, no PKU.
        let mut leaf1 = entry(LEAF_FEATURES, 0);
        leaf1.ecx = 1 << 28;
        let mut cpuid = CpuId::from_entries(&[
            leaf1,
            entry(LEAF_EXT_FEATURES, 0),
            xsave(0, 0x207, 0x240, 0xa88),
            xsave(2, 0x100, 0x240, 0),
            xsave(9, 8, 0xa80, 0),
        ])
        .unwrap();
        normalize_xsave(&mut cpuid);
        let e = cpuid.as_slice();
        assert_eq!(e[2].eax, 0x7);
        assert_eq!(e[2].ecx, 0x340);
        assert_eq!((e[3].eax, e[3].ebx), (0x100, 0x240));
        assert_eq!((e[4].eax, e[4].ebx), (0, 0));
    }

    #[test]
    fn advertised_components_are_kept() {
        let mut leaf1 = entry(LEAF_FEATURES, 0);
        leaf1.ecx = 1 << 28;
        let mut leaf7 = entry(LEAF_EXT_FEATURES, 0);
        leaf7.ecx = 1 << 3;
        let mut cpuid = CpuId::from_entries(&[
            leaf1,
            leaf7,
            xsave(0, 0x207, 0x240, 0xa88),
            xsave(2, 0x100, 0x240, 0),
            xsave(9, 8, 0xa80, 0),
        ])
        .unwrap();
        normalize_xsave(&mut cpuid);
        let e = cpuid.as_slice();
        assert_eq!((e[2].eax, e[2].ecx), (0x207, 0xa88));
    }

    #[test]
    fn apic_id_and_count_are_set() {
        let mut cpuid = CpuId::from_entries(&[entry(1, 0), entry(0xb, 0), entry(0xb, 1)]).unwrap();
        normalize(&mut cpuid, None, 3, 4);
        let e = cpuid.as_slice();
        assert_eq!(e[0].ebx >> 24, 3);
        assert_eq!((e[0].ebx >> 16) & 0xff, 4);
        assert_ne!(e[0].edx & EDX_HTT, 0);
        assert_ne!(e[0].ecx & ECX_TSC_DEADLINE, 0);
        assert_eq!(e[1].edx, 3);
        assert_eq!(e[2].eax, 2);
        assert_eq!(e[2].ebx, 4);
    }

    #[test]
    fn a_template_drops_the_xsave_components_of_the_features_it_masks() {
        // A host with AVX and AVX-512 state; x86-64-v3 keeps AVX's only.
        let mut leaf1 = entry(LEAF_FEATURES, 0);
        leaf1.ecx = 1 << 28 | 1 << 26;
        let mut leaf7 = entry(LEAF_EXT_FEATURES, 0);
        leaf7.ebx = 1 << 16 | 1 << 5;
        let mut cpuid = CpuId::from_entries(&[
            leaf1,
            leaf7,
            xsave(0, 0xe7, 0x240, 0xa80),
            xsave(2, 0x100, 0x240, 0),
            xsave(5, 0x40, 0x440, 0),
            xsave(6, 0x200, 0x480, 0),
            xsave(7, 0x400, 0x680, 0),
        ])
        .unwrap();
        normalize(
            &mut cpuid,
            Some(&super::super::cpu_template::X86_64_V3),
            0,
            1,
        );
        let e = cpuid.as_slice();
        assert_eq!(e[1].ebx, 1 << 5, "avx2 stays, avx512f goes");
        assert_eq!((e[2].eax, e[2].ecx), (0x7, 0x340));
        assert_eq!((e[4].eax, e[5].eax, e[6].eax), (0, 0, 0));
    }
}

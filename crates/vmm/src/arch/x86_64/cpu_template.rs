//! CPU templates: the guest's CPUID masked to a named, vendor-neutral
//! baseline, so that every host of a cluster that has the baseline offers
//! its guests the same features and a snapshot taken on one restores on
//! another. The baselines are the x86-64 psABI microarchitecture levels
//! (what distributions and compilers target), on top of the system features
//! every 64-bit host has.
//!
//! In the registers a template governs ([`cpu_features::GOVERNED`]) the
//! guest keeps only the template's features, the bits the VMM owns, the
//! speculation-control bits (mitigations, which the guest needs where the
//! host has them and which the restore check covers) and, on AMD, leaf
//! 0x80000001's copies of leaf 1's bits. Everything else there is cleared.
//! A host that lacks one of the template's features cannot run it: the
//! boot is refused, naming what is missing.

use kvm_bindings::kvm_cpuid_entry2;

use super::cpu_features::{
    self, CpuidReg, E1_EDX, GOVERNED, L1_EDX, L7_EDX, LD_1_EAX, LD_EAX, feature,
};

/// A CPU template: its name and the features it offers.
#[derive(Debug, PartialEq, Eq)]
pub struct CpuTemplate {
    pub name: &'static str,
    /// Feature names ([`cpu_features::FEATURES`]), each level's added to
    /// those of the levels below.
    levels: &'static [&'static [&'static str]],
}

/// x86-64 (v1) and what a 64-bit guest kernel uses of every host: paging,
/// the local APIC (x2APIC is emulated by KVM), SYSCALL, NX, RDTSCP. Not VME
/// (virtual-8086 mode, which 64-bit guests never enter): KVM on AMD hosts
/// does not offer it (seen in the lab).
const BASELINE: &[&str] = &[
    "fpu", "de", "pse", "tsc", "msr", "pae", "mce", "cx8", "apic", "sep", "mtrr", "pge", "mca",
    "cmov", "pat", "pse36", "clflush", "mmx", "fxsr", "sse", "sse2", "x2apic", "syscall", "nx",
    "lm", "rdtscp",
];

/// x86-64-v2 (Nehalem, Bulldozer and later), with AES-NI and PCLMULQDQ,
/// which TLS in the guest wants and every such server CPU but Nehalem has.
const V2: &[&str] = &[
    "pni",
    "ssse3",
    "cx16",
    "sse4_1",
    "sse4_2",
    "popcnt",
    "lahf_lm",
    "aes",
    "pclmulqdq",
];

/// x86-64-v3 (Haswell, Zen and later), with XSAVEOPT, FSGSBASE and SMEP,
/// which all of those have.
const V3: &[&str] = &[
    "fma", "movbe", "xsave", "avx", "f16c", "bmi1", "avx2", "bmi2", "abm", "xsaveopt", "fsgsbase",
    "smep",
];

/// x86-64-v4 (Skylake-SP, Zen 4 and later).
const V4: &[&str] = &["avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"];

pub const X86_64_V2: CpuTemplate = CpuTemplate {
    name: "x86-64-v2",
    levels: &[BASELINE, V2],
};
pub const X86_64_V3: CpuTemplate = CpuTemplate {
    name: "x86-64-v3",
    levels: &[BASELINE, V2, V3],
};
pub const X86_64_V4: CpuTemplate = CpuTemplate {
    name: "x86-64-v4",
    levels: &[BASELINE, V2, V3, V4],
};

/// Speculation-control bits of leaf 7 EDX: MD_CLEAR, SPEC_CTRL, STIBP,
/// L1D_FLUSH, ARCH_CAPABILITIES, SSBD. Hiding them would leave the guest
/// unmitigated; they pass through as the host has them.
const SPECULATION_CONTROL: u32 = 1 << 10 | 1 << 26 | 1 << 27 | 1 << 28 | 1 << 29 | 1 << 31;

/// Leaf 1 EDX bits that AMD repeats in leaf 0x80000001 EDX (Intel leaves
/// them 0 there); guests and tools on AMD expect the copies.
const AMD_COPIES_OF_LEAF1_EDX: u32 = 0x0183_f3ff;

/// The template an API name means; None for `None` (the host's CPU).
pub fn for_api(t: vmm_api::CpuTemplate) -> Option<&'static CpuTemplate> {
    match t {
        vmm_api::CpuTemplate::X86_64V2 => Some(&X86_64_V2),
        vmm_api::CpuTemplate::X86_64V3 => Some(&X86_64_V3),
        vmm_api::CpuTemplate::X86_64V4 => Some(&X86_64_V4),
        // Firecracker's are refused by validation before they get here.
        _ => None,
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "CPU template {template}: this host's KVM does not support {}; use a lower template on this host \
     (or on every host of its cluster)",
    .missing.join(", ")
)]
pub struct TemplateUnsupported {
    pub template: &'static str,
    pub missing: Vec<String>,
}

impl CpuTemplate {
    fn features(&self) -> impl Iterator<Item = &'static cpu_features::Feature> + '_ {
        self.levels
            .iter()
            .flat_map(|level| level.iter())
            .filter_map(|name| feature(name))
    }

    /// The template's features in `reg`.
    fn offered(&self, reg: CpuidReg) -> u32 {
        self.features()
            .filter(|f| f.reg == reg)
            .fold(0, |m, f| m | f.mask())
    }

    /// What of `reg` the guest keeps (when the host has it).
    fn kept(&self, reg: CpuidReg) -> u32 {
        let mut kept = self.offered(reg) | cpu_features::vmm_owned(reg);
        if reg == L7_EDX {
            kept |= SPECULATION_CONTROL;
        }
        if reg == E1_EDX {
            kept |= self.offered(L1_EDX) & AMD_COPIES_OF_LEAF1_EDX;
        }
        kept
    }

    /// Checks that `host` (`KVM_GET_SUPPORTED_CPUID`) has every feature of
    /// the template.
    pub fn check_host(&self, host: &[kvm_cpuid_entry2]) -> Result<(), TemplateUnsupported> {
        let missing: Vec<String> = self
            .features()
            .filter(|f| cpu_features::read(host, f.reg) & f.mask() == 0)
            .map(|f| f.name.to_owned())
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(TemplateUnsupported {
                template: self.name,
                missing,
            })
        }
    }

    /// Masks `entries` (the host's supported CPUID) to the template. The
    /// XSAVE components are cut to the remaining features afterwards
    /// (`cpuid::normalize`).
    pub fn apply(&self, entries: &mut [kvm_cpuid_entry2]) {
        for reg in GOVERNED {
            let kept = self.kept(reg);
            for entry in entries.iter_mut() {
                if let Some(value) = cpu_features::slot(entry, reg) {
                    *value &= kept;
                }
            }
        }
        // Without XSAVES no supervisor state component is offered.
        let xsaves = feature("xsaves").map_or(0, |f| f.mask());
        if self.offered(LD_1_EAX) & xsaves == 0 {
            for entry in entries
                .iter_mut()
                .filter(|e| e.function == LD_EAX.leaf && e.index == 1)
            {
                entry.ecx = 0;
                entry.edx = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::cpu_features::tests::entry;
    use crate::arch::x86_64::cpu_features::{
        E1_ECX, FEATURES, L1_ECX, L7_1_EAX, L7_EBX, L7_ECX, check_snapshot, read,
    };

    /// A host with every bit of every governed register set, on AMD.
    fn everything() -> Vec<kvm_cpuid_entry2> {
        vec![
            entry(1, 0, [0, 0, !0, !0]),
            entry(7, 0, [0, !0, !0, !0]),
            entry(7, 1, [!0, 0, 0, 0]),
            entry(0xd, 0, [0x2e7, 0, 0, 0]),
            entry(0xd, 1, [0xf, 0, 0x1800, 0]),
            entry(0x8000_0001, 0, [0, 0, !0, !0]),
        ]
    }

    fn has(entries: &[kvm_cpuid_entry2], name: &str) -> bool {
        let f = feature(name).unwrap();
        read(entries, f.reg) & f.mask() != 0
    }

    #[test]
    fn every_template_feature_is_named() {
        for t in [&X86_64_V2, &X86_64_V3, &X86_64_V4] {
            for name in t.levels.iter().flat_map(|l| l.iter()) {
                assert!(feature(name).is_some(), "{}: {name}", t.name);
            }
        }
    }

    #[test]
    fn v2_masks_avx_and_keeps_its_level_and_the_vmms_bits() {
        let mut cpuid = everything();
        X86_64_V2.apply(&mut cpuid);
        for name in [
            "sse4_2", "popcnt", "cx16", "lahf_lm", "x2apic", "nx", "lm", "aes",
        ] {
            assert!(has(&cpuid, name), "{name}");
        }
        for name in [
            "avx", "avx2", "xsave", "fma", "bmi1", "abm", "avx512f", "sha_ni", "pku", "rdrand",
            "svm", "vmx", "pcid", "xsaveopt", "avx_vnni", "amx_tile", "fsrm",
        ] {
            assert!(!has(&cpuid, name), "{name}");
        }
        // What the VMM owns, and mitigations, stay for the host to decide.
        for name in ["hypervisor", "tsc_deadline_timer", "osxsave", "ht", "ospke"] {
            assert!(has(&cpuid, name), "{name}");
        }
        for name in [
            "spec_ctrl",
            "arch_capabilities",
            "md_clear",
            "spec_ctrl_ssbd",
        ] {
            assert!(has(&cpuid, name), "{name}");
        }
        // AMD's copies in 0x80000001 EDX of what leaf 1 EDX keeps stay.
        assert!(!has(&cpuid, "vme"));
        assert_eq!(read(&cpuid, E1_EDX) & 0x0183_f3ff, 0x0183_f3fd);
        assert!(!has(&cpuid, "mmxext"));
        assert_eq!(read(&cpuid, L7_1_EAX), 0);
        let leaf_d1 = cpuid.iter().find(|e| e.function == 0xd && e.index == 1);
        assert_eq!(leaf_d1.map(|e| (e.eax, e.ecx)), Some((0, 0)));
    }

    #[test]
    fn v3_offers_avx2_and_not_avx512() {
        let mut cpuid = everything();
        X86_64_V3.apply(&mut cpuid);
        for name in [
            "avx", "avx2", "fma", "bmi2", "abm", "movbe", "xsave", "xsaveopt",
        ] {
            assert!(has(&cpuid, name), "{name}");
        }
        for name in ["avx512f", "avx512vl", "xsavec", "xsaves", "adx", "smap"] {
            assert!(!has(&cpuid, name), "{name}");
        }
        let mut cpuid = everything();
        X86_64_V4.apply(&mut cpuid);
        assert!(has(&cpuid, "avx512bw") && !has(&cpuid, "avx512_vnni"));
    }

    #[test]
    fn the_same_template_on_different_hosts_offers_the_same() {
        // A bigger host and a smaller one, both with all of v3.
        let mut big = everything();
        let mut small = everything();
        X86_64_V3.check_host(&big).unwrap();
        for e in small.iter_mut() {
            match (e.function, e.index) {
                (7, 0) => e.ebx = X86_64_V3.offered(L7_EBX),
                (7, 1) => e.eax = 0,
                (0x8000_0001, 0) => e.ecx = X86_64_V3.offered(E1_ECX),
                _ => {}
            }
        }
        X86_64_V3.check_host(&small).unwrap();
        X86_64_V3.apply(&mut big);
        X86_64_V3.apply(&mut small);
        for reg in [L1_ECX, L1_EDX, L7_EBX, L7_ECX, L7_1_EAX, E1_ECX] {
            assert_eq!(read(&big, reg), read(&small, reg), "{reg:?}");
        }
        // A snapshot of either restores on the other.
        check_snapshot(&big, &small).unwrap();
        check_snapshot(&small, &big).unwrap();
    }

    #[test]
    fn a_host_without_the_templates_features_is_refused_by_name() {
        let mut host = everything();
        for e in host.iter_mut().filter(|e| e.function == 7 && e.index == 0) {
            e.ebx &= !(1 << 5 | 1 << 8); // avx2, bmi2
        }
        X86_64_V2.check_host(&host).unwrap();
        let err = X86_64_V3.check_host(&host).unwrap_err();
        assert_eq!(err.missing, ["avx2", "bmi2"]);
        assert!(
            err.to_string().starts_with(
                "CPU template x86-64-v3: this host's KVM does not support avx2, bmi2;"
            ),
            "{err}"
        );
        assert!(X86_64_V2.check_host(&[]).unwrap_err().missing.len() > 20);
    }

    #[test]
    fn only_named_features_are_offered() {
        // Nothing a template keeps is an unnamed bit, so errors name it.
        let mut cpuid = everything();
        X86_64_V4.apply(&mut cpuid);
        for reg in GOVERNED {
            let v = read(&cpuid, reg);
            for bit in 0..32 {
                if v & (1 << bit) != 0 {
                    assert!(
                        FEATURES.iter().any(|f| f.reg == reg && f.bit == bit)
                            || (reg == E1_EDX && AMD_COPIES_OF_LEAF1_EDX & (1 << bit) != 0),
                        "{reg:?} bit {bit}"
                    );
                }
            }
        }
    }

    /// This host's KVM, when there is one: each template it can run,
    /// applied as a boot applies it, gives a CPUID whose snapshot this
    /// host accepts back (the restore check and the templates agree on
    /// what the VMM owns); each it cannot run names real missing features.
    #[test]
    fn templates_against_this_hosts_kvm() {
        let Ok(kvm) = kvm_ioctls::Kvm::new() else {
            eprintln!("no /dev/kvm: skipped");
            return;
        };
        let supported = crate::vstate::vm::supported_cpuid(&kvm).unwrap();
        let host = supported.as_slice();
        eprintln!(
            "this host's KVM offers: {}",
            GOVERNED
                .iter()
                .flat_map(|&reg| cpu_features::names(reg, read(host, reg)))
                .collect::<Vec<_>>()
                .join(" ")
        );
        for t in [&X86_64_V2, &X86_64_V3, &X86_64_V4] {
            match t.check_host(host) {
                Ok(()) => {
                    let mut cpuid = supported.clone();
                    crate::arch::x86_64::cpuid::normalize(&mut cpuid, Some(t), 0, 2);
                    check_snapshot(cpuid.as_slice(), host).unwrap();
                    eprintln!("{}: supported", t.name);
                }
                Err(e) => {
                    for name in &e.missing {
                        let f = feature(name).unwrap();
                        assert_eq!(read(host, f.reg) & f.mask(), 0, "{name}");
                    }
                    eprintln!("{e}");
                }
            }
        }
        // Without a template, too.
        let mut cpuid = supported.clone();
        crate::arch::x86_64::cpuid::normalize(&mut cpuid, None, 1, 2);
        check_snapshot(cpuid.as_slice(), host).unwrap();
    }
}

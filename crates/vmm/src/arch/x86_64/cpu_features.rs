//! CPUID feature bits by name, the registers CPU templates govern, and the
//! check a restore makes: every feature a snapshot's CPUID offers in those
//! registers must be one this host's KVM supports, or the guest, which
//! already chose its code paths, dies on `#UD` at its next such instruction.

use kvm_bindings::kvm_cpuid_entry2;

/// A CPUID output register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reg {
    Eax,
    Ebx,
    Ecx,
    Edx,
}

/// One register of one CPUID leaf and subleaf.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuidReg {
    pub leaf: u32,
    pub subleaf: u32,
    pub reg: Reg,
}

const fn reg(leaf: u32, subleaf: u32, reg: Reg) -> CpuidReg {
    CpuidReg { leaf, subleaf, reg }
}

pub const L1_ECX: CpuidReg = reg(0x1, 0, Reg::Ecx);
pub const L1_EDX: CpuidReg = reg(0x1, 0, Reg::Edx);
pub const L7_EBX: CpuidReg = reg(0x7, 0, Reg::Ebx);
pub const L7_ECX: CpuidReg = reg(0x7, 0, Reg::Ecx);
pub const L7_EDX: CpuidReg = reg(0x7, 0, Reg::Edx);
pub const L7_1_EAX: CpuidReg = reg(0x7, 1, Reg::Eax);
pub const LD_EAX: CpuidReg = reg(0xd, 0, Reg::Eax);
pub const LD_1_EAX: CpuidReg = reg(0xd, 1, Reg::Eax);
pub const E1_ECX: CpuidReg = reg(0x8000_0001, 0, Reg::Ecx);
pub const E1_EDX: CpuidReg = reg(0x8000_0001, 0, Reg::Edx);

/// The registers a CPU template masks, and a restore checks: the
/// instruction-set and system feature flags. XSAVE's component mask
/// (0xD EAX) is not masked directly (it follows the features, see
/// `cpuid::normalize_xsave`) but is checked: a component the host lacks
/// cannot be restored.
pub const GOVERNED: [CpuidReg; 9] = [
    L1_ECX, L1_EDX, L7_EBX, L7_ECX, L7_EDX, L7_1_EAX, LD_1_EAX, E1_ECX, E1_EDX,
];

/// Bits the VMM sets itself or KVM changes as the guest runs, so neither a
/// template nor a host's supported CPUID says anything about them: HTT,
/// TSC-deadline and the hypervisor bit (`cpuid::normalize`), OSXSAVE and
/// OSPKE (mirrors of the guest's CR4).
pub const VMM_OWNED: [(CpuidReg, u32); 5] = [
    (L1_EDX, 1 << 28),
    (L1_ECX, 1 << 24),
    (L1_ECX, 1 << 31),
    (L1_ECX, 1 << 27),
    (L7_ECX, 1 << 4),
];

/// A feature bit and the name Linux gives it in `/proc/cpuinfo`.
#[derive(Clone, Copy, Debug)]
pub struct Feature {
    pub name: &'static str,
    pub reg: CpuidReg,
    pub bit: u32,
}

impl Feature {
    pub fn mask(&self) -> u32 {
        1 << self.bit
    }
}

macro_rules! features {
    ($($reg:ident { $($bit:literal $name:literal),* $(,)? })*) => {
        &[$($(Feature { name: $name, reg: $reg, bit: $bit },)*)*]
    };
}

/// Named feature bits: those the templates use, and the others a host or
/// snapshot commonly has, so an error names them. A bit not listed is
/// named by its position.
pub const FEATURES: &[Feature] = features! {
    L1_EDX {
        0 "fpu", 1 "vme", 2 "de", 3 "pse", 4 "tsc", 5 "msr", 6 "pae", 7 "mce", 8 "cx8",
        9 "apic", 11 "sep", 12 "mtrr", 13 "pge", 14 "mca", 15 "cmov", 16 "pat", 17 "pse36",
        19 "clflush", 21 "ds", 22 "acpi", 23 "mmx", 24 "fxsr", 25 "sse", 26 "sse2", 27 "ss",
        28 "ht", 29 "tm", 31 "pbe",
    }
    L1_ECX {
        0 "pni", 1 "pclmulqdq", 2 "dtes64", 3 "monitor", 4 "ds_cpl", 5 "vmx", 6 "smx",
        7 "est", 8 "tm2", 9 "ssse3", 11 "sdbg", 12 "fma", 13 "cx16", 14 "xtpr", 15 "pdcm",
        17 "pcid", 18 "dca", 19 "sse4_1", 20 "sse4_2", 21 "x2apic", 22 "movbe", 23 "popcnt",
        24 "tsc_deadline_timer", 25 "aes", 26 "xsave", 27 "osxsave", 28 "avx", 29 "f16c",
        30 "rdrand", 31 "hypervisor",
    }
    L7_EBX {
        0 "fsgsbase", 1 "tsc_adjust", 2 "sgx", 3 "bmi1", 4 "hle", 5 "avx2", 7 "smep",
        8 "bmi2", 9 "erms", 10 "invpcid", 11 "rtm", 14 "mpx", 16 "avx512f", 17 "avx512dq",
        18 "rdseed", 19 "adx", 20 "smap", 21 "avx512ifma", 23 "clflushopt", 24 "clwb",
        25 "intel_pt", 26 "avx512pf", 27 "avx512er", 28 "avx512cd", 29 "sha_ni",
        30 "avx512bw", 31 "avx512vl",
    }
    L7_ECX {
        1 "avx512vbmi", 2 "umip", 3 "pku", 4 "ospke", 5 "waitpkg", 6 "avx512_vbmi2",
        7 "shstk", 8 "gfni", 9 "vaes", 10 "vpclmulqdq", 11 "avx512_vnni", 12 "avx512_bitalg",
        13 "tme", 14 "avx512_vpopcntdq", 16 "la57", 22 "rdpid", 24 "bus_lock_detect",
        25 "cldemote", 27 "movdiri", 28 "movdir64b", 29 "enqcmd", 30 "sgx_lc", 31 "pks",
    }
    L7_EDX {
        2 "avx512_4vnniw", 3 "avx512_4fmaps", 4 "fsrm", 8 "avx512_vp2intersect",
        9 "srbds_ctrl", 10 "md_clear", 14 "serialize", 15 "hybrid_cpu", 16 "tsxldtrk",
        18 "pconfig", 19 "arch_lbr", 20 "ibt", 22 "amx_bf16", 23 "avx512_fp16",
        24 "amx_tile", 25 "amx_int8", 26 "spec_ctrl", 27 "intel_stibp", 28 "flush_l1d",
        29 "arch_capabilities", 30 "core_capabilities", 31 "spec_ctrl_ssbd",
    }
    L7_1_EAX {
        4 "avx_vnni", 5 "avx512_bf16", 10 "fzrm", 11 "fsrs", 12 "fsrc", 22 "amx_fp16",
        23 "avx_ifma",
    }
    LD_1_EAX {
        0 "xsaveopt", 1 "xsavec", 2 "xgetbv1", 3 "xsaves", 4 "xfd",
    }
    LD_EAX {
        0 "x87 state", 1 "sse state", 2 "avx state", 3 "mpx bndregs state",
        4 "mpx bndcsr state", 5 "avx-512 opmask state", 6 "avx-512 zmm_hi256 state",
        7 "avx-512 hi16_zmm state", 9 "pkru state", 17 "amx tilecfg state",
        18 "amx tiledata state",
    }
    E1_ECX {
        0 "lahf_lm", 1 "cmp_legacy", 2 "svm", 3 "extapic", 4 "cr8_legacy", 5 "abm",
        6 "sse4a", 7 "misalignsse", 8 "3dnowprefetch", 9 "osvw", 10 "ibs", 11 "xop",
        12 "skinit", 13 "wdt", 15 "lwp", 16 "fma4", 17 "tce", 19 "nodeid_msr", 21 "tbm",
        22 "topoext", 23 "perfctr_core", 24 "perfctr_nb", 26 "bpext", 27 "ptsc",
        28 "perfctr_llc", 29 "mwaitx",
    }
    E1_EDX {
        11 "syscall", 19 "mp", 20 "nx", 22 "mmxext", 25 "fxsr_opt", 26 "pdpe1gb",
        27 "rdtscp", 29 "lm", 30 "3dnowext", 31 "3dnow",
    }
};

/// The feature called `name`.
pub fn feature(name: &str) -> Option<&'static Feature> {
    FEATURES.iter().find(|f| f.name == name)
}

/// The name of bit `bit` of `reg`: Linux's, or its position.
pub fn bit_name(reg: CpuidReg, bit: u32) -> String {
    let named = |reg: CpuidReg| FEATURES.iter().find(|f| f.reg == reg && f.bit == bit);
    match named(reg) {
        Some(f) => f.name.to_owned(),
        // AMD's copies of leaf 1 EDX.
        None if reg == E1_EDX && named(L1_EDX).is_some() => {
            format!("{} (0x80000001)", named(L1_EDX).map_or("", |f| f.name))
        }
        None => format!(
            "cpuid {:#x}.{}:{}[{bit}]",
            reg.leaf,
            reg.subleaf,
            match reg.reg {
                Reg::Eax => "eax",
                Reg::Ebx => "ebx",
                Reg::Ecx => "ecx",
                Reg::Edx => "edx",
            }
        ),
    }
}

/// The value of `reg` in `entries`; 0 when the leaf is absent.
pub fn read(entries: &[kvm_cpuid_entry2], reg: CpuidReg) -> u32 {
    entries
        .iter()
        .find(|e| e.function == reg.leaf && e.index == reg.subleaf)
        .map_or(0, |e| value(e, reg.reg))
}

fn value(e: &kvm_cpuid_entry2, reg: Reg) -> u32 {
    match reg {
        Reg::Eax => e.eax,
        Reg::Ebx => e.ebx,
        Reg::Ecx => e.ecx,
        Reg::Edx => e.edx,
    }
}

/// The register `reg` of `entry`, if `entry` is its leaf and subleaf.
pub fn slot(entry: &mut kvm_cpuid_entry2, reg: CpuidReg) -> Option<&mut u32> {
    if entry.function != reg.leaf || entry.index != reg.subleaf {
        return None;
    }
    Some(match reg.reg {
        Reg::Eax => &mut entry.eax,
        Reg::Ebx => &mut entry.ebx,
        Reg::Ecx => &mut entry.ecx,
        Reg::Edx => &mut entry.edx,
    })
}

/// The bits of `reg` the VMM owns (see [`VMM_OWNED`]).
pub fn vmm_owned(reg: CpuidReg) -> u32 {
    VMM_OWNED
        .iter()
        .filter(|(r, _)| *r == reg)
        .fold(0, |m, (_, bits)| m | bits)
}

/// The names of the bits set in `mask` of `reg`.
pub fn names(reg: CpuidReg, mask: u32) -> impl Iterator<Item = String> {
    (0..u32::BITS)
        .filter(move |b| mask & (1 << b) != 0)
        .map(move |b| bit_name(reg, b))
}

/// The CPU vendor (leaf 0's `GenuineIntel`, `AuthenticAMD`, ...), if given.
pub fn vendor(entries: &[kvm_cpuid_entry2]) -> Option<String> {
    let leaf0 = entries.iter().find(|e| e.function == 0 && e.index == 0)?;
    let bytes: Vec<u8> = [leaf0.ebx, leaf0.edx, leaf0.ecx]
        .iter()
        .flat_map(|r| r.to_le_bytes())
        .collect();
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

/// Why a snapshot's CPU cannot run on this host.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SnapshotCpuError {
    #[error(
        "the snapshot's CPU offers features this host's KVM does not support: {}; restore it on \
         a host that has them, or take snapshots under a CPU template every host supports \
         (machine-config cpu_template, e.g. x86-64-v3)",
        .0.join(", ")
    )]
    Missing(Vec<String>),
    #[error("the snapshot was taken on a {snapshot} CPU, and this host's is {host}")]
    Vendor { snapshot: String, host: String },
}

/// Checks that this host (`host`: its `KVM_GET_SUPPORTED_CPUID`) supports
/// every governed feature `snapshot` (a vCPU's saved CPUID) offers, and is
/// of the same vendor.
pub fn check_snapshot(
    snapshot: &[kvm_cpuid_entry2],
    host: &[kvm_cpuid_entry2],
) -> Result<(), SnapshotCpuError> {
    if let (Some(snapshot), Some(host)) = (vendor(snapshot), vendor(host))
        && snapshot != host
    {
        return Err(SnapshotCpuError::Vendor { snapshot, host });
    }
    let mut missing = Vec::new();
    for reg in GOVERNED.into_iter().chain([LD_EAX]) {
        let lacking = read(snapshot, reg) & !read(host, reg) & !vmm_owned(reg);
        missing.extend(names(reg, lacking));
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(SnapshotCpuError::Missing(missing))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn entry(
        function: u32,
        index: u32,
        [eax, ebx, ecx, edx]: [u32; 4],
    ) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax,
            ebx,
            ecx,
            edx,
            ..Default::default()
        }
    }

    /// Leaf 0 of an `AuthenticAMD` CPU.
    fn amd() -> kvm_cpuid_entry2 {
        entry(0, 0, [0xd, 0x6874_7541, 0x444d_4163, 0x6974_6e65])
    }

    #[test]
    fn names_are_unique_and_fit_their_register() {
        for (i, f) in FEATURES.iter().enumerate() {
            assert!(f.bit < 32, "{}", f.name);
            assert!(
                FEATURES[..i].iter().all(|g| g.name != f.name),
                "{} twice",
                f.name
            );
            assert!(
                FEATURES[..i]
                    .iter()
                    .all(|g| g.reg != f.reg || g.bit != f.bit),
                "{} shares its bit",
                f.name
            );
        }
        assert_eq!(bit_name(L7_EBX, 5), "avx2");
        assert_eq!(bit_name(L7_EBX, 6), "cpuid 0x7.0:ebx[6]");
        assert_eq!(bit_name(E1_EDX, 0), "fpu (0x80000001)");
        assert_eq!(vendor(&[amd()]).as_deref(), Some("AuthenticAMD"));
    }

    #[test]
    fn a_snapshot_within_the_host_passes() {
        let host = [
            amd(),
            entry(1, 0, [0, 0, 0x0098_2203, 0x178b_fbff]),
            entry(7, 0, [0, 0x0000_0129, 0, 0]),
        ];
        // Fewer features, and the bits the VMM sets itself.
        let snapshot = [
            amd(),
            entry(
                1,
                0,
                [0, 0, 0x0080_0201 | 1 << 24 | 1 << 31 | 1 << 27, 0x178b_fbff],
            ),
            entry(7, 0, [0, 0x0000_0001, 1 << 4, 0]),
        ];
        check_snapshot(&snapshot, &host).unwrap();
    }

    #[test]
    fn a_snapshot_with_features_the_host_lacks_is_refused_by_name() {
        let host = [amd(), entry(1, 0, [0, 0, 1 << 23, 0]), entry(7, 0, [0; 4])];
        let snapshot = [
            amd(),
            entry(1, 0, [0, 0, 1 << 23 | 1 << 28, 0]),
            entry(7, 0, [0, 1 << 5 | 1 << 16 | 1 << 6, 0, 0]),
            entry(0xd, 0, [0x7, 0, 0, 0]),
        ];
        let err = check_snapshot(&snapshot, &host).unwrap_err();
        assert_eq!(
            err,
            SnapshotCpuError::Missing(vec![
                "avx".into(),
                "avx2".into(),
                "cpuid 0x7.0:ebx[6]".into(),
                "avx512f".into(),
                "x87 state".into(),
                "sse state".into(),
                "avx state".into(),
            ])
        );
        let text = err.to_string();
        assert!(text.contains("avx, avx2, "), "{text}");
    }

    #[test]
    fn a_snapshot_from_another_vendor_is_refused() {
        let intel = entry(0, 0, [0xd, 0x756e_6547, 0x6c65_746e, 0x4965_6e69]);
        let err = check_snapshot(&[intel], &[amd()]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the snapshot was taken on a GenuineIntel CPU, and this host's is AuthenticAMD"
        );
    }
}

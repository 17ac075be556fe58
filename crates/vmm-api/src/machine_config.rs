//! `GET/PUT/PATCH /machine-config`: vCPU count, memory size and related switches.

use serde::{Deserialize, Serialize};

use crate::validation::ValidationError;

/// Firecracker's limit, kept so configurations behave the same on both VMMs.
pub const MAX_VCPUS: u8 = 32;
/// Firecracker's default memory size.
pub const DEFAULT_MEM_SIZE_MIB: u64 = 128;
/// 256 GiB: far above any sandbox, low enough to catch unit mistakes (bytes for MiB).
pub const MAX_MEM_SIZE_MIB: u64 = 256 * 1024;

/// How guest memory is backed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum HugePages {
    #[default]
    None,
    /// Transparent huge pages (`madvise(MADV_HUGEPAGE)`).
    Transparent,
    /// Explicit 2 MiB hugetlbfs pages.
    #[serde(rename = "2M")]
    Hugetlbfs2M,
}

/// The CPU template: what of the host's CPU the guest is offered.
///
/// Firecracker's static templates (`C3`, `T2`, ...) are parsed so a
/// Firecracker configuration reads, and refused by [`MachineConfig::validate`].
/// sandfork's own are the x86-64 psABI microarchitecture levels: the guest's
/// CPUID is masked to the level's features (plus what the VMM itself needs),
/// the same on every host that has them, so a snapshot taken on one node of
/// a cluster restores on another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CpuTemplate {
    C3,
    T2,
    T2S,
    T2CL,
    T2A,
    V1N1,
    None,
    /// SSE4.2, SSSE3, POPCNT, CMPXCHG16B, LAHF/SAHF (plus AES-NI and PCLMULQDQ).
    #[serde(rename = "x86-64-v2")]
    X86_64V2,
    /// v2 and AVX, AVX2, BMI1/2, FMA, F16C, LZCNT, MOVBE, XSAVE.
    #[serde(rename = "x86-64-v3")]
    X86_64V3,
    /// v3 and AVX-512 F, BW, CD, DQ, VL.
    #[serde(rename = "x86-64-v4")]
    X86_64V4,
}

impl CpuTemplate {
    /// The templates sandfork implements, by their API names.
    pub const SUPPORTED: [CpuTemplate; 3] = [
        CpuTemplate::X86_64V2,
        CpuTemplate::X86_64V3,
        CpuTemplate::X86_64V4,
    ];

    /// The name the API and the command line use.
    pub fn as_str(self) -> &'static str {
        match self {
            CpuTemplate::C3 => "C3",
            CpuTemplate::T2 => "T2",
            CpuTemplate::T2S => "T2S",
            CpuTemplate::T2CL => "T2CL",
            CpuTemplate::T2A => "T2A",
            CpuTemplate::V1N1 => "V1N1",
            CpuTemplate::None => "None",
            CpuTemplate::X86_64V2 => "x86-64-v2",
            CpuTemplate::X86_64V3 => "x86-64-v3",
            CpuTemplate::X86_64V4 => "x86-64-v4",
        }
    }

    /// Whether sandfork implements it (`None` included: the host's CPU).
    pub fn is_supported(self) -> bool {
        self == CpuTemplate::None || Self::SUPPORTED.contains(&self)
    }
}

impl std::fmt::Display for CpuTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for CpuTemplate {
    type Err = ValidationError;

    /// One of sandfork's templates or `None` (case-insensitive); a
    /// Firecracker template's name is refused, as the API refuses it.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let found = [CpuTemplate::None]
            .into_iter()
            .chain(Self::SUPPORTED)
            .find(|t| t.as_str().eq_ignore_ascii_case(s));
        found.ok_or_else(|| ValidationError::new(unsupported_template(s)))
    }
}

fn unsupported_template(name: &str) -> String {
    format!(
        "cpu_template {name} is not supported; use \"None\" (the host's CPU), \"x86-64-v2\", \
         \"x86-64-v3\" or \"x86-64-v4\""
    )
}

/// The body of `PUT /machine-config` and the answer to `GET /machine-config`.
///
/// As in Firecracker, a PUT resets every omitted optional field to its default, so the
/// optional switches are plain values with serde defaults rather than `Option`s.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineConfig {
    pub vcpu_count: u8,
    pub mem_size_mib: u64,
    #[serde(default)]
    pub smt: bool,
    #[serde(default)]
    pub track_dirty_pages: bool,
    #[serde(default)]
    pub huge_pages: HugePages,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_template: Option<CpuTemplate>,
}

impl Default for MachineConfig {
    /// What `GET /machine-config` reports before any PUT: 1 vCPU, 128 MiB.
    fn default() -> Self {
        Self {
            vcpu_count: 1,
            mem_size_mib: DEFAULT_MEM_SIZE_MIB,
            smt: false,
            track_dirty_pages: false,
            huge_pages: HugePages::None,
            cpu_template: None,
        }
    }
}

impl MachineConfig {
    pub fn new(vcpu_count: u8, mem_size_mib: u64) -> Self {
        Self {
            vcpu_count,
            mem_size_mib,
            ..Self::default()
        }
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        if !(1..=MAX_VCPUS).contains(&self.vcpu_count) {
            return Err(ValidationError::new(format!(
                "vcpu_count must be between 1 and {MAX_VCPUS}, got {}",
                self.vcpu_count
            )));
        }
        if self.smt && self.vcpu_count > 1 && !self.vcpu_count.is_multiple_of(2) {
            return Err(ValidationError::new(format!(
                "vcpu_count must be 1 or even when smt is enabled, got {}",
                self.vcpu_count
            )));
        }
        if !(1..=MAX_MEM_SIZE_MIB).contains(&self.mem_size_mib) {
            return Err(ValidationError::new(format!(
                "mem_size_mib must be between 1 and {MAX_MEM_SIZE_MIB}, got {}",
                self.mem_size_mib
            )));
        }
        if self.huge_pages == HugePages::Hugetlbfs2M && !self.mem_size_mib.is_multiple_of(2) {
            return Err(ValidationError::new(format!(
                "mem_size_mib must be a multiple of 2 with 2M huge pages, got {}",
                self.mem_size_mib
            )));
        }
        match self.cpu_template {
            Some(t) if !t.is_supported() => {
                Err(ValidationError::new(unsupported_template(t.as_str())))
            }
            _ => Ok(()),
        }
    }

    /// Applies a PATCH and validates the result; `self` is left unchanged on error.
    pub fn patched(&self, update: &MachineConfigUpdate) -> Result<Self, ValidationError> {
        if update.is_empty() {
            return Err(ValidationError::new(
                "PATCH /machine-config needs at least one field to change",
            ));
        }
        let next = Self {
            vcpu_count: update.vcpu_count.unwrap_or(self.vcpu_count),
            mem_size_mib: update.mem_size_mib.unwrap_or(self.mem_size_mib),
            smt: update.smt.unwrap_or(self.smt),
            track_dirty_pages: update.track_dirty_pages.unwrap_or(self.track_dirty_pages),
            huge_pages: update.huge_pages.unwrap_or(self.huge_pages),
            cpu_template: match update.cpu_template {
                Some(CpuTemplate::None) => None,
                Some(t) => Some(t),
                None => self.cpu_template,
            },
        };
        next.validate()?;
        Ok(next)
    }
}

/// The body of `PATCH /machine-config`: every field optional, only given ones change.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineConfigUpdate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpu_count: Option<u8>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_size_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub smt: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub track_dirty_pages: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub huge_pages: Option<HugePages>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_template: Option<CpuTemplate>,
}

impl MachineConfigUpdate {
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn firecracker_shaped_json() {
        let m: MachineConfig = serde_json::from_str(
            r#"{"vcpu_count": 2, "mem_size_mib": 1024, "smt": false, "track_dirty_pages": true, "huge_pages": "2M"}"#,
        )
        .unwrap();
        assert_eq!(m.vcpu_count, 2);
        assert_eq!(m.mem_size_mib, 1024);
        assert!(m.track_dirty_pages);
        assert_eq!(m.huge_pages, HugePages::Hugetlbfs2M);
        m.validate().unwrap();

        let m: MachineConfig = serde_json::from_str(
            r#"{"vcpu_count": 1, "mem_size_mib": 256, "cpu_template": "None"}"#,
        )
        .unwrap();
        assert_eq!(m.cpu_template, Some(CpuTemplate::None));
        m.validate().unwrap();
    }

    #[test]
    fn default_is_what_get_reports() {
        let v = serde_json::to_value(MachineConfig::default()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "vcpu_count": 1, "mem_size_mib": 128, "smt": false,
                "track_dirty_pages": false, "huge_pages": "None"
            })
        );
    }

    #[test]
    fn rejects_bad_json() {
        let err = serde_json::from_str::<MachineConfig>(r#"{"vcpu_count": 1}"#).unwrap_err();
        assert!(
            err.to_string().contains("missing field `mem_size_mib`"),
            "{err}"
        );
        let err = serde_json::from_str::<MachineConfig>(
            r#"{"vcpu_count": 1, "mem_size_mib": 1, "ht_enabled": true}"#,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("unknown field `ht_enabled`"),
            "{err}"
        );
        let err =
            serde_json::from_str::<MachineConfig>(r#"{"vcpu_count": 300, "mem_size_mib": 1}"#)
                .unwrap_err();
        assert!(err.to_string().contains("300"), "{err}");
        let err =
            serde_json::from_str::<MachineConfig>(r#"{"vcpu_count": "2", "mem_size_mib": 1}"#)
                .unwrap_err();
        assert!(err.to_string().contains("invalid type"), "{err}");
    }

    #[test]
    fn validation_bounds() {
        let msg = |m: MachineConfig| m.validate().unwrap_err().to_string();
        assert_eq!(
            msg(MachineConfig::new(0, 128)),
            "vcpu_count must be between 1 and 32, got 0"
        );
        assert!(msg(MachineConfig::new(33, 128)).contains("got 33"));
        MachineConfig::new(32, 128).validate().unwrap();
        assert!(msg(MachineConfig::new(1, 0)).contains("mem_size_mib"));
        assert!(msg(MachineConfig::new(1, MAX_MEM_SIZE_MIB + 1)).contains("mem_size_mib"));
        MachineConfig::new(1, MAX_MEM_SIZE_MIB).validate().unwrap();

        let mut m = MachineConfig::new(3, 128);
        m.smt = true;
        assert!(msg(m.clone()).contains("smt"));
        m.vcpu_count = 4;
        m.validate().unwrap();

        let mut m = MachineConfig::new(1, 129);
        m.huge_pages = HugePages::Hugetlbfs2M;
        assert!(msg(m).contains("multiple of 2"));

        let mut m = MachineConfig::new(1, 128);
        m.cpu_template = Some(CpuTemplate::T2);
        assert!(msg(m.clone()).contains("cpu_template T2 is not supported"));
        m.cpu_template = Some(CpuTemplate::X86_64V3);
        m.validate().unwrap();
    }

    #[test]
    fn cpu_template_names() {
        let m: MachineConfig = serde_json::from_str(
            r#"{"vcpu_count": 1, "mem_size_mib": 256, "cpu_template": "x86-64-v2"}"#,
        )
        .unwrap();
        assert_eq!(m.cpu_template, Some(CpuTemplate::X86_64V2));
        assert_eq!(
            serde_json::to_value(&m).unwrap()["cpu_template"],
            "x86-64-v2"
        );
        for t in CpuTemplate::SUPPORTED {
            assert_eq!(t.as_str().parse::<CpuTemplate>().unwrap(), t);
            assert_eq!(serde_json::to_value(t).unwrap(), t.as_str());
        }
        assert_eq!("none".parse::<CpuTemplate>().unwrap(), CpuTemplate::None);
        let err = "T2".parse::<CpuTemplate>().unwrap_err().to_string();
        assert!(
            err.contains("T2 is not supported") && err.contains("x86-64-v3"),
            "{err}"
        );
        assert!(
            serde_json::from_str::<MachineConfig>(
                r#"{"vcpu_count": 1, "mem_size_mib": 256, "cpu_template": "x86-64-v9"}"#
            )
            .is_err()
        );
    }

    #[test]
    fn patch() {
        let base = MachineConfig::default();
        let upd: MachineConfigUpdate = serde_json::from_str(r#"{"mem_size_mib": 512}"#).unwrap();
        let next = base.patched(&upd).unwrap();
        assert_eq!((next.vcpu_count, next.mem_size_mib), (1, 512));

        assert!(base.patched(&MachineConfigUpdate::default()).is_err());
        let bad = MachineConfigUpdate {
            vcpu_count: Some(0),
            ..Default::default()
        };
        assert!(base.patched(&bad).is_err());
        assert!(serde_json::from_str::<MachineConfigUpdate>(r#"{"cpus": 1}"#).is_err());
    }
}

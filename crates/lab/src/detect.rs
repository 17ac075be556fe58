//! Whether this host can run KVM guests itself or needs the lab.

use std::fmt;
use std::path::Path;

/// Where sandfork's VMM can boot Linux guests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Environment {
    /// /dev/kvm is backed by hardware virtualization: run directly.
    Hardware,
    /// No usable hardware KVM: run inside the QEMU TCG lab.
    Lab,
}

impl fmt::Display for Environment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Environment::Hardware => "hardware",
            Environment::Lab => "lab",
        })
    }
}

/// The verdict and the fact that decided it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detection {
    pub environment: Environment,
    pub reason: String,
}

/// Looks at this host: /dev/kvm, the PVM module, and the CPU flags.
pub fn detect() -> Detection {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    detect_from(
        Path::new("/dev/kvm").exists(),
        Path::new("/sys/module/kvm_pvm").exists(),
        &cpuinfo,
    )
}

/// The decision itself, from the facts `detect` gathers.
pub fn detect_from(kvm_present: bool, pvm_loaded: bool, cpuinfo: &str) -> Detection {
    let lab = |reason: &str| Detection {
        environment: Environment::Lab,
        reason: reason.to_string(),
    };
    if !kvm_present {
        return lab("/dev/kvm does not exist");
    }
    if pvm_loaded {
        return lab("/dev/kvm is PVM (kvm_pvm is loaded), which cannot boot unmodified Linux");
    }
    match virt_flag(cpuinfo) {
        Some(flag) => Detection {
            environment: Environment::Hardware,
            reason: format!("/dev/kvm exists and the CPU has {flag}"),
        },
        None => lab("the CPU has neither vmx nor svm in /proc/cpuinfo"),
    }
}

/// The hardware virtualization flag named in cpuinfo's `flags` lines, if any.
fn virt_flag(cpuinfo: &str) -> Option<&'static str> {
    for line in cpuinfo.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        if key.trim() != "flags" {
            continue;
        }
        for word in value.split_whitespace() {
            match word {
                "vmx" => return Some("vmx"),
                "svm" => return Some("svm"),
                _ => {}
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const AMD: &str = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu vme de pse svm npt\nbugs\t\t: sysret_ss_attrs\n";
    const INTEL: &str = "processor\t: 0\nflags\t\t: fpu vmx ept\n";
    const NONE: &str =
        "processor\t: 0\nflags\t\t: fpu vme hypervisor svm_lock\nvmx flags\t: vnmi\n";

    #[test]
    fn hardware_needs_kvm_flag_and_no_pvm() {
        assert_eq!(
            detect_from(true, false, AMD).environment,
            Environment::Hardware
        );
        let intel = detect_from(true, false, INTEL);
        assert_eq!(intel.environment, Environment::Hardware);
        assert!(intel.reason.contains("vmx"));
    }

    #[test]
    fn pvm_means_lab_even_with_flags() {
        let d = detect_from(true, true, AMD);
        assert_eq!(d.environment, Environment::Lab);
        assert!(d.reason.contains("PVM"));
    }

    #[test]
    fn missing_kvm_means_lab() {
        let d = detect_from(false, false, AMD);
        assert_eq!(d.environment, Environment::Lab);
        assert!(d.reason.contains("/dev/kvm"));
    }

    #[test]
    fn flag_must_be_a_whole_word_on_a_flags_line() {
        // `svm_lock` is not `svm`, and the `vmx flags` line is not `flags`.
        let d = detect_from(true, false, NONE);
        assert_eq!(d.environment, Environment::Lab);
        assert_eq!(d.environment.to_string(), "lab");
    }
}

//! `sandfork bench`: boot, snapshot, restore and fork figures of sandfork-vmm,
//! and of a reference Firecracker on the same kernel and image when one is
//! given (for what Firecracker can do); then the node's figures through the
//! E2B Python SDK against `sandfork serve` (`sdk`).

pub mod sdk;
mod snapshot;
pub mod summary;

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use serde_json::{Value, json};

use crate::launcher::{self, GuestImage};

const BOOT_TIMEOUT: Duration = Duration::from_secs(300);

pub(crate) fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Boots `runs` times and returns the figures as JSON.
async fn measure(vmm: &Path, image: &GuestImage, runs: usize) -> Result<Value> {
    let mut boot_ms = Vec::with_capacity(runs);
    let name = vmm.file_name().map_or_else(
        || vmm.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    for run in 1..=runs {
        let (vm, took) = launcher::boot_to_agent(vmm, image, BOOT_TIMEOUT).await?;
        boot_ms.push(took.as_secs_f64() * 1000.0);
        eprintln!(
            "bench: {name} boot {run}/{runs}: {:.0} ms to agent",
            took.as_secs_f64() * 1000.0
        );
        vm.shutdown(Duration::from_secs(30)).await?;
    }
    let samples = boot_ms.clone();
    Ok(json!({
        "vmm": vmm.display().to_string(),
        "boot_to_agent_ms": median(&mut boot_ms),
        "boot_to_agent_ms_samples": samples,
    }))
}

fn merge(into: &mut Value, from: Value) {
    if let (Value::Object(into), Value::Object(from)) = (into, from) {
        into.extend(from);
    }
}

/// A part of the bench that can be run alone (`--only`).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    Vmm,
    Sdk,
}

pub struct VmmFigures<'a> {
    pub runs: usize,
    pub firecracker: Option<&'a Path>,
}

/// What one `sandfork bench` measures.
pub struct Plan<'a> {
    pub environment: String,
    pub vmm: &'a Path,
    pub image: &'a GuestImage,
    pub vmm_figures: Option<VmmFigures<'a>>,
    pub sdk: Option<sdk::SdkBench<'a>>,
}

impl Plan<'_> {
    pub async fn run(&self) -> Result<Value> {
        let mut report = json!({});
        if let Some(figures) = &self.vmm_figures {
            report = vmm_figures(self.vmm, figures.firecracker, self.image, figures.runs).await?;
            report["runs"] = json!(figures.runs);
        }
        if let Some(sdk) = &self.sdk {
            merge(&mut report, sdk.measure().await?);
        }
        report["environment"] = json!(self.environment);
        report["guest"] = json!({"vcpus": self.image.vcpus, "mem_mib": self.image.mem_mib});
        if self.environment == "lab" {
            report["note"] = json!(
                "emulated: measured inside the KVM lab (QEMU TCG with nested SVM), roughly \
                 20-50x slower than hardware KVM; compare ratios, not absolute times"
            );
        }
        Ok(report)
    }
}

async fn vmm_figures(
    vmm: &Path,
    firecracker: Option<&Path>,
    image: &GuestImage,
    runs: usize,
) -> Result<Value> {
    let mut report = measure(vmm, image, runs).await?;
    merge(&mut report, snapshot::measure(vmm, image, runs).await?);
    let reference = match firecracker {
        Some(fc) => {
            let mut fc_report = measure(fc, image, runs).await?;
            merge(
                &mut fc_report,
                snapshot::measure_reference(fc, image, runs).await?,
            );
            for key in [
                "boot_to_agent_ms",
                "restore_to_agent_ms",
                "pause_ms",
                "snapshot_full_ms",
            ] {
                let ratio = report[key].as_f64().unwrap_or(f64::NAN)
                    / fc_report[key].as_f64().unwrap_or(f64::NAN);
                let name = format!("{}_ratio_vs_reference", key.trim_end_matches("_ms"));
                report[name] = json!(ratio);
            }
            fc_report
        }
        None => Value::Null,
    };
    report["reference"] = reference;
    Ok(report)
}

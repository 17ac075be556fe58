//! `sandfork bench`: boot, snapshot, restore and fork figures of sandfork-vmm,
//! and of a reference Firecracker on the same kernel and image when one is
//! given (for what Firecracker can do); memory a guest frees given back by
//! its balloon (`balloon`); network slot setup (`net`); TCP to and from a
//! guest over its VMM's virtio-net and a tap alone, for both VMMs
//! (`guest_tcp`); then the node's figures through the
//! E2B Python SDK against `sandfork serve` (`sdk`), and when forking a
//! stateful episode pays against snapshot-and-create and create-and-replay
//! (`rl`, a phase of the same script: `rl_bench.py`); and task images of
//! 1-4 GiB pulled from a loopback registry and converted, cold, with the
//! disk images sharing a base take (`images`).

mod balloon;
pub mod cluster_scale;
mod guest_tcp;
pub mod images;
mod net;
mod plot;
pub mod report;
pub mod sdk;
mod snapshot;
pub mod summary;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::{Map, Value, json};

use crate::launcher::{self, GuestImage};

const BOOT_TIMEOUT: Duration = Duration::from_secs(300);

pub(crate) fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// The key of the ratio of ours to the reference's figure `key`
/// (`boot_to_agent_ms` -> `boot_to_agent_ratio_vs_reference`).
pub(crate) fn ratio_key(key: &str) -> String {
    let stem = key
        .strip_suffix("_ms")
        .or_else(|| key.strip_suffix("_mib_s"))
        .unwrap_or(key);
    format!("{stem}_ratio_vs_reference")
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

/// What `sandfork bench` does instead of measuring.
#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Render the Markdown report and SVG plots of a bench JSON (as
    /// `sandfork bench --json FILE` writes, or its stdout saved) beside it:
    /// `out/bench.json` gives `out/bench.md` and `out/bench-plots/`.
    ///
    /// Example: sandfork bench report --json out/bench.json
    Report {
        #[arg(long, value_name = "FILE")]
        json: std::path::PathBuf,
    },
}

/// A part of the bench that can be run alone (`--only`).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    Vmm,
    Sdk,
    /// Branching an episode N ways at step k: fork, snapshot, replay.
    Rl,
    /// The cluster's control plane with many node records and routes
    /// (etcd and gateways on this host; no sandbox runs).
    ClusterScale,
    /// Task images pulled and converted (no guest: runs on the host).
    Images,
}

/// A part of the VMM figures that can be measured alone (`--vmm-parts`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum VmmPart {
    /// `boot_to_agent_ms`.
    Boot,
    /// Pause, full and diff snapshot, restore to the agent.
    Snapshot,
    /// Fork of 1 and of 16, an idle child's memory.
    Fork,
    Balloon,
    /// Slot setup and guest TCP over a tap (need root).
    Net,
}

impl VmmPart {
    pub const ALL: &'static [VmmPart] = &[
        VmmPart::Boot,
        VmmPart::Snapshot,
        VmmPart::Fork,
        VmmPart::Balloon,
        VmmPart::Net,
    ];
}

pub struct VmmFigures<'a> {
    pub runs: usize,
    pub firecracker: Option<&'a Path>,
    /// The parts measured (for the reference too, where it can).
    pub parts: &'a [VmmPart],
}

/// What one `sandfork bench` measures.
pub struct Plan<'a> {
    pub environment: String,
    pub vmm: &'a Path,
    pub image: &'a GuestImage,
    pub vmm_figures: Option<VmmFigures<'a>>,
    pub sdk: Option<sdk::SdkBench<'a>>,
    pub images: Option<images::ImagesBench<'a>>,
    /// The whole bench ends by then: a part still running is abandoned and
    /// the report printed with what was measured.
    pub deadline: Instant,
}

/// Parts that failed, by name, with their error.
pub type Errors = Map<String, Value>;

/// Runs `part` until the plan's deadline; its figures are merged into
/// `report`, or its error (or overrun) recorded under `name`.
async fn part(
    report: &mut Value,
    errors: &mut Errors,
    name: &str,
    deadline: Instant,
    part: impl std::future::Future<Output = Result<Value>>,
) {
    let left = deadline.saturating_duration_since(Instant::now());
    let error = match tokio::time::timeout(left, part).await {
        Ok(Ok(figures)) => {
            merge(report, figures);
            return;
        }
        Ok(Err(e)) => format!("{e:#}"),
        Err(_) => "did not finish before the bench's --timeout".to_owned(),
    };
    eprintln!("bench: {name} failed: {error}");
    errors.insert(name.to_owned(), json!(error));
}

impl Plan<'_> {
    /// Every part, each on its own: one that fails or overruns is recorded
    /// in `errors` and the next runs, so the report always holds everything
    /// measured.
    pub async fn run(&self) -> Value {
        let mut report = json!({});
        let mut errors = Errors::new();
        if let Some(figures) = &self.vmm_figures {
            self.vmm_figures(&mut report, &mut errors, figures).await;
            report["runs"] = json!(figures.runs);
        }
        if let Some(sdk) = &self.sdk {
            part(
                &mut report,
                &mut errors,
                "sdk",
                self.deadline,
                sdk.measure(),
            )
            .await;
        }
        if let Some(images) = &self.images {
            let figures = images.measure();
            part(&mut report, &mut errors, "images", self.deadline, figures).await;
        }
        report["environment"] = json!(self.environment);
        report["guest"] = json!({"vcpus": self.image.vcpus, "mem_mib": self.image.mem_mib});
        if self.environment == "lab" {
            report["note"] = json!(
                "emulated: measured inside the KVM lab (QEMU TCG with nested SVM), roughly \
                 20-50x slower than hardware KVM; compare ratios, not absolute times"
            );
        }
        report["errors"] = Value::Object(errors);
        report
    }

    async fn vmm_figures(&self, report: &mut Value, errors: &mut Errors, figures: &VmmFigures<'_>) {
        let (vmm, image, runs) = (self.vmm, self.image, figures.runs);
        let has = |p| figures.parts.contains(&p);
        if has(VmmPart::Boot) {
            let boots = measure(vmm, image, runs);
            part(report, errors, "boot", self.deadline, boots).await;
        }
        if has(VmmPart::Snapshot) || has(VmmPart::Fork) {
            let snapshots = snapshot::measure(vmm, image, runs, has(VmmPart::Fork));
            part(report, errors, "snapshot", self.deadline, snapshots).await;
        }
        if has(VmmPart::Balloon) {
            let balloon = balloon::measure(vmm, image);
            part(report, errors, "balloon", self.deadline, balloon).await;
        }
        if has(VmmPart::Net) {
            part(report, errors, "net", self.deadline, net::measure()).await;
            let tcp = guest_tcp::measure(vmm, image);
            part(report, errors, "guest_tcp", self.deadline, tcp).await;
        }
        let Some(fc) = figures.firecracker else {
            report["reference"] = Value::Null;
            return;
        };
        let mut reference = json!({});
        if has(VmmPart::Boot) {
            let boots = measure(fc, image, runs);
            part(
                &mut reference,
                errors,
                "reference_boot",
                self.deadline,
                boots,
            )
            .await;
        }
        if has(VmmPart::Snapshot) {
            let snapshots = snapshot::measure_reference(fc, image, runs);
            part(
                &mut reference,
                errors,
                "reference_snapshot",
                self.deadline,
                snapshots,
            )
            .await;
        }
        if has(VmmPart::Net) {
            let tcp = guest_tcp::measure(fc, image);
            part(
                &mut reference,
                errors,
                "reference_guest_tcp",
                self.deadline,
                tcp,
            )
            .await;
        }
        for key in [
            "boot_to_agent_ms",
            "restore_to_agent_ms",
            "pause_ms",
            "snapshot_full_ms",
            "vmm_guest_tcp_host_to_guest_mib_s",
            "vmm_guest_tcp_guest_to_host_mib_s",
        ] {
            // Only where both sides measured it.
            if let (Some(ours), Some(theirs)) = (report[key].as_f64(), reference[key].as_f64()) {
                report[ratio_key(key)] = json!(ours / theirs);
            }
        }
        report["reference"] = reference;
    }
}

/// Whether the report records a part, or a phase of the SDK bench, that
/// failed (the exit status says so).
pub fn failed(report: &Value) -> bool {
    let any = |key: &str| report[key].as_object().is_some_and(|m| !m.is_empty());
    any("errors") || any("sdk_errors") || report["sdk_error"].is_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image() -> GuestImage {
        GuestImage {
            kernel: "/nonexistent/vmlinux".into(),
            rootfs: "/nonexistent/rootfs.ext4".into(),
            vcpus: 1,
            mem_mib: 128,
        }
    }

    /// A VMM that cannot even start: every part fails, each is recorded,
    /// and the report still has everything else.
    #[tokio::test]
    async fn a_failing_part_is_recorded_and_the_others_run() {
        let image = image();
        let vmm = Path::new("/nonexistent/sandfork-vmm");
        let plan = Plan {
            environment: "hardware".into(),
            vmm,
            image: &image,
            vmm_figures: Some(VmmFigures {
                runs: 1,
                firecracker: Some(Path::new("/nonexistent/firecracker")),
                parts: &[
                    VmmPart::Boot,
                    VmmPart::Snapshot,
                    VmmPart::Fork,
                    VmmPart::Balloon,
                ],
            }),
            sdk: None,
            images: None,
            deadline: Instant::now() + Duration::from_secs(60),
        };
        let report = plan.run().await;
        let errors = report["errors"].as_object().unwrap();
        let names: Vec<&str> = errors.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "balloon",
                "boot",
                "reference_boot",
                "reference_snapshot",
                "snapshot"
            ]
        );
        assert!(
            errors["boot"]
                .as_str()
                .unwrap()
                .contains("/nonexistent/sandfork-vmm"),
            "{errors:?}"
        );
        assert_eq!(report["guest"]["mem_mib"], 128);
        assert_eq!(report["runs"], 1);
        assert!(report.get("boot_to_agent_ratio_vs_reference").is_none());
        assert!(failed(&report));
    }

    /// A part that never ends is abandoned at the deadline.
    #[tokio::test]
    async fn a_part_that_overruns_is_cut_at_the_deadline() {
        let mut report = json!({"kept": 1});
        let mut errors = Errors::new();
        let deadline = Instant::now() + Duration::from_millis(50);
        part(&mut report, &mut errors, "stuck", deadline, async {
            std::future::pending::<()>().await;
            Ok(json!({}))
        })
        .await;
        part(&mut report, &mut errors, "late", deadline, async {
            Ok(json!({"late": 2}))
        })
        .await;
        assert!(errors["stuck"].as_str().unwrap().contains("--timeout"));
        // Past the deadline even a quick part is not started.
        assert!(errors.contains_key("late") || report["late"] == 2);
        assert_eq!(report["kept"], 1);
        part(
            &mut report,
            &mut errors,
            "ok",
            Instant::now() + Duration::from_secs(5),
            async { Ok(json!({"figure": 3})) },
        )
        .await;
        assert_eq!(report["figure"], 3);
        assert!(!errors.contains_key("ok"));
    }

    #[test]
    fn ratio_keys_drop_the_unit() {
        assert_eq!(
            ratio_key("boot_to_agent_ms"),
            "boot_to_agent_ratio_vs_reference"
        );
        assert_eq!(
            ratio_key("vmm_guest_tcp_host_to_guest_mib_s"),
            "vmm_guest_tcp_host_to_guest_ratio_vs_reference"
        );
    }

    #[test]
    fn failures_are_errors_of_parts_or_of_sdk_phases() {
        assert!(!failed(&json!({"errors": {}, "sdk_errors": {}})));
        assert!(!failed(&json!({"boot_to_agent_ms": 3})));
        assert!(failed(&json!({"errors": {"boot": "x"}})));
        assert!(failed(
            &json!({"errors": {}, "sdk_errors": {"fork16": "x"}})
        ));
    }
}

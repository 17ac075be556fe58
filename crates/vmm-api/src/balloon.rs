//! `PUT/GET/PATCH /balloon` and `GET/PATCH /balloon/statistics`: the
//! virtio-balloon device, as in Firecracker's API.

use serde::{Deserialize, Serialize};

use crate::validation::ValidationError;

/// The body of `PUT /balloon` (before boot), the answer to `GET /balloon`
/// and the `balloon` key of a config file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Balloon {
    /// The balloon's target size: memory the guest is asked to give back.
    pub amount_mib: u32,
    /// Let the guest take pages back from the balloon when it runs out of
    /// memory, instead of its OOM killer ending a process.
    pub deflate_on_oom: bool,
    /// Seconds between statistics updates; 0 turns statistics off (and they
    /// cannot be turned on after boot).
    #[serde(default)]
    pub stats_polling_interval_s: u16,
    /// The guest reports the pages it frees, and the VMM gives them back to
    /// the host (Firecracker 1.12's field).
    #[serde(default)]
    pub free_page_reporting: bool,
    /// Firecracker's hinting mode; parsed so its files load, refused when on.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub free_page_hinting: bool,
}

impl Balloon {
    pub fn validate(&self) -> Result<(), ValidationError> {
        if self.free_page_hinting {
            return Err(ValidationError::new(
                "free_page_hinting is not supported: use free_page_reporting",
            ));
        }
        Ok(())
    }
}

/// The body of `PATCH /balloon`: a new target, after boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BalloonUpdate {
    pub amount_mib: u32,
}

/// The body of `PATCH /balloon/statistics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BalloonStatsUpdate {
    pub stats_polling_interval_s: u16,
}

/// The answer to `GET /balloon/statistics`: the balloon's target and actual
/// size, what the guest last reported (absent until it reports a field),
/// and how much memory the VMM gave back to the host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BalloonStats {
    pub target_pages: u32,
    pub actual_pages: u32,
    pub target_mib: u32,
    pub actual_mib: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swap_in: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swap_out: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major_faults: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor_faults: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_memory: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_memory: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub available_memory: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_caches: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugetlb_allocations: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugetlb_failures: Option<u64>,
    /// Sandfork extension: bytes of guest memory the VMM returned to the
    /// host for free page reports since the VMM started.
    #[serde(default)]
    pub reported_bytes: u64,
    /// Sandfork extension: bytes returned for pages put in the balloon.
    #[serde(default)]
    pub inflated_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn firecracker_shaped_json() {
        let b: Balloon = serde_json::from_str(
            r#"{"amount_mib": 64, "deflate_on_oom": true, "stats_polling_interval_s": 1}"#,
        )
        .unwrap();
        assert_eq!(b.amount_mib, 64);
        assert!(!b.free_page_reporting);
        b.validate().unwrap();
        let with_reporting: Balloon = serde_json::from_str(
            r#"{"amount_mib": 0, "deflate_on_oom": false, "free_page_reporting": true}"#,
        )
        .unwrap();
        assert!(with_reporting.free_page_reporting);
        assert_eq!(
            serde_json::to_value(&with_reporting).unwrap(),
            serde_json::json!({"amount_mib": 0, "deflate_on_oom": false,
                "stats_polling_interval_s": 0, "free_page_reporting": true})
        );
        let update: BalloonUpdate = serde_json::from_str(r#"{"amount_mib": 10}"#).unwrap();
        assert_eq!(update.amount_mib, 10);
        let stats = BalloonStats {
            free_memory: Some(1 << 20),
            ..BalloonStats::default()
        };
        let v = serde_json::to_value(&stats).unwrap();
        assert_eq!(v["free_memory"], 1 << 20);
        assert!(v.get("swap_in").is_none());
    }

    #[test]
    fn rejects_bad_input() {
        assert!(serde_json::from_str::<Balloon>(r#"{"amount_mib": 1}"#).is_err());
        assert!(
            serde_json::from_str::<Balloon>(
                r#"{"amount_mib": 1, "deflate_on_oom": true, "size": 2}"#
            )
            .is_err()
        );
        let hinting: Balloon = serde_json::from_str(
            r#"{"amount_mib": 0, "deflate_on_oom": true, "free_page_hinting": true}"#,
        )
        .unwrap();
        assert!(hinting.validate().is_err());
        assert!(serde_json::from_str::<BalloonUpdate>(r#"{"amount_mib": -1}"#).is_err());
        assert!(serde_json::from_str::<BalloonStatsUpdate>(r#"{}"#).is_err());
    }
}

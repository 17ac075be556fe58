//! `PUT /drives/{drive_id}` and `PATCH /drives/{drive_id}`: virtio-blk devices.

use serde::{Deserialize, Serialize};

use crate::validation::{ValidationError, validate_path, validate_resource_id};

/// How the device treats guest flush requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum CacheType {
    /// Flushes are acknowledged without syncing the backing file.
    #[default]
    Unsafe,
    /// Flushes sync the backing file.
    Writeback,
}

/// Firecracker's choice of block I/O engine; sandfork only has a synchronous one and
/// accepts the field so Firecracker configurations load unchanged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum IoEngine {
    #[default]
    Sync,
    Async,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Drive {
    pub drive_id: String,
    pub path_on_host: String,
    pub is_root_device: bool,
    /// Absent means read-write, as in Firecracker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is_read_only: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partuuid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_type: Option<CacheType>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_engine: Option<IoEngine>,
    /// Accepted for compatibility; sandfork does not rate-limit block I/O.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limiter: Option<serde_json::Value>,
    /// Firecracker's vhost-user-block backend socket; parsed only to reject it with a
    /// clear message rather than "unknown field".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<String>,
}

impl Drive {
    /// A plain read-write or read-only drive with every optional field absent.
    pub fn new(
        drive_id: impl Into<String>,
        path_on_host: impl Into<String>,
        is_root_device: bool,
        is_read_only: bool,
    ) -> Self {
        Self {
            drive_id: drive_id.into(),
            path_on_host: path_on_host.into(),
            is_root_device,
            is_read_only: Some(is_read_only),
            partuuid: None,
            cache_type: None,
            io_engine: None,
            rate_limiter: None,
            socket: None,
        }
    }

    pub fn read_only(&self) -> bool {
        self.is_read_only.unwrap_or(false)
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_resource_id("drive_id", &self.drive_id)?;
        if self.socket.is_some() {
            return Err(ValidationError::new(
                "socket (vhost-user-block) is not supported; use path_on_host",
            ));
        }
        validate_path("path_on_host", &self.path_on_host)?;
        if let Some(partuuid) = &self.partuuid {
            if !self.is_root_device {
                return Err(ValidationError::new(
                    "partuuid is only meaningful when is_root_device is true",
                ));
            }
            if partuuid.is_empty() || partuuid.chars().any(|c| c.is_whitespace()) {
                return Err(ValidationError::new(
                    "partuuid must be non-empty and contain no whitespace",
                ));
            }
        }
        validate_rate_limiter(self.rate_limiter.as_ref())
    }
}

/// `PATCH /drives/{drive_id}`: a post-boot update of the backing file or rate limiter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartialDrive {
    pub drive_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_on_host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limiter: Option<serde_json::Value>,
}

impl PartialDrive {
    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_resource_id("drive_id", &self.drive_id)?;
        if let Some(path) = &self.path_on_host {
            validate_path("path_on_host", path)?;
        }
        validate_rate_limiter(self.rate_limiter.as_ref())
    }
}

fn validate_rate_limiter(value: Option<&serde_json::Value>) -> Result<(), ValidationError> {
    match value {
        None | Some(serde_json::Value::Null) | Some(serde_json::Value::Object(_)) => Ok(()),
        Some(_) => Err(ValidationError::new("rate_limiter must be a JSON object")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn firecracker_shaped_json() {
        let body = r#"{
            "drive_id": "rootfs",
            "path_on_host": "/img/rootfs.ext4",
            "is_root_device": true,
            "is_read_only": false,
            "cache_type": "Writeback",
            "io_engine": "Sync",
            "rate_limiter": {"bandwidth": {"size": 1000, "refill_time": 100}}
        }"#;
        let d: Drive = serde_json::from_str(body).unwrap();
        assert_eq!(d.drive_id, "rootfs");
        assert!(d.is_root_device);
        assert!(!d.read_only());
        assert_eq!(d.cache_type, Some(CacheType::Writeback));
        assert_eq!(d.io_engine, Some(IoEngine::Sync));
        assert!(d.rate_limiter.is_some());
        d.validate().unwrap();
    }

    #[test]
    fn minimal_body_and_round_trip() {
        let d: Drive = serde_json::from_str(
            r#"{"drive_id": "data", "path_on_host": "/d", "is_root_device": false}"#,
        )
        .unwrap();
        assert!(!d.read_only());
        let v = serde_json::to_value(&d).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"drive_id": "data", "path_on_host": "/d", "is_root_device": false})
        );
        let d2 = Drive::new("data", "/d", false, true);
        assert_eq!(serde_json::to_value(&d2).unwrap()["is_read_only"], true);
    }

    #[test]
    fn rejects_bad_input() {
        let err = serde_json::from_str::<Drive>(
            r#"{"drive_id": "a", "path_on_host": "/d", "is_root_device": false, "bogus": 1}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown field `bogus`"), "{err}");
        let err = serde_json::from_str::<Drive>(
            r#"{"drive_id": "a", "path_on_host": "/d", "is_root_device": "yes"}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("expected a boolean"), "{err}");
        let err = serde_json::from_str::<Drive>(
            r#"{"drive_id": "a", "path_on_host": "/d", "is_root_device": false, "cache_type": "Fast"}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown variant `Fast`"), "{err}");

        let mut d = Drive::new("bad id", "/d", false, false);
        assert!(d.validate().unwrap_err().to_string().contains("drive_id"));
        d.drive_id = "ok".into();
        d.socket = Some("/s".into());
        assert!(d.validate().unwrap_err().to_string().contains("vhost-user"));
        d.socket = None;
        d.partuuid = Some("abcd-01".into());
        assert!(
            d.validate()
                .unwrap_err()
                .to_string()
                .contains("is_root_device")
        );
        d.is_root_device = true;
        d.validate().unwrap();
        d.rate_limiter = Some(serde_json::json!(5));
        assert!(d.validate().is_err());
    }

    #[test]
    fn partial_drive() {
        let p: PartialDrive =
            serde_json::from_str(r#"{"drive_id": "data", "path_on_host": "/new"}"#).unwrap();
        p.validate().unwrap();
        assert!(
            serde_json::from_str::<PartialDrive>(r#"{"drive_id": "d", "is_root_device": true}"#)
                .is_err()
        );
    }
}

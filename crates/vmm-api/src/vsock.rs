//! `PUT /vsock`: the virtio-vsock device and its host-side Unix socket.

use serde::{Deserialize, Serialize};

use crate::validation::{ValidationError, validate_path};

/// CIDs 0-2 are reserved (hypervisor, local, host); `u32::MAX` means "any".
const MIN_GUEST_CID: u32 = 3;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Vsock {
    pub guest_cid: u32,
    /// Host connections go to this socket (`CONNECT <port>\n`); guest-initiated ones to
    /// `<uds_path>_<port>`.
    pub uds_path: String,
    /// Deprecated by Firecracker; accepted and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock_id: Option<String>,
}

impl Vsock {
    pub fn new(guest_cid: u32, uds_path: impl Into<String>) -> Self {
        Self {
            guest_cid,
            uds_path: uds_path.into(),
            vsock_id: None,
        }
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        if self.guest_cid < MIN_GUEST_CID || self.guest_cid == u32::MAX {
            return Err(ValidationError::new(format!(
                "guest_cid must be between {MIN_GUEST_CID} and {}, got {}",
                u32::MAX - 1,
                self.guest_cid
            )));
        }
        validate_path("uds_path", &self.uds_path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn firecracker_shaped_json() {
        let v: Vsock = serde_json::from_str(
            r#"{"vsock_id": "vsock0", "guest_cid": 3, "uds_path": "/tmp/v.sock"}"#,
        )
        .unwrap();
        assert_eq!(v.guest_cid, 3);
        assert_eq!(v.vsock_id.as_deref(), Some("vsock0"));
        v.validate().unwrap();
        assert_eq!(
            serde_json::to_value(Vsock::new(7, "/s")).unwrap(),
            serde_json::json!({"guest_cid": 7, "uds_path": "/s"})
        );
    }

    #[test]
    fn rejects_bad_input() {
        assert!(
            serde_json::from_str::<Vsock>(r#"{"guest_cid": 3, "uds_path": "/s", "port": 1}"#)
                .is_err()
        );
        assert!(serde_json::from_str::<Vsock>(r#"{"guest_cid": -1, "uds_path": "/s"}"#).is_err());
        let err = Vsock::new(2, "/s").validate().unwrap_err();
        assert!(err.to_string().contains("guest_cid"), "{err}");
        assert!(Vsock::new(u32::MAX, "/s").validate().is_err());
        assert!(Vsock::new(3, "").validate().is_err());
    }
}

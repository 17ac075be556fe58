//! `GET /`: who this VMM is and what state its guest is in.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum InstanceState {
    #[serde(rename = "Not started")]
    NotStarted,
    Running,
    Paused,
}

/// Parsed leniently (no `deny_unknown_fields`): it is a response, and newer Firecrackers
/// may add fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceInfo {
    pub id: String,
    pub state: InstanceState,
    pub vmm_version: String,
    pub app_name: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn firecracker_shaped_json() {
        let i: InstanceInfo = serde_json::from_str(
            r#"{"id": "anonymous-instance", "state": "Not started", "vmm_version": "1.7.0", "app_name": "Firecracker"}"#,
        )
        .unwrap();
        assert_eq!(i.state, InstanceState::NotStarted);
        assert_eq!(i.app_name, "Firecracker");
        let back = serde_json::to_value(&i).unwrap();
        assert_eq!(back["state"], "Not started");
        for s in ["Running", "Paused"] {
            let v = serde_json::json!({"id": "x", "state": s, "vmm_version": "1", "app_name": "a"});
            serde_json::from_value::<InstanceInfo>(v).unwrap();
        }
    }
}

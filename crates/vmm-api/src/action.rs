//! `PUT /actions`: start the guest, send Ctrl+Alt+Del, flush metrics.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ActionType {
    InstanceStart,
    SendCtrlAltDel,
    FlushMetrics,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstanceActionInfo {
    pub action_type: ActionType,
}

impl InstanceActionInfo {
    pub fn new(action_type: ActionType) -> Self {
        Self { action_type }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn firecracker_shaped_json() {
        for (text, want) in [
            ("InstanceStart", ActionType::InstanceStart),
            ("SendCtrlAltDel", ActionType::SendCtrlAltDel),
            ("FlushMetrics", ActionType::FlushMetrics),
        ] {
            let body = format!(r#"{{"action_type": "{text}"}}"#);
            let a: InstanceActionInfo = serde_json::from_str(&body).unwrap();
            assert_eq!(a.action_type, want);
            assert_eq!(
                serde_json::to_value(a).unwrap(),
                serde_json::json!({"action_type": text})
            );
        }
    }

    #[test]
    fn rejects_bad_input() {
        let err =
            serde_json::from_str::<InstanceActionInfo>(r#"{"action_type": "Reboot"}"#).unwrap_err();
        assert!(
            err.to_string().contains("unknown variant `Reboot`"),
            "{err}"
        );
        assert!(
            serde_json::from_str::<InstanceActionInfo>(
                r#"{"action_type": "InstanceStart", "payload": {}}"#
            )
            .is_err()
        );
        assert!(serde_json::from_str::<InstanceActionInfo>("{}").is_err());
    }
}

//! `PATCH /vm`: pause or resume the guest.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum VmState {
    Paused,
    Resumed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Vm {
    pub state: VmState,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn firecracker_shaped_json() {
        let v: Vm = serde_json::from_str(r#"{"state": "Paused"}"#).unwrap();
        assert_eq!(v.state, VmState::Paused);
        let v: Vm = serde_json::from_str(r#"{"state": "Resumed"}"#).unwrap();
        assert_eq!(v.state, VmState::Resumed);
        assert!(serde_json::from_str::<Vm>(r#"{"state": "paused"}"#).is_err());
        assert!(serde_json::from_str::<Vm>(r#"{"state": "Paused", "x": 1}"#).is_err());
    }
}

//! The error body every failing route returns.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiError {
    pub fault_message: String,
}

impl ApiError {
    pub fn new(fault_message: impl Into<String>) -> Self {
        Self {
            fault_message: fault_message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape() {
        assert_eq!(
            serde_json::to_string(&ApiError::new("boom")).unwrap(),
            r#"{"fault_message":"boom"}"#
        );
    }
}

//! Errors as E2B's API answers them: `{"code": <status>, "message": "..."}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::node::events::Denial;
use crate::node::sandbox::SandboxError;
use crate::wire::{self, CLUSTER_STATE_HEADER, TEAM_LIMIT_HEADER};

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The answer is the cluster's, not the node's (a header says which).
    pub cluster_wide: Option<ClusterWide>,
}

/// Why an answer would be the same on every node of a cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterWide {
    /// The caller's team is at its limit (a 429 with [`TEAM_LIMIT_HEADER`]).
    TeamLimit,
    /// etcd failed (a 503 with [`CLUSTER_STATE_HEADER`]).
    ClusterState,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            cluster_wide: None,
        }
    }

    /// A 429 for a team at its limit.
    pub fn team_limit(message: impl Into<String>) -> ApiError {
        ApiError {
            cluster_wide: Some(ClusterWide::TeamLimit),
            ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, message)
        }
    }

    /// A 503 for an etcd failure `e`.
    pub fn cluster_state(e: impl std::fmt::Display) -> ApiError {
        ApiError {
            cluster_wide: Some(ClusterWide::ClusterState),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("cluster state: {e}"),
            )
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = wire::Error {
            code: self.status.as_u16(),
            message: self.message,
        };
        let mut answer = (self.status, axum::Json(body)).into_response();
        let header = match self.cluster_wide {
            None => None,
            Some(ClusterWide::TeamLimit) => Some(TEAM_LIMIT_HEADER),
            Some(ClusterWide::ClusterState) => Some(CLUSTER_STATE_HEADER),
        };
        if let Some(header) = header {
            answer
                .headers_mut()
                .insert(header, axum::http::HeaderValue::from_static("1"));
        }
        answer
    }
}

/// What the cluster said no with: the same on every node for a team at
/// its limit and for the cluster's state.
impl From<Denial> for ApiError {
    fn from(denial: Denial) -> ApiError {
        let message = denial.to_string();
        match denial {
            Denial::TeamFull { .. } => ApiError::team_limit(message),
            Denial::ClusterState(_) => ApiError {
                cluster_wide: Some(ClusterWide::ClusterState),
                ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)
            },
            Denial::Conflict(_) => ApiError::new(StatusCode::CONFLICT, message),
            Denial::NotFound(_) => ApiError::new(StatusCode::NOT_FOUND, message),
            Denial::Unavailable(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message),
        }
    }
}

impl From<SandboxError> for ApiError {
    fn from(e: SandboxError) -> ApiError {
        match e {
            SandboxError::TeamLimit(message) => return ApiError::team_limit(message),
            SandboxError::Denied(denial) => return denial.into(),
            _ => {}
        }
        let status = match &e {
            SandboxError::NotFound(_)
            | SandboxError::TemplateNotFound(_)
            | SandboxError::BuildNotReady(_) => StatusCode::NOT_FOUND,
            SandboxError::AtCapacity { .. } => StatusCode::TOO_MANY_REQUESTS,
            SandboxError::OverCapacity(_) => StatusCode::SERVICE_UNAVAILABLE,
            SandboxError::Conflict { .. }
            | SandboxError::InUse { .. }
            | SandboxError::NameTaken(_) => StatusCode::CONFLICT,
            SandboxError::Invalid(_) => StatusCode::BAD_REQUEST,
            SandboxError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            SandboxError::Network(crate::node::net::NetError::Exhausted(_)) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            SandboxError::Network(crate::node::net::NetError::InvalidPolicy(_)) => {
                StatusCode::BAD_REQUEST
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let message = e.to_string();
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            // The whole error, with a stuck guest's diagnostics (console,
            // VMM threads, host kernel messages), is for the node's log;
            // the client gets what failed, not the host's insides.
            tracing::error!("{message}");
            let first = message.lines().next().unwrap_or_default();
            return ApiError::new(status, format!("{first} (details in the node's log)"));
        }
        ApiError::new(status, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_network_slots_is_a_503_that_says_so() {
        let e = ApiError::from(SandboxError::Network(
            crate::node::net::NetError::Exhausted(1024),
        ));
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.message, "no free network slot (all 1024 in use)");
    }

    #[test]
    fn an_internal_error_answers_its_first_line_and_logs_the_rest() {
        let e = SandboxError::Unavailable("unused".into());
        assert_eq!(ApiError::from(e).message, "unused");
        let stuck = SandboxError::Io {
            what: "the agent did not answer\n--- host kernel messages ---\nsecret".into(),
            source: std::io::Error::other("timed out"),
        };
        let answer = ApiError::from(stuck);
        assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            answer.message,
            "the agent did not answer (details in the node's log)"
        );
    }
}

//! Errors as E2B's API answers them: `{"code": <status>, "message": "..."}`.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::node::events::Denial;
use crate::node::idempotent::IdempotencyError;
use crate::node::sandbox::SandboxError;
use crate::node::template::ImageError;
use crate::node::volume::VolumeError;
use crate::node::webhooks::WebhookError;
use crate::wire::{
    self, BUILDING_HEADER, CLUSTER_STATE_HEADER, RETRY_AFTER_HEADER, SHOULD_RETRY_HEADER,
    TEAM_LIMIT_HEADER,
};

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The answer is the cluster's, not the node's (a header says which).
    pub cluster_wide: Option<ClusterWide>,
    /// What the SDKs' retry should do (see [`Retry`]); None: the default
    /// of the status.
    pub retry: Option<Retry>,
    /// E2B's `error_code` of the body, for the errors E2B names.
    pub error_code: Option<&'static str>,
}

/// What a refusal tells the E2B SDKs' retry. They retry a 429, 502, 503 or
/// 504 by themselves (the JS SDK only a 429 with `Retry-After`), waiting
/// `Retry-After` seconds when it is given, and obey `Should-Retry` whatever
/// the status when it is present.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Room may free (a sandbox ends, etcd answers): `Should-Retry: true`
    /// and `Retry-After` in seconds.
    After(u32),
    /// The same request would be refused the same (this node cannot do it
    /// at all): `Should-Retry: false`, so that a 503 is not retried.
    Never,
}

/// A team or a node at its limit: a sandbox may end any moment, and a
/// retry costs the node one admission check.
pub const ROOM_RETRY_SECS: u32 = 1;
/// etcd unreachable or slow: its client retries for seconds itself.
pub const CLUSTER_STATE_RETRY_SECS: u32 = 2;

/// Why an answer would be the same on every node of a cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterWide {
    /// The caller's team is at its limit (a 429 with [`TEAM_LIMIT_HEADER`]).
    TeamLimit,
    /// etcd failed (a 503 with [`CLUSTER_STATE_HEADER`]).
    ClusterState,
    /// The template is being built (a 503 with [`BUILDING_HEADER`]): for a
    /// registry image, the cluster's one conversion of it, which another
    /// node would wait for too.
    Building,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            cluster_wide: None,
            retry: None,
            error_code: None,
        }
    }

    /// This error with `retry` advice for the SDKs.
    pub fn with_retry(self, retry: Retry) -> ApiError {
        ApiError {
            retry: Some(retry),
            ..self
        }
    }

    /// A 429 for a team at its limit.
    pub fn team_limit(message: impl Into<String>) -> ApiError {
        ApiError {
            cluster_wide: Some(ClusterWide::TeamLimit),
            retry: Some(Retry::After(ROOM_RETRY_SECS)),
            ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, message)
        }
    }

    /// A 503 for an etcd failure `e`.
    pub fn cluster_state(e: impl std::fmt::Display) -> ApiError {
        ApiError {
            cluster_wide: Some(ClusterWide::ClusterState),
            retry: Some(Retry::After(CLUSTER_STATE_RETRY_SECS)),
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
            error_code: self.error_code.map(str::to_owned),
        };
        let mut answer = (self.status, axum::Json(body)).into_response();
        // Every status the SDKs retry by themselves says when to: without
        // it they back off blind (Python) or give up (JS, on a 429).
        let retry = self.retry.or(match self.status {
            StatusCode::TOO_MANY_REQUESTS
            | StatusCode::BAD_GATEWAY
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::GATEWAY_TIMEOUT => Some(Retry::After(ROOM_RETRY_SECS)),
            _ => None,
        });
        let headers = answer.headers_mut();
        match retry {
            Some(Retry::After(secs)) => {
                headers.insert(SHOULD_RETRY_HEADER, HeaderValue::from_static("true"));
                headers.insert(RETRY_AFTER_HEADER, HeaderValue::from(secs));
            }
            Some(Retry::Never) => {
                headers.insert(SHOULD_RETRY_HEADER, HeaderValue::from_static("false"));
            }
            None => {}
        }
        let header = match self.cluster_wide {
            None => None,
            Some(ClusterWide::TeamLimit) => Some(TEAM_LIMIT_HEADER),
            Some(ClusterWide::ClusterState) => Some(CLUSTER_STATE_HEADER),
            Some(ClusterWide::Building) => Some(BUILDING_HEADER),
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
            Denial::ClusterState(e) => ApiError::cluster_state(e),
            Denial::Conflict(_) => ApiError::new(StatusCode::CONFLICT, message),
            Denial::NotFound(_) => ApiError::new(StatusCode::NOT_FOUND, message),
            // Not possible on this node (a gateway tries the next one):
            // asking this node again gets the same.
            Denial::Unavailable(_) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message).with_retry(Retry::Never)
            }
        }
    }
}

impl From<SandboxError> for ApiError {
    fn from(e: SandboxError) -> ApiError {
        match e {
            SandboxError::TeamLimit(message) => return ApiError::team_limit(message),
            SandboxError::Denied(denial) => return denial.into(),
            SandboxError::Volume(e) => return e.into(),
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
            | SandboxError::NameTaken(_)
            | SandboxError::AgentUnresponsiveAtPause(_) => StatusCode::CONFLICT,
            SandboxError::Invalid(_) => StatusCode::BAD_REQUEST,
            SandboxError::Unavailable(_) | SandboxError::Building { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            SandboxError::Network(crate::node::net::NetError::Exhausted(_)) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            SandboxError::Network(crate::node::net::NetError::InvalidPolicy(_)) => {
                StatusCode::BAD_REQUEST
            }
            SandboxError::Image(e) => match e {
                ImageError::Reference(_) | ImageError::Unsupported { .. } => {
                    StatusCode::BAD_REQUEST
                }
                ImageError::NotFound { .. } => StatusCode::NOT_FOUND,
                // Not the caller's API key (401 would say so to the SDKs):
                // the node's credentials for the image's registry.
                ImageError::Denied { .. } => StatusCode::FORBIDDEN,
                ImageError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
                ImageError::Registry { .. } => StatusCode::BAD_GATEWAY,
                ImageError::Failed { .. } => StatusCode::INTERNAL_SERVER_ERROR,
                ImageError::NoRoom { .. } => StatusCode::SERVICE_UNAVAILABLE,
            },
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let retry = match &e {
            SandboxError::AtCapacity { .. }
            | SandboxError::OverCapacity(_)
            | SandboxError::Network(crate::node::net::NetError::Exhausted(_)) => {
                Some(Retry::After(ROOM_RETRY_SECS))
            }
            // What this node cannot do at all (no agent binary to build
            // with, a template of another network set-up, a build that
            // failed): a retry is refused the same.
            SandboxError::Unavailable(_) => Some(Retry::Never),
            // A registry that failed is asked again by the next create, not
            // by the SDKs' own retry of a 502 (a wrong host would be asked
            // for minutes).
            SandboxError::Image(ImageError::Registry { .. }) => Some(Retry::Never),
            SandboxError::Building {
                retry_after_secs, ..
            } => Some(Retry::After(*retry_after_secs)),
            // Room comes as sandboxes of other images end; each retry runs
            // the disk bound's pass again.
            SandboxError::Image(ImageError::NoRoom { .. }) => {
                Some(Retry::After(crate::node::template::image_disk::RETRY_SECS))
            }
            _ => None,
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
        let error_code = match &e {
            SandboxError::AgentUnresponsiveAtPause(_) => {
                Some("sandbox_snapshot_guest_agent_unresponsive")
            }
            _ => None,
        };
        let cluster_wide = match &e {
            SandboxError::Building { .. } => Some(ClusterWide::Building),
            _ => None,
        };
        ApiError {
            retry,
            error_code,
            cluster_wide,
            ..ApiError::new(status, message)
        }
    }
}

impl From<WebhookError> for ApiError {
    fn from(e: WebhookError) -> ApiError {
        match e {
            WebhookError::Invalid(_) => ApiError::bad_request(e.to_string()),
            WebhookError::NotFound(_) => ApiError::new(StatusCode::NOT_FOUND, e.to_string()),
            WebhookError::Store(_) | WebhookError::Random(_) => {
                tracing::error!("webhooks: {e}");
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
            }
        }
    }
}

impl From<VolumeError> for ApiError {
    fn from(e: VolumeError) -> ApiError {
        let status = match e {
            VolumeError::Invalid(_) => StatusCode::BAD_REQUEST,
            VolumeError::NotFound(_) => StatusCode::NOT_FOUND,
            VolumeError::NameTaken(_)
            | VolumeError::InUse { .. }
            | VolumeError::Snapshotted { .. } => StatusCode::CONFLICT,
            VolumeError::Disk(crate::node::volume::DiskError::Size(_)) => StatusCode::BAD_REQUEST,
            VolumeError::Disk(_)
            | VolumeError::Store(_)
            | VolumeError::Io { .. }
            | VolumeError::Mount { .. } => {
                tracing::error!("volumes: {e}");
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        ApiError::new(status, e.to_string())
    }
}

impl From<IdempotencyError> for ApiError {
    fn from(e: IdempotencyError) -> ApiError {
        let (status, code) = match &e {
            IdempotencyError::Malformed => (StatusCode::BAD_REQUEST, None),
            IdempotencyError::Mismatch => {
                (StatusCode::CONFLICT, Some("idempotency_request_mismatch"))
            }
            IdempotencyError::OutcomeUnknown => (
                StatusCode::UNPROCESSABLE_ENTITY,
                Some("idempotency_outcome_unknown"),
            ),
            IdempotencyError::Store(_) => (StatusCode::INTERNAL_SERVER_ERROR, None),
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!("{e}");
        }
        ApiError {
            error_code: code,
            ..ApiError::new(status, e.to_string())
        }
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
        assert_eq!(e.retry, Some(Retry::After(ROOM_RETRY_SECS)));
    }

    #[test]
    fn refusals_tell_the_sdks_when_to_retry_and_when_not_to() {
        let headers = |e: ApiError| {
            let h = e.into_response().headers().clone();
            let get = |n: &str| h.get(n).map(|v| v.to_str().unwrap().to_owned());
            (get(SHOULD_RETRY_HEADER), get(RETRY_AFTER_HEADER))
        };
        let again = (Some("true".to_owned()), Some("1".to_owned()));
        assert_eq!(headers(ApiError::team_limit("full")), again);
        assert_eq!(
            headers(ApiError::from(Denial::TeamFull { limit: 1 })),
            again
        );
        assert_eq!(
            headers(ApiError::from(SandboxError::AtCapacity {
                running: 1,
                asked: 1,
                max: 1
            })),
            again
        );
        assert_eq!(
            headers(ApiError::cluster_state("etcd")),
            (Some("true".to_owned()), Some("2".to_owned()))
        );
        // Any other 503 says when, by default.
        assert_eq!(
            headers(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "x")),
            again
        );
        let never = (Some("false".to_owned()), None);
        assert_eq!(
            headers(ApiError::from(SandboxError::Unavailable("no agent".into()))),
            never
        );
        assert_eq!(
            headers(ApiError::from(Denial::Unavailable("elsewhere".into()))),
            never
        );
        assert_eq!(headers(ApiError::bad_request("no")), (None, None));
    }

    #[test]
    fn a_memory_resume_of_an_unanswering_agents_pause_is_e2bs_409() {
        let answer = ApiError::from(SandboxError::AgentUnresponsiveAtPause("s1".into()));
        assert_eq!(answer.status, StatusCode::CONFLICT);
        assert_eq!(
            answer.error_code,
            Some("sandbox_snapshot_guest_agent_unresponsive")
        );
        assert!(
            answer.message.contains("memory: false"),
            "{}",
            answer.message
        );
    }

    #[test]
    fn image_failures_answer_the_registrys_answer_in_a_4xx() {
        let image = || "127.0.0.1:5000/repo:v1".to_owned();
        for (e, status) in [
            (
                ImageError::Reference("image reference \"A\": bad".into()),
                StatusCode::BAD_REQUEST,
            ),
            (
                ImageError::NotFound {
                    image: image(),
                    answer: "127.0.0.1:5000/repo:v1: not found in the registry (MANIFEST_UNKNOWN)"
                        .into(),
                },
                StatusCode::NOT_FOUND,
            ),
            (
                ImageError::Denied {
                    image: image(),
                    answer: "127.0.0.1:5000: the registry refused the credentials".into(),
                },
                StatusCode::FORBIDDEN,
            ),
            (
                ImageError::TooLarge {
                    image: image(),
                    answer: "the image is 9 bytes".into(),
                },
                StatusCode::PAYLOAD_TOO_LARGE,
            ),
            (
                ImageError::Registry {
                    image: image(),
                    answer: "connecting: refused".into(),
                },
                StatusCode::BAD_GATEWAY,
            ),
        ] {
            let message = e.to_string();
            let answer = ApiError::from(SandboxError::Image(e));
            assert_eq!(answer.status, status, "{message}");
            assert_eq!(answer.message, message);
        }
        let gateway = ApiError::from(SandboxError::Image(ImageError::Registry {
            image: image(),
            answer: "x".into(),
        }));
        assert_eq!(gateway.retry, Some(Retry::Never));
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

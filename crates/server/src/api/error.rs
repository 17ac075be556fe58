//! Errors as E2B's API answers them: `{"code": <status>, "message": "..."}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::sandbox::SandboxError;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({"code": self.status.as_u16(), "message": self.message});
        (self.status, axum::Json(body)).into_response()
    }
}

impl From<SandboxError> for ApiError {
    fn from(e: SandboxError) -> ApiError {
        let status = match &e {
            SandboxError::NotFound(_) | SandboxError::TemplateNotFound(_) => StatusCode::NOT_FOUND,
            SandboxError::AtCapacity { .. } => StatusCode::TOO_MANY_REQUESTS,
            SandboxError::OverCapacity(_) => StatusCode::SERVICE_UNAVAILABLE,
            SandboxError::Conflict { .. }
            | SandboxError::InUse { .. }
            | SandboxError::NameTaken(_) => StatusCode::CONFLICT,
            SandboxError::Invalid(_) => StatusCode::BAD_REQUEST,
            SandboxError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!("{e}");
        }
        ApiError::new(status, e.to_string())
    }
}

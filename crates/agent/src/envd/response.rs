//! envd's plain-HTTP error answer, shared by the auth layer and the handlers
//! (a leaf, so neither imports the other for it).

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// envd's plain-HTTP error shape: `{"code":<status>,"message":"..."}`.
pub fn json_error(status: StatusCode, message: &str) -> Response {
    let body = serde_json::json!({ "code": status.as_u16(), "message": message });
    (status, Json(body)).into_response()
}

//! The control plane's own extractors: a request's JSON body and a
//! sandbox id from its path, refused as E2B refuses them (a 400 with the
//! reason), in place of axum's plain-text rejections.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::Uri;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

use super::ApiError;
use crate::node::ids;

/// A JSON body; an empty one (or only whitespace) is `T::default()`, as
/// the SDKs send no body where every field is optional.
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned + Default> JsonBody<T> {
    pub fn parse(body: &[u8]) -> Result<T, ApiError> {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(T::default());
        }
        serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("malformed request body: {e}")))
    }
}

impl<S, T> FromRequest<S> for JsonBody<T>
where
    S: Send + Sync,
    T: DeserializeOwned + Default,
{
    // A body over the route's limit keeps axum's 413.
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        let body = Bytes::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        Self::parse(&body)
            .map(JsonBody)
            .map_err(IntoResponse::into_response)
    }
}

/// The sandbox id of a route's one path parameter. E2B's clients may send
/// `<id>-<client id>`; the client part is dropped.
#[derive(Debug)]
pub struct SandboxId(pub String);

impl SandboxId {
    pub fn parse(raw: &str) -> Result<String, ApiError> {
        let id = match raw.split('-').collect::<Vec<_>>()[..] {
            [id, _client] => id,
            _ => raw,
        };
        if ids::is_sandbox_id(id) {
            Ok(id.to_owned())
        } else {
            Err(ApiError::bad_request("Invalid sandbox ID"))
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for SandboxId {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        Self::parse(&raw)
            .map(SandboxId)
            .map_err(IntoResponse::into_response)
    }
}

/// A query's parameters in order, empty values left out (as absent).
pub fn query(uri: &Uri) -> Vec<(String, String)> {
    form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

/// A query parameter that must be a whole number.
pub fn number(key: &str, value: &str) -> Result<u64, ApiError> {
    value
        .parse::<u64>()
        .map_err(|_| ApiError::bad_request(format!("{key} must be a whole number ≥ 0")))
}

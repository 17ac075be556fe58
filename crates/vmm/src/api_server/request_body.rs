//! Reading and parsing request bodies with Firecracker-style error answers.
//!
//! The Content-Type header is not checked: Firecracker ignores it, and scripts commonly
//! send JSON with `curl -d`, which labels it as a form.

use axum::body::{Body, Bytes};
use axum::http::HeaderMap;
use axum::http::header::CONTENT_LENGTH;
use axum::response::Response;
use serde::de::DeserializeOwned;
use vmm_api::ValidationError;

use super::response::bad_request;

/// Firecracker's default `--http-api-max-payload-size`; every valid body is far smaller.
pub const MAX_BODY_BYTES: usize = 51_200;

/// Reads, parses and validates a JSON body; the `Err` is the response to send.
pub(super) async fn parse_body<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: Body,
    validate: impl FnOnce(&T) -> Result<(), ValidationError>,
) -> Result<T, Response> {
    let bytes = read_body(headers, body).await?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(bad_request("request body is empty; expected a JSON object"));
    }
    let value: T = serde_json::from_slice(&bytes)
        .map_err(|e| bad_request(format!("invalid JSON body: {e}")))?;
    validate(&value).map_err(|e| bad_request(e.message))?;
    Ok(value)
}

async fn read_body(headers: &HeaderMap, body: Body) -> Result<Bytes, Response> {
    let too_large = |size: &str| {
        bad_request(format!(
            "request body of {size} bytes exceeds the limit of {MAX_BODY_BYTES} bytes"
        ))
    };
    // Refuse before reading when the client announces the size.
    if let Some(len) = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > MAX_BODY_BYTES as u64
    {
        return Err(too_large(&len.to_string()));
    }
    axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|e| {
            // A chunked body that grows past the limit ends up here too; its error says so.
            bad_request(format!(
                "cannot read request body (limit {MAX_BODY_BYTES} bytes): {e}"
            ))
        })
}

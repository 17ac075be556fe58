//! `X-Access-Token` enforcement (spec §3.2).
//!
//! Once `/init` has set a token, every request must carry it, except
//! `GET /health`, `POST /init` (which checks it itself) and `GET`/`POST /files`,
//! which may instead carry a URL signature: for those the token is checked
//! only when the header is present, and the files handler must verify the
//! signature when it is not.

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use super::Envd;
use super::response::json_error;

pub const HEADER: &str = "x-access-token";

/// Whether the request's `X-Access-Token` equals `token`.
pub fn header_token_matches(headers: &HeaderMap, token: &str) -> bool {
    headers
        .get(HEADER)
        .is_some_and(|v| constant_time_eq(v.as_bytes(), token.as_bytes()))
}

/// Whether the request carries a non-empty `X-Access-Token`: envd reads an
/// empty one as none (a signed file URL then still works).
pub fn header_present(headers: &HeaderMap) -> bool {
    headers.get(HEADER).is_some_and(|v| !v.is_empty())
}

/// Compares without an early exit, so timing does not reveal a prefix match.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// 401 with envd's plain-HTTP error body.
pub fn unauthorized(message: &str) -> Response {
    json_error(StatusCode::UNAUTHORIZED, message)
}

enum Rule {
    Open,
    /// Token checked only if the header is present.
    IfPresent,
    Required,
}

fn rule(method: &Method, path: &str) -> Rule {
    match (method, path) {
        (&Method::GET, "/health") | (&Method::POST, "/init") => Rule::Open,
        (&Method::GET | &Method::POST, "/files") => Rule::IfPresent,
        _ => Rule::Required,
    }
}

/// Middleware: answers 401 unless the request may pass.
pub async fn require_token(State(envd): State<Envd>, req: Request, next: Next) -> Response {
    let Some(token) = envd.sandbox.access_token() else {
        return next.run(req).await;
    };
    // The refusals are worded as E2B's envd words them (clients compare them).
    match rule(req.method(), req.uri().path()) {
        Rule::Open => next.run(req).await,
        Rule::IfPresent
            if header_present(req.headers()) && !header_token_matches(req.headers(), &token) =>
        {
            unauthorized("access token present in header but does not match")
        }
        Rule::IfPresent => next.run(req).await,
        Rule::Required if header_token_matches(req.headers(), &token) => next.run(req).await,
        Rule::Required => unauthorized(
            "unauthorized access, please provide a valid access token or method signing if supported",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compares_whole_tokens() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
        let mut h = HeaderMap::new();
        assert!(!header_token_matches(&h, "t"));
        h.insert(HEADER, "t".parse().unwrap());
        assert!(header_token_matches(&h, "t"));
        assert!(!header_token_matches(&h, "u"));
    }

    #[test]
    fn exclusions_follow_the_spec() {
        assert!(matches!(rule(&Method::GET, "/health"), Rule::Open));
        assert!(matches!(rule(&Method::POST, "/init"), Rule::Open));
        assert!(matches!(rule(&Method::GET, "/files"), Rule::IfPresent));
        assert!(matches!(rule(&Method::POST, "/files"), Rule::IfPresent));
        assert!(matches!(rule(&Method::POST, "/health"), Rule::Required));
        assert!(matches!(
            rule(&Method::POST, "/files/compose"),
            Rule::Required
        ));
        assert!(matches!(rule(&Method::GET, "/envs"), Rule::Required));
        assert!(matches!(
            rule(&Method::POST, "/process.Process/Start"),
            Rule::Required
        ));
    }
}

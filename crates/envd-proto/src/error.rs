//! Connect error codes, the unary error body and the end-stream object.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Connect error codes, with their wire names and HTTP statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    pub const ALL: [Code; 16] = [
        Code::Canceled,
        Code::Unknown,
        Code::InvalidArgument,
        Code::DeadlineExceeded,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Aborted,
        Code::OutOfRange,
        Code::Unimplemented,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
        Code::Unauthenticated,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error response with this code.
    pub fn http_status(self) -> u16 {
        match self {
            Code::Canceled => 499,
            Code::Unknown => 500,
            Code::InvalidArgument => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::FailedPrecondition => 400,
            Code::Aborted => 409,
            Code::OutOfRange => 400,
            Code::Unimplemented => 501,
            Code::Internal => 500,
            Code::Unavailable => 503,
            Code::DataLoss => 500,
            Code::Unauthenticated => 401,
        }
    }

    pub fn from_name(name: &str) -> Option<Code> {
        Code::ALL.into_iter().find(|c| c.as_str() == name)
    }

    /// How a client maps a non-Connect error response by its HTTP status (what
    /// the Python SDK does for proxy errors).
    pub fn from_http_status(status: u16) -> Code {
        match status {
            400 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::NotFound,
            409 => Code::AlreadyExists,
            413 | 429 => Code::ResourceExhausted,
            499 => Code::Canceled,
            501 | 505 => Code::Unimplemented,
            502 | 503 => Code::Unavailable,
            504 => Code::DeadlineExceeded,
            _ => Code::Unknown,
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Code {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Code {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        // Unknown names are kept as `unknown`, as Connect clients do.
        Ok(Code::from_name(&name).unwrap_or(Code::Unknown))
    }
}

/// A Connect error: the body of a unary error response, and the `error` of an
/// end-stream object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ConnectError {
    pub code: Code,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }

    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(Code::Unauthenticated, message)
    }

    pub fn http_status(&self) -> u16 {
        self.code.http_status()
    }

    /// The unary error body: `{"code":"...","message":"...","details":[]}`.
    pub fn to_unary_body(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct Body<'a> {
            code: Code,
            message: &'a str,
            details: [(); 0],
        }
        serde_json::to_vec(&Body {
            code: self.code,
            message: &self.message,
            details: [],
        })
        .unwrap_or_default()
    }
}

/// The payload of the end-stream envelope.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndStream {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ConnectError>,
    /// Trailers.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, Vec<String>>,
}

impl EndStream {
    pub fn ok() -> Self {
        Self::default()
    }

    pub fn error(error: ConnectError) -> Self {
        Self {
            error: Some(error),
            metadata: BTreeMap::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_statuses_follow_connect() {
        let statuses: Vec<u16> = Code::ALL.iter().map(|c| c.http_status()).collect();
        assert_eq!(
            statuses,
            [
                499, 500, 400, 504, 404, 409, 403, 429, 400, 409, 400, 501, 500, 503, 500, 401
            ]
        );
        for c in Code::ALL {
            assert_eq!(Code::from_name(c.as_str()), Some(c));
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(json, format!("\"{}\"", c.as_str()));
        }
        assert_eq!(Code::from_name("nope"), None);
        assert_eq!(
            serde_json::from_str::<Code>("\"brand_new\"").unwrap(),
            Code::Unknown
        );
        assert_eq!(Code::from_http_status(413), Code::ResourceExhausted);
        assert_eq!(Code::from_http_status(502), Code::Unavailable);
    }

    #[test]
    fn unary_body_and_end_stream_shapes() {
        let e = ConnectError::not_found("process with pid 1 not found");
        assert_eq!(
            String::from_utf8(e.to_unary_body()).unwrap(),
            r#"{"code":"not_found","message":"process with pid 1 not found","details":[]}"#
        );
        assert_eq!(serde_json::to_string(&EndStream::ok()).unwrap(), "{}");
        let end: EndStream = serde_json::from_str(
            r#"{"error":{"code":"deadline_exceeded","message":"m","details":[]},"metadata":{"a":["b"]}}"#,
        )
        .unwrap();
        assert_eq!(end.error.unwrap().code, Code::DeadlineExceeded);
        assert_eq!(end.metadata["a"], vec!["b".to_string()]);
        assert_eq!(e.to_string(), "not_found: process with pid 1 not found");
    }
}

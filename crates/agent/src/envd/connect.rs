//! Connect protocol plumbing for axum handlers (JSON codec only, as the SDKs
//! use): unary request/response, server-stream responses, client-stream
//! request bodies, deadlines.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use envd_proto::envelope::{self, DEFAULT_MAX_MESSAGE, Envelope, EnvelopeError};
use envd_proto::{CONTENT_TYPE_STREAM, CONTENT_TYPE_UNARY, Code, ConnectError, Decoder, EndStream};
use http_body::Frame;
use http_body_util::BodyExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

/// Largest unary request body we read.
pub const MAX_UNARY_BODY: usize = DEFAULT_MAX_MESSAGE;

/// A Connect error as an axum response: non-200 with the JSON error body.
#[derive(Debug)]
pub struct ConnectErr(pub ConnectError);

impl From<ConnectError> for ConnectErr {
    fn from(e: ConnectError) -> Self {
        ConnectErr(e)
    }
}

impl IntoResponse for ConnectErr {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(CONTENT_TYPE_UNARY),
            )],
            self.0.to_unary_body(),
        )
            .into_response()
    }
}

/// A unary success: 200 with the bare JSON message.
pub struct Unary<T>(pub T);

impl<T: Serialize> IntoResponse for Unary<T> {
    fn into_response(self) -> Response {
        match serde_json::to_vec(&self.0) {
            Ok(body) => (
                [(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static(CONTENT_TYPE_UNARY),
                )],
                body,
            )
                .into_response(),
            Err(e) => ConnectErr(ConnectError::internal(format!("encoding response: {e}")))
                .into_response(),
        }
    }
}

pub type UnaryResult<T> = Result<Unary<T>, ConnectErr>;

/// The media type of a Content-Type value, parameters stripped, lowercased.
fn media_type(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    Some(
        v.split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase(),
    )
}

fn check_identity(headers: &HeaderMap, name: &str) -> Result<(), ConnectError> {
    match headers.get(name).map(|v| v.to_str().unwrap_or("?")) {
        None | Some("identity") | Some("") => Ok(()),
        Some(other) => Err(ConnectError::new(
            Code::Unimplemented,
            format!("{name} {other:?} is not supported"),
        )),
    }
}

/// Parses a JSON message with a clear `invalid_argument` error.
pub fn parse_message<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ConnectError> {
    serde_json::from_slice(bytes)
        .map_err(|e| ConnectError::invalid_argument(format!("invalid request message: {e}")))
}

/// Extractor for a unary request: checks the content type, reads a bounded
/// body and parses it.
pub struct ConnectJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ConnectJson<T> {
    type Rejection = ConnectErr;

    async fn from_request(req: Request, _: &S) -> Result<Self, ConnectErr> {
        let headers = req.headers();
        match media_type(headers).as_deref() {
            Some(CONTENT_TYPE_UNARY) => {}
            other => {
                return Err(ConnectErr(ConnectError::invalid_argument(format!(
                    "unsupported content-type {:?}; unary calls take {CONTENT_TYPE_UNARY}",
                    other.unwrap_or("")
                ))));
            }
        }
        check_identity(headers, "content-encoding")?;
        let body = axum::body::to_bytes(req.into_body(), MAX_UNARY_BODY)
            .await
            .map_err(|e| {
                ConnectErr(ConnectError::new(
                    Code::ResourceExhausted,
                    format!("request body: {e}"),
                ))
            })?;
        // An empty body is the empty message.
        let body: &[u8] = if body.is_empty() { b"{}" } else { &body };
        Ok(ConnectJson(parse_message(body)?))
    }
}

/// Extractor for a streaming request: checks the content type; the body is
/// read envelope by envelope as it arrives.
pub struct StreamRequest {
    pub headers: HeaderMap,
    pub body: EnvelopeReader,
}

impl<S: Send + Sync> FromRequest<S> for StreamRequest {
    type Rejection = ConnectErr;

    async fn from_request(req: Request, _: &S) -> Result<Self, ConnectErr> {
        let (parts, body) = req.into_parts();
        match media_type(&parts.headers).as_deref() {
            Some(CONTENT_TYPE_STREAM) => {}
            other => {
                return Err(ConnectErr(ConnectError::invalid_argument(format!(
                    "unsupported content-type {:?}; streaming calls take {CONTENT_TYPE_STREAM}",
                    other.unwrap_or("")
                ))));
            }
        }
        check_identity(&parts.headers, "connect-content-encoding")?;
        Ok(StreamRequest {
            headers: parts.headers,
            body: EnvelopeReader::new(body, DEFAULT_MAX_MESSAGE),
        })
    }
}

/// Reads envelopes from a request body incrementally.
pub struct EnvelopeReader {
    body: Body,
    decoder: Decoder,
    done: bool,
}

impl EnvelopeReader {
    pub fn new(body: Body, max_message: usize) -> Self {
        Self {
            body,
            decoder: Decoder::new(max_message),
            done: false,
        }
    }

    /// The next envelope; `None` at the end of the body or after a client
    /// end-stream envelope.
    pub async fn next_envelope(&mut self) -> Result<Option<Envelope>, ConnectError> {
        loop {
            if self.done {
                return Ok(None);
            }
            match self.decoder.next_envelope() {
                Ok(Some(env)) if env.is_end_stream() => {
                    self.done = true;
                    return Ok(None);
                }
                Ok(Some(env)) if env.is_compressed() => {
                    self.done = true;
                    return Err(ConnectError::new(
                        Code::Unimplemented,
                        "compressed messages are not supported",
                    ));
                }
                Ok(Some(env)) => return Ok(Some(env)),
                Ok(None) => {}
                Err(e) => {
                    self.done = true;
                    return Err(envelope_error(e));
                }
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.decoder.push(&data);
                    }
                }
                Some(Err(e)) => {
                    self.done = true;
                    return Err(ConnectError::new(
                        Code::Canceled,
                        format!("reading request: {e}"),
                    ));
                }
                None => {
                    self.done = true;
                    self.decoder.finish().map_err(envelope_error)?;
                    return Ok(None);
                }
            }
        }
    }

    /// The next message, parsed.
    pub async fn next_message<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ConnectError> {
        match self.next_envelope().await? {
            Some(env) => parse_message(&env.payload).map(Some),
            None => Ok(None),
        }
    }

    /// The one message of a server-streaming request. Does not wait for the
    /// end of the body beyond it.
    pub async fn single<T: DeserializeOwned>(&mut self) -> Result<T, ConnectError> {
        self.next_message()
            .await?
            .ok_or_else(|| ConnectError::invalid_argument("request has no message"))
    }
}

fn envelope_error(e: EnvelopeError) -> ConnectError {
    match e {
        EnvelopeError::TooLarge { .. } => ConnectError::new(Code::ResourceExhausted, e.to_string()),
        _ => ConnectError::invalid_argument(e.to_string()),
    }
}

/// `connect-timeout-ms`: at most 10 digits of milliseconds.
pub fn timeout(headers: &HeaderMap) -> Result<Option<Duration>, ConnectError> {
    let Some(v) = headers.get("connect-timeout-ms") else {
        return Ok(None);
    };
    let text = v.to_str().unwrap_or("");
    if text.is_empty() || text.len() > 10 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ConnectError::invalid_argument(format!(
            "invalid connect-timeout-ms {text:?}"
        )));
    }
    let ms: u64 = text.parse().unwrap_or(u64::MAX);
    Ok(Some(Duration::from_millis(ms)))
}

enum Out {
    Message(Bytes),
    End(Bytes),
}

/// Sends a server-stream response's messages. Dropping it without `end` still
/// terminates the response with one end-stream envelope (an `internal` error).
pub struct StreamSender {
    tx: mpsc::Sender<Out>,
}

/// The client is gone: nothing more can be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("stream closed by the client")]
pub struct Closed;

impl StreamSender {
    /// Sends one message; waits while the client is slow (at most `capacity`
    /// messages are queued), which is the backpressure.
    pub async fn send<T: Serialize>(&self, msg: &T) -> Result<(), Closed> {
        let bytes = match envelope::encode_message(msg) {
            Ok(b) => b,
            Err(e) => {
                log::error!("cannot encode a stream message: {e}");
                return Ok(());
            }
        };
        self.tx.send(Out::Message(bytes)).await.map_err(|_| Closed)
    }

    /// Ends the stream: `{}`, or `{"error":...}`.
    pub async fn end(self, error: Option<ConnectError>) {
        let end = match error {
            Some(e) => EndStream::error(e),
            None => EndStream::ok(),
        };
        let _ = self
            .tx
            .send(Out::End(envelope::encode_end_stream(&end)))
            .await;
    }

    /// Resolves once the client has gone (the response body was dropped).
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

/// A server-stream response and its sender. The response is 200 with content
/// type exactly `application/connect+json`.
pub fn stream_response(capacity: usize) -> (StreamSender, Response) {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    let body = ChannelBody { rx, ended: false };
    let response = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, CONTENT_TYPE_STREAM)
        .body(Body::new(body))
        .unwrap_or_default();
    (StreamSender { tx }, response)
}

/// A server-stream response that carries only an end-stream error.
pub fn stream_error(error: ConnectError) -> Response {
    let body = envelope::encode_end_stream(&EndStream::error(error));
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(CONTENT_TYPE_STREAM),
        )],
        body,
    )
        .into_response()
}

/// A client-stream response: exactly one message, then end-stream.
pub fn client_stream_response<T: Serialize>(result: Result<T, ConnectError>) -> Response {
    let mut body = Vec::new();
    let end = match result.map(|m| envelope::encode_message(&m)) {
        Ok(Ok(msg)) => {
            body.extend_from_slice(&msg);
            EndStream::ok()
        }
        Ok(Err(e)) => EndStream::error(ConnectError::internal(format!("encoding: {e}"))),
        Err(e) => EndStream::error(e),
    };
    body.extend_from_slice(&envelope::encode_end_stream(&end));
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(CONTENT_TYPE_STREAM),
        )],
        body,
    )
        .into_response()
}

struct ChannelBody {
    rx: mpsc::Receiver<Out>,
    ended: bool,
}

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Out::Message(b))) => Poll::Ready(Some(Ok(Frame::data(b)))),
            Poll::Ready(Some(Out::End(b))) => {
                self.ended = true;
                self.rx.close();
                Poll::Ready(Some(Ok(Frame::data(b))))
            }
            Poll::Ready(None) => {
                // The sender vanished without `end`: still close the stream the
                // way clients require.
                self.ended = true;
                let end = EndStream::error(ConnectError::internal("stream ended unexpectedly"));
                Poll::Ready(Some(Ok(Frame::data(envelope::encode_end_stream(&end)))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Handler for unknown methods of a Connect service.
pub async fn unimplemented(req: Request) -> ConnectErr {
    ConnectErr(ConnectError::new(
        Code::Unimplemented,
        format!("{} is not implemented", req.uri().path()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use envd_proto::envelope::{FLAG_END_STREAM, decode_all, encode};

    async fn body_bytes(r: Response) -> Vec<u8> {
        axum::body::to_bytes(r.into_body(), usize::MAX)
            .await
            .unwrap()
            .to_vec()
    }

    #[test]
    fn timeout_header() {
        let mut h = HeaderMap::new();
        assert_eq!(timeout(&h), Ok(None));
        h.insert("connect-timeout-ms", "60000".parse().unwrap());
        assert_eq!(timeout(&h), Ok(Some(Duration::from_secs(60))));
        for bad in ["", "-1", "12345678901", "1.5", "abc"] {
            h.insert("connect-timeout-ms", bad.parse().unwrap());
            assert!(timeout(&h).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn error_response_shape() {
        let r = ConnectErr(ConnectError::not_found("nope")).into_response();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
        assert_eq!(
            body_bytes(r).await,
            br#"{"code":"not_found","message":"nope","details":[]}"#
        );
    }

    #[tokio::test]
    async fn stream_sends_messages_then_one_end() {
        let (tx, resp) = stream_response(4);
        assert_eq!(
            resp.headers()[header::CONTENT_TYPE],
            "application/connect+json"
        );
        tokio::spawn(async move {
            tx.send(&serde_json::json!({"a": 1})).await.unwrap();
            tx.end(None).await;
        });
        let envs = decode_all(&body_bytes(resp).await, 1 << 20).unwrap();
        assert_eq!(envs.len(), 2);
        assert_eq!(&envs[0].payload[..], br#"{"a":1}"#);
        assert!(envs[1].is_end_stream());
        assert_eq!(&envs[1].payload[..], b"{}");
    }

    #[tokio::test]
    async fn dropped_sender_still_ends_the_stream() {
        let (tx, resp) = stream_response(4);
        drop(tx);
        let envs = decode_all(&body_bytes(resp).await, 1 << 20).unwrap();
        assert_eq!(envs.len(), 1);
        assert!(envs[0].is_end_stream());
        assert!(
            std::str::from_utf8(&envs[0].payload)
                .unwrap()
                .contains("internal")
        );
    }

    #[tokio::test]
    async fn client_stream_response_has_exactly_one_message() {
        let envs = decode_all(
            &body_bytes(client_stream_response(Ok(serde_json::json!({})))).await,
            100,
        )
        .unwrap();
        assert_eq!(envs.len(), 2);
        assert_eq!((&envs[0].payload[..], envs[0].flags), (&b"{}"[..], 0));
        assert_eq!(envs[1].flags, FLAG_END_STREAM);
        let err = client_stream_response::<()>(Err(ConnectError::not_found("x")));
        let envs = decode_all(&body_bytes(err).await, 100).unwrap();
        assert_eq!(envs.len(), 1);
        assert!(envs[0].is_end_stream());
    }

    #[tokio::test]
    async fn reader_takes_messages_as_they_come() {
        let mut body = Vec::new();
        body.extend_from_slice(&encode(0, br#"{"x":1}"#));
        body.extend_from_slice(&encode(0, br#"{"x":2}"#));
        let mut r = EnvelopeReader::new(Body::from(body), 100);
        let a: serde_json::Value = r.next_message().await.unwrap().unwrap();
        let b: serde_json::Value = r.next_message().await.unwrap().unwrap();
        assert_eq!((a["x"].as_i64(), b["x"].as_i64()), (Some(1), Some(2)));
        assert_eq!(r.next_message::<serde_json::Value>().await, Ok(None));

        // Truncated, oversized, compressed, invalid JSON.
        let mut r = EnvelopeReader::new(Body::from(vec![0u8, 0, 0, 0, 9, b'{']), 100);
        assert_eq!(
            r.next_envelope().await.unwrap_err().code,
            Code::InvalidArgument
        );
        let mut r = EnvelopeReader::new(Body::from(vec![0u8, 0x7f, 0, 0, 0]), 100);
        assert_eq!(
            r.next_envelope().await.unwrap_err().code,
            Code::ResourceExhausted
        );
        let mut r = EnvelopeReader::new(Body::from(encode(1, b"{}").to_vec()), 100);
        assert_eq!(
            r.next_envelope().await.unwrap_err().code,
            Code::Unimplemented
        );
        let mut r = EnvelopeReader::new(Body::from(encode(0, b"{nope").to_vec()), 100);
        assert_eq!(
            r.next_message::<serde_json::Value>()
                .await
                .unwrap_err()
                .code,
            Code::InvalidArgument
        );
        // A client end-stream envelope ends the input.
        let mut r = EnvelopeReader::new(Body::from(encode(2, b"{}").to_vec()), 100);
        assert_eq!(r.next_envelope().await, Ok(None));
        let mut r = EnvelopeReader::new(Body::empty(), 100);
        assert!(r.single::<serde_json::Value>().await.is_err());
    }
}

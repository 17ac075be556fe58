//! A Connect stream whose guest connection breaks mid-response still ends as
//! a Connect stream: E2B's proxy then closes it with an `unavailable`
//! end-stream ("the connection to sandbox ... ended before the stream
//! completed"), which the SDKs answer with a health probe of the sandbox,
//! instead of cutting the chunked body (which the SDKs report as a transport
//! failure, "unexpected EOF during chunk size line").
//!
//! To append an envelope the client can parse, what goes out must end on an
//! envelope boundary: the body is passed on envelope by envelope (the guest
//! sends them whole anyway, so this holds nothing back for long). An envelope
//! larger than [`MAX_HELD`] is passed on as it comes instead, and a break
//! after one is the transport error it was.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use envd_proto::envelope::{self, FLAG_END_STREAM, HEADER_LEN};
use envd_proto::{Code, ConnectError, EndStream};
use hyper::body::{Body, Frame, SizeHint};

/// The largest envelope held back until it is complete.
const MAX_HELD: usize = 4 << 20;

/// The end-stream error of a stream whose guest connection broke.
fn broken_stream_end(sandbox: &str) -> Bytes {
    envelope::encode_end_stream(&EndStream::error(ConnectError::new(
        Code::Unavailable,
        format!("the connection to sandbox {sandbox} ended before the stream completed"),
    )))
}

/// A Connect streaming response body from a guest; see the module.
pub struct EndedStream<B> {
    inner: B,
    sandbox: String,
    /// Bytes of an envelope not yet complete.
    held: BytesMut,
    /// Envelopes (or raw bytes, once `raw`) ready to go out.
    out: VecDeque<Bytes>,
    /// An envelope too large to hold came: bytes pass as they arrive.
    raw: bool,
    /// The guest's end-stream envelope went out.
    ended: bool,
    /// Nothing more comes from `inner`.
    done: bool,
}

impl<B> EndedStream<B> {
    pub fn new(inner: B, sandbox: &str) -> Self {
        Self {
            inner,
            sandbox: sandbox.to_owned(),
            held: BytesMut::new(),
            out: VecDeque::new(),
            raw: false,
            ended: false,
            done: false,
        }
    }

    fn push(&mut self, data: Bytes) {
        if self.raw {
            self.out.push_back(data);
            return;
        }
        self.held.extend_from_slice(&data);
        while self.held.len() >= HEADER_LEN {
            let len = u32::from_be_bytes([self.held[1], self.held[2], self.held[3], self.held[4]])
                as usize;
            if len > MAX_HELD {
                self.raw = true;
                self.out.push_back(self.held.split().freeze());
                return;
            }
            if self.held.len() < HEADER_LEN + len {
                return;
            }
            self.ended |= self.held[0] & FLAG_END_STREAM != 0;
            self.out
                .push_back(self.held.split_to(HEADER_LEN + len).freeze());
        }
    }

    /// The guest's side is over without its end-stream: what is held of a
    /// partial envelope is dropped and the stream ends as E2B's proxy ends it.
    fn end_broken(&mut self) {
        self.done = true;
        if self.ended {
            return;
        }
        self.held.clear();
        self.out.push_back(broken_stream_end(&self.sandbox));
        self.ended = true;
    }
}

impl<B> Body for EndedStream<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        loop {
            if let Some(bytes) = self.out.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(bytes))));
            }
            if self.done {
                return Poll::Ready(None);
            }
            match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(mut data) => {
                        let data = data.copy_to_bytes(data.remaining());
                        self.push(data);
                    }
                    // Trailers: Connect has none, pass them on unchanged.
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                Some(Err(e)) if self.raw => return Poll::Ready(Some(Err(e))),
                Some(Err(e)) => {
                    tracing::info!(
                        "sandbox {}: the guest's stream broke: {e}; ending it as unavailable",
                        self.sandbox
                    );
                    self.end_broken();
                }
                None if self.raw || self.ended => self.done = true,
                None => {
                    tracing::info!(
                        "sandbox {}: the guest's stream ended without its end-stream",
                        self.sandbox
                    );
                    self.end_broken();
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.out.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    type Item = Result<Frame<Bytes>, String>;

    /// A body of these frames, in this order.
    struct Frames(VecDeque<Item>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = String;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, String>>> {
            Poll::Ready(self.0.pop_front())
        }
    }

    fn body(items: Vec<Item>) -> Frames {
        Frames(items.into())
    }

    fn data(b: &[u8]) -> Item {
        Ok(Frame::data(Bytes::copy_from_slice(b)))
    }

    async fn collect(
        b: impl Body<Data = Bytes, Error = String> + Unpin,
    ) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        let mut b = b;
        while let Some(frame) = b.frame().await {
            if let Ok(d) = frame?.into_data() {
                out.extend_from_slice(&d);
            }
        }
        Ok(out)
    }

    fn msg(json: &str) -> Bytes {
        envelope::encode(0, json.as_bytes())
    }

    #[tokio::test]
    async fn a_whole_stream_passes_unchanged_however_it_is_split() {
        let mut whole = msg(r#"{"a":1}"#).to_vec();
        whole.extend_from_slice(&msg(r#"{"b":2}"#));
        whole.extend_from_slice(&envelope::encode_end_stream(&EndStream::ok()));
        for split in [1, 3, 5, 9, whole.len()] {
            let items = whole.chunks(split).map(data).collect();
            let got = collect(EndedStream::new(body(items), "sbx")).await.unwrap();
            assert_eq!(got, whole, "split {split}");
        }
    }

    #[tokio::test]
    async fn a_break_mid_envelope_ends_with_the_envelopes_before_and_unavailable() {
        let first = msg(r#"{"event":{"start":{"pid":7}}}"#);
        let second = msg(r#"{"event":{"data":{"stdout":"aGk="}}}"#);
        let items = vec![
            data(&first),
            data(&second[..4]),
            Err("unexpected EOF during chunk size line".into()),
        ];
        let got = collect(EndedStream::new(body(items), "sbx")).await.unwrap();
        let envs = envelope::decode_all(&got, 1 << 20).unwrap();
        assert_eq!(envs.len(), 2);
        assert_eq!(envs[0].payload, first.slice(HEADER_LEN..));
        assert!(envs[1].is_end_stream());
        let end: serde_json::Value = serde_json::from_slice(&envs[1].payload).unwrap();
        assert_eq!(end["error"]["code"], "unavailable");
        assert_eq!(
            end["error"]["message"],
            "the connection to sandbox sbx ended before the stream completed"
        );
    }

    #[tokio::test]
    async fn an_end_without_end_stream_is_unavailable_and_after_one_nothing_is_added() {
        let got = collect(EndedStream::new(body(vec![data(&msg("{}"))]), "s"))
            .await
            .unwrap();
        let envs = envelope::decode_all(&got, 1 << 20).unwrap();
        assert_eq!(envs.len(), 2);
        assert!(envs[1].is_end_stream());

        let end = envelope::encode_end_stream(&EndStream::ok());
        let items = vec![data(&end), Err("reset".into())];
        let got = collect(EndedStream::new(body(items), "s")).await.unwrap();
        assert_eq!(got, end.to_vec());
    }

    #[tokio::test]
    async fn an_envelope_too_large_to_hold_passes_raw_and_a_break_stays_an_error() {
        let mut head = vec![0u8];
        head.extend_from_slice(&((MAX_HELD as u32) + 1).to_be_bytes());
        let items = vec![data(&head), data(b"partial"), Err("reset".into())];
        let mut b = EndedStream::new(body(items), "s");
        let mut got = Vec::new();
        let err = loop {
            match b.frame().await {
                Some(Ok(f)) => got.extend_from_slice(&f.into_data().unwrap()),
                Some(Err(e)) => break e,
                None => panic!("the break must stay an error"),
            }
        };
        assert_eq!(err, "reset");
        assert_eq!(&got[..5], &head[..]);
        assert_eq!(&got[5..], b"partial");
    }
}

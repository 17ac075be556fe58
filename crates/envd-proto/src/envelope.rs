//! Connect streaming envelopes: one flags byte, a big-endian u32 payload length,
//! then the payload (one JSON message, or the end-stream object).

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::Serialize;

use crate::error::EndStream;

/// An ordinary message.
pub const FLAG_NONE: u8 = 0x00;
/// The payload is compressed. The SDKs never compress; we reject it.
pub const FLAG_COMPRESSED: u8 = 0x01;
/// The last envelope of a response stream, carrying an [`EndStream`] object.
pub const FLAG_END_STREAM: u8 = 0x02;
/// Bytes before the payload.
pub const HEADER_LEN: usize = 5;
/// A sensible default bound on one message: far above any envd message (stdin
/// chunks are small), far below what would hurt a small guest.
pub const DEFAULT_MAX_MESSAGE: usize = 4 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub flags: u8,
    pub payload: Bytes,
}

impl Envelope {
    pub fn is_end_stream(&self) -> bool {
        self.flags & FLAG_END_STREAM != 0
    }

    pub fn is_compressed(&self) -> bool {
        self.flags & FLAG_COMPRESSED != 0
    }

    /// Header and payload as one buffer, ready to write.
    pub fn encode(&self) -> Bytes {
        encode(self.flags, &self.payload)
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EnvelopeError {
    #[error("envelope of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("stream ended inside an envelope ({have} bytes of {want})")]
    Truncated { have: usize, want: usize },
    #[error("payload of {0} bytes does not fit an envelope")]
    Unencodable(usize),
}

/// Frames `payload` with `flags`. Panics never: payloads over 4 GiB cannot be
/// built by this crate's callers, but are truncated in the length rather than
/// silently wrapped (see [`try_encode`] for the checked form).
pub fn encode(flags: u8, payload: &[u8]) -> Bytes {
    let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
    let mut out = BytesMut::with_capacity(HEADER_LEN + payload.len());
    out.put_u8(flags);
    out.put_u32(len);
    out.put_slice(&payload[..len as usize]);
    out.freeze()
}

/// Frames `payload`, refusing payloads too large for the 32-bit length.
pub fn try_encode(flags: u8, payload: &[u8]) -> Result<Bytes, EnvelopeError> {
    if u32::try_from(payload.len()).is_err() {
        return Err(EnvelopeError::Unencodable(payload.len()));
    }
    Ok(encode(flags, payload))
}

/// Serialises `msg` as JSON into a normal envelope.
pub fn encode_message<T: Serialize>(msg: &T) -> Result<Bytes, serde_json::Error> {
    Ok(encode(FLAG_NONE, &serde_json::to_vec(msg)?))
}

/// The end-stream envelope: `{}` on success, `{"error":{...}}` on failure.
pub fn encode_end_stream(end: &EndStream) -> Bytes {
    // Serialising EndStream cannot fail (strings and maps of strings only).
    let json = serde_json::to_vec(end).unwrap_or_else(|_| b"{}".to_vec());
    encode(FLAG_END_STREAM, &json)
}

/// Incremental decoder: feed byte chunks as they arrive, take complete envelopes
/// out. Only bytes actually received are buffered, so a huge declared length is
/// refused as soon as the header is in, without allocating for it.
#[derive(Debug)]
pub struct Decoder {
    buf: BytesMut,
    max: usize,
}

impl Decoder {
    pub fn new(max_message: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            max: max_message,
        }
    }

    /// Appends received bytes.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete envelope, `Ok(None)` if more bytes are needed. After an
    /// error the stream is unusable (framing is lost).
    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, EnvelopeError> {
        if self.buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > self.max {
            return Err(EnvelopeError::TooLarge { len, max: self.max });
        }
        if self.buf.len() < HEADER_LEN + len {
            return Ok(None);
        }
        let flags = self.buf[0];
        self.buf.advance(HEADER_LEN);
        let payload = self.buf.split_to(len).freeze();
        Ok(Some(Envelope { flags, payload }))
    }

    /// Call at end of input: an error if a partial envelope is left over.
    pub fn finish(&self) -> Result<(), EnvelopeError> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let want = if self.buf.len() >= HEADER_LEN {
            HEADER_LEN
                + u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize
        } else {
            HEADER_LEN
        };
        Err(EnvelopeError::Truncated {
            have: self.buf.len(),
            want,
        })
    }

    /// Bytes received but not yet returned as envelopes.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_MESSAGE)
    }
}

/// Decodes a complete body (tests, clients holding the whole response).
pub fn decode_all(body: &[u8], max_message: usize) -> Result<Vec<Envelope>, EnvelopeError> {
    let mut d = Decoder::new(max_message);
    d.push(body);
    let mut out = Vec::new();
    while let Some(e) = d.next_envelope()? {
        out.push(e);
    }
    d.finish()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Code, ConnectError};

    #[test]
    fn encodes_header_then_payload() {
        let b = encode(FLAG_NONE, b"{}");
        assert_eq!(&b[..], b"\x00\x00\x00\x00\x02{}");
        let e = encode_end_stream(&EndStream::ok());
        assert_eq!(&e[..], b"\x02\x00\x00\x00\x02{}");
        let err = encode_end_stream(&EndStream::error(ConnectError::new(Code::NotFound, "x")));
        assert_eq!(
            &err[5..],
            br#"{"error":{"code":"not_found","message":"x"}}"#.as_slice()
        );
        assert_eq!(err[0], FLAG_END_STREAM);
        assert_eq!(
            u32::from_be_bytes([err[1], err[2], err[3], err[4]]) as usize,
            err.len() - 5
        );
    }

    #[test]
    fn decodes_byte_by_byte_and_in_one_go() {
        let mut body = Vec::new();
        body.extend_from_slice(&encode(FLAG_NONE, br#"{"a":1}"#));
        body.extend_from_slice(&encode(FLAG_NONE, b""));
        body.extend_from_slice(&encode(FLAG_END_STREAM, b"{}"));
        let all = decode_all(&body, 100).unwrap();
        assert_eq!(all.len(), 3);
        assert_eq!(&all[0].payload[..], br#"{"a":1}"#);
        assert!(all[1].payload.is_empty() && !all[1].is_end_stream());
        assert!(all[2].is_end_stream() && !all[2].is_compressed());

        let mut d = Decoder::new(100);
        let mut got = Vec::new();
        for b in &body {
            d.push(std::slice::from_ref(b));
            while let Some(e) = d.next_envelope().unwrap() {
                got.push(e);
            }
        }
        assert_eq!(got, all);
        assert_eq!(d.buffered(), 0);
        d.finish().unwrap();
    }

    #[test]
    fn huge_declared_length_is_refused_from_the_header_alone() {
        let mut d = Decoder::new(1024);
        d.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(
            d.next_envelope(),
            Err(EnvelopeError::TooLarge {
                len: u32::MAX as usize,
                max: 1024
            })
        );
        // Exactly the limit is fine.
        let mut d = Decoder::new(3);
        d.push(&encode(FLAG_NONE, b"abc"));
        assert_eq!(&d.next_envelope().unwrap().unwrap().payload[..], b"abc");
    }

    #[test]
    fn partial_input_is_reported_at_finish() {
        let mut d = Decoder::new(100);
        d.push(&[0, 0, 0]);
        assert_eq!(d.next_envelope(), Ok(None));
        assert_eq!(
            d.finish(),
            Err(EnvelopeError::Truncated { have: 3, want: 5 })
        );
        d.push(&[0, 4, b'a']);
        assert_eq!(d.next_envelope(), Ok(None));
        assert_eq!(
            d.finish(),
            Err(EnvelopeError::Truncated { have: 6, want: 9 })
        );
        assert!(decode_all(&[0, 0, 0, 0, 9, b'x'], 100).is_err());
    }

    #[test]
    fn encode_message_uses_json() {
        let b = encode_message(&serde_json::json!({"k":"v"})).unwrap();
        assert_eq!(&b[..], b"\x00\x00\x00\x00\x09{\"k\":\"v\"}");
        assert!(try_encode(FLAG_NONE, b"x").is_ok());
    }
}

//! For host tests: a guest behind a vsock socket whose agent misbehaves
//! (the real guest needs a KVM lab). It takes one connection, answers the
//! `CONNECT` handshake, reads the request's head, writes `head` and then
//! filler bytes until the host hangs up.

use std::path::Path;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixListener;

pub fn serve(uds: &Path, head: &'static [u8]) {
    let listener = UnixListener::bind(uds).unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut seen = Vec::new();
        let mut byte = [0u8; 1];
        while !seen.ends_with(b"\n") {
            s.read_exact(&mut byte).await.unwrap();
            seen.push(byte[0]);
        }
        s.write_all(b"OK 1\n").await.unwrap();
        seen.clear();
        while !seen.ends_with(b"\r\n\r\n") {
            s.read_exact(&mut byte).await.unwrap();
            seen.push(byte[0]);
        }
        s.write_all(head).await.unwrap();
        let filler = [b'x'; 64 << 10];
        while s.write_all(&filler).await.is_ok() {}
    });
}

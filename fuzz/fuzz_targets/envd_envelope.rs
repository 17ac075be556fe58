//! envd's Connect framing and messages: the envelope decoder fed in chunks of
//! a fuzzed size (as bytes arrive from a client or a guest), and every
//! envelope's payload parsed as each message type a peer can send.
#![no_main]

use envd_proto::envelope::Decoder;
use envd_proto::{ConnectError, EndStream, filesystem, json, process, tcp_forward};
use libfuzzer_sys::fuzz_target;
use sandfork_fuzz::Cursor;

fn messages(payload: &[u8]) {
    macro_rules! parse {
        ($($ty:ty),* $(,)?) => {
            $(let _ = serde_json::from_slice::<$ty>(payload);)*
        };
    }
    parse!(
        process::StartRequest,
        process::ConnectRequest,
        process::ListRequest,
        process::ListResponse,
        process::UpdateRequest,
        process::SendInputRequest,
        process::StreamInputRequest,
        process::SendSignalRequest,
        process::CloseStdinRequest,
        process::StartResponse,
        filesystem::PathRequest,
        filesystem::MoveRequest,
        filesystem::ListDirRequest,
        filesystem::ListDirResponse,
        filesystem::EntryResponse,
        filesystem::WatchRequest,
        filesystem::WatchDirResponse,
        filesystem::WatcherIdMessage,
        filesystem::GetWatcherEventsResponse,
        filesystem::ComposeRequest,
        filesystem::WrittenFile,
        filesystem::HttpError,
        EndStream,
        ConnectError,
    );
    if let Ok(text) = std::str::from_utf8(payload) {
        let _ = json::b64_decode(text);
        let _ = tcp_forward::parse_request(text);
        let _ = tcp_forward::Reply::parse(text);
    }
}

fuzz_target!(|data: &[u8]| {
    let mut c = Cursor::new(data);
    let chunk = usize::from(c.u8()) + 1;
    let body = c.rest();
    let mut decoder = Decoder::new(1 << 16);
    'stream: for piece in body.chunks(chunk) {
        decoder.push(piece);
        loop {
            match decoder.next_envelope() {
                Ok(Some(envelope)) => {
                    let _ = envelope.is_end_stream();
                    messages(&envelope.payload);
                }
                Ok(None) => break,
                Err(_) => break 'stream,
            }
        }
    }
    let _ = decoder.finish();
    // The whole body at once takes the same path as the stream.
    let _ = envd_proto::envelope::decode_all(body, 1 << 16);
});

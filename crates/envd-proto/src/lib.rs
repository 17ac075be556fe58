//! Wire types of E2B's envd protocol as the E2B SDKs speak it: the Connect
//! protocol with the JSON codec (envelopes, error codes and bodies) and the
//! proto3-JSON messages of each service.
//!
//! Shared by the guest agent (server side) and the host tools (client side), so
//! every type both serialises and deserialises.

pub mod envelope;
pub mod error;
pub mod filesystem;
pub mod json;
pub mod process;
pub mod tcp_forward;

pub use envelope::{Decoder, Envelope, EnvelopeError};
pub use error::{Code, ConnectError, EndStream};

/// The envd version sandfork's agent implements, as the control plane
/// advertises it (`envdVersion`): the SDKs gate client features on it, and
/// every gate up to 0.6.4 (recursive and entry-carrying watches, metrics with
/// disk, stdin control, default user, octet-stream uploads, metadata, network
/// mount flag) is implemented. Later envd releases add no client-side gates.
pub const ENVD_VERSION: &str = "0.6.4";

/// The port envd serves on, in the guest: E2B's `E2b-Sandbox-Port` for envd
/// traffic and the vsock port the host reaches the guest agent on.
pub const PORT: u32 = 49983;

/// Content type of unary Connect requests and responses (JSON codec).
pub const CONTENT_TYPE_UNARY: &str = "application/json";
/// Content type of streaming Connect requests and responses. Responses must use
/// exactly this string: the Python SDK rejects any parameter after it.
pub const CONTENT_TYPE_STREAM: &str = "application/connect+json";

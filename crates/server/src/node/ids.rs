//! Random identifiers and secrets from the kernel's RNG.

use std::io::Read;

/// Length of a sandbox id: E2B-style, lowercase letters and digits only, so it
/// is one DNS label with no `-` (host names are `<port>-<id>.<domain>`).
pub const SANDBOX_ID_LEN: usize = 20;

/// The id of the node's built-in template.
pub const BASE_TEMPLATE: &str = "base";

/// A template or snapshot ID as looked up: without the tag E2B appends to
/// one (`<id>:default`).
pub fn without_default_tag(id: &str) -> &str {
    id.strip_suffix(":default").unwrap_or(id)
}

pub fn random_bytes(n: usize) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; n];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf)
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// 16 bytes written as a UUID (`8-4-4-4-12` hex digits).
pub fn uuid_text(bytes: &[u8; 16]) -> String {
    let h = hex(bytes);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// A random UUID (version 4), as E2B's ids are.
pub fn random_uuid() -> std::io::Result<String> {
    let mut b = [0u8; 16];
    b.copy_from_slice(&random_bytes(16)?);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    Ok(uuid_text(&b))
}

/// A fresh sandbox id.
pub fn sandbox_id() -> std::io::Result<String> {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    // 252 is the largest multiple of 36 below 256: rejecting above it keeps
    // every character equally likely.
    let mut id = String::with_capacity(SANDBOX_ID_LEN);
    while id.len() < SANDBOX_ID_LEN {
        for b in random_bytes(SANDBOX_ID_LEN * 2)? {
            if b < 252 && id.len() < SANDBOX_ID_LEN {
                id.push(ALPHABET[(b % 36) as usize] as char);
            }
        }
    }
    Ok(id)
}

/// Whether `id` can be a sandbox id (checked before it names a directory).
pub fn is_sandbox_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// A new secret token: 32 random bytes in hex.
pub fn token() -> std::io::Result<Token> {
    Ok(Token(hex(&random_bytes(32)?)))
}

/// A secret (an envd or traffic access token, a fork's file token): stored
/// and sent as itself, but its `Debug` shows none of it, so that a record
/// or request printed into a log gives nothing away.
#[derive(Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Token(String);

impl Token {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for Token {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

// A token-keyed map is looked up by the `&str` a request carries (the
// derived hash is the string's).
impl std::borrow::Borrow<str> for Token {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl From<String> for Token {
    fn from(s: String) -> Token {
        Token(s)
    }
}

impl From<&str> for Token {
    fn from(s: &str) -> Token {
        Token(s.to_owned())
    }
}

impl From<Token> for String {
    fn from(t: Token) -> String {
        t.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_ids_are_dns_labels_without_dashes_and_differ() {
        let a = sandbox_id().unwrap();
        let b = sandbox_id().unwrap();
        assert_eq!(a.len(), SANDBOX_ID_LEN);
        assert!(is_sandbox_id(&a), "{a}");
        assert_ne!(a, b);
        assert!(!is_sandbox_id("ab-c"));
        assert!(!is_sandbox_id("../x"));
        assert!(!is_sandbox_id("ABC"));
        assert!(!is_sandbox_id(""));
    }

    #[test]
    fn a_token_is_serialized_whole_and_debugged_as_nothing() {
        let t = token().unwrap();
        assert_eq!(t.len(), 64);
        assert_eq!(
            serde_json::to_string(&t).unwrap(),
            format!("\"{}\"", t.as_str())
        );
        assert_eq!(format!("{:?}", Some(t)), "Some(Token(..))");
    }

    #[test]
    fn hex_is_lowercase_two_digits_per_byte() {
        assert_eq!(hex(&[0, 0xab, 0x0f]), "00ab0f");
    }
}

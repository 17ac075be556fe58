//! v1 signatures of file URLs (`download_url`/`upload_url`, spec §3.2):
//! `"v1_" + base64_nopad(sha256("<path>:<op>:<username>:<token>[:<expiration>]"))`.

use base64::Engine;
use sha2::{Digest, Sha256};

/// What a signed URL allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Read,
    Write,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Operation::Read => "read",
            Operation::Write => "write",
        }
    }
}

/// The texts are E2B envd's own: clients compare them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("missing signature query parameter")]
    Missing,
    #[error("invalid signature")]
    Invalid,
    #[error("signature is already expired")]
    Expired,
    #[error("invalid signature expiration")]
    BadExpiration,
}

/// The signature of `path` (the raw query value) for `op` as `username` (""
/// when the URL has none), valid until `expiration` (unix seconds) if given.
pub fn sign(
    path: &str,
    op: Operation,
    username: &str,
    token: &str,
    expiration: Option<i64>,
) -> String {
    let mut text = format!("{path}:{}:{username}:{token}", op.as_str());
    if let Some(exp) = expiration {
        text += &format!(":{exp}");
    }
    let digest = Sha256::digest(text.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// Checks a URL's `signature` and `signature_expiration` against the token at
/// time `now` (unix seconds).
pub fn verify(
    path: &str,
    op: Operation,
    username: &str,
    token: &str,
    signature: Option<&str>,
    expiration: Option<&str>,
    now: i64,
) -> Result<(), SignatureError> {
    let signature = signature
        .filter(|s| !s.is_empty())
        .ok_or(SignatureError::Missing)?;
    let expiration = match expiration.filter(|e| !e.is_empty()) {
        None => None,
        Some(e) => Some(
            e.parse::<i64>()
                .map_err(|_| SignatureError::BadExpiration)?,
        ),
    };
    let expected = sign(path, op, username, token, expiration);
    if !constant_time_eq(expected.as_bytes(), signature.as_bytes()) {
        return Err(SignatureError::Invalid);
    }
    match expiration {
        Some(exp) if exp < now => Err(SignatureError::Expired),
        _ => Ok(()),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_example() {
        assert_eq!(
            sign(
                "/home/user/a.txt",
                Operation::Read,
                "",
                "tok_envd_secret",
                None
            ),
            "v1_aV6X1LHWPB4q7tmf5ETpqDSWAM58F6MZXorj0dYU79k"
        );
    }

    #[test]
    fn verify_checks_every_input() {
        let tok = "t";
        let s = sign("a", Operation::Write, "root", tok, Some(100));
        let v = |path, op, user, sig: Option<&str>, exp: Option<&str>, now| {
            verify(path, op, user, tok, sig, exp, now)
        };
        assert_eq!(
            v("a", Operation::Write, "root", Some(&s), Some("100"), 100),
            Ok(())
        );
        assert_eq!(
            v("a", Operation::Write, "root", Some(&s), Some("100"), 101),
            Err(SignatureError::Expired)
        );
        for (path, op, user, exp) in [
            ("b", Operation::Write, "root", Some("100")),
            ("a", Operation::Read, "root", Some("100")),
            ("a", Operation::Write, "", Some("100")),
            ("a", Operation::Write, "root", Some("101")),
            ("a", Operation::Write, "root", None),
        ] {
            assert_eq!(
                v(path, op, user, Some(&s), exp, 0),
                Err(SignatureError::Invalid),
                "{path} {op:?} {user} {exp:?}"
            );
        }
        assert_eq!(
            v("a", Operation::Write, "root", None, None, 0),
            Err(SignatureError::Missing)
        );
        assert_eq!(
            v("a", Operation::Write, "root", Some(&s), Some("soon"), 0),
            Err(SignatureError::BadExpiration)
        );
        let unexpiring = sign("a", Operation::Read, "", tok, None);
        assert_eq!(
            v("a", Operation::Read, "", Some(&unexpiring), None, i64::MAX),
            Ok(())
        );
    }
}

//! A sandbox's ingress settings as E2B's create sets them
//! (`network.allowPublicTraffic`, `network.maskRequestHost`,
//! `network.httpsPorts`): what the port proxy demands of, and changes in, a
//! request to one of the guest's own ports, and which of them it reaches
//! over TLS. envd's port is exempt from both, as in E2B's proxy: envd checks its
//! own access token and routes by nothing the Host says.

use axum::http::Uri;
use axum::http::header::{self, HeaderMap, HeaderValue};
use serde::{Deserialize, Serialize};

/// The header a private sandbox's traffic token travels in.
pub use crate::wire::TRAFFIC_TOKEN_HEADER;
/// Where `maskRequestHost` takes the guest port.
const PORT_PLACEHOLDER: &str = "${PORT}";

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ingress {
    /// `allowPublicTraffic` as given (None: never set, so public).
    #[serde(default)]
    pub allow_public_traffic: Option<bool>,
    /// `maskRequestHost` as given.
    #[serde(default)]
    pub mask_request_host: Option<String>,
    /// Set exactly when public traffic is off: what every request to a guest
    /// port must carry in [`TRAFFIC_TOKEN_HEADER`]. Kept by the sandbox for
    /// its life (pauses and resumes included); a fork child gets its own.
    #[serde(default)]
    pub traffic_access_token: Option<crate::node::ids::Token>,
    /// `httpsPorts`: guest ports the proxy speaks TLS to, certificates
    /// unchecked (E2B's: a guest's server has no certificate anyone signed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub https_ports: Vec<u32>,
}

/// Why a create's ingress settings are refused (E2B's 400 texts).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IngressError {
    #[error("mask request host is not valid: {0}")]
    InvalidMask(String),
    #[error("mask request host '{0}' is not ASCII. Please use ASCII characters only.")]
    NotAscii(String),
    /// The node's fault, not the request's.
    #[error("generating a traffic access token: {0}")]
    Token(String),
    #[error("httpsPorts: {0} is not a port of the sandbox's own (1 to 65535, not envd's 49983)")]
    HttpsPort(u32),
}

/// A request the proxy refuses for its traffic token (E2B answers 403).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Missing,
    Invalid,
}

impl Refusal {
    /// What the client is told (E2B's texts).
    pub fn message(self) -> String {
        match self {
            Refusal::Missing => format!(
                "Sandbox is secured with traffic access token. Token header \
                 '{TRAFFIC_TOKEN_HEADER}' is missing"
            ),
            Refusal::Invalid => format!(
                "Sandbox is secured with traffic access token. Provided token in header \
                 '{TRAFFIC_TOKEN_HEADER}' is invalid"
            ),
        }
    }
}

/// The host part of `mask` (`host`, `host:port` or `[v6]:port`), as Go's
/// `net.SplitHostPort` with the port optional; None when it is no host.
fn mask_host(mask: &str) -> Option<&str> {
    if let Some(rest) = mask.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        return (after.is_empty() || after.starts_with(':') && !after[1..].contains(':'))
            .then_some(host);
    }
    match mask.split_once(':') {
        Some((_, port)) if port.contains(':') => None,
        Some((host, _)) => Some(host),
        None => Some(mask),
    }
}

impl Ingress {
    /// From a create's fields: the mask checked as E2B checks it (and fit to
    /// be a Host header), a new token when public traffic is off.
    pub fn new(
        allow_public_traffic: Option<bool>,
        mask_request_host: Option<String>,
    ) -> Result<Ingress, IngressError> {
        if let Some(mask) = &mask_request_host {
            let host = mask_host(mask).ok_or_else(|| IngressError::InvalidMask(mask.clone()))?;
            if !host.is_ascii() {
                return Err(IngressError::NotAscii(host.to_owned()));
            }
            if mask.bytes().any(|b| !b.is_ascii_graphic()) {
                return Err(IngressError::InvalidMask(mask.clone()));
            }
        }
        let traffic_access_token = if allow_public_traffic == Some(false) {
            Some(new_token().map_err(|e| IngressError::Token(e.to_string()))?)
        } else {
            None
        };
        Ok(Ingress {
            allow_public_traffic,
            mask_request_host,
            traffic_access_token,
            https_ports: Vec::new(),
        })
    }

    /// With `ports` served over TLS (E2B's `httpsPorts`): guest ports,
    /// not envd's (the agent speaks plain HTTP), each once.
    pub fn with_https_ports(mut self, mut ports: Vec<u32>) -> Result<Ingress, IngressError> {
        if let Some(&bad) = ports
            .iter()
            .find(|&&p| p == 0 || p > 65535 || p == envd_proto::PORT)
        {
            return Err(IngressError::HttpsPort(bad));
        }
        ports.sort_unstable();
        ports.dedup();
        self.https_ports = ports;
        Ok(self)
    }

    /// Whether the proxy reaches guest port `port` over TLS.
    pub fn is_https(&self, port: u32) -> bool {
        self.https_ports.contains(&port)
    }

    /// The same settings for a fork child: private stays private, with a
    /// token of the child's own (E2B derives each token from the sandbox's
    /// id, so a child's differs from its parent's; a resume keeps the id and
    /// with it the token).
    pub fn for_child(&self) -> std::io::Result<Ingress> {
        let traffic_access_token = match self.traffic_access_token {
            Some(_) => Some(new_token()?),
            None => None,
        };
        Ok(Ingress {
            traffic_access_token,
            ..self.clone()
        })
    }

    /// Whether a request carrying `headers` may reach a guest port.
    pub fn admit(&self, headers: &HeaderMap) -> Result<(), Refusal> {
        let Some(token) = &self.traffic_access_token else {
            return Ok(());
        };
        let given = headers
            .get(TRAFFIC_TOKEN_HEADER)
            .map(HeaderValue::as_bytes)
            .filter(|v| !v.is_empty())
            .ok_or(Refusal::Missing)?;
        if crate::node::keys::same_secret(given, token.as_bytes()) {
            Ok(())
        } else {
            Err(Refusal::Invalid)
        }
    }

    /// Presents the masked host to guest port `port` (`${PORT}` replaced):
    /// `Host` rewritten, the one the client used kept in
    /// `X-Forwarded-Host`, as E2B's proxy does. `uri` is the request's own
    /// (an HTTP/2 request names its host there, not in a header).
    pub fn mask(&self, port: u32, uri: &Uri, headers: &mut HeaderMap) {
        let Some(mask) = self.mask_request_host.as_deref().filter(|m| !m.is_empty()) else {
            return;
        };
        let Ok(masked) = HeaderValue::from_str(&mask.replace(PORT_PLACEHOLDER, &port.to_string()))
        else {
            return;
        };
        let original = headers.get(header::HOST).cloned().or_else(|| {
            uri.authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        if let Some(original) = original {
            headers.insert("x-forwarded-host", original);
        }
        headers.insert(header::HOST, masked);
    }
}

fn new_token() -> std::io::Result<crate::node::ids::Token> {
    crate::node::ids::token()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::wire::header_map as headers;

    #[test]
    fn a_private_sandbox_gets_a_token_and_demands_it() {
        let public = Ingress::new(None, None).unwrap();
        assert_eq!(public.traffic_access_token, None);
        assert_eq!(public.admit(&HeaderMap::new()), Ok(()));
        assert_eq!(
            Ingress::new(Some(true), None).unwrap().traffic_access_token,
            None
        );

        let private = Ingress::new(Some(false), None).unwrap();
        let token = private.traffic_access_token.clone().unwrap();
        assert_eq!(token.len(), 64);
        assert_ne!(
            Ingress::new(Some(false), None)
                .unwrap()
                .traffic_access_token,
            Some(token.clone())
        );
        assert_eq!(private.admit(&HeaderMap::new()), Err(Refusal::Missing));
        assert_eq!(
            private.admit(&headers(&[(TRAFFIC_TOKEN_HEADER, "")])),
            Err(Refusal::Missing)
        );
        assert_eq!(
            private.admit(&headers(&[(TRAFFIC_TOKEN_HEADER, "nope")])),
            Err(Refusal::Invalid)
        );
        // Another sandbox's token, or the envd one, is no key.
        let other = Ingress::new(Some(false), None).unwrap();
        let other_token = other.traffic_access_token.unwrap();
        assert_eq!(
            private.admit(&headers(&[(TRAFFIC_TOKEN_HEADER, &other_token)])),
            Err(Refusal::Invalid)
        );
        // Header names are case-insensitive (the code interpreter sends
        // `E2B-Traffic-Access-Token`).
        assert_eq!(
            private.admit(&headers(&[("E2B-Traffic-Access-Token", &token)])),
            Ok(())
        );
        assert!(Refusal::Missing.message().contains("is missing"));
    }

    #[test]
    fn fork_children_stay_private_with_tokens_of_their_own() {
        let parent = Ingress::new(Some(false), Some("${PORT}-x.test".into())).unwrap();
        let child = parent.for_child().unwrap();
        assert_eq!(child.allow_public_traffic, Some(false));
        assert_eq!(child.mask_request_host, parent.mask_request_host);
        assert!(child.traffic_access_token.is_some());
        assert_ne!(child.traffic_access_token, parent.traffic_access_token);
        let public = Ingress::default().for_child().unwrap();
        assert_eq!(public, Ingress::default());
    }

    #[test]
    fn masks_are_checked_as_e2b_checks_them() {
        for ok in [
            "${PORT}-sandboxid.e2b.app",
            "localhost",
            "example.com:8080",
            "[::1]:80",
            "[::1]",
            "",
        ] {
            assert!(Ingress::new(None, Some(ok.into())).is_ok(), "{ok}");
        }
        for (bad, says) in [
            ("a:b:c", "not valid"),
            ("[::1", "not valid"),
            ("[::1]:80:1", "not valid"),
            ("exämple.com", "not ASCII"),
            ("a b.com", "not valid"),
            ("a\r\nx: y", "not valid"),
        ] {
            let e = Ingress::new(None, Some(bad.into())).unwrap_err();
            assert!(e.to_string().contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn the_mask_becomes_the_host_and_the_old_one_is_forwarded() {
        let ingress = Ingress::new(None, Some("${PORT}-app.internal:${PORT}".into())).unwrap();
        let uri: Uri = "/path".parse().unwrap();
        let mut h = headers(&[("host", "8080-abc.sandfork.example")]);
        ingress.mask(8080, &uri, &mut h);
        assert_eq!(h["host"], "8080-app.internal:8080");
        assert_eq!(h["x-forwarded-host"], "8080-abc.sandfork.example");
        // HTTP/2: the host is the URI's authority.
        let uri: Uri = "https://3000-abc.example/x".parse().unwrap();
        let mut h = HeaderMap::new();
        ingress.mask(3000, &uri, &mut h);
        assert_eq!(h["host"], "3000-app.internal:3000");
        assert_eq!(h["x-forwarded-host"], "3000-abc.example");
        // No mask (or an empty one): nothing changes.
        for ingress in [
            Ingress::default(),
            Ingress::new(None, Some(String::new())).unwrap(),
        ] {
            let mut h = headers(&[("host", "a")]);
            ingress.mask(1, &uri, &mut h);
            assert_eq!(h, headers(&[("host", "a")]));
        }
    }
}

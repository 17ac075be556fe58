//! The egress proxy's readers of what a guest sends first: the TLS
//! ClientHello's SNI and the HTTP request head's host, on any bytes. Neither
//! may panic, and a name either returns is a lower-case host name: the
//! proxy matches it against domain rules as is.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandfork_network::egress::{Parse, http, sni};

fn check(name: &str) {
    assert!(!name.is_empty() && name.len() <= 253, "{name:?}");
    assert!(
        name.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b)),
        "{name:?}"
    );
    assert!(!name.split('.').any(str::is_empty), "{name:?}");
}

fuzz_target!(|data: &[u8]| {
    if let Parse::Done(Some(name)) = sni::server_name(data) {
        check(&name);
    }
    if let Parse::Done(Some(name)) = http::request_host(data) {
        check(&name);
    }
});

//! `PUT /network-interfaces/{iface_id}`: a virtio-net device on a host tap.

use serde::{Deserialize, Serialize};

use crate::validation::{ValidationError, validate_resource_id};

/// Interface names are at most 15 bytes (`IFNAMSIZ` minus the NUL).
const MAX_HOST_DEV_NAME_LEN: usize = 15;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkInterface {
    pub iface_id: String,
    /// The host tap device; the VMM attaches to it (creating it if absent).
    pub host_dev_name: String,
    /// `"AA:FC:00:00:00:01"`; absent lets the guest pick a random one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_mac: Option<String>,
    /// Accepted for compatibility; sandfork does not rate-limit network I/O.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_rate_limiter: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tx_rate_limiter: Option<serde_json::Value>,
}

impl NetworkInterface {
    pub fn new(
        iface_id: impl Into<String>,
        host_dev_name: impl Into<String>,
        guest_mac: Option<&str>,
    ) -> Self {
        Self {
            iface_id: iface_id.into(),
            host_dev_name: host_dev_name.into(),
            guest_mac: guest_mac.map(str::to_owned),
            rx_rate_limiter: None,
            tx_rate_limiter: None,
        }
    }

    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_resource_id("iface_id", &self.iface_id)?;
        validate_host_dev_name("host_dev_name", &self.host_dev_name)?;
        if let Some(mac) = &self.guest_mac {
            parse_mac(mac)?;
        }
        Ok(())
    }

    /// The guest MAC as bytes; `None` when absent or invalid (see `validate`).
    pub fn mac(&self) -> Option<[u8; 6]> {
        self.guest_mac.as_deref().and_then(|m| parse_mac(m).ok())
    }
}

/// Checks a host interface name as the kernel would accept it for a tap.
pub(crate) fn validate_host_dev_name(field: &str, name: &str) -> Result<(), ValidationError> {
    let valid = !name.is_empty()
        && name.len() <= MAX_HOST_DEV_NAME_LEN
        && name != "."
        && name != ".."
        && !name
            .bytes()
            .any(|b| b == b'/' || b == b':' || b == b'%' || b == 0 || b.is_ascii_whitespace());
    if valid {
        Ok(())
    } else {
        Err(ValidationError::new(format!(
            "{field} {name:?} is not a valid interface name: 1 to {MAX_HOST_DEV_NAME_LEN} bytes, \
             without '/', ':', '%' or whitespace"
        )))
    }
}

/// Parses `"aa:bb:cc:dd:ee:ff"` (either case). A multicast or all-zero address
/// cannot be a NIC's own, so both are refused.
pub fn parse_mac(text: &str) -> Result<[u8; 6], ValidationError> {
    let invalid = || {
        ValidationError::new(format!(
            "guest_mac {text:?} is invalid: expected six hex byte pairs separated by ':', \
             like \"06:00:AC:10:00:02\""
        ))
    };
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next().ok_or_else(invalid)?;
        if part.len() != 2 || !part.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(invalid());
        }
        *byte = u8::from_str_radix(part, 16).map_err(|_| invalid())?;
    }
    if parts.next().is_some() {
        return Err(invalid());
    }
    if mac[0] & 1 != 0 {
        return Err(ValidationError::new(format!(
            "guest_mac {text} is a multicast address (lowest bit of the first byte set)"
        )));
    }
    if mac == [0; 6] {
        return Err(ValidationError::new("guest_mac must not be all zeros"));
    }
    Ok(mac)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn firecracker_shaped_json() {
        let n: NetworkInterface = serde_json::from_str(
            r#"{"iface_id": "eth0", "host_dev_name": "tap0", "guest_mac": "06:00:ac:10:00:02",
                "rx_rate_limiter": null}"#,
        )
        .unwrap();
        n.validate().unwrap();
        assert_eq!(n.mac(), Some([6, 0, 0xac, 0x10, 0, 2]));
        assert_eq!(
            serde_json::to_value(NetworkInterface::new("eth0", "tap0", None)).unwrap(),
            serde_json::json!({"iface_id": "eth0", "host_dev_name": "tap0"})
        );
        assert_eq!(NetworkInterface::new("eth0", "tap0", None).mac(), None);
    }

    #[test]
    fn rejects_bad_input() {
        assert!(
            serde_json::from_str::<NetworkInterface>(
                r#"{"iface_id": "eth0", "host_dev_name": "tap0", "mtu": 9000}"#
            )
            .is_err()
        );
        let check = |iface: &str, tap: &str, mac: Option<&str>| {
            NetworkInterface::new(iface, tap, mac)
                .validate()
                .unwrap_err()
                .to_string()
        };
        assert!(check("eth/0", "tap0", None).contains("iface_id"));
        assert!(check("eth0", "", None).contains("host_dev_name"));
        assert!(check("eth0", "a234567890123456", None).contains("host_dev_name"));
        assert!(check("eth0", "tap 0", None).contains("host_dev_name"));
        for bad in [
            "06:00:ac:10:00",
            "06:00:ac:10:00:02:03",
            "06-00-ac-10-00-02",
            "06:00:ac:10:00:2",
            "06:00:ac:10:00:0g",
            "06:00:ac:10:00:+2",
            "",
        ] {
            assert!(
                check("eth0", "tap0", Some(bad)).contains("invalid"),
                "{bad}"
            );
        }
        assert!(check("eth0", "tap0", Some("01:00:5e:00:00:01")).contains("multicast"));
        assert!(check("eth0", "tap0", Some("00:00:00:00:00:00")).contains("zeros"));
    }
}

//! `GET /devices` (sandfork extension): each virtio device's transport and
//! rings as guest memory holds them, for telling a lost interrupt (the
//! device raised one the driver never acknowledged) from a lost
//! notification (buffers the driver made available that the device never
//! took) when a guest stops answering.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceReport {
    /// The virtio device type (2 block, 1 net, 19 vsock).
    pub device_type: u32,
    pub activated: bool,
    /// The transport's interrupt status register: bits raised and not yet
    /// acknowledged by the driver (1 used buffers, 2 configuration).
    pub interrupt_status: u32,
    pub queues: Vec<QueueReport>,
    /// A disk: which drive, on which file now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drive: Option<DriveReport>,
}

/// A disk device's drive and the file it is on (its top layer).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriveReport {
    pub drive_id: String,
    pub path_on_host: String,
}

/// One queue's ring indices, read from guest memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueReport {
    pub size: u16,
    /// The driver's: buffers it has made available so far (mod 2^16).
    pub avail_idx: Option<u16>,
    /// The device's: buffers it has used so far (mod 2^16).
    pub used_idx: Option<u16>,
    /// The driver's flags (1: no interrupt wanted).
    pub avail_flags: Option<u16>,
    /// The device's flags (1: no notification wanted).
    pub used_flags: Option<u16>,
    /// With VIRTIO_RING_F_EVENT_IDX, the used index past which the driver
    /// wants an interrupt, and the available index past which the device
    /// wants a notification.
    pub used_event: Option<u16>,
    pub avail_event: Option<u16>,
    /// Why a value is missing (the ring is outside guest memory).
    pub error: Option<String>,
}

fn device_name(device_type: u32) -> String {
    match device_type {
        1 => "net".into(),
        2 => "block".into(),
        19 => "vsock".into(),
        other => format!("type {other}"),
    }
}

fn opt(v: Option<u16>) -> String {
    v.map_or_else(|| "?".into(), |v| v.to_string())
}

impl std::fmt::Display for DeviceReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {}, interrupt status {:#x}",
            device_name(self.device_type),
            if self.activated { "active" } else { "inactive" },
            self.interrupt_status
        )?;
        for (i, q) in self.queues.iter().enumerate() {
            write!(
                f,
                "\n  queue {i} (size {}): avail idx {} flags {}, used idx {} flags {}, used_event {}, avail_event {}",
                q.size,
                opt(q.avail_idx),
                opt(q.avail_flags),
                opt(q.used_idx),
                opt(q.used_flags),
                opt(q.used_event),
                opt(q.avail_event)
            )?;
            if let Some(e) = &q.error {
                write!(f, " ({e})")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_names_the_device_and_each_queue() {
        let report = DeviceReport {
            device_type: 19,
            activated: true,
            interrupt_status: 1,
            queues: vec![QueueReport {
                size: 128,
                avail_idx: Some(300),
                used_idx: Some(172),
                avail_flags: Some(0),
                used_flags: Some(0),
                used_event: None,
                avail_event: None,
                error: None,
            }],
            drive: None,
        };
        let text = report.to_string();
        assert!(
            text.starts_with("vsock: active, interrupt status 0x1"),
            "{text}"
        );
        assert!(
            text.contains("avail idx 300 flags 0, used idx 172"),
            "{text}"
        );
        let json = serde_json::to_string(&report).unwrap();
        assert_eq!(serde_json::from_str::<DeviceReport>(&json).unwrap(), report);
    }
}

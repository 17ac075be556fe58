//! The whole-VM configuration: Firecracker's `--config-file` JSON and `GET /vm/config`.

use serde::{Deserialize, Serialize};

use crate::balloon::Balloon;
use crate::boot_source::BootSource;
use crate::drive::Drive;
use crate::machine_config::MachineConfig;
use crate::network_interface::NetworkInterface;
use crate::validation::ValidationError;
use crate::vsock::Vsock;

/// Keys use Firecracker's kebab-case spelling.
///
/// Sections for devices sandfork lacks are parsed (so a Firecracker file or a
/// `GET /vm/config` answer, which lists them as `null` or `[]`, still loads) and then
/// refused by [`validate`](Self::validate) when they configure something. `logger` and
/// `metrics` only affect Firecracker's own output and are ignored.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    #[serde(
        rename = "boot-source",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub boot_source: Option<BootSource>,
    #[serde(default)]
    pub drives: Vec<Drive>,
    #[serde(
        rename = "machine-config",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub machine_config: Option<MachineConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock: Option<Vsock>,
    #[serde(
        rename = "network-interfaces",
        default,
        deserialize_with = "null_as_empty",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub network_interfaces: Vec<NetworkInterface>,

    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logger: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<serde_json::Value>,

    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balloon: Option<Balloon>,
    #[serde(
        rename = "mmds-config",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub mmds_config: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entropy: Option<serde_json::Value>,
    #[serde(
        rename = "cpu-config",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub cpu_config: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pmem: Option<serde_json::Value>,
    #[serde(
        rename = "memory-hotplug",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub memory_hotplug: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<serde_json::Value>,
}

impl VmConfig {
    /// Parses a config file's contents; the error names the offending key or position.
    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The machine config to use: the given one or Firecracker's defaults.
    pub fn machine_config_or_default(&self) -> MachineConfig {
        self.machine_config.clone().unwrap_or_default()
    }

    /// Checks every section, and that the file can boot a VM: a boot source, at most one
    /// root drive, unique drive ids, and no device sandfork does not implement.
    pub fn validate(&self) -> Result<(), ValidationError> {
        let Some(boot) = &self.boot_source else {
            return Err(ValidationError::new("boot-source is required"));
        };
        boot.validate()?;
        self.machine_config_or_default().validate()?;
        let mut roots = 0;
        for (i, drive) in self.drives.iter().enumerate() {
            drive
                .validate()
                .map_err(|e| ValidationError::new(format!("drives[{i}]: {e}")))?;
            if self.drives[..i]
                .iter()
                .any(|d| d.drive_id == drive.drive_id)
            {
                return Err(ValidationError::new(format!(
                    "drives[{i}]: duplicate drive_id {:?}",
                    drive.drive_id
                )));
            }
            roots += usize::from(drive.is_root_device);
        }
        if roots > 1 {
            return Err(ValidationError::new(
                "at most one drive may have is_root_device set",
            ));
        }
        if let Some(v) = &self.vsock {
            v.validate()?;
        }
        for (i, net) in self.network_interfaces.iter().enumerate() {
            net.validate()
                .map_err(|e| ValidationError::new(format!("network-interfaces[{i}]: {e}")))?;
            let earlier = &self.network_interfaces[..i];
            if earlier.iter().any(|n| n.iface_id == net.iface_id) {
                return Err(ValidationError::new(format!(
                    "network-interfaces[{i}]: duplicate iface_id {:?}",
                    net.iface_id
                )));
            }
            if earlier.iter().any(|n| n.host_dev_name == net.host_dev_name) {
                return Err(ValidationError::new(format!(
                    "network-interfaces[{i}]: tap {:?} is already used by another interface",
                    net.host_dev_name
                )));
            }
        }
        if let Some(b) = &self.balloon {
            b.validate()
                .map_err(|e| ValidationError::new(format!("balloon: {e}")))?;
        }
        let unsupported = [
            ("mmds-config", &self.mmds_config),
            ("entropy", &self.entropy),
            ("cpu-config", &self.cpu_config),
            ("pmem", &self.pmem),
            ("memory-hotplug", &self.memory_hotplug),
            ("serial", &self.serial),
        ];
        for (key, value) in unsupported {
            if configures_something(value.as_ref()) {
                return Err(ValidationError::new(format!(
                    "{key} is not supported by sandfork-vmm"
                )));
            }
        }
        Ok(())
    }
}

/// Firecracker's `GET /vm/config` may give an absent list as `null`.
fn null_as_empty<'de, D, T>(de: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(Option::<Vec<T>>::deserialize(de)?.unwrap_or_default())
}

fn configures_something(value: Option<&serde_json::Value>) -> bool {
    match value {
        None | Some(serde_json::Value::Null) => false,
        Some(serde_json::Value::Array(items)) => !items.is_empty(),
        Some(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIRECRACKER_FILE: &str = r#"{
        "boot-source": {"kernel_image_path": "vmlinux", "boot_args": "console=ttyS0 reboot=k panic=1"},
        "drives": [
            {"drive_id": "rootfs", "path_on_host": "rootfs.ext4", "is_root_device": true, "is_read_only": false}
        ],
        "machine-config": {"vcpu_count": 2, "mem_size_mib": 1024, "smt": false},
        "vsock": {"guest_cid": 3, "uds_path": "/tmp/v.sock"},
        "network-interfaces": null,
        "balloon": null,
        "logger": {"log_path": "/tmp/fc.log", "level": "Debug"}
    }"#;

    #[test]
    fn parses_a_firecracker_config_file() {
        let c = VmConfig::from_json(FIRECRACKER_FILE).unwrap();
        c.validate().unwrap();
        assert_eq!(c.boot_source.as_ref().unwrap().kernel_image_path, "vmlinux");
        assert_eq!(c.drives.len(), 1);
        assert_eq!(c.machine_config.as_ref().unwrap().vcpu_count, 2);
        assert_eq!(c.vsock.as_ref().unwrap().guest_cid, 3);
        assert!(c.network_interfaces.is_empty());

        let with_net = FIRECRACKER_FILE.replace(
            r#""network-interfaces": null"#,
            r#""network-interfaces": [{"iface_id": "eth0", "host_dev_name": "tap0", "guest_mac": "06:00:AC:10:00:02"}]"#,
        );
        let c = VmConfig::from_json(&with_net).unwrap();
        c.validate().unwrap();
        assert_eq!(
            c.network_interfaces[0].mac(),
            Some([6, 0, 0xac, 0x10, 0, 2])
        );
        let again = serde_json::to_value(&c).unwrap();
        assert_eq!(again["network-interfaces"][0]["host_dev_name"], "tap0");
    }

    #[test]
    fn serializes_with_kebab_keys() {
        let c = VmConfig {
            boot_source: Some(BootSource {
                kernel_image_path: "/k".into(),
                boot_args: None,
                initrd_path: None,
            }),
            machine_config: Some(MachineConfig::default()),
            ..Default::default()
        };
        let v = serde_json::to_value(&c).unwrap();
        assert!(v.get("boot-source").is_some());
        assert!(v.get("machine-config").is_some());
        assert_eq!(v["drives"], serde_json::json!([]));
        assert_eq!(VmConfig::from_json(&v.to_string()).unwrap(), c);
    }

    #[test]
    fn rejections() {
        let err = VmConfig::from_json(r#"{"boot_source": {}}"#).unwrap_err();
        assert!(
            err.to_string().contains("unknown field `boot_source`"),
            "{err}"
        );

        let no_boot = VmConfig::default();
        assert_eq!(
            no_boot.validate().unwrap_err().to_string(),
            "boot-source is required"
        );

        let mut c = VmConfig::from_json(FIRECRACKER_FILE).unwrap();
        c.network_interfaces = vec![
            NetworkInterface::new("eth0", "tap0", Some("06:00:00:00:00:01")),
            NetworkInterface::new("eth1", "tap0", None),
        ];
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("network-interfaces[1]") && err.contains("tap0"),
            "{err}"
        );
        c.network_interfaces[1].iface_id = "eth0".into();
        assert!(c.validate().unwrap_err().to_string().contains("duplicate"));
        c.network_interfaces[1] = NetworkInterface::new("eth1", "tap1", Some("bad"));
        assert!(c.validate().unwrap_err().to_string().contains("guest_mac"));
        c.network_interfaces.pop();
        c.validate().unwrap();

        let mut c = VmConfig::from_json(FIRECRACKER_FILE).unwrap();
        c.drives.push(c.drives[0].clone());
        assert!(c.validate().unwrap_err().to_string().contains("duplicate"));
        c.drives[1].drive_id = "second".into();
        assert!(c.validate().unwrap_err().to_string().contains("root"));

        let mut c = VmConfig::from_json(FIRECRACKER_FILE).unwrap();
        c.machine_config = Some(MachineConfig::new(64, 128));
        assert!(c.validate().unwrap_err().to_string().contains("vcpu_count"));
    }
}

//! `PUT /boot-source`: the guest kernel, its command line and an optional initrd.

use serde::{Deserialize, Serialize};

use crate::validation::{ValidationError, validate_path};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BootSource {
    /// Host path of an uncompressed `vmlinux` (ELF) kernel.
    pub kernel_image_path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_args: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd_path: Option<String>,
}

impl BootSource {
    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_path("kernel_image_path", &self.kernel_image_path)?;
        if let Some(initrd) = &self.initrd_path {
            validate_path("initrd_path", initrd)?;
        }
        if let Some(args) = &self.boot_args
            && args.contains('\0')
        {
            return Err(ValidationError::new(
                "boot_args must not contain a NUL byte",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn firecracker_shaped_json() {
        let body = r#"{"kernel_image_path": "/k/vmlinux", "boot_args": "console=ttyS0 reboot=k"}"#;
        let b: BootSource = serde_json::from_str(body).unwrap();
        assert_eq!(b.kernel_image_path, "/k/vmlinux");
        assert_eq!(b.boot_args.as_deref(), Some("console=ttyS0 reboot=k"));
        assert_eq!(b.initrd_path, None);
        b.validate().unwrap();
        // Absent options stay absent on the wire, so older Firecrackers accept our bodies.
        let back = serde_json::to_value(&b).unwrap();
        assert_eq!(
            back,
            serde_json::json!({"kernel_image_path": "/k/vmlinux", "boot_args": "console=ttyS0 reboot=k"})
        );
    }

    #[test]
    fn rejects_unknown_and_missing_fields() {
        let err = serde_json::from_str::<BootSource>(r#"{"kernel_image_path": "/k", "kernel": 1}"#)
            .unwrap_err();
        assert!(err.to_string().contains("unknown field `kernel`"), "{err}");
        let err = serde_json::from_str::<BootSource>(r#"{"boot_args": "x"}"#).unwrap_err();
        assert!(
            err.to_string()
                .contains("missing field `kernel_image_path`"),
            "{err}"
        );
    }

    #[test]
    fn validation() {
        let mut b = BootSource {
            kernel_image_path: String::new(),
            boot_args: None,
            initrd_path: None,
        };
        assert_eq!(
            b.validate().unwrap_err().to_string(),
            "kernel_image_path must not be empty"
        );
        b.kernel_image_path = "/k".into();
        b.initrd_path = Some(String::new());
        assert!(b.validate().is_err());
    }
}

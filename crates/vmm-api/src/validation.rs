//! The error every resource's `validate` returns, and checks shared by several resources.

/// A request body that parsed but holds a value the VMM cannot accept.
///
/// The message is shown to API users verbatim as the `fault_message`, so it names the
/// field and the accepted range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ValidationError {
    pub message: String,
}

impl ValidationError {
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

/// Checks an id used in a URL path (`/drives/{drive_id}`) or a body.
///
/// Firecracker accepts only ASCII letters, digits and underscores in resource ids; keeping
/// the same rule means ids never need escaping in a path.
pub fn validate_resource_id(field: &str, id: &str) -> Result<(), ValidationError> {
    if id.is_empty() {
        return Err(ValidationError::new(format!("{field} must not be empty")));
    }
    if !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(ValidationError::new(format!(
            "{field} {id:?} is invalid: only ASCII letters, digits and underscores are allowed"
        )));
    }
    Ok(())
}

/// Checks that a host path field is present and usable as a path.
pub(crate) fn validate_path(field: &str, path: &str) -> Result<(), ValidationError> {
    if path.is_empty() {
        return Err(ValidationError::new(format!("{field} must not be empty")));
    }
    if path.contains('\0') {
        return Err(ValidationError::new(format!(
            "{field} must not contain a NUL byte"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_ids() {
        assert!(validate_resource_id("drive_id", "rootfs_1").is_ok());
        let err = validate_resource_id("drive_id", "").unwrap_err();
        assert_eq!(err.to_string(), "drive_id must not be empty");
        let err = validate_resource_id("drive_id", "a/b").unwrap_err();
        assert!(err.to_string().contains("\"a/b\""), "{err}");
        assert!(validate_resource_id("drive_id", "é").is_err());
    }

    #[test]
    fn paths() {
        assert!(validate_path("path_on_host", "/x").is_ok());
        assert!(validate_path("path_on_host", "").is_err());
        assert!(validate_path("path_on_host", "a\0b").is_err());
    }
}

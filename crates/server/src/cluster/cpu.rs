//! The cluster's CPU rule: a frozen guest (a pause, a template, a fork)
//! runs on another node only if that node boots guests under the CPU
//! template the guest was booted under (`serve --cpu-template`), so the
//! features its CPUID offers, which its code already chose paths by, are
//! the ones every such node offers. The VMM checks the host itself at the
//! load too (every feature the snapshot's CPUID offers must be in this
//! host's KVM); this rule refuses earlier, by name, what nodes of a cluster
//! configured alike would never hand each other.

use super::durable::DurableError;
use crate::node::sandbox::Manager;

/// How a CPU template reads in messages.
fn shown(template: Option<&str>) -> String {
    match template {
        Some(t) => format!("CPU template {t}"),
        None => "the host's CPU (no --cpu-template)".into(),
    }
}

/// Checks that `what`, booted under CPU template `made`, may run on a
/// node whose guests get `here` (None: the host's CPU).
pub fn check(what: &str, made: Option<&str>, here: Option<&str>) -> Result<(), DurableError> {
    if made == here {
        return Ok(());
    }
    Err(DurableError::CpuTemplate(format!(
        "{what} was booted under {}, and this node runs its guests under {}: it runs on \
         nodes started with the same --cpu-template",
        shown(made),
        shown(here)
    )))
}

/// [`check`] against the template of `manager`'s node.
pub fn check_here(manager: &Manager, what: &str, made: Option<&str>) -> Result<(), DurableError> {
    check(what, made, manager.config().cpu_template_name().as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_same_template_passes() {
        check("sandbox a", None, None).unwrap();
        check("sandbox a", Some("x86-64-v3"), Some("x86-64-v3")).unwrap();
        let err = check("sandbox a", Some("x86-64-v3"), None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "sandbox a was booted under CPU template x86-64-v3, and this node runs its guests \
             under the host's CPU (no --cpu-template): it runs on nodes started with the same \
             --cpu-template"
        );
        let err = check("template t", None, Some("x86-64-v2")).unwrap_err();
        assert!(
            err.to_string().contains("under CPU template x86-64-v2"),
            "{err}"
        );
    }
}

//! The KVM lab.

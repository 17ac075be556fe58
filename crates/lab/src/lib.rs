//! The KVM lab: real KVM for hosts whose own /dev/kvm cannot boot Linux.
//!
//! A lab machine is `qemu-system-x86_64 -accel tcg -cpu max,+svm,+npt` booting
//! Debian's generic kernel with a small initramfs (static busybox, the kvm-amd,
//! virtio and 9p modules, a generated init). Inside, `/dev/kvm` is a standard
//! KVM on emulated SVM. The host's root is shared read-only over 9p and the
//! command runs chrooted into it at the same working directory, so host
//! binaries run unchanged; selected directories are shared read-write.
//!
//! ```no_run
//! use sandfork_lab::{Lab, LabConfig, default_cache_dir};
//! let lab = Lab::prepare(&default_cache_dir())?;
//! let out = lab.run(&LabConfig::default(), &["ls".into(), "-l".into(), "/dev/kvm".into()])?;
//! assert_eq!(out.code, 0);
//! # Ok::<(), sandfork_lab::LabError>(())
//! ```

mod config;
mod cpio;
mod detect;
mod elf;
mod error;
mod job;
mod modules;
mod prepare;
mod qemu;
mod run;
mod sizing;
mod stall;

pub use config::{
    LabConfig, OutputMode, PASSED_HOST_VARS, PortForward, RootCache, TcgThreads, effective_env,
    parse_env,
};
pub use detect::{Detection, Environment, detect, detect_from};
pub use error::{LabError, Result};
pub use modules::LAB_MODULES;
pub use prepare::{LabPaths, default_cache_dir};
pub use run::{Lab, LabChild, LabOutput};
pub use sizing::host_sized_memory_mib;

//! The QEMU command line of a lab machine.

use std::path::{Path, PathBuf};

use crate::config::{LabConfig, RootCache};

pub const QEMU: &str = "qemu-system-x86_64";

/// Names of the virtio-serial ports, as init looks them up.
pub const PORT_STDOUT: &str = "sandfork.stdout";
pub const PORT_STDERR: &str = "sandfork.stderr";
pub const PORT_STATUS: &str = "sandfork.status";
/// Asked on a timeout, init answers there with the machine's state.
pub const PORT_DIAG: &str = "sandfork.diag";

/// Everything one QEMU invocation needs besides the config.
pub struct MachineFiles<'a> {
    pub kernel: &'a Path,
    pub initramfs: &'a Path,
    /// Directory holding job.sh and mounts, passed to init by path.
    pub job_dir: &'a Path,
    pub console_log: &'a Path,
    /// Unix sockets QEMU connects to, one per port.
    pub stdout_sock: &'a Path,
    pub stderr_sock: &'a Path,
    pub status_sock: &'a Path,
    pub diag_sock: &'a Path,
    /// QEMU's human monitor, a server socket (for the emulated CPU's state).
    pub monitor_sock: &'a Path,
    /// Read-write shares as (9p tag, host directory).
    pub rw_shares: &'a [(String, PathBuf)],
}

/// QEMU's option syntax doubles commas inside values.
fn esc(p: &Path) -> String {
    p.to_string_lossy().replace(',', ",,")
}

/// The kernel command line. `quiet loglevel=0` keeps the console to init's
/// own messages and panics; `panic=-1` with `-no-reboot` ends QEMU on a panic.
/// `psi=1`: Debian's kernel tracks pressure stall information only when
/// asked, and the node's memory pressure monitor reads it.
/// `extra` comes last, so it can override what comes before.
pub fn kernel_cmdline(job_dir: &Path, root_cache: RootCache, extra: &[String]) -> String {
    let mut line = format!(
        "console=ttyS0 quiet loglevel=0 panic=-1 psi=1 sandfork.job={} sandfork.root_cache={}",
        job_dir.display(),
        root_cache.as_9p()
    );
    for arg in extra {
        line.push(' ');
        line.push_str(arg);
    }
    line
}

pub fn qemu_args(config: &LabConfig, files: &MachineFiles<'_>) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let mut push = |xs: &[&str]| a.extend(xs.iter().map(|s| s.to_string()));
    push(&[
        "-accel",
        &format!("tcg,thread={}", config.tcg_threads.as_qemu()),
        "-cpu",
        "max,+svm,+npt",
    ]);
    if config.icount {
        push(&["-icount", "shift=auto"]);
    }
    push(&["-m", &config.memory_mib.to_string()]);
    push(&["-smp", &config.cpus.to_string()]);
    push(&[
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
    ]);
    push(&["-kernel", &files.kernel.to_string_lossy()]);
    push(&["-initrd", &files.initramfs.to_string_lossy()]);
    push(&[
        "-append",
        &kernel_cmdline(files.job_dir, config.root_cache, &config.kernel_args),
    ]);
    push(&[
        "-chardev",
        &format!("file,id=console,path={}", esc(files.console_log)),
        "-serial",
        "chardev:console",
    ]);
    // multidevs=remap: the host root spans several filesystems whose inode
    // numbers collide (/proc and /sys roots are both 1); without it the guest
    // takes them for one inode and a mount on one shows on the other.
    push(&[
        "-virtfs",
        "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap",
    ]);
    for (tag, dir) in files.rw_shares {
        push(&[
            "-virtfs",
            &format!(
                "local,path={},mount_tag={tag},security_model=passthrough,multidevs=remap",
                esc(dir)
            ),
        ]);
    }
    let mut netdev = String::from("user,id=net0");
    for f in &config.forwards {
        netdev.push_str(&format!(
            ",hostfwd=tcp:{}:{}-:{}",
            f.host_addr, f.host_port, f.guest_port
        ));
    }
    push(&["-netdev", &netdev, "-device", "virtio-net-pci,netdev=net0"]);
    push(&[
        "-monitor",
        &format!("unix:{},server=on,wait=off", esc(files.monitor_sock)),
    ]);
    push(&["-device", "virtio-serial-pci,id=vser0"]);
    for (id, sock, name) in [
        ("out", files.stdout_sock, PORT_STDOUT),
        ("err", files.stderr_sock, PORT_STDERR),
        ("status", files.status_sock, PORT_STATUS),
        ("diag", files.diag_sock, PORT_DIAG),
    ] {
        push(&[
            "-chardev",
            &format!("socket,id={id},path={}", esc(sock)),
            "-device",
            &format!("virtserialport,bus=vser0.0,chardev={id},name={name}"),
        ]);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{PortForward, TcgThreads};

    #[test]
    fn args_carry_the_config() {
        let config = LabConfig {
            memory_mib: 2048,
            cpus: 1,
            tcg_threads: TcgThreads::Single,
            kernel_args: vec!["kvm_amd.vgif=0".into()],
            forwards: vec![
                "8080:80".parse::<PortForward>().unwrap(),
                "0.0.0.0:2222:22".parse().unwrap(),
            ],
            ..LabConfig::default()
        };
        let shares = vec![("rw0".to_string(), PathBuf::from("/work/a,b"))];
        let files = MachineFiles {
            kernel: Path::new("/c/vmlinuz"),
            initramfs: Path::new("/c/initramfs.cpio"),
            job_dir: Path::new("/tmp/sandfork-lab-x"),
            console_log: Path::new("/tmp/sandfork-lab-x/console.log"),
            stdout_sock: Path::new("/tmp/sandfork-lab-x/out.sock"),
            stderr_sock: Path::new("/tmp/sandfork-lab-x/err.sock"),
            status_sock: Path::new("/tmp/sandfork-lab-x/status.sock"),
            diag_sock: Path::new("/tmp/sandfork-lab-x/diag.sock"),
            monitor_sock: Path::new("/tmp/sandfork-lab-x/monitor.sock"),
            rw_shares: &shares,
        };
        let a = qemu_args(&config, &files);
        let after = |flag: &str| -> Vec<&str> {
            a.windows(2)
                .filter(|w| w[0] == flag)
                .map(|w| w[1].as_str())
                .collect()
        };
        assert_eq!(after("-m"), ["2048"]);
        assert_eq!(after("-smp"), ["1"]);
        assert_eq!(after("-cpu"), ["max,+svm,+npt"]);
        assert_eq!(after("-accel"), ["tcg,thread=single"]);
        assert!(after("-append")[0].ends_with(" kvm_amd.vgif=0"));
        assert_eq!(
            after("-netdev"),
            ["user,id=net0,hostfwd=tcp:127.0.0.1:8080-:80,hostfwd=tcp:0.0.0.0:2222-:22"]
        );
        let virtfs = after("-virtfs");
        assert!(virtfs[0].contains("path=/,") && virtfs[0].contains("readonly=on"));
        assert!(virtfs[1].starts_with("local,path=/work/a,,b,mount_tag=rw0,"));
        assert!(after("-append")[0].contains("sandfork.job=/tmp/sandfork-lab-x "));
        assert_eq!(
            after("-monitor"),
            ["unix:/tmp/sandfork-lab-x/monitor.sock,server=on,wait=off"]
        );
        let ports = after("-device");
        for name in [PORT_STDOUT, PORT_STDERR, PORT_STATUS, PORT_DIAG] {
            assert!(ports.iter().any(|d| d.ends_with(&format!("name={name}"))));
        }
    }
}

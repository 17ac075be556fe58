//! The jail a node's VMM runs in: its own mount, PID and IPC namespaces (and
//! its sandbox's network namespace), a root of its own holding only what a
//! VMM needs, an unprivileged uid and gid of its own, no capabilities,
//! `no_new_privs`, resource limits, and no descriptor but its standard ones.
//!
//! The server starts the VMM with `clone(2)` (a new PID namespace needs a
//! new process: `unshare` would only move its children) and the child jails
//! itself before it executes the VMM. Everything that allocates or reads
//! files (paths, mount list, devices, argument and environment vectors) is
//! prepared in [`Prepared`] before the clone; between clone and exec the
//! child only makes system calls on that prepared data, which is what a
//! child of a multi-threaded process may do (async-signal-safe, no locks, no
//! allocation). A failure there is written to a pipe as a step and an errno,
//! and the child exits; the server reads the pipe to its end (closed by the
//! exec) before it calls the spawn done.
//!
//! Paths are not translated: every host path the VMM is given (its API and
//! vsock sockets, kernel, disk layers and the parents they name, memory
//! files, snapshot and fork destinations) is visible in the jail at the same
//! path. So the server's API calls, snapshot state files and layer headers
//! stay valid inside and outside, a fork child finds its parent's memory
//! file where the parent wrote it, and an adopting server finds a VMM by the
//! socket path it was started with. Directories every VMM needs whole (its
//! own, the kernels') are bind-mounted at their own paths at the start;
//! the directories holding many VMMs' files ([`Jail::staged`]) start empty,
//! and each file or directory an API call names is bind-mounted into them
//! at its own path just before the call (see `expose`), so a VMM sees only
//! what it was handed, not its neighbours' disks and memory.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};
use nix::sched::CloneFlags;
use nix::sys::stat::{Mode, SFlag};
use nix::unistd::{Gid, Uid};

/// How a node's VMMs are jailed.
#[derive(Clone, Debug)]
pub struct Jail {
    /// A VMM runs as uid and gid `uid_base` + its pid (as the host sees
    /// it): unique among running VMMs without a table to keep or recover.
    pub uid_base: u32,
    /// Host directories the VMM sees at their own paths and may write (its
    /// own directory is always one).
    pub writable: Vec<PathBuf>,
    /// Host files and directories it sees at their own paths, read-only
    /// (kernels, root images, the VMM's shared libraries).
    pub read_only: Vec<PathBuf>,
    /// Host directories it sees empty (a small tmpfs of root's at each
    /// path), into which the files it is handed are exposed one by one:
    /// the directories holding every sandbox's disks and memory files.
    pub staged: Vec<PathBuf>,
    pub limits: Limits,
}

/// The resource limits of a jailed VMM (soft and hard).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Open descriptors (disk layers, memory files, vsock connections).
    pub nofile: u64,
    /// Threads of its uid (vCPUs, device workers, API); its cgroup's
    /// `pids.max` is the tighter bound per sandbox.
    pub nproc: u64,
    /// The largest file it may write; `None` leaves it unlimited (a pooled
    /// VMM does not know its guest's memory and disk sizes yet).
    pub fsize: Option<u64>,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            nofile: 4096,
            nproc: 512,
            fsize: None,
        }
    }
}

impl Jail {
    /// A jail exposing `writable` and `read_only`, plus the shared libraries
    /// the VMM binary `vmm` loads (from `ldd`; none for a static binary).
    pub fn new(
        uid_base: u32,
        writable: Vec<PathBuf>,
        mut read_only: Vec<PathBuf>,
        vmm: &Path,
    ) -> Jail {
        read_only.extend(shared_libraries(vmm));
        Jail {
            uid_base,
            writable,
            read_only,
            staged: Vec::new(),
            limits: Limits::default(),
        }
    }

    /// This jail with `dirs` staged (see [`Jail::staged`]).
    pub fn with_staged(mut self, dirs: Vec<PathBuf>) -> Jail {
        self.staged = dirs;
        self
    }
}

/// The source name of the tmpfs at a staged directory: how the exposing
/// side finds a VMM's staged directories in its mount table (an adopted
/// VMM's too) without a record of its own.
pub(crate) const STAGED_SOURCE: &std::ffi::CStr = c"sandfork-staged";

/// The files a dynamically linked `binary` loads at its start: its program
/// interpreter and libraries, at the paths the loader looks them up by.
fn shared_libraries(binary: &Path) -> Vec<PathBuf> {
    let Ok(out) = std::process::Command::new("ldd").arg(binary).output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` or
            // `/lib64/ld-linux-x86-64.so.2 (0x...)`.
            let path = line.rsplit("=>").next()?.split_whitespace().next()?;
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

/// The device nodes a VMM gets in its `/dev`, made for its uid only.
const DEVICES: [(&str, u32); 3] = [
    ("/dev/kvm", 0o600),
    ("/dev/urandom", 0o666),
    ("/dev/null", 0o666),
];
/// Only a VMM with a network opens taps.
const TUN: (&str, u32) = ("/dev/net/tun", 0o600);

/// One step of building the jail's root before `pivot_root` (paths under it).
enum Step {
    Dir(CString),
    /// An empty file to bind a file onto.
    File(CString),
    Bind {
        src: CString,
        dst: CString,
    },
    /// An empty tmpfs of root's at a staged directory.
    Staged(CString),
    Device {
        path: CString,
        mode: u32,
        rdev: u64,
    },
}

/// How a path is exposed when the jail is built.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Writable,
    ReadOnly,
    Staged,
}

/// A bind to remount after `pivot_root` (at its path in the jail) with
/// `nosuid`, `nodev` and `ro` (read-only ones) or `noexec` (writable ones).
struct Remount {
    path: CString,
    read_only: bool,
}

/// Everything the child needs, made before the clone.
struct Prepared {
    /// The VMM's directory, which it gets to own.
    vm_dir: CString,
    /// An empty directory in it where the jail's root (a tmpfs) is mounted.
    root: CString,
    tmpfs_options: CString,
    staged_options: CString,
    steps: Vec<Step>,
    proc_dir: CString,
    put_old: CString,
    old_in_jail: CString,
    remounts: Vec<Remount>,
    uid_base: u32,
    limits: Limits,
    cap_last: i32,
    /// `argv` and `envp` for execveat, NULL-terminated, pointing into the
    /// CStrings kept next to them.
    _args: Vec<CString>,
    argv: Vec<*const libc::c_char>,
    _env: Vec<CString>,
    envp: Vec<*const libc::c_char>,
}

/// The descriptors the child uses (all close-on-exec in the server).
struct Fds {
    exe: OwnedFd,
    stdin: OwnedFd,
    stdout: OwnedFd,
    stderr: OwnedFd,
    netns: Option<OwnedFd>,
    /// The child reads its host pid here (it is 1 in its own namespace).
    pid_rx: OwnedFd,
    /// The child reports a failed step here.
    err_tx: OwnedFd,
}

fn cstring(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in a path"))
}

fn cpath(path: &Path) -> io::Result<CString> {
    cstring(path.as_os_str().as_bytes())
}

/// `root` + `path` (an absolute path).
fn under(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// The variables a VMM may read from its environment; nothing else of the
/// server's environment (credentials, proxies) reaches it.
fn passed_env(name: &OsStr) -> bool {
    let name = name.as_bytes();
    name.starts_with(b"SANDFORK_VMM") || name == b"RUST_LOG" || name == b"RUST_BACKTRACE"
}

impl Prepared {
    fn new(
        jail: &Jail,
        binary: &Path,
        vm_dir: &Path,
        api_sock: &Path,
        networked: bool,
    ) -> io::Result<Prepared> {
        let root = vm_dir.join("jail");
        std::fs::create_dir(&root)?;
        let mut steps = Vec::new();
        let mut remounts = Vec::new();
        let mut made = std::collections::BTreeSet::new();
        let mut dirs_to = |steps: &mut Vec<Step>, path: &Path| -> io::Result<()> {
            let mut at = PathBuf::from("/");
            for c in path.components() {
                if let Component::Normal(c) = c {
                    at.push(c);
                    if made.insert(at.clone()) {
                        steps.push(Step::Dir(cpath(&under(&root, &at))?));
                    }
                }
            }
            Ok(())
        };
        // Shallow paths first: a deeper bind lands inside a shallower one.
        let mut exposed: Vec<(PathBuf, Kind)> =
            std::iter::once((vm_dir.to_owned(), Kind::Writable))
                .chain(jail.writable.iter().map(|p| (p.clone(), Kind::Writable)))
                .chain(jail.read_only.iter().map(|p| (p.clone(), Kind::ReadOnly)))
                .chain(jail.staged.iter().map(|p| (p.clone(), Kind::Staged)))
                .filter(|(p, _)| p.is_absolute() && p.exists())
                .collect();
        exposed.sort_by(|a, b| {
            (a.0.components().count(), &a.0).cmp(&(b.0.components().count(), &b.0))
        });
        exposed.dedup_by(|a, b| a.0 == b.0);
        for (path, kind) in &exposed {
            let target = under(&root, path);
            if *kind == Kind::Staged {
                dirs_to(&mut steps, path)?;
                steps.push(Step::Staged(cpath(&target)?));
                continue;
            }
            if path.is_dir() {
                dirs_to(&mut steps, path)?;
            } else {
                if let Some(parent) = path.parent() {
                    dirs_to(&mut steps, parent)?;
                }
                steps.push(Step::File(cpath(&target)?));
            }
            steps.push(Step::Bind {
                src: cpath(path)?,
                dst: cpath(&target)?,
            });
            remounts.push(Remount {
                path: cpath(path)?,
                read_only: *kind == Kind::ReadOnly,
            });
        }
        let devices = DEVICES.iter().chain(networked.then_some(&TUN));
        for (dev, mode) in devices {
            let dev = Path::new(dev);
            let meta = std::fs::metadata(dev)?;
            if !meta.file_type().is_char_device() {
                return Err(io::Error::other(format!("{} is no device", dev.display())));
            }
            dirs_to(&mut steps, dev.parent().unwrap_or(Path::new("/")))?;
            steps.push(Step::Device {
                path: cpath(&under(&root, dev))?,
                mode: *mode,
                rdev: meta.rdev(),
            });
        }
        dirs_to(&mut steps, Path::new("/proc"))?;
        dirs_to(&mut steps, Path::new("/old-root"))?;

        let args = vec![cpath(binary)?, cstring(b"--api-sock")?, cpath(api_sock)?];
        let env: Vec<CString> = std::env::vars_os()
            .filter(|(k, _)| passed_env(k))
            .map(|(k, v)| {
                let mut kv = k.as_bytes().to_vec();
                kv.push(b'=');
                kv.extend_from_slice(v.as_bytes());
                cstring(&kv)
            })
            .collect::<io::Result<_>>()?;
        let nul_terminated = |v: &[CString]| {
            v.iter()
                .map(|s| s.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect::<Vec<_>>()
        };
        let cap_last = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(63);
        Ok(Prepared {
            vm_dir: cpath(vm_dir)?,
            tmpfs_options: cstring(b"mode=0755,size=1m,nr_inodes=4096")?,
            // Empty files and directories to bind onto, a few per call.
            staged_options: cstring(b"mode=0755,size=64k,nr_inodes=65536")?,
            proc_dir: cpath(&under(&root, Path::new("/proc")))?,
            put_old: cpath(&under(&root, Path::new("/old-root")))?,
            old_in_jail: cstring(b"/old-root")?,
            root: cpath(&root)?,
            steps,
            remounts,
            uid_base: jail.uid_base,
            limits: jail.limits,
            cap_last,
            argv: nul_terminated(&args),
            _args: args,
            envp: nul_terminated(&env),
            _env: env,
        })
    }
}

/// What went wrong in the child, by step: the step's index in [`STEPS`].
const STEPS: [&str; 15] = [
    "reading its pid",
    "joining its network namespace",
    "starting a session",
    "redirecting its standard descriptors",
    "making its mounts private",
    "mounting its root",
    "building its root",
    "mounting /proc",
    "pivot_root into its root",
    "remounting its binds",
    "setting its resource limits",
    "dropping its capabilities",
    "switching to its uid",
    "closing inherited descriptors",
    "executing the VMM",
];

/// A jailed VMM the server started: a child of the server, not a
/// `std::process::Child` (std cannot clone into new namespaces).
#[derive(Debug)]
pub(crate) struct JailedChild {
    pid: libc::pid_t,
    status: Option<std::process::ExitStatus>,
}

impl JailedChild {
    pub(crate) fn id(&self) -> u32 {
        self.pid as u32
    }

    /// Its exit status once it has ended (reaping it).
    pub(crate) fn try_wait(&mut self) -> io::Result<Option<std::process::ExitStatus>> {
        if self.status.is_some() {
            return Ok(self.status);
        }
        let mut raw = 0;
        // SAFETY: waitpid writes only the status int it is given.
        let rc = unsafe { libc::waitpid(self.pid, &mut raw, libc::WNOHANG) };
        match rc {
            0 => Ok(None),
            rc if rc == self.pid => {
                self.status = Some(std::os::unix::process::ExitStatusExt::from_raw(raw));
                Ok(self.status)
            }
            _ => Err(io::Error::last_os_error()),
        }
    }

    /// SIGKILLs it (it is pid 1 of its namespace: only SIGKILL from outside
    /// is sure to end it); not reaped, so its pid is still its own.
    pub(crate) fn kill(&mut self) {
        if self.status.is_none() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Starts `binary --api-sock <api_sock>` jailed in `vm_dir` (which it comes
/// to own), in the network namespace `netns` if given, with standard output
/// and error going to `stdout` and `stderr`. Blocks for the few
/// milliseconds the jail takes to build.
pub(crate) fn spawn(
    jail: &Jail,
    binary: &Path,
    vm_dir: &Path,
    api_sock: &Path,
    netns: Option<OwnedFd>,
    stdout: File,
    stderr: File,
) -> io::Result<JailedChild> {
    let prepared = Prepared::new(jail, binary, vm_dir, api_sock, netns.is_some())?;
    let (pid_rx, pid_tx) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let (err_rx, err_tx) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let fds = Fds {
        exe: File::open(binary)?.into(),
        stdin: File::open("/dev/null")?.into(),
        stdout: stdout.into(),
        stderr: stderr.into(),
        netns,
        pid_rx,
        err_tx,
    };
    let mut stack = vec![0u8; 256 * 1024];
    let flags = CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWPID | CloneFlags::CLONE_NEWIPC;
    let callback = Box::new(|| -> isize {
        let Err((step, errno)) = enter(&prepared, &fds);
        let report = [step, 0, 0, 0];
        let errno = (errno as i32).to_ne_bytes();
        let mut msg = [0u8; 8];
        msg[..4].copy_from_slice(&report);
        msg[4..].copy_from_slice(&errno);
        // SAFETY: write(2) of a stack buffer to a descriptor this child owns.
        unsafe { libc::write(fds.err_tx.as_raw_fd(), msg.as_ptr().cast(), msg.len()) };
        // SAFETY: _exit(2) ends this child at once, running nothing of the
        // parent's (no atexit handlers, no destructors).
        unsafe { libc::_exit(127) }
    });
    // SAFETY: the child is a copy of this process (no CLONE_VM) that runs
    // `callback` on `stack`: only system calls on data prepared above, no
    // allocation or locks (see `enter`), ending in exec or `_exit`.
    let pid = unsafe { nix::sched::clone(callback, &mut stack, flags, Some(libc::SIGCHLD)) }?;
    let mut child = JailedChild {
        pid: pid.as_raw(),
        status: None,
    };
    // Only the child writes to the error pipe: its end closes with its exec.
    drop(fds);
    let sent = nix::unistd::write(&pid_tx, &pid.as_raw().to_ne_bytes());
    drop(pid_tx);
    let mut msg = [0u8; 8];
    let read = read_full(&err_rx, &mut msg);
    match (sent, read) {
        (Ok(4), Ok(0)) => Ok(child),
        (_, Ok(8)) => {
            child.kill();
            let _ = reap(&mut child);
            let step = STEPS.get(usize::from(msg[0])).unwrap_or(&"?");
            let errno = i32::from_ne_bytes([msg[4], msg[5], msg[6], msg[7]]);
            Err(io::Error::other(format!(
                "jailing the VMM: {step}: {}",
                io::Error::from_raw_os_error(errno)
            )))
        }
        (sent, read) => {
            child.kill();
            let _ = reap(&mut child);
            Err(io::Error::other(format!(
                "jailing the VMM: the child's pipes failed ({sent:?}, {read:?})"
            )))
        }
    }
}

fn reap(child: &mut JailedChild) -> io::Result<()> {
    for _ in 0..2000 {
        if child.try_wait()?.is_some() {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    Ok(())
}

/// Reads until `buf` is full or the writers are gone; the bytes read.
fn read_full(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match nix::unistd::read(fd.as_fd(), &mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(got)
}

/// The child's side: builds the jail, enters it, drops privileges and
/// executes the VMM; returns only on failure, with the step that failed.
/// Async-signal-safe: system calls on `p` and `fds` only (nix's path
/// arguments are `CStr`s, passed through without copies).
fn enter(p: &Prepared, fds: &Fds) -> Result<std::convert::Infallible, (u8, Errno)> {
    let at = |step: u8| move |e: Errno| (step, e);
    let mut pid = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        // SAFETY: read(2) into the rest of a stack buffer.
        let n = unsafe {
            libc::read(
                fds.pid_rx.as_raw_fd(),
                pid[got..].as_mut_ptr().cast(),
                4 - got,
            )
        };
        match n {
            n if n > 0 => got += n as usize,
            0 => return Err((0, Errno::EPIPE)),
            _ if Errno::last() == Errno::EINTR => {}
            _ => return Err((0, Errno::last())),
        }
    }
    let host_pid = u32::from_ne_bytes(pid);
    let id = p.uid_base.checked_add(host_pid).ok_or((0, Errno::ERANGE))?;
    let (uid, gid) = (Uid::from_raw(id), Gid::from_raw(id));

    if let Some(ns) = &fds.netns {
        nix::sched::setns(ns, CloneFlags::CLONE_NEWNET).map_err(at(1))?;
    }
    nix::unistd::setsid().map_err(at(2))?;
    for (fd, to) in [(&fds.stdin, 0), (&fds.stdout, 1), (&fds.stderr, 2)] {
        // SAFETY: dup2(2) onto a standard descriptor of this child.
        Errno::result(unsafe { libc::dup2(fd.as_raw_fd(), to) }).map_err(at(3))?;
    }

    let none: Option<&std::ffi::CStr> = None;
    nix::mount::mount(
        none,
        c"/",
        none,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        none,
    )
    .map_err(at(4))?;
    nix::mount::mount(
        Some(c"tmpfs"),
        p.root.as_c_str(),
        Some(c"tmpfs"),
        MsFlags::MS_NOSUID,
        Some(p.tmpfs_options.as_c_str()),
    )
    .map_err(at(5))?;
    nix::unistd::chown(p.vm_dir.as_c_str(), Some(uid), Some(gid)).map_err(at(6))?;
    for step in &p.steps {
        match step {
            Step::Dir(path) => {
                match nix::unistd::mkdir(path.as_c_str(), Mode::from_bits_truncate(0o755)) {
                    Ok(()) | Err(Errno::EEXIST) => {}
                    Err(e) => return Err((6, e)),
                }
            }
            Step::File(path) => {
                let fd = nix::fcntl::open(
                    path.as_c_str(),
                    nix::fcntl::OFlag::O_CREAT
                        | nix::fcntl::OFlag::O_WRONLY
                        | nix::fcntl::OFlag::O_CLOEXEC,
                    Mode::from_bits_truncate(0o644),
                )
                .map_err(at(6))?;
                drop(fd);
            }
            Step::Bind { src, dst } => nix::mount::mount(
                Some(src.as_c_str()),
                dst.as_c_str(),
                none,
                // Not recursive: the jail's own root is mounted inside the
                // VMM's directory, and nothing else mounted below an exposed
                // directory is meant for it.
                MsFlags::MS_BIND,
                none,
            )
            .map_err(at(6))?,
            Step::Staged(path) => nix::mount::mount(
                Some(STAGED_SOURCE),
                path.as_c_str(),
                Some(c"tmpfs"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                Some(p.staged_options.as_c_str()),
            )
            .map_err(at(6))?,
            Step::Device { path, mode, rdev } => {
                nix::sys::stat::mknod(
                    path.as_c_str(),
                    SFlag::S_IFCHR,
                    Mode::from_bits_truncate(*mode),
                    *rdev,
                )
                .map_err(at(6))?;
                nix::unistd::chown(path.as_c_str(), Some(uid), Some(gid)).map_err(at(6))?;
            }
        }
    }
    // Its own PID namespace's /proc: it reads its own pagemap.
    nix::mount::mount(
        Some(c"proc"),
        p.proc_dir.as_c_str(),
        Some(c"proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        none,
    )
    .map_err(at(7))?;
    nix::unistd::pivot_root(p.root.as_c_str(), p.put_old.as_c_str()).map_err(at(8))?;
    nix::unistd::chdir(c"/").map_err(at(8))?;
    nix::mount::umount2(p.old_in_jail.as_c_str(), MntFlags::MNT_DETACH).map_err(at(8))?;
    // SAFETY: rmdir(2) of a path `p` owns.
    Errno::result(unsafe { libc::rmdir(p.old_in_jail.as_ptr()) }).map_err(at(8))?;
    let hardened = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    for r in &p.remounts {
        // Read-only binds hold the loader and libraries it maps executable;
        // nothing it can write may be executed.
        let flags = match r.read_only {
            true => hardened | MsFlags::MS_RDONLY,
            false => hardened | MsFlags::MS_NOEXEC,
        };
        nix::mount::mount(none, r.path.as_c_str(), none, flags, none).map_err(at(9))?;
    }
    // Its root itself takes no new files.
    nix::mount::mount(
        none,
        c"/",
        none,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID,
        none,
    )
    .map_err(at(9))?;

    let limits = [
        (libc::RLIMIT_NOFILE, p.limits.nofile),
        (libc::RLIMIT_NPROC, p.limits.nproc),
        // A core dump would hold its guest's memory.
        (libc::RLIMIT_CORE, 0),
    ];
    let fsize = p.limits.fsize.map(|f| (libc::RLIMIT_FSIZE, f));
    for (resource, value) in limits.into_iter().chain(fsize) {
        let limit = libc::rlimit {
            rlim_cur: value,
            rlim_max: value,
        };
        // SAFETY: setrlimit(2) reads the struct it is given.
        Errno::result(unsafe { libc::setrlimit(resource, &limit) }).map_err(at(10))?;
    }
    // New files readable by the other VMMs that load them (a fork's
    // children map its memory file), writable by this one only.
    nix::sys::stat::umask(Mode::from_bits_truncate(0o022));

    for cap in 0..=p.cap_last {
        // SAFETY: prctl(2) with integer arguments only.
        Errno::result(unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) })
            .map_err(at(11))?;
    }
    // SAFETY: prctl(2) with integer arguments only.
    Errno::result(unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    })
    .map_err(at(11))?;
    // The raw system calls, not libc's wrappers: in a process it believes
    // multi-threaded (this child is a copy of one), glibc's set*id signals
    // every thread it knows of to change too and waits for them: for ever,
    // as they are not in this process. The calls apply to this one thread,
    // the only one.
    let (uid, gid) = (uid.as_raw(), gid.as_raw());
    // SAFETY: setgroups(2) with an empty list reads no memory.
    Errno::result(unsafe {
        libc::syscall(libc::SYS_setgroups, 0usize, std::ptr::null::<libc::gid_t>())
    })
    .map_err(at(12))?;
    // SAFETY: setresgid(2) and setresuid(2) take integers only.
    Errno::result(unsafe { libc::syscall(libc::SYS_setresgid, gid, gid, gid) }).map_err(at(12))?;
    // Leaving uid 0 clears the permitted and effective capabilities.
    // SAFETY: as above.
    Errno::result(unsafe { libc::syscall(libc::SYS_setresuid, uid, uid, uid) }).map_err(at(12))?;
    nix::sys::prctl::set_no_new_privs().map_err(at(12))?;

    // Rust ignores SIGPIPE; the VMM starts with the default, as a spawn
    // through std would give it, and with no signal blocked.
    // SAFETY: sigaction(2) with the default disposition.
    unsafe {
        nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGPIPE,
            nix::sys::signal::SigHandler::SigDfl,
        )
    }
    .map_err(at(14))?;
    nix::sys::signal::SigSet::empty()
        .thread_set_mask()
        .map_err(at(14))?;
    // Every descriptor but 0-2 closes at the exec, the ones this child
    // inherited from the server's other threads included.
    // SAFETY: close_range(2) with integer arguments only.
    Errno::result(unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    })
    .map_err(at(13))?;
    // SAFETY: execveat(2) of the binary's descriptor, with argument and
    // environment vectors that are NULL-terminated arrays of pointers to
    // CStrings `p` owns.
    unsafe {
        libc::syscall(
            libc::SYS_execveat,
            fds.exe.as_raw_fd(),
            c"".as_ptr(),
            p.argv.as_ptr(),
            p.envp.as_ptr(),
            libc::AT_EMPTY_PATH,
        )
    };
    Err((14, Errno::last()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_loader_and_libraries_of_a_dynamic_binary() {
        let libs = shared_libraries(Path::new("/bin/sh"));
        if libs.is_empty() {
            // A static /bin/sh (or no ldd) needs nothing.
            return;
        }
        assert!(
            libs.iter().all(|p| p.is_absolute() && p.exists()),
            "{libs:?}"
        );
        assert!(
            libs.iter()
                .any(|p| p.to_string_lossy().contains("ld-linux")),
            "{libs:?}"
        );
    }

    #[test]
    fn passes_only_the_vmm_s_own_variables() {
        assert!(passed_env(OsStr::new("RUST_LOG")));
        assert!(passed_env(OsStr::new("SANDFORK_VMM_SECCOMP_SELF_TEST")));
        assert!(!passed_env(OsStr::new("AWS_SECRET_ACCESS_KEY")));
        assert!(!passed_env(OsStr::new("SANDFORK_S3")));
    }
}

/// Root-only: the real VMM binary jailed (it answers its API without a
/// guest, so no KVM that boots Linux is needed).
#[cfg(test)]
mod spawn_tests {
    use super::super::VmmProcess;
    use super::*;

    pub(super) fn vmm_binary() -> PathBuf {
        if let Ok(p) = std::env::var("SANDFORK_VMM") {
            return p.into();
        }
        // target/debug/deps/<test> -> target/debug/sandfork-vmm
        let exe = std::env::current_exe().unwrap();
        exe.parent().unwrap().parent().unwrap().join("sandfork-vmm")
    }

    fn status_field(pid: u32, key: &str) -> String {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap_or_else(|| panic!("no {key} in {status}"))
            .trim()
            .to_owned()
    }

    /// Many at once from a process of many threads (blocking tasks), as the node's pool
    /// starts them: no child may wait on a lock or thread of the server.
    #[tokio::test]
    async fn jailed_vmms_start_concurrently() {
        if !nix::unistd::geteuid().is_root() || !vmm_binary().exists() {
            eprintln!("skipped: needs root and {}", vmm_binary().display());
            return;
        }
        let base = tempfile::tempdir().unwrap();
        let jail = Jail::new(1_000_000_000, vec![], vec![], &vmm_binary());
        let started = std::time::Instant::now();
        let spawns = (0..16).map(|i| {
            let (jail, dir) = (jail.clone(), base.path().join(format!("vm{i}")));
            tokio::spawn(async move {
                VmmProcess::spawn_jailed(&vmm_binary(), dir, None, &jail)
                    .await
                    .unwrap()
            })
        });
        let mut vms = Vec::new();
        for s in spawns {
            vms.push(
                tokio::time::timeout(std::time::Duration::from_secs(60), s)
                    .await
                    .unwrap()
                    .unwrap(),
            );
        }
        eprintln!("16 jailed VMMs answering after {:?}", started.elapsed());
        for vm in &vms {
            vm.api().get_instance_info().await.unwrap();
        }
    }

    #[tokio::test]
    async fn a_jailed_vmm_is_unprivileged_in_its_own_namespaces_and_root() {
        if !nix::unistd::geteuid().is_root() || !vmm_binary().exists() {
            eprintln!("skipped: needs root and {}", vmm_binary().display());
            return;
        }
        let base = tempfile::tempdir().unwrap();
        let shared = base.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::write(shared.join("f"), "x").unwrap();
        let hidden = base.path().join("hidden");
        std::fs::create_dir(&hidden).unwrap();
        let jail = Jail::new(1_000_000_000, vec![], vec![shared.clone()], &vmm_binary());
        let dir = base.path().join("vm");
        let vm = VmmProcess::spawn_jailed(&vmm_binary(), dir.clone(), None, &jail)
            .await
            .unwrap();
        vm.api().get_instance_info().await.unwrap();
        let pid = vm.pid();
        let id = 1_000_000_000 + pid;
        assert_eq!(vm.owner(), Some((id, id)));
        assert_eq!(status_field(pid, "Uid:"), format!("{id}\t{id}\t{id}\t{id}"));
        assert_eq!(status_field(pid, "Gid:"), format!("{id}\t{id}\t{id}\t{id}"));
        assert_eq!(status_field(pid, "Groups:"), "");
        assert_eq!(status_field(pid, "CapEff:"), "0000000000000000");
        assert_eq!(status_field(pid, "CapPrm:"), "0000000000000000");
        assert_eq!(status_field(pid, "CapBnd:"), "0000000000000000");
        assert_eq!(status_field(pid, "NoNewPrivs:"), "1");
        // The API thread filters itself at its start (the main thread once
        // a VM is built, which this one never is: see the VMM's seccomp
        // module).
        let filtered = std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.unwrap().path().join("status")).ok())
            .filter(|s| s.lines().any(|l| l == "Seccomp:\t2"))
            .count();
        assert!(filtered >= 1, "no thread of {pid} under seccomp");
        assert_eq!(status_field(pid, "NSpid:"), format!("{pid}\t1"));
        for ns in ["mnt", "pid", "ipc"] {
            let theirs = std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).unwrap();
            let ours = std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap();
            assert_ne!(theirs, ours, "{ns}");
        }
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
        for (name, value) in [
            ("Max open files", "4096"),
            ("Max processes", "512"),
            ("Max core file size", "0"),
        ] {
            let line = limits.lines().find(|l| l.starts_with(name)).unwrap();
            let fields: Vec<&str> = line[name.len()..].split_whitespace().collect();
            assert_eq!(&fields[..2], [value, value], "{line}");
        }
        // Its root: its own directory, what it was given, its devices.
        let root = PathBuf::from(format!("/proc/{pid}/root"));
        assert!(under(&root, &dir).join("api.sock").exists());
        assert_eq!(
            std::fs::read_to_string(under(&root, &shared).join("f")).unwrap(),
            "x"
        );
        assert!(!under(&root, &hidden).exists());
        assert!(!root.join("etc").exists());
        let mut devices: Vec<_> = std::fs::read_dir(root.join("dev"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        devices.sort();
        assert_eq!(devices, ["kvm", "null", "urandom"]);
        assert_eq!(std::fs::metadata(root.join("dev/kvm")).unwrap().uid(), id);
        // Only its standard descriptors (and what it opened itself).
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap();
        for fd in fds {
            let target = std::fs::read_link(fd.unwrap().path()).unwrap();
            let target = target.to_string_lossy();
            assert!(
                !target.contains("pipe:") || target.is_empty(),
                "an inherited descriptor: {target}"
            );
        }
        drop(vm);
        assert!(!dir.exists());
    }
}

/// Root-only: what a jailed VMM sees of its staged directories.
#[cfg(test)]
mod staged_tests {
    use super::super::{Handed, Lineage, ProcessError, VmmProcess};
    use super::spawn_tests::vmm_binary;
    use super::*;

    fn listing(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    fn mounts(pid: u32) -> usize {
        std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
            .unwrap()
            .lines()
            .count()
    }

    #[tokio::test]
    async fn a_jailed_vmm_sees_only_what_it_is_handed() {
        if !nix::unistd::geteuid().is_root() || !vmm_binary().exists() {
            eprintln!("skipped: needs root and {}", vmm_binary().display());
            return;
        }
        let base = tempfile::tempdir().unwrap();
        // The data dir through a link of the host's: disk chains are read
        // canonical and must still land at the paths the jail shows.
        std::fs::create_dir(base.path().join("real")).unwrap();
        std::os::unix::fs::symlink("real", base.path().join("data")).unwrap();
        let (sandboxes, templates) = (
            base.path().join("data/sandboxes"),
            base.path().join("data/templates"),
        );
        let (mine, theirs) = (sandboxes.join("mine"), sandboxes.join("theirs"));
        for d in [&mine, &theirs, &templates.join("t"), &mine.join("out")] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(theirs.join("mem"), "a neighbour's memory").unwrap();
        std::fs::write(mine.join("other"), "not handed").unwrap();
        let rootfs = templates.join("t/rootfs.img");
        std::fs::write(&rootfs, vec![0u8; 1 << 20]).unwrap();
        let top = mine.join("root.layer");
        drop(disk_layers::LayeredDisk::create(&rootfs, &top).unwrap());
        std::os::unix::fs::symlink("/etc/passwd", mine.join("out/link")).unwrap();

        let jail = Jail::new(1_000_000_000, vec![], vec![], &vmm_binary())
            .with_staged(vec![sandboxes.clone(), templates.clone()]);
        let dir = base.path().join("vm");
        let vm = VmmProcess::spawn_jailed(&vmm_binary(), dir.clone(), None, &jail)
            .await
            .unwrap();
        let pid = vm.pid();
        let root = PathBuf::from(format!("/proc/{pid}/root"));
        let inside = |p: &Path| under(&root, p);
        // Empty until something is handed.
        assert!(listing(&inside(&sandboxes)).is_empty());
        assert!(listing(&inside(&templates)).is_empty());
        // Nothing of them was written on the host's side.
        assert_eq!(listing(&sandboxes), ["mine", "theirs"]);

        let handed = || Handed::default().disk(&top, true).write(mine.join("out"));
        let t = std::time::Instant::now();
        vm.give(handed()).await.unwrap();
        eprintln!(
            "a disk of two layers and a directory handed in {:?}",
            t.elapsed()
        );
        assert_eq!(listing(&inside(&sandboxes)), ["mine"]);
        assert_eq!(listing(&inside(&mine)), ["out", "root.layer"]);
        assert_eq!(listing(&inside(&templates)), ["t"]);
        assert_eq!(listing(&inside(&templates.join("t"))), ["rootfs.img"]);
        // Its top layer and destination are its own and writable; the
        // parent layer it only reads.
        let id = 1_000_000_000 + pid;
        assert_eq!(std::fs::metadata(&top).unwrap().uid(), id);
        let write = |p: &Path| std::fs::OpenOptions::new().write(true).open(p);
        assert!(write(&inside(&top)).is_ok());
        let denied = write(&inside(&rootfs)).unwrap_err();
        assert_eq!(denied.raw_os_error(), Some(libc::EROFS), "{denied}");
        std::fs::write(inside(&mine.join("out/written")), "by the VMM").unwrap();
        assert_eq!(
            std::fs::read_to_string(mine.join("out/written")).unwrap(),
            "by the VMM"
        );
        // Handing the same again binds nothing more.
        let before = mounts(pid);
        vm.give(handed()).await.unwrap();
        assert_eq!(mounts(pid), before);
        // A link planted in a directory it writes leads nowhere.
        let planted = vm.give(Handed::default().read(mine.join("out/link"))).await;
        assert!(planted.is_err());
        assert!(!inside(Path::new("/etc/passwd")).exists());

        // The host saw no mount: the binds live in the VMM's namespace.
        let host = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!host.contains(STAGED_SOURCE.to_str().unwrap()));
        assert!(!host.contains(base.path().to_str().unwrap()), "{host}");
        drop(vm);
        assert!(!dir.exists());
        assert!(top.exists() && rootfs.exists() && theirs.join("mem").exists());
    }

    #[tokio::test]
    async fn a_jailed_vmm_is_handed_nothing_outside_its_guests_lineage() {
        if !nix::unistd::geteuid().is_root() || !vmm_binary().exists() {
            eprintln!("skipped: needs root and {}", vmm_binary().display());
            return;
        }
        let base = tempfile::tempdir().unwrap();
        let (sandboxes, templates) = (base.path().join("sandboxes"), base.path().join("templates"));
        let (mine, theirs) = (sandboxes.join("mine"), sandboxes.join("theirs"));
        for d in [&mine, &theirs, &templates.join("t")] {
            std::fs::create_dir_all(d).unwrap();
        }
        let rootfs = templates.join("t/rootfs.img");
        std::fs::write(&rootfs, vec![0u8; 1 << 20]).unwrap();
        std::fs::write(theirs.join("secret.img"), vec![7u8; 1 << 20]).unwrap();
        std::fs::write(theirs.join("vm.mem"), "a neighbour's memory").unwrap();
        // As a VMM taken over could leave them: a layer whose header names a
        // neighbour's file as its parent, a state naming a neighbour's memory.
        let forged_top = mine.join("forged.layer");
        drop(disk_layers::LayeredDisk::create(&theirs.join("secret.img"), &forged_top).unwrap());
        let forged_state = mine.join("forged.state");
        let their_mem = theirs.join("vm.mem");
        crate::snapshot_state::test_support::state_file(
            &forged_state,
            &[their_mem.to_str().unwrap()],
        )
        .unwrap();
        let top = mine.join("root.layer");
        drop(disk_layers::LayeredDisk::create(&rootfs, &top).unwrap());

        let jail = Jail::new(1_000_000_000, vec![], vec![], &vmm_binary())
            .with_staged(vec![sandboxes.clone(), templates.clone()]);
        let dir = base.path().join("vm");
        let mut vm = VmmProcess::spawn_jailed(&vmm_binary(), dir.clone(), None, &jail)
            .await
            .unwrap();
        vm.set_lineage(Lineage::new([mine.clone(), templates.join("t")]));
        let inside = |p: &Path| under(&PathBuf::from(format!("/proc/{}/root", vm.pid())), p);
        let refused = |r: Result<(), ProcessError>, path: &Path, named_in: &str| match r {
            Err(ProcessError::OutsideLineage {
                path: p,
                named_in: n,
            }) => {
                assert_eq!(p, path);
                assert_eq!(n, named_in);
            }
            other => panic!("{other:?}"),
        };

        let forged = vm.give(Handed::for_guest().disk(&forged_top, true)).await;
        refused(
            forged,
            &theirs.join("secret.img"),
            forged_top.to_str().unwrap(),
        );
        let forged = vm.give(Handed::for_guest().snapshot(&forged_state)).await;
        refused(forged, &their_mem, forged_state.to_str().unwrap());
        let asked = vm.give(Handed::for_guest().read(&their_mem)).await;
        refused(asked, &their_mem, "the request");
        // A missing file outside it binds nothing, and is not bound later.
        let gone = theirs.join("gone.mem");
        let stale = mine.join("stale.state");
        crate::snapshot_state::test_support::state_file(&stale, &[gone.to_str().unwrap()]).unwrap();
        vm.give(Handed::for_guest().snapshot(&stale)).await.unwrap();
        std::fs::write(&gone, "made afterwards").unwrap();
        vm.give(Handed::for_guest().read(mine.join("stale.state")))
            .await
            .unwrap();
        assert!(!inside(&gone).exists());
        // Refused whole: nothing was exposed or made the VMM's (but the
        // stale state, in its own directory).
        assert_eq!(listing(&inside(&sandboxes)), ["mine"]);
        assert_eq!(listing(&inside(&mine)), ["stale.state"]);
        assert_eq!(std::fs::metadata(&forged_top).unwrap().uid(), 0);

        // Its own disk, on its template, is handed.
        vm.give(Handed::for_guest().disk(&top, true)).await.unwrap();
        assert_eq!(listing(&inside(&mine)), ["root.layer", "stale.state"]);
        assert_eq!(listing(&inside(&templates.join("t"))), ["rootfs.img"]);
        // What the server names for calls that are not a load (a fork's or
        // snapshot's destination) is not a guest's: no lineage applies.
        vm.give(Handed::default().write(theirs.join("out")))
            .await
            .unwrap();
        drop(vm);
        assert!(!dir.exists());
    }
}

//! Building the lab machine's kernel and initramfs, cached by content hash.
//!
//! Layout under `<cache>/lab/`:
//! - `<hash>/vmlinuz`, `<hash>/initramfs.cpio`, `<hash>/manifest`: one lab, made in
//!   a temporary sibling directory and renamed into place whole;
//! - `last`: "<hash> <local key>" of the lab prepared last, reused without
//!   asking apt while busybox and the init script are unchanged.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::cpio::CpioWriter;
use crate::elf;
use crate::error::{LabError, Result};
use crate::modules::{LAB_MODULES, ModuleTree};

/// Bumped whenever the initramfs layout changes in a way the hash cannot see.
const FORMAT: &str = "sandfork-lab initramfs v1";
/// Debian's generic kernel: unlike `-cloud-amd64` it has 9p as modules.
const KERNEL_META_PACKAGE: &str = "linux-image-amd64";
pub(crate) const INIT_SCRIPT: &str = include_str!("init.sh");

/// The files of a prepared lab.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabPaths {
    pub dir: PathBuf,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    pub manifest: PathBuf,
}

impl LabPaths {
    fn in_dir(dir: PathBuf) -> Self {
        LabPaths {
            kernel: dir.join("vmlinuz"),
            initramfs: dir.join("initramfs.cpio"),
            manifest: dir.join("manifest"),
            dir,
        }
    }

    fn complete(&self) -> bool {
        self.kernel.is_file() && self.initramfs.is_file() && self.manifest.is_file()
    }
}

/// `${SANDFORK_CACHE:-/var/cache/sandfork}`.
pub fn default_cache_dir() -> PathBuf {
    std::env::var_os("SANDFORK_CACHE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/sandfork"))
}

/// Where the kernel comes from.
enum KernelSource {
    /// A package to fetch with `apt-get download`, e.g. linux-image-6.1.0-57-amd64.
    Apt {
        package: String,
        version: String,
        sha256: String,
    },
    /// A .deb given by SANDFORK_LAB_KERNEL_DEB.
    Deb { path: PathBuf, sha256: String },
}

impl KernelSource {
    fn key(&self) -> String {
        match self {
            KernelSource::Apt {
                package,
                version,
                sha256,
            } => format!("apt {package}={version} {sha256}"),
            KernelSource::Deb { sha256, .. } => format!("deb {sha256}"),
        }
    }
}

/// Runs a tool to completion, mapping "not installed" and failures to errors.
fn run_tool(mut cmd: Command, package: &'static str) -> Result<std::process::Output> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let described = format!(
        "{program} {}",
        cmd.get_args()
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let out = cmd.output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            LabError::ToolMissing {
                program: program.clone(),
                package,
            }
        } else {
            LabError::io(format!("run {described}"), e)
        }
    })?;
    if !out.status.success() {
        return Err(LabError::ToolFailed {
            command: described,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(out)
}

/// The first `Depends:` of `apt-cache depends` output.
fn parse_depends(text: &str) -> Option<String> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends:"))
        .map(|p| p.trim().to_string())
        .find(|p| !p.is_empty() && !p.starts_with('<'))
}

/// A field of `apt-cache show` output (first stanza).
fn parse_field(text: &str, field: &str) -> Option<String> {
    let prefix = format!("{field}:");
    text.lines()
        .take_while(|l| !l.is_empty())
        .find_map(|l| l.strip_prefix(&prefix))
        .map(|v| v.trim().to_string())
}

fn resolve_kernel() -> Result<KernelSource> {
    if let Some(deb) = std::env::var_os("SANDFORK_LAB_KERNEL_DEB").filter(|v| !v.is_empty()) {
        let path = PathBuf::from(deb);
        let bytes = std::fs::read(&path)
            .map_err(|e| LabError::io(format!("read {}", path.display()), e))?;
        return Ok(KernelSource::Deb {
            sha256: hex(&Sha256::digest(&bytes)),
            path,
        });
    }
    let mut cmd = Command::new("apt-cache");
    cmd.args(["depends", KERNEL_META_PACKAGE]);
    let out = run_tool(cmd, "apt")?;
    let package = parse_depends(&String::from_utf8_lossy(&out.stdout)).ok_or_else(|| {
        LabError::KernelPackage(format!(
            "apt-cache depends {KERNEL_META_PACKAGE} names no kernel (run apt-get update?)"
        ))
    })?;
    let mut cmd = Command::new("apt-cache");
    cmd.args(["show", "--no-all-versions", &package]);
    let out = run_tool(cmd, "apt")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |f: &str| {
        parse_field(&text, f)
            .ok_or_else(|| LabError::KernelPackage(format!("apt-cache show {package}: no {f}")))
    };
    Ok(KernelSource::Apt {
        version: field("Version")?,
        sha256: field("SHA256")?,
        package,
    })
}

fn find_busybox() -> Result<(PathBuf, Vec<u8>)> {
    let candidates: Vec<PathBuf> = match std::env::var_os("SANDFORK_LAB_BUSYBOX") {
        Some(p) if !p.is_empty() => vec![PathBuf::from(p)],
        _ => vec!["/bin/busybox".into(), "/usr/bin/busybox".into()],
    };
    let path = candidates
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| LabError::ToolMissing {
            program: "busybox".into(),
            package: "busybox-static",
        })?;
    let bytes =
        std::fs::read(&path).map_err(|e| LabError::io(format!("read {}", path.display()), e))?;
    if elf::is_static(&bytes) != Some(true) {
        return Err(LabError::BusyboxNotStatic { path });
    }
    Ok((path, bytes))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The part of the cache key known without asking apt: busybox, the init
/// script, the module list and the format.
fn local_key(busybox: &[u8]) -> String {
    let mut h = Sha256::new();
    for part in [
        FORMAT.as_bytes(),
        &Sha256::digest(busybox),
        INIT_SCRIPT.as_bytes(),
        LAB_MODULES.join(",").as_bytes(),
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    hex(&h.finalize())[..16].to_string()
}

/// The cache key: everything that decides the lab's bytes.
fn lab_hash(kernel_key: &str, local_key: &str) -> String {
    let mut h = Sha256::new();
    for part in [kernel_key, local_key] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    hex(&h.finalize())[..16].to_string()
}

/// `last` holds "<hash> <local key>" of the lab prepared last.
fn read_last(lab_dir: &Path, local: &str) -> Option<LabPaths> {
    let text = std::fs::read_to_string(lab_dir.join("last")).ok()?;
    let mut words = text.split_whitespace();
    let (hash, key) = (words.next()?, words.next()?);
    let paths = LabPaths::in_dir(lab_dir.join(hash));
    (key == local && !hash.contains('/') && paths.complete()).then_some(paths)
}

/// Finds the prepared lab under `cache_dir`, or builds it. Unless `refresh`,
/// the lab prepared last is reused without asking apt when busybox and the
/// init script are unchanged; `refresh` picks up a newer kernel package.
pub fn prepare(cache_dir: &Path, refresh: bool) -> Result<LabPaths> {
    let lab_dir = cache_dir.join("lab");
    let (_, busybox) = find_busybox()?;
    let local = local_key(&busybox);
    let last = read_last(&lab_dir, &local);
    if !refresh && let Some(paths) = last {
        return Ok(paths);
    }
    let kernel = match resolve_kernel() {
        Ok(k) => k,
        // Offline or no apt lists: the last lab still works.
        Err(e) => return last.ok_or(e),
    };
    let hash = lab_hash(&kernel.key(), &local);
    let paths = LabPaths::in_dir(lab_dir.join(&hash));
    if !paths.complete() {
        std::fs::create_dir_all(&lab_dir)
            .map_err(|e| LabError::io(format!("create {}", lab_dir.display()), e))?;
        let tmp = tempfile::Builder::new()
            .prefix(&format!(".build-{hash}-"))
            .tempdir_in(&lab_dir)
            .map_err(|e| LabError::io(format!("create a directory in {}", lab_dir.display()), e))?;
        build(tmp.path(), &kernel, &busybox)?;
        let built = tmp.keep();
        if let Err(e) = std::fs::rename(&built, &paths.dir) {
            let _ = std::fs::remove_dir_all(&built);
            // Another process may have finished the same lab first.
            if !paths.complete() {
                return Err(LabError::io(
                    format!("rename into {}", paths.dir.display()),
                    e,
                ));
            }
        }
    }
    let _ = std::fs::write(lab_dir.join("last"), format!("{hash} {local}\n"));
    Ok(paths)
}

/// Fetches and unpacks the kernel, then writes vmlinuz, initramfs.cpio and
/// manifest into `out`.
fn build(out: &Path, kernel: &KernelSource, busybox: &[u8]) -> Result<()> {
    let deb = match kernel {
        KernelSource::Deb { path, .. } => path.clone(),
        KernelSource::Apt {
            package, version, ..
        } => {
            let mut cmd = Command::new("apt-get");
            cmd.args(["download", "-q", &format!("{package}={version}")])
                .current_dir(out);
            run_tool(cmd, "apt")?;
            find_deb(out)?
        }
    };
    let root = out.join("root");
    let mut cmd = Command::new("dpkg-deb");
    cmd.arg("-x").arg(&deb).arg(&root);
    run_tool(cmd, "dpkg")?;

    let release = only_entry(&root.join("lib/modules"))?;
    let vmlinuz = root.join("boot").join(format!("vmlinuz-{release}"));
    std::fs::copy(&vmlinuz, out.join("vmlinuz"))
        .map_err(|e| LabError::io(format!("copy {}", vmlinuz.display()), e))?;

    let tree = ModuleTree::open(&root.join("lib/modules").join(&release))?;
    let order = tree.load_order(LAB_MODULES)?;

    let file = std::fs::File::create(out.join("initramfs.cpio"))
        .map_err(|e| LabError::io("create initramfs.cpio", e))?;
    let io = |e| LabError::io("write initramfs.cpio", e);
    let mut w = CpioWriter::new(std::io::BufWriter::new(file));
    for d in ["bin", "dev", "lib", "lib/modules"] {
        w.dir(d).map_err(io)?;
    }
    w.char_dev("dev/console", 0o600, 5, 1).map_err(io)?;
    w.file("bin/busybox", 0o755, busybox).map_err(io)?;
    w.file("init", 0o755, INIT_SCRIPT.as_bytes()).map_err(io)?;
    let mut order_list = String::new();
    for path in &order {
        let name =
            path.file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| LabError::BadModule {
                    path: path.clone(),
                    reason: "file name is not UTF-8".into(),
                })?;
        let bytes =
            std::fs::read(path).map_err(|e| LabError::io(format!("read {}", path.display()), e))?;
        w.file(&format!("lib/modules/{name}"), 0o644, &bytes)
            .map_err(io)?;
        order_list.push_str(name);
        order_list.push('\n');
    }
    w.file("lib/modules/order", 0o644, order_list.as_bytes())
        .map_err(io)?;
    let mut buf = w.finish().map_err(io)?;
    buf.flush().map_err(io)?;

    let manifest = format!(
        "{FORMAT}\nkernel: {}\nrelease: {release}\nmodules: {}\n",
        kernel.key(),
        order_list.trim_end().replace('\n', " ")
    );
    std::fs::write(out.join("manifest"), manifest)
        .map_err(|e| LabError::io("write manifest", e))?;

    // The unpacked package and the .deb are large and no longer needed.
    std::fs::remove_dir_all(&root).map_err(|e| LabError::io("remove the unpacked kernel", e))?;
    if matches!(kernel, KernelSource::Apt { .. }) {
        std::fs::remove_file(&deb).map_err(|e| LabError::io("remove the kernel .deb", e))?;
    }
    Ok(())
}

fn find_deb(dir: &Path) -> Result<PathBuf> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| LabError::io(format!("read {}", dir.display()), e))?;
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| {
            LabError::KernelPackage(format!(
                "apt-get download left no .deb in {}",
                dir.display()
            ))
        })
}

/// The single entry of a directory (the kernel release under lib/modules).
fn only_entry(dir: &Path) -> Result<String> {
    let names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| LabError::io(format!("read {}", dir.display()), e))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    match &names[..] {
        [one] => Ok(one.clone()),
        _ => Err(LabError::KernelPackage(format!(
            "expected one kernel release in {}, found {names:?}",
            dir.display()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apt_output_parses() {
        let depends = "linux-image-amd64\n  Depends: linux-image-6.1.0-57-amd64\n";
        assert_eq!(
            parse_depends(depends).as_deref(),
            Some("linux-image-6.1.0-57-amd64")
        );
        assert_eq!(parse_depends("linux-image-amd64\n"), None);
        let show = "Package: linux-image-6.1.0-57-amd64\nVersion: 6.1.192-3\nSHA256: abc\n\nPackage: x\nVersion: 9\n";
        assert_eq!(parse_field(show, "Version").as_deref(), Some("6.1.192-3"));
        assert_eq!(parse_field(show, "SHA256").as_deref(), Some("abc"));
        assert_eq!(parse_field(show, "Missing"), None);
    }

    #[test]
    fn hash_depends_on_every_input() {
        let local = local_key(b"busybox");
        assert_ne!(local, local_key(b"busybox2"));
        let a = lab_hash("apt k=1 x", &local);
        assert_eq!(a.len(), 16);
        assert_eq!(a, lab_hash("apt k=1 x", &local));
        assert_ne!(a, lab_hash("apt k=2 x", &local));
        assert_ne!(a, lab_hash("apt k=1 x", &local_key(b"busybox2")));
    }

    #[test]
    fn last_is_reused_only_for_the_same_local_key() {
        let d = tempfile::tempdir().unwrap();
        let lab = d.path();
        std::fs::create_dir(lab.join("abc")).unwrap();
        for f in ["vmlinuz", "initramfs.cpio", "manifest"] {
            std::fs::write(lab.join("abc").join(f), "").unwrap();
        }
        std::fs::write(lab.join("last"), "abc k1\n").unwrap();
        assert_eq!(read_last(lab, "k1").unwrap().dir, lab.join("abc"));
        assert!(read_last(lab, "k2").is_none());
        std::fs::remove_file(lab.join("abc/manifest")).unwrap();
        assert!(read_last(lab, "k1").is_none());
    }

    #[test]
    fn init_script_is_valid_sh() {
        let out = Command::new("/bin/sh")
            .args(["-n", "-c", INIT_SCRIPT])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

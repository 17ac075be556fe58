//! Kernel modules for the lab's initramfs: finding them in an extracted kernel
//! package and ordering them so each loads after its dependencies.
//!
//! The .deb carries no modules.dep (depmod makes it at install time, and kmod is
//! not on every host), so dependencies come from each module's own `.modinfo`.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::elf;
use crate::error::{LabError, Result};

/// The modules the lab loads, by name; their dependencies come along.
pub const LAB_MODULES: &[&str] = &[
    "virtio_pci",
    "virtio_net",
    "virtio_blk",
    "virtio_console",
    "9pnet_virtio",
    "9p",
    "kvm_amd",
    "tun",
    // Sandbox networking (crates/network): slot veths, NAT and egress
    // policy in nftables (the rest of what its rules use is in nf_tables).
    "veth",
    // libcrc32c (under nf_tables) asks the crypto API for crc32c at load;
    // a soft dependency, not in `depends=`.
    "crc32c_generic",
    "nf_tables",
    "nft_ct",
    "nft_nat",
    "nft_masq",
    "nft_chain_nat",
    "nft_reject_inet",
    // The egress proxy asks a slot's conntrack where a connection was going.
    "nf_conntrack_netlink",
    // Image conversion (crates/template-build's layer store) applies each
    // layer to an ext4 image mounted through a loop device.
    "loop",
    "ext4",
];

/// The kernel's name for a module file: `kvm-amd.ko` is `kvm_amd`.
pub fn module_name(file_name: &str) -> Option<String> {
    let stem = file_name.strip_suffix(".ko")?;
    Some(stem.replace('-', "_"))
}

/// The `depends=` entry of a module's `.modinfo` section.
pub fn modinfo_depends(ko: &[u8]) -> Result<Vec<String>, String> {
    let info = elf::section(ko, ".modinfo").ok_or("no .modinfo section")?;
    for entry in info.split(|&c| c == 0) {
        if let Some(list) = entry.strip_prefix(b"depends=") {
            let list = std::str::from_utf8(list).map_err(|_| "depends= is not UTF-8")?;
            return Ok(list
                .split(',')
                .filter(|s| !s.is_empty())
                .map(|s| s.replace('-', "_"))
                .collect());
        }
    }
    Ok(Vec::new())
}

/// Orders `wanted` and all their dependencies so that each comes after what it
/// needs. `deps_of` answers for one module; None means built into the kernel.
pub fn resolve<F>(wanted: &[&str], mut deps_of: F) -> Result<Vec<String>>
where
    F: FnMut(&str) -> Result<Option<Vec<String>>>,
{
    let mut order = Vec::new();
    let mut done = HashSet::new();
    // Iterative depth-first search; `on_path` catches dependency cycles.
    for &root in wanted {
        let mut stack: Vec<(String, Option<std::vec::IntoIter<String>>)> =
            vec![(root.replace('-', "_"), None)];
        let mut on_path = HashSet::new();
        while let Some((name, children)) = stack.last_mut() {
            if children.is_none() {
                if done.contains(name.as_str()) {
                    stack.pop();
                    continue;
                }
                if !on_path.insert(name.clone()) {
                    return Err(LabError::BadConfig(format!(
                        "kernel module dependency cycle through {name}"
                    )));
                }
                match deps_of(name)? {
                    Some(deps) => *children = Some(deps.into_iter()),
                    None => {
                        // Built in: nothing to load.
                        let name = name.clone();
                        on_path.remove(&name);
                        done.insert(name);
                        stack.pop();
                        continue;
                    }
                }
            }
            let next = children.as_mut().and_then(|c| c.next());
            match next {
                Some(dep) => stack.push((dep, None)),
                None => {
                    let name = name.clone();
                    on_path.remove(&name);
                    done.insert(name.clone());
                    order.push(name);
                    stack.pop();
                }
            }
        }
    }
    Ok(order)
}

/// The modules of one extracted kernel: `<root>/lib/modules/<release>`.
pub struct ModuleTree {
    dir: PathBuf,
    by_name: HashMap<String, PathBuf>,
    builtin: HashSet<String>,
}

impl ModuleTree {
    pub fn open(dir: &Path) -> Result<Self> {
        let mut by_name = HashMap::new();
        let mut pending = vec![dir.join("kernel")];
        while let Some(d) = pending.pop() {
            let entries = std::fs::read_dir(&d)
                .map_err(|e| LabError::io(format!("read {}", d.display()), e))?;
            for entry in entries {
                let entry = entry.map_err(|e| LabError::io(format!("read {}", d.display()), e))?;
                let path = entry.path();
                let kind = entry
                    .file_type()
                    .map_err(|e| LabError::io(format!("stat {}", path.display()), e))?;
                if kind.is_dir() {
                    pending.push(path);
                } else if let Some(name) = entry.file_name().to_str().and_then(module_name) {
                    by_name.insert(name, path);
                }
            }
        }
        let builtin_file = dir.join("modules.builtin");
        let builtin = std::fs::read_to_string(&builtin_file)
            .map_err(|e| LabError::io(format!("read {}", builtin_file.display()), e))?
            .lines()
            .filter_map(|l| l.rsplit('/').next().and_then(module_name))
            .collect();
        Ok(ModuleTree {
            dir: dir.to_path_buf(),
            by_name,
            builtin,
        })
    }

    /// The files to load, in load order, for `wanted` and their dependencies.
    pub fn load_order(&self, wanted: &[&str]) -> Result<Vec<PathBuf>> {
        let names = resolve(wanted, |name| {
            let Some(path) = self.by_name.get(name) else {
                if self.builtin.contains(name) {
                    return Ok(None);
                }
                return Err(LabError::ModuleNotFound {
                    name: name.to_string(),
                    dir: self.dir.clone(),
                });
            };
            let bytes = std::fs::read(path)
                .map_err(|e| LabError::io(format!("read {}", path.display()), e))?;
            modinfo_depends(&bytes)
                .map(Some)
                .map_err(|reason| LabError::BadModule {
                    path: path.clone(),
                    reason,
                })
        })?;
        Ok(names
            .iter()
            .filter_map(|n| self.by_name.get(n).cloned())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(edges: &[(&str, &[&str])]) -> HashMap<String, Vec<String>> {
        edges
            .iter()
            .map(|(m, d)| (m.to_string(), d.iter().map(|s| s.to_string()).collect()))
            .collect()
    }

    fn order(g: &HashMap<String, Vec<String>>, wanted: &[&str]) -> Result<Vec<String>> {
        resolve(wanted, |n| Ok(g.get(n).cloned()))
    }

    #[test]
    fn dependencies_load_first_and_once() {
        // The shape of the real kvm_amd and 9p stacks.
        let g = graph(&[
            ("kvm_amd", &["ccp", "kvm", "irqbypass"]),
            ("kvm", &["irqbypass"]),
            ("irqbypass", &[]),
            ("ccp", &[]),
            ("9pnet_virtio", &["9pnet", "virtio", "virtio_ring"]),
            ("9pnet", &[]),
            ("virtio", &["virtio_ring"]),
            ("virtio_ring", &[]),
        ]);
        let o = order(&g, &["kvm-amd", "9pnet_virtio"]).unwrap();
        let pos = |m: &str| o.iter().position(|x| x == m).unwrap();
        assert_eq!(o.len(), 8);
        assert!(pos("irqbypass") < pos("kvm"));
        assert!(pos("kvm") < pos("kvm_amd"));
        assert!(pos("ccp") < pos("kvm_amd"));
        assert!(pos("virtio_ring") < pos("virtio"));
        assert!(pos("virtio") < pos("9pnet_virtio"));
    }

    #[test]
    fn builtin_modules_are_skipped() {
        let g = graph(&[("virtio_net", &["virtio"])]);
        // `virtio` is absent from the graph: built in.
        assert_eq!(order(&g, &["virtio_net"]).unwrap(), vec!["virtio_net"]);
    }

    #[test]
    fn cycles_are_errors() {
        let g = graph(&[("a", &["b"]), ("b", &["a"])]);
        assert!(order(&g, &["a"]).is_err());
    }

    #[test]
    fn names_normalise_dashes() {
        assert_eq!(module_name("kvm-amd.ko").as_deref(), Some("kvm_amd"));
        assert_eq!(module_name("9p.ko").as_deref(), Some("9p"));
        assert_eq!(module_name("vmlinuz"), None);
        assert_eq!(module_name("x.ko.xz"), None);
    }

    /// A minimal ELF64 file with sections: null, .shstrtab, .modinfo.
    fn fake_module(modinfo: &[u8]) -> Vec<u8> {
        let shstrtab = b"\0.shstrtab\0.modinfo\0";
        let mut b = vec![0u8; 64];
        b[..6].copy_from_slice(b"\x7fELF\x02\x01");
        let str_off = b.len();
        b.extend_from_slice(shstrtab);
        let info_off = b.len();
        b.extend_from_slice(modinfo);
        let shoff = b.len();
        b[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        b[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        b[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        b[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        for (name, off, size) in [
            (0u32, 0usize, 0usize),
            (1, str_off, shstrtab.len()),
            (11, info_off, modinfo.len()),
        ] {
            let mut h = [0u8; 64];
            h[..4].copy_from_slice(&name.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&(off as u64).to_le_bytes());
            h[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
            b.extend_from_slice(&h);
        }
        b
    }

    #[test]
    fn modinfo_depends_is_read_from_the_section() {
        let ko = fake_module(b"license=GPL\0depends=ccp,kvm,irq-bypass\0name=kvm_amd\0");
        assert_eq!(
            modinfo_depends(&ko).unwrap(),
            vec!["ccp", "kvm", "irq_bypass"]
        );
        let leaf = fake_module(b"license=GPL\0depends=\0name=irqbypass\0");
        assert!(modinfo_depends(&leaf).unwrap().is_empty());
    }

    #[test]
    fn modinfo_of_garbage_is_an_error() {
        assert!(modinfo_depends(b"nope").is_err());
    }
}

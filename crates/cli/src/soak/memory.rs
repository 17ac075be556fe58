//! The node's memory as this host's `/proc` shows it: the server's RSS and
//! Pss, the sum over its child processes (the VMMs, warm pool included) and
//! the host's `MemAvailable`, read through `sandfork-host-mem` as the bench
//! and the node's admission read them.
//!
//! The node does not say its pid (`GET /v1/node` reports capacity, not
//! processes), so it is `--server-pid`, or found from the node's URL: a
//! loopback port whose listening socket belongs to a `sandfork` process. A
//! node in the KVM lab is reached through QEMU's port forward: its processes
//! are the lab machine's, out of this host's sight, and that is said instead.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::{Value, json};

/// One reading of the node's memory, in KiB as `/proc` gives it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NodeMemory {
    pub server_rss_kib: u64,
    pub server_pss_kib: u64,
    pub vmm_processes: usize,
    pub vmm_pss_kib: u64,
    pub vmm_rss_kib: u64,
    pub mem_available_mib: u64,
}

fn mib(kib: u64) -> f64 {
    (kib as f64 / 1024.0 * 10.0).round() / 10.0
}

impl NodeMemory {
    /// The server `pid` and its descendants now. A child that ends between
    /// the listing and its reading is left out (a VMM killed meanwhile).
    pub fn read(pid: u32) -> std::io::Result<NodeMemory> {
        let server = host_mem::ProcessMemory::of(pid)?;
        let mut reading = NodeMemory {
            server_rss_kib: server.private_kib + server.shared_kib,
            server_pss_kib: server.pss_kib,
            mem_available_mib: host_mem::mem_available_mib()?,
            ..NodeMemory::default()
        };
        for child in descendants(pid, &parents()) {
            if let Ok(m) = host_mem::ProcessMemory::of(child) {
                reading.vmm_processes += 1;
                reading.vmm_pss_kib += m.pss_kib;
                reading.vmm_rss_kib += m.private_kib + m.shared_kib;
            }
        }
        Ok(reading)
    }

    pub fn to_json(self) -> Value {
        json!({
            "server_rss_mib": mib(self.server_rss_kib),
            "server_pss_mib": mib(self.server_pss_kib),
            "vmm_processes": self.vmm_processes,
            "vmm_pss_mib": mib(self.vmm_pss_kib),
            "vmm_rss_mib": mib(self.vmm_rss_kib),
            "mem_available_mib": self.mem_available_mib,
        })
    }
}

/// After minus before, in MiB (MemAvailable's as a drop: before minus after).
pub fn growth_json(before: NodeMemory, after: NodeMemory) -> Value {
    let grew = |a: u64, b: u64| mib(a) - mib(b);
    json!({
        "server_rss_mib": round1(grew(after.server_rss_kib, before.server_rss_kib)),
        "server_pss_mib": round1(grew(after.server_pss_kib, before.server_pss_kib)),
        "vmm_pss_mib": round1(grew(after.vmm_pss_kib, before.vmm_pss_kib)),
        "vmm_rss_mib": round1(grew(after.vmm_rss_kib, before.vmm_rss_kib)),
        "mem_available_drop_mib": before.mem_available_mib as i64 - after.mem_available_mib as i64,
    })
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// How many of the server's descendants there are now (to wait until the
/// warm pool has refilled before a reading).
pub fn descendant_count(pid: u32) -> usize {
    descendants(pid, &parents()).len()
}

/// Every process's parent, from `/proc/<pid>/stat`.
fn parents() -> HashMap<u32, u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return HashMap::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            Some((pid, parent_of_stat(&stat)?))
        })
        .collect()
}

/// The parent pid of a `/proc/<pid>/stat` line: the fourth field, counted
/// after the command name's closing parenthesis (the name may hold spaces
/// and parentheses itself).
fn parent_of_stat(stat: &str) -> Option<u32> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

fn descendants(root: u32, parents: &HashMap<u32, u32>) -> Vec<u32> {
    let mut found: HashSet<u32> = HashSet::from([root]);
    let mut grew = true;
    while grew {
        grew = false;
        for (&pid, parent) in parents {
            if found.contains(parent) && found.insert(pid) {
                grew = true;
            }
        }
    }
    found.remove(&root);
    let mut list: Vec<u32> = found.into_iter().collect();
    list.sort_unstable();
    list
}

/// Where the node's server runs, as far as this host can tell.
#[derive(Debug, PartialEq, Eq)]
pub enum Located {
    Here(u32),
    /// Why its memory cannot be read from here.
    NotHere(String),
}

/// The server behind `host:port`: a `sandfork` process listening on that
/// loopback port in this network namespace.
pub fn locate(host: &str, port: u16) -> Located {
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if !loopback {
        return Located::NotHere(format!(
            "the node at {host} is not on this host's loopback (give --server-pid if it runs here)"
        ));
    }
    let mut inodes = HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = std::fs::read_to_string(table) {
            inodes.extend(listening_inodes(&text, port));
        }
    }
    if inodes.is_empty() {
        return Located::NotHere(format!("nothing here listens on port {port}"));
    }
    let Some(pid) = socket_owner(&inodes) else {
        return Located::NotHere(format!(
            "the process listening on port {port} is not visible (another user's? run as root or give --server-pid)"
        ));
    };
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
    let name = exe
        .as_deref()
        .and_then(Path::file_name)
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if name == "sandfork" {
        Located::Here(pid)
    } else {
        Located::NotHere(format!(
            "port {port} is held by {name:?} (pid {pid}), not a sandfork server: a node in the \
             KVM lab is reached through QEMU's port forward and its processes are the lab's \
             (run the soak in the lab beside it, as scripts/soak-test.sh does)"
        ))
    }
}

/// The socket inodes of a `/proc/net/tcp{,6}` table listening on `port`
/// (state `0A`), on any local address.
fn listening_inodes(table: &str, port: u16) -> Vec<u64> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local = fields.get(1)?;
            let (_, hex_port) = local.rsplit_once(':')?;
            let listening = *fields.get(3)? == "0A";
            let matches = u16::from_str_radix(hex_port, 16).ok()? == port;
            (listening && matches).then(|| fields.get(9)?.parse().ok())?
        })
        .collect()
}

/// The first process holding one of the socket `inodes` open.
fn socket_owner(inodes: &HashSet<u64>) -> Option<u32> {
    let wanted: HashSet<String> = inodes.iter().map(|i| format!("socket:[{i}]")).collect();
    let mut pids: Vec<u32> = std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    pids.into_iter().find(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
            fds.flatten().any(|fd| {
                std::fs::read_link(fd.path())
                    .is_ok_and(|target| wanted.contains(target.to_string_lossy().as_ref()))
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parent_is_read_after_the_command_name() {
        assert_eq!(parent_of_stat("42 (sandfork) S 7 42 42 0"), Some(7));
        assert_eq!(parent_of_stat("43 (a) b (c)) R 9 1 1"), Some(9));
        assert_eq!(parent_of_stat("garbage"), None);
    }

    #[test]
    fn descendants_are_followed_down_every_generation() {
        let parents = HashMap::from([(2, 1), (3, 2), (4, 3), (5, 1), (6, 99), (1, 0)]);
        assert_eq!(descendants(1, &parents), vec![2, 3, 4, 5]);
        assert_eq!(descendants(6, &parents), Vec::<u32>::new());
    }

    #[test]
    fn only_listening_sockets_on_the_port_count() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:0BB8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0 100 0 0 10 0\n\
   1: 0100007F:0BB8 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 222 1 0 20 4 30 10 -1\n\
   2: 00000000:0BB9 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 333 1 0 100 0 0 10 0\n";
        assert_eq!(listening_inodes(table, 3000), vec![111]);
        assert_eq!(listening_inodes(table, 3001), vec![333]);
        assert!(listening_inodes(table, 80).is_empty());
        assert!(listening_inodes("header only\n", 3000).is_empty());
    }

    #[test]
    fn a_remote_node_is_not_looked_for_here() {
        assert!(matches!(locate("10.1.2.3", 3000), Located::NotHere(_)));
        assert!(matches!(locate("node.example", 3000), Located::NotHere(_)));
    }

    #[test]
    fn growth_is_after_minus_before() {
        let before = NodeMemory {
            server_rss_kib: 10 * 1024,
            mem_available_mib: 1000,
            ..NodeMemory::default()
        };
        let after = NodeMemory {
            server_rss_kib: 12 * 1024 + 512,
            mem_available_mib: 990,
            ..NodeMemory::default()
        };
        let g = growth_json(before, after);
        assert_eq!(g["server_rss_mib"], 2.5);
        assert_eq!(g["mem_available_drop_mib"], 10);
    }
}

//! What a node needs to run: where it listens, where it keeps its data, what
//! it boots.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// The node's settings (the `serve` command fills them from flags and the
/// `SANDFORK_KERNEL`, `SANDFORK_ROOTFS` and `SANDFORK_VMM` variables).
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    /// Durable state: the store, the API key, templates, sandboxes.
    pub data_dir: PathBuf,
    pub kernel: PathBuf,
    pub rootfs: PathBuf,
    /// The `sandfork-vmm` binary.
    pub vmm: PathBuf,
    /// VMM processes kept started and waiting for a snapshot to load.
    pub pool_size: usize,
    pub vcpus: u8,
    pub mem_mib: u64,
    /// Running sandboxes at most; a create beyond it answers 429.
    pub max_sandboxes: usize,
    /// The longest lifetime a create or timeout may ask for.
    pub max_timeout: Duration,
    /// The static guest agent binary that template builds install as init
    /// (`SANDFORK_AGENT`); without it `POST /templates` answers 503.
    pub agent: Option<PathBuf>,
    /// Where template builds cache root filesystems (and the base tree);
    /// `$SANDFORK_CACHE` or `/var/cache/sandfork` when None.
    pub build_cache: Option<PathBuf>,
}

pub const DEFAULT_DATA_DIR: &str = "/var/lib/sandfork";

impl Config {
    pub fn new(listen: SocketAddr, kernel: PathBuf, rootfs: PathBuf, vmm: PathBuf) -> Config {
        Config {
            listen,
            data_dir: PathBuf::from(DEFAULT_DATA_DIR),
            kernel,
            rootfs,
            vmm,
            pool_size: 4,
            vcpus: 1,
            mem_mib: 256,
            max_sandboxes: 64,
            max_timeout: Duration::from_secs(24 * 3600),
            agent: None,
            build_cache: None,
        }
    }

    pub fn sandboxes_dir(&self) -> PathBuf {
        self.data_dir.join("sandboxes")
    }

    pub fn templates_dir(&self) -> PathBuf {
        self.data_dir.join("templates")
    }
}

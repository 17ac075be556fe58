//! What a node needs to run: where it listens, where it keeps its data, what
//! it boots.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::node::capacity::CapacityConfig;

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
    /// Control-plane requests per second of each API key (a burst of twice
    /// that) unless its team sets its own; 0: no limit. Beyond it: 429.
    pub key_rate_limit: u32,
    /// vCPUs, memory and disk sandboxes may use; beyond it answers 503.
    pub capacity: CapacityConfig,
    /// The longest lifetime a create or timeout may ask for.
    pub max_timeout: Duration,
    /// Where VMM processes keep their sockets and logs; `None` for a
    /// directory under `/run/sandfork` named for the data dir (see [`Config::run_dir`]).
    pub run_dir: Option<PathBuf>,
    /// The static guest agent binary that template builds install as init
    /// (`SANDFORK_AGENT`); without it `POST /templates` answers 503.
    pub agent: Option<PathBuf>,
    /// Build the `code-interpreter` template at start when it is missing
    /// (minutes: a first create would otherwise wait on it).
    pub build_code_interpreter: bool,
    /// How long a create waits on a builtin template's build under way
    /// before it is answered 503 with `Retry-After` (the SDKs give up on a
    /// request after 60 s).
    pub builtin_wait: Duration,
    /// The create metadata key whose value names the image the sandbox
    /// runs (`serve --image-metadata-key`, slime's
    /// `SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY`); None: metadata names none.
    pub image_metadata_key: Option<String>,
    /// The most bytes an image's config and layers may add up to (as its
    /// registry serves them, compressed) for the node to pull it
    /// (`--max-image-mib`); None: no bound.
    pub max_image_bytes: Option<u64>,
    /// Where template builds cache root filesystems (and the base tree);
    /// `$SANDFORK_CACHE` or `/var/cache/sandfork` when None.
    pub build_cache: Option<PathBuf>,
    /// How sandboxes are networked; None: they have no network (`--no-network`).
    pub network: Option<crate::node::net::NetworkConfig>,
    /// How VMMs are confined in cgroups; None: they are not (`--no-cgroups`).
    pub cgroups: Option<crate::node::cgroups::CgroupConfig>,
    /// Guests get a balloon with free page reporting (`--no-balloon`: not).
    pub balloon: bool,
    /// When idle sandboxes are paused under host memory pressure; None:
    /// never (`--no-pressure-pause`).
    pub pressure: Option<crate::node::pressure::PressureConfig>,
    /// How VMMs are jailed; None: they run as the server (`--no-jail`).
    pub jail: Option<crate::node::jail::JailConfig>,
    /// The CPU template every guest the node boots gets (`--cpu-template`),
    /// and so every snapshot of one; None: the host's CPU.
    pub cpu_template: Option<vmm_api::CpuTemplate>,
    /// What `cluster-cache/` may hold, in bytes on disk, before the
    /// collector evicts the files nothing uses, least recently used first;
    /// None: a quarter of the data dir's file system (see
    /// `sandbox::cache_bound`).
    pub cluster_cache_max: Option<u64>,
    /// Networks lifecycle webhooks may be delivered to besides public
    /// addresses (`--webhook-allow-net`); none by default.
    pub webhook_allow_nets: Vec<ipnet::IpNet>,
    /// The node's part in a cluster (none: a lone node). Read by the
    /// composition root only; the node itself does not know it is in one.
    pub cluster: Option<ClusterConfig>,
}

pub const DEFAULT_DATA_DIR: &str = "/var/lib/sandfork";
/// Running sandboxes at most when not configured: memory admission is what
/// limits a node (idle sandboxes use a few MiB each); this bounds the
/// descriptors and threads the server holds (a fork of 100 plus others fits).
/// Each API key's control-plane requests per second by default.
pub const DEFAULT_KEY_RATE_LIMIT: u32 = 200;
pub const DEFAULT_MAX_SANDBOXES: usize = 1024;
pub const DEFAULT_RUN_ROOT: &str = "/run/sandfork";
/// The largest image a node pulls unless configured: SWE-bench-style task
/// images are about 4 GiB.
pub const DEFAULT_MAX_IMAGE_MIB: u64 = 16 << 10;

/// The balloon every guest the node boots gets: empty (the node does not
/// take memory a guest uses), free page reporting on (memory the guest
/// frees goes back to the host a few seconds later, and so leaves the
/// Pss the node admits by), deflate on OOM (a later target never costs the
/// guest a process), no statistics (an idle guest is not woken for them).
pub fn node_balloon() -> vmm_api::Balloon {
    vmm_api::Balloon {
        amount_mib: 0,
        deflate_on_oom: true,
        stats_polling_interval_s: 0,
        free_page_reporting: true,
        free_page_hinting: false,
    }
}

/// `template`'s name as records keep it: None for the host's CPU (`None`).
pub fn cpu_template_name(template: Option<vmm_api::CpuTemplate>) -> Option<String> {
    template
        .filter(|t| *t != vmm_api::CpuTemplate::None)
        .map(|t| t.as_str().to_owned())
}

impl Config {
    /// Where template builds cache: `build_cache`, else `$SANDFORK_CACHE`
    /// or `/var/cache/sandfork`.
    pub fn build_cache_dir(&self) -> PathBuf {
        (self.build_cache.clone()).unwrap_or_else(template_build::default_cache_dir)
    }

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
            max_sandboxes: DEFAULT_MAX_SANDBOXES,
            key_rate_limit: DEFAULT_KEY_RATE_LIMIT,
            capacity: CapacityConfig::default(),
            max_timeout: Duration::from_secs(24 * 3600),
            run_dir: None,
            agent: None,
            build_code_interpreter: false,
            builtin_wait: Duration::from_secs(30),
            image_metadata_key: None,
            max_image_bytes: Some(DEFAULT_MAX_IMAGE_MIB << 20),
            build_cache: None,
            network: None,
            webhook_allow_nets: Vec::new(),
            cgroups: Some(crate::node::cgroups::CgroupConfig::default()),
            balloon: true,
            pressure: Some(crate::node::pressure::PressureConfig::default()),
            // Off unless asked for (`serve --jail`): the jail's lab test turns it on.
            jail: None,
            cpu_template: None,
            cluster_cache_max: None,
            cluster: None,
        }
    }

    /// The CPU template's name as records, manifests and the cluster keep
    /// it; None: the host's CPU.
    pub fn cpu_template_name(&self) -> Option<String> {
        cpu_template_name(self.cpu_template)
    }

    pub fn sandboxes_dir(&self) -> PathBuf {
        self.data_dir.join("sandboxes")
    }

    /// What the node observed of each sandbox (logs, metrics), a directory
    /// per sandbox id (see `sandbox::history`).
    pub fn observe_dir(&self) -> PathBuf {
        self.data_dir.join("observe")
    }

    pub fn templates_dir(&self) -> PathBuf {
        self.data_dir.join("templates")
    }

    /// Each volume's directory, by its id (see [`crate::node::volume`]).
    pub fn volumes_dir(&self) -> PathBuf {
        self.data_dir.join("volumes")
    }

    /// Files of paused sandboxes taken in from the cluster's object store,
    /// by content digest (see `crate::cluster::durable`).
    pub fn cluster_cache_dir(&self) -> PathBuf {
        self.data_dir.join("cluster-cache")
    }

    /// The VMMs' directories. Not in the data dir: they hold Unix sockets
    /// (short paths, a local file system) and live exactly as long as the
    /// processes, which a reboot ends, as it empties `/run`. Named for the
    /// data dir so that two nodes on one host never adopt each other's VMMs.
    pub fn run_dir(&self) -> PathBuf {
        if let Some(dir) = &self.run_dir {
            return dir.clone();
        }
        let data = std::fs::canonicalize(&self.data_dir).unwrap_or_else(|_| self.data_dir.clone());
        let digest = Sha256::digest(data.as_os_str().as_encoded_bytes());
        PathBuf::from(DEFAULT_RUN_ROOT).join(crate::node::ids::hex(&digest[..8]))
    }
}

/// How a node joins a cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// etcd's client URLs.
    pub etcd: Vec<String>,
    /// The node's name in the cluster.
    pub node_id: String,
    /// Where gateways and other nodes reach this node's API.
    pub advertise: std::net::SocketAddr,
    /// The registration's lease: a node silent this long is gone.
    pub lease_ttl: std::time::Duration,
    /// The object store durable pauses and templates go to (an S3 URL).
    pub s3: Option<String>,
    /// How often the node collects the object store's unreferenced
    /// chunks (None: never).
    pub store_gc_every: Option<std::time::Duration>,
    /// TLS with both sides authenticated on the node's port, to the other
    /// nodes and to etcd (None: plain HTTP, the port kept private).
    pub tls: Option<sandfork_tls::ClusterTls>,
}

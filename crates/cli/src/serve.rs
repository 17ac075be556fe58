//! `sandfork serve`: the node server on one port. Where this host's KVM
//! cannot boot Linux it re-runs itself inside the KVM lab, with the port
//! forwarded and the data dir shared read-write.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use sandfork_lab::Environment;
use server::node::capacity::{
    CapacityConfig, DEFAULT_IMAGE_DISK_HIGH_PERCENT, DEFAULT_IMAGE_DISK_LOW_PERCENT,
    DEFAULT_MEMORY_HEADROOM_MIB, DEFAULT_MIN_FREE_DISK_MIB, DEFAULT_VCPU_OVERCOMMIT,
    ImageDiskWatermarks,
};
use server::node::config::{Config, DEFAULT_DATA_DIR};

use crate::{ImageArgs, sibling_binary};

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Address and port of the API (and of the envd proxy).
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// Store, API key, templates and sandboxes.
    #[arg(long, env = "SANDFORK_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
    /// VMM processes kept started for the next creates.
    #[arg(long, default_value_t = 4)]
    pool_size: usize,
    /// Running sandboxes at most (creates beyond answer 429).
    #[arg(long, default_value_t = server::node::config::DEFAULT_MAX_SANDBOXES)]
    max_sandboxes: usize,
    /// Control-plane requests per second of each API key, a burst of twice
    /// that (beyond: 429 with Retry-After); a team may set its own; 0: no limit.
    #[arg(long, value_name = "N", default_value_t = server::node::config::DEFAULT_KEY_RATE_LIMIT)]
    key_rate_limit: u32,
    /// The static guest agent that template builds install as init
    /// (without it `POST /templates` answers 503 for image sources).
    #[arg(long, env = "SANDFORK_AGENT")]
    agent: Option<PathBuf>,
    /// Memory of the KVM lab machine in MiB, when one is needed [default:
    /// the host's MemTotal less the larger of 2 GiB and 15 %].
    #[arg(long, value_name = "MIB")]
    lab_memory: Option<u32>,
    /// Sandboxes get no network (for hosts where the node cannot make
    /// network namespaces, veths and nftables rules).
    #[arg(long)]
    no_network: bool,
    /// Network slots kept ready for the next creates and fork children
    /// (a fork burst's worth; more are made on demand).
    #[arg(long, default_value_t = 32)]
    ready_slots: usize,
    /// The link sandboxes reach the internet through [default: the default
    /// route's].
    #[arg(long)]
    uplink: Option<String>,
    /// VMMs run without a cgroup of their own (for hosts without cgroup v2
    /// and its cpu, memory and pids controllers).
    #[arg(long)]
    no_cgroups: bool,
    /// Guests get no balloon: memory a guest frees stays with its VMM
    /// (by default it goes back to the host, through free page reporting).
    /// Takes effect for templates built from then on; the base template is
    /// rebuilt when it differs.
    #[arg(long)]
    no_balloon: bool,
    /// Builds the `code-interpreter` template at start when it is missing
    /// (the first build runs pip: minutes), so that the first create of it
    /// does not wait; a create during the build is answered 503 with
    /// `Retry-After`.
    #[arg(long)]
    build_code_interpreter: bool,
    /// A create whose metadata has KEY runs the registry image its value
    /// names (converted into a template on its first create), as a
    /// template id that is an image reference does (slime's
    /// `SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY`).
    #[arg(long, value_name = "KEY")]
    image_metadata_key: Option<String>,
    /// The largest image (its layers as the registry serves them) a create
    /// or build may pull; 0: no bound. Larger ones answer 413.
    #[arg(long, value_name = "MIB", default_value_t = server::node::config::DEFAULT_MAX_IMAGE_MIB)]
    max_image_mib: u64,
    /// A network (CIDR) lifecycle webhooks may be delivered to besides
    /// public addresses, e.g. 10.0.0.0/8 for receivers inside the
    /// operator's own network; repeatable. Without it a URL at a loopback,
    /// private or link-local address is refused (400), and a name that
    /// resolves to one is not delivered to.
    #[arg(long, value_name = "CIDR")]
    webhook_allow_net: Vec<ipnet::IpNet>,
    /// The cgroup, under the cgroup2 mount, the node's VMM groups live in
    /// (one more level per node, named as its run dir).
    #[arg(long, value_name = "PATH", default_value = "sandfork")]
    cgroup_parent: PathBuf,
    /// Every VMM runs jailed: its own mount, PID and IPC namespaces and
    /// root, its own uid, no capabilities (see README "Hardening"). The
    /// default; kept so that a later `--jail` undoes an earlier `--no-jail`.
    #[arg(long, overrides_with = "no_jail")]
    jail: bool,
    /// VMMs run unjailed: as the server's user, in its mount and PID
    /// namespaces, with its capabilities.
    #[arg(long, overrides_with = "jail")]
    no_jail: bool,
    /// A jailed VMM runs as uid and gid BASE + its pid (a range as wide as
    /// the host's pid_max, used by nothing else).
    #[arg(long, value_name = "BASE", default_value_t = server::node::jail::DEFAULT_UID_BASE)]
    jail_uid_base: u32,
    /// The resolver sandboxes' DNS queries are forwarded to, IP[:PORT]
    /// [default: the first IPv4 nameserver of /etc/resolv.conf, port 53].
    #[arg(long, value_name = "IP[:PORT]", value_parser = parse_dns_upstream)]
    dns_upstream: Option<std::net::SocketAddrV4>,
    /// The CPU template every guest is booted under: its CPUID is masked to
    /// an x86-64 microarchitecture level (x86-64-v2, x86-64-v3,
    /// x86-64-v4), the same on every host that has it, so a pause or
    /// template made on one node resumes on another; None: the host's CPU.
    /// Every node of a cluster must use the same one (a node refuses what
    /// was made under another). The base template is rebuilt when it
    /// differs; a host that lacks the level's features refuses to start.
    #[arg(
        long,
        env = "SANDFORK_CPU_TEMPLATE",
        value_name = "NAME",
        default_value = "None"
    )]
    cpu_template: vmm_api::CpuTemplate,
    #[command(flatten)]
    capacity: CapacityArgs,
    #[command(flatten)]
    pressure: PressureArgs,
    #[command(flatten)]
    cluster: ClusterArgs,
    #[command(flatten)]
    image: ImageArgs,
}

/// `IP` or `IP:PORT` (port 53 by default).
fn parse_dns_upstream(s: &str) -> Result<std::net::SocketAddrV4, String> {
    if let Ok(ip) = s.parse::<std::net::Ipv4Addr>() {
        return Ok(std::net::SocketAddrV4::new(ip, 53));
    }
    s.parse()
        .map_err(|_| format!("{s:?} is not an IPv4 address or IPv4:port"))
}

/// What this process is in a cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Role {
    /// The single node of today: sandboxes and API, no etcd.
    All,
    /// Runs sandboxes, registered in etcd (its API is what gateways call).
    Node,
    /// Routes the E2B API and envd traffic to the nodes; runs no VMs.
    Gateway,
}

#[derive(clap::Args)]
struct ClusterArgs {
    #[arg(long, value_enum, default_value_t = Role::All)]
    role: Role,
    /// etcd endpoints, comma-separated (e.g. http://127.0.0.1:2379);
    /// needed by --role node and gateway.
    #[arg(long, env = "SANDFORK_ETCD", value_delimiter = ',')]
    etcd: Vec<String>,
    /// The node's name in the cluster [default: the host name and port].
    #[arg(long)]
    node_id: Option<String>,
    /// The address gateways reach this node's API at [default: --listen].
    #[arg(long)]
    advertise: Option<SocketAddr>,
    /// Seconds a node's registration outlives its last refresh.
    #[arg(long, default_value_t = 10)]
    lease_ttl_secs: u64,
    /// The cluster's object store, `http://HOST:PORT/BUCKET` (S3-compatible;
    /// credentials from SANDFORK_S3_ACCESS_KEY and SANDFORK_S3_SECRET_KEY):
    /// a node stores each pause there, so another node can resume it.
    #[arg(long, env = "SANDFORK_S3")]
    s3: Option<String>,
    /// How often a node looks whether the object store is due a collection
    /// (chunks no manifest names, stored pauses no route names, an hour
    /// old); one node of the cluster at a time runs it. 0: never on this node.
    #[arg(long, value_name = "SECS", default_value_t = 1800)]
    store_gc_every_secs: u64,
    /// What `<data dir>/cluster-cache` may hold before the files no
    /// sandbox or template uses are evicted, least recently used first
    /// [default: a quarter of the data dir's file system].
    #[arg(long, value_name = "MIB")]
    cluster_cache_max_mib: Option<u64>,
    /// This part's certificate (PEM) for TLS between the cluster's parts,
    /// both sides authenticated: a node's port then takes only clients with
    /// a certificate of --tls-ca, and gateways and nodes reach nodes and etcd
    /// (`https://` endpoints) with it. All three --tls flags or none; a
    /// gateway's own port stays plain HTTP. `sandfork cluster certs` makes
    /// a set.
    #[arg(long, env = "SANDFORK_TLS_CERT", value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// This part's private key (PEM).
    #[arg(long, env = "SANDFORK_TLS_KEY", value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// The cluster's CA certificate (PEM): the only one trusted.
    #[arg(long, env = "SANDFORK_TLS_CA", value_name = "FILE")]
    tls_ca: Option<PathBuf>,
}

impl ServeArgs {
    /// Jailed unless `--no-jail` came last (clap keeps only the last of the
    /// two flags set).
    fn jailed(&self) -> bool {
        self.jail || !self.no_jail
    }
}

impl ClusterArgs {
    fn check(&self) -> Result<()> {
        match (self.role, self.etcd.is_empty()) {
            (Role::All, false) => anyhow::bail!(
                "--etcd is for a cluster: pick --role node or --role gateway (--role all is one node on its own)"
            ),
            (Role::Node | Role::Gateway, true) => {
                anyhow::bail!("--role node and --role gateway need --etcd")
            }
            (Role::All, true) if self.s3.is_some() => {
                anyhow::bail!("--s3 is for a cluster node (--role node)")
            }
            _ => {}
        }
        if self.tls_files()?.is_some() && self.role == Role::All {
            anyhow::bail!(
                "--tls-cert/--tls-key/--tls-ca are for a cluster's parts (--role node or gateway); \
                 a single node's port is plain HTTP (put a TLS proxy in front of it)"
            );
        }
        Ok(())
    }

    /// The three TLS files, all or none.
    fn tls_files(&self) -> Result<Option<sandfork_tls::TlsFiles>> {
        Ok(sandfork_tls::TlsFiles::from_parts(
            self.tls_cert.clone(),
            self.tls_key.clone(),
            self.tls_ca.clone(),
        )?)
    }

    /// The part's TLS, loaded (None without the flags).
    fn tls(&self) -> Result<Option<sandfork_tls::ClusterTls>> {
        match self.tls_files()? {
            Some(files) => Ok(Some(files.load()?)),
            None => Ok(None),
        }
    }

    fn node_id(&self, listen: SocketAddr) -> Result<String> {
        let id = match &self.node_id {
            Some(id) => id.clone(),
            None => {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
                format!("{}-{}", host.trim(), listen.port())
            }
        };
        anyhow::ensure!(
            sandfork_cluster::keyspace::is_node_id(&id),
            "node id {id:?}: use letters, digits, '-', '_' and '.' (at most 64)"
        );
        Ok(id)
    }

    /// The same flags, for the `serve` run inside the lab.
    fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            format!(
                "--role={}",
                match self.role {
                    Role::All => "all",
                    Role::Node => "node",
                    Role::Gateway => "gateway",
                }
            ),
            format!("--lease-ttl-secs={}", self.lease_ttl_secs),
        ];
        if !self.etcd.is_empty() {
            args.push(format!("--etcd={}", self.etcd.join(",")));
        }
        if let Some(id) = &self.node_id {
            args.push(format!("--node-id={id}"));
        }
        if let Some(a) = self.advertise {
            args.push(format!("--advertise={a}"));
        }
        if let Some(s3) = &self.s3 {
            args.push(format!("--s3={s3}"));
        }
        args.push(format!(
            "--store-gc-every-secs={}",
            self.store_gc_every_secs
        ));
        if let Some(mib) = self.cluster_cache_max_mib {
            args.push(format!("--cluster-cache-max-mib={mib}"));
        }
        // (absolute: the lab's serve starts elsewhere; the host's files are
        // readable there)
        for (flag, path) in [
            ("tls-cert", &self.tls_cert),
            ("tls-key", &self.tls_key),
            ("tls-ca", &self.tls_ca),
        ] {
            if let Some(path) = path {
                let path = std::path::absolute(path).unwrap_or_else(|_| path.clone());
                args.push(format!("--{flag}={}", path.display()));
            }
        }
        args
    }
}

/// What sandboxes may use of the node; beyond it creates, resumes and forks
/// answer 503 (see `GET /v1/node`).
#[derive(clap::Args)]
struct CapacityArgs {
    /// Memory for sandboxes in MiB: what they really use plus their
    /// headroom stays under it [default: the host's MemTotal minus
    /// --reserve-memory-mib]. Not a guest's size (that is --mem-mib).
    #[arg(long, value_name = "MIB")]
    node_memory_mib: Option<u64>,
    /// Memory kept for the host [default: the larger of 1024 MiB and 10 %].
    #[arg(long, value_name = "MIB")]
    reserve_memory_mib: Option<u64>,
    /// Memory charged per sandbox beyond what it really uses (sampled), for
    /// its growth; a create or fork child asks for this much. At a guest's
    /// size every guest is counted whole.
    #[arg(long, value_name = "MIB", default_value_t = DEFAULT_MEMORY_HEADROOM_MIB)]
    memory_headroom_mib: u64,
    /// vCPUs for sandboxes before overcommit [default: the host's CPUs].
    #[arg(long, value_name = "N")]
    node_vcpus: Option<u64>,
    /// Guest vCPUs per node vCPU (idle sandboxes use next to no CPU).
    #[arg(long, value_name = "RATIO", default_value_t = DEFAULT_VCPU_OVERCOMMIT, value_parser = ratio)]
    vcpu_overcommit: f64,
    /// Disk space on the data dir's filesystem that sandboxes never use.
    #[arg(long, value_name = "MIB", default_value_t = DEFAULT_MIN_FREE_DISK_MIB)]
    min_free_disk_mib: u64,
    /// Above this use of the data dir's filesystem (percent, as df counts
    /// it) templates converted from registry images that nothing uses are
    /// evicted, least recently used first, and a new conversion is refused
    /// (503 with Retry-After) while it stays above; 100: never.
    #[arg(long, value_name = "PERCENT", default_value_t = DEFAULT_IMAGE_DISK_HIGH_PERCENT, value_parser = percent)]
    image_disk_high_percent: f64,
    /// The use evictions go down to (at most --image-disk-high-percent).
    #[arg(long, value_name = "PERCENT", default_value_t = DEFAULT_IMAGE_DISK_LOW_PERCENT, value_parser = percent)]
    image_disk_low_percent: f64,
}

impl CapacityArgs {
    fn config(&self) -> CapacityConfig {
        CapacityConfig {
            memory_mib: self.node_memory_mib,
            reserve_memory_mib: self.reserve_memory_mib,
            memory_headroom_mib: self.memory_headroom_mib,
            vcpus: self.node_vcpus,
            vcpu_overcommit: self.vcpu_overcommit,
            min_free_disk_mib: self.min_free_disk_mib,
            image_disk: ImageDiskWatermarks {
                high_percent: self.image_disk_high_percent,
                low_percent: self.image_disk_low_percent,
            },
        }
    }

    fn check(&self) -> Result<()> {
        anyhow::ensure!(
            self.image_disk_low_percent <= self.image_disk_high_percent,
            "--image-disk-low-percent {} is above --image-disk-high-percent {}",
            self.image_disk_low_percent,
            self.image_disk_high_percent
        );
        Ok(())
    }

    /// The same flags, for the `serve` run inside the lab.
    fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            format!("--memory-headroom-mib={}", self.memory_headroom_mib),
            format!("--vcpu-overcommit={}", self.vcpu_overcommit),
            format!("--min-free-disk-mib={}", self.min_free_disk_mib),
            format!("--image-disk-high-percent={}", self.image_disk_high_percent),
            format!("--image-disk-low-percent={}", self.image_disk_low_percent),
        ];
        let optional = [
            ("node-memory-mib", self.node_memory_mib),
            ("reserve-memory-mib", self.reserve_memory_mib),
            ("node-vcpus", self.node_vcpus),
        ];
        for (name, value) in optional {
            if let Some(v) = value {
                args.push(format!("--{name}={v}"));
            }
        }
        args
    }
}

/// When the host runs short of memory, idle sandboxes are paused (least
/// recently used first, auto-pause ones before others) rather than let the
/// kernel's OOM killer end a VMM; each resumes on its next request.
#[derive(clap::Args)]
struct PressureArgs {
    /// Never pause sandboxes for memory pressure.
    #[arg(long)]
    no_pressure_pause: bool,
    /// Pause while the host's MemAvailable is below this percent of the
    /// node's memory ceiling (--node-memory-mib, at most MemTotal).
    #[arg(long, value_name = "PERCENT", default_value_t = server::node::pressure::DEFAULT_MIN_AVAILABLE_PERCENT, value_parser = percent)]
    pressure_min_available_percent: f64,
    /// Pause while the kernel's memory pressure (PSI `full` avg10, percent
    /// of time all tasks stalled on memory) is above this and stalling goes on.
    #[arg(long, value_name = "PERCENT", default_value_t = server::node::pressure::DEFAULT_MAX_FULL_AVG10, value_parser = percent)]
    pressure_max_full_avg10: f64,
    /// A sandbox is idle, and may be paused, once no request has reached it
    /// for this many seconds.
    #[arg(long, value_name = "SECS", default_value_t = server::node::pressure::DEFAULT_IDLE.as_secs())]
    pressure_idle_secs: u64,
    /// Pauses for memory pressure a minute at most.
    #[arg(long, value_name = "N", default_value_t = server::node::pressure::DEFAULT_MAX_PAUSES_PER_MINUTE)]
    pressure_max_pauses_per_minute: u32,
}

impl PressureArgs {
    fn config(&self) -> Option<server::node::pressure::PressureConfig> {
        (!self.no_pressure_pause).then(|| server::node::pressure::PressureConfig {
            min_available_percent: self.pressure_min_available_percent,
            max_full_avg10: self.pressure_max_full_avg10,
            idle: std::time::Duration::from_secs(self.pressure_idle_secs),
            max_pauses_per_minute: self.pressure_max_pauses_per_minute,
        })
    }

    /// The same flags, for the `serve` run inside the lab.
    fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            format!(
                "--pressure-min-available-percent={}",
                self.pressure_min_available_percent
            ),
            format!("--pressure-max-full-avg10={}", self.pressure_max_full_avg10),
            format!("--pressure-idle-secs={}", self.pressure_idle_secs),
            format!(
                "--pressure-max-pauses-per-minute={}",
                self.pressure_max_pauses_per_minute
            ),
        ];
        if self.no_pressure_pause {
            args.push("--no-pressure-pause".into());
        }
        args
    }
}

fn percent(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if (0.0..=100.0).contains(&p) => Ok(p),
        _ => Err(format!("{s:?} is not a percentage from 0 to 100")),
    }
}

fn ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!("{s:?} is not a positive number")),
    }
}

pub fn run(args: ServeArgs) -> Result<ExitCode> {
    args.cluster.check()?;
    // the TLS files read and checked here, before any lab starts
    args.cluster.tls()?;
    args.capacity.check()?;
    // A gateway runs no VMs: it needs no KVM, and so no lab.
    if args.cluster.role != Role::Gateway
        && !args.image.in_lab
        && sandfork_lab::detect().environment != Environment::Hardware
    {
        return run_in_lab(&args);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(serve(args))?;
    Ok(ExitCode::SUCCESS)
}

async fn serve(args: ServeArgs) -> Result<()> {
    if args.cluster.role == Role::Gateway {
        return serve_gateway(&args).await;
    }
    let mut config = Config::new(
        args.listen,
        args.image.kernel.clone(),
        args.image.rootfs.clone(),
        args.image.vmm()?,
    );
    config.data_dir = args.data_dir.clone();
    config.cluster_cache_max = args.cluster.cluster_cache_max_mib.map(|m| m << 20);
    // Each VMM holds descriptors in the server: the soft default (often
    // 1024) would refuse opens long before the node's capacity.
    match server::node::capacity::raise_open_files_limit() {
        Ok(Some(n)) if n < args.max_sandboxes as u64 * server::node::capacity::FDS_PER_SANDBOX => {
            eprintln!(
                "sandfork serve: open files are limited to {n}: fewer than --max-sandboxes {} may run \
                 (raise the hard limit, e.g. LimitNOFILE=)",
                args.max_sandboxes
            )
        }
        Ok(_) => {}
        Err(e) => eprintln!("sandfork serve: raising the open files limit: {e}"),
    }
    config.pool_size = args.pool_size;
    config.max_sandboxes = args.max_sandboxes;
    config.key_rate_limit = args.key_rate_limit;
    config.capacity = args.capacity.config();
    config.pressure = args.pressure.config();
    config.vcpus = args.image.vcpus;
    config.mem_mib = args.image.mem_mib;
    config.agent = args.agent.clone();
    config.network = (!args.no_network).then(|| server::node::net::NetworkConfig {
        ready_slots: args.ready_slots,
        uplink: args.uplink.clone(),
        dns_upstream: args.dns_upstream,
    });
    config.balloon = !args.no_balloon;
    config.build_code_interpreter = args.build_code_interpreter;
    config.image_metadata_key = args.image_metadata_key.clone().filter(|k| !k.is_empty());
    config.max_image_bytes =
        (args.max_image_mib > 0).then(|| args.max_image_mib.saturating_mul(1 << 20));
    config.webhook_allow_nets = args.webhook_allow_net.clone();
    config.cpu_template = Some(args.cpu_template);
    config.jail = args.jailed().then_some(server::node::jail::JailConfig {
        uid_base: args.jail_uid_base,
    });
    config.cgroups = (!args.no_cgroups).then(|| server::node::cgroups::CgroupConfig {
        parent: args.cgroup_parent.clone(),
        ..Default::default()
    });
    // Bind first: a taken port fails before the template is built.
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    if args.cluster.role != Role::All {
        let node_id = args.cluster.node_id(args.listen)?;
        let advertise = args.cluster.advertise.unwrap_or(args.listen);
        anyhow::ensure!(
            !advertise.ip().is_unspecified(),
            "--listen {} is every address: say which one gateways use with --advertise",
            args.listen
        );
        config.cluster = Some(server::node::config::ClusterConfig {
            etcd: args.cluster.etcd.clone(),
            node_id,
            advertise,
            lease_ttl: std::time::Duration::from_secs(args.cluster.lease_ttl_secs),
            s3: args.cluster.s3.clone(),
            store_gc_every: (args.cluster.store_gc_every_secs > 0)
                .then(|| std::time::Duration::from_secs(args.cluster.store_gc_every_secs)),
            tls: args.cluster.tls()?,
        });
    }
    eprintln!("sandfork serve: preparing the base template (the first start boots a microVM)");
    let node = server::Server::start(config).await?;
    match &node.api_key_file {
        Some(path) => println!("sandfork serve: API key in {}", path.display()),
        None => println!("sandfork serve: API key from SANDFORK_API_KEY"),
    }
    if node.tls.is_some() {
        println!(
            "sandfork serve: listening on https://{}, for clients with a certificate of the cluster's CA",
            args.listen
        );
    } else {
        println!(
            "sandfork serve: listening on http://{0} (E2B_API_URL=http://{0} E2B_SANDBOX_URL=http://{0})",
            args.listen
        );
    }
    if let Some(member) = &node.member {
        println!(
            "sandfork serve: node {} in the cluster, reached at {}",
            member.node.registration.node_id(),
            args.cluster.advertise.unwrap_or(args.listen)
        );
    }
    node.serve(listener, shutdown_signal()).await?;
    Ok(())
}

async fn serve_gateway(args: &ServeArgs) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let tls = args.cluster.tls()?;
    let etcd = sandfork_cluster::Cluster::connect_with(&args.cluster.etcd, tls.as_ref())
        .await
        .context("connecting to etcd")?;
    println!(
        "sandfork serve: gateway listening on http://{0} (E2B_API_URL=http://{0} E2B_SANDBOX_URL=http://{0})",
        args.listen
    );
    // The cluster's admin key, which the nodes take too: a scrape of the
    // gateway's /metrics sends it.
    let metrics_key = std::env::var("SANDFORK_API_KEY")
        .ok()
        .filter(|k| !k.is_empty());
    let options = server::http::gateway::GatewayOptions {
        metrics_key,
        image_metadata_key: args.image_metadata_key.clone(),
        dialer: tls.map(|t| t.dialer()).unwrap_or_default(),
    };
    server::http::gateway::serve(listener, etcd, options, shutdown_signal()).await?;
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Runs this same `serve` inside the lab: listening on all of the lab's
/// addresses, reached through a forward of the same port on the host.
fn run_in_lab(args: &ServeArgs) -> Result<ExitCode> {
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating {}", args.data_dir.display()))?;
    let data_dir = std::fs::canonicalize(&args.data_dir)?;
    let port = args.listen.port();
    let inside = SocketAddr::from(([0, 0, 0, 0], port));
    let image = &args.image;
    let mut cmd = std::process::Command::new(sibling_binary("sandfork-lab")?);
    // One lab vCPU: steadier under nested emulation (see scripts/test.sh).
    let memory = args
        .lab_memory
        .unwrap_or_else(sandfork_lab::host_sized_memory_mib);
    cmd.args(["run", "--cpus", "1", "--memory"])
        .arg(memory.to_string())
        .arg("--forward")
        .arg(format!("{}:{port}:{port}", args.listen.ip()))
        .arg("--rw")
        .arg(&data_dir);
    // Template builds write their cache (the base tree, built root
    // filesystems) there; the lab's host root is read-only. A data dir
    // under it (CI's checkout is) is covered by its share: the lab mounts
    // the outer of nested shares.
    let cache = std::env::var_os("SANDFORK_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/sandfork"));
    if let Ok(cache) = std::fs::canonicalize(&cache) {
        cmd.arg("--rw").arg(cache);
    }
    // Users reach the node on this host's loopback, so an image on a
    // loopback registry (`127.0.0.1:5000/img`) is theirs, on this host: the
    // lab reaches it through its user-mode network's gateway (crates/lab's
    // init.sh routes through 10.0.2.2, which QEMU maps to the host).
    cmd.env("SANDFORK_REGISTRY_LOOPBACK_VIA", "10.0.2.2");
    cmd.arg("--")
        .arg(std::env::current_exe()?)
        .arg("serve")
        .arg("--listen")
        .arg(inside.to_string())
        .arg("--data-dir")
        .arg(&data_dir)
        .arg("--pool-size")
        .arg(args.pool_size.to_string())
        .arg("--max-sandboxes")
        .arg(args.max_sandboxes.to_string())
        .arg("--key-rate-limit")
        .arg(args.key_rate_limit.to_string())
        .args(args.capacity.to_args())
        .args(args.pressure.to_args())
        .args(args.cluster.to_args())
        .arg("--kernel")
        .arg(&image.kernel)
        .arg("--rootfs")
        .arg(&image.rootfs)
        .arg("--vmm")
        .arg(image.vmm()?)
        .arg("--vcpus")
        .arg(image.vcpus.to_string())
        .arg("--mem-mib")
        .arg(image.mem_mib.to_string())
        .arg("--in-lab");
    if let Some(agent) = &args.agent {
        cmd.arg("--agent").arg(agent);
    }
    cmd.arg("--ready-slots").arg(args.ready_slots.to_string());
    if args.no_network {
        cmd.arg("--no-network");
    }
    if let Some(uplink) = &args.uplink {
        cmd.arg("--uplink").arg(uplink);
    }
    if args.no_cgroups {
        cmd.arg("--no-cgroups");
    }
    if args.no_balloon {
        cmd.arg("--no-balloon");
    }
    cmd.arg("--cgroup-parent").arg(&args.cgroup_parent);
    cmd.arg(if args.jailed() { "--jail" } else { "--no-jail" });
    cmd.arg("--jail-uid-base")
        .arg(args.jail_uid_base.to_string());
    if let Some(dns) = &args.dns_upstream {
        cmd.arg("--dns-upstream").arg(dns.to_string());
    }
    cmd.arg("--cpu-template").arg(args.cpu_template.as_str());
    if let Some(key) = &args.image_metadata_key {
        cmd.arg("--image-metadata-key").arg(key);
    }
    cmd.arg("--max-image-mib")
        .arg(args.max_image_mib.to_string());
    for net in &args.webhook_allow_net {
        cmd.arg("--webhook-allow-net").arg(net.to_string());
    }
    eprintln!(
        "sandfork serve: this host's KVM cannot boot Linux; running in the KVM lab (emulated, slow), \
         reachable at http://{} (the lab's own address below is forwarded there)",
        args.listen
    );
    // Become the lab runner, so that a signal to this process (a service
    // manager's SIGTERM, `kill PID`) reaches the lab and its QEMU; a
    // child left behind would keep serving with nobody to stop it.
    let error = std::os::unix::process::CommandExt::exec(&mut cmd);
    Err(error).context("running the KVM lab")
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        capacity: CapacityArgs,
    }

    fn parse(args: &[&str]) -> Result<CapacityArgs, clap::Error> {
        Flags::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
            .map(|f| f.capacity)
    }

    #[test]
    fn cpu_template_takes_sandforks_names_and_refuses_firecrackers() {
        #[derive(Parser)]
        struct Flags {
            #[arg(long, default_value = "None")]
            cpu_template: vmm_api::CpuTemplate,
        }
        let parse = |args: &[&str]| {
            Flags::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
                .map(|f| f.cpu_template)
        };
        assert_eq!(parse(&[]).unwrap(), vmm_api::CpuTemplate::None);
        assert_eq!(
            parse(&["--cpu-template", "x86-64-v3"]).unwrap(),
            vmm_api::CpuTemplate::X86_64V3
        );
        let err = parse(&["--cpu-template", "T2"]).unwrap_err().to_string();
        assert!(err.contains("x86-64-v2"), "{err}");
        let none = server::node::config::cpu_template_name(Some(parse(&[]).unwrap()));
        assert_eq!(none, None);
    }

    #[test]
    fn dns_upstream_is_an_ipv4_with_port_53_by_default() {
        let a = |s| parse_dns_upstream(s).map(|a| a.to_string());
        assert_eq!(a("10.0.2.3"), Ok("10.0.2.3:53".into()));
        assert_eq!(a("203.0.113.53:5300"), Ok("203.0.113.53:5300".into()));
        for bad in ["", "resolver.lan", "::1", "1.2.3.4:x"] {
            assert!(parse_dns_upstream(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn capacity_flags_reach_the_config_and_the_lab() {
        assert_eq!(parse(&[]).unwrap().config(), CapacityConfig::default());
        let args = parse(&[
            "--node-memory-mib",
            "600",
            "--memory-headroom-mib",
            "16",
            "--node-vcpus",
            "2",
            "--min-free-disk-mib",
            "10",
            "--image-disk-high-percent",
            "50.5",
            "--image-disk-low-percent",
            "40",
        ])
        .unwrap();
        let config = args.config();
        assert_eq!(config.memory_mib, Some(600));
        assert_eq!(config.memory_headroom_mib, 16);
        assert_eq!(config.vcpus, Some(2));
        assert_eq!(config.reserve_memory_mib, None);
        assert_eq!(config.min_free_disk_mib, 10);
        assert_eq!(config.image_disk.high_percent, 50.5);
        assert_eq!(config.image_disk.low_percent, 40.0);
        args.check().unwrap();
        let inverted = parse(&["--image-disk-low-percent", "90"]).unwrap();
        assert!(inverted.check().is_err(), "low above the default high");
        assert!(parse(&["--image-disk-high-percent", "101"]).is_err());
        // What the lab's `serve` gets parses to the same.
        let again = args.to_args();
        let again: Vec<&str> = again.iter().map(String::as_str).collect();
        assert_eq!(parse(&again).unwrap().config(), config);
    }

    #[derive(Parser)]
    struct PressureFlags {
        #[command(flatten)]
        pressure: PressureArgs,
    }

    fn parse_pressure(args: &[&str]) -> Result<PressureArgs, clap::Error> {
        PressureFlags::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
            .map(|f| f.pressure)
    }

    #[test]
    fn pressure_flags_reach_the_config_and_the_lab() {
        assert_eq!(
            parse_pressure(&[]).unwrap().config(),
            Some(server::node::pressure::PressureConfig::default())
        );
        assert_eq!(
            parse_pressure(&["--no-pressure-pause"]).unwrap().config(),
            None
        );
        let args = parse_pressure(&[
            "--pressure-min-available-percent",
            "12.5",
            "--pressure-max-full-avg10",
            "40",
            "--pressure-idle-secs",
            "3",
            "--pressure-max-pauses-per-minute",
            "5",
        ])
        .unwrap();
        let config = args.config().unwrap();
        assert_eq!(config.min_available_percent, 12.5);
        assert_eq!(config.max_full_avg10, 40.0);
        assert_eq!(config.idle, std::time::Duration::from_secs(3));
        assert_eq!(config.max_pauses_per_minute, 5);
        let again = args.to_args();
        let again: Vec<&str> = again.iter().map(String::as_str).collect();
        assert_eq!(parse_pressure(&again).unwrap().config(), Some(config));
        for bad in ["-1", "101", "x"] {
            assert!(
                parse_pressure(&["--pressure-max-full-avg10", bad]).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn tls_flags_are_all_or_none_and_for_a_clusters_parts() {
        #[derive(Parser)]
        struct Flags {
            #[command(flatten)]
            cluster: ClusterArgs,
        }
        let parse = |args: &[&str]| {
            Flags::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
                .unwrap()
                .cluster
        };
        let node = ["--role", "node", "--etcd", "https://127.0.0.1:2379"];
        let tls = [
            "--tls-cert",
            "c.pem",
            "--tls-key",
            "k.pem",
            "--tls-ca",
            "ca.pem",
        ];
        let with = |extra: &[&'static str]| [&node[..], extra].concat();
        parse(&node).check().unwrap();
        parse(&with(&tls)).check().unwrap();
        let partial = parse(&with(&tls[..4])).check().unwrap_err().to_string();
        assert!(partial.ends_with("missing: --tls-ca"), "{partial}");
        let single = parse(&tls).check().unwrap_err().to_string();
        assert!(single.contains("--role node or gateway"), "{single}");
        // the lab's serve gets the same files, as absolute paths
        let args = parse(&with(&tls)).to_args();
        let cwd = std::env::current_dir().unwrap();
        assert!(
            args.contains(&format!("--tls-ca={}", cwd.join("ca.pem").display())),
            "{args:?}"
        );
    }

    #[test]
    fn ratios_must_be_positive_numbers() {
        for bad in ["0", "-1", "NaN", "inf", "x"] {
            assert!(parse(&["--vcpu-overcommit", bad]).is_err(), "{bad}");
        }
        assert_eq!(
            parse(&["--vcpu-overcommit", "0.5"])
                .unwrap()
                .vcpu_overcommit,
            0.5
        );
    }
}

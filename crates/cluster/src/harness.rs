//! Real servers for tests, on loopback, on ports free at start, their data
//! in a temporary directory, killed on drop: etcd members (Debian's
//! `etcd`) and an S3 server (SeaweedFS's `weed`, installed by
//! scripts/deps.sh; `$WEED` names another binary).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A cluster of etcd members on loopback (one for most tests, three to
/// lose a leader or the quorum). Members can be killed and restarted on
/// their ports and data; all are killed on drop.
#[derive(Debug)]
pub struct Etcd {
    members: Vec<Member>,
    dir: PathBuf,
    /// Clients and peers through TLS with both sides authenticated: every
    /// member serves and dials with these files (their certificate names
    /// 127.0.0.1).
    tls: Option<sandfork_tls::TlsFiles>,
    _tmp: Option<tempfile::TempDir>,
}

#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
    scheme: &'static str,
}

impl Member {
    fn client_url(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme, self.client_port)
    }

    fn peer_url(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme, self.peer_port)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("etcd did not answer on {0} within 20 s (log in {1})")]
    NotReady(String, PathBuf),
    #[error("the S3 server did not answer on {0} within 60 s (log in {1})")]
    S3NotReady(String, PathBuf),
    #[error("the S3 server on {0} exited before it answered, {1} times (its last log: {2})")]
    S3Exited(String, usize, String),
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error("no running member answered as the leader")]
    NoLeader,
    #[error("TLS: {0}")]
    Tls(String),
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Etcd {
    /// Starts a one-member cluster in a new temporary directory.
    pub fn start() -> Result<Etcd, HarnessError> {
        Etcd::start_members(1)
    }

    /// Starts a cluster of `count` members in a new temporary directory.
    pub fn start_members(count: usize) -> Result<Etcd, HarnessError> {
        let tmp = tempfile::tempdir()?;
        let mut etcd = Etcd::start_in(tmp.path(), count)?;
        etcd._tmp = Some(tmp);
        Ok(etcd)
    }

    /// Starts a cluster of `count` members in a new temporary directory,
    /// reached (and reaching each other) through TLS with `tls`'s files.
    pub fn start_members_tls(
        count: usize,
        tls: sandfork_tls::TlsFiles,
    ) -> Result<Etcd, HarnessError> {
        let tmp = tempfile::tempdir()?;
        let mut etcd = Etcd::start_with(tmp.path(), count, Some(tls))?;
        etcd._tmp = Some(tmp);
        Ok(etcd)
    }

    /// Starts `count` members with their data dirs and logs under `dir`.
    pub fn start_in(dir: &Path, count: usize) -> Result<Etcd, HarnessError> {
        Etcd::start_with(dir, count, None)
    }

    fn start_with(
        dir: &Path,
        count: usize,
        tls: Option<sandfork_tls::TlsFiles>,
    ) -> Result<Etcd, HarnessError> {
        let mut members = Vec::with_capacity(count);
        for i in 0..count {
            members.push(Member {
                name: format!("m{i}"),
                client_port: free_port()?,
                peer_port: free_port()?,
                child: None,
                scheme: if tls.is_some() { "https" } else { "http" },
            });
        }
        let mut etcd = Etcd {
            members,
            dir: dir.to_owned(),
            tls,
            _tmp: None,
        };
        for i in 0..count {
            etcd.spawn(i)?;
        }
        for i in 0..count {
            etcd.wait_listening(i)?;
        }
        Ok(etcd)
    }

    /// Every member's client URL (the client fails over between them).
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(Member::client_url).collect()
    }

    /// Kills member `i` with SIGKILL (its data stays for a restart).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts member `i` again on its ports and data.
    pub fn restart(&mut self, i: usize) -> Result<(), HarnessError> {
        self.kill(i);
        self.spawn(i)?;
        self.wait_listening(i)
    }

    /// The index of the member that is the leader now, asked of the running
    /// members one by one.
    pub async fn leader(&self) -> Result<usize, HarnessError> {
        for (i, member) in self.members.iter().enumerate() {
            if member.child.is_none() {
                continue;
            }
            let options = match &self.tls {
                Some(files) => {
                    let tls = files.load().map_err(|e| HarnessError::Tls(e.to_string()))?;
                    Some(etcd_client::ConnectOptions::new().with_tls(crate::etcd_tls(&tls)))
                }
                None => None,
            };
            let mut client = etcd_client::Client::connect([member.client_url()], options).await?;
            let Ok(status) = client.status().await else {
                continue;
            };
            let this_member = status.header().map(|h| h.member_id());
            if status.leader() != 0 && this_member == Some(status.leader()) {
                return Ok(i);
            }
        }
        Err(HarnessError::NoLeader)
    }

    /// Waits until the members have a leader, at most `within`: listening
    /// members of a new cluster may still be electing one, and on a loaded
    /// host that outlasts a client's request timeout.
    pub async fn elected(&self, within: Duration) -> Result<usize, HarnessError> {
        let deadline = Instant::now() + within;
        loop {
            match self.leader().await {
                Err(HarnessError::NoLeader) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                r => return r,
            }
        }
    }

    fn spawn(&mut self, i: usize) -> Result<(), HarnessError> {
        let initial_cluster = self
            .members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect::<Vec<_>>()
            .join(",");
        let member = &self.members[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(i))?;
        let mut command = Command::new(std::env::var_os("ETCD").unwrap_or_else(|| "etcd".into()));
        if let Some(tls) = &self.tls {
            let (cert, key, ca) = (tls.cert.display(), tls.key.display(), tls.ca.display());
            command.args([
                format!("--cert-file={cert}"),
                format!("--key-file={key}"),
                format!("--trusted-ca-file={ca}"),
                "--client-cert-auth".to_owned(),
                format!("--peer-cert-file={cert}"),
                format!("--peer-key-file={key}"),
                format!("--peer-trusted-ca-file={ca}"),
                "--peer-client-cert-auth".to_owned(),
            ]);
        }
        let child = command
            .arg(format!("--name={}", member.name))
            .arg(format!(
                "--data-dir={}",
                self.dir.join(&member.name).display()
            ))
            .arg(format!("--listen-client-urls={}", member.client_url()))
            .arg(format!("--advertise-client-urls={}", member.client_url()))
            .arg(format!("--listen-peer-urls={}", member.peer_url()))
            .arg(format!(
                "--initial-advertise-peer-urls={}",
                member.peer_url()
            ))
            .arg(format!("--initial-cluster={initial_cluster}"))
            .arg("--initial-cluster-token=sandfork-test")
            // 3.4's default logger (capnslog) leaves a nil zap logger that a
            // slow read's retry warning dereferences (etcd-io/etcd#14402).
            .args(["--logger=zap", "--log-outputs=stderr"])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.members[i].child = Some(child);
        Ok(())
    }

    fn log_path(&self, i: usize) -> PathBuf {
        self.dir.join(format!("{}.log", self.members[i].name))
    }

    fn wait_listening(&mut self, i: usize) -> Result<(), HarnessError> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = format!("127.0.0.1:{}", self.members[i].client_port);
        loop {
            // Listening is not serving, but the client retries until the
            // members elected a leader; a dead child fails here instead.
            if std::net::TcpStream::connect(&addr).is_ok() {
                return Ok(());
            }
            let exited = match self.members[i].child.as_mut() {
                Some(child) => child.try_wait()?.is_some(),
                None => true,
            };
            if Instant::now() > deadline || exited {
                return Err(HarnessError::NotReady(
                    self.members[i].client_url(),
                    self.log_path(i),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

/// SeaweedFS (`weed server -s3`) with one bucket, `sandfork`.
#[derive(Debug)]
pub struct SeaweedFs {
    child: Child,
    /// `http://127.0.0.1:PORT/sandfork`
    pub url: String,
    _dir: tempfile::TempDir,
}

/// Starts of a weed that exits before it answers: each takes new ports.
const WEED_STARTS: usize = 3;

impl SeaweedFs {
    /// A weed on ports of its own. One that exits before it answers is
    /// started again on new ports: `free_port` frees the port it found, and
    /// another test of the binary may bind it first (seen in a CI run).
    pub fn start() -> Result<SeaweedFs, HarnessError> {
        let mut tries = 0;
        loop {
            tries += 1;
            match Self::start_once() {
                Err(HarnessError::S3Exited(url, _, log)) if tries >= WEED_STARTS => {
                    return Err(HarnessError::S3Exited(url, tries, log));
                }
                Err(HarnessError::S3Exited(..)) => continue,
                other => return other,
            }
        }
    }

    fn start_once() -> Result<SeaweedFs, HarnessError> {
        let dir = tempfile::tempdir()?;
        let log_path = dir.path().join("weed.log");
        let log = std::fs::File::create(&log_path)?;
        // Every service's gRPC port is given too: its default (port + 10000)
        // may be taken or out of range.
        let mut args = vec![
            "server".to_owned(),
            format!("-dir={}", dir.path().display()),
            "-ip=127.0.0.1".into(),
            "-ip.bind=127.0.0.1".into(),
            "-s3".into(),
            "-master.volumeSizeLimitMB=64".into(),
            "-volume.max=16".into(),
            // Off: their fixed ports (8181, 9101) made a second weed of a
            // test run at once exit.
            "-s3.port.iceberg=0".into(),
            "-s3.port.lance=0".into(),
        ];
        let mut s3 = 0;
        for service in ["master", "volume", "filer", "s3"] {
            let port = free_port()?;
            if service == "s3" {
                s3 = port;
            }
            args.push(format!("-{service}.port={port}"));
            args.push(format!("-{service}.port.grpc={}", free_port()?));
        }
        let child = Command::new(std::env::var_os("WEED").unwrap_or_else(|| "weed".into()))
            .args(&args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let mut weed = SeaweedFs {
            child,
            url: format!("http://127.0.0.1:{s3}/sandfork"),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        // Ready when the bucket can be made (the S3 gateway answers before
        // its filer and volume are up).
        while !create_bucket(s3) {
            if weed.child.try_wait()?.is_some() {
                // its directory (and log) goes with it: the log's tail kept
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                let tail = lines[lines.len().saturating_sub(3)..].join(" | ");
                return Err(HarnessError::S3Exited(weed.url.clone(), 1, tail));
            }
            if Instant::now() > deadline {
                return Err(HarnessError::S3NotReady(weed.url.clone(), log_path));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(weed)
    }
}

/// `PUT /sandfork` answered 200 (made) or 409 (there).
fn create_bucket(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let req = format!(
        "PUT /sandfork HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    let mut answer = String::new();
    if s.write_all(req.as_bytes()).is_err() || s.read_to_string(&mut answer).is_err() {
        return false;
    }
    answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.1 409")
}

impl Drop for SeaweedFs {
    fn drop(&mut self) {
        // SIGKILL: after SIGTERM weed has been seen to linger.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Another node's pass of the store's collector under way, as far as etcd
/// tells (`store-gc/pass` held under a lease): collectors and uploads see
/// it until [`ForeignPass::end`].
pub struct ForeignPass {
    client: etcd_client::Client,
    lease: i64,
}

impl std::fmt::Debug for ForeignPass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The etcd client prints nothing of use.
        f.debug_struct("ForeignPass")
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl ForeignPass {
    pub async fn start(
        cluster: &crate::Cluster,
        node_id: &str,
    ) -> Result<ForeignPass, HarnessError> {
        let mut client = cluster.client();
        let lease = client.lease_grant(60, None).await?.id();
        let held = etcd_client::PutOptions::new().with_lease(lease);
        client
            .put(crate::keyspace::STORE_GC_PASS, node_id, Some(held))
            .await?;
        Ok(ForeignPass { client, lease })
    }

    pub async fn end(mut self) -> Result<(), HarnessError> {
        self.client.lease_revoke(self.lease).await?;
        Ok(())
    }
}

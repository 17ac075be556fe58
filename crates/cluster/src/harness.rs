//! A real etcd member for tests: Debian's `etcd` on loopback, on ports
//! free at start, its data dir in a temporary directory, killed on drop.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Etcd {
    child: Child,
    pub endpoint: String,
    _dir: Option<tempfile::TempDir>,
}

#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("etcd did not answer on {0} within 20 s (log in {1})")]
    NotReady(String, PathBuf),
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Etcd {
    /// Starts a one-member cluster in a new temporary directory.
    pub fn start() -> Result<Etcd, HarnessError> {
        let dir = tempfile::tempdir()?;
        let mut etcd = Etcd::start_in(dir.path())?;
        etcd._dir = Some(dir);
        Ok(etcd)
    }

    /// Starts one member with its data dir and log under `dir`.
    pub fn start_in(dir: &Path) -> Result<Etcd, HarnessError> {
        let (client, peer) = (free_port()?, free_port()?);
        let endpoint = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log_path = dir.join("etcd.log");
        let log = std::fs::File::create(&log_path)?;
        let child = Command::new(std::env::var_os("ETCD").unwrap_or_else(|| "etcd".into()))
            .arg("--name=test")
            .arg(format!("--data-dir={}", dir.join("etcd").display()))
            .arg(format!("--listen-client-urls={endpoint}"))
            .arg(format!("--advertise-client-urls={endpoint}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=test={peer_url}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let mut etcd = Etcd {
            child,
            endpoint,
            _dir: None,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = format!("127.0.0.1:{client}");
        loop {
            // Listening is not serving, but the client retries until the
            // member elected itself; a dead child fails here instead.
            if std::net::TcpStream::connect(&addr).is_ok() {
                return Ok(etcd);
            }
            if Instant::now() > deadline || etcd.child.try_wait()?.is_some() {
                return Err(HarnessError::NotReady(etcd.endpoint.clone(), log_path));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn endpoints(&self) -> Vec<String> {
        vec![self.endpoint.clone()]
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

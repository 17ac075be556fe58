//! Real servers for tests, on loopback, on ports free at start, their data
//! in a temporary directory, killed on drop: an etcd member (Debian's
//! `etcd`) and an S3 server (SeaweedFS's `weed`, installed by
//! scripts/deps.sh; `$WEED` names another binary).

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
    #[error("the S3 server did not answer on {0} within 60 s (log in {1})")]
    S3NotReady(String, PathBuf),
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

/// SeaweedFS (`weed server -s3`) with one bucket, `sandfork`.
pub struct SeaweedFs {
    child: Child,
    /// `http://127.0.0.1:PORT/sandfork`
    pub url: String,
    _dir: tempfile::TempDir,
}

impl SeaweedFs {
    pub fn start() -> Result<SeaweedFs, HarnessError> {
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
            if Instant::now() > deadline || weed.child.try_wait()?.is_some() {
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

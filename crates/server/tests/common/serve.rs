//! `sandfork serve` as a child process, for the tests that restart or crash
//! a node (a restart is a new process on the same data dir: the store is open
//! in one process at a time).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::{http, vmm_binary};

pub struct ServeProcess {
    pub addr: SocketAddr,
    pub data: PathBuf,
    pub key: String,
    child: Option<Child>,
    starts: u32,
}

impl ServeProcess {
    /// A node on a free loopback port with data dir `data` and API key
    /// `key`, not started.
    pub fn new(data: &Path, key: &str) -> ServeProcess {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        ServeProcess {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            data: data.to_owned(),
            key: key.to_owned(),
            child: None,
            starts: 0,
        }
    }

    /// Starts `sandfork serve --in-lab --data-dir DATA` with `args` (which
    /// name `--listen`: loopback or every address) and `env`; its output goes
    /// to `serve-N.log` in the data dir, N counting the starts.
    pub fn spawn(&mut self, args: &[String], env: &[(&str, &str)]) {
        self.starts += 1;
        let log = std::fs::File::create(self.data.join(format!("serve-{}.log", self.starts)))
            .expect("creating the server log");
        let sandfork = vmm_binary().with_file_name("sandfork");
        let child = Command::new(&sandfork)
            .args(["serve", "--in-lab", "--data-dir"])
            .arg(&self.data)
            .args(args)
            .env("SANDFORK_API_KEY", &self.key)
            .env("SANDFORK_VMM", vmm_binary())
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", sandfork.display()));
        self.child = Some(child);
    }

    /// Until `/health` answers 204; the server's log if it exits first.
    pub async fn wait_up(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            if tokio::net::TcpStream::connect(self.addr).await.is_ok()
                && http(self.addr, "GET", "/health", &[], "").await.status == 204
            {
                return;
            }
            if let Some(status) = self.try_wait() {
                panic!("the server exited ({status}):\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "no /health:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The last start's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.data.join(format!("serve-{}.log", self.starts)))
            .unwrap_or_default()
    }

    /// The running server's exit, if it has ended (then it is gone).
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        let status = self.child.as_mut().expect("a server").try_wait().unwrap()?;
        self.child = None;
        Some(status)
    }

    /// SIGKILL: the server gets no chance to do anything.
    pub fn crash(&mut self) {
        let mut server = self.child.take().unwrap();
        server.kill().unwrap();
        server.wait().unwrap();
    }

    /// SIGTERM, as a service manager stops it (running sandboxes stay); the
    /// exit must be clean.
    pub fn stop(&mut self) {
        let mut server = self.child.take().unwrap();
        let status = Command::new("kill")
            .args(["-TERM", &server.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = server.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "the server's exit: {status}\n{}",
                    self.log()
                );
                return;
            }
            assert!(Instant::now() < deadline, "no exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn auth(&self) -> [(&'static str, &str); 2] {
        [
            ("x-api-key", self.key.as_str()),
            ("content-type", "application/json"),
        ]
    }
}

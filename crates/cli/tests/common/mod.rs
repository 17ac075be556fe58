//! Runs the real `sandfork` binary with a clean environment: its own config
//! directory, and no node settings except those a test gives.
#![allow(dead_code)] // each test binary uses its own part

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

pub struct Cli {
    pub config_home: tempfile::TempDir,
    pub env: Vec<(String, String)>,
}

pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout is not JSON ({e}): {:?}\n{}",
                self.stdout, self.stderr
            )
        })
    }

    /// Asserts success and returns stdout.
    pub fn ok(&self) -> &str {
        assert_eq!(
            self.code, 0,
            "stdout: {}\nstderr: {}",
            self.stdout, self.stderr
        );
        &self.stdout
    }

    /// Asserts failure with exactly one line on stderr and returns it.
    pub fn one_line_error(&self, code: i32) -> &str {
        assert_eq!(
            self.code, code,
            "stdout: {}\nstderr: {}",
            self.stdout, self.stderr
        );
        assert_eq!(self.stderr.lines().count(), 1, "stderr: {:?}", self.stderr);
        self.stderr.trim_end()
    }
}

pub fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sandfork"))
}

impl Cli {
    pub fn new() -> Cli {
        Cli {
            config_home: tempfile::tempdir().unwrap(),
            env: Vec::new(),
        }
    }

    /// A client of the node at `url` with the API key `key`.
    pub fn of_node(url: &str, key: &str) -> Cli {
        Cli::new()
            .with("SANDFORK_API_URL", url)
            .with("SANDFORK_API_KEY", key)
    }

    pub fn with(mut self, key: &str, value: &str) -> Cli {
        self.env.push((key.into(), value.into()));
        self
    }

    pub fn config_file(&self) -> PathBuf {
        self.config_home.path().join("sandfork/config.json")
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(binary());
        cmd.args(args)
            .env_remove("SANDFORK_API_URL")
            .env_remove("SANDFORK_API_KEY")
            .env_remove("SANDFORK_CONFIG")
            .env_remove("E2B_API_URL")
            .env_remove("E2B_API_KEY")
            .env("XDG_CONFIG_HOME", self.config_home.path())
            .stdin(Stdio::null());
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd
    }

    pub fn run(&self, args: &[&str]) -> Run {
        let out = self.command(args).output().unwrap();
        to_run(out)
    }

    /// With `input` on stdin.
    pub fn run_with_input(&self, args: &[&str], input: &[u8]) -> Run {
        use std::io::Write;
        let mut child = self
            .command(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(input).unwrap();
        to_run(child.wait_with_output().unwrap())
    }
}

fn to_run(out: Output) -> Run {
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A local port nothing listens on (bound, then released).
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

pub fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

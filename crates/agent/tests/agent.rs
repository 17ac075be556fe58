//! Runs the real agent binary: on TCP in host mode, and as PID 1 of fresh user,
//! PID, mount, UTS and network namespaces (the closest thing to a guest boot
//! without a VM).

#![cfg(test)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

const AGENT: &str = env!("CARGO_BIN_EXE_sandfork-agent");

/// The agent's stderr, line by line, with everything seen so far.
struct Log {
    rx: Receiver<String>,
    seen: Vec<String>,
}

impl Log {
    fn capture(child: &mut Child) -> Self {
        let stderr = child.stderr.take().expect("stderr piped");
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[agent] {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            rx,
            seen: Vec::new(),
        }
    }

    /// Waits for a line containing `needle` and returns it.
    fn wait_for(&mut self, needle: &str, timeout: Duration) -> String {
        if let Some(l) = self.seen.iter().find(|l| l.contains(needle)) {
            return l.clone();
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(_) => panic!("no line with {needle:?} in {:#?}", self.seen),
            }
        }
    }

    /// Waits until `n` lines containing `needle` have been seen.
    fn wait_for_count(&mut self, needle: &str, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.seen.iter().filter(|l| l.contains(needle)).count() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(_) => panic!("fewer than {n} lines with {needle:?} in {:#?}", self.seen),
            }
        }
    }

    /// Collects whatever is left once the agent has exited.
    fn drain(&mut self) {
        while let Ok(line) = self.rx.recv_timeout(Duration::from_secs(2)) {
            self.seen.push(line);
        }
    }

    fn has(&self, needle: &str) -> bool {
        self.seen.iter().any(|l| l.contains(needle))
    }
}

fn wait_exit(child: &mut Child, timeout: Duration) -> ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("agent did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) on a pid we spawned (or found as its child) and still track.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, sig) }, 0);
}

/// One HTTP/1.1 request over a fresh connection; returns the whole response.
fn http(addr: &str, request_line: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "{request_line}\r\nHost: agent\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn spawn_host_mode(extra: &[&str]) -> (Child, Log) {
    let mut child = Command::new(AGENT)
        .args(["--listen-tcp", "127.0.0.1:0"])
        .args(extra)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = Log::capture(&mut child);
    (child, log)
}

fn tcp_addr(log: &mut Log) -> String {
    let line = log.wait_for("listening on tcp ", Duration::from_secs(10));
    line.rsplit(' ').next().unwrap().to_string()
}

#[test]
fn host_mode_serves_health_and_404_then_exits_on_sigterm() {
    let (mut child, mut log) = spawn_host_mode(&["--no-vsock"]);
    let addr = tcp_addr(&mut log);

    let health = http(&addr, "GET /health HTTP/1.1");
    assert!(
        health.starts_with("HTTP/1.1 204 No Content\r\n"),
        "{health}"
    );
    let unknown = http(&addr, "GET /no/such/route HTTP/1.1");
    assert!(
        unknown.starts_with("HTTP/1.1 404 Not Found\r\n"),
        "{unknown}"
    );

    signal(child.id(), libc::SIGTERM);
    let status = wait_exit(&mut child, Duration::from_secs(10));
    assert!(status.success(), "{status:?}");
    log.drain();
    assert!(log.has("SIGTERM: exiting"), "{:#?}", log.seen);
    // Not PID 1: none of the guest setup ran.
    assert!(!log.has("loopback"), "{:#?}", log.seen);
    assert!(!log.has("hostname"), "{:#?}", log.seen);
    assert!(!log.has("shutting down"), "{:#?}", log.seen);
}

#[test]
fn host_mode_exits_cleanly_on_sigint_too() {
    let (mut child, mut log) = spawn_host_mode(&["--no-vsock"]);
    tcp_addr(&mut log);
    signal(child.id(), libc::SIGINT);
    assert!(wait_exit(&mut child, Duration::from_secs(10)).success());
}

#[test]
fn vsock_listener_binds_or_is_skipped_with_a_warning() {
    let port = 40_000 + std::process::id() % 20_000;
    let (mut child, mut log) = spawn_host_mode(&["--vsock-port", &port.to_string()]);
    let addr = tcp_addr(&mut log);
    let line = log.wait_for("vsock", Duration::from_secs(10));
    assert!(
        line.ends_with(&format!("listening on vsock port {port}"))
            || line.contains("warn: no AF_VSOCK in this kernel"),
        "{line}"
    );
    // Whatever vsock did, TCP still serves.
    assert!(http(&addr, "GET /health HTTP/1.1").starts_with("HTTP/1.1 204"));
    signal(child.id(), libc::SIGTERM);
    assert!(wait_exit(&mut child, Duration::from_secs(10)).success());
}

#[test]
fn bad_arguments_fail_outside_pid1() {
    let out = Command::new(AGENT)
        .args(["--listen-tcp", "not-an-address"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("usage:"));
}

/// (pid, state, comm) of every process whose parent is `parent`.
fn children_of(parent: u32) -> Vec<(u32, char, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // comm is in parentheses and may hold spaces; the fields after it are fixed.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = stat[open + 1..close].to_string();
        let mut rest = stat[close + 1..].split_whitespace();
        let state = rest.next().and_then(|s| s.chars().next()).unwrap_or('?');
        let ppid: u32 = rest.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        if ppid == parent {
            out.push((pid, state, comm));
        }
    }
    out
}

const NAMESPACES: &[&str] = &[
    "--user",
    "--map-root-user",
    "--pid",
    "--fork",
    "--mount",
    "--mount-proc",
    "--uts",
    "--net",
];

fn namespaces_available() -> bool {
    Command::new("unshare")
        .args(NAMESPACES)
        .arg("true")
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The agent as PID 1 of new namespaces: it adopts orphans and reaps them, brings
/// up the namespace's loopback, and on SIGTERM kills everything and "reboots"
/// (which ends a PID namespace). A user namespace keeps host filesystems, host
/// name and host network out of its reach.
#[test]
fn pid1_in_namespaces_reaps_orphans_and_shuts_down() {
    if !namespaces_available() {
        eprintln!("SKIPPED: `unshare --user --pid ...` is not permitted here");
        return;
    }
    // Orphans: each subshell exits at once, leaving its sleep to PID 1, which by
    // then is the agent (exec keeps the PID).
    let script = r#"
        (sleep 0.5 &)
        (sleep 0.6 &)
        (sleep 1000 &)
        exec "$0" --no-vsock
    "#;
    let mut child = Command::new("unshare")
        .args(NAMESPACES)
        .args(["sh", "-c", script, AGENT])
        .env("SANDFORK_AGENT_LOG", "debug")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut log = Log::capture(&mut child);
    log.wait_for("serving nothing", Duration::from_secs(10));
    assert!(log.has("container mode"), "{:#?}", log.seen);
    assert!(log.has("loopback up"), "{:#?}", log.seen);

    let agent = children_of(child.id())
        .first()
        .map(|c| c.0)
        .expect("unshare's child");
    // The kernel added 127.0.0.1 to lo in the agent's network namespace: lo is up.
    let fib = std::fs::read_to_string(format!("/proc/{agent}/net/fib_trie")).unwrap();
    assert!(fib.contains("127.0.0.1"), "{fib}");

    // Both short orphans die after the agent started; nobody but it can reap them.
    let deadline = Instant::now() + Duration::from_secs(10);
    let orphan = loop {
        let kids = children_of(agent);
        let sleepers: Vec<_> = kids.iter().filter(|k| k.2 == "sleep").collect();
        let zombies: Vec<_> = kids.iter().filter(|k| k.1 == 'Z').collect();
        if sleepers.len() == 1 && zombies.is_empty() {
            break sleepers[0].0;
        }
        assert!(Instant::now() < deadline, "children of the agent: {kids:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    log.wait_for_count("reaped Exited", 2, Duration::from_secs(5));

    signal(agent, libc::SIGTERM);
    let status = wait_exit(&mut child, Duration::from_secs(15));
    log.drain();
    assert!(log.has("SIGTERM: shutting down"), "{:#?}", log.seen);
    assert!(
        log.has("container mode: leaving filesystems mounted"),
        "{:#?}",
        log.seen
    );
    assert!(log.has("rebooting"), "{:#?}", log.seen);
    // reboot() in a child PID namespace ends it; it must not have failed.
    assert!(!log.has("reboot: "), "{:#?}", log.seen);
    assert!(
        !log.has("SIGKILL"),
        "sleep ignores nothing: {:#?}",
        log.seen
    );
    assert!(
        !std::path::Path::new(&format!("/proc/{orphan}")).exists(),
        "the long-lived orphan {orphan} survived shutdown"
    );
    // The kernel ends a PID namespace whose init calls reboot(RB_AUTOBOOT) as if
    // its init died of SIGHUP; unshare passes that on.
    use std::os::unix::process::ExitStatusExt;
    assert!(
        status.signal() == Some(libc::SIGHUP) || status.code() == Some(128 + libc::SIGHUP),
        "{status:?}"
    );
}

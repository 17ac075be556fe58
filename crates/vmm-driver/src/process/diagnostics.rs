//! What a VMM and its host look like when a guest stops answering: the
//! guest console's tail, the VMM's log, what each vCPU thread is doing,
//! the VMM's threads as the host kernel sees them, and the host kernel's
//! own recent messages (in the KVM lab: the lab machine's, where nested
//! KVM reports its trouble), and the host's KVM trace of the VMM's threads
//! when KVM events are traced. Every part is bounded in size and time, and a
//! part that cannot be read says why instead of failing the rest.

use std::fmt::Write as _;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Duration;

use crate::VmmClient;

/// Lines kept of the console and of the VMM's log.
const LOG_LINES: usize = 40;
/// Kernel messages kept: enough for a whole oops with its stack.
pub const KERNEL_LINES: usize = 120;
/// How long the VMM may take to report its vCPUs.
const VCPU_REPORT_TIMEOUT: Duration = Duration::from_secs(3);

/// The last `n` lines of a file, or why it cannot be read.
pub fn file_tail(path: &Path, n: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => tail(&String::from_utf8_lossy(&bytes), n),
        Err(e) => format!("({} unreadable: {e})", path.display()),
    }
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let skipped = lines.len().saturating_sub(n);
    let mut out = String::new();
    if skipped > 0 {
        let _ = writeln!(out, "({skipped} earlier lines left out)");
    }
    out.push_str(&lines[skipped..].join("\n"));
    out
}

/// /proc reports CPU times in USER_HZ ticks, 100 a second on x86.
const USER_HZ: f64 = 100.0;

/// The threads of process `pid`: name, scheduler state, CPU time used and
/// the kernel function a sleeping one waits in.
pub fn threads(pid: u32) -> String {
    let dir = format!("/proc/{pid}/task");
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) => return format!("(no {dir}: {e})"),
    };
    let mut tids: Vec<u32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_unstable();
    let mut out = String::new();
    for tid in tids {
        let read = |file: &str| {
            std::fs::read_to_string(format!("{dir}/{tid}/{file}"))
                .map(|s| s.trim().to_owned())
                .unwrap_or_default()
        };
        let stat = read("stat");
        // The state follows the parenthesised name, which may hold blanks.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or("?")
            .to_owned();
        // utime and stime, the 12th and 13th fields after the name.
        let cpu_ticks: u64 = stat
            .rsplit_once(')')
            .map(|(_, rest)| {
                rest.split_whitespace()
                    .skip(11)
                    .take(2)
                    .filter_map(|t| t.parse::<u64>().ok())
                    .sum()
            })
            .unwrap_or(0);
        let wchan = read("wchan");
        let wchan = if wchan.is_empty() || wchan == "0" {
            "-".to_owned()
        } else {
            wchan
        };
        let _ = writeln!(
            out,
            "{tid} {:<16} {state} {:>7.2}s {wchan}",
            read("comm"),
            cpu_ticks as f64 / USER_HZ
        );
    }
    out
}

/// The last `n` messages of the kernel log (`/dev/kmsg`, which needs root),
/// with their time since boot.
pub fn kernel_messages(n: usize) -> String {
    let mut kmsg = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits())
        .open("/dev/kmsg")
    {
        Ok(f) => f,
        Err(e) => return format!("(/dev/kmsg unreadable: {e})"),
    };
    let mut lines = std::collections::VecDeque::with_capacity(n);
    // One record per read; EAGAIN at the end, EPIPE when the ring overwrote
    // the record we were at (the next read goes on from the oldest).
    let mut record = vec![0u8; 8192];
    loop {
        match kmsg.read(&mut record) {
            Ok(0) => break,
            Ok(len) => {
                let text = String::from_utf8_lossy(&record[..len]);
                // "<prio>,<seq>,<usec>,<flags>[,...];<message>\n", then
                // " KEY=value" lines of device metadata, left out.
                if let Some((prefix, rest)) = text.split_once(';') {
                    let message = rest.split('\n').next().unwrap_or_default();
                    let usec: u64 = prefix
                        .split(',')
                        .nth(2)
                        .and_then(|u| u.parse().ok())
                        .unwrap_or(0);
                    if lines.len() == n {
                        lines.pop_front();
                    }
                    lines.push_back(format!(
                        "[{:>6}.{:06}] {}",
                        usec / 1_000_000,
                        usec % 1_000_000,
                        message.trim_end()
                    ));
                }
            }
            Err(e) if e.raw_os_error() == Some(nix::libc::EPIPE) => continue,
            Err(_) => break,
        }
    }
    Vec::from(lines).join("\n")
}

/// One report per line, or why the VMM gave none.
fn lines<T: std::fmt::Display>(reports: Result<Vec<T>, crate::ClientError>, what: &str) -> String {
    match reports {
        Ok(reports) => reports
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n"),
        Err(e) => format!("(no {what} report: {e})"),
    }
}

/// Everything above for the VMM in `dir` (process `pid`, API at `api`).
pub async fn diagnose(dir: &Path, pid: u32, api: &VmmClient) -> String {
    // First: asking for the vCPUs' state below kicks them out of the guest.
    let kvm_trace = super::kvm_trace::report(pid)
        .map(|trace| format!("--- host KVM trace of the VMM's threads ---\n{trace}"))
        .unwrap_or_default();
    let api = api.clone().with_request_timeout(VCPU_REPORT_TIMEOUT);
    let vcpus = lines(api.get_vcpus().await, "vCPU");
    let devices = lines(api.get_devices().await, "device");
    format!(
        "--- console (tail) ---\n{}\n--- vmm log (tail) ---\n{}\n--- vCPUs ---\n{vcpus}\n\
         --- virtio devices ---\n{devices}\n\
         --- VMM threads (pid {pid}: tid, name, state, CPU time, wait channel) ---\n{}\
         {kvm_trace}--- host kernel messages (tail) ---\n{}\n--- end of diagnostics ---",
        file_tail(&dir.join("console.log"), LOG_LINES),
        file_tail(&dir.join("vmm.log"), LOG_LINES),
        threads(pid),
        kernel_messages(KERNEL_LINES),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines_and_says_how_many_it_left_out() {
        assert_eq!(tail("a\nb\nc\n", 2), "(1 earlier lines left out)\nb\nc");
        assert_eq!(tail("a\nb", 5), "a\nb");
    }

    #[test]
    fn threads_names_each_thread_of_this_process() {
        let (started, wait) = std::sync::mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("diag-probe".into())
            .spawn(move || {
                started.send(()).unwrap();
                std::thread::sleep(Duration::from_secs(2))
            })
            .unwrap();
        wait.recv().unwrap();
        // The thread names itself as it starts; give it a moment to sleep.
        std::thread::sleep(Duration::from_millis(100));
        let listing = threads(std::process::id());
        assert!(
            listing
                .lines()
                .any(|l| l.contains("diag-probe") && l.contains(" S ")),
            "{listing}"
        );
        handle.join().unwrap();
        assert!(threads(u32::MAX).starts_with("(no /proc/"));
    }

    #[test]
    fn kernel_messages_end_with_the_newest() {
        // Root may write to the kernel log (CI runs as root); others are told
        // why they cannot read it.
        let marker = format!("sandfork diagnostics test {}", std::process::id());
        if std::fs::write("/dev/kmsg", format!("{marker}\n")).is_err() {
            assert!(kernel_messages(3).starts_with("(/dev/kmsg unreadable"));
            return;
        }
        let text = kernel_messages(3);
        assert!(text.lines().count() <= 3, "{text}");
        assert!(text.lines().any(|l| l.ends_with(&marker)), "{text}");
    }
}

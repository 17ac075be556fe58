//! The host kernel's KVM trace events, for diagnosing a guest that stops
//! answering: which exits its vCPU threads took last, and how often each
//! (exit reason, guest RIP) came round. In the KVM lab this is the lab
//! machine's KVM, the one that runs our guests nested under QEMU, where a
//! lost guest's vCPU is seen sitting at one intercepted instruction.
//!
//! Tracing is off unless something turned it on ([`enable`], e.g.
//! `sandfork stress --kvm-trace`); [`report`] then adds the VMM's part of
//! the trace buffer to its diagnostics.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Where tracefs is mounted on current kernels, and where older ones have it.
const TRACEFS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];
/// Lines of each thread's own trace kept in a report.
const THREAD_LINES: usize = 30;
/// (exit reason, RIP) pairs listed in a report, most frequent first.
const TOP_EXITS: usize = 12;

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot mount tracefs at {path}: {source}")]
    Mount {
        path: String,
        #[source]
        source: nix::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn tracefs() -> Option<PathBuf> {
    TRACEFS
        .iter()
        .map(PathBuf::from)
        .find(|p| p.join("trace").exists())
}

fn write(dir: &Path, file: &str, value: &str) -> Result<(), TraceError> {
    let path = dir.join(file);
    std::fs::write(&path, value).map_err(|source| TraceError::Write { path, source })
}

/// Turns on every KVM trace event into a ring buffer of `buffer_kib` per
/// CPU that overwrites its oldest entries, mounting tracefs first if it is
/// not (needs root). Returns the tracefs directory.
pub fn enable(buffer_kib: u32) -> Result<PathBuf, TraceError> {
    let dir = match tracefs() {
        Some(dir) => dir,
        None => {
            let dir = TRACEFS[0];
            nix::mount::mount(
                Some("tracefs"),
                dir,
                Some("tracefs"),
                nix::mount::MsFlags::empty(),
                None::<&str>,
            )
            .map_err(|source| TraceError::Mount {
                path: dir.to_owned(),
                source,
            })?;
            PathBuf::from(dir)
        }
    };
    write(&dir, "tracing_on", "0")?;
    write(&dir, "buffer_size_kb", &buffer_kib.to_string())?;
    write(&dir, "options/overwrite", "1")?;
    // Emptied, so a report holds only what happened since.
    write(&dir, "trace", "")?;
    write(&dir, "events/kvm/enable", "1")?;
    write(&dir, "tracing_on", "1")?;
    Ok(dir)
}

/// The KVM trace of process `pid`'s threads, or `None` when KVM events are
/// not being traced.
pub fn report(pid: u32) -> Option<String> {
    let dir = tracefs()?;
    let on = |file: &str| {
        std::fs::read_to_string(dir.join(file))
            .map(|s| s.trim() != "0")
            .unwrap_or(false)
    };
    if !on("tracing_on") || !on("events/kvm/enable") {
        return None;
    }
    let tids = thread_ids(pid);
    // Reading the non-consuming `trace` file pauses recording meanwhile.
    let text = match std::fs::read(dir.join("trace")) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) => return Some(format!("(trace unreadable: {e})")),
    };
    Some(summarize(&text, &tids))
}

fn thread_ids(pid: u32) -> HashSet<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// One event line of the trace file:
/// `  <comm>-<tid>  [<cpu>] <flags>  <secs>: <event>: <fields>`.
#[derive(Debug, PartialEq)]
struct Event<'a> {
    tid: u32,
    secs: f64,
    name: &'a str,
    fields: &'a str,
}

fn parse(line: &str) -> Option<Event<'_>> {
    let (task, rest) = line.split_once(" [")?;
    let tid = task.trim().rsplit_once('-')?.1.parse().ok()?;
    let (_, rest) = rest.split_once(']')?;
    // The flags (e.g. "d..1.") then the timestamp, ending in ':'.
    let (head, rest) = rest.split_once(": ")?;
    let secs = head.split_whitespace().last()?.parse().ok()?;
    let (name, fields) = rest.split_once(": ").unwrap_or((rest, ""));
    Some(Event {
        tid,
        secs,
        name: name.trim(),
        fields: fields.trim(),
    })
}

/// `kvm_exit: vcpu 0 reason msr rip 0xffffffff81071234 info1 ...` -> (reason, rip).
fn exit_site(fields: &str) -> Option<(&str, &str)> {
    let mut words = fields.split_whitespace();
    let mut reason = None;
    let mut rip = None;
    while let Some(word) = words.next() {
        match word {
            "reason" => reason = words.next(),
            "rip" => rip = words.next(),
            _ => {}
        }
    }
    Some((reason?, rip?))
}

/// Events of any thread that raise a guest interrupt line: irqfd injections
/// run on kernel workers, not on the VMM's threads.
const IRQ_EVENTS: [&str; 4] = [
    "kvm_set_irq",
    "kvm_ioapic_set_irq",
    "kvm_msi_set_irq",
    "kvm_pic_set_irq",
];
/// Lines of interrupt-line events kept in a report.
const IRQ_LINES: usize = 12;

fn count<'a>(counts: &mut BTreeMap<&'a str, usize>, key: &'a str) {
    *counts.entry(key).or_default() += 1;
}

fn ranked<K: std::fmt::Display>(counts: BTreeMap<K, usize>, n: usize) -> String {
    let mut ranked: Vec<_> = counts.into_iter().collect();
    ranked.sort_by_key(|(_, count)| std::cmp::Reverse(*count));
    ranked
        .iter()
        .take(n)
        .map(|(key, count)| format!("  {count:>8}  {key}\n"))
        .collect()
}

fn summarize(text: &str, tids: &HashSet<u32>) -> String {
    let mut per_thread: BTreeMap<u32, Vec<&str>> = BTreeMap::new();
    let mut exits: BTreeMap<String, usize> = BTreeMap::new();
    let mut injected: BTreeMap<&str, usize> = BTreeMap::new();
    let mut to_userspace: BTreeMap<&str, usize> = BTreeMap::new();
    let mut irq_lines: BTreeMap<&str, usize> = BTreeMap::new();
    let mut irq_tail: Vec<&str> = Vec::new();
    let (mut first, mut last) = (f64::MAX, 0f64);
    let mut events = 0usize;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(event) = parse(line) else { continue };
        if IRQ_EVENTS.contains(&event.name) {
            count(&mut irq_lines, event.fields);
            irq_tail.push(line.trim());
        }
        if !tids.contains(&event.tid) {
            continue;
        }
        events += 1;
        first = first.min(event.secs);
        last = last.max(event.secs);
        match event.name {
            "kvm_exit" => {
                if let Some((reason, rip)) = exit_site(event.fields) {
                    *exits.entry(format!("{reason:<16} {rip}")).or_default() += 1;
                }
            }
            "kvm_inj_virq" => count(&mut injected, event.fields),
            "kvm_userspace_exit" => count(&mut to_userspace, event.fields),
            _ => {}
        }
        per_thread.entry(event.tid).or_default().push(line.trim());
    }
    let mut out = String::new();
    if events == 0 {
        let _ = writeln!(out, "(no KVM events of this VMM's threads in the buffer)");
    } else {
        let _ = writeln!(
            out,
            "{events} events over {:.3} s ({first:.3}..{last:.3}); guest exits by reason and RIP:",
            last - first
        );
        out.push_str(&ranked(exits, TOP_EXITS));
        let _ = writeln!(out, "interrupts injected:");
        out.push_str(&ranked(injected, TOP_EXITS));
        let _ = writeln!(out, "returns to the VMM:");
        out.push_str(&ranked(to_userspace, TOP_EXITS));
    }
    let _ = writeln!(out, "interrupt lines raised (any VM on this host):");
    out.push_str(&ranked(irq_lines, TOP_EXITS));
    let skipped = irq_tail.len().saturating_sub(IRQ_LINES);
    for line in &irq_tail[skipped..] {
        let _ = writeln!(out, "  {line}");
    }
    for (tid, lines) in &per_thread {
        let skipped = lines.len().saturating_sub(THREAD_LINES);
        let _ = writeln!(out, "thread {tid}: last {} events", lines.len() - skipped);
        for line in &lines[skipped..] {
            let _ = writeln!(out, "  {line}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: &str = "\
# tracer: nop
#
           <...>-812     [000] d..1.   101.000100: kvm_exit: vcpu 0 reason msr rip 0xffffffff8107a2b4 info1 0x0000000000000001 info2 0x0000000000000000 intr_info 0x00000000 error_code 0x00000000
     fc_vcpu 1-813     [000] d..1.   101.000200: kvm_exit: vcpu 1 reason hlt rip 0xffffffff81b2c0d1 info1 0x0 info2 0x0 intr_info 0x00000000 error_code 0x00000000
           <...>-812     [000] d..1.   101.000300: kvm_msr: msr_write 80b = 0x0
           <...>-812     [000] d..1.   101.000400: kvm_exit: vcpu 0 reason msr rip 0xffffffff8107a2b4 info1 0x1 info2 0x0 intr_info 0x00000000 error_code 0x00000000
     kworker/0:1-44      [000] .....   101.000500: kvm_set_irq: gsi 5 level 1 source 0
           <...>-813     [000] .....   101.000600: kvm_inj_virq: IRQ 0x30
          qemu-900     [000] d..1.   102.000000: kvm_exit: vcpu 0 reason npf rip 0x1000 info1 0x0 info2 0x0 intr_info 0x0 error_code 0x0
";

    #[test]
    fn parses_an_event_line_with_blanks_in_the_thread_name() {
        let line = TRACE.lines().nth(3).unwrap();
        let event = parse(line).unwrap();
        assert_eq!(event.tid, 813);
        assert_eq!(event.name, "kvm_exit");
        assert!((event.secs - 101.0002).abs() < 1e-9);
        assert_eq!(exit_site(event.fields), Some(("hlt", "0xffffffff81b2c0d1")));
        assert_eq!(parse("# tracer: nop"), None);
    }

    #[test]
    fn summary_counts_only_the_vmm_threads_exits_most_frequent_first() {
        let text = summarize(TRACE, &HashSet::from([812, 813]));
        assert!(text.starts_with("5 events over 0.001 s"), "{text}");
        let ranked: Vec<&str> = text.lines().skip(1).take(2).collect();
        assert!(ranked[0].contains("2  msr") && ranked[0].ends_with("0xffffffff8107a2b4"));
        assert!(ranked[1].contains("1  hlt"));
        assert!(text.contains("1  gsi 5 level 1 source 0"), "{text}");
        assert!(text.contains("1  IRQ 0x30"), "{text}");
        assert!(!text.contains("npf"), "another process's exit: {text}");
        assert!(text.contains("thread 812: last 3 events"));
        let none = summarize(TRACE, &HashSet::from([1]));
        assert!(none.starts_with("(no KVM events"));
        assert!(none.contains("gsi 5 level 1"), "{none}");
    }
}

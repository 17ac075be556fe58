//! The soak's report: one JSON object for machines, a few lines for people,
//! and whether it passed (no failed operation, the server's RSS grown no
//! more than the bound).

use std::fmt::Write as _;

use serde_json::{Value, json};

use super::memory::{self, NodeMemory};
use super::{Ended, Soak};

/// How many failures the JSON lists in full (all are counted).
const FIRST_FAILURES: usize = 10;

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// `{p50, p99, max, samples}` in ms; null without samples.
pub fn latency(samples: &[f64]) -> Value {
    if samples.is_empty() {
        return Value::Null;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    json!({
        "p50": round1(percentile(&sorted, 50.0)),
        "p99": round1(percentile(&sorted, 99.0)),
        "max": round1(sorted[sorted.len() - 1]),
        "samples": sorted.len(),
    })
}

/// Where two byte strings first differ, or None when they are equal.
pub fn difference(sent: &[u8], back: &[u8]) -> Option<String> {
    if sent == back {
        return None;
    }
    let at = sent
        .iter()
        .zip(back)
        .position(|(a, b)| a != b)
        .unwrap_or(sent.len().min(back.len()));
    Some(format!(
        "read back {} bytes of {} written, first difference at byte {at}",
        back.len(),
        sent.len()
    ))
}

pub(super) fn report(
    soak: &Soak<'_>,
    ended: Ended,
    memory_not_read: Option<&str>,
    node_info: &Value,
) -> Value {
    let record = &soak.record;
    let bounds = soak.bounds;
    let failures = record.failures.borrow();
    let mut by_op = serde_json::Map::new();
    for f in failures.iter() {
        let n = by_op.get(f.op).and_then(Value::as_u64).unwrap_or(0);
        by_op.insert(f.op.to_owned(), json!(n + 1));
    }
    let before = record.memory_before.get();
    let after = record.memory_after.get();
    let growth = before.zip(after).map(|(b, a)| memory::growth_json(b, a));
    let server_growth = growth.as_ref().and_then(|g| g["server_rss_mib"].as_f64());
    let mut problems = Vec::new();
    if !failures.is_empty() {
        problems.push(format!("{} operations failed", failures.len()));
    }
    if let Some(grew) = server_growth
        && grew > bounds.max_growth_mib
    {
        problems.push(format!(
            "the server's RSS grew {grew:.1} MiB, more than --max-growth-mib {}",
            bounds.max_growth_mib
        ));
    }
    if ended == Ended::Interrupted {
        problems.push("interrupted".to_owned());
    }
    let load_s = record.load_s.get();
    let memory_json = json!({
        "server_pid": soak.server,
        "not_read": memory_not_read,
        "before": before.map(NodeMemory::to_json),
        "after": after.map(NodeMemory::to_json),
        "growth": growth,
        "max_growth_mib": bounds.max_growth_mib,
        "server_rss_mib_samples": record
            .rss_samples
            .borrow()
            .iter()
            .map(|(at, mib)| json!([round1(*at), round1(*mib)]))
            .collect::<Vec<_>>(),
    });
    let ops = (record.commands.get() + record.files.get()) as f64;
    json!({
        "node": soak.node.url(),
        "node_version": node_info["version"],
        "template": bounds.template,
        "sandboxes": bounds.sandboxes,
        "workers": bounds.workers,
        "commands": record.commands.get(),
        "files": record.files.get(),
        "bytes": record.bytes.get(),
        "duration_s": round1(load_s),
        "setup_s": round1(record.setup_s.get()),
        "ops_per_s": if load_s > 0.0 { round1(ops / load_s) } else { 0.0 },
        "ended_by": ended.name(),
        "bounds": {
            "commands": bounds.commands,
            "files": bounds.files,
            "duration_s": bounds.duration.as_secs(),
            "max_file_bytes": bounds.max_file_bytes,
            "op_timeout_s": bounds.op_timeout.as_secs(),
            "max_errors": bounds.max_errors,
        },
        "errors": failures.len(),
        "errors_by_op": by_op,
        "first_errors": failures.iter().take(FIRST_FAILURES).map(super::Failure::to_json).collect::<Vec<_>>(),
        "latency_ms": {
            "command": latency(&record.command_ms.borrow()),
            "file_write": latency(&record.write_ms.borrow()),
            "file_read": latency(&record.read_ms.borrow()),
        },
        "memory": memory_json,
        "seed": soak.seed,
        "passed": problems.is_empty(),
        "problems": problems,
    })
}

/// A few lines for people, from the report.
pub fn summary(report: &Value) -> String {
    let mut s = String::new();
    let n = |v: &Value| v.as_f64().map_or("?".to_owned(), |x| format!("{x}"));
    let _ = writeln!(
        s,
        "soak: {} sandboxes, {} workers: {} commands, {} files ({:.1} MiB moved) in {} s ({} ops/s), ended by {}",
        n(&report["sandboxes"]),
        n(&report["workers"]),
        n(&report["commands"]),
        n(&report["files"]),
        report["bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
        n(&report["duration_s"]),
        n(&report["ops_per_s"]),
        report["ended_by"].as_str().unwrap_or("?"),
    );
    for (kind, name) in [
        ("command", "command"),
        ("file_write", "file write"),
        ("file_read", "file read"),
    ] {
        let l = &report["latency_ms"][kind];
        if !l.is_null() {
            let _ = writeln!(
                s,
                "soak:   {name}: p50 {} ms, p99 {} ms, max {} ms",
                n(&l["p50"]),
                n(&l["p99"]),
                n(&l["max"])
            );
        }
    }
    let memory = &report["memory"];
    match (&memory["before"], &memory["after"]) {
        (before, after) if before.is_object() && after.is_object() => {
            let _ = writeln!(
                s,
                "soak:   server RSS {} -> {} MiB ({:+} MiB, bound {} MiB); VMMs' Pss {} -> {} MiB ({} -> {} processes); MemAvailable {} -> {} MiB",
                n(&before["server_rss_mib"]),
                n(&after["server_rss_mib"]),
                memory["growth"]["server_rss_mib"].as_f64().unwrap_or(0.0),
                n(&memory["max_growth_mib"]),
                n(&before["vmm_pss_mib"]),
                n(&after["vmm_pss_mib"]),
                n(&before["vmm_processes"]),
                n(&after["vmm_processes"]),
                n(&before["mem_available_mib"]),
                n(&after["mem_available_mib"]),
            );
        }
        _ => {
            let why = memory["not_read"]
                .as_str()
                .unwrap_or("the load did not run");
            let _ = writeln!(s, "soak:   memory not read: {why}");
        }
    }
    let errors = report["errors"].as_u64().unwrap_or(0);
    let _ = writeln!(s, "soak:   errors: {errors}");
    for e in report["first_errors"]
        .as_array()
        .into_iter()
        .flatten()
        .take(5)
    {
        let _ = writeln!(
            s,
            "soak:     {} {} on {:?} at {} s: {}",
            e["phase"].as_str().unwrap_or("?"),
            e["op"].as_str().unwrap_or("?"),
            e["sandbox"].as_str().unwrap_or(""),
            n(&e["at_s"]),
            e["error"].as_str().unwrap_or("?"),
        );
    }
    match report["problems"].as_array() {
        Some(p) if !p.is_empty() => {
            let list: Vec<&str> = p.iter().filter_map(Value::as_str).collect();
            let _ = writeln!(s, "soak: FAILED: {}", list.join("; "));
        }
        _ => {
            let _ = writeln!(s, "soak: passed");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_are_nearest_rank() {
        let samples: Vec<f64> = (1..=100).map(f64::from).rev().collect();
        let l = latency(&samples);
        assert_eq!(
            (l["p50"].as_f64(), l["p99"].as_f64()),
            (Some(50.0), Some(99.0))
        );
        assert_eq!(
            (l["max"].as_f64(), l["samples"].as_u64()),
            (Some(100.0), Some(100))
        );
        assert_eq!(latency(&[7.0])["p99"], 7.0);
        assert!(latency(&[]).is_null());
    }

    #[test]
    fn differences_name_the_first_byte() {
        assert_eq!(difference(b"abc", b"abc"), None);
        assert!(difference(b"abc", b"abd").unwrap().contains("at byte 2"));
        assert!(difference(b"abc", b"ab").unwrap().contains("2 bytes of 3"));
        assert!(difference(b"", b"x").unwrap().contains("at byte 0"));
    }

    fn passed_report() -> Value {
        json!({
            "sandboxes": 4, "workers": 8, "commands": 300, "files": 100,
            "bytes": 104857600u64, "duration_s": 61.5, "ops_per_s": 6.5, "ended_by": "counts",
            "latency_ms": {
                "command": {"p50": 120.0, "p99": 900.5, "max": 1000.0, "samples": 300},
                "file_write": null, "file_read": null
            },
            "memory": {
                "before": {"server_rss_mib": 40.0, "vmm_pss_mib": 300.0, "vmm_processes": 8, "mem_available_mib": 3000},
                "after": {"server_rss_mib": 41.5, "vmm_pss_mib": 310.0, "vmm_processes": 8, "mem_available_mib": 2990},
                "growth": {"server_rss_mib": 1.5},
                "max_growth_mib": 64.0
            },
            "errors": 0, "first_errors": [], "problems": [], "passed": true
        })
    }

    #[test]
    fn the_summary_gives_counts_latencies_and_memory() {
        let text = summary(&passed_report());
        assert!(
            text.contains(
                "4 sandboxes, 8 workers: 300 commands, 100 files (100.0 MiB moved) in 61.5 s"
            ),
            "{text}"
        );
        assert!(text.contains("command: p50 120 ms, p99 900.5 ms"), "{text}");
        assert!(!text.contains("file write"), "{text}");
        assert!(
            text.contains("server RSS 40 -> 41.5 MiB (+1.5 MiB, bound 64 MiB)"),
            "{text}"
        );
        assert!(text.contains("errors: 0"), "{text}");
        assert!(text.ends_with("soak: passed\n"), "{text}");
    }

    #[test]
    fn the_summary_names_failures_and_unread_memory() {
        let mut r = passed_report();
        r["memory"] =
            json!({"before": null, "after": null, "not_read": "the node runs in the lab"});
        r["errors"] = json!(1);
        r["first_errors"] = json!([{"phase": "load", "op": "file_read", "sandbox": "abc", "at_s": 3.5, "error": "no answer within 120 s"}]);
        r["problems"] = json!(["1 operations failed"]);
        let text = summary(&r);
        assert!(
            text.contains("memory not read: the node runs in the lab"),
            "{text}"
        );
        assert!(
            text.contains("load file_read on \"abc\" at 3.5 s: no answer within 120 s"),
            "{text}"
        );
        assert!(
            text.ends_with("soak: FAILED: 1 operations failed\n"),
            "{text}"
        );
    }
}

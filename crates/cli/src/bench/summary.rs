//! A readable summary of a bench report, for people at a terminal (the
//! JSON on stdout stays the record).

use serde_json::Value;

/// One line per headline figure present in `report`: its value, and
/// Firecracker's with the ratio where the report has a reference.
pub fn summary(report: &Value) -> String {
    let mut out = String::new();
    if let Some(env) = report["environment"].as_str() {
        out.push_str(&format!("sandfork bench ({env})\n"));
    }
    let reference = &report["reference"];
    for (key, unit) in [
        ("boot_to_agent_ms", "ms"),
        ("pause_ms", "ms"),
        ("snapshot_full_ms", "ms"),
        ("snapshot_diff_ms", "ms"),
        ("restore_load_ms", "ms"),
        ("restore_to_agent_ms", "ms"),
        ("fork1_ms", "ms"),
        ("fork16_ms", "ms"),
        ("child_private_mib", "MiB"),
        ("idle_children_per_24gib", ""),
        ("vmm_guest_tcp_host_to_guest_mib_s", "MiB/s"),
        ("vmm_guest_tcp_guest_to_host_mib_s", "MiB/s"),
        ("sdk_create_to_first_command_ms", "ms"),
        ("sdk_create_to_first_command_no_network_ms", "ms"),
        ("sdk_create_networking_ratio", ""),
        ("first_command_page_faults", ""),
        ("sdk_fork16_ms", "ms"),
        ("sdk_fork100_ms", "ms"),
        ("fork_parent_pause_ms", "ms"),
        ("snapshot_parent_pause_ms", "ms"),
        ("guest_tcp_guest_to_host_mib_s", "MiB/s"),
        ("guest_tcp_host_to_guest_mib_s", "MiB/s"),
        ("sdk_creates_per_s_4way", "/s"),
        ("sdk_creates_per_s_16way", "/s"),
        ("idle_sandbox_mib", "MiB"),
        ("balloon_reclaimed_mib", "MiB"),
        ("idle_sandboxes_per_24gib", ""),
        ("density_idle_sandboxes", ""),
        ("density_sandbox_mib", "MiB"),
        ("density_mem_available_mib", "MiB"),
        ("image_first_create_ms", "ms"),
        ("image_create_ms", "ms"),
        ("image_concurrent8_builds", ""),
        ("image_disk_bytes_16", "B"),
        ("image_disk_16_vs_unique", ""),
    ] {
        let value = &report[key];
        let shown = match (value.as_f64(), value["p50"].as_f64()) {
            _ if value.get("without_prefetch").is_some() => format!(
                "{} without the working set, p50 {} with it",
                value["without_prefetch"]
                    .as_f64()
                    .map_or("?".into(), number),
                value["with_prefetch"]["p50"]
                    .as_f64()
                    .map_or("?".into(), number)
            ),
            (Some(v), _) => format!("{} {unit}", number(v)),
            (None, Some(p50)) => format!(
                "p50 {} {unit}, p95 {} {unit}",
                number(p50),
                value["p95"].as_f64().map_or("?".into(), number)
            ),
            _ if value.is_null() && report.get(key).is_some() => "failed".into(),
            _ => continue,
        };
        let mut line = format!("  {key:<32} {}", shown.trim_end());
        if let Some(fc) = reference[key].as_f64() {
            line.push_str(&format!("   (Firecracker {} {unit}", number(fc)));
            if let Some(r) = report[super::ratio_key(key).as_str()].as_f64() {
                line.push_str(&format!(", ratio {r:.2}"));
            }
            line.push(')');
        }
        out.push_str(&line);
        out.push('\n');
    }
    // Per image size: pull and conversion, and the layered conversion over
    // the whole-image one.
    for (size, figure) in report["image_pull_convert_ms"]
        .as_object()
        .into_iter()
        .flatten()
    {
        let ratio = &report["image_convert_ratio_vs_reference"][size]["p50"];
        out.push_str(&format!(
            "  image_pull_convert_ms {size:<10} p50 {} ms   (convert vs whole-image {})\n",
            figure["p50"].as_f64().map_or("?".into(), number),
            ratio.as_f64().map_or("?".into(), |r| format!("{r:.2}"))
        ));
    }
    rl_summary(&report["rl"], &mut out);
    group_summary(report, &mut out);
    // What failed, so that a short report says why.
    for key in ["errors", "sdk_errors"] {
        for (part, error) in report[key].as_object().into_iter().flatten() {
            let error = error.as_str().unwrap_or_default();
            out.push_str(&format!("  failed: {part}: {error}\n"));
        }
    }
    if let Some(error) = report["sdk_error"].as_str() {
        out.push_str(&format!("  failed: sdk: {error}\n"));
    }
    if let Some(note) = report["note"].as_str() {
        out.push_str(&format!("  note: {note}\n"));
    }
    out
}

/// Fork per group: per N, the group set up once and forked against set up
/// per child, and the private memory per child of each.
fn group_summary(report: &Value, out: &mut String) {
    let Some(fork) = report["group_setup_fork_ms"].as_object() else {
        return;
    };
    let shown = |v: &Value, unit: &str| {
        v.as_f64()
            .map_or_else(|| "failed".to_owned(), |v| format!("{} {unit}", number(v)))
    };
    let private = &report["group_child_private_mib"];
    let mut sizes: Vec<(&String, &Value)> = fork.iter().collect();
    sizes.sort_by_key(|(n, _)| n.parse::<u64>().unwrap_or(u64::MAX));
    for (n, fork_ms) in sizes {
        let each_ms = &report["group_setup_each_ms"][n];
        let mut line = format!(
            "  rl group n={n:<3} set up once + fork {}; set up each {}",
            shown(fork_ms, "ms"),
            shown(each_ms, "ms")
        );
        if let (Some(f), Some(e)) = (fork_ms.as_f64(), each_ms.as_f64()) {
            line.push_str(&format!(" ({:.2}x)", e / f));
        }
        line.push_str(&format!(
            "; private per child: fork {}, each {}\n",
            shown(&private["fork"][n], "MiB"),
            shown(&private["each"][n], "MiB")
        ));
        out.push_str(&line);
    }
}

/// The rl part: one line per (N, k) with each way's time to N ready
/// children and what of the parent's state they did not see, then where
/// fork wins.
fn rl_summary(rl: &Value, out: &mut String) {
    let Some(cases) = rl["cases"].as_array() else {
        return;
    };
    for case in cases {
        let mut line = format!(
            "  rl n={:<3} k={:<3}",
            case["n"].to_string(),
            case["k"].to_string()
        );
        for way in ["fork", "fork_again", "snapshot", "replay"] {
            if case.get(way).is_none() {
                continue;
            }
            let figures = &case[way];
            let time = figures["ready_ms"]
                .as_f64()
                .map_or_else(|| "failed".to_owned(), |v| format!("{} ms", number(v)));
            let fidelity = &figures["fidelity"];
            let missed: Vec<&str> = ["files", "process", "memory"]
                .into_iter()
                .filter(|k| fidelity[*k] != fidelity["children"])
                .collect();
            line.push_str(&format!(" {way} {time}"));
            if !missed.is_empty() && figures["ready_ms"].is_number() {
                line.push_str(&format!(" (differs: {})", missed.join(",")));
            }
            line.push(';');
        }
        line.pop();
        out.push_str(&line);
        out.push('\n');
    }
    if let Some(wins) = rl["fork_wins_from_k"].as_object() {
        let shown: Vec<String> = wins
            .iter()
            .map(|(n, k)| match k.as_u64() {
                Some(k) => format!("n={n}: k>={k}"),
                None => format!("n={n}: never"),
            })
            .collect();
        out.push_str(&format!("  rl fork fastest from: {}\n", shown.join(", ")));
    }
}

pub(crate) fn number(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn shows_figures_references_percentiles_and_failures() {
        let report = json!({
            "environment": "lab",
            "pause_ms": 33.94,
            "pause_ratio_vs_reference": 3.29,
            "restore_to_agent_ms": 369.2,
            "vmm_guest_tcp_host_to_guest_mib_s": 210.4,
            "vmm_guest_tcp_host_to_guest_ratio_vs_reference": 0.5,
            "sdk_create_to_first_command_ms": {"p50": 2130.6, "p95": 2779.7},
            "first_command_page_faults": {"without_prefetch": 5012, "with_prefetch": {"p50": 801}},
            "sdk_fork16_ms": null,
            "reference": {
                "pause_ms": 10.31,
                "restore_to_agent_ms": 248.0,
                "vmm_guest_tcp_host_to_guest_mib_s": 420.8
            },
            "errors": {"reference_boot": "no such file"},
            "sdk_errors": {"fork16": "TimeoutError: fork of 16"},
            "note": "emulated"
        });
        let text = summary(&report);
        assert_eq!(
            text,
            "sandfork bench (lab)\n\
             \x20 pause_ms                         33.94 ms   (Firecracker 10.31 ms, ratio 3.29)\n\
             \x20 restore_to_agent_ms              369 ms   (Firecracker 248 ms)\n\
             \x20 vmm_guest_tcp_host_to_guest_mib_s 210 MiB/s   (Firecracker 421 MiB/s, ratio 0.50)\n\
             \x20 sdk_create_to_first_command_ms   p50 2131 ms, p95 2780 ms\n\
             \x20 first_command_page_faults        5012 without the working set, p50 801 with it\n\
             \x20 sdk_fork16_ms                    failed\n\
             \x20 failed: reference_boot: no such file\n\
             \x20 failed: fork16: TimeoutError: fork of 16\n\
             \x20 note: emulated\n"
        );
    }

    #[test]
    fn shows_each_branching_case_and_where_fork_wins() {
        let ok = |ms: f64, files: u32| {
            json!({"ready_ms": ms, "fidelity":
                {"files": files, "process": 4, "memory": 4, "children": 4, "all": files == 4}})
        };
        let report = json!({"rl": {
            "cases": [{"n": 4, "k": 8, "fork": ok(900.0, 4), "fork_again": ok(400.0, 4),
                       "snapshot": ok(1500.0, 4), "replay": ok(1200.0, 0)},
                      {"n": 4, "k": 32, "fork": {"ready_ms": null, "error": "x"},
                       "snapshot": ok(1600.0, 4), "replay": ok(4000.0, 0)}],
            "fork_wins_from_k": {"4": null, "16": 1}
        }});
        assert_eq!(
            summary(&report),
            "  rl n=4   k=8   fork 900 ms; fork_again 400 ms; snapshot 1500 ms; replay 1200 ms (differs: files)\n\
             \x20 rl n=4   k=32  fork failed; snapshot 1600 ms; replay 4000 ms (differs: files)\n\
             \x20 rl fork fastest from: n=16: k>=1, n=4: never\n"
        );
    }

    #[test]
    fn shows_each_group_size_both_ways() {
        let report = json!({
            "group_setup_fork_ms": {"8": 1000.0, "16": null},
            "group_setup_each_ms": {"8": 4000.0, "16": 9000.0},
            "group_child_private_mib": {"fork": {"8": 3.5, "16": null},
                                        "each": {"8": 60.0, "16": 61.0}}
        });
        assert_eq!(
            summary(&report),
            "  rl group n=8   set up once + fork 1000 ms; set up each 4000 ms (4.00x); private per child: fork 3.50 MiB, each 60.00 MiB\n\
             \x20 rl group n=16  set up once + fork failed; set up each 9000 ms; private per child: fork failed, each 61.00 MiB\n"
        );
    }

    #[test]
    fn leaves_out_what_was_not_measured() {
        assert_eq!(summary(&json!({})), "");
        assert_eq!(summary(&json!({"errors": {}})), "");
    }
}

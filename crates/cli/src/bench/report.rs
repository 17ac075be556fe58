//! The bench's Markdown report and its SVG plots, rendered from the bench's
//! JSON alone: `sandfork bench --json FILE` writes them beside FILE, and
//! `sandfork bench report --json FILE` renders an old run's again.
//!
//! The JSON is the record; the report only reads it, so every figure keeps
//! the key it has there.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::cluster_scale::size_suffix;
use super::plot::{DrawResult, Lines, Strip, lines_svg, median, strip_svg};
use super::ratio_key;

/// Why a report could not be read, rendered or written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("reading the bench JSON {}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is not a bench JSON", path.display())]
    Malformed {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{} is not a bench JSON: its top level is {found}, not an object", path.display())]
    NotAnObject { path: PathBuf, found: &'static str },
    #[error("{} would be overwritten by its own report: give the JSON a .json name", path.display())]
    ReportOverJson { path: PathBuf },
    #[error("drawing the plot {name}: {message}")]
    Draw { name: String, message: String },
    #[error("writing {}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A report: the Markdown and the plots it links to.
#[derive(Debug)]
pub struct Rendered {
    pub markdown: String,
    pub plots: Vec<Plot>,
}

/// One SVG plot, its file name in the plots folder.
#[derive(Debug)]
pub struct Plot {
    pub file: String,
    pub svg: String,
}

/// Where the report of the JSON at `json` goes: `out/bench.json` ->
/// `out/bench.md` and `out/bench-plots/`.
pub fn paths(json: &Path) -> (PathBuf, PathBuf) {
    let stem = json
        .file_stem()
        .map_or_else(|| "bench".to_owned(), |s| s.to_string_lossy().into_owned());
    (
        json.with_file_name(format!("{stem}.md")),
        json.with_file_name(format!("{stem}-plots")),
    )
}

/// Whether a report can go beside the JSON at `json` (not over it).
pub fn check(json: &Path) -> Result<(), ReportError> {
    match paths(json).0 == json {
        true => Err(ReportError::ReportOverJson {
            path: json.to_owned(),
        }),
        false => Ok(()),
    }
}

/// The bench JSON at `path`.
pub fn load(path: &Path) -> Result<Value, ReportError> {
    let text = std::fs::read_to_string(path).map_err(|source| ReportError::Read {
        path: path.to_owned(),
        source,
    })?;
    let report: Value = serde_json::from_str(&text).map_err(|source| ReportError::Malformed {
        path: path.to_owned(),
        source,
    })?;
    let found = match &report {
        Value::Object(_) => return Ok(report),
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
    };
    Err(ReportError::NotAnObject {
        path: path.to_owned(),
        found,
    })
}

/// Renders the report of `report` (the JSON at `json`) and writes it beside
/// it; returns the Markdown's path. Plots of an earlier render are replaced.
pub fn write(json: &Path, report: &Value) -> Result<PathBuf, ReportError> {
    check(json)?;
    let (markdown, plots_dir) = paths(json);
    let dir_name = plots_dir
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let rendered = render(report, &dir_name)?;
    let written = |path: &Path| {
        let path = path.to_owned();
        move |source| ReportError::Write { path, source }
    };
    std::fs::create_dir_all(&plots_dir).map_err(written(&plots_dir))?;
    let old = std::fs::read_dir(&plots_dir).map_err(written(&plots_dir))?;
    for entry in old {
        let path = entry.map_err(written(&plots_dir))?.path();
        if path.extension().is_some_and(|e| e == "svg") {
            std::fs::remove_file(&path).map_err(written(&path))?;
        }
    }
    for plot in &rendered.plots {
        let path = plots_dir.join(&plot.file);
        std::fs::write(&path, &plot.svg).map_err(written(&path))?;
    }
    std::fs::write(&markdown, &rendered.markdown).map_err(written(&markdown))?;
    Ok(markdown)
}

/// Keys that describe the run, or hold figures rendered on their own.
const NOT_FIGURES: &[&str] = &[
    "environment",
    "guest",
    "note",
    "runs",
    "vmm",
    "errors",
    "sdk_errors",
    "sdk_error",
    "reference",
    "rl",
];

/// The bench's parts, by the prefixes of their keys (`--only`).
const PARTS: &[(&str, &[&str])] = &[
    (
        "VMM",
        &[
            "boot_to_agent",
            "pause_",
            "snapshot_",
            "restore_",
            "fork1_",
            "fork16_",
            "child_private",
            "idle_children",
            "balloon_",
            "net_",
            "vmm_guest_tcp",
        ],
    ),
    (
        "SDK",
        &[
            "sdk_",
            "first_command",
            "fork_parent",
            "guest_tcp_",
            "idle_sandbox",
            "density_",
            "rollback",
        ],
    ),
    ("RL", &["group_"]),
    ("Images", &["image_"]),
    ("Cluster scale", &["cluster_", "gateway_"]),
];
const OTHER: &str = "Other";

/// One figure of the JSON: its value as recorded (a median, a p50, a mean
/// or one sample: the key's documentation says), its samples where the JSON
/// has them, and Firecracker's where it has a reference.
#[derive(Debug)]
struct Figure {
    key: String,
    /// None: recorded as failed (null).
    value: Option<f64>,
    samples: Vec<f64>,
    unit: &'static str,
    reference: Option<f64>,
    reference_samples: Vec<f64>,
    ratio: Option<f64>,
}

/// The unit of a figure, from its key's suffix (`_ms`, `_mib_s`, ...); a
/// key may end in a size after its unit (`gateway_reload_ms_10k`).
fn unit(key: &str) -> &'static str {
    let tokens: Vec<&str> = key.split('_').collect();
    for (i, token) in tokens.iter().enumerate().rev() {
        let before = i.checked_sub(1).and_then(|i| tokens.get(i)).copied();
        match (*token, before) {
            ("ms", _) => return "ms",
            ("s", Some("mib")) => return "MiB/s",
            ("s", Some("per")) => return "/s",
            ("s", _) => return "s",
            ("mib", _) => return "MiB",
            ("kib", _) => return "KiB",
            ("bytes", _) => return "B",
            ("ratio" | "vs", _) => return "ratio",
            _ => {}
        }
    }
    ""
}

fn numbers(value: &Value) -> Vec<f64> {
    value
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

/// The samples of the top-level figure `key` in `root` (the report or its
/// reference): `<key>_samples`, the guest TCP details' per direction, or
/// the cluster-scale detail's per route count.
fn samples_of(root: &Value, key: &str) -> Vec<f64> {
    let listed = numbers(&root[format!("{key}_samples")]);
    if !listed.is_empty() {
        return listed;
    }
    if let Some(suffix) = key.strip_prefix("cluster_reconcile_pass_ms_") {
        let sizes = root["cluster_scale_detail"]["sizes"].as_array();
        let of_suffix = |size: &&Value| {
            let routes = size["routes"]
                .as_u64()
                .and_then(|r| usize::try_from(r).ok());
            routes.map(size_suffix).as_deref() == Some(suffix)
        };
        let size = sizes.into_iter().flatten().find(of_suffix);
        return size.map_or_else(Vec::new, |s| numbers(&s["reconcile_pass_ms_samples"]));
    }
    let detail = match key.strip_suffix("_mib_s") {
        Some(rest) => match (
            rest.strip_prefix("vmm_guest_tcp_"),
            rest.strip_prefix("guest_tcp_"),
        ) {
            (Some(way), _) => &root["vmm_guest_tcp_detail"]["samples_mib_s"][way],
            (_, Some(way)) => &root["sdk_detail"]["guest_tcp"]["samples_mib_s"][way],
            _ => return Vec::new(),
        },
        None => return Vec::new(),
    };
    numbers(detail)
}

/// `key[8]` for a per-N or per-size entry, `key.name` otherwise.
fn child_key(parent: &str, child: &str) -> String {
    match child.starts_with(|c: char| c.is_ascii_digit()) {
        true => format!("{parent}[{child}]"),
        false => format!("{parent}.{child}"),
    }
}

/// The figures under `key`: a number, a `{p50, samples}` object, null
/// (failed), or an object of those (per N, per size, per way).
fn collect(key: String, value: &Value, unit: &'static str, out: &mut Vec<Figure>) {
    let figure = |value, samples| Figure {
        key: key.clone(),
        value,
        samples,
        unit,
        reference: None,
        reference_samples: Vec::new(),
        ratio: None,
    };
    match value {
        Value::Number(n) => out.push(figure(n.as_f64(), Vec::new())),
        Value::Null => out.push(figure(None, Vec::new())),
        Value::Object(map) if map.contains_key("p50") || map.contains_key("samples") => {
            let samples = numbers(&value["samples"]);
            let value = value["p50"].as_f64().or_else(|| median(&samples));
            out.push(figure(value, samples));
        }
        Value::Object(map) => {
            for (child, value) in map {
                collect(child_key(&key, child), value, unit, out);
            }
        }
        _ => {}
    }
}

fn part_of(key: &str) -> &'static str {
    PARTS
        .iter()
        .find(|(_, prefixes)| prefixes.iter().any(|p| key.starts_with(p)))
        .map_or(OTHER, |(name, _)| name)
}

/// Every figure of the report, by part, in the JSON's order of keys.
fn figures(report: &Value) -> Vec<(&'static str, Figure)> {
    let Some(map) = report.as_object() else {
        return Vec::new();
    };
    let reference = &report["reference"];
    // Ratios shown beside the figure they are of.
    let ratios: BTreeSet<String> = map
        .iter()
        .filter(|(_, v)| v.is_number())
        .map(|(k, _)| ratio_key(k))
        .filter(|r| map.contains_key(r))
        .collect();
    let mut out = Vec::new();
    for (key, value) in map {
        let shown_elsewhere = NOT_FIGURES.contains(&key.as_str())
            || key.ends_with("_detail")
            || key.ends_with("_samples")
            // Rendered in their own table, both ways side by side.
            || key.starts_with("group_setup_")
            || ratios.contains(key);
        if shown_elsewhere {
            continue;
        }
        let mut found = Vec::new();
        collect(key.clone(), value, unit(key), &mut found);
        if let [figure] = found.as_mut_slice()
            && figure.key == *key
        {
            if figure.samples.is_empty() {
                figure.samples = samples_of(report, key);
            }
            figure.reference = reference[key].as_f64();
            figure.reference_samples = samples_of(reference, key);
            figure.ratio = report[ratio_key(key)].as_f64();
        }
        let part = part_of(key);
        out.extend(found.into_iter().map(|f| (part, f)));
    }
    out
}

/// A figure as the summary shows it, but small ones to three significant
/// digits (a route lookup takes some 0.0002 ms).
fn number(v: f64) -> String {
    match v.abs() {
        a if a == 0.0 || a >= 1.0 => super::summary::number(v),
        a => {
            let digits = usize::try_from(2 - a.log10().floor() as i64).unwrap_or(2);
            format!("{v:.digits$}")
        }
    }
}

fn shown(v: Option<f64>) -> String {
    v.map_or_else(|| "–".to_owned(), number)
}

/// A plot's file name: the key with what a file name should not hold as `_`.
fn file_name(key: &str) -> String {
    let name: String = key
        .chars()
        .map(
            |c| match c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                true => c,
                false => '_',
            },
        )
        .collect();
    format!("{}.svg", name.trim_end_matches('_'))
}

/// What the report is being built into.
struct Builder<'a> {
    md: String,
    plots: Vec<Plot>,
    plots_dir: &'a str,
}

impl Builder<'_> {
    fn add(
        &mut self,
        file: String,
        svg: DrawResult<String>,
        title: &str,
    ) -> Result<(), ReportError> {
        let svg = svg.map_err(|e| ReportError::Draw {
            name: file.clone(),
            message: e.to_string(),
        })?;
        let _ = writeln!(self.md, "\n![{title}]({}/{file})", self.plots_dir);
        self.plots.push(Plot { file, svg });
        Ok(())
    }

    fn strip(&mut self, file: String, plot: &Strip) -> Result<(), ReportError> {
        self.add(file, strip_svg(plot), &plot.title)
    }

    fn lines(&mut self, file: String, plot: &Lines) -> Result<(), ReportError> {
        self.add(file, lines_svg(plot), &plot.title)
    }
}

/// The Markdown report of a bench JSON, its plots' links under `plots_dir`
/// (relative to the Markdown file).
pub fn render(report: &Value, plots_dir: &str) -> Result<Rendered, ReportError> {
    let mut b = Builder {
        md: String::new(),
        plots: Vec::new(),
        plots_dir,
    };
    header(report, &mut b.md);
    let figures = figures(report);
    let rollback = ["rollback_ms", "rollback_by_create_ms"];
    let mut parts: Vec<&str> = PARTS.iter().map(|(name, _)| *name).collect();
    parts.push(OTHER);
    for part in parts {
        let in_part: Vec<&Figure> = figures
            .iter()
            .filter(|(p, _)| *p == part)
            .map(|(_, f)| f)
            .collect();
        let rl =
            part == "RL" && (report["rl"].is_object() || report["group_setup_fork_ms"].is_object());
        if in_part.is_empty() && !rl {
            continue;
        }
        let _ = writeln!(b.md, "\n## {part}");
        table(&in_part, &mut b.md);
        // The two ways back to a checkpoint get one plot of both, below.
        let sampled = in_part
            .iter()
            .filter(|f| !f.samples.is_empty() && !rollback.contains(&f.key.as_str()));
        for (family, members) in families(sampled) {
            sampled_plot(&family, &members, &mut b)?;
        }
        match part {
            "SDK" => rollback_plot(report, &mut b)?,
            "RL" => {
                rl_cases(&report["rl"], &mut b)?;
                groups(report, &mut b)?;
            }
            "Images" => image_conversions(report, &mut b)?,
            _ => {}
        }
    }
    failures(report, &mut b.md);
    Ok(Rendered {
        markdown: b.md,
        plots: b.plots,
    })
}

/// A figure's family and its member: `image_pull_convert_ms[1g]` and
/// `cluster_reconcile_pass_ms_10k` are members `1g` and `10k`, per size.
fn family_of(key: &str) -> Option<(&str, &str)> {
    if let Some(inner) = key.strip_suffix(']')
        && let Some((family, member)) = inner.rsplit_once('[')
    {
        return Some((family, member));
    }
    let (family, member) = key.rsplit_once('_')?;
    let digits = member.strip_suffix('k').unwrap_or(member);
    let sized = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit());
    sized.then_some((family, member))
}

/// The size a member stands for, to order them (`1k` before `10k`).
fn member_size(member: &str) -> u64 {
    let digits: String = member.chars().take_while(char::is_ascii_digit).collect();
    let n = digits.parse::<u64>().unwrap_or(u64::MAX);
    match member.strip_prefix(digits.as_str()) {
        Some("k") => n.saturating_mul(1000),
        _ => n,
    }
}

/// Figures with samples by family, in order of their first member: the
/// members of one family (per size or per N) share a plot.
fn families<'a>(figures: impl Iterator<Item = &'a &'a Figure>) -> Vec<(String, Vec<&'a Figure>)> {
    let mut out: Vec<(String, Vec<&Figure>)> = Vec::new();
    for figure in figures {
        let family = family_of(&figure.key).map_or(figure.key.as_str(), |(f, _)| f);
        match out.iter_mut().find(|(name, _)| name == family) {
            Some((_, members)) => members.push(figure),
            None => out.push((family.to_owned(), vec![figure])),
        }
    }
    out
}

/// One figure's samples (beside Firecracker's where the reference has
/// them), or a family's, a column per member.
fn sampled_plot(family: &str, members: &[&Figure], b: &mut Builder<'_>) -> Result<(), ReportError> {
    let plot = match members {
        [figure] => Strip {
            title: format!(
                "{} ({} samples; bar: median)",
                figure.key,
                figure.samples.len()
            ),
            x_desc: String::new(),
            y_desc: axis(&figure.key, figure.unit),
            series: match figure.reference_samples.is_empty() {
                true => vec![(figure.key.clone(), figure.samples.clone())],
                false => vec![
                    ("sandfork".to_owned(), figure.samples.clone()),
                    ("Firecracker".to_owned(), figure.reference_samples.clone()),
                ],
            },
        },
        _ => {
            let mut members = members.to_vec();
            members.sort_by_key(|f| family_of(&f.key).map_or(u64::MAX, |(_, m)| member_size(m)));
            let unit = members.first().map_or("", |f| f.unit);
            Strip {
                title: format!("{family} per size (bar: median)"),
                x_desc: "size (the key's suffix)".into(),
                y_desc: axis(family, unit),
                series: members
                    .iter()
                    .map(|f| {
                        let member = family_of(&f.key).map_or(f.key.as_str(), |(_, m)| m);
                        (member.to_owned(), f.samples.clone())
                    })
                    .collect(),
            }
        }
    };
    let file = match members {
        [figure] => file_name(&figure.key),
        _ => file_name(family),
    };
    b.strip(file, &plot)
}

fn axis(what: &str, unit: &str) -> String {
    match unit {
        "" => what.to_owned(),
        unit => format!("{what} ({unit})"),
    }
}

fn header(report: &Value, md: &mut String) {
    md.push_str("# sandfork bench report\n\n");
    md.push_str(
        "Rendered from the bench's JSON (`sandfork bench report --json FILE` renders it again). \
         *value* is the figure as the JSON records it (a median or p50, or a single \
         sample: see docs/src/benchmarks.md for each key); median, min and max are of its \
         samples where the JSON keeps them.\n",
    );
    let mut about = String::new();
    if let Some(env) = report["environment"].as_str() {
        let _ = write!(about, "- environment: {env}");
        let guest = &report["guest"];
        if let (Some(vcpus), Some(mib)) = (guest["vcpus"].as_u64(), guest["mem_mib"].as_u64()) {
            let _ = write!(about, "; guest: {vcpus} vCPU, {mib} MiB");
        }
        if let Some(runs) = report["runs"].as_u64() {
            let _ = write!(about, "; runs: {runs}");
        }
        about.push('\n');
    }
    if let Some(vmm) = report["vmm"].as_str() {
        let _ = writeln!(about, "- VMM: `{vmm}`");
    }
    if let Some(fc) = report["reference"]["vmm"].as_str() {
        let _ = writeln!(about, "- reference: Firecracker `{fc}`");
    }
    if let Some(note) = report["note"].as_str() {
        let _ = writeln!(about, "- note: {note}");
    }
    if !about.is_empty() {
        let _ = write!(md, "\n{about}");
    }
}

fn table(figures: &[&Figure], md: &mut String) {
    if figures.is_empty() {
        return;
    }
    let reference = figures.iter().any(|f| f.reference.is_some());
    md.push_str("\n| figure | value | median | min | max | samples | unit |");
    let mut rule = String::from("|---|--:|--:|--:|--:|--:|---|");
    if reference {
        md.push_str(" Firecracker | ratio (sandfork / Firecracker) |");
        rule.push_str("--:|--:|");
    }
    let _ = writeln!(md, "\n{rule}");
    for f in figures {
        let sorted = {
            let mut s = f.samples.clone();
            s.sort_by(f64::total_cmp);
            s
        };
        let value = match f.value {
            Some(v) => number(v),
            None => "failed".to_owned(),
        };
        let count = match sorted.len() {
            0 => "–".to_owned(),
            n => n.to_string(),
        };
        let _ = write!(
            md,
            "| `{}` | {value} | {} | {} | {} | {count} | {} |",
            f.key,
            shown(median(&sorted)),
            shown(sorted.first().copied()),
            shown(sorted.last().copied()),
            f.unit
        );
        if reference {
            let ratio = f
                .ratio
                .map_or_else(|| "–".to_owned(), |r| format!("{r:.2}"));
            let _ = write!(md, " {} | {ratio} |", shown(f.reference));
        }
        md.push('\n');
    }
    if reference {
        md.push_str(
            "\nThe ratio is sandfork's figure over Firecracker's: below 1 is faster for a \
             time, above 1 for a throughput (MiB/s).\n",
        );
    }
}

/// Back to a checkpoint in place against a create from the snapshot.
fn rollback_plot(report: &Value, b: &mut Builder<'_>) -> Result<(), ReportError> {
    let series: Vec<(String, Vec<f64>)> = [
        ("in place (rollback_ms)", "rollback_ms"),
        (
            "create from snapshot (rollback_by_create_ms)",
            "rollback_by_create_ms",
        ),
    ]
    .into_iter()
    .map(|(name, key)| (name.to_owned(), numbers(&report[key]["samples"])))
    .filter(|(_, s)| !s.is_empty())
    .collect();
    if series.is_empty() {
        return Ok(());
    }
    let plot = Strip {
        title: "back to a checkpoint: rollback in place vs a create from the snapshot".into(),
        x_desc: String::new(),
        y_desc: "until a command answers (ms)".into(),
        series,
    };
    b.strip("rollback.svg".into(), &plot)
}

/// Per image size: the layered conversion against the whole-image one.
fn image_conversions(report: &Value, b: &mut Builder<'_>) -> Result<(), ReportError> {
    let Some(detail) = report["image_detail"].as_object() else {
        return Ok(());
    };
    for (size, d) in detail {
        let layered = numbers(&d["convert_layered_ms"]["samples"]);
        let whole = numbers(&d["reference_whole_image_convert_ms"]["samples"]);
        if layered.is_empty() && whole.is_empty() {
            continue;
        }
        let plot = Strip {
            title: format!("image {size}: layered conversion vs whole-image"),
            x_desc: String::new(),
            y_desc: "conversion (ms)".into(),
            series: vec![
                ("layered (convert_layered_ms)".into(), layered),
                ("whole image (reference)".into(), whole),
            ],
        };
        b.strip(file_name(&format!("image_convert_{size}")), &plot)?;
    }
    Ok(())
}

const WAYS: &[(&str, &str)] = &[
    ("fork", "fork"),
    ("fork_again", "fork again"),
    ("snapshot", "snapshot and create"),
    ("replay", "create and replay"),
];

/// The rl cases: per (N, k) each way's time to N ready children, and a
/// plot per N of it against k.
fn rl_cases(rl: &Value, b: &mut Builder<'_>) -> Result<(), ReportError> {
    let Some(cases) = rl["cases"].as_array() else {
        return Ok(());
    };
    b.md.push_str(
        "\nBranching an episode N ways at step k (`rl.cases`, `ready_ms`: until all N \
         children answered):\n\n| N | k | fork | fork again | snapshot | replay | snapshot / fork | \
         replay / fork | unit |\n|--:|--:|--:|--:|--:|--:|--:|--:|---|\n",
    );
    let ready = |case: &Value, way: &str| case[way]["ready_ms"].as_f64();
    let mut counts: Vec<u64> = Vec::new();
    for case in cases {
        let (n, k) = (case["n"].to_string(), case["k"].to_string());
        let cell = |way: &str| match case.get(way) {
            None => "–".to_owned(),
            Some(_) => ready(case, way).map_or_else(|| "failed".to_owned(), number),
        };
        let over_fork = |way: &str| match (ready(case, way), ready(case, "fork")) {
            (Some(v), Some(f)) if f > 0.0 => format!("{:.2}", v / f),
            _ => "–".to_owned(),
        };
        let _ = writeln!(
            b.md,
            "| {n} | {k} | {} | {} | {} | {} | {} | {} | ms |",
            cell("fork"),
            cell("fork_again"),
            cell("snapshot"),
            cell("replay"),
            over_fork("snapshot"),
            over_fork("replay"),
        );
        if let Some(n) = case["n"].as_u64()
            && !counts.contains(&n)
        {
            counts.push(n);
        }
    }
    for n in counts {
        let mut of_n: Vec<&Value> = cases
            .iter()
            .filter(|c| c["n"].as_u64() == Some(n))
            .collect();
        of_n.sort_by_key(|c| c["k"].as_u64().unwrap_or(u64::MAX));
        let series = WAYS
            .iter()
            .filter(|(way, _)| of_n.iter().any(|c| c.get(*way).is_some()))
            .map(|(way, name)| {
                (
                    (*name).to_owned(),
                    of_n.iter().map(|c| ready(c, way)).collect(),
                )
            })
            .collect();
        let plot = Lines {
            title: format!("branching an episode {n} ways at step k"),
            x_desc: "k (the episode's step branched at)".into(),
            y_desc: format!("until all {n} children answered (ms)"),
            categories: of_n.iter().map(|c| c["k"].to_string()).collect(),
            series,
        };
        b.lines(format!("rl_n{n}.svg"), &plot)?;
    }
    Ok(())
}

/// Fork per group: per N, set up once and forked against set up per child.
fn groups(report: &Value, b: &mut Builder<'_>) -> Result<(), ReportError> {
    let Some(fork) = report["group_setup_fork_ms"].as_object() else {
        return Ok(());
    };
    let each = &report["group_setup_each_ms"];
    let mut sizes: Vec<&String> = fork.keys().collect();
    sizes.sort_by_key(|n| n.parse::<u64>().unwrap_or(u64::MAX));
    b.md.push_str(
        "\nA rollout group of N from one set-up task state (`group_setup_fork_ms`, \
         `group_setup_each_ms`):\n\n| N | set up once + fork | set up each | each / fork | unit |\n\
         |--:|--:|--:|--:|---|\n",
    );
    let value = |v: &Value| v.as_f64().map_or_else(|| "failed".to_owned(), number);
    for n in &sizes {
        let (f, e) = (&fork[n.as_str()], &each[n.as_str()]);
        let ratio = match (f.as_f64(), e.as_f64()) {
            (Some(f), Some(e)) if f > 0.0 => format!("{:.2}", e / f),
            _ => "–".to_owned(),
        };
        let _ = writeln!(b.md, "| {n} | {} | {} | {ratio} | ms |", value(f), value(e));
    }
    let plot = Lines {
        title: "a rollout group of N from one set-up task state".into(),
        x_desc: "N (children)".into(),
        y_desc: "until every child answered (ms)".into(),
        categories: sizes.iter().map(|n| (*n).clone()).collect(),
        series: vec![
            (
                "set up once + fork".into(),
                sizes.iter().map(|n| fork[n.as_str()].as_f64()).collect(),
            ),
            (
                "set up each".into(),
                sizes.iter().map(|n| each[n.as_str()].as_f64()).collect(),
            ),
        ],
    };
    b.lines("rl_group.svg".into(), &plot)
}

fn failures(report: &Value, md: &mut String) {
    let mut lines = Vec::new();
    for key in ["errors", "sdk_errors"] {
        for (part, error) in report[key].as_object().into_iter().flatten() {
            let error = error
                .as_str()
                .map_or_else(|| error.to_string(), str::to_owned);
            let error = error.replace('\n', " ");
            lines.push(format!("- `{part}`: {error}"));
        }
    }
    if let Some(error) = report["sdk_error"].as_str() {
        lines.push(format!("- `sdk`: {error}"));
    }
    if !lines.is_empty() {
        let _ = writeln!(md, "\n## Failed\n\n{}", lines.join("\n"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A bench JSON with one figure of each shape the bench writes.
    fn known() -> Value {
        json!({
            "environment": "lab",
            "guest": {"vcpus": 1, "mem_mib": 256},
            "runs": 3,
            "boot_to_agent_ms": 300.0,
            "boot_to_agent_ms_samples": [410.0, 250.0, 300.0],
            "boot_to_agent_ratio_vs_reference": 2.0,
            "pause_ms": 33.94,
            "vmm_guest_tcp_host_to_guest_mib_s": 210.4,
            "vmm_guest_tcp_host_to_guest_ratio_vs_reference": 0.5,
            "vmm_guest_tcp_detail": {"samples_mib_s": {"host_to_guest": [200.0, 210.4, 220.0]}},
            "fork16_ms": null,
            "reference": {
                "vmm": "/opt/fc/firecracker",
                "boot_to_agent_ms": 150.0,
                "boot_to_agent_ms_samples": [150.0, 140.0, 160.0],
                "vmm_guest_tcp_host_to_guest_mib_s": 420.8
            },
            "sdk_create_to_first_command_ms": {"p50": 2130.6, "p95": 2779.7,
                                               "samples": [2130.6, 2779.7, 1900.0, 2000.0]},
            "first_command_page_faults": {"without_prefetch": 5012,
                                          "with_prefetch": {"p50": 801, "samples": [801, 790, 820]}},
            "rollback_ms": {"p50": 667.0, "samples": [667.0, 650.0, 700.0]},
            "rollback_by_create_ms": {"p50": 729.0, "samples": [729.0, 720.0, 760.0]},
            "rl": {"cases": [
                {"n": 4, "k": 1, "fork": {"ready_ms": 900.0}, "snapshot": {"ready_ms": 1800.0},
                 "replay": {"ready_ms": 1200.0}},
                {"n": 4, "k": 8, "fork": {"ready_ms": null, "error": "x"},
                 "snapshot": {"ready_ms": 1500.0}, "replay": {"ready_ms": 4000.0}}
            ]},
            "group_setup_fork_ms": {"8": 1000.0, "16": null},
            "group_setup_each_ms": {"8": 4000.0, "16": 9000.0},
            "image_pull_convert_ms": {"1g": {"p50": 15906.0, "samples": [11551.0, 15906.0]},
                                      "4g": {"p50": 84402.0, "samples": [54092.0, 84402.0]}},
            "image_detail": {"1g": {
                "convert_layered_ms": {"p50": 15019.0, "samples": [10449.0, 15019.0]},
                "reference_whole_image_convert_ms": {"p50": 94733.0, "samples": [40673.0, 94733.0]}
            }},
            "gateway_reload_ms_10k": 27.0,
            "gateway_route_lookup_p50_ms_10k": 0.00012,
            "cluster_reconcile_pass_ms_10k": 22.0,
            "cluster_scale_detail": {"nodes": 100, "sizes": [
                {"routes": 10000, "reconcile_pass_ms_samples": [22.0, 21.0, 25.0]}
            ]},
            "errors": {"reference_snapshot": "no such file"},
            "sdk_errors": {"fork16": "TimeoutError:\nfork of 16"},
            "note": "emulated"
        })
    }

    /// Well-formed enough for a viewer: one `<svg>` root, every tag closed
    /// in order.
    fn assert_well_formed_svg(svg: &str) {
        let mut open: Vec<&str> = Vec::new();
        let mut roots = 0;
        let mut rest = svg;
        while let Some(start) = rest.find('<') {
            let end = rest[start..].find('>').expect("an unclosed tag") + start;
            let tag = &rest[start + 1..end];
            rest = &rest[end + 1..];
            if tag.starts_with('?') || tag.starts_with('!') {
                continue;
            }
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(open.pop(), Some(name.trim()), "in {svg}");
                continue;
            }
            let name = tag.split_whitespace().next().unwrap().trim_end_matches('/');
            if open.is_empty() {
                roots += 1;
                assert_eq!(name, "svg");
            }
            if !tag.ends_with('/') {
                open.push(name);
            }
        }
        assert!(open.is_empty(), "unclosed: {open:?}");
        assert_eq!(roots, 1);
    }

    /// The texts of an SVG's `<text>` elements, entities decoded.
    fn svg_text(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .map(|t| {
                let body = &t[t.find('>').unwrap() + 1..t.find("</text>").unwrap()];
                body.trim()
                    .replace("&apos;", "'")
                    .replace("&quot;", "\"")
                    .replace("&lt;", "<")
                    .replace("&gt;", ">")
                    .replace("&amp;", "&")
            })
            .collect()
    }

    fn has_text(svg: &str, text: &str) -> bool {
        svg_text(svg).iter().any(|t| t == text)
    }

    fn plot<'a>(rendered: &'a Rendered, file: &str) -> &'a str {
        let found = rendered.plots.iter().find(|p| p.file == file);
        &found.unwrap_or_else(|| panic!("no plot {file}")).svg
    }

    #[test]
    fn tables_carry_every_figure_with_its_samples_and_reference() {
        let r = render(&known(), "bench-plots").unwrap();
        let md = &r.markdown;
        for row in [
            "| `boot_to_agent_ms` | 300 | 300 | 250 | 410 | 3 | ms | 150 | 2.00 |",
            "| `pause_ms` | 33.94 | – | – | – | – | ms | – | – |",
            "| `vmm_guest_tcp_host_to_guest_mib_s` | 210 | 210 | 200 | 220 | 3 | MiB/s | 421 | 0.50 |",
            "| `fork16_ms` | failed | – | – | – | – | ms | – | – |",
            "| `sdk_create_to_first_command_ms` | 2131 | 2131 | 1900 | 2780 | 4 | ms |",
            "| `first_command_page_faults.without_prefetch` | 5012 | – | – | – | – |  |",
            "| `first_command_page_faults.with_prefetch` | 801 | 801 | 790 | 820 | 3 |  |",
            "| `rollback_by_create_ms` | 729 | 729 | 720 | 760 | 3 | ms |",
            "| `image_pull_convert_ms[1g]` | 15906 | 15906 | 11551 | 15906 | 2 | ms |",
            "| `gateway_reload_ms_10k` | 27.00 | – | – | – | – | ms |",
            "| `gateway_route_lookup_p50_ms_10k` | 0.000120 | – | – | – | – | ms |",
            "| `image_pull_convert_ms[4g]` | 84402 | 84402 | 54092 | 84402 | 2 | ms |",
            "| `cluster_reconcile_pass_ms_10k` | 22.00 | 22.00 | 21.00 | 25.00 | 3 | ms |",
            "| 4 | 1 | 900 | – | 1800 | 1200 | 2.00 | 1.33 | ms |",
            "| 4 | 8 | failed | – | 1500 | 4000 | – | – | ms |",
            "| 8 | 1000 | 4000 | 4.00 | ms |",
            "| 16 | failed | 9000 | – | ms |",
            "- environment: lab; guest: 1 vCPU, 256 MiB; runs: 3",
            "- reference: Firecracker `/opt/fc/firecracker`",
            "- `reference_snapshot`: no such file",
            "- `fork16`: TimeoutError: fork of 16",
        ] {
            assert!(md.contains(row), "no {row:?} in\n{md}");
        }
        // Ratios are beside their figure, details and samples not rows.
        for key in [
            "boot_to_agent_ratio_vs_reference",
            "boot_to_agent_ms_samples",
            "vmm_guest_tcp_detail",
            "cluster_scale_detail",
            "group_setup_fork_ms",
            "image_detail",
        ] {
            assert!(!md.contains(&format!("| `{key}")), "{key} in\n{md}");
        }
        // Each part its own table, in the bench's order.
        let at = |h: &str| md.find(h).unwrap_or_else(|| panic!("no {h} in\n{md}"));
        assert!(at("## VMM") < at("## SDK"));
        assert!(at("## SDK") < at("## RL") && at("## RL") < at("## Images"));
        assert!(
            at("## Images") < at("## Cluster scale") && at("## Cluster scale") < at("## Failed")
        );
    }

    #[test]
    fn plots_are_svg_naming_their_figures_and_linked_from_the_report() {
        let r = render(&known(), "bench-plots").unwrap();
        let mut files: Vec<&str> = r.plots.iter().map(|p| p.file.as_str()).collect();
        files.sort_unstable();
        assert_eq!(
            files,
            [
                "boot_to_agent_ms.svg",
                "cluster_reconcile_pass_ms_10k.svg",
                "first_command_page_faults_with_prefetch.svg",
                "image_convert_1g.svg",
                "image_pull_convert_ms.svg",
                "rl_group.svg",
                "rl_n4.svg",
                "rollback.svg",
                "sdk_create_to_first_command_ms.svg",
                "vmm_guest_tcp_host_to_guest_mib_s.svg",
            ]
        );
        for p in &r.plots {
            assert_well_formed_svg(&p.svg);
            assert!(
                r.markdown.contains(&format!("](bench-plots/{})", p.file)),
                "{} not linked",
                p.file
            );
        }
        // Ours against Firecracker: both columns, a point per sample, the
        // axes labelled with the unit.
        let boot = plot(&r, "boot_to_agent_ms.svg");
        for text in [
            "boot_to_agent_ms (3 samples; bar: median)",
            "sandfork",
            "Firecracker",
            "boot_to_agent_ms (ms)",
        ] {
            assert!(has_text(boot, text), "no {text:?} in {boot}");
        }
        assert_eq!(boot.matches("<circle").count(), 6);
        let faults = plot(&r, "first_command_page_faults_with_prefetch.svg");
        assert_eq!(faults.matches("<circle").count(), 3);
        // Fork against snapshot and replay per N: a point per measured case
        // (the failed fork is a gap), a legend naming each way.
        let rl = plot(&r, "rl_n4.svg");
        assert_eq!(rl.matches("<circle").count(), 5);
        for text in ["fork", "snapshot and create", "create and replay"] {
            assert!(has_text(rl, text), "no {text:?} in {rl}");
        }
        assert!(has_text(rl, "k (the episode's step branched at)"), "{rl}");
        // Sizes of one figure side by side, in order of size.
        let sizes = plot(&r, "image_pull_convert_ms.svg");
        assert_eq!(sizes.matches("<circle").count(), 4);
        let labels = svg_text(sizes);
        let at = |t: &str| labels.iter().position(|l| l == t).unwrap();
        assert!(at("1g") < at("4g"), "{labels:?}");
        assert!(has_text(sizes, "image_pull_convert_ms (ms)"), "{labels:?}");
        let rollback = plot(&r, "rollback.svg");
        assert!(has_text(rollback, "in place (rollback_ms)"), "{rollback}");
        assert_eq!(rollback.matches("<circle").count(), 6);
    }

    #[test]
    fn a_report_without_figures_is_a_header_alone() {
        let r = render(&json!({"errors": {}}), "p").unwrap();
        assert!(r.plots.is_empty());
        assert!(!r.markdown.contains("##"), "{}", r.markdown);
    }

    #[test]
    fn written_beside_the_json_replacing_an_earlier_render() {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("out/bench.json");
        std::fs::create_dir_all(json.parent().unwrap()).unwrap();
        std::fs::write(&json, known().to_string()).unwrap();
        let stale = dir.path().join("out/bench-plots/gone.svg");
        std::fs::create_dir_all(stale.parent().unwrap()).unwrap();
        std::fs::write(&stale, "<svg/>").unwrap();

        let report = load(&json).unwrap();
        let markdown = write(&json, &report).unwrap();
        assert_eq!(markdown, dir.path().join("out/bench.md"));
        let md = std::fs::read_to_string(&markdown).unwrap();
        assert!(md.contains("| `pause_ms` | 33.94 |"), "{md}");
        assert!(!stale.exists());
        let plots = dir.path().join("out/bench-plots");
        let svg = std::fs::read_to_string(plots.join("rl_group.svg")).unwrap();
        assert_well_formed_svg(&svg);
        assert_eq!(std::fs::read_dir(&plots).unwrap().count(), 10);
    }

    #[test]
    fn a_missing_or_malformed_json_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("none.json");
        let e = load(&missing).unwrap_err();
        assert!(matches!(e, ReportError::Read { .. }), "{e:?}");
        // As the command prints it: what, which file, why (once).
        let shown = format!("{:#}", anyhow::Error::new(e));
        assert_eq!(
            shown,
            format!(
                "reading the bench JSON {}: No such file or directory (os error 2)",
                missing.display()
            )
        );

        let cut = dir.path().join("cut.json");
        std::fs::write(&cut, r#"{"boot_to_agent_ms": 3"#).unwrap();
        let e = load(&cut).unwrap_err();
        assert!(matches!(e, ReportError::Malformed { .. }), "{e:?}");
        let shown = format!("{:#}", anyhow::Error::new(e));
        let expected = format!("{} is not a bench JSON: EOF while parsing", cut.display());
        assert!(shown.starts_with(&expected), "{shown}");

        let list = dir.path().join("list.json");
        std::fs::write(&list, "[1, 2]").unwrap();
        let e = load(&list).unwrap_err();
        assert!(e.to_string().contains("its top level is an array"), "{e}");

        let md = dir.path().join("bench.md");
        let e = write(&md, &json!({})).unwrap_err();
        assert!(matches!(e, ReportError::ReportOverJson { .. }), "{e:?}");
    }

    #[test]
    fn members_of_a_family_are_ordered_by_size() {
        assert_eq!(
            family_of("image_pull_convert_ms[1g]"),
            Some(("image_pull_convert_ms", "1g"))
        );
        assert_eq!(
            family_of("cluster_reconcile_pass_ms_10k"),
            Some(("cluster_reconcile_pass_ms", "10k"))
        );
        assert_eq!(family_of("boot_to_agent_ms"), None);
        assert_eq!(family_of("sdk_creates_per_s_4way"), None);
        assert!(member_size("1k") < member_size("10k") && member_size("9") < member_size("1k"));
    }

    #[test]
    fn units_come_from_the_key() {
        for (key, unit) in [
            ("boot_to_agent_ms", "ms"),
            ("gateway_route_lookup_p50_ms_10k", "ms"),
            ("vmm_guest_tcp_guest_to_host_mib_s", "MiB/s"),
            ("sdk_creates_per_s_4way", "/s"),
            ("balloon_reclaim_s", "s"),
            ("child_private_mib", "MiB"),
            ("image_disk_bytes_16", "B"),
            ("image_disk_16_vs_unique", "ratio"),
            ("idle_children_per_24gib", ""),
            ("density_idle_sandboxes", ""),
        ] {
            assert_eq!(super::unit(key), unit, "{key}");
        }
        let (md, plots) = paths(Path::new("out/bench.json"));
        assert_eq!(
            (md.as_path(), plots.as_path()),
            (Path::new("out/bench.md"), Path::new("out/bench-plots"))
        );
    }
}

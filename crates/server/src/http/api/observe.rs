//! `GET /sandboxes/{id}/metrics` and the logs routes (`GET /sandboxes/{id}/logs`,
//! `GET /v2/sandboxes/{id}/logs`): what the node sampled and read of the
//! sandbox (see `sandbox::observe`), a fresh look first when it runs.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};

use super::extract::{SandboxId, number, query};
use super::{ApiError, Shared};
use crate::node::clock::{now_ms, rfc3339};
use crate::node::sandbox::{Level, LogLine, Sample};
use crate::node::store::SandboxState;
use crate::wire;

/// Most log entries one answer holds (E2B's default and limit).
pub const MAX_LOGS: usize = 1000;

/// Looks at the sandbox now when it runs; 404 when there is no such sandbox.
async fn refresh(state: &Shared, id: &str) -> Result<(), ApiError> {
    let id = &SandboxId::parse(id)?;
    if state.manager.get(id)?.state == SandboxState::Running {
        state.manager.observe(id).await;
    }
    Ok(())
}

/// `GET /v1/sandboxes/{id}/diagnostics` (sandfork's own, for the node's
/// operator): a running sandbox's VMM diagnostics as text; 404 unknown, 409
/// when no VMM of it runs.
pub async fn diagnostics(
    State(state): State<Shared>,
    SandboxId(id): SandboxId,
) -> Result<String, ApiError> {
    let record = state.manager.get(&id)?;
    let not_running = || {
        ApiError::new(
            StatusCode::CONFLICT,
            format!(
                "sandbox {id} is {}: no VMM to diagnose",
                record.state.as_str()
            ),
        )
    };
    if record.state != SandboxState::Running {
        return Err(not_running());
    }
    state.manager.diagnostics(&id).await.ok_or_else(not_running)
}

/// `start` and `end` in unix seconds (both optional, both inclusive).
fn metrics_range(uri: &Uri) -> Result<(u64, u64), ApiError> {
    let (mut from, mut to) = (0, u64::MAX);
    for (k, v) in query(uri) {
        match k.as_str() {
            "start" => from = number("start", &v)?.saturating_mul(1000),
            // through the end of that second
            "end" => to = number("end", &v)?.saturating_mul(1000).saturating_add(999),
            _ => {}
        }
    }
    if from > to {
        return Err(ApiError::bad_request("start must not be after end"));
    }
    Ok((from, to))
}

/// `GET /sandboxes/{id}/metrics?start=&end=`: E2B's SandboxMetric array,
/// oldest first.
pub async fn metrics(
    State(state): State<Shared>,
    Path(id): Path<String>,
    uri: Uri,
) -> Result<Json<Vec<wire::SandboxMetric>>, ApiError> {
    let (from, to) = metrics_range(&uri)?;
    refresh(&state, &id).await?;
    let samples = state.manager.samples(&id, from, to);
    Ok(Json(samples.iter().map(metric).collect()))
}

/// E2B's SandboxMetric.
fn metric(s: &Sample) -> wire::SandboxMetric {
    let m = &s.metrics;
    wire::SandboxMetric {
        timestamp: rfc3339(s.at_ms),
        timestamp_unix: s.at_ms / 1000,
        cpu_count: m.cpu_count,
        cpu_used_pct: m.cpu_used_pct,
        mem_used: m.mem_used,
        mem_total: m.mem_total,
        mem_cache: m.mem_cache,
        disk_used: m.disk_used,
        disk_total: m.disk_total,
    }
}

/// Most sandboxes one batch metrics request may name.
const MAX_BATCH: usize = 100;

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: the latest sample of each named
/// sandbox that has one, `{"sandboxes": {id: SandboxMetric}}`. Unknown (or
/// impossible) ids
/// are left out, as E2B does, rather than failing the whole batch.
pub async fn metrics_batch(
    State(state): State<Shared>,
    axum::Extension(caller): axum::Extension<crate::node::tenants::Caller>,
    uri: Uri,
) -> Result<Json<wire::SandboxesMetrics>, ApiError> {
    let ids: Vec<String> = query(&uri)
        .into_iter()
        .filter(|(k, _)| k == "sandbox_ids")
        .flat_map(|(_, v)| {
            v.split(',')
                .map(str::trim)
                .filter(|id| !id.is_empty())
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    if ids.is_empty() {
        return Err(ApiError::bad_request(
            "sandbox_ids is required: a comma-separated list of sandbox ids",
        ));
    }
    if ids.len() > MAX_BATCH {
        return Err(ApiError::bad_request(format!(
            "sandbox_ids names {} sandboxes; at most {MAX_BATCH}",
            ids.len()
        )));
    }
    let mut out = wire::SandboxesMetrics::default();
    for id in ids {
        if SandboxId::parse(&id).is_err() {
            continue;
        }
        match state.manager.get(&id) {
            // Another team's is left out as an unknown one.
            Ok(r) if !caller.owns(r.team.as_deref()) => continue,
            Ok(r) if r.state == SandboxState::Running => state.manager.observe(&id).await,
            Ok(_) => {}
            Err(_) => continue,
        }
        if let Some(last) = state.manager.samples(&id, 0, u64::MAX).last() {
            out.sandboxes.insert(id, metric(last));
        }
    }
    Ok(Json(out))
}

fn entry(l: &LogLine) -> wire::SandboxLogEntry {
    wire::SandboxLogEntry {
        timestamp: rfc3339(l.at_ms),
        level: l.level.as_str().to_owned(),
        message: l.message.clone(),
        fields: wire::LogFields {
            source: l.source.to_owned(),
        },
    }
}

fn limit(v: &str) -> Result<usize, ApiError> {
    v.parse::<usize>()
        .ok()
        .filter(|n| (1..=MAX_LOGS).contains(n))
        .ok_or_else(|| {
            ApiError::bad_request(format!("limit must be a whole number from 1 to {MAX_LOGS}"))
        })
}

/// A log line as E2B's `SandboxLog.line`: a [`wire::LogLine`] in text.
fn v1_line(l: &LogLine) -> String {
    let line = wire::LogLine {
        level: l.level.as_str().to_owned(),
        logger: l.source.to_owned(),
        message: l.message.clone(),
    };
    // Strings only: it cannot fail to serialize.
    serde_json::to_string(&line).unwrap_or_default()
}

/// `GET /sandboxes/{id}/logs?start=<unix ms>&limit=`: lines from `start` on,
/// oldest first, as `logs` (`{timestamp, line}`, `line` a JSON object, see
/// [`v1_line`]) and `logEntries`.
pub async fn logs_v1(
    State(state): State<Shared>,
    Path(id): Path<String>,
    uri: Uri,
) -> Result<Json<wire::SandboxLogs>, ApiError> {
    let (mut from, mut max) = (0, MAX_LOGS);
    for (k, v) in query(&uri) {
        match k.as_str() {
            "start" => from = number("start", &v)?,
            "limit" => max = limit(&v)?,
            _ => {}
        }
    }
    refresh(&state, &id).await?;
    let lines: Vec<LogLine> = state
        .manager
        .log_lines(&id)
        .into_iter()
        .filter(|l| l.at_ms >= from)
        .take(max)
        .collect();
    let logs = lines
        .iter()
        .map(|l| wire::SandboxLog {
            timestamp: rfc3339(l.at_ms),
            line: v1_line(l),
        })
        .collect();
    let log_entries = lines.iter().map(entry).collect();
    Ok(Json(wire::SandboxLogs { logs, log_entries }))
}

#[derive(Debug, PartialEq, Eq)]
struct V2Query {
    cursor: Option<u64>,
    limit: usize,
    backward: bool,
    level: Level,
    search: Option<String>,
}

fn parse_v2(uri: &Uri) -> Result<V2Query, ApiError> {
    let mut q = V2Query {
        cursor: None,
        limit: MAX_LOGS,
        backward: false,
        level: Level::Debug,
        search: None,
    };
    for (k, v) in query(uri) {
        match k.as_str() {
            "cursor" => q.cursor = Some(number("cursor", &v)?),
            "limit" => q.limit = limit(&v)?,
            "direction" => {
                q.backward = match v.as_str() {
                    "forward" => false,
                    "backward" => true,
                    other => {
                        return Err(ApiError::bad_request(format!(
                            "direction {other:?} is not forward or backward"
                        )));
                    }
                }
            }
            "level" => {
                q.level = Level::parse(&v).ok_or_else(|| {
                    ApiError::bad_request(format!("level {v:?} is not debug, info, warn or error"))
                })?
            }
            "search" => q.search = Some(v),
            _ => {}
        }
    }
    Ok(q)
}

/// `GET /v2/sandboxes/{id}/logs?cursor=<unix ms>&limit=&direction=&level=&search=`:
/// `{"logs": [SandboxLogEntry]}`; forward from the cursor (oldest first) or
/// backward to it (newest first); `level` is the lowest level wanted.
pub async fn logs_v2(
    State(state): State<Shared>,
    Path(id): Path<String>,
    uri: Uri,
) -> Result<Json<wire::SandboxLogsV2>, ApiError> {
    let q = parse_v2(&uri)?;
    refresh(&state, &id).await?;
    let mut lines: Vec<LogLine> = state
        .manager
        .log_lines(&id)
        .into_iter()
        .filter(|l| l.level >= q.level)
        .filter(|l| q.search.as_ref().is_none_or(|s| l.message.contains(s)))
        .collect();
    if q.backward {
        let cursor = q.cursor.unwrap_or_else(now_ms);
        lines.retain(|l| l.at_ms <= cursor);
        lines.reverse();
    } else {
        let cursor = q.cursor.unwrap_or(0);
        lines.retain(|l| l.at_ms >= cursor);
    }
    lines.truncate(q.limit);
    let logs = lines.iter().map(entry).collect();
    Ok(Json(wire::SandboxLogsV2 { logs }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn uri(q: &str) -> Uri {
        format!("/x?{q}").parse().unwrap()
    }

    #[test]
    fn metrics_range_is_in_seconds_and_checked() {
        assert_eq!(metrics_range(&uri("")).unwrap(), (0, u64::MAX));
        assert_eq!(
            metrics_range(&uri("start=10&end=20")).unwrap(),
            (10_000, 20_999)
        );
        for bad in ["start=x", "end=-1", "start=5&end=4"] {
            assert!(metrics_range(&uri(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn v1_lines_are_json_objects_as_the_e2b_cli_reads_them() {
        let l = LogLine {
            at_ms: 1,
            level: Level::Warn,
            source: "agent",
            message: "disk \"full\"".into(),
        };
        let parsed: Value = serde_json::from_str(&v1_line(&l)).unwrap();
        assert_eq!(
            parsed,
            json!({"level": "warn", "logger": "agent", "message": "disk \"full\""})
        );
    }

    #[test]
    fn v2_logs_query_is_parsed_and_checked() {
        let q = parse_v2(&uri(
            "cursor=5&limit=3&direction=backward&level=warn&search=a+b",
        ))
        .unwrap();
        assert_eq!(
            q,
            V2Query {
                cursor: Some(5),
                limit: 3,
                backward: true,
                level: Level::Warn,
                search: Some("a b".into()),
            }
        );
        for bad in [
            "limit=0",
            "limit=1001",
            "direction=up",
            "level=loud",
            "cursor=x",
        ] {
            assert!(parse_v2(&uri(bad)).is_err(), "{bad}");
        }
    }
}

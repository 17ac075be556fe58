//! `GET /v2/sandboxes` and `GET /sandboxes`: query parsing, filters, and
//! pagination through the `x-next-token` header.

use std::collections::BTreeMap;
use std::time::UNIX_EPOCH;

use percent_encoding::percent_decode_str;

use axum::Json;
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};

use super::ApiError;
use crate::node::store::{SandboxRecord, SandboxState};

/// E2B's default and largest page.
pub const MAX_LIMIT: usize = 100;

/// A page size: a whole number from 1 to [`MAX_LIMIT`].
pub fn parse_limit(value: &str) -> Result<usize, ApiError> {
    value
        .parse::<usize>()
        .ok()
        .filter(|n| (1..=MAX_LIMIT).contains(n))
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "limit must be a whole number from 1 to {MAX_LIMIT}"
            ))
        })
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListQuery {
    pub metadata: BTreeMap<String, String>,
    /// Empty means every state.
    pub states: Vec<SandboxState>,
    pub limit: usize,
    pub next_token: Option<(u64, String)>,
    /// Sandboxes started at or after this time (the SDKs' documented meaning).
    pub started_after_ms: Option<u64>,
    pub template: Option<String>,
    pub descending: bool,
}

impl Default for ListQuery {
    fn default() -> Self {
        ListQuery {
            metadata: BTreeMap::new(),
            states: Vec::new(),
            limit: MAX_LIMIT,
            next_token: None,
            started_after_ms: None,
            template: None,
            descending: true,
        }
    }
}

fn unescape(s: &str) -> String {
    percent_decode_str(s).decode_utf8_lossy().into_owned()
}

/// Undoes the SDK's layered encoding of the `metadata` filter (the query
/// value as the framework decoded it once): unescape the whole string, split
/// on `&` and `=`, then unescape each key and value.
pub fn decode_metadata_filter(value: &str) -> Result<BTreeMap<String, String>, ApiError> {
    let whole = unescape(value);
    let mut out = BTreeMap::new();
    for pair in whole.split('&').filter(|p| !p.is_empty()) {
        let Some((k, v)) = pair.split_once('=') else {
            return Err(ApiError::bad_request(format!(
                "metadata filter {pair:?} is not key=value"
            )));
        };
        out.insert(unescape(k), unescape(v));
    }
    Ok(out)
}

/// Milliseconds since the epoch of an RFC 3339 time as the SDKs send it:
/// JS `toISOString()` (`...T09:40:00.123Z`), Python `astimezone().isoformat()`
/// (`...T10:40:00.123456+01:00`, microseconds and the local offset). A `+`
/// that reached us unescaped was decoded to a space; it is read as `+`. A
/// time with no offset is taken as UTC.
pub fn parse_time_ms(value: &str) -> Option<u64> {
    let value = value.trim();
    // The offset, if any, follows the time part (after the date's `T`).
    let time_at = value.find(['T', 't', ' '])?;
    let (local, offset_secs) = match value[time_at + 1..].find(['+', '-', ' ']) {
        Some(i) => {
            let at = time_at + 1 + i;
            let sign: i64 = if &value[at..=at] == "-" { -1 } else { 1 };
            let digits: String = value[at + 1..].chars().filter(|c| *c != ':').collect();
            if digits.len() != 4 || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let (h, m): (i64, i64) = (digits[..2].parse().ok()?, digits[2..].parse().ok()?);
            if h > 23 || m > 59 {
                return None;
            }
            (&value[..at], sign * (h * 3600 + m * 60))
        }
        None => (value, 0),
    };
    let local = humantime::parse_rfc3339_weak(local.trim_end_matches(['Z', 'z'])).ok()?;
    let local_ms = local.duration_since(UNIX_EPOCH).ok()?.as_millis() as i64;
    u64::try_from(local_ms - offset_secs * 1000).ok()
}

fn token(r: &SandboxRecord) -> String {
    format!("{}.{}", r.started_at_ms, r.id)
}

fn parse_token(t: &str) -> Result<(u64, String), ApiError> {
    t.split_once('.')
        .and_then(|(ms, id)| Some((ms.parse().ok()?, id.to_owned())))
        .ok_or_else(|| ApiError::bad_request("nextToken is malformed"))
}

impl ListQuery {
    /// Parses the raw query string (`?` excluded).
    pub fn parse(raw: Option<&str>) -> Result<ListQuery, ApiError> {
        let mut q = ListQuery::default();
        for (key, value) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
            match key.as_ref() {
                "metadata" => q.metadata.extend(decode_metadata_filter(&value)?),
                "state" => {
                    for s in value.split(',').filter(|s| !s.is_empty()) {
                        q.states.push(match s {
                            "running" => SandboxState::Running,
                            "paused" => SandboxState::Paused,
                            other => {
                                return Err(ApiError::bad_request(format!(
                                    "state {other:?} is not running or paused"
                                )));
                            }
                        });
                    }
                }
                "limit" => q.limit = parse_limit(&value)?,
                "nextToken" if !value.is_empty() => q.next_token = Some(parse_token(&value)?),
                "startedAfter" if !value.is_empty() => {
                    q.started_after_ms = Some(parse_time_ms(&value).ok_or_else(|| {
                        ApiError::bad_request(format!(
                            "startedAfter {value:?} is not an RFC 3339 time"
                        ))
                    })?);
                }
                "template" if !value.is_empty() => q.template = Some(value.into_owned()),
                "order" => {
                    q.descending = match value.as_ref() {
                        "asc" => false,
                        "desc" | "" => true,
                        other => {
                            return Err(ApiError::bad_request(format!(
                                "order {other:?} is not asc or desc"
                            )));
                        }
                    }
                }
                // Unknown parameters are ignored, as E2B does.
                _ => {}
            }
        }
        Ok(q)
    }

    fn matches(&self, r: &SandboxRecord) -> bool {
        (self.states.is_empty() || self.states.contains(&r.state))
            && self
                .metadata
                .iter()
                .all(|(k, v)| r.metadata.get(k) == Some(v))
            && self.started_after_ms.is_none_or(|t| r.started_at_ms >= t)
            && self
                .template
                .as_ref()
                .is_none_or(|t| *t == r.template_id || r.alias.as_ref() == Some(t))
    }

    /// The page of `all` this query asks for, and the token of the next page.
    pub fn page(&self, mut all: Vec<SandboxRecord>) -> (Vec<SandboxRecord>, Option<String>) {
        all.retain(|r| self.matches(r));
        all.sort_by(|a, b| (a.started_at_ms, &a.id).cmp(&(b.started_at_ms, &b.id)));
        if self.descending {
            all.reverse();
        }
        if let Some((ms, id)) = &self.next_token {
            let after = |r: &SandboxRecord| {
                let key = (r.started_at_ms, &r.id);
                if self.descending {
                    key < (*ms, id)
                } else {
                    key > (*ms, id)
                }
            };
            all.retain(after);
        }
        let next = (all.len() > self.limit).then(|| token(&all[self.limit - 1]));
        all.truncate(self.limit);
        (all, next)
    }
}

/// One page of a listing: its items as JSON, and the token of the next
/// page (if any) in the `x-next-token` header.
pub fn page_answer<T: serde::Serialize>(items: Vec<T>, next: Option<String>) -> Response {
    let mut response = Json(items).into_response();
    if let Some(token) = next.and_then(|t| HeaderValue::from_str(&t).ok()) {
        response
            .headers_mut()
            .insert(crate::wire::NEXT_TOKEN_HEADER, token);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::store::SandboxRecord;

    fn rec(id: &str, started: u64, state: SandboxState, meta: &[(&str, &str)]) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            template_id: "base".into(),
            alias: Some("base".into()),
            metadata: meta
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            started_at_ms: started,
            end_at_ms: started + 1000,
            state,
            cpu_count: 1,
            memory_mb: 256,
            disk_size_mb: 2048,
            ..Default::default()
        }
    }

    #[test]
    fn started_after_reads_the_times_both_sdks_send() {
        // 2026-01-01T00:00:00Z
        let base = 1_767_225_600_000;
        for (text, ms) in [
            ("2026-01-01T00:00:00.123Z", base + 123),
            ("2026-01-01T00:00:00Z", base),
            ("2026-01-01T01:00:00.123456+01:00", base + 123),
            ("2025-12-31T19:30:00-04:30", base),
            ("2026-01-01T00:00:00.5+0000", base + 500),
            // an unescaped `+` the query decoding made a space
            ("2026-01-01T02:00:00 02:00", base),
            ("2026-01-01T00:00:00", base),
        ] {
            assert_eq!(parse_time_ms(text), Some(ms), "{text}");
        }
        for bad in [
            "yesterday",
            "2026-01-01T00:00:00+1",
            "2026-01-01T00:00:00+25:00",
            "",
        ] {
            assert_eq!(parse_time_ms(bad), None, "{bad}");
        }
        // Through the query, as Python's httpx encodes it.
        let q = ListQuery::parse(Some(
            "startedAfter=2026-01-01T01%3A00%3A00.000001%2B01%3A00",
        ))
        .unwrap();
        assert_eq!(q.started_after_ms, Some(base));
    }

    #[test]
    fn metadata_filter_is_decoded_the_way_e2b_does() {
        // What the Python SDK sends for {"k": "v w"}: `metadata=k%3Dv%252520w`.
        let q = ListQuery::parse(Some("metadata=k%3Dv%252520w")).unwrap();
        assert_eq!(q.metadata, BTreeMap::from([("k".into(), "v w".into())]));
        let q = ListQuery::parse(Some("metadata=a%3D1%26b%3D2")).unwrap();
        assert_eq!(q.metadata.len(), 2);
        assert_eq!(q.metadata["b"], "2");
        assert!(ListQuery::parse(Some("metadata=novalue")).is_err());
    }

    #[test]
    fn query_parameters_are_validated() {
        let q = ListQuery::parse(Some("state=running,paused&limit=5&order=asc")).unwrap();
        assert_eq!(q.states, vec![SandboxState::Running, SandboxState::Paused]);
        assert_eq!(q.limit, 5);
        assert!(!q.descending);
        for bad in [
            "state=dead",
            "limit=0",
            "limit=101",
            "limit=x",
            "order=up",
            "nextToken=junk",
            "startedAfter=yesterday",
        ] {
            let err = ListQuery::parse(Some(bad)).unwrap_err();
            assert_eq!(err.status, axum::http::StatusCode::BAD_REQUEST, "{bad}");
        }
        assert_eq!(ListQuery::parse(None).unwrap(), ListQuery::default());
        let q = ListQuery::parse(Some("startedAfter=2026-01-01T00:00:00Z")).unwrap();
        assert_eq!(q.started_after_ms, Some(1_767_225_600_000));
    }

    #[test]
    fn filters_apply_together() {
        let all = vec![
            rec("a", 1, SandboxState::Running, &[("team", "x")]),
            rec("b", 2, SandboxState::Paused, &[("team", "x")]),
            rec("c", 3, SandboxState::Running, &[("team", "y")]),
        ];
        let q = ListQuery::parse(Some("state=running&metadata=team%3Dx")).unwrap();
        let (page, next) = q.page(all.clone());
        assert_eq!(page.iter().map(|r| &r.id[..]).collect::<Vec<_>>(), ["a"]);
        assert_eq!(next, None);
        let q = ListQuery::parse(Some("template=other")).unwrap();
        assert!(q.page(all.clone()).0.is_empty());
        // "at or after", as the SDKs document it.
        let q = ListQuery::parse(Some("startedAfter=1970-01-01T00:00:00.001Z")).unwrap();
        assert_eq!(q.page(all.clone()).0.len(), 3);
        let q = ListQuery::parse(Some("startedAfter=1970-01-01T00:00:00.002Z")).unwrap();
        assert_eq!(q.page(all).0.len(), 2);
    }

    #[test]
    fn pages_follow_each_other_without_gaps_or_repeats() {
        let all: Vec<_> = (0..7)
            .map(|i| {
                rec(
                    &format!("s{i}"),
                    100 + i as u64 / 2,
                    SandboxState::Running,
                    &[],
                )
            })
            .collect();
        for order in ["asc", "desc"] {
            let mut seen = Vec::new();
            let mut token: Option<String> = None;
            loop {
                let raw = match &token {
                    Some(t) => format!("limit=3&order={order}&nextToken={t}"),
                    None => format!("limit=3&order={order}"),
                };
                let (page, next) = ListQuery::parse(Some(&raw)).unwrap().page(all.clone());
                assert!(page.len() <= 3);
                seen.extend(page.into_iter().map(|r| r.id));
                match next {
                    Some(t) => token = Some(t),
                    None => break,
                }
            }
            let mut expected: Vec<_> = all.iter().map(|r| r.id.clone()).collect();
            if order == "desc" {
                expected.reverse();
            }
            assert_eq!(seen, expected, "{order}");
        }
    }
}

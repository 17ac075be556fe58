//! E2B's template-build routes, as the unmodified SDK's `Template.build`
//! calls them: `POST /v3/templates` (202), `GET /templates/{id}/files/{hash}`
//! (201, an upload link), `PUT /e2b-files/{token}` (the link: no API key, the
//! token is the credential), `POST /v2/templates/{id}/builds/{buildID}`
//! (202). The status route is sandfork's ([`super::templates::build_status`]),
//! which answers E2B's `logEntries` and `reason.step` too. The builds
//! themselves: [`crate::template::e2b_build`].

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use super::sandboxes::parse_body;
use super::{ApiError, Shared};
use crate::template::build::check_name;
use crate::template::e2b_build::{self, RawStep, Step, StepsPlan, Waiting};
use crate::template::{BuildParams, BuildSource};

/// `TemplateBuildRequestV3` (`teamID`, `cpuCount`, `memoryMB` accepted and
/// not used: a build's sandbox keeps its base template's machine).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RequestV3 {
    name: Option<String>,
    alias: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
}

/// The template name of an E2B build request: lowercased, a team
/// namespace (`team/alias`) dropped, the `default` tag alone accepted.
fn request_name(body: &Bytes) -> Result<String, ApiError> {
    let req: RequestV3 = parse_body(body)?;
    let raw = req
        .name
        .or(req.alias)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ApiError::bad_request("name is required"))?
        .to_lowercase();
    let raw = raw.rsplit('/').next().unwrap_or_default();
    let (name, tag) = match raw.split_once(':') {
        Some((n, t)) => (n, Some(t)),
        None => (raw, None),
    };
    let tags = tag.into_iter().chain(req.tags.iter().map(String::as_str));
    for t in tags {
        if t != "default" {
            return Err(ApiError::bad_request(format!(
                "tag {t:?}: this node keeps one build per template name (tags other than \
                 \"default\" are not supported)"
            )));
        }
    }
    check_name(name)?;
    Ok(name.to_owned())
}

/// `POST /v3/templates`: 202 `{templateID, buildID, public, names, tags,
/// aliases}` (all six: the SDK's client needs them); 409 when a template of
/// that name exists (delete it first).
pub async fn request_build(State(state): State<Shared>, body: Bytes) -> Result<Response, ApiError> {
    let name = request_name(&body)?;
    if state.manager.resolve_template(&name).is_ok() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("a template named {name} exists: delete it (DELETE /templates/{name}) first"),
        ));
    }
    let template_id = crate::ids::sandbox_id()
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let build_id = crate::template::build::uuid()?;
    state.templates.e2b().add_waiting(
        &template_id,
        Waiting {
            build_id: build_id.clone(),
            name: name.clone(),
        },
    );
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({
            "templateID": template_id,
            "buildID": build_id,
            "public": false,
            "names": [name],
            "tags": ["default"],
            "aliases": [name],
        })),
    )
        .into_response())
}

/// The base URL the caller reached the node at (its `Host`).
fn base_url(headers: &HeaderMap) -> Result<String, ApiError> {
    let host = headers
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .filter(|h| {
            !h.is_empty()
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
        })
        .ok_or_else(|| ApiError::bad_request("a Host header is needed for the upload link"))?;
    let scheme = match headers
        .get("x-forwarded-proto")
        .and_then(|h| h.to_str().ok())
    {
        Some("https") => "https",
        _ => "http",
    };
    Ok(format!("{scheme}://{host}"))
}

/// `GET /templates/{id}/files/{hash}`: 201 `{present, url}`; 400 for a
/// malformed hash, 404 for a template with no waiting build.
pub async fn file_link(
    State(state): State<Shared>,
    Path((id, hash)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    e2b_build::check_files_hash(&hash).map_err(ApiError::bad_request)?;
    let e2b = state.templates.e2b();
    if e2b.waiting(&id).is_none() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("template {id} has no build waiting for files"),
        ));
    }
    let token = e2b
        .new_link(&id, &hash)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let url = format!("{}/e2b-files/{token}", base_url(&headers)?);
    Ok((
        StatusCode::CREATED,
        Json(json!({"present": e2b.has_file(&hash), "url": url})),
    )
        .into_response())
}

/// `PUT /e2b-files/{token}` (no API key: the link's token is the
/// credential): 200 once the archive is stored; 404 for an unknown or
/// expired link.
pub async fn upload(
    State(state): State<Shared>,
    Path(token): Path<String>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let (_, hash) =
        state.templates.e2b().link(&token).ok_or_else(|| {
            ApiError::new(StatusCode::NOT_FOUND, "unknown or expired upload link")
        })?;
    let shared = state.clone();
    tokio::task::spawn_blocking(move || shared.templates.e2b().store_file(&hash, &body))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("storing the upload: {e}"),
            )
        })?;
    Ok(StatusCode::OK)
}

/// `TemplateBuildStartV2`; unknown fields (`force`, ...) ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StartV2 {
    from_image: Option<String>,
    from_template: Option<String>,
    from_image_registry: Option<serde_json::Value>,
    #[serde(default)]
    steps: Vec<RawStep>,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
}

/// The start request checked into a plan and its start and ready commands.
fn parse_start(body: &Bytes) -> Result<(StepsPlan, Option<String>, Option<String>), ApiError> {
    let req: StartV2 = parse_body(body)?;
    let base = e2b_build::map_base(
        req.from_template.as_deref(),
        req.from_image.as_deref(),
        req.from_image_registry.as_ref(),
    )
    .map_err(ApiError::bad_request)?;
    let steps = e2b_build::parse_steps(req.steps).map_err(ApiError::bad_request)?;
    let (base, pull) = match base {
        e2b_build::Base::Template(t) => (t, None),
        e2b_build::Base::Image(i) => (String::new(), Some(i)),
    };
    Ok((
        StepsPlan { base, steps, pull },
        req.start_cmd,
        req.ready_cmd,
    ))
}

/// `POST /v2/templates/{id}/builds/{buildID}`: 202, the build runs on; 400
/// for bad steps, a build not waiting, or files not uploaded; 404 unknown.
pub async fn start_build(
    State(state): State<Shared>,
    Path((id, build_id)): Path<(String, String)>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let e2b = state.templates.e2b();
    let waiting = match e2b.waiting(&id) {
        Some(w) if w.build_id == build_id => w,
        Some(_) => {
            return Err(ApiError::bad_request(format!(
                "build {build_id} is not in waiting state"
            )));
        }
        None if state.manager.store().build(&id).ok().flatten().is_some() => {
            return Err(ApiError::bad_request(format!(
                "build {build_id} is not in waiting state"
            )));
        }
        None => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("template {id} not found"),
            ));
        }
    };
    let (plan, start_cmd, ready_cmd) = parse_start(&body)?;
    for (i, step) in plan.steps.iter().enumerate() {
        if let Step::Copy { files_hash, .. } = step
            && !e2b.has_file(files_hash)
        {
            return Err(ApiError::bad_request(format!(
                "step {}: its files ({files_hash}) were not uploaded",
                i + 1
            )));
        }
    }
    state.templates.start(BuildParams {
        name: waiting.name,
        source: BuildSource::Steps(plan),
        start_cmd,
        ready_cmd,
        vcpus: None,
        mem_mib: None,
        ids: Some((id.clone(), build_id)),
    })?;
    e2b.take_waiting(&id);
    Ok(StatusCode::ACCEPTED)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> Result<String, ApiError> {
        request_name(&Bytes::from(s.to_owned()))
    }

    #[test]
    fn build_requests_name_one_template() {
        assert_eq!(name(r#"{"name":"My-T","cpuCount":2}"#).unwrap(), "my-t");
        assert_eq!(name(r#"{"name":"team/t:default"}"#).unwrap(), "t");
        assert_eq!(name(r#"{"alias":"t","memoryMB":1024}"#).unwrap(), "t");
        for bad in [
            "{}",
            "[]",
            r#"{"name":""}"#,
            r#"{"name":"t:v1"}"#,
            r#"{"name":"t","tags":["v2"]}"#,
            r#"{"name":"a b"}"#,
        ] {
            assert_eq!(
                name(bad).unwrap_err().status,
                StatusCode::BAD_REQUEST,
                "{bad}"
            );
        }
    }

    #[test]
    fn start_requests_parse_as_the_sdk_sends_them() {
        let body = Bytes::from(
            r#"{"fromTemplate":"base","force":false,"steps":[
                {"type":"RUN","args":["echo hi","user"],"force":false},
                {"type":"COPY","args":["d/","/app/","user","0755"],"force":false,
                 "filesHash":"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                 "forceUpload":true},
                {"type":"ENV","args":["A","1"],"force":false}],
               "startCmd":"sleep 1000","readyCmd":"true"}"#,
        );
        let (plan, start, ready) = parse_start(&body).unwrap();
        assert_eq!(plan.base, "base");
        assert_eq!(plan.steps.len(), 3);
        assert_eq!(
            (start.as_deref(), ready.as_deref()),
            (Some("sleep 1000"), Some("true"))
        );
        for (bad, why) in [
            (r#"{"steps":[]}"#, "fromTemplate or fromImage"),
            (
                r#"{"fromImage":"Ubuntu 22.04","steps":[]}"#,
                "image reference",
            ),
            (
                r#"{"fromImage":"e2bdev/base","fromImageRegistry":{"type":"registry"}}"#,
                "username",
            ),
            (
                r#"{"fromImage":"a/b","fromImageRegistry":{"type":"aws","awsRegion":"x"}}"#,
                "not supported",
            ),
            (
                r#"{"fromTemplate":"base","steps":[{"type":"HEALTHCHECK","args":[]}]}"#,
                "step 1",
            ),
            (r#"{"fromTemplate":"base","steps":{}}"#, ""),
        ] {
            let e = parse_start(&Bytes::from(bad)).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
            assert!(e.message.contains(why), "{}: {why}", e.message);
        }
    }

    #[test]
    fn links_point_at_the_host_asked() {
        let mut h = HeaderMap::new();
        assert!(base_url(&h).is_err());
        h.insert("host", "127.0.0.1:3000".parse().unwrap());
        assert_eq!(base_url(&h).unwrap(), "http://127.0.0.1:3000");
        h.insert("x-forwarded-proto", "https".parse().unwrap());
        assert_eq!(base_url(&h).unwrap(), "https://127.0.0.1:3000");
        h.insert("host", "evil/path".parse().unwrap());
        assert!(base_url(&h).is_err());
    }
}

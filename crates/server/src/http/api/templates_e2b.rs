//! E2B's template-build routes, as the unmodified SDK's `Template.build`
//! calls them: `POST /v3/templates` (202), `GET /templates/{id}/files/{hash}`
//! (201, an upload link), `PUT /e2b-files/{token}` (the link: no API key, the
//! token is the credential), `POST /v2/templates/{id}/builds/{buildID}`
//! (202). The status route is sandfork's ([`super::templates::build_status`]),
//! which answers E2B's `logEntries` and `reason.step` too. The builds
//! themselves: [`crate::node::template::e2b_build`].

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::extract::JsonBody;
use super::{ApiError, Shared};
use crate::node::store::BuildStatus;
use crate::node::template::build::check_name;
use crate::node::template::e2b_build::{self, RawStep, Step, StepsPlan};
use crate::node::template::{BuildParams, BuildSource};
use crate::wire;

/// `TemplateBuildRequestV3` (`teamID` accepted and not used).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RequestV3 {
    name: Option<String>,
    alias: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
    cpu_count: Option<i64>,
    #[serde(rename = "memoryMB")]
    memory_mb: Option<i64>,
}

/// An E2B build request checked: the alias (lowercased, a team namespace
/// `team/alias` dropped), its tags (`name:tag` and `tags`; `default` when
/// none), and its machine.
#[derive(Debug, PartialEq, Eq)]
struct Requested {
    alias: String,
    tags: Vec<String>,
    vcpus: Option<u8>,
    mem_mib: Option<u64>,
}

/// `name` or `name:tag` (a namespace dropped, lowercased).
pub(super) fn split_name(raw: &str) -> (String, Option<String>) {
    let raw = raw.to_lowercase();
    let raw = raw.rsplit('/').next().unwrap_or_default().to_owned();
    match raw.split_once(':') {
        Some((n, t)) => (n.to_owned(), Some(t.to_owned())),
        None => (raw, None),
    }
}

fn request(body: &Bytes) -> Result<Requested, ApiError> {
    let req: RequestV3 = JsonBody::parse(body)?;
    let raw = req
        .name
        .or(req.alias)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ApiError::bad_request("name is required"))?;
    let (alias, tag) = split_name(&raw);
    check_name(&alias)?;
    let mut tags: Vec<String> = Vec::new();
    for t in tag
        .into_iter()
        .chain(req.tags.iter().map(|t| t.to_lowercase()))
    {
        e2b_build::check_tag(&t).map_err(ApiError::bad_request)?;
        if !tags.contains(&t) {
            tags.push(t);
        }
    }
    if tags.is_empty() {
        tags.push(e2b_build::DEFAULT_TAG.to_owned());
    }
    let (vcpus, mem_mib) =
        super::templates::machine_size((req.cpu_count, "cpuCount"), (req.memory_mb, "memoryMB"))?;
    Ok(Requested {
        alias,
        tags,
        vcpus,
        mem_mib,
    })
}

/// `POST /v3/templates`: 202 `{templateID, buildID, public, names, tags,
/// aliases}` (all six: the SDK's client needs them). A name this node has
/// already built is rebuilt: the same `templateID`, a new build, which takes
/// the name's tags when it is ready. A name another team holds is a 409.
pub async fn request_build(
    State(state): State<Shared>,
    axum::Extension(caller): axum::Extension<crate::node::tenants::Caller>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req = request(&body)?;
    if let Ok(existing) = state.manager.resolve_template(&req.alias)
        && !super::tenancy::sees_template(&state, &caller, &existing.id)
    {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("the template name {} is taken", req.alias),
        ));
    }
    // 0: the base's (known when the build starts).
    let build = state.templates.e2b_request(
        &req.alias,
        req.tags.clone(),
        req.vcpus.unwrap_or(0),
        req.mem_mib.unwrap_or(0),
    )?;
    super::tenancy::own_template(&state, &caller, e2b_build::e2b_template_id(&build))?;
    Ok((
        StatusCode::ACCEPTED,
        Json(wire::TemplateRequested {
            build: wire::BuildNames {
                template_id: e2b_build::e2b_template_id(&build).to_owned(),
                build_id: build.build_id.clone(),
                names: vec![req.alias.clone()],
            },
            public: false,
            tags: req.tags,
            aliases: vec![req.alias],
        }),
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
    if !state.templates.e2b_waiting(&id)? {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("template {id} has no build waiting for files"),
        ));
    }
    let e2b = state.templates.e2b();
    let token = e2b
        .new_link(&id, &hash)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let url = format!("{}/e2b-files/{token}", base_url(&headers)?);
    Ok((
        StatusCode::CREATED,
        Json(wire::TemplateBuildFileUpload {
            present: e2b.has_file(&hash),
            url,
        }),
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

/// `TemplateBuildStartV2`; unknown fields ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StartV2 {
    from_image: Option<String>,
    from_template: Option<String>,
    from_image_registry: Option<serde_json::Value>,
    #[serde(default)]
    force: bool,
    #[serde(default)]
    steps: Vec<RawStep>,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
}

/// The start request checked into a plan and its start and ready commands.
fn parse_start(body: &Bytes) -> Result<(StepsPlan, Option<String>, Option<String>), ApiError> {
    let req: StartV2 = JsonBody::parse(body)?;
    let base = e2b_build::map_base(
        req.from_template.as_deref(),
        req.from_image.as_deref(),
        req.from_image_registry.as_ref(),
    )
    .map_err(ApiError::bad_request)?;
    let forced_from = req.steps.iter().position(|s| s.force);
    let steps = e2b_build::parse_steps(req.steps).map_err(ApiError::bad_request)?;
    let (base, pull) = match base {
        e2b_build::Base::Template(t) => (t, None),
        e2b_build::Base::Image(i) => (String::new(), Some(i)),
    };
    let plan = StepsPlan {
        base,
        steps,
        force: req.force,
        forced_from,
        pull,
    };
    Ok((plan, req.start_cmd, req.ready_cmd))
}

/// `POST /v2/templates/{id}/builds/{buildID}`: 202, the build runs on; 400
/// for bad steps, a build not waiting, or files not uploaded; 404 unknown.
pub async fn start_build(
    State(state): State<Shared>,
    Path((id, build_id)): Path<(String, String)>,
    axum::Extension(caller): axum::Extension<crate::node::tenants::Caller>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let e2b = state.templates.e2b();
    let waiting = match state.templates.e2b_build(&id, &build_id)? {
        Some(w) if w.status == BuildStatus::Waiting => w,
        Some(_) => {
            return Err(ApiError::bad_request(format!(
                "build {build_id} is not in waiting state"
            )));
        }
        None => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("template {id} has no build {build_id}"),
            ));
        }
    };
    let (plan, start_cmd, ready_cmd) = parse_start(&body)?;
    super::tenancy::check_template(&state, &caller, &plan.base)?;
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
        name: waiting.name.clone(),
        source: BuildSource::Steps(plan),
        start_cmd,
        ready_cmd,
        vcpus: (waiting.vcpus != 0).then_some(waiting.vcpus),
        mem_mib: (waiting.mem_mib != 0).then_some(waiting.mem_mib),
        e2b: Some(waiting),
        ids: None,
    })?;
    Ok(StatusCode::ACCEPTED)
}

/// `GET /templates/aliases/{alias}`: 200 `{templateID, public}`; 404 when
/// no template has that alias (E2B's `alias_exists` false).
pub async fn alias(
    State(state): State<Shared>,
    Path(alias): Path<String>,
) -> Result<Response, ApiError> {
    let (name, _) = split_name(&alias);
    match state.templates.e2b_template_of_alias(&name)? {
        Some(id) => Ok(Json(wire::TemplateAlias {
            template_id: id,
            public: false,
        })
        .into_response()),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("template alias {alias} not found"),
        )),
    }
}

/// `GET /v2/templates`: E2B's templates, one per `templateID` (its default
/// build, else its newest), base first.
pub async fn list_v2(State(state): State<Shared>) -> Result<Response, ApiError> {
    let all = state.templates.list()?;
    let mut seen: Vec<&str> = Vec::new();
    let mut out = Vec::new();
    for t in &all {
        if seen.contains(&t.id.as_str()) {
            continue;
        }
        seen.push(&t.id);
        let same: Vec<_> = all.iter().filter(|o| o.id == t.id).collect();
        let pick = same
            .iter()
            .find(|o| o.names.contains(&o.id))
            .or_else(|| same.iter().max_by_key(|o| o.created_at_ms))
            .copied()
            .unwrap_or(t);
        out.push(wire::Template::from(pick));
    }
    Ok(Json(out).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(s: &str) -> Result<Requested, ApiError> {
        request(&Bytes::from(s.to_owned()))
    }

    #[test]
    fn build_requests_name_a_template_and_its_tags() {
        let r = req(r#"{"name":"My-T","cpuCount":2,"memoryMB":1024}"#).unwrap();
        assert_eq!(
            r,
            Requested {
                alias: "my-t".into(),
                tags: vec!["default".into()],
                vcpus: Some(2),
                mem_mib: Some(1024)
            }
        );
        assert_eq!(req(r#"{"name":"team/t:default"}"#).unwrap().alias, "t");
        assert_eq!(req(r#"{"alias":"t"}"#).unwrap().tags, vec!["default"]);
        assert_eq!(
            req(r#"{"name":"t:v1","tags":["v2","v1"]}"#).unwrap().tags,
            vec!["v1", "v2"]
        );
        for bad in [
            "{}",
            "[]",
            r#"{"name":""}"#,
            r#"{"name":"t:v 1"}"#,
            r#"{"name":"t","tags":["0f8fad5b-d9cb-469f-a165-70867728950e"]}"#,
            r#"{"name":"a b"}"#,
            r#"{"name":"t","cpuCount":0}"#,
            r#"{"name":"t","memoryMB":1}"#,
        ] {
            assert_eq!(
                req(bad).unwrap_err().status,
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
            (plan.force, plan.forced_from, plan.cacheable()),
            (false, None, 3)
        );
        let forced = Bytes::from(
            r#"{"fromTemplate":"base","force":false,"steps":[
                {"type":"RUN","args":["a"]},{"type":"RUN","args":["b"],"force":true},
                {"type":"RUN","args":["c"],"force":true}]}"#,
        );
        let (plan, _, _) = parse_start(&forced).unwrap();
        assert_eq!((plan.forced_from, plan.cacheable()), (Some(1), 1));
        let all = Bytes::from(
            r#"{"fromTemplate":"base","force":true,"steps":[{"type":"RUN","args":["a"]}]}"#,
        );
        assert_eq!(parse_start(&all).unwrap().0.cacheable(), 0);
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

//! Template routes (sandfork's; E2B's build routes are in
//! [`super::templates_e2b`], and share the status route):
//! `POST /templates` (202, the build runs on), `GET /templates`,
//! `GET /templates/{id}`, `GET /templates/{id}/builds/{buildID}/status`,
//! `DELETE /templates/{id}`. JSON in E2B's camelCase.

use std::path::PathBuf;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;

use super::extract::JsonBody;
use super::{ApiError, Shared};
use crate::node::clock::rfc3339;
use crate::node::sandbox::SandboxError;
use crate::node::store::BuildStatus;
use crate::node::template::build::{MAX_MEM_MIB, MAX_VCPUS, MIN_MEM_MIB, TemplateInfo};
use crate::node::template::{BuildParams, BuildSource, code_interpreter};
use crate::node::tenants::{Caller, template_owner_key};
use crate::wire;

/// A template as `GET /templates` lists it (E2B's Template fields, plus
/// `kind` and `source`).
impl std::convert::From<&TemplateInfo> for wire::Template {
    fn from(t: &TemplateInfo) -> wire::Template {
        let created_at = rfc3339(t.created_at_ms);
        wire::Template {
            template_id: t.id.clone(),
            build_id: t.build_id.clone().unwrap_or_else(|| t.id.clone()),
            names: t.names.clone(),
            aliases: t.names.clone(),
            kind: t.kind.to_owned(),
            source: t.source.clone(),
            cpu_count: t.vcpus,
            memory_mb: t.mem_mib,
            disk_size_mb: t.disk_size_mb,
            updated_at: created_at.clone(),
            created_at,
            created_by: None,
            last_spawned_at: None,
            spawn_count: 0,
            build_count: u64::from(t.build_id.is_some()),
            build_status: t.status.as_str().to_owned(),
            public: false,
            is_default: t.kind == "base",
            envd_version: envd_proto::ENVD_VERSION.to_owned(),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewTemplate {
    name: Option<String>,
    from: Option<From>,
    #[serde(alias = "startCmd")]
    start_cmd: Option<String>,
    #[serde(alias = "readyCmd")]
    ready_cmd: Option<String>,
    #[serde(alias = "cpuCount")]
    vcpus: Option<i64>,
    #[serde(alias = "memoryMB")]
    memory_mb: Option<i64>,
}

/// Exactly one of these.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct From {
    #[serde(alias = "debianPackages")]
    debian_packages: Option<Vec<String>>,
    #[serde(alias = "ociLayout")]
    oci_layout: Option<PathBuf>,
    #[serde(alias = "dockerArchive")]
    docker_archive: Option<PathBuf>,
    sandbox: Option<String>,
    /// A template sandfork ships: `code-interpreter`.
    builtin: Option<String>,
}

const FROM_ONE: &str =
    "from must hold exactly one of debian_packages, oci_layout, docker_archive, sandbox, builtin";

fn parse_new(body: &Bytes) -> Result<BuildParams, ApiError> {
    let req: NewTemplate = JsonBody::parse(body)?;
    let name = req
        .name
        .ok_or_else(|| ApiError::bad_request("name is required"))?;
    let from = req.from.ok_or_else(|| ApiError::bad_request(FROM_ONE))?;
    let mut sources = Vec::new();
    if let Some(p) = from.debian_packages {
        sources.push(BuildSource::DebianPackages(p));
    }
    if let Some(p) = from.oci_layout {
        sources.push(BuildSource::OciLayout(p));
    }
    if let Some(p) = from.docker_archive {
        sources.push(BuildSource::DockerArchive(p));
    }
    if let Some(id) = from.sandbox {
        sources.push(BuildSource::Sandbox(id));
    }
    if let Some(b) = from.builtin {
        if b != code_interpreter::NAME {
            return Err(ApiError::bad_request(format!(
                "builtin {b:?}: the builtin templates are {}",
                code_interpreter::NAME
            )));
        }
        sources.push(BuildSource::CodeInterpreter);
    }
    let [source] =
        <[BuildSource; 1]>::try_from(sources).map_err(|_| ApiError::bad_request(FROM_ONE))?;
    let (vcpus, mem_mib) = machine_size((req.vcpus, "vcpus"), (req.memory_mb, "memory_mb"))?;
    Ok(BuildParams {
        name,
        source,
        start_cmd: req.start_cmd,
        ready_cmd: req.ready_cmd,
        vcpus,
        mem_mib,
        e2b: None,
        ids: None,
    })
}

/// A build's machine as a request asks for it: vCPUs 1 to `MAX_VCPUS`,
/// memory `MIN_MEM_MIB` to `MAX_MEM_MIB`; each with its field's name as the
/// request spells it, for the refusal.
pub(super) fn machine_size(
    (vcpus, vcpus_field): (Option<i64>, &str),
    (memory_mb, memory_field): (Option<i64>, &str),
) -> Result<(Option<u8>, Option<u64>), ApiError> {
    let vcpus = vcpus
        .map(|v| {
            u8::try_from(v)
                .ok()
                .filter(|v| (1..=MAX_VCPUS).contains(v))
                .ok_or_else(|| {
                    ApiError::bad_request(format!("{vcpus_field} must be 1 to {MAX_VCPUS}"))
                })
        })
        .transpose()?;
    let mem_mib = memory_mb
        .map(|v| {
            u64::try_from(v)
                .ok()
                .filter(|v| (MIN_MEM_MIB..=MAX_MEM_MIB).contains(v))
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "{memory_field} must be {MIN_MEM_MIB} to {MAX_MEM_MIB}"
                    ))
                })
        })
        .transpose()?;
    Ok((vcpus, mem_mib))
}

/// `POST /templates`: 202 `{templateID, buildID, names, status: "building"}`;
/// 400 bad input, 404 unknown sandbox, 409 name taken or sandbox paused, 503
/// when the node cannot build.
pub async fn create(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let mut params = parse_new(&body)?;
    if let BuildSource::Sandbox(id) = &params.source {
        super::tenancy::check_sandbox(&state, &caller, id)?;
    }
    // Owned by the caller's team before the build is seen.
    let template_id = crate::node::ids::sandbox_id()
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    params.ids = Some((template_id.clone(), crate::node::template::build::uuid()?));
    super::tenancy::own_template(&state, &caller, &template_id)?;
    let build = match state.templates.start(params) {
        Ok(build) => build,
        Err(e) => {
            super::tenancy::disown_template(&state, &template_id);
            return Err(e.into());
        }
    };
    let body = wire::TemplateBuildStarted {
        build: wire::BuildNames {
            template_id: build.template_id,
            build_id: build.build_id,
            names: vec![build.name],
        },
        status: build.status.as_str().to_owned(),
    };
    Ok((StatusCode::ACCEPTED, Json(body)).into_response())
}

/// `GET /templates`: base first, then the others oldest first.
pub async fn list(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
) -> Result<Response, ApiError> {
    let all = state.templates.list()?;
    let body: Vec<wire::Template> = all
        .iter()
        .filter(|t| super::tenancy::sees_template(&state, &caller, &t.id))
        .map(wire::Template::from)
        .collect();
    Ok(Json(body).into_response())
}

/// `GET /default-templates`: the templates the node itself provides, to
/// every key: its base and, once built by the node, the code interpreter.
pub async fn defaults(State(state): State<Shared>) -> Result<Json<Vec<wire::Template>>, ApiError> {
    let base = &state.manager.template().id;
    let store = state.manager.store();
    let node_owned = |id: &str| {
        store
            .owner(&template_owner_key(id))
            .is_ok_and(|owner| owner.is_none())
    };
    let body = state
        .templates
        .list()?
        .iter()
        .filter(|t| {
            &t.id == base
                || (t.names.iter().any(|n| code_interpreter::is_name(n)) && node_owned(&t.id))
        })
        .map(|t| wire::Template {
            is_default: true,
            ..wire::Template::from(t)
        })
        .collect();
    Ok(Json(body))
}

/// The template `id` names (its id, else its newest holder of that name).
fn find(state: &Shared, id: &str) -> Result<TemplateInfo, ApiError> {
    let all = state.templates.list()?;
    let found = all
        .iter()
        .find(|t| t.id == id)
        .or_else(|| all.iter().rev().find(|t| t.names.iter().any(|n| n == id)))
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("template {id} not found")))?;
    Ok(found.clone())
}

/// `GET /templates/{id}` (id or name).
pub async fn get_one(
    State(state): State<Shared>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(wire::Template::from(&find(&state, &id)?)).into_response())
}

/// E2B's `TemplateUpdateRequest`.
#[derive(Debug, Default, Deserialize)]
pub(super) struct TemplateUpdate {
    public: Option<bool>,
}

/// `PATCH /v2/templates/{id}` (id or name; `e2b template publish` and
/// `unpublish`): 200 `{names}`. Every template of this node is private to
/// its API keys, so `{"public": false}` (or no change) is answered and
/// `{"public": true}` refused with 400: this node publishes nothing to
/// other teams. 404 unknown.
pub async fn update_v2(
    State(state): State<Shared>,
    Path(id): Path<String>,
    JsonBody(update): JsonBody<TemplateUpdate>,
) -> Result<Response, ApiError> {
    let template = find(&state, &id)?;
    if update.public == Some(true) {
        return Err(ApiError::bad_request(format!(
            "template {id}: this node does not publish templates (public: true); its \
             templates are for its own API keys"
        )));
    }
    Ok(Json(wire::TemplateNames {
        names: template.names,
    })
    .into_response())
}

fn logs_offset(query: Option<&str>) -> Result<usize, ApiError> {
    for (key, value) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        if key == "logsOffset" && !value.is_empty() {
            return value
                .parse()
                .map_err(|_| ApiError::bad_request("logsOffset must be a whole number"));
        }
    }
    Ok(0)
}

/// `GET /templates/{id}/builds/{buildID}/status` (`logsOffset`: skip that
/// many log lines): `{templateID, buildID, status, logs, logEntries,
/// reason}` where `reason` is `{"message", "step"?}` for a failed build
/// (`step`: E2B's failing step, `base`, `1`... or `finalize`), else absent.
/// Past the last line the page is empty (the E2B SDK polls until it is).
pub async fn build_status(
    State(state): State<Shared>,
    Path((id, build_id)): Path<(String, String)>,
    uri: Uri,
) -> Result<Response, ApiError> {
    let offset = logs_offset(uri.query())?;
    let (build, logs) = match state.templates.e2b_build(&id, &build_id)? {
        Some(b) => state.templates.status_of(b, offset),
        None => state.templates.status(&id, offset)?,
    };
    if build.build_id != build_id {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("template {id} has no build {build_id}"),
        ));
    }
    let reason = match (&build.status, &build.reason) {
        (BuildStatus::Error, Some(r)) => Some(wire::BuildReason {
            message: r.clone(),
            step: build.reason_step.clone(),
        }),
        _ => None,
    };
    let at = rfc3339(build.finished_at_ms.unwrap_or(build.started_at_ms));
    let log_entries = logs.iter().map(|l| log_entry(l, &at)).collect();
    let body = wire::TemplateBuild {
        build: wire::BuildNames {
            template_id: crate::node::template::e2b_build::e2b_template_id(&build).to_owned(),
            build_id: build.build_id.clone(),
            names: vec![build.name.clone()],
        },
        status: build.status.as_str().to_owned(),
        logs,
        log_entries,
        started_at: rfc3339(build.started_at_ms),
        finished_at: build.finished_at_ms.map(rfc3339),
        reason,
    };
    Ok(Json(body).into_response())
}

/// A log line as E2B's `BuildLogEntry` (the lines carry no time of their
/// own: `at` is the build's).
fn log_entry(line: &str, at: &str) -> wire::BuildLogEntry {
    let level = if line.starts_with("error: ") {
        "error"
    } else {
        "info"
    };
    wire::BuildLogEntry {
        timestamp: at.to_owned(),
        level: level.to_owned(),
        message: line.to_owned(),
    }
}

/// `DELETE /templates/{id}` (id or name; a snapshot's `:default` tag
/// allowed): 204; 404 unknown; 409 while it builds or sandboxes or snapshots
/// use it; 400 for the base template.
pub async fn delete(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    match state.templates.delete(&id).await {
        Ok(()) => Ok(StatusCode::NO_CONTENT),
        // Stored by a node of the cluster, none of whose copies is here.
        Err(SandboxError::TemplateNotFound(missing)) => match &state.cluster {
            Some(cluster) if cluster.delete_stored_template(&caller, &id).await? => {
                Ok(StatusCode::NO_CONTENT)
            }
            _ => Err(SandboxError::TemplateNotFound(missing).into()),
        },
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<BuildParams, ApiError> {
        parse_new(&Bytes::from(s.to_owned()))
    }

    #[test]
    fn requests_are_parsed_and_checked() {
        let p = parse(
            r#"{"name":"t","from":{"debian_packages":["jq"]},"startCmd":"x","memory_mb":512}"#,
        )
        .unwrap();
        assert_eq!(p.source, BuildSource::DebianPackages(vec!["jq".into()]));
        assert_eq!((p.start_cmd.as_deref(), p.mem_mib), (Some("x"), Some(512)));
        let p = parse(r#"{"name":"t","from":{"sandbox":"abc"}}"#).unwrap();
        assert_eq!(p.source, BuildSource::Sandbox("abc".into()));
        for bad in [
            "",
            "[]",
            r#"{"from":{"sandbox":"a"}}"#,
            r#"{"name":"t"}"#,
            r#"{"name":"t","from":{}}"#,
            r#"{"name":"t","from":{"sandbox":"a","oci_layout":"/x"}}"#,
            r#"{"name":"t","from":{"image":"x"}}"#,
            r#"{"name":"t","from":{"sandbox":"a"},"vcpus":0}"#,
            r#"{"name":"t","from":{"sandbox":"a"},"vcpus":300}"#,
            r#"{"name":"t","from":{"sandbox":"a"},"memory_mb":64}"#,
            r#"{"name":"t","from":{"sandbox":"a"},"cmd":"x"}"#,
        ] {
            assert_eq!(
                parse(bad).unwrap_err().status,
                StatusCode::BAD_REQUEST,
                "{bad}"
            );
        }
    }

    #[test]
    fn logs_offset_is_parsed() {
        assert_eq!(logs_offset(None).unwrap(), 0);
        assert_eq!(logs_offset(Some("logsOffset=7")).unwrap(), 7);
        assert!(logs_offset(Some("logsOffset=-1")).is_err());
    }
}

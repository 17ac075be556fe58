//! E2B's template tags: assigning and removing them, and the reads the
//! 2.63 client has (`tags`, `tags/count`, `tags/exists`, `tags/groups`,
//! `tags/{tag}/assignments`). The node keeps each tag's current build only,
//! so a tag has one assignment and no history.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::extract::{JsonBody, number, query};
use super::templates_e2b::split_name;
use super::{ApiError, Shared};
use crate::node::clock::rfc3339;
use crate::node::template::e2b_build::{self, TagAssignment};
use crate::wire;

#[derive(Debug, Default, Deserialize)]
pub(super) struct AssignTags {
    target: String,
    tags: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct RemoveTags {
    name: String,
    tags: Vec<String>,
}

fn check_tags(tags: &[String]) -> Result<Vec<String>, ApiError> {
    if tags.is_empty() {
        return Err(ApiError::bad_request("tags must name at least one tag"));
    }
    tags.iter()
        .map(|t| {
            let t = t.to_lowercase();
            e2b_build::check_tag(&t).map_err(ApiError::bad_request)?;
            Ok(t)
        })
        .collect()
}

/// The template a tag route names: `name`, `name:tag`, a namespace dropped.
fn tag_target(raw: &str) -> String {
    match split_name(raw) {
        (name, Some(tag)) => format!("{name}:{tag}"),
        (name, None) => name,
    }
}

/// `POST /templates/tags` `{target: "name:tag", tags}`: 201 `{tags,
/// buildID}`, the target's build now also has `tags` (moved from the builds
/// that had them).
pub async fn assign_tags(
    State(state): State<Shared>,
    JsonBody(req): JsonBody<AssignTags>,
) -> Result<Response, ApiError> {
    let tags = check_tags(&req.tags)?;
    let build_id = state
        .templates
        .assign_tags(&tag_target(&req.target), &tags)
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(wire::AssignedTemplateTags { tags, build_id }),
    )
        .into_response())
}

/// `DELETE /templates/tags` `{name, tags}`: 204; the builds stay.
pub async fn remove_tags(
    State(state): State<Shared>,
    JsonBody(req): JsonBody<RemoveTags>,
) -> Result<StatusCode, ApiError> {
    let tags = check_tags(&req.tags)?;
    let (name, _) = split_name(&req.name);
    state.templates.remove_tags(&name, &tags).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The tags of the template a route names (by id or alias; 404 unknown).
fn tags_of(state: &Shared, id: &str) -> Result<Vec<TagAssignment>, ApiError> {
    Ok(state.templates.tags_of(&split_name(id).0)?)
}

fn assignment(a: &TagAssignment) -> wire::TemplateTagAssignment {
    wire::TemplateTagAssignment {
        assignment_id: a.assignment_id.clone(),
        build_id: a.build_id.clone(),
        assigned_at: rfc3339(a.ready_at_ms),
        build_created_at: rfc3339(a.build_started_at_ms),
        build_finished_at: a.build_finished_at_ms.map(rfc3339),
    }
}

/// A tag as a query or path gives it: lowercased and checked (400).
fn normalized(tag: &str) -> Result<String, ApiError> {
    let tag = tag.to_lowercase();
    e2b_build::check_tag(&tag).map_err(ApiError::bad_request)?;
    Ok(tag)
}

/// `GET /templates/{id}/tags`: 200 `[{tag, buildID, createdAt}]`.
pub async fn tags(
    State(state): State<Shared>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let body: Vec<wire::TemplateTag> = tags_of(&state, &id)?
        .into_iter()
        .map(|a| wire::TemplateTag {
            created_at: rfc3339(a.ready_at_ms),
            tag: a.tag,
            build_id: a.build_id,
        })
        .collect();
    Ok(Json(body).into_response())
}

/// `GET /templates/{id}/tags/count`: 200 `{total}`.
pub async fn count(
    State(state): State<Shared>,
    Path(id): Path<String>,
) -> Result<Json<wire::TemplateTagsCount>, ApiError> {
    let total = tags_of(&state, &id)?.len();
    Ok(Json(wire::TemplateTagsCount { total }))
}

/// `GET /templates/{id}/tags/exists?tag=`: 200 `{exists, normalizedTag}`;
/// 400 without a tag or with one E2B would refuse.
pub async fn exists(
    State(state): State<Shared>,
    Path(id): Path<String>,
    uri: Uri,
) -> Result<Json<wire::TemplateTagExists>, ApiError> {
    let raw = query(&uri)
        .into_iter()
        .find(|(k, _)| k == "tag")
        .map(|(_, v)| v)
        .ok_or_else(|| ApiError::bad_request("tag is required"))?;
    let tag = normalized(&raw)?;
    let exists = tags_of(&state, &id)?.iter().any(|a| a.tag == tag);
    Ok(Json(wire::TemplateTagExists {
        exists,
        normalized_tag: tag,
    }))
}

/// How `tags/groups` orders its tags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GroupOrder {
    LatestDesc,
    LatestAsc,
    NameAsc,
    NameDesc,
}

impl GroupOrder {
    fn parse(raw: &str) -> Result<GroupOrder, ApiError> {
        match raw {
            "latest_desc" => Ok(GroupOrder::LatestDesc),
            "latest_asc" => Ok(GroupOrder::LatestAsc),
            "name_asc" => Ok(GroupOrder::NameAsc),
            "name_desc" => Ok(GroupOrder::NameDesc),
            _ => Err(ApiError::bad_request(format!(
                "sort must be latest_desc, latest_asc, name_asc or name_desc, not {raw:?}"
            ))),
        }
    }

    fn sort(self, tags: &mut [TagAssignment]) {
        // Ties (tags of one build) by name, so pages do not shift.
        let by_time = |a: &TagAssignment, b: &TagAssignment| {
            a.ready_at_ms
                .cmp(&b.ready_at_ms)
                .then_with(|| a.tag.cmp(&b.tag))
        };
        match self {
            GroupOrder::LatestDesc => tags.sort_by(|a, b| by_time(b, a)),
            GroupOrder::LatestAsc => tags.sort_by(by_time),
            GroupOrder::NameAsc => tags.sort_by(|a, b| a.tag.cmp(&b.tag)),
            GroupOrder::NameDesc => tags.sort_by(|a, b| b.tag.cmp(&a.tag)),
        }
    }
}

/// The most a page of tags or assignments may hold.
const MAX_PAGE: u64 = 100;

/// A page size from a query: 1 to [`MAX_PAGE`].
fn page_size(key: &str, value: &str) -> Result<usize, ApiError> {
    match number(key, value)? {
        n @ 1..=MAX_PAGE => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
        _ => Err(ApiError::bad_request(format!(
            "{key} must be 1 to {MAX_PAGE}"
        ))),
    }
}

/// A page: the items from the cursor (an offset, as this node pages) and
/// the cursor of the next page.
fn page<T>(items: Vec<T>, cursor: usize, limit: usize) -> (Vec<T>, Option<String>) {
    let next = (items.len() > cursor.saturating_add(limit))
        .then(|| cursor.saturating_add(limit).to_string());
    (items.into_iter().skip(cursor).take(limit).collect(), next)
}

fn cursor(key: &str, value: &str) -> Result<usize, ApiError> {
    Ok(usize::try_from(number(key, value)?).unwrap_or(usize::MAX))
}

/// `GET /templates/{id}/tags/groups` (`tagsLimit` 25, `tagsCursor`,
/// `assignmentLimit` 6, `search`, `sort` latest_desc): 200 `{tags:
/// [{tag, assignments, hasMore}], nextCursor}`.
pub async fn groups(
    State(state): State<Shared>,
    Path(id): Path<String>,
    uri: Uri,
) -> Result<Json<wire::TemplateTagGroups>, ApiError> {
    let (mut limit, mut from, mut order, mut search) = (25, 0, GroupOrder::LatestDesc, None);
    for (k, v) in query(&uri) {
        match k.as_str() {
            "tagsLimit" => limit = page_size("tagsLimit", &v)?,
            "tagsCursor" => from = cursor("tagsCursor", &v)?,
            // Each tag has one assignment here: any limit of 1 or more holds it.
            "assignmentLimit" => drop(page_size("assignmentLimit", &v)?),
            "search" => search = Some(v.to_lowercase()),
            "sort" => order = GroupOrder::parse(&v)?,
            _ => {}
        }
    }
    let mut tags = tags_of(&state, &id)?;
    if let Some(search) = &search {
        tags.retain(|a| a.tag.contains(search.as_str()));
    }
    order.sort(&mut tags);
    let (tags, next_cursor) = page(tags, from, limit);
    Ok(Json(wire::TemplateTagGroups {
        tags: tags
            .iter()
            .map(|a| wire::TemplateTagGroup {
                tag: a.tag.clone(),
                assignments: vec![assignment(a)],
                has_more: false,
            })
            .collect(),
        next_cursor,
    }))
}

/// `GET /templates/{id}/tags/{tag}/assignments` (`limit` 50, `cursor`): 200
/// `{data, nextCursor}`, latest first; an unassigned tag has none.
pub async fn assignments(
    State(state): State<Shared>,
    Path((id, tag)): Path<(String, String)>,
    uri: Uri,
) -> Result<Json<wire::TemplateTagAssignments>, ApiError> {
    let tag = normalized(&tag)?;
    let (mut limit, mut from) = (50, 0);
    for (k, v) in query(&uri) {
        match k.as_str() {
            "limit" => limit = page_size("limit", &v)?,
            "cursor" => from = cursor("cursor", &v)?,
            _ => {}
        }
    }
    let all: Vec<wire::TemplateTagAssignment> = tags_of(&state, &id)?
        .iter()
        .filter(|a| a.tag == tag)
        .map(assignment)
        .collect();
    let (data, next_cursor) = page(all, from, limit);
    Ok(Json(wire::TemplateTagAssignments { data, next_cursor }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_routes_name_targets() {
        assert_eq!(tag_target("NS/My-T:V1"), "my-t:v1");
        assert_eq!(tag_target("t"), "t");
        assert!(check_tags(&[]).is_err());
        assert_eq!(check_tags(&["Prod".into()]).unwrap(), vec!["prod"]);
        assert!(check_tags(&["a/b".into()]).is_err());
    }

    #[test]
    fn pages_go_by_offset_and_end_with_no_cursor() {
        assert_eq!(page(vec![1, 2, 3], 0, 2), (vec![1, 2], Some("2".into())));
        assert_eq!(page(vec![1, 2, 3], 2, 2), (vec![3], None));
        assert_eq!(page(vec![1, 2], 0, 2), (vec![1, 2], None));
        assert_eq!(page(vec![1], 5, 2), (vec![], None));
    }
}

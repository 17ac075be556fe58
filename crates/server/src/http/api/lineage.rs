//! `GET /v1/sandboxes/{id}/lineage` (a sandfork extension, drawn by the
//! web console): the fork tree a sandbox is in, from the root the node's
//! recent lifecycle events name down through every child, each with its
//! branch index and whether it runs, is paused or is gone.
//!
//! Two sources, merged: each fork child's record names its parent and
//! branch for as long as it lives ([`ForkedFrom`], across restarts), and
//! every child a fork makes is told as a `forked` event naming its parent,
//! of which the node keeps its last [`crate::node::webhooks::RECENT`]: those
//! reach the children already gone (and so their own children's parents).
//! A sandbox that is neither live, nor in the caller's team's events, nor
//! the parent of one of its live sandboxes is a 404.

use std::collections::{HashMap, HashSet};

use axum::extract::State;
use axum::{Extension, Json};

use super::extract::SandboxId;
use super::{ApiError, Shared};
use crate::node::events::{Lifecycle, LifecycleKind};
use crate::node::sandbox::SandboxError;
use crate::node::store::{ForkedFrom, SandboxRecord};
use crate::node::tenants::Caller;
use crate::wire;

pub async fn lineage(
    State(state): State<Shared>,
    Extension(caller): Extension<Caller>,
    SandboxId(id): SandboxId,
) -> Result<Json<wire::Lineage>, ApiError> {
    let events = state.webhooks.recent(&caller.team, None);
    let manager = &state.manager;
    let records: Vec<SandboxRecord> = manager
        .list()?
        .into_iter()
        .filter(|r| caller.owns(r.team.as_deref()))
        .collect();
    let found = build(&id, &records, &events, |sandbox| {
        match manager.get(sandbox) {
            Ok(r) if caller.owns(r.team.as_deref()) => Some(r.state.as_str()),
            _ => None,
        }
    });
    let Some(mut tree) = found else {
        return Err(SandboxError::NotFound(id).into());
    };
    // A parent no event made and no record holds may be a snapshot forked.
    for node in &mut tree.nodes {
        if node.state == GONE
            && node.template_id.is_empty()
            && matches!(manager.store().template(&node.sandbox_id), Ok(Some(_)))
        {
            node.state = "snapshot".to_owned();
        }
    }
    Ok(Json(tree))
}

const GONE: &str = "gone";

/// The tree of `of` from the caller's `records` and `events` (oldest
/// first), `live` naming the state of a sandbox the node holds for the
/// caller; None when none of them knows `of`.
fn build(
    of: &str,
    records: &[SandboxRecord],
    events: &[Lifecycle],
    live: impl Fn(&str) -> Option<&'static str>,
) -> Option<wire::Lineage> {
    let mut parent_of: HashMap<&str, &str> = HashMap::new();
    // A child's branch as its record keeps it; else its place among the
    // events' children of its parent.
    let mut branch_of: HashMap<&str, u32> = HashMap::new();
    let mut template: HashMap<&str, &str> = HashMap::new();
    for r in records {
        template.insert(&r.id, &r.template_id);
        if let Some(ForkedFrom { parent_id, branch }) = &r.forked_from {
            parent_of.insert(&r.id, parent_id);
            branch_of.insert(&r.id, *branch);
        }
    }
    let mut told: HashMap<&str, Vec<&str>> = HashMap::new();
    for e in events {
        template.entry(&e.sandbox_id).or_insert(&e.template_id);
        if e.kind != LifecycleKind::Forked {
            continue;
        }
        let Some(parent) = e.parent_id.as_deref() else {
            continue;
        };
        let siblings = told.entry(parent).or_default();
        if !siblings.contains(&e.sandbox_id.as_str()) {
            siblings.push(&e.sandbox_id);
        }
        parent_of.entry(&e.sandbox_id).or_insert(parent);
    }
    for siblings in told.values() {
        for (n, child) in siblings.iter().enumerate() {
            branch_of
                .entry(child)
                .or_insert(u32::try_from(n).unwrap_or(u32::MAX));
        }
    }
    let mut children: HashMap<&str, Vec<&str>> = HashMap::new();
    for (child, parent) in &parent_of {
        children.entry(parent).or_default().push(child);
    }
    for siblings in children.values_mut() {
        siblings.sort_by_key(|c| (branch_of.get(c).copied().unwrap_or(u32::MAX), *c));
    }
    if live(of).is_none() && !template.contains_key(of) && !children.contains_key(of) {
        return None;
    }
    // Up to the root (a set against a cycle no honest events make).
    let mut root = of;
    let mut seen = HashSet::from([of]);
    while let Some(parent) = parent_of.get(root) {
        if !seen.insert(parent) {
            break;
        }
        root = parent;
    }
    // Down, a generation at a time.
    let mut nodes = Vec::new();
    let mut level = vec![root];
    let mut drawn = HashSet::new();
    while !level.is_empty() {
        let mut next = Vec::new();
        for id in level {
            if !drawn.insert(id) {
                continue;
            }
            // The root's parent, if a cycle gave it one, is not drawn.
            let below_root = id != root;
            nodes.push(wire::LineageNode {
                sandbox_id: id.to_owned(),
                parent_id: parent_of
                    .get(id)
                    .filter(|_| below_root)
                    .map(|p| (*p).to_owned()),
                branch: branch_of.get(id).copied().filter(|_| below_root),
                state: live(id).unwrap_or(GONE).to_owned(),
                template_id: template
                    .get(id)
                    .map(|t| (*t).to_owned())
                    .unwrap_or_default(),
            });
            next.extend(children.get(id).into_iter().flatten());
        }
        level = next;
    }
    Some(wire::Lineage {
        root_id: root.to_owned(),
        sandbox_id: of.to_owned(),
        nodes,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn event(kind: LifecycleKind, id: &str, parent: Option<&str>) -> Lifecycle {
        Lifecycle {
            id: format!("{id}-{}", kind.as_str()),
            kind,
            sandbox_id: id.to_owned(),
            team: "t".to_owned(),
            template_id: "base".to_owned(),
            metadata: BTreeMap::new(),
            parent_id: parent.map(str::to_owned),
            run: 0,
            started_at_ms: 0,
            cpu_count: 1,
            memory_mb: 128,
            at_ms: 0,
        }
    }

    /// A drawn node: its id, parent, branch and state.
    type Row = (String, Option<String>, Option<u32>, String);

    fn tree(of: &str, events: &[Lifecycle]) -> Option<Vec<Row>> {
        tree_with(of, &[], events)
    }

    fn tree_with(of: &str, records: &[SandboxRecord], events: &[Lifecycle]) -> Option<Vec<Row>> {
        let live = |id: &str| match id {
            "p" | "a" => Some("running"),
            "b" => Some("paused"),
            _ => None,
        };
        build(of, records, events, live).map(|t| {
            t.nodes
                .into_iter()
                .map(|n| (n.sandbox_id, n.parent_id, n.branch, n.state))
                .collect()
        })
    }

    fn node(id: &str, parent: Option<&str>, branch: Option<u32>, state: &str) -> Row {
        (
            id.to_owned(),
            parent.map(str::to_owned),
            branch,
            state.to_owned(),
        )
    }

    #[test]
    fn a_child_finds_its_root_and_its_siblings_in_fork_order() {
        use LifecycleKind::*;
        let events = [
            event(Created, "p", None),
            event(Forked, "a", Some("p")),
            event(Forked, "b", Some("p")),
            event(Forked, "c", Some("p")),
            event(Killed, "c", None),
            event(Forked, "d", Some("a")),
        ];
        let want = vec![
            node("p", None, None, "running"),
            node("a", Some("p"), Some(0), "running"),
            node("b", Some("p"), Some(1), "paused"),
            node("c", Some("p"), Some(2), "gone"),
            node("d", Some("a"), Some(0), "gone"),
        ];
        assert_eq!(tree("d", &events), Some(want.clone()));
        assert_eq!(tree("p", &events), Some(want));
    }

    #[test]
    fn a_sandbox_known_to_neither_is_none_and_a_lone_one_its_own_root() {
        use LifecycleKind::*;
        assert_eq!(tree("zz", &[event(Created, "p", None)]), None);
        assert_eq!(tree("p", &[]), Some(vec![node("p", None, None, "running")]));
        // A gone sandbox the events still name is answered.
        assert_eq!(
            tree("x", &[event(Created, "x", None), event(Killed, "x", None)]),
            Some(vec![node("x", None, None, "gone")])
        );
    }

    /// A live child of the tree, as its record keeps it.
    fn child(id: &str, parent: &str, branch: u32) -> SandboxRecord {
        SandboxRecord {
            forked_from: Some(ForkedFrom {
                parent_id: parent.to_owned(),
                branch,
            }),
            ..crate::node::store::tests::record(id, 0)
        }
    }

    #[test]
    fn records_keep_the_tree_when_the_events_are_gone() {
        // After a restart: no events; the parent p lives, so do its
        // children a (branch 3) and b (branch 1) of one fork.
        let records = [child("a", "p", 3), child("b", "p", 1)];
        assert_eq!(
            tree_with("a", &records, &[]),
            Some(vec![
                node("p", None, None, "running"),
                node("b", Some("p"), Some(1), "paused"),
                node("a", Some("p"), Some(3), "running"),
            ])
        );
        // A gone parent (or snapshot) is drawn, and asked about, as gone.
        let orphans = [child("a", "q", 0)];
        let want = vec![
            node("q", None, None, "gone"),
            node("a", Some("q"), Some(0), "running"),
        ];
        assert_eq!(tree_with("a", &orphans, &[]), Some(want.clone()));
        assert_eq!(tree_with("q", &orphans, &[]), Some(want));
    }

    #[test]
    fn records_and_events_merge_the_records_branch_first() {
        use LifecycleKind::*;
        // Events saw the whole fork of 3 (c then killed); the records of
        // the live ones agree on their branches.
        let events = [
            event(Forked, "a", Some("p")),
            event(Forked, "b", Some("p")),
            event(Forked, "c", Some("p")),
            event(Killed, "c", None),
        ];
        let records = [child("a", "p", 0), child("b", "p", 1)];
        assert_eq!(
            tree_with("p", &records, &events),
            Some(vec![
                node("p", None, None, "running"),
                node("a", Some("p"), Some(0), "running"),
                node("b", Some("p"), Some(1), "paused"),
                node("c", Some("p"), Some(2), "gone"),
            ])
        );
    }

    #[test]
    fn a_cycle_in_the_events_ends() {
        use LifecycleKind::*;
        let events = [event(Forked, "a", Some("b")), event(Forked, "b", Some("a"))];
        let nodes = tree("a", &events).unwrap_or_default();
        assert_eq!(nodes.len(), 2);
    }
}

//! The keys under `/sandfork/v1/` and their JSON records.
//!
//! | key | value | lifetime |
//! |---|---|---|
//! | `nodes/{node_id}` | [`NodeRecord`] | the node's lease |
//! | `sandboxes/{id}` | [`SandboxRoute`] | create to kill (not lease-bound: a paused sandbox outlives its node) |
//! | `teams/{team}/quota` | [`TeamQuota`] | set by the team's admin |
//! | `teams/{team}/running/{slot}` | the sandbox ID | while the sandbox runs, under its node's lease |
//! | `tenants/teams/{team}` | the node's team record (its JSON) | created and changed by an admin |
//! | `tenants/names/{name}` | the team ID | with the team: keeps names unique |
//! | `tenants/keys/{sha256}` | the node's API key record (its JSON) | created to revoked |
//! | `killed/{id}` | the ID of the node that held it | a kill through a gateway while its node was gone, until that node is back and removes its copy; at most a day (a lease) |
//! | `store-gc/pass` | the ID of the node collecting the object store | one pass of [`crate::store_gc`], under a lease of its own |
//! | `store-gc/last` | who started the last pass, and when | rewritten at each pass's start (its revision is the uploads' epoch) |
//! | `images/{sha256 of the image}` | [`ImageClaim`]: the node converting a registry image (its normalised reference) into a template | from the conversion's start until its template is in the object store (or the conversion failed), under that node's lease |

use serde::{Deserialize, Serialize};

pub const PREFIX: &str = "/sandfork/v1/";
pub const NODES: &str = "/sandfork/v1/nodes/";
pub const SANDBOXES: &str = "/sandfork/v1/sandboxes/";
pub const TEAMS: &str = "/sandfork/v1/teams/";
pub const TENANTS: &str = "/sandfork/v1/tenants/";
pub const TENANT_TEAMS: &str = "/sandfork/v1/tenants/teams/";
pub const TENANT_NAMES: &str = "/sandfork/v1/tenants/names/";
pub const TENANT_KEYS: &str = "/sandfork/v1/tenants/keys/";
pub const KILLED: &str = "/sandfork/v1/killed/";
pub const STORE_GC: &str = "/sandfork/v1/store-gc/";
pub const STORE_GC_PASS: &str = "/sandfork/v1/store-gc/pass";
pub const STORE_GC_LAST: &str = "/sandfork/v1/store-gc/last";
pub const IMAGES: &str = "/sandfork/v1/images/";

pub fn node_key(node_id: &str) -> String {
    format!("{NODES}{node_id}")
}

pub fn sandbox_key(id: &str) -> String {
    format!("{SANDBOXES}{id}")
}

/// The sandbox ID of a `sandboxes/{id}` key (None for any other key).
pub fn sandbox_id(key: &[u8]) -> Option<&str> {
    let id = std::str::from_utf8(key).ok()?.strip_prefix(SANDBOXES)?;
    (!id.is_empty() && !id.contains('/')).then_some(id)
}

pub fn killed_key(id: &str) -> String {
    format!("{KILLED}{id}")
}

pub fn team_quota_key(team: &str) -> String {
    format!("{TEAMS}{team}/quota")
}

/// Where team `team`'s running slots are, each `{prefix}{slot}`.
pub fn team_slots_prefix(team: &str) -> String {
    format!("{TEAMS}{team}/running/")
}

pub fn team_slot_key(team: &str, slot: u64) -> String {
    format!("{}{slot}", team_slots_prefix(team))
}

pub fn team_record_key(team: &str) -> String {
    format!("{TENANT_TEAMS}{team}")
}

pub fn team_name_key(name: &str) -> String {
    format!("{TENANT_NAMES}{name}")
}

/// The record of the API key whose SHA-256 is `hash` (hex).
pub fn api_key_key(hash: &str) -> String {
    format!("{TENANT_KEYS}{hash}")
}

/// Where the conversion of `image` (a normalised reference, which may hold
/// `/`, `:` and `@`) is claimed: its SHA-256, so one key segment whatever
/// the reference.
pub fn image_key(image: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(image.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("{IMAGES}{hex}")
}

/// `images/{sha256}`: a node converting a registry image into a template
/// (one conversion per image in the cluster: other nodes wait for it and
/// take the template in from the object store).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageClaim {
    /// The image's normalised reference (the name of its template).
    pub image: String,
    pub node_id: String,
    /// The node's lease, which the claim is held by.
    pub incarnation: i64,
    pub started_at_ms: u64,
}

/// A node ID (or a team's) names one key segment: letters, digits, `-`,
/// `_`, `.`.
pub fn is_node_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// What a node may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NodeCapacity {
    pub max_sandboxes: u64,
    pub vcpus: u64,
    pub memory_mib: u64,
}

/// What a node holds now (rewritten only when it changes).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NodeLoad {
    pub sandboxes: u64,
    pub vcpus: u64,
    pub memory_mib: u64,
    /// The IDs and names of the templates it has (sorted): a create from
    /// one of them starts there without taking it in from the store.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub templates: Vec<String>,
}

/// `nodes/{node_id}`: a registered node, bound to its lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub node_id: String,
    /// The lease the record is held by: a new one at each registration, so a
    /// node that lost its lease and came back is told apart from before.
    pub incarnation: i64,
    /// `host:port` of the node's API and envd proxy.
    pub api_addr: String,
    pub capacity: NodeCapacity,
    pub load: NodeLoad,
    /// The CPU template the node boots guests under (`serve
    /// --cpu-template`); None: the host's CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_template: Option<String>,
}

impl NodeRecord {
    /// Placement's measure: the share of the node still free, the scarcest
    /// of sandboxes, vCPUs and memory (0 when any is used up).
    pub fn free_share(&self) -> f64 {
        let share = |cap: u64, used: u64| {
            if cap == 0 {
                1.0
            } else {
                cap.saturating_sub(used) as f64 / cap as f64
            }
        };
        [
            share(self.capacity.max_sandboxes, self.load.sandboxes),
            share(self.capacity.vcpus, self.load.vcpus),
            share(self.capacity.memory_mib, self.load.memory_mib),
        ]
        .into_iter()
        .fold(1.0, f64::min)
    }

    /// Whether the node published that it has template `id_or_name`.
    pub fn has_template(&self, id_or_name: &str) -> bool {
        self.load
            .templates
            .binary_search_by(|t| t.as_str().cmp(id_or_name))
            .is_ok()
    }
}

/// `sandboxes/{id}`: which node serves the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRoute {
    pub node_id: String,
    /// The owning node's incarnation when it claimed the sandbox.
    pub incarnation: i64,
    pub created_at_ms: u64,
    /// Set while the sandbox is paused with its snapshot in the object
    /// store: another node can resume it if its own is gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<DurablePause>,
    /// The slot of its team's quota it holds while it runs (a team with a
    /// quota only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<RunningSlot>,
}

/// One of a team's `max_sandboxes` slots, held by one running sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunningSlot {
    pub team: String,
    pub slot: u64,
}

impl RunningSlot {
    pub fn key(&self) -> String {
        team_slot_key(&self.team, self.slot)
    }
}

/// `teams/{team}/quota`: what a team may hold across the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TeamQuota {
    /// Sandboxes running at once (None: no limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sandboxes: Option<u64>,
}

/// A pause whose snapshot is in the object store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DurablePause {
    /// The object holding the pause's description (record and files).
    pub manifest: String,
    pub generation: u32,
    /// The CPU template its guest was booted under (None: the host's CPU):
    /// only nodes with the same one take it in, so gateways try those first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_template: Option<String>,
}

/// Nodes in the order a create tries them: most free first, ties by ID
/// (stable, so equal nodes are not picked at random by each gateway).
pub fn placement_order(nodes: Vec<NodeRecord>) -> Vec<NodeRecord> {
    placement_order_for(nodes, None)
}

/// How much freer (in share of the node) a node lacking a template must be
/// than one that has it to be tried first: taking a template in costs a
/// fetch from the store once per node, so creates stay where it is until
/// those nodes are clearly fuller, and then spread.
pub const TEMPLATE_HELD_BONUS: f64 = 0.25;

/// [`placement_order`] for a create from `template` (an ID or name; None:
/// any): nodes that have it count [`TEMPLATE_HELD_BONUS`] freer.
pub fn placement_order_for(nodes: Vec<NodeRecord>, template: Option<&str>) -> Vec<NodeRecord> {
    placement_order_preferring(nodes, |n| template.is_some_and(|t| n.has_template(t)))
}

/// [`placement_order_for`] a create from a registry image whose template
/// is named `image` (its normalised reference): the nodes that have it, and
/// the node converting it now (`converting`, a node ID; its creates wait on
/// that conversion, and so would another node's), count
/// [`TEMPLATE_HELD_BONUS`] freer.
pub fn placement_order_for_image(
    nodes: Vec<NodeRecord>,
    image: &str,
    converting: Option<&str>,
) -> Vec<NodeRecord> {
    placement_order_preferring(nodes, |n| {
        n.has_template(image) || converting == Some(n.node_id.as_str())
    })
}

/// [`placement_order`] where the nodes `preferred` picks count
/// [`TEMPLATE_HELD_BONUS`] freer (unless full).
fn placement_order_preferring(
    mut nodes: Vec<NodeRecord>,
    preferred: impl Fn(&NodeRecord) -> bool,
) -> Vec<NodeRecord> {
    let score = |n: &NodeRecord| {
        let held = preferred(n);
        // A full node stays last: what it has does not make room.
        let free = n.free_share();
        if held && free > 0.0 {
            free + TEMPLATE_HELD_BONUS
        } else {
            free
        }
    };
    nodes.sort_by(|a, b| {
        score(b)
            .total_cmp(&score(a))
            .then_with(|| a.node_id.cmp(&b.node_id))
    });
    nodes
}

/// [`placement_order`] with the nodes that have template `id_or_name`
/// first: for requests about the template itself (a snapshot's fork, a
/// template's details), which another node would take in first or not
/// know.
pub fn holders_first(nodes: Vec<NodeRecord>, id_or_name: &str) -> Vec<NodeRecord> {
    first_those(placement_order(nodes), |n| n.has_template(id_or_name))
}

/// `nodes` with those `wanted` picks first, then the others, each in the
/// order they had.
pub fn first_those(
    nodes: Vec<NodeRecord>,
    wanted: impl Fn(&NodeRecord) -> bool,
) -> Vec<NodeRecord> {
    let (mut first, others): (Vec<_>, Vec<_>) = nodes.into_iter().partition(|n| wanted(n));
    first.extend(others);
    first
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, cap: u64, used: u64) -> NodeRecord {
        NodeRecord {
            node_id: id.into(),
            incarnation: 1,
            api_addr: "127.0.0.1:1".into(),
            capacity: NodeCapacity {
                max_sandboxes: cap,
                vcpus: 8,
                memory_mib: 4096,
            },
            load: NodeLoad {
                sandboxes: used,
                ..NodeLoad::default()
            },
            cpu_template: None,
        }
    }

    #[test]
    fn keys_round_trip_and_reject_other_keys() {
        let key = sandbox_key("abc123");
        assert_eq!(key, "/sandfork/v1/sandboxes/abc123");
        assert_eq!(sandbox_id(key.as_bytes()), Some("abc123"));
        assert_eq!(sandbox_id(b"/sandfork/v1/sandboxes/"), None);
        assert_eq!(sandbox_id(b"/sandfork/v1/sandboxes/a/b"), None);
        assert_eq!(sandbox_id(node_key("n1").as_bytes()), None);
        assert!(is_node_id("node-1.lab"));
        for bad in ["", "a/b", "a b", &"x".repeat(65)] {
            assert!(!is_node_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn placement_prefers_the_freest_node_then_the_lowest_id() {
        let order = placement_order(vec![node("c", 4, 3), node("b", 4, 1), node("a", 4, 1)]);
        let ids: Vec<&str> = order.iter().map(|n| n.node_id.as_str()).collect();
        assert_eq!(ids, ["a", "b", "c"]);
        // The scarcest resource decides; a full node scores 0.
        let mut full = node("d", 4, 0);
        full.load.memory_mib = 4096;
        assert_eq!(full.free_share(), 0.0);
        assert_eq!(node("e", 0, 9).free_share(), 1.0);
    }

    #[test]
    fn an_image_goes_where_its_template_is_else_where_it_is_being_converted() {
        const IMAGE: &str = "127.0.0.1:5000/task/a:v1";
        let with = |mut n: NodeRecord| {
            n.load.templates = vec![IMAGE.into(), "base".into()];
            n
        };
        let ids = |nodes: Vec<NodeRecord>| nodes.into_iter().map(|n| n.node_id).collect::<Vec<_>>();
        // Nobody has it: the node converting it, though a little fuller.
        let fresh = || vec![node("a", 8, 0), node("b", 8, 1), node("c", 8, 1)];
        assert_eq!(
            ids(placement_order_for_image(fresh(), IMAGE, Some("c"))),
            ["c", "a", "b"]
        );
        // Nobody has it nor converts it: freest first, as any create.
        assert_eq!(
            ids(placement_order_for_image(fresh(), IMAGE, None)),
            ["a", "b", "c"]
        );
        // b has it (ready): b, before a that is a little freer; c converts
        // it (a second conversion's claim, which cannot be) and is fuller.
        let some = || vec![node("a", 8, 0), with(node("b", 8, 1)), node("c", 8, 3)];
        assert_eq!(
            ids(placement_order_for_image(some(), IMAGE, None)),
            ["b", "a", "c"]
        );
        // Those that have it clearly fuller: the freest, which takes it in.
        let full = vec![node("a", 8, 0), with(node("b", 8, 6))];
        assert_eq!(
            ids(placement_order_for_image(full, IMAGE, None)),
            ["a", "b"]
        );
        // Keys: one segment per image, whatever its reference holds.
        let key = image_key(IMAGE);
        assert!(key.starts_with(IMAGES));
        assert_eq!(key.len(), IMAGES.len() + 64);
        assert_ne!(key, image_key("127.0.0.1:5000/task/a:v2"));
    }

    #[test]
    fn placement_prefers_nodes_with_the_template_until_they_are_clearly_fuller() {
        let with = |mut n: NodeRecord| {
            n.load.templates = vec!["base".into(), "tmpl1".into()];
            n
        };
        let ids = |nodes: Vec<NodeRecord>| nodes.into_iter().map(|n| n.node_id).collect::<Vec<_>>();
        let nodes = || {
            vec![
                node("a", 8, 0),
                with(node("b", 8, 1)),
                with(node("c", 8, 4)),
            ]
        };
        // b has it and is nearly as free as a: b; c is half full: after a.
        assert_eq!(
            ids(placement_order_for(nodes(), Some("tmpl1"))),
            ["b", "a", "c"]
        );
        // Without a template, or for one no node has, freest first.
        assert_eq!(ids(placement_order_for(nodes(), None)), ["a", "b", "c"]);
        assert_eq!(
            ids(placement_order_for(nodes(), Some("other"))),
            ["a", "b", "c"]
        );
        // About the template itself: whoever has it first, however full.
        assert_eq!(ids(holders_first(nodes(), "tmpl1")), ["b", "c", "a"]);
        // A full node that has it stays last.
        let full = with(node("d", 8, 8));
        assert_eq!(
            ids(placement_order_for(
                vec![full, node("a", 8, 7)],
                Some("tmpl1")
            )),
            ["a", "d"]
        );
    }
}

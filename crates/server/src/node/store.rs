//! Durable metadata in redb: sandboxes, templates and the API key hash. Every
//! change is one write transaction, committed (and synced) before the caller
//! answers anyone.

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::node::tenants::{KeyRecord, TeamRecord};
use crate::node::volume::VolumeRecord;
use crate::node::webhooks::{DeliveryRecord, WebhookRecord};

type Table = TableDefinition<'static, &'static str, &'static [u8]>;

/// A table of one kind of record, stored as JSON and named in errors.
struct Records<T> {
    table: Table,
    what: &'static str,
    of: PhantomData<fn() -> T>,
}

impl<T> Records<T> {
    const fn new(name: &'static str, what: &'static str) -> Records<T> {
        Records {
            table: TableDefinition::new(name),
            what,
            of: PhantomData,
        }
    }
}

impl<T> Clone for Records<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Records<T> {}

const SANDBOXES: Records<SandboxRecord> = Records::new("sandboxes", "sandbox");
const TEMPLATES: Records<TemplateRecord> = Records::new("templates", "template");
/// Templates deleted while something still stacked on them: out of every
/// lookup, kept until the garbage collector finds nothing using them.
const RETIRED: Records<TemplateRecord> = Records::new("retired_templates", "retired template");
const META: Table = TableDefinition::new("meta");
const BUILDS: Records<BuildRecord> = Records::new("builds", "build");
/// Teams by id, API keys by the hex SHA-256 of the key, and the owning team
/// of templates (`template/<id>`: a template, snapshot or build; absent: the
/// default team's). See [`crate::node::tenants`].
const TEAMS: Records<TeamRecord> = Records::new("teams", "team");
const KEYS: Records<KeyRecord> = Records::new("api_keys", "API key");
const OWNERS: Table = TableDefinition::new("owners");
/// Creates made with an `Idempotency-Key`, by `<team>/<key>`: see
/// [`crate::node::idempotent`].
const IDEMPOTENT: Records<IdempotentCreate> =
    Records::new("idempotent_creates", "idempotent create");
/// Lifecycle webhooks by id, and their deliveries by id: see
/// [`crate::node::webhooks`].
const WEBHOOKS: Records<WebhookRecord> = Records::new("webhooks", "webhook");
const DELIVERIES: Records<DeliveryRecord> = Records::new("webhook_deliveries", "webhook delivery");
/// Volumes by id: see [`crate::node::volume`].
const VOLUMES: Records<VolumeRecord> = Records::new("volumes", "volume");

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the store: {0}")]
    Db(#[from] redb::Error),
    #[error("a stored {what} is unreadable: {source}")]
    Decode {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

fn db_err(e: impl Into<redb::Error>) -> StoreError {
    StoreError::Db(e.into())
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    #[default]
    Running,
    Paused,
}

/// Why a sandbox is paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum PauseReason {
    /// Its owner paused it (`POST /sandboxes/{id}/pause`).
    Request,
    /// Its timeout ended and it pauses rather than dies (`autoPause`).
    Timeout,
    /// The node paused it, idle, while the host ran short of memory; it
    /// resumes on its next request with the timeout it had left.
    MemoryPressure,
}

impl PauseReason {
    pub fn as_str(self) -> &'static str {
        match self {
            PauseReason::Request => "request",
            PauseReason::Timeout => "timeout",
            PauseReason::MemoryPressure => "memoryPressure",
        }
    }
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
        }
    }
}

/// One sandbox as the node remembers it. Times are unix milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub id: String,
    pub template_id: String,
    pub alias: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    /// The envd access token, when the sandbox is secure.
    pub access_token: Option<crate::node::ids::Token>,
    pub started_at_ms: u64,
    pub end_at_ms: u64,
    pub state: SandboxState,
    pub cpu_count: u32,
    pub memory_mb: u64,
    pub disk_size_mb: u64,
    /// Pause instead of kill at the end of the timeout.
    pub auto_pause: bool,
    /// That pause keeps the memory (E2B's `autoPauseMemory`; false: the
    /// filesystem only, and the resume cold-boots).
    #[serde(default = "yes")]
    pub auto_pause_memory: bool,
    /// Pauses so far: each writes its own snapshot files (a diff snapshot
    /// maps the earlier ones below it).
    #[serde(default)]
    pub pause_generation: u32,
    /// The pause (its generation) asked to stay on this node (`"durable":
    /// false`): in a cluster, the object store does not get it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_pause: Option<u32>,
    /// The snapshot a paused sandbox resumes from; none for one paused
    /// filesystem-only (its resume cold-boots the kernel on its disk).
    #[serde(default)]
    pub snapshot: Option<PausedSnapshot>,
    /// The running guest was cold-booted (its memory is no snapshot's, so
    /// its next pause writes all of it rather than a diff).
    #[serde(default)]
    pub cold_booted: bool,
    /// Its memory pause was taken while its guest agent did not answer:
    /// restoring that memory would bring the dead agent back, so only a
    /// resume from its disk is allowed (E2B's `envdUnresponsiveAtPause`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub envd_unresponsive_at_pause: bool,
    /// The root disk's writable layer when it is not `root.layer` in the
    /// sandbox's directory (after a fork, in the fork's directory).
    #[serde(default)]
    pub root_layer: Option<PathBuf>,
    /// Other sandboxes read files in this one's directory (its sealed root
    /// layer, after a fork): a kill leaves the directory in place.
    #[serde(default)]
    pub has_dependents: bool,
    /// Snapshots whose files this sandbox's memory or disk stacks on: none of
    /// them may be deleted while it exists.
    #[serde(default)]
    pub uses_snapshots: Vec<String>,
    /// Directories under `sandboxes/` and `forks/` holding files its memory
    /// or disk stacks on, its own included; the garbage collector keeps these.
    /// Empty only in records from before it existed.
    #[serde(default)]
    pub uses_dirs: Vec<PathBuf>,
    /// A running sandbox's VMM directory (under the node's run dir), where
    /// a restarted server finds the process to adopt.
    #[serde(default)]
    pub vmm_dir: Option<PathBuf>,
    /// Its network policy as E2B's API set it and, while it runs, its slot.
    #[serde(default)]
    pub network: crate::node::net::SandboxNetwork,
    /// Why a paused sandbox is paused (none while it runs, and in records
    /// from before it existed).
    #[serde(default)]
    pub pause_reason: Option<PauseReason>,
    /// The team that owns it; None: the default team (and every record from
    /// before teams existed). See [`crate::node::tenants`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
    /// The CPU template its guest was booted under (its template's, or the
    /// node's when it was cold-booted), which its snapshots keep; None: the
    /// host's CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_template: Option<String>,
    /// The volumes mounted in it (see [`crate::node::volume`]): none may
    /// be deleted while it exists.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<VolumeMount>,
    /// The sandbox or snapshot it was forked from, kept for as long as it
    /// lives (its lineage outlasts the node's recent events and restarts);
    /// None: not a fork's child.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<ForkedFrom>,
}

/// Where a fork child comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ForkedFrom {
    /// The sandbox forked, or the snapshot.
    pub parent_id: String,
    /// Its place among that fork's children, from 0.
    pub branch: u32,
}

/// A volume in one of a sandbox's slots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeMount {
    pub volume_id: String,
    /// The volume's name as the create named it (names are fixed, and a
    /// mounted volume is not deleted, so it still names it), for E2B's
    /// `volumeMounts` in details and lists. Empty in records from before.
    #[serde(default)]
    pub name: String,
    /// Its spare drive (`vol<slot>`).
    pub slot: usize,
    /// Where the guest mounts it.
    pub path: String,
    pub read_only: bool,
    /// The disk layer the slot is restored on.
    pub disk: PathBuf,
    /// A fork child's own copy of the volume (its layer over the volume's
    /// as it was at the fork), not the volume: it leaves the volume free to
    /// mount, but a delete of the volume waits for it (its layer stacks on
    /// the volume's files).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub copy: bool,
}

impl SandboxRecord {
    /// The id of the team that owns it.
    pub fn team(&self) -> &str {
        crate::node::tenants::team_or_default(self.team.as_deref())
    }
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PausedSnapshot {
    pub state: PathBuf,
    pub mem: PathBuf,
}

/// A template ready to restore: its full snapshot and sealed root layer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateRecord {
    pub id: String,
    pub dir: PathBuf,
    pub snapshot: PathBuf,
    pub mem: PathBuf,
    /// The sealed root disk layer every sandbox stacks its own layer on.
    pub root_layer: PathBuf,
    /// The drive id of the root disk in the snapshot.
    pub root_drive_id: String,
    pub kernel: PathBuf,
    pub rootfs: PathBuf,
    pub vcpus: u8,
    pub mem_mib: u64,
    pub disk_size_mb: u64,
    pub created_at_ms: u64,
    /// Set for a snapshot: the sandbox it was taken from.
    #[serde(default)]
    pub source_sandbox: Option<String>,
    /// A snapshot's names (the `name` it was given, if any).
    #[serde(default)]
    pub names: Vec<String>,
    /// The envd access token the snapshot's agent holds (its source's).
    #[serde(default)]
    pub agent_token: Option<crate::node::ids::Token>,
    /// A snapshot's source's network (E2B rules, policy, ingress) when it
    /// was taken: what the snapshot's fork children keep.
    #[serde(default)]
    pub source_network: Option<crate::node::net::SandboxNetwork>,
    /// The source's sandbox-wide environment, kept by sandboxes made from it.
    #[serde(default)]
    pub env_vars: BTreeMap<String, String>,
    /// Other snapshots whose files this one stacks on.
    #[serde(default)]
    pub uses_snapshots: Vec<String>,
    /// A snapshot's source's `uses_dirs` (see [`SandboxRecord::uses_dirs`]).
    #[serde(default)]
    pub uses_dirs: Vec<PathBuf>,
    /// The guest network ABI its snapshot carries (a network interface at
    /// the fixed addresses of `sandfork_network::plan`); None: no interface.
    #[serde(default)]
    pub net_abi: Option<u32>,
    /// Its snapshot has a balloon that gives the memory its guest frees
    /// back to the host (`serve --no-balloon` builds without).
    #[serde(default)]
    pub balloon: bool,
    /// The CPU template its guest was booted under (`serve
    /// --cpu-template`), which its snapshot's CPUID keeps; None: the host's
    /// CPU (and every template made before templates were).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_template: Option<String>,
    /// The spare drives its snapshot has for volumes
    /// ([`crate::node::volume`]); 0 for templates built before them.
    #[serde(default)]
    pub volume_slots: usize,
    /// Set for a template converted from a registry image (the image's
    /// name): a cache of it, evicted when the disk runs short and nothing
    /// uses it (see `crate::node::template::image_disk`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The manifest digest of that image: a create naming the same image
    /// by another reference (a second tag) is given this template, named
    /// by that reference too, instead of a template of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_digest: Option<String>,
    /// A filesystem-only snapshot (E2B's `memory: false`): its sandboxes
    /// cold-boot the node's kernel on their own layer over `root_layer`,
    /// and nothing restores its `snapshot` and `mem` (written all the same:
    /// the VMM's fork seals the disk, and its source's memory then maps
    /// them).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub filesystem_only: bool,
    /// A snapshot's source's volumes, each on the layer the snapshot sealed
    /// (`disk`): every sandbox made from it stacks its own copy on it, in
    /// the same slot at the same path. A volume is not deleted while a
    /// snapshot names it (its sealed layer stacks on the volume's files).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<VolumeMount>,
}

impl TemplateRecord {
    /// The image references that name it: its `image` and, for a template
    /// converted from an image, the other references to the same image (a
    /// second tag) that creates named it by since (in its `names`).
    pub fn image_references(&self) -> Vec<&str> {
        let Some(image) = self.image.as_deref() else {
            return Vec::new();
        };
        let mut references = vec![image];
        references.extend(
            self.names
                .iter()
                .map(String::as_str)
                .filter(|n| *n != image),
        );
        references
    }

    /// Whether its snapshot, memory and sealed root layer are all here (a
    /// record whose files a crash or the collector took is not).
    pub fn files_whole(&self) -> bool {
        [&self.snapshot, &self.mem, &self.root_layer]
            .iter()
            .all(|p| p.is_file())
    }

    pub fn is_snapshot(&self) -> bool {
        self.source_sandbox.is_some()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BuildStatus {
    /// Requested (E2B's `POST /v3/templates`), not started yet.
    Waiting,
    Building,
    Ready,
    Error,
}

impl BuildStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            BuildStatus::Waiting => "waiting",
            BuildStatus::Building => "building",
            BuildStatus::Ready => "ready",
            BuildStatus::Error => "error",
        }
    }
}

/// A template build (`POST /templates`), keyed by the template id it makes.
/// The template's own record is written only when the build is ready, in the
/// same transaction that marks it so.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildRecord {
    pub template_id: String,
    pub build_id: String,
    pub name: String,
    /// What it is built from, for people (`debian packages jq, curl`).
    pub source: String,
    pub vcpus: u8,
    pub mem_mib: u64,
    pub status: BuildStatus,
    /// Why it failed, when it did.
    pub reason: Option<String>,
    pub started_at_ms: u64,
    pub finished_at_ms: Option<u64>,
    /// The build's log (its tail, when long); written when it ends.
    pub log: Vec<String>,
    /// E2B's step that failed (`base`, `1`..., `finalize`), when known.
    #[serde(default)]
    pub reason_step: Option<String>,
    /// Set for E2B's builds (`POST /v3/templates`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2b: Option<E2bBuild>,
}

/// What an E2B build is part of: its template (E2B's `templateID`, shared by
/// every build of a name; the build's own record id differs for a rebuild)
/// and the tags its template takes when it is ready.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct E2bBuild {
    pub template_id: String,
    pub tags: Vec<String>,
}

#[derive(Debug)]
pub struct Store {
    db: redb::Database,
}

impl Store {
    /// Opens (or creates) the store file and its tables.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let db = redb::Database::create(path).map_err(db_err)?;
        let tx = db.begin_write().map_err(db_err)?;
        for table in [
            SANDBOXES.table,
            TEMPLATES.table,
            RETIRED.table,
            META,
            BUILDS.table,
            TEAMS.table,
            KEYS.table,
            OWNERS,
            IDEMPOTENT.table,
            WEBHOOKS.table,
            DELIVERIES.table,
            VOLUMES.table,
        ] {
            tx.open_table(table).map_err(db_err)?;
        }
        tx.commit().map_err(db_err)?;
        Ok(Store { db })
    }

    fn put(&self, table: Table, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let tx = self.db.begin_write().map_err(db_err)?;
        tx.open_table(table)
            .map_err(db_err)?
            .insert(key, value)
            .map_err(db_err)?;
        tx.commit().map_err(db_err)
    }

    fn get(&self, table: Table, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let tx = self.db.begin_read().map_err(db_err)?;
        let table = tx.open_table(table).map_err(db_err)?;
        Ok(table.get(key).map_err(db_err)?.map(|v| v.value().to_vec()))
    }

    /// Removes `key`; returns whether it was there.
    fn remove(&self, table: Table, key: &str) -> Result<bool, StoreError> {
        let tx = self.db.begin_write().map_err(db_err)?;
        let existed = tx
            .open_table(table)
            .map_err(db_err)?
            .remove(key)
            .map_err(db_err)?
            .is_some();
        tx.commit().map_err(db_err)?;
        Ok(existed)
    }

    fn all(&self, table: Table) -> Result<Vec<Vec<u8>>, StoreError> {
        let tx = self.db.begin_read().map_err(db_err)?;
        let table = tx.open_table(table).map_err(db_err)?;
        let mut out = Vec::new();
        for entry in table.iter().map_err(db_err)? {
            let (_, v) = entry.map_err(db_err)?;
            out.push(v.value().to_vec());
        }
        Ok(out)
    }

    fn put_record<T: Serialize>(
        &self,
        t: Records<T>,
        key: &str,
        value: &T,
    ) -> Result<(), StoreError> {
        self.put(t.table, key, &encode(value))
    }

    fn record<T: DeserializeOwned>(
        &self,
        t: Records<T>,
        key: &str,
    ) -> Result<Option<T>, StoreError> {
        self.get(t.table, key)?
            .map(|b| decode(&b, t.what))
            .transpose()
    }

    fn records<T: DeserializeOwned>(&self, t: Records<T>) -> Result<Vec<T>, StoreError> {
        self.all(t.table)?
            .iter()
            .map(|b| decode(b, t.what))
            .collect()
    }

    pub fn put_sandbox(&self, s: &SandboxRecord) -> Result<(), StoreError> {
        self.put_record(SANDBOXES, &s.id, s)
    }

    pub fn sandbox(&self, id: &str) -> Result<Option<SandboxRecord>, StoreError> {
        self.record(SANDBOXES, id)
    }

    /// Changes one sandbox inside a single transaction; returns the new record,
    /// or None when there is no such sandbox.
    pub fn update_sandbox(
        &self,
        id: &str,
        change: impl FnOnce(&mut SandboxRecord),
    ) -> Result<Option<SandboxRecord>, StoreError> {
        let tx = self.db.begin_write().map_err(db_err)?;
        let updated = {
            let mut table = tx.open_table(SANDBOXES.table).map_err(db_err)?;
            let current = table
                .get(id)
                .map_err(db_err)?
                .map(|v| decode::<SandboxRecord>(v.value(), SANDBOXES.what))
                .transpose()?;
            match current {
                Some(mut record) => {
                    change(&mut record);
                    table
                        .insert(id, encode(&record).as_slice())
                        .map_err(db_err)?;
                    Some(record)
                }
                None => None,
            }
        };
        tx.commit().map_err(db_err)?;
        Ok(updated)
    }

    pub fn remove_sandbox(&self, id: &str) -> Result<bool, StoreError> {
        self.remove(SANDBOXES.table, id)
    }

    pub fn sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        self.records(SANDBOXES)
    }

    pub fn put_template(&self, t: &TemplateRecord) -> Result<(), StoreError> {
        self.put_record(TEMPLATES, &t.id, t)
    }

    pub fn template(&self, id: &str) -> Result<Option<TemplateRecord>, StoreError> {
        self.record(TEMPLATES, id)
    }

    pub fn remove_template(&self, id: &str) -> Result<bool, StoreError> {
        self.remove(TEMPLATES.table, id)
    }

    pub fn templates(&self) -> Result<Vec<TemplateRecord>, StoreError> {
        self.records(TEMPLATES)
    }

    pub fn put_build(&self, b: &BuildRecord) -> Result<(), StoreError> {
        self.put_record(BUILDS, &b.template_id, b)
    }

    pub fn build(&self, template_id: &str) -> Result<Option<BuildRecord>, StoreError> {
        self.record(BUILDS, template_id)
    }

    /// Moves a template out of every lookup into the retired ones, in one
    /// transaction: its name is free at once, its files stay for its users.
    pub fn retire_template(&self, t: &TemplateRecord) -> Result<(), StoreError> {
        let tx = self.db.begin_write().map_err(db_err)?;
        tx.open_table(TEMPLATES.table)
            .map_err(db_err)?
            .remove(t.id.as_str())
            .map_err(db_err)?;
        tx.open_table(RETIRED.table)
            .map_err(db_err)?
            .insert(t.id.as_str(), encode(t).as_slice())
            .map_err(db_err)?;
        tx.commit().map_err(db_err)
    }

    pub fn retired_templates(&self) -> Result<Vec<TemplateRecord>, StoreError> {
        self.records(RETIRED)
    }

    pub fn remove_retired_template(&self, id: &str) -> Result<bool, StoreError> {
        self.remove(RETIRED.table, id)
    }

    pub fn builds(&self) -> Result<Vec<BuildRecord>, StoreError> {
        self.records(BUILDS)
    }

    pub fn remove_build(&self, template_id: &str) -> Result<bool, StoreError> {
        self.remove(BUILDS.table, template_id)
    }

    /// Records a finished build and its template in one transaction, so a
    /// crash leaves either both or neither.
    pub fn finish_build(&self, t: &TemplateRecord, b: &BuildRecord) -> Result<(), StoreError> {
        let tx = self.db.begin_write().map_err(db_err)?;
        tx.open_table(TEMPLATES.table)
            .map_err(db_err)?
            .insert(t.id.as_str(), encode(t).as_slice())
            .map_err(db_err)?;
        tx.open_table(BUILDS.table)
            .map_err(db_err)?
            .insert(b.template_id.as_str(), encode(b).as_slice())
            .map_err(db_err)?;
        tx.commit().map_err(db_err)
    }

    pub fn put_meta(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.put(META, key, value)
    }

    pub fn meta(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.get(META, key)
    }

    pub fn put_team(&self, t: &TeamRecord) -> Result<(), StoreError> {
        self.put_record(TEAMS, &t.id, t)
    }

    pub fn teams(&self) -> Result<Vec<TeamRecord>, StoreError> {
        self.records(TEAMS)
    }

    /// Records an API key by the hex SHA-256 of the key.
    pub fn put_key(&self, hash_hex: &str, k: &KeyRecord) -> Result<(), StoreError> {
        self.put_record(KEYS, hash_hex, k)
    }

    /// Every API key: (hex SHA-256, record).
    pub fn keys(&self) -> Result<Vec<(String, KeyRecord)>, StoreError> {
        let tx = self.db.begin_read().map_err(db_err)?;
        let table = tx.open_table(KEYS.table).map_err(db_err)?;
        let mut out = Vec::new();
        for entry in table.iter().map_err(db_err)? {
            let (k, v) = entry.map_err(db_err)?;
            out.push((k.value().to_owned(), decode(v.value(), KEYS.what)?));
        }
        Ok(out)
    }

    pub fn remove_key(&self, hash_hex: &str) -> Result<bool, StoreError> {
        self.remove(KEYS.table, hash_hex)
    }

    /// The team owning `what` (see [`crate::node::tenants::template_owner_key`]);
    /// None: the default team.
    pub fn owner(&self, what: &str) -> Result<Option<String>, StoreError> {
        Ok(self
            .get(OWNERS, what)?
            .map(|b| String::from_utf8_lossy(&b).into_owned()))
    }

    /// Records `team` as the owner of `what` (None: the default team, which
    /// needs no entry).
    pub fn set_owner(&self, what: &str, team: Option<&str>) -> Result<(), StoreError> {
        match team {
            Some(team) => self.put(OWNERS, what, team.as_bytes()),
            None => self.remove(OWNERS, what).map(drop),
        }
    }
}

/// A create made with an `Idempotency-Key`: what its replays are compared
/// with and answered. Times are unix milliseconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdempotentCreate {
    /// The SHA-256 (hex) of the route and the request's JSON.
    pub fingerprint: String,
    /// Forgotten from then on (a replay after it creates again).
    pub expires_at_ms: u64,
    /// None while the create runs: found so after a restart, the create's
    /// outcome is unknown.
    pub answer: Option<IdempotentAnswer>,
}

/// The 201 a create answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdempotentAnswer {
    /// The JSON body, byte for byte.
    pub body: String,
}

impl Store {
    pub fn idempotent_create(&self, key: &str) -> Result<Option<IdempotentCreate>, StoreError> {
        self.record(IDEMPOTENT, key)
    }

    pub fn put_idempotent_create(&self, key: &str, c: &IdempotentCreate) -> Result<(), StoreError> {
        self.put_record(IDEMPOTENT, key, c)
    }

    pub fn remove_idempotent_create(&self, key: &str) -> Result<bool, StoreError> {
        self.remove(IDEMPOTENT.table, key)
    }

    /// Removes the records expired at `now_ms` (and unreadable ones, which
    /// nothing could replay); returns how many.
    pub fn remove_expired_idempotent_creates(&self, now_ms: u64) -> Result<u64, StoreError> {
        let tx = self.db.begin_write().map_err(db_err)?;
        let removed = {
            let mut table = tx.open_table(IDEMPOTENT.table).map_err(db_err)?;
            let before = table.len().map_err(db_err)?;
            table
                .retain(|_, v| {
                    decode::<IdempotentCreate>(v, IDEMPOTENT.what)
                        .is_ok_and(|c| c.expires_at_ms > now_ms)
                })
                .map_err(db_err)?;
            before.saturating_sub(table.len().map_err(db_err)?)
        };
        tx.commit().map_err(db_err)?;
        Ok(removed)
    }
}

impl Store {
    pub fn put_volume(&self, v: &VolumeRecord) -> Result<(), StoreError> {
        self.put_record(VOLUMES, &v.id, v)
    }

    pub fn volume(&self, id: &str) -> Result<Option<VolumeRecord>, StoreError> {
        self.record(VOLUMES, id)
    }

    pub fn volumes(&self) -> Result<Vec<VolumeRecord>, StoreError> {
        self.records(VOLUMES)
    }

    /// Removes volume `id`'s record; returns whether it was there.
    pub fn remove_volume(&self, id: &str) -> Result<bool, StoreError> {
        self.remove(VOLUMES.table, id)
    }
}

impl Store {
    pub fn put_webhook(&self, w: &WebhookRecord) -> Result<(), StoreError> {
        self.put_record(WEBHOOKS, &w.id, w)
    }

    pub fn webhook(&self, id: &str) -> Result<Option<WebhookRecord>, StoreError> {
        self.record(WEBHOOKS, id)
    }

    pub fn webhooks(&self) -> Result<Vec<WebhookRecord>, StoreError> {
        self.records(WEBHOOKS)
    }

    /// Removes webhook `id` and its deliveries; returns whether it was there.
    pub fn remove_webhook(&self, id: &str) -> Result<bool, StoreError> {
        let tx = self.db.begin_write().map_err(db_err)?;
        let existed = tx
            .open_table(WEBHOOKS.table)
            .map_err(db_err)?
            .remove(id)
            .map_err(db_err)?
            .is_some();
        tx.open_table(DELIVERIES.table)
            .map_err(db_err)?
            .retain(|_, v| {
                decode::<DeliveryRecord>(v, DELIVERIES.what).is_ok_and(|d| d.webhook_id != id)
            })
            .map_err(db_err)?;
        tx.commit().map_err(db_err)?;
        Ok(existed)
    }

    pub fn put_delivery(&self, d: &DeliveryRecord) -> Result<(), StoreError> {
        self.put_record(DELIVERIES, &d.id, d)
    }

    pub fn deliveries(&self) -> Result<Vec<DeliveryRecord>, StoreError> {
        self.records(DELIVERIES)
    }

    /// Removes the deliveries made before `before_ms` (and unreadable
    /// ones); returns how many.
    pub fn remove_deliveries_before(&self, before_ms: u64) -> Result<u64, StoreError> {
        let tx = self.db.begin_write().map_err(db_err)?;
        let removed = {
            let mut table = tx.open_table(DELIVERIES.table).map_err(db_err)?;
            let before = table.len().map_err(db_err)?;
            table
                .retain(|_, v| {
                    decode::<DeliveryRecord>(v, DELIVERIES.what)
                        .is_ok_and(|d| d.created_at_ms >= before_ms)
                })
                .map_err(db_err)?;
            before.saturating_sub(table.len().map_err(db_err)?)
        };
        tx.commit().map_err(db_err)?;
        Ok(removed)
    }
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Plain structs of strings, numbers and maps with string keys always serialize.
    serde_json::to_vec(value).unwrap_or_default()
}

fn decode<T: DeserializeOwned>(bytes: &[u8], what: &'static str) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|source| StoreError::Decode { what, source })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn record(id: &str, started: u64) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            template_id: "base".into(),
            alias: Some("base".into()),
            metadata: BTreeMap::from([("k".into(), "v".into())]),
            access_token: Some("tok".into()),
            started_at_ms: started,
            end_at_ms: started + 300_000,
            state: SandboxState::Running,
            cpu_count: 1,
            memory_mb: 256,
            disk_size_mb: 2048,
            ..Default::default()
        }
    }

    #[test]
    fn sandboxes_round_trip_update_and_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.redb");
        {
            let store = Store::open(&path).unwrap();
            store.put_sandbox(&record("a", 1)).unwrap();
            store.put_sandbox(&record("b", 2)).unwrap();
            assert_eq!(store.sandbox("a").unwrap(), Some(record("a", 1)));
            let updated = store
                .update_sandbox("b", |s| s.state = SandboxState::Paused)
                .unwrap()
                .unwrap();
            assert_eq!(updated.state, SandboxState::Paused);
            assert_eq!(store.update_sandbox("zz", |_| ()).unwrap(), None);
            assert!(store.remove_sandbox("a").unwrap());
            assert!(!store.remove_sandbox("a").unwrap());
            store.put_meta("k", b"v").unwrap();
        }
        let store = Store::open(&path).unwrap();
        let all = store.sandboxes().unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].id, "b");
        assert_eq!(all[0].state, SandboxState::Paused);
        assert_eq!(store.meta("k").unwrap().as_deref(), Some(&b"v"[..]));
        assert_eq!(store.sandbox("a").unwrap(), None);
    }

    #[test]
    fn a_build_and_its_template_are_recorded_together() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.redb")).unwrap();
        let mut b = BuildRecord {
            template_id: "t1".into(),
            build_id: "b1".into(),
            name: "jq".into(),
            source: "debian packages jq".into(),
            vcpus: 1,
            mem_mib: 256,
            status: BuildStatus::Building,
            reason: None,
            started_at_ms: 1,
            finished_at_ms: None,
            log: Vec::new(),
            reason_step: None,
            e2b: None,
        };
        store.put_build(&b).unwrap();
        assert_eq!(store.template("t1").unwrap(), None);
        b.status = BuildStatus::Ready;
        let t = TemplateRecord {
            id: "t1".into(),
            names: vec!["jq".into()],
            ..base_template()
        };
        store.finish_build(&t, &b).unwrap();
        assert_eq!(store.template("t1").unwrap(), Some(t));
        assert_eq!(store.builds().unwrap(), vec![b]);
        assert!(store.remove_build("t1").unwrap());
        assert_eq!(store.build("t1").unwrap(), None);
    }

    fn base_template() -> TemplateRecord {
        TemplateRecord {
            id: "base".into(),
            dir: "/t".into(),
            snapshot: "/t/vm.state".into(),
            mem: "/t/vm.mem".into(),
            root_layer: "/t/root.layer".into(),
            root_drive_id: "rootfs".into(),
            kernel: "/k".into(),
            rootfs: "/r".into(),
            vcpus: 1,
            mem_mib: 256,
            disk_size_mb: 2048,
            created_at_ms: 5,
            ..Default::default()
        }
    }

    #[test]
    fn templates_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.redb")).unwrap();
        let t = base_template();
        store.put_template(&t).unwrap();
        assert_eq!(store.template("base").unwrap(), Some(t.clone()));
        assert_eq!(store.templates().unwrap(), vec![t]);
        assert!(store.remove_template("base").unwrap());
        assert_eq!(store.template("base").unwrap(), None);
    }
}

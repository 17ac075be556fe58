//! Creates that name a registry image instead of a template: its
//! template id is an image reference ([`is_image_reference`]), or, when the
//! node is configured with `Config::image_metadata_key`, the create's
//! metadata names the image under that key (slime's way).
//!
//! The first create of an image pulls it with the node's registry
//! credentials (`template_build::registry::AUTH_VAR`), converts it into a
//! root filesystem and boots it into a template named by the normalised
//! reference (`127.0.0.1:5000/repo:tag`); the create, and every later one,
//! restores that template. A tag is resolved once: a later push under the
//! same tag is not pulled until the template is deleted.
//!
//! **One conversion per image**: creates of an image whose conversion is
//! under way wait on it (a flight, in memory) for up to
//! `Config::builtin_wait`, then are answered [`SandboxError::Building`]
//! (503, `Retry-After`); the conversion goes on without them. It is a build
//! like any other (recorded `building`, listed, with its log), and a failed
//! one leaves nothing: its build record and files are removed, and the next
//! create of the image tries again.
//!
//! **One template per image, whatever names it**: a reference the node has
//! not seen (a second tag) is resolved to its manifest digest, and when a
//! template of that digest is here the reference becomes one more of its
//! names; nothing is booted and its build record goes. Two references to
//! one new image converted at the same moment still make two templates.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use template_build::registry::{Credentials, Reference, RegistryError};
use tokio::sync::watch;

use super::boot::{self, BootSpec};
use super::build::{BUILTIN_RETRY_SECS, BuildLog, Templates, new_build};
use super::image::PullError;
use crate::node::capacity::{Ask, Reservation};
use crate::node::clock::now_ms;
use crate::node::ids;
use crate::node::sandbox::SandboxError;
use crate::node::store::{BuildRecord, BuildStatus};

/// Why an image could not be made a template. The registry's answer is in
/// the message; credentials never are.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ImageError {
    /// Not an image reference (400).
    #[error("{0}")]
    Reference(String),
    /// The registry has no such image (404).
    #[error("{}", named(image, answer))]
    NotFound { image: String, answer: String },
    /// The registry refused the node's credentials, or wants some the node
    /// lacks (403).
    #[error("{}", named(image, answer))]
    Denied { image: String, answer: String },
    /// Larger than `Config::max_image_bytes` (413).
    #[error("{}", named(image, answer))]
    TooLarge { image: String, answer: String },
    /// Not an image this node runs (no linux/amd64, an old manifest) (400).
    #[error("{}", named(image, answer))]
    Unsupported { image: String, answer: String },
    /// The registry failed or could not be reached (502).
    #[error("{}", named(image, answer))]
    Registry { image: String, answer: String },
    /// The node failed to convert or boot it (500).
    #[error("image {image}: {reason}")]
    Failed { image: String, reason: String },
    /// The node's disk is above the high watermark for images with every
    /// image template on it in use (503, `Retry-After`: one may be unused
    /// by then, and a cluster's gateway tries the next node).
    #[error(
        "image {image}: not converted: this node's disk is {used_percent:.1} % used, above its \
         high watermark for images ({high_percent} %), and no image template on it is unused; \
         retry later"
    )]
    NoRoom {
        image: String,
        used_percent: f64,
        high_percent: f64,
    },
}

/// The registry's answer, with the image's name unless it has it already.
fn named(image: &str, answer: &str) -> String {
    if answer.contains(image) {
        answer.to_owned()
    } else {
        format!("image {image}: {answer}")
    }
}

impl ImageError {
    fn from_registry(image: &str, e: RegistryError) -> ImageError {
        let (image, answer) = (image.to_owned(), e.to_string());
        match e {
            RegistryError::BadReference { .. } => ImageError::Reference(answer),
            RegistryError::NotFound { .. } => ImageError::NotFound { image, answer },
            RegistryError::Unauthorized { .. } => ImageError::Denied { image, answer },
            RegistryError::TooLarge { .. } => ImageError::TooLarge { image, answer },
            RegistryError::Unsupported { .. } => ImageError::Unsupported { image, answer },
            RegistryError::Http { .. }
            | RegistryError::Transport { .. }
            | RegistryError::Tls { .. }
            | RegistryError::DigestMismatch { .. } => ImageError::Registry { image, answer },
            RegistryError::AuthFile { .. } | RegistryError::Io { .. } => ImageError::Failed {
                image,
                reason: answer,
            },
        }
    }
}

/// Whether a create's template id names a registry image rather than a
/// template: it has a digest (`repo@sha256:...`; template names never have
/// an `@`), or its first `/`-separated part is a registry host, as Docker
/// tells one (it has a `.` or a `:`, or is `localhost`). So `name`,
/// `name:tag`, `alias:build-id` and `team/alias` stay template names, and
/// Docker Hub's short names (`python:3.12`) are not images here: a create
/// names them with their registry (`docker.io/library/python:3.12`) or
/// through the metadata key.
pub fn is_image_reference(template_id: &str) -> bool {
    if template_id.contains('@') {
        return true;
    }
    match template_id.split_once('/') {
        Some((first, _)) => first.contains(['.', ':']) || first == "localhost",
        None => false,
    }
}

/// The image a create names, if any: its template id when that is an image
/// reference, else the value of the metadata key `key` (any reference
/// Docker accepts, short names too) when the template id is unset or the
/// base. Both at once is refused: which one the caller meant is unclear.
pub fn image_of_create(
    template_id: Option<&str>,
    metadata: &BTreeMap<String, String>,
    key: Option<&str>,
) -> Result<Option<String>, SandboxError> {
    let template_id = template_id.filter(|t| !t.is_empty());
    let from_metadata = key
        .and_then(|k| metadata.get(k).map(|v| (k, v.trim())))
        .filter(|(_, v)| !v.is_empty());
    match (template_id, from_metadata) {
        (Some(t), None) if is_image_reference(t) => Ok(Some(t.to_owned())),
        (t, Some((_, image))) if t.is_none_or(|t| ids::without_default_tag(t) == super::BASE) => {
            Ok(Some(image.to_owned()))
        }
        (Some(t), Some((k, image))) => Err(SandboxError::Invalid(format!(
            "the create names template {t:?} and, in its metadata {k:?}, image {image:?}: \
             name one"
        ))),
        _ => Ok(None),
    }
}

/// What a conversion ends with, for the creates waiting on it.
type Outcome = Option<Result<(), ImageError>>;

/// A conversion under way.
#[derive(Debug)]
pub(super) struct Flight {
    started: Instant,
    done: watch::Receiver<Outcome>,
}

/// What [`Templates::start_image`] found.
#[derive(Debug)]
pub enum ImageStart {
    /// The node has the image's template, by this name.
    Ready(String),
    /// The image is being converted here.
    Converting(Conversion),
}

/// A conversion of an image under way here.
#[derive(Debug, Clone)]
pub struct Conversion {
    /// The image's normalised reference: its template's name.
    pub name: String,
    flight: Arc<Flight>,
}

impl Conversion {
    /// How the conversion ended, once it has (None: its task ended without
    /// an answer, as when the node stops).
    pub async fn ended(&self) -> Option<Result<(), ImageError>> {
        let mut done = self.flight.done.clone();
        done.wait_for(Option::is_some).await.ok()?.clone()
    }
}

/// The normalised reference of `image` (a registry image a create names),
/// which its template is named by (`localhost:5000/a` is
/// `localhost:5000/a:latest`).
pub fn image_name(image: &str) -> Result<String, ImageError> {
    Reference::parse(image)
        .map(|r| r.to_string())
        .map_err(|e| ImageError::Reference(e.to_string()))
}

/// The conversions under way, by the image's normalised name.
pub(super) type Flights = Mutex<HashMap<String, Arc<Flight>>>;

impl Templates {
    fn flights(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Flight>>> {
        self.images.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Before a create of `image`: the name of its template, converted
    /// (once) when missing (see the module's documentation).
    pub async fn ensure_image(self: &Arc<Self>, image: &str) -> Result<String, SandboxError> {
        match self.start_image(image).await? {
            ImageStart::Ready(name) => Ok(name),
            ImageStart::Converting(conversion) => self.wait_image(&conversion).await,
        }
    }

    /// Whether image `name` (a normalised reference) is being converted
    /// here now.
    pub fn converting_image(&self, name: &str) -> bool {
        self.flights().contains_key(name)
    }

    /// The first half of [`Templates::ensure_image`]: `image`'s template
    /// when this node has it, else its conversion, started now or under
    /// way.
    pub async fn start_image(self: &Arc<Self>, image: &str) -> Result<ImageStart, SandboxError> {
        let reference =
            Reference::parse(image).map_err(|e| ImageError::Reference(e.to_string()))?;
        let name = reference.to_string();
        if let Ok(t) = self.manager().resolve_template(&name) {
            // Its last use, for the disk bound's order.
            crate::node::sandbox::cache_bound::mark_used(&t.snapshot);
            return Ok(ImageStart::Ready(name));
        }
        let converting = self.flights().contains_key(&name);
        if !converting {
            // Room first: unused image templates go while the disk is
            // above the high watermark; still above it, no conversion.
            let (above, used_percent) = self.bound_image_disk().await?;
            if above {
                self.count_refusal();
                return Err(ImageError::NoRoom {
                    image: name,
                    used_percent,
                    high_percent: self.manager().config().capacity.image_disk.high_percent,
                }
                .into());
            }
        }
        let mut flights = self.flights();
        let flight = match flights.get(&name) {
            Some(f) => f.clone(),
            None => {
                // A conversion that ended since the look-up above left
                // its template (it is recorded before its flight goes).
                if self.manager().resolve_template(&name).is_ok() {
                    return Ok(ImageStart::Ready(name));
                }
                let (record, room) = self.begin_conversion(&name)?;
                let (tx, rx) = watch::channel(None);
                let f = Arc::new(Flight {
                    started: Instant::now(),
                    done: rx,
                });
                flights.insert(name.clone(), f.clone());
                tokio::spawn(self.clone().convert(reference, record, room, tx));
                f
            }
        };
        Ok(ImageStart::Converting(Conversion { name, flight }))
    }

    /// The second half of [`Templates::ensure_image`]: waits for
    /// `conversion` for up to `Config::builtin_wait`, then answers
    /// [`SandboxError::Building`] (the conversion goes on).
    pub async fn wait_image(&self, conversion: &Conversion) -> Result<String, SandboxError> {
        let name = conversion.name.clone();
        let wait = self.manager().config().builtin_wait;
        match tokio::time::timeout(wait, conversion.ended()).await {
            Ok(Some(Ok(()))) => Ok(name),
            Ok(Some(Err(e))) => Err(e.into()),
            // The conversion's task ended without an answer (the node stops).
            Ok(None) => Err(SandboxError::Unavailable(format!(
                "the conversion of image {name} ended without an answer"
            ))),
            Err(_) => Err(SandboxError::Building {
                name,
                elapsed_secs: conversion.flight.started.elapsed().as_secs(),
                retry_after_secs: BUILTIN_RETRY_SECS,
            }),
        }
    }

    /// Holds room for the conversion's VM and records its build; what a
    /// conversion needs and cannot have is the create's answer at once.
    fn begin_conversion(&self, name: &str) -> Result<(BuildRecord, Reservation), SandboxError> {
        let manager = self.manager();
        let config = manager.config();
        if config.agent.is_none() {
            return Err(SandboxError::Unavailable(
                "this node has no guest agent binary to build images with (SANDFORK_AGENT)".into(),
            ));
        }
        let room = manager.capacity().reserve(
            Ask {
                sandboxes: 0,
                ..Ask::sandbox(u64::from(config.vcpus), config.mem_mib)
            },
            "an image's template",
        )?;
        let record = new_build(
            None,
            name,
            format!("image {name}"),
            (config.vcpus, config.mem_mib),
        )?;
        manager.store().put_build(&record)?;
        self.running()
            .insert(record.template_id.clone(), Arc::default());
        tracing::info!(
            "template {} ({name}): converting the image for a create",
            record.template_id
        );
        Ok((record, room))
    }

    /// The conversion's task: converts, records, then answers the creates.
    async fn convert(
        self: Arc<Self>,
        reference: Reference,
        mut record: BuildRecord,
        room: Reservation,
        tx: watch::Sender<Outcome>,
    ) {
        let id = record.template_id.clone();
        let name = record.name.clone();
        let started = Instant::now();
        let log = self.running().get(&id).cloned().unwrap_or_default();
        let outcome = {
            // Its files lack a record until the end: the collector keeps off.
            let _writing = self.manager().writing_template(&id);
            let made = self
                .make_image_template(&reference, &mut record, &log)
                .await;
            drop(room);
            made
        };
        match &outcome {
            Ok(served) if *served != id => {
                tracing::info!(
                    "template {served}: named {name} too, the same image (found in {:.1} s)",
                    started.elapsed().as_secs_f64()
                );
                // No template of its own: neither is its build.
                self.discard_build(&id);
                self.made_ready(served).await;
            }
            Ok(_) => {
                tracing::info!(
                    "template {id} ({name}): converted in {:.1} s",
                    started.elapsed().as_secs_f64()
                );
                self.made_ready(&id).await;
                // The new template may take the disk above the high
                // watermark: the unused ones go now, not at the next
                // conversion.
                if let Err(e) = self.bound_image_disk().await {
                    tracing::warn!("images: bounding their disk: {e}");
                }
            }
            Err(e) => {
                // Nothing half-made: the next create of the image starts over.
                tracing::warn!("template {id}: {e}");
                self.discard_build(&id);
            }
        }
        self.running().remove(&id);
        self.flights().remove(&name);
        tx.send_replace(Some(outcome.map(|_| ())));
    }

    /// Removes build `id`'s record and its template's directory (a build
    /// that failed, or found its image a template already).
    fn discard_build(&self, id: &str) {
        if let Err(e) = self.manager().store().remove_build(id) {
            tracing::error!("template {id}: removing its build: {e}");
        }
        let _ = std::fs::remove_dir_all(self.manager().config().templates_dir().join(id));
    }

    /// Pulls, converts and boots the image into template `record`'s, and
    /// records the template with the build, ready; or, when a template of
    /// the same image (by manifest digest) is here, names that one by the
    /// record's name too. The id of the template that serves the image.
    async fn make_image_template(
        &self,
        reference: &Reference,
        record: &mut BuildRecord,
        log: &Arc<BuildLog>,
    ) -> Result<String, ImageError> {
        let manager = self.manager();
        let config = manager.config();
        let name = record.name.clone();
        let failed = |reason: String| ImageError::Failed {
            image: name.clone(),
            reason,
        };
        let agent = config
            .agent
            .clone()
            .ok_or_else(|| failed("no guest agent binary".into()))?;
        let credentials = Credentials::from_env(&reference.registry)
            .map_err(|e| ImageError::from_registry(&name, e))?;
        let opts = self.pull_options(credentials);
        let (built, digest, one) = self
            .pull_and_convert(agent, reference, &opts, log)
            .await
            .map_err(|e| match e {
                PullError::Pull(e) => ImageError::from_registry(&name, e),
                PullError::Convert(e) => failed(format!("converting: {e}")),
            })?;
        drop(one);
        // Another reference to this image converted at the same moment
        // boots it first; this one then names that template.
        let _booting = self.image_boots.lock(&digest).await;
        if let Some(id) = self
            .name_image_template(&digest, &name)
            .await
            .map_err(|e| failed(format!("naming the template of {digest}: {e}")))?
        {
            log.push(&format!("image {name} is {digest}, template {id}'s image"));
            return Ok(id);
        }
        log.push(&format!("booting image {name} ({digest})"));
        let spec = BootSpec::from_image(&built, record.vcpus, record.mem_mib);
        let push = |line: &str| log.push(line);
        let mut template = boot::build_on(manager, &record.template_id, &spec, &push)
            .await
            .map_err(|e| failed(format!("booting: {e}")))?;
        template.names = vec![name.clone()];
        template.image = Some(name.clone());
        template.image_digest = Some(digest.clone());
        log.push(&format!(
            "template ready in {:.1} s",
            now_ms().saturating_sub(record.started_at_ms) as f64 / 1000.0
        ));
        record.status = BuildStatus::Ready;
        record.finished_at_ms = Some(now_ms());
        record.log = log.lines_from(0);
        manager
            .store()
            .finish_build(&template, record)
            .map_err(|e| {
                let _ = std::fs::remove_dir_all(&template.dir);
                failed(format!("recording the template: {e}"))
            })?;
        Ok(template.id)
    }

    /// Names the ready template converted from the image of manifest
    /// `digest` by `name` too, if this node has one (made for this kernel,
    /// its files all here): its id.
    pub async fn name_image_template(
        &self,
        digest: &str,
        name: &str,
    ) -> Result<Option<String>, crate::node::store::StoreError> {
        // Not while the disk bound's pass may evict it.
        let _pass = self.image_disk_pass.lock().await;
        let manager = self.manager();
        let store = manager.store();
        let kernel = &manager.config().kernel;
        let found = store.templates()?.into_iter().find(|t| {
            t.image_digest.as_deref() == Some(digest)
                && !t.names.is_empty()
                && t.kernel == *kernel
                && t.files_whole()
        });
        let Some(template) = found else {
            return Ok(None);
        };
        add_name(store, template, name).map(Some)
    }

    /// Names image template `id` by `name` too: another reference to its
    /// image (a cluster's object store says so, having it under that
    /// reference). Nothing for a template not converted from an image.
    pub async fn name_image_template_by_id(
        &self,
        id: &str,
        name: &str,
    ) -> Result<(), crate::node::store::StoreError> {
        let _pass = self.image_disk_pass.lock().await;
        let store = self.manager().store();
        if let Some(template) = store.template(id)?
            && template.image.is_some()
        {
            add_name(store, template, name)?;
        }
        Ok(())
    }
}

/// `name` added to image template `template`'s names (when missing), its
/// use marked (a create of it follows): its id.
fn add_name(
    store: &crate::node::store::Store,
    mut template: crate::node::store::TemplateRecord,
    name: &str,
) -> Result<String, crate::node::store::StoreError> {
    if !template.names.iter().any(|n| n == name) {
        template.names.push(name.to_owned());
        store.put_template(&template)?;
    }
    crate::node::sandbox::cache_bound::mark_used(&template.snapshot);
    Ok(template.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_references_are_told_from_template_names() {
        let d = format!("sha256:{}", "a".repeat(64));
        for image in [
            "127.0.0.1:5000/repo:tag",
            "localhost/repo",
            "localhost:5000/a/b",
            "registry.example/team/repo:v1",
            "docker.io/library/python:3.12",
            &format!("repo@{d}"),
            &format!("reg.example:443/repo@{d}"),
        ] {
            assert!(is_image_reference(image), "{image}");
        }
        for template in [
            "base",
            "base:default",
            "code-interpreter-v1",
            "my-template:v2",
            "alias:0f8fad5b-d9cb-469f-a165-70867728950e",
            "team/alias",
            "team/alias:tag",
            "python:3.12",
            "abc123def456",
        ] {
            assert!(!is_image_reference(template), "{template}");
        }
    }

    #[test]
    fn the_registrys_answer_names_the_image_once() {
        let image = || "r.example/a:1".to_owned();
        let found = ImageError::NotFound {
            image: image(),
            answer: "r.example/a:1: not found in the registry (x)".into(),
        };
        assert_eq!(
            found.to_string(),
            "r.example/a:1: not found in the registry (x)"
        );
        let gone = ImageError::Registry {
            image: image(),
            answer: "connecting: refused".into(),
        };
        assert_eq!(gone.to_string(), "image r.example/a:1: connecting: refused");
    }

    #[test]
    fn the_metadata_key_names_an_image_when_the_node_has_one() {
        let md = |v: &str| BTreeMap::from([("image".to_owned(), v.to_owned())]);
        let key = Some("image");
        assert_eq!(
            image_of_create(None, &md("python:3.12"), key).unwrap(),
            Some("python:3.12".to_owned())
        );
        assert_eq!(
            image_of_create(Some("base"), &md(" a.io/x:1 "), key).unwrap(),
            Some("a.io/x:1".to_owned())
        );
        // without the key configured, metadata is only metadata
        assert_eq!(
            image_of_create(None, &md("python:3.12"), None).unwrap(),
            None
        );
        assert_eq!(image_of_create(Some("mine"), &md(""), key).unwrap(), None);
        assert_eq!(
            image_of_create(Some("localhost:1/x"), &BTreeMap::new(), None).unwrap(),
            Some("localhost:1/x".to_owned())
        );
        let e = image_of_create(Some("mine"), &md("python:3.12"), key).unwrap_err();
        assert!(matches!(e, SandboxError::Invalid(_)), "{e}");
        assert_eq!(
            image_of_create(Some("mine"), &BTreeMap::new(), key).unwrap(),
            None
        );
    }

    /// A template converted from the image of digest `D`, its files here: a
    /// second reference to `D` is given it, named by that reference too
    /// (once, however often asked); another digest, or a template of `D`
    /// whose files are gone, or one for another kernel, gives none.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_second_reference_to_an_image_names_its_template() {
        use crate::node::store::{Store, TemplateRecord};

        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("data");
        let config =
            crate::node::sandbox::tests::offline_config(&data, tmp.path().join("base.raw"));
        let store = Store::open(&tmp.path().join("s.redb")).unwrap();
        let digest = format!("sha256:{}", "d".repeat(64));
        let template = |id: &str, kernel: &str, with_files: bool| {
            let dir = data.join("templates").join(id);
            std::fs::create_dir_all(&dir).unwrap();
            let t = TemplateRecord {
                id: id.into(),
                snapshot: dir.join("vm.state"),
                mem: dir.join("vm.mem"),
                root_layer: dir.join("root.layer"),
                kernel: kernel.into(),
                names: vec![format!("r.example/{id}:1")],
                image: Some(format!("r.example/{id}:1")),
                image_digest: Some(digest.clone()),
                dir,
                ..Default::default()
            };
            if with_files {
                for f in [&t.snapshot, &t.mem, &t.root_layer] {
                    std::fs::write(f, b"x").unwrap();
                }
            }
            t
        };
        // Listed first, neither may serve: files gone, another kernel.
        store
            .put_template(&template("a-gone", "/nonexistent/vmlinux", false))
            .unwrap();
        store
            .put_template(&template("b-old-kernel", "/other/vmlinux", true))
            .unwrap();
        store
            .put_template(&template("c-ready", "/nonexistent/vmlinux", true))
            .unwrap();
        let manager = crate::node::sandbox::tests::with_store(config, store);
        let templates = Templates::new(manager.clone());

        for _ in 0..2 {
            let served = templates
                .name_image_template(&digest, "r.example/c-ready:2")
                .await
                .unwrap();
            assert_eq!(served.as_deref(), Some("c-ready"));
        }
        let t = manager.store().template("c-ready").unwrap().unwrap();
        assert_eq!(t.names, ["r.example/c-ready:1", "r.example/c-ready:2"]);
        assert_eq!(
            t.image_references(),
            ["r.example/c-ready:1", "r.example/c-ready:2"]
        );
        assert_eq!(
            manager.resolve_template("r.example/c-ready:2").unwrap().id,
            "c-ready"
        );
        let other = format!("sha256:{}", "e".repeat(64));
        assert_eq!(
            templates
                .name_image_template(&other, "r.example/x:1")
                .await
                .unwrap(),
            None
        );
        for id in ["a-gone", "b-old-kernel"] {
            let t = manager.store().template(id).unwrap().unwrap();
            assert_eq!(t.names.len(), 1, "{id}");
        }

        // By id, as a cluster's object store names a template taken in (or
        // here already) under another reference: an image's template gets
        // the name, once; any other template does not.
        for _ in 0..2 {
            templates
                .name_image_template_by_id("b-old-kernel", "r.example/b:2")
                .await
                .unwrap();
        }
        let t = manager.store().template("b-old-kernel").unwrap().unwrap();
        assert_eq!(t.names, ["r.example/b-old-kernel:1", "r.example/b:2"]);
        let plain = TemplateRecord {
            id: "d-plain".into(),
            names: vec!["mine".into()],
            ..Default::default()
        };
        manager.store().put_template(&plain).unwrap();
        templates
            .name_image_template_by_id("d-plain", "r.example/d:1")
            .await
            .unwrap();
        let t = manager.store().template("d-plain").unwrap().unwrap();
        assert_eq!(t.names, ["mine"]);
    }
}

//! `fromImage` bases of E2B builds: the image is pulled from its registry
//! (`template_build::registry`, blobs cached by digest under
//! `$SANDFORK_CACHE/images`), converted into a chain of disk layers stored
//! once per layer (`template_build::layer_store`, under
//! `$SANDFORK_CACHE/layers`), and booted into a template of its own,
//! `image-<key>` (the chain's key), which later builds of the same image and
//! agent reuse. The build's steps then run in a sandbox of it.

use std::sync::{Arc, OnceLock};

use template_build::registry::{self, Credentials, PullOptions, Reference, RegistryError};

use super::boot::{self, BootSpec};
use super::build::{BuildLog, Templates};
use super::e2b_build::ImagePull;

/// One image template made at a time (two builds of one image boot it once).
fn image_lock() -> &'static tokio::sync::Mutex<()> {
    static LOCK: OnceLock<tokio::sync::Mutex<()>> = OnceLock::new();
    LOCK.get_or_init(|| tokio::sync::Mutex::new(()))
}

/// Why an image did not become a root filesystem.
#[derive(Debug)]
pub(super) enum PullError {
    /// Its registry's answer (or no answer).
    Pull(RegistryError),
    /// Converting its layers.
    Convert(String),
}

impl Templates {
    /// How this node pulls images: its registry settings (from the
    /// environment, see [`PullOptions`]) and its bound on their size, with
    /// `credentials`.
    pub(super) fn pull_options(&self, credentials: Option<Credentials>) -> PullOptions {
        PullOptions {
            credentials,
            insecure: PullOptions::insecure_from_env(),
            loopback_via: PullOptions::loopback_via_from_env(),
            ca_file: PullOptions::ca_file_from_env(),
            max_bytes: self.manager().config().max_image_bytes,
        }
    }

    /// The manifest digest registry image `name` (a normalised reference)
    /// names now: its manifest is fetched (and cached with the node's
    /// blobs), no layer. With the node's own credentials for its registry.
    pub async fn image_digest(&self, name: &str) -> Result<String, RegistryError> {
        let reference = Reference::parse(name)?;
        let opts = self.pull_options(Credentials::from_env(&reference.registry)?);
        let store = template_build::images_in(&self.manager().config().build_cache_dir());
        let resolved = registry::resolve(&store, &reference, &opts, &mut |_| {}).await?;
        Ok(resolved.manifest_digest)
    }

    /// Pulls `reference` and converts it into a root filesystem (cached by
    /// its content), one conversion at a time on the node: the lock is
    /// returned held, for a caller that boots a template shared by images.
    pub(super) async fn pull_and_convert(
        &self,
        agent: std::path::PathBuf,
        reference: &Reference,
        opts: &PullOptions,
        log: &Arc<BuildLog>,
    ) -> Result<
        (
            template_build::Template,
            String,
            tokio::sync::MutexGuard<'static, ()>,
        ),
        PullError,
    > {
        let mut builder = template_build::Builder::new(agent);
        if let Some(dir) = &self.manager().config().build_cache {
            builder = builder.cache_dir(dir);
        }
        log.push(&format!("pulling {reference}"));
        let store = builder.images_dir();
        let pull_log = log.clone();
        let pulled = registry::pull(&store, reference, opts, &mut |line| pull_log.push(line))
            .await
            .map_err(PullError::Pull)?;
        let one = image_lock().lock().await;
        let manifest = pulled.manifest_digest.clone();
        let build_log = log.clone();
        // Stored once per layer: layers other images converted are reused.
        let built = tokio::task::spawn_blocking(move || {
            builder
                .build_layered(&store, &manifest, &mut |line| build_log.push(line))
                .map(|layered| layered.template)
        })
        .await
        .map_err(|e| PullError::Convert(format!("the image build task failed: {e}")))?
        .map_err(|e| PullError::Convert(e.to_string()))?;
        Ok((built, pulled.manifest_digest, one))
    }

    /// The id of the template of `pull`'s image, pulled, built and booted
    /// when missing. Errors are the user's to read (the build's reason).
    pub(super) async fn image_base(
        &self,
        pull: &ImagePull,
        log: &Arc<BuildLog>,
    ) -> Result<String, String> {
        let manager = self.manager();
        let config = manager.config();
        let agent = config
            .agent
            .clone()
            .ok_or("this node has no guest agent binary to build images with (SANDFORK_AGENT)")?;
        let reference = Reference::parse(&pull.image).map_err(|e| e.to_string())?;
        let opts = self.pull_options(pull.username.as_ref().map(|u| Credentials {
            username: u.clone(),
            password: pull.password.clone().unwrap_or_default(),
        }));
        let (built, manifest_digest, _one) = self
            .pull_and_convert(agent, &reference, &opts, log)
            .await
            .map_err(|e| match e {
                PullError::Pull(e) => format!("pulling {}: {e}", pull.image),
                PullError::Convert(e) => format!("converting {}: {e}", pull.image),
            })?;
        let id = format!("image-{}", built.key.get(..16).unwrap_or(&built.key));
        let db = manager.store();
        if let Some(t) = db.template(&id).map_err(|e| e.to_string())?
            && t.kernel == config.kernel
            && t.files_whole()
        {
            log.push(&format!("image template {id} ({manifest_digest}) cached"));
            return Ok(id);
        }
        // The image's own template is not the build's: claimed apart, or the
        // collector takes its scratch directory for an orphan mid-build.
        let _writing = manager.writing_template(&id);
        log.push(&format!("booting image template {id}"));
        let spec = BootSpec::from_image(&built, config.vcpus, config.mem_mib);
        let push = |line: &str| log.push(line);
        let mut template = boot::build_on(manager, &id, &spec, &push)
            .await
            .map_err(|e| format!("booting the image {}: {e}", pull.image))?;
        // A cache of the image, as a create's conversion is.
        template.image = Some(reference.to_string());
        db.put_template(&template).map_err(|e| {
            let _ = std::fs::remove_dir_all(&template.dir);
            format!("recording the image template: {e}")
        })?;
        Ok(id)
    }
}

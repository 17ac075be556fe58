//! Creates that name a registry image on a node of a cluster with an object
//! store: one conversion per image in the cluster, not one per node. A node
//! that lacks the image's template takes it in from the object store when
//! a node stored it there ([`super::templates`], found by the image);
//! otherwise it claims the conversion in etcd
//! ([`sandfork_cluster::images`]) and converts the image as a lone node
//! does, storing the template once it is ready and then giving the claim
//! back. A node that lacks the template under that reference asks the
//! image's registry for its manifest digest first: another tag of an image
//! the store has is that template, taken in the same way (found by the
//! digest). A node asked for an image another node is converting waits for that
//! template to be stored (up to `Config::builtin_wait`, then
//! [`SandboxError::Building`], as a create waiting on a conversion here)
//! and takes it in. Gateways place creates of an image on the nodes that
//! have its template, else on the node converting it
//! (`sandfork_cluster::keyspace::placement_order_for_image`), so this wait
//! is rare.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sandfork_cluster::ImageConversion;

use super::Node;
use super::durable::DurableError;
use crate::node::clock::now_ms;
use crate::node::events::Denial;
use crate::node::sandbox::SandboxError;
use crate::node::template::build::BUILTIN_RETRY_SECS;
use crate::node::template::{self, ImageStart, Templates};
use crate::node::tenants::Caller;

/// How often a node waiting for another node's conversion looks whether its
/// template is stored.
const POLL: Duration = Duration::from_millis(500);

impl Node {
    /// Before a create of `image` on this node: the name of its template,
    /// which this node has, took in from the object store, or converted
    /// (see the module's documentation). Without an object store, as on a
    /// lone node ([`Templates::ensure_image`]).
    pub async fn ensure_image(
        self: &Arc<Self>,
        templates: &Arc<Templates>,
        caller: &Caller,
        image: &str,
    ) -> Result<String, SandboxError> {
        let name = template::image_name(image)?;
        let Some(durable) = &self.durable else {
            return templates.ensure_image(&name).await;
        };
        if self.manager.resolve_template(&name).is_ok() || templates.converting_image(&name) {
            return templates.ensure_image(&name).await;
        }
        let asked = Instant::now();
        let wait = self.manager.config().builtin_wait;
        let mut told = false;
        let mut digest_asked = false;
        loop {
            let taking = |e: DurableError| {
                Denial::Unavailable(format!(
                    "image {name}: taking its template in from the object store: {e}"
                ))
            };
            let mut taken = durable
                .take_in_image(&self.manager, &name, |team| caller.owns(team))
                .await
                .map_err(taking)?
                .map(|t| (t, String::new()));
            if taken.is_none() && !digest_asked {
                // Another tag of an image the store has: only the registry
                // can say, and asking it for a manifest costs far less than
                // a conversion.
                digest_asked = true;
                if let Some(digest) = self.image_digest(templates, &name).await {
                    // Here under another reference: nothing to take in.
                    if let Some(id) = templates
                        .name_image_template(&digest, &name)
                        .await
                        .map_err(SandboxError::from)?
                    {
                        tracing::info!(
                            "template {id}: named {name} too, the same image ({digest}, here)"
                        );
                        self.publish_templates();
                        return templates.ensure_image(&name).await;
                    }
                    taken = durable
                        .take_in_image_digest(&self.manager, &digest, |team| caller.owns(team))
                        .await
                        .map_err(taking)?
                        .map(|t| (t, format!(" (image {digest})")));
                }
            }
            if let Some((t, by_digest)) = taken {
                // Here already under another reference to the same image
                // (a second tag), it is named by this one too.
                templates
                    .name_image_template_by_id(&t.id, &name)
                    .await
                    .map_err(SandboxError::from)?;
                tracing::info!(
                    "cluster: image {name}: template {}{by_digest} taken in from the object \
                     store, not pulled ({:.1} s after the create asked)",
                    t.id,
                    asked.elapsed().as_secs_f64()
                );
                self.publish_templates();
                return templates.ensure_image(&name).await;
            }
            let claimed = self.registration.claim_image(&name).await.map_err(|e| {
                Denial::ClusterState(format!("claiming the conversion of image {name}: {e}"))
            })?;
            match claimed {
                ImageConversion::Claimed => return self.convert_image(templates, &name).await,
                ImageConversion::Refused => {
                    return Err(Denial::ClusterState(format!(
                        "image {name}: this node's lease has run out: it converts nothing"
                    ))
                    .into());
                }
                ImageConversion::Converting(claim) => {
                    if !told {
                        told = true;
                        tracing::info!(
                            "cluster: image {name}: node {} converts it; waiting for its template",
                            claim.node_id
                        );
                    }
                    if asked.elapsed() >= wait {
                        return Err(SandboxError::Building {
                            name,
                            elapsed_secs: now_ms().saturating_sub(claim.started_at_ms) / 1000,
                            retry_after_secs: BUILTIN_RETRY_SECS,
                        });
                    }
                    tokio::time::sleep(POLL).await;
                }
            }
        }
    }

    /// The manifest digest image `name` names, from its registry; None
    /// when the registry does not answer it (the conversion that follows
    /// asks again, and tells the create why).
    async fn image_digest(&self, templates: &Templates, name: &str) -> Option<String> {
        match templates.image_digest(name).await {
            Ok(digest) => Some(digest),
            Err(e) => {
                tracing::info!("cluster: image {name}: its digest is unknown: {e}");
                None
            }
        }
    }

    /// Converts image `name`, whose claim this node holds, and waits for it
    /// as a create does. A conversion that fails gives the claim back at
    /// once; one that makes a template, once the template is stored
    /// ([`Node::store_template_in_background`]).
    async fn convert_image(
        self: &Arc<Self>,
        templates: &Arc<Templates>,
        name: &str,
    ) -> Result<String, SandboxError> {
        match templates.start_image(name).await {
            Ok(ImageStart::Ready(name)) => {
                self.release_image(&name).await;
                Ok(name)
            }
            Ok(ImageStart::Converting(conversion)) => {
                let node = self.clone();
                let watched = conversion.clone();
                tokio::spawn(async move {
                    if !matches!(watched.ended().await, Some(Ok(()))) {
                        node.release_image(&watched.name).await;
                    }
                });
                templates.wait_image(&conversion).await
            }
            Err(e) => {
                self.release_image(name).await;
                Err(e)
            }
        }
    }

    /// Gives back this node's claim on converting image `name` (if it
    /// fails, the claim goes with the node's lease).
    pub(super) async fn release_image(&self, name: &str) {
        if let Err(e) = self.registration.release_image(name).await {
            tracing::warn!("cluster: image {name}: giving back the claim on its conversion: {e}");
        }
    }
}

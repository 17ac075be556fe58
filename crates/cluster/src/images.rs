//! One conversion of a registry image per cluster: a node about to pull and
//! convert an image into a template claims it first (`images/{sha256}`,
//! [`ImageClaim`], under the node's lease, only if no node holds it), and
//! gives it back once the template is in the object store (or the
//! conversion failed). A node asked for an image another node claims waits
//! for that template instead of converting the image too; a claim whose
//! node dies goes with its lease. Gateways read the claims from their
//! watched copy ([`crate::View::image_claim`]) to place creates of an image
//! on the node converting it.

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};

use crate::keyspace::{self, ImageClaim};
use crate::{Cluster, ClusterError, Registration};

/// What a claim of an image's conversion found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageConversion {
    /// This node converts it (it holds the claim now, or held it already).
    Claimed,
    /// Another node converts it.
    Converting(ImageClaim),
    /// This node's lease no longer holds its record: it may claim nothing.
    Refused,
}

impl Registration {
    /// Claims the conversion of `image` (a normalised reference) for this
    /// node, unless a node holds it.
    pub async fn claim_image(&self, image: &str) -> Result<ImageConversion, ClusterError> {
        let claim = ImageClaim {
            image: image.to_owned(),
            node_id: self.node_id(),
            incarnation: self.incarnation(),
            started_at_ms: crate::membership::now_ms(),
        };
        let key = keyspace::image_key(image);
        let value = crate::encode(&key, &claim)?;
        let txn = Txn::new()
            .when([
                Compare::create_revision(key.clone(), CompareOp::Equal, 0),
                crate::node_holds(&claim.node_id, claim.incarnation),
            ])
            .and_then([TxnOp::put(
                key.clone(),
                value,
                Some(PutOptions::new().with_lease(claim.incarnation)),
            )])
            .or_else([TxnOp::get(key.clone(), None)]);
        let answer = crate::send(&mut self.cluster().client(), txn).await?;
        if answer.succeeded() {
            return Ok(ImageConversion::Claimed);
        }
        let held = match answer.op_responses().first() {
            Some(TxnOpResponse::Get(get)) => get.kvs().first().cloned(),
            _ => None,
        };
        Ok(match held {
            Some(kv) => {
                let held: ImageClaim = crate::decode(kv.key(), kv.value())?;
                if held.node_id == claim.node_id && held.incarnation == claim.incarnation {
                    ImageConversion::Claimed
                } else {
                    ImageConversion::Converting(held)
                }
            }
            // Absent, so the node's own compare failed.
            None => ImageConversion::Refused,
        })
    }

    /// Gives back this node's claim on `image` (false: it held none).
    pub async fn release_image(&self, image: &str) -> Result<bool, ClusterError> {
        let key = keyspace::image_key(image);
        let txn = Txn::new()
            .when([Compare::lease(
                key.clone(),
                CompareOp::Equal,
                self.incarnation(),
            )])
            .and_then([TxnOp::delete(key, None)]);
        crate::send_txn(&mut self.cluster().client(), txn).await
    }
}

impl Cluster {
    /// The claim on `image`'s conversion, if a node holds one.
    pub async fn image_claim(&self, image: &str) -> Result<Option<ImageClaim>, ClusterError> {
        let key = keyspace::image_key(image);
        let answer = crate::retried(|| {
            let (mut client, key) = (self.client(), key.clone());
            async move { client.get(key, None).await }
        })
        .await?;
        answer
            .kvs()
            .first()
            .map(|kv| crate::decode(kv.key(), kv.value()))
            .transpose()
    }
}

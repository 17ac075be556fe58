//! Changes run to their end when their client goes away.
//!
//! hyper drops a request's future when its client closes the connection. A
//! change dropped half-way leaves its work half-done: a fork's parent left
//! in its freeze's phase with its new disk layer unrecorded, a create's VMM
//! started but never recorded, a pause's snapshot written but not its state.
//! So each change (any method but `GET` and `HEAD` on the control plane; the
//! envd proxy's requests are the guest's business) runs in a task of its own
//! and the request's future only waits for it. A handler that made something
//! only its caller would learn of (a create's sandbox, a fork's children)
//! asks [`ClientGone`] before it answers and removes it: nobody would know
//! its id, and it would hold the node's capacity until its timeout.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::{FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::ApiError;
use crate::http::proxy::{self, Route};

/// Whether the client of this request closed its connection before the
/// answer. A request that was not detached never reads as gone.
#[derive(Clone, Debug, Default)]
pub struct ClientGone(Arc<AtomicBool>);

impl ClientGone {
    pub fn is_gone(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    /// The answer to a client that is gone (nobody reads it; the status is
    /// nginx's "client closed request", for the logs). What the request
    /// made was killed as its client asked (the cluster is told).
    pub fn answer(what: &str) -> ApiError {
        ApiError::new(
            StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            format!("the client closed the request before its answer; {what}"),
        )
    }
}

impl<S: Send + Sync> FromRequestParts<S> for ClientGone {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(parts
            .extensions
            .get::<ClientGone>()
            .cloned()
            .unwrap_or_default())
    }
}

/// Marks its [`ClientGone`] gone when dropped before [`Watch::answered`]:
/// hyper dropped the request's future.
struct Watch(Option<ClientGone>);

impl Watch {
    fn answered(mut self) {
        self.0 = None;
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(gone) = self.0.take() {
            gone.0.store(true, Ordering::Release);
        }
    }
}

/// The middleware (outermost: the node's telling the cluster of a change
/// is part of the change). A request for a sandbox (by its host name, or
/// a path only envd serves) is the proxy's and passes as it is.
pub async fn run_to_end(req: Request, next: Next) -> Response {
    let reads = matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
    let for_a_sandbox = matches!(
        proxy::route(req.headers(), req.uri()),
        Route::Sandbox { .. }
    ) || proxy::is_envd_path(req.uri().path());
    if reads || for_a_sandbox {
        return next.run(req).await;
    }
    detached(req, next).await
}

/// Runs `req` in a task of its own, with a [`ClientGone`] its handler can ask.
async fn detached(mut req: Request, next: Next) -> Response {
    let gone = ClientGone::default();
    req.extensions_mut().insert(gone.clone());
    let watch = Watch(Some(gone));
    let change = tokio::spawn(next.run(req));
    let response = match change.await {
        Ok(response) => response,
        Err(e) => {
            tracing::error!("a request's task failed: {e}");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the request failed").into_response()
        }
    };
    watch.answered();
    response
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::Router;
    use axum::routing::post;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::mpsc;

    use super::*;

    /// A server whose `POST /slow` sleeps, then reports whether its client
    /// was gone by then; with `detach`, run through [`detached`].
    async fn serve(detach: bool) -> (std::net::SocketAddr, mpsc::UnboundedReceiver<bool>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let router = Router::new().route(
            "/slow",
            post(move |gone: ClientGone| async move {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let _ = tx.send(gone.is_gone());
                "done"
            }),
        );
        let router = if detach {
            router.layer(axum::middleware::from_fn(detached))
        } else {
            router
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });
        (addr, rx)
    }

    async fn post_slow(addr: std::net::SocketAddr, wait_for_answer: bool) {
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
            .await
            .unwrap();
        if wait_for_answer {
            let mut buf = [0u8; 256];
            let n = conn.read(&mut buf).await.unwrap();
            assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        } else {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    #[tokio::test]
    async fn a_change_whose_client_went_away_runs_to_its_end_and_knows_it() {
        let (addr, mut done) = serve(true).await;
        post_slow(addr, false).await;
        let gone = tokio::time::timeout(Duration::from_secs(5), done.recv()).await;
        assert_eq!(gone.unwrap(), Some(true));
        post_slow(addr, true).await;
        assert_eq!(done.recv().await, Some(false));
    }

    /// What the middleware is for: without it hyper drops the handler.
    #[tokio::test]
    async fn without_it_a_change_whose_client_went_away_is_dropped_half_way() {
        let (addr, mut done) = serve(false).await;
        post_slow(addr, false).await;
        let ended = tokio::time::timeout(Duration::from_secs(2), done.recv()).await;
        assert!(matches!(ended, Err(_) | Ok(None)), "{ended:?}");
    }
}

//! The Firecracker-compatible HTTP API on a Unix socket.
//!
//! [`spawn_api_server`] binds the socket and serves it from a thread named `api` running
//! a current-thread tokio runtime. Each request body is parsed and validated there
//! (errors answer `400 {"fault_message": ...}` without involving the VMM), then turned
//! into a [`VmmAction`](vmm_api::VmmAction) and queued on the [`ApiRequestReceiver`] for
//! the controller thread, whose answer becomes the response (`204`, or `200` with JSON
//! for GETs). See [`channel`] for how the controller waits for requests.

mod channel;
mod request_body;
mod response;
mod routes;
mod socket;

#[cfg(test)]
mod tests;

use std::future::IntoFuture;
use std::io;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::oneshot;

pub use channel::{ApiRequest, ApiRequestReceiver, ApiRequestSender, api_channel};
pub use request_body::MAX_BODY_BYTES;
/// The routes without the socket, for serving in-process (the fuzz targets).
pub use routes::router;

/// How long shutdown lets requests in flight finish before dropping them.
const SHUTDOWN_GRACE: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum ApiServerError {
    #[error("API socket {} is in use by a running process", path.display())]
    InUse { path: PathBuf },
    #[error("{} exists and is not a socket; refusing to replace it", path.display())]
    NotASocket { path: PathBuf },
    #[error("API socket {}: {source}", path.display())]
    Socket { path: PathBuf, source: io::Error },
    #[error("cannot create the API request eventfd: {0}")]
    EventFd(io::Error),
    #[error("cannot create the API server runtime: {0}")]
    Runtime(io::Error),
    #[error("cannot spawn the API server thread: {0}")]
    Thread(io::Error),
    #[error("the API server failed: {0}")]
    Serve(io::Error),
    #[error("the API server thread panicked")]
    Panicked,
}

/// Starts the API server on `socket_path` and returns its handle and the receiving end
/// of its requests.
///
/// A socket file already at the path is replaced only when nothing accepts connections
/// on it (a leftover of a crashed VMM); a live socket or a non-socket file is an error.
pub fn spawn_api_server(
    socket_path: &Path,
) -> Result<(ApiServerHandle, ApiRequestReceiver), ApiServerError> {
    let (sender, receiver) = api_channel().map_err(ApiServerError::EventFd)?;
    let handle = spawn_api_server_with_sender(socket_path, sender)?;
    Ok((handle, receiver))
}

/// Like [`spawn_api_server`], feeding a channel the caller already has.
pub fn spawn_api_server_with_sender(
    socket_path: &Path,
    sender: ApiRequestSender,
) -> Result<ApiServerHandle, ApiServerError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(ApiServerError::Runtime)?;
    let bound = socket::bind(socket_path)?;
    let path = bound.path.clone();
    let file_id = bound.file_id();
    let (shutdown_tx, shutdown_rx) = oneshot::channel();
    let thread_path = path.clone();
    let thread = std::thread::Builder::new()
        .name("api".into())
        .spawn(move || {
            // The socket is bound and the runtime built: from here on the
            // thread only serves connections.
            crate::seccomp::apply_or_exit(crate::seccomp::ThreadKind::Api);
            let result = runtime.block_on(serve(bound, sender, shutdown_rx));
            socket::remove(&thread_path, file_id);
            result
        });
    let thread = match thread {
        Ok(t) => t,
        Err(e) => {
            socket::remove(&path, file_id);
            return Err(ApiServerError::Thread(e));
        }
    };
    Ok(ApiServerHandle {
        socket_path: path,
        shutdown: Some(shutdown_tx),
        thread: Some(thread),
    })
}

async fn serve(
    bound: socket::BoundSocket,
    sender: ApiRequestSender,
    shutdown: oneshot::Receiver<()>,
) -> io::Result<()> {
    let listener = tokio::net::UnixListener::from_std(bound.listener)?;
    let (graceful_tx, graceful_rx) = oneshot::channel::<()>();
    let server = axum::serve(listener, routes::router(sender)).with_graceful_shutdown(async {
        let _ = graceful_rx.await;
    });
    let server = server.into_future();
    tokio::pin!(server);
    tokio::select! {
        result = &mut server => return result,
        // A dropped handle counts as a shutdown request too.
        _ = shutdown => {}
    }
    let _ = graceful_tx.send(());
    match tokio::time::timeout(SHUTDOWN_GRACE, server).await {
        Ok(result) => result,
        Err(_) => {
            tracing::warn!("API requests still running after {SHUTDOWN_GRACE:?}; dropping them");
            Ok(())
        }
    }
}

/// Owns the server thread. [`shutdown`](Self::shutdown) (or drop) stops it, waits for
/// it and removes the socket file.
#[derive(Debug)]
pub struct ApiServerHandle {
    socket_path: PathBuf,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<io::Result<()>>>,
}

impl ApiServerHandle {
    pub fn socket_path(&self) -> &Path {
        &self.socket_path
    }

    /// Stops accepting, lets requests in flight finish for a short grace period, then
    /// removes the socket. Drop the [`ApiRequestReceiver`] first (or keep answering) so
    /// that requests waiting on the controller end at once.
    pub fn shutdown(mut self) -> Result<(), ApiServerError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), ApiServerError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match self.thread.take() {
            Some(thread) => thread
                .join()
                .map_err(|_| ApiServerError::Panicked)?
                .map_err(ApiServerError::Serve),
            None => Ok(()),
        }
    }
}

impl Drop for ApiServerHandle {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!("API server: {e}");
        }
    }
}

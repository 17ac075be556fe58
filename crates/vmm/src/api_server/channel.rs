//! The request channel from the API server thread to the VMM controller.
//!
//! A `std::sync::mpsc` queue plus an `EventFd`: the controller is a plain thread, so it
//! can block on [`ApiRequestReceiver::recv`], or put [`ApiRequestReceiver::event_fd`] in
//! its epoll set next to device and vCPU events. Every send bumps the event counter after
//! queueing, so "clear the event, then drain with `try_recv`" never misses a request.
//! Replies go back through a `tokio::sync::oneshot`, whose `send` is synchronous and
//! works from any thread.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::time::Duration;

use tokio::sync::oneshot;
use vmm_api::{VmmAction, VmmActionError, VmmData};
use vmm_sys_util::eventfd::EventFd;

/// One API call waiting for the controller's answer.
#[derive(Debug)]
pub struct ApiRequest {
    pub action: VmmAction,
    pub reply: oneshot::Sender<Result<VmmData, VmmActionError>>,
}

impl ApiRequest {
    /// Sends the answer back. An HTTP client that hung up meanwhile is not an error.
    pub fn respond(self, result: Result<VmmData, VmmActionError>) {
        let _ = self.reply.send(result);
    }
}

/// Creates a connected sender/receiver pair.
pub fn api_channel() -> io::Result<(ApiRequestSender, ApiRequestReceiver)> {
    let event = Arc::new(EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)?);
    let (tx, rx) = mpsc::channel();
    Ok((
        ApiRequestSender {
            route: Arc::new(Route::Channel {
                tx,
                event: event.clone(),
            }),
        },
        ApiRequestReceiver { rx, event },
    ))
}

/// The server's end; cloneable, so other producers (a config file loader, a signal
/// handler) can feed the same controller loop.
#[derive(Clone)]
pub struct ApiRequestSender {
    route: Arc<Route>,
}

enum Route {
    Channel {
        tx: mpsc::Sender<ApiRequest>,
        event: Arc<EventFd>,
    },
    Forward(Forward),
}

type ForwardFn = Box<dyn Fn(ApiRequest) + Send + Sync>;
type CloseFn = Box<dyn FnOnce() + Send + Sync>;

/// Hands requests straight to the caller's own queue, saving a thread hop;
/// tells it when the last sender is gone.
struct Forward {
    send: ForwardFn,
    on_close: std::sync::Mutex<Option<CloseFn>>,
}

impl Drop for Forward {
    fn drop(&mut self) {
        let close = self
            .on_close
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(close) = close {
            close();
        }
    }
}

impl std::fmt::Debug for ApiRequestSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match *self.route {
            Route::Channel { .. } => "channel",
            Route::Forward(_) => "forward",
        };
        f.debug_struct("ApiRequestSender")
            .field("route", &kind)
            .finish()
    }
}

impl ApiRequestSender {
    /// A sender that calls `send` for every request (on the API server's
    /// thread) and `on_close` once every clone is gone (the server stopped).
    /// A request `send` cannot deliver is dropped, and its client gets a 500.
    pub fn forwarding(
        send: impl Fn(ApiRequest) + Send + Sync + 'static,
        on_close: impl FnOnce() + Send + Sync + 'static,
    ) -> Self {
        ApiRequestSender {
            route: Arc::new(Route::Forward(Forward {
                send: Box::new(send),
                on_close: std::sync::Mutex::new(Some(Box::new(on_close))),
            })),
        }
    }

    /// Queues a request; gives it back if the receiver is gone.
    pub fn send(&self, request: ApiRequest) -> Result<(), Box<ApiRequest>> {
        match &*self.route {
            Route::Forward(forward) => {
                (forward.send)(request);
                Ok(())
            }
            Route::Channel { tx, event } => {
                tx.send(request).map_err(|e| Box::new(e.0))?;
                // Only fails if the counter would overflow u64, i.e. never in practice;
                // the request is queued either way and `recv` does not depend on it.
                if let Err(e) = event.write(1) {
                    tracing::warn!("cannot signal the API request event: {e}");
                }
                Ok(())
            }
        }
    }
}

/// The controller's end.
#[derive(Debug)]
pub struct ApiRequestReceiver {
    rx: mpsc::Receiver<ApiRequest>,
    event: Arc<EventFd>,
}

impl ApiRequestReceiver {
    /// Blocks for the next request; `None` once every sender (the server) is gone.
    pub fn recv(&self) -> Option<ApiRequest> {
        self.rx.recv().ok()
    }

    pub fn recv_timeout(&self, timeout: Duration) -> Result<ApiRequest, RecvTimeoutError> {
        self.rx.recv_timeout(timeout)
    }

    pub fn try_recv(&self) -> Result<ApiRequest, TryRecvError> {
        self.rx.try_recv()
    }

    /// Readable (EPOLLIN) when requests may be queued. After it fires, call
    /// [`clear_event`](Self::clear_event) and then `try_recv` until it is empty.
    pub fn event_fd(&self) -> &EventFd {
        &self.event
    }

    /// Resets the event counter; harmless when it is already zero.
    pub fn clear_event(&self) {
        // EAGAIN means the counter was zero; nothing else can fail on an eventfd read.
        let _ = self.event.read();
    }
}

impl AsRawFd for ApiRequestReceiver {
    fn as_raw_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(fd: RawFd) -> bool {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is a valid pollfd for the duration of the call and nfds is 1.
        let n = unsafe { libc::poll(&mut pfd, 1, 0) };
        n == 1 && pfd.revents & libc::POLLIN != 0
    }

    #[test]
    fn event_fd_signals_queued_requests() {
        let (tx, rx) = api_channel().unwrap();
        assert!(!readable(rx.as_raw_fd()));
        let (reply, answer) = oneshot::channel();
        tx.send(ApiRequest {
            action: VmmAction::Pause,
            reply,
        })
        .unwrap();
        assert!(readable(rx.as_raw_fd()));

        rx.clear_event();
        assert!(!readable(rx.as_raw_fd()));
        let req = rx.try_recv().unwrap();
        assert_eq!(req.action, VmmAction::Pause);
        assert!(matches!(rx.try_recv(), Err(TryRecvError::Empty)));
        rx.clear_event();

        req.respond(Ok(VmmData::Empty));
        assert_eq!(answer.blocking_recv().unwrap(), Ok(VmmData::Empty));
    }

    #[test]
    fn a_forwarding_sender_hands_requests_over_and_reports_its_end() {
        let (seen_tx, seen_rx) = mpsc::channel();
        let (closed_tx, closed_rx) = mpsc::channel();
        let tx = ApiRequestSender::forwarding(
            move |req: ApiRequest| seen_tx.send(req.action).unwrap(),
            move || closed_tx.send(()).unwrap(),
        );
        let clone = tx.clone();
        let (reply, _answer) = oneshot::channel();
        clone
            .send(ApiRequest {
                action: VmmAction::Pause,
                reply,
            })
            .unwrap();
        assert_eq!(seen_rx.try_recv().unwrap(), VmmAction::Pause);
        drop(tx);
        assert!(closed_rx.try_recv().is_err(), "a clone is still alive");
        drop(clone);
        closed_rx.try_recv().unwrap();
    }

    #[test]
    fn send_fails_when_receiver_dropped_and_recv_ends_when_sender_dropped() {
        let (tx, rx) = api_channel().unwrap();
        drop(rx);
        let (reply, _answer) = oneshot::channel();
        let back = tx
            .send(ApiRequest {
                action: VmmAction::Resume,
                reply,
            })
            .unwrap_err();
        assert_eq!(back.action, VmmAction::Resume);

        let (tx, rx) = api_channel().unwrap();
        drop(tx);
        assert!(rx.recv().is_none());
    }
}

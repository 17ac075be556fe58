//! Fan-out of a process's output to every attached stream.
//!
//! Policy (bounded memory, the process never blocked for long by a client):
//! each attached stream has a queue of `QUEUE_CHUNKS` chunks (at most
//! `CHUNK` bytes each). A full queue applies backpressure: the reader stops
//! reading the process's pipe (and so the process blocks on write) for up to
//! `SLOW_CLIENT_WAIT`. A stream that stays full that long is marked lagging and
//! from then on gets chunks only when its queue has room; what does not fit is
//! dropped and logged. Output produced while no stream is attached is
//! dropped (envd behaves the same: a later Connect sees only new output).

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc::{self, error::SendTimeoutError, error::TrySendError};

/// Largest chunk read from a process at once.
pub const CHUNK: usize = 32 * 1024;
/// Chunks queued per attached stream (so at most 1 MiB).
pub const QUEUE_CHUNKS: usize = 32;
/// How long a full stream may hold the process back.
pub const SLOW_CLIENT_WAIT: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    Stdout(Bytes),
    Stderr(Bytes),
    Pty(Bytes),
}

#[derive(Default)]
struct SubState {
    lagging: AtomicBool,
    dropped: AtomicU64,
}

struct Sub {
    tx: mpsc::Sender<Chunk>,
    state: Arc<SubState>,
}

pub struct Fanout {
    pid: u32,
    subs: Mutex<Vec<Sub>>,
    slow_client_wait: Duration,
}

impl Fanout {
    pub fn new(pid: u32) -> Self {
        Self::with_slow_client_wait(pid, SLOW_CLIENT_WAIT)
    }

    /// Tests wait less than the real policy's two seconds (tokio's paused
    /// clock would need its `test-util` feature, which a dev-dependency
    /// turns on for the whole workspace's test build, so `cargo test` would
    /// link the node's and VMM's binaries anew over `cargo build`'s).
    fn with_slow_client_wait(pid: u32, slow_client_wait: Duration) -> Self {
        Self {
            pid,
            subs: Mutex::new(Vec::new()),
            slow_client_wait,
        }
    }

    /// Attaches a stream; it gets output from now on.
    pub fn subscribe(&self) -> mpsc::Receiver<Chunk> {
        let (tx, rx) = mpsc::channel(QUEUE_CHUNKS);
        self.lock().push(Sub {
            tx,
            state: Arc::default(),
        });
        rx
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Sub>> {
        self.subs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Number of attached streams (closed ones pruned).
    #[cfg(test)]
    pub fn attached(&self) -> usize {
        let mut subs = self.lock();
        subs.retain(|s| !s.tx.is_closed());
        subs.len()
    }

    /// Detaches every stream: their receivers see the end of output.
    pub fn close(&self) {
        self.lock().clear();
    }

    /// Delivers one chunk to every attached stream, per the policy above.
    pub async fn publish(&self, chunk: Chunk) {
        let targets: Vec<(mpsc::Sender<Chunk>, Arc<SubState>)> = {
            let mut subs = self.lock();
            subs.retain(|s| !s.tx.is_closed());
            subs.iter()
                .map(|s| (s.tx.clone(), s.state.clone()))
                .collect()
        };
        for (tx, state) in targets {
            if state.lagging.load(Ordering::Relaxed) {
                match tx.try_send(chunk.clone()) {
                    Ok(()) => {
                        let lost = state.dropped.swap(0, Ordering::Relaxed);
                        state.lagging.store(false, Ordering::Relaxed);
                        log::warn!(
                            "process {}: slow stream caught up; {lost} chunks dropped",
                            self.pid
                        );
                    }
                    Err(TrySendError::Full(_)) => {
                        state.dropped.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(TrySendError::Closed(_)) => {}
                }
                continue;
            }
            match tx.send_timeout(chunk.clone(), self.slow_client_wait).await {
                Ok(()) | Err(SendTimeoutError::Closed(_)) => {}
                Err(SendTimeoutError::Timeout(_)) => {
                    log::warn!(
                        "process {}: a stream has not read output for {:?}; dropping its output until it catches up",
                        self.pid,
                        self.slow_client_wait
                    );
                    state.lagging.store(true, Ordering::Relaxed);
                    state.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(s: &str) -> Chunk {
        Chunk::Stdout(Bytes::copy_from_slice(s.as_bytes()))
    }

    #[tokio::test]
    async fn every_stream_gets_each_chunk_and_unattached_output_is_dropped() {
        let f = Fanout::new(1);
        f.publish(out("lost")).await;
        let mut a = f.subscribe();
        let mut b = f.subscribe();
        f.publish(out("x")).await;
        assert_eq!(a.recv().await, Some(out("x")));
        assert_eq!(b.recv().await, Some(out("x")));
        drop(b);
        assert_eq!(f.attached(), 1);
        f.close();
        assert_eq!(a.recv().await, None);
    }

    #[tokio::test]
    async fn a_stuck_stream_is_waited_for_then_skipped() {
        let wait = Duration::from_secs(1);
        let f = Fanout::with_slow_client_wait(1, wait);
        let mut stuck = f.subscribe();
        for i in 0..QUEUE_CHUNKS {
            f.publish(out(&i.to_string())).await;
        }
        // Full: the next publish waits, then drops.
        let t = tokio::time::Instant::now();
        f.publish(out("dropped")).await;
        assert!(t.elapsed() >= wait);
        // Lagging now: no more waiting.
        let t = tokio::time::Instant::now();
        f.publish(out("dropped too")).await;
        assert!(t.elapsed() < wait / 2);
        // Draining lets it catch up: the next chunk is delivered.
        for i in 0..QUEUE_CHUNKS {
            assert_eq!(stuck.recv().await, Some(out(&i.to_string())));
        }
        f.publish(out("back")).await;
        assert_eq!(stuck.recv().await, Some(out("back")));
    }
}

//! A warm pool of started `sandfork-vmm` processes waiting on their API
//! socket, so a create only pays for the snapshot load, not the process start.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use vmm_api::process::{ProcessError, VmmProcess};

pub struct Pool {
    binary: PathBuf,
    size: usize,
    idle: Mutex<Vec<VmmProcess>>,
    wake: Notify,
}

impl Pool {
    /// Creates the pool and starts filling it in the background.
    pub fn start(binary: PathBuf, size: usize) -> Arc<Pool> {
        let pool = Arc::new(Pool {
            binary,
            size,
            idle: Mutex::new(Vec::new()),
            wake: Notify::new(),
        });
        if size > 0 {
            tokio::spawn(pool.clone().refill());
        }
        pool
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<VmmProcess>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn idle_count(&self) -> usize {
        self.idle().len()
    }

    /// A started VMM with nothing loaded: from the pool, or started now when
    /// the pool is empty.
    pub async fn take(&self) -> Result<VmmProcess, ProcessError> {
        let pooled = self.idle().pop();
        self.wake.notify_one();
        match pooled {
            Some(vm) => Ok(vm),
            None => VmmProcess::spawn(&self.binary).await,
        }
    }

    async fn refill(self: Arc<Self>) {
        loop {
            while self.idle().len() < self.size {
                match VmmProcess::spawn(&self.binary).await {
                    Ok(vm) => self.idle().push(vm),
                    Err(e) => {
                        tracing::warn!("warm pool: starting a VMM: {e}");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
            self.wake.notified().await;
        }
    }
}

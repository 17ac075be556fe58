//! A warm pool of started `sandfork-vmm` processes waiting on their API
//! socket, so a create only pays for the snapshot load, not the process start.
//! Every VMM gets its own directory under the node's run dir, where a later
//! server can find (and adopt or stop) it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use vmm_driver::process::{ProcessError, VmmProcess};

pub struct Pool {
    binary: PathBuf,
    run_dir: PathBuf,
    size: usize,
    idle: Mutex<Vec<VmmProcess>>,
    wake: Notify,
    closed: AtomicBool,
}

impl Pool {
    /// Creates the pool and starts filling it in the background.
    pub fn start(binary: PathBuf, run_dir: PathBuf, size: usize) -> Arc<Pool> {
        let pool = Arc::new(Pool {
            binary,
            run_dir,
            size,
            idle: Mutex::new(Vec::new()),
            wake: Notify::new(),
            closed: AtomicBool::new(false),
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
        loop {
            let pooled = self.idle().pop();
            self.wake.notify_one();
            let Some(mut vm) = pooled else {
                return self.spawn().await;
            };
            if vm.is_running() {
                return Ok(vm);
            }
            // Dropping it removes its directory.
            tracing::warn!("warm pool: VMM pid {} had exited; dropped", vm.pid());
        }
    }

    async fn spawn(&self) -> Result<VmmProcess, ProcessError> {
        let name = crate::ids::random_bytes(8).map_err(|source| ProcessError::Io {
            what: "naming a VMM directory",
            source,
        })?;
        std::fs::create_dir_all(&self.run_dir).map_err(|source| ProcessError::Io {
            what: "creating the run directory",
            source,
        })?;
        let dir = self.run_dir.join(format!("vmm-{}", crate::ids::hex(&name)));
        VmmProcess::spawn_in(&self.binary, dir).await
    }

    /// Stops the idle VMMs and refilling (at shutdown).
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.wake.notify_one();
        self.idle().clear();
    }

    async fn refill(self: Arc<Self>) {
        while !self.closed.load(Ordering::SeqCst) {
            while self.idle().len() < self.size && !self.closed.load(Ordering::SeqCst) {
                match self.spawn().await {
                    // Closed meanwhile: dropping it stops it.
                    Ok(vm) if self.closed.load(Ordering::SeqCst) => drop(vm),
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

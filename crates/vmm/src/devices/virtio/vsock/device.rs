//! The virtio-vsock device model: configuration space, features, and the worker's
//! lifecycle.

use std::io;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_VSOCK;
use virtio_queue::QueueState;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::muxer::Muxer;
use super::worker::Worker;
use crate::devices::virtio::persist::SavedDevice;
use crate::devices::virtio::worker::{StopSignal, WorkerThread};
use crate::devices::virtio::{
    ActivateError, ActivatedQueue, VirtioDevice, VirtioInterrupt, read_config_space,
};
use crate::vstate::memory::GuestMemory;

/// rx, tx and event queues.
const QUEUE_SIZES: &[u16] = &[256, 256, 256];

/// How long a host-initiated connection waits for the guest's answer, and a host
/// stream for its `CONNECT` line.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error("guest CID {0} is reserved or out of range (valid: 3 to 4294967294)")]
    InvalidCid(u64),
    #[error("cannot bind the vsock socket {}: {source}", path.display())]
    Bind {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("vsock setup failed: {0}")]
    Setup(#[source] io::Error),
}

/// A virtio-vsock device whose host side is a Unix socket, as in Firecracker:
///
/// - a host process connects to `uds_path`, writes `CONNECT <port>\n`, reads
///   `OK <host_port>\n` once the guest accepts, then talks to guest port `port`;
/// - a guest connection to CID 2 port `P` is relayed to a listener at `<uds_path>_P`.
#[derive(Debug)]
pub struct Vsock {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    acked_features: u64,
    connect_timeout: Duration,
    reset_evt: EventFd,
    reset_requested: Arc<AtomicBool>,
    /// Parked with its connections while paused for a snapshot.
    worker: Option<WorkerThread<Worker>>,
}

impl Vsock {
    /// Binds the host socket at `uds_path`; fails if the path exists.
    pub fn new(guest_cid: u64, uds_path: PathBuf) -> Result<Self, VsockError> {
        // CIDs 0-2 are reserved, u32::MAX is VMADDR_CID_ANY, and drivers use 32 bits.
        if !(3..u64::from(u32::MAX)).contains(&guest_cid) {
            return Err(VsockError::InvalidCid(guest_cid));
        }
        let listener = UnixListener::bind(&uds_path).map_err(|source| VsockError::Bind {
            path: uds_path.clone(),
            source,
        })?;
        let setup = || -> io::Result<(EventFd,)> {
            listener.set_nonblocking(true)?;
            Ok((EventFd::new(EFD_NONBLOCK)?,))
        };
        let (reset_evt,) = match setup() {
            Ok(v) => v,
            Err(e) => {
                let _ = std::fs::remove_file(&uds_path);
                return Err(VsockError::Setup(e));
            }
        };
        Ok(Self {
            guest_cid,
            uds_path,
            listener,
            acked_features: 0,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            reset_evt,
            reset_requested: Arc::new(AtomicBool::new(false)),
            worker: None,
        })
    }

    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    pub fn uds_path(&self) -> &Path {
        &self.uds_path
    }

    /// Changes how long host handshakes and guest answers may take (takes effect at the
    /// next activation).
    pub fn set_connect_timeout(&mut self, timeout: Duration) {
        self.connect_timeout = timeout;
    }

    /// Queues `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET` on the event queue and drops every
    /// connection (host streams see EOF); host streams still in their handshake survive.
    ///
    /// Call it after restoring a snapshot, once the device is activated with its restored
    /// queues: the guest driver then resets all its sockets and re-reads the CID, and
    /// guest services listen again. If the device is not active, the reset happens when
    /// it next activates. Safe to call from any thread.
    pub fn send_transport_reset(&self) {
        self.reset_requested.store(true, Ordering::SeqCst);
        if let Err(e) = self.reset_evt.write(1) {
            tracing::warn!("vsock: cannot signal a transport reset: {e}");
        }
    }

    fn stop_worker(&mut self) {
        if let Some(w) = self.worker.take() {
            w.stop();
        }
    }

    fn start_worker(
        &mut self,
        mem: GuestMemory,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: [ActivatedQueue; 3],
    ) -> io::Result<WorkerThread<Worker>> {
        let stop = StopSignal::new()?;
        // The worker gets its own descriptor for the listener; the device keeps one so
        // the socket outlives resets.
        let muxer = Muxer::new(
            self.guest_cid,
            self.uds_path.clone(),
            self.listener.try_clone()?,
            self.connect_timeout,
        )?;
        let worker = Worker::new(
            mem,
            interrupt,
            queues,
            &stop,
            self.reset_evt.try_clone()?,
            self.reset_requested.clone(),
            muxer,
        )?;
        WorkerThread::spawn("vsock".into(), stop, worker)
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        QUEUE_SIZES
    }

    fn avail_features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
    }

    fn set_acked_features(&mut self, acked: u64) {
        self.acked_features = acked & self.avail_features();
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_space(&self.guest_cid.to_le_bytes(), offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActivatedQueue>,
    ) -> Result<(), ActivateError> {
        if self.worker.as_ref().is_some_and(WorkerThread::is_alive) {
            return Err(ActivateError::Other(
                "the vsock device is already active".into(),
            ));
        }
        let queues: [ActivatedQueue; 3] =
            queues
                .try_into()
                .map_err(|q: Vec<_>| ActivateError::QueueCount {
                    expected: QUEUE_SIZES.len(),
                    got: q.len(),
                })?;
        let handle = self
            .start_worker(mem, interrupt, queues)
            .map_err(ActivateError::Worker)?;
        self.worker = Some(handle);
        Ok(())
    }

    fn reset(&mut self) -> bool {
        self.stop_worker();
        self.acked_features = 0;
        true
    }

    fn acked_features(&self) -> u64 {
        self.acked_features
    }

    fn queue_states(&self) -> Vec<QueueState> {
        self.worker
            .as_ref()
            .and_then(WorkerThread::parked)
            .map(Worker::queue_states)
            .unwrap_or_default()
    }

    fn snapshot(&self) -> Option<SavedDevice> {
        Some(SavedDevice::Vsock(Vsock::save(self)))
    }

    /// The host sides of the guest's connections did not survive the restore:
    /// the guest must drop its sockets (its listeners stay).
    fn on_restored(&self) {
        self.send_transport_reset();
    }

    fn pause(&mut self) {
        if let Some(worker) = &mut self.worker {
            worker.park();
        }
    }

    fn resume(&mut self) -> Result<(), ActivateError> {
        if let Some(worker) = &mut self.worker {
            worker.unpark().map_err(ActivateError::Worker)?;
        }
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for Vsock {
    fn drop(&mut self) {
        self.stop_worker();
        let _ = std::fs::remove_file(&self.uds_path);
    }
}

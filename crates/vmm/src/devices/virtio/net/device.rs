//! The virtio-net device model: features, configuration space (the MAC), and the
//! worker's lifecycle (activation, pause for snapshots, reset).

use std::sync::Arc;

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6,
    VIRTIO_NET_F_GUEST_UFO, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6, VIRTIO_NET_F_HOST_UFO,
    VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF,
};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{QueueState, QueueT};

use super::backend::FrameBackend;
use super::metrics::NetCounters;
use super::tap::{Tap, TapError, offloads_for};
use super::worker::Worker;
use crate::devices::virtio::persist::SavedDevice;
use crate::devices::virtio::worker::{StopSignal, WorkerThread};
use crate::devices::virtio::{
    ActivateError, ActivatedQueue, VirtioDevice, VirtioInterrupt, read_config_space,
};
use crate::vstate::memory::GuestMemory;

/// Receive and transmit queues.
pub const QUEUE_SIZE: u16 = 256;
const QUEUE_SIZES: [u16; 2] = [QUEUE_SIZE, QUEUE_SIZE];

/// What every interface offers, as Firecracker does: checksum and segmentation
/// offload both ways (a tap passes the virtio-net header through, so the host
/// kernel does the work, or none when the frame stays virtual end to end),
/// mergeable receive buffers and event-index notification suppression.
pub const OFFERED_FEATURES: u64 = (1 << VIRTIO_F_VERSION_1)
    | (1 << VIRTIO_NET_F_CSUM)
    | (1 << VIRTIO_NET_F_GUEST_CSUM)
    | (1 << VIRTIO_NET_F_GUEST_TSO4)
    | (1 << VIRTIO_NET_F_GUEST_TSO6)
    | (1 << VIRTIO_NET_F_GUEST_UFO)
    | (1 << VIRTIO_NET_F_HOST_TSO4)
    | (1 << VIRTIO_NET_F_HOST_TSO6)
    | (1 << VIRTIO_NET_F_HOST_UFO)
    | (1 << VIRTIO_NET_F_MRG_RXBUF)
    | (1 << VIRTIO_RING_F_EVENT_IDX);

/// An Ethernet address.
pub type MacAddr = [u8; 6];

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("network interface {iface_id}: {source}")]
    Tap {
        iface_id: String,
        #[source]
        source: TapError,
    },
}

/// What a network interface is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetConfig {
    /// The interface's name in the API; also its worker thread's name.
    pub iface_id: String,
    /// The host tap it is attached to.
    pub host_dev_name: String,
    /// Offered to the guest with `VIRTIO_NET_F_MAC`; without it the guest picks one.
    pub guest_mac: Option<MacAddr>,
}

/// A virtio-net device with one queue pair and a frame backend (a tap in a VM).
pub struct Net {
    config: NetConfig,
    /// Owned here until activation, and again after a reset.
    backend: Option<Box<dyn FrameBackend>>,
    avail_features: u64,
    acked_features: u64,
    counters: Arc<NetCounters>,
    worker: Option<WorkerThread<Worker>>,
}

impl std::fmt::Debug for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Net")
            .field("config", &self.config)
            .field("avail_features", &self.avail_features)
            .field("acked_features", &self.acked_features)
            .field("counters", &self.counters)
            .field("worker", &self.worker)
            .finish_non_exhaustive()
    }
}

impl Net {
    /// Opens the tap `config.host_dev_name` and builds the device on it.
    pub fn new(config: NetConfig) -> Result<Net, NetError> {
        let tap = Tap::open(&config.host_dev_name).map_err(|source| NetError::Tap {
            iface_id: config.iface_id.clone(),
            source,
        })?;
        Ok(Self::with_backend(config, Box::new(tap)))
    }

    /// Builds the device on any frame backend (a socket in tests).
    pub fn with_backend(config: NetConfig, backend: Box<dyn FrameBackend>) -> Net {
        let mut avail_features = OFFERED_FEATURES;
        if config.guest_mac.is_some() {
            avail_features |= 1 << VIRTIO_NET_F_MAC;
        }
        Net {
            config,
            backend: Some(backend),
            avail_features,
            acked_features: 0,
            counters: Arc::new(NetCounters::default()),
            worker: None,
        }
    }

    pub fn config(&self) -> &NetConfig {
        &self.config
    }

    pub fn counters(&self) -> Arc<NetCounters> {
        self.counters.clone()
    }

    pub fn is_activated(&self) -> bool {
        self.worker.as_ref().is_some_and(WorkerThread::is_alive)
    }

    fn worker_name(&self) -> String {
        format!("net-{}", self.config.iface_id)
    }

    /// Stops the worker and takes the backend back from it.
    fn stop_worker(&mut self) {
        if let Some(worker) = self.worker.take().and_then(WorkerThread::stop) {
            self.backend = Some(worker.into_backend());
        }
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn avail_features(&self) -> u64 {
        self.avail_features
    }

    fn set_acked_features(&mut self, acked: u64) {
        self.acked_features = acked & self.avail_features;
    }

    /// `struct virtio_net_config` up to the MAC; `status` and later fields belong to
    /// features not offered and read as 0.
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_space(&self.config.guest_mac.unwrap_or_default(), offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActivatedQueue>,
    ) -> Result<(), ActivateError> {
        if self.is_activated() {
            return Err(ActivateError::Other(format!(
                "network interface {} is already active",
                self.config.iface_id
            )));
        }
        let [mut rx, mut tx]: [ActivatedQueue; 2] =
            queues
                .try_into()
                .map_err(|q: Vec<_>| ActivateError::QueueCount {
                    expected: QUEUE_SIZES.len(),
                    got: q.len(),
                })?;
        if !rx.queue.is_valid(&mem) || !tx.queue.is_valid(&mem) {
            return Err(ActivateError::Other(format!(
                "network interface {}: a queue does not fit in guest memory",
                self.config.iface_id
            )));
        }
        let acked = self.acked_features;
        let event_idx = acked & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        rx.queue.set_event_idx(event_idx);
        tx.queue.set_event_idx(event_idx);
        let mut backend = self.backend.take().ok_or_else(|| {
            ActivateError::Other(format!(
                "network interface {} has lost its backend",
                self.config.iface_id
            ))
        })?;
        // On every activation, the first boot's and a restore's alike: a restored
        // VM has a freshly opened tap that knows nothing of the driver.
        if let Err(e) = backend.set_offloads(offloads_for(acked)) {
            self.backend = Some(backend);
            return Err(ActivateError::Other(format!(
                "network interface {}: cannot set the tap's offloads (TUNSETOFFLOAD): {e}",
                self.config.iface_id
            )));
        }
        let stop = StopSignal::new().map_err(ActivateError::Worker)?;
        let worker = Worker::new(
            mem,
            interrupt,
            [rx, tx],
            backend,
            acked & (1 << VIRTIO_NET_F_MRG_RXBUF) != 0,
            self.counters.clone(),
            &stop,
        )
        .map_err(ActivateError::Worker)?;
        let thread =
            WorkerThread::spawn(self.worker_name(), stop, worker).map_err(ActivateError::Worker)?;
        self.worker = Some(thread);
        Ok(())
    }

    fn reset(&mut self) -> bool {
        self.stop_worker();
        self.acked_features = 0;
        // A driver that comes back may accept less: no offloaded frames until then.
        if let Some(backend) = &mut self.backend
            && let Err(e) = backend.set_offloads(0)
        {
            crate::warn_limited!("net: clearing the tap's offloads on reset: {e}");
        }
        // The backend survives only if the worker handed it back.
        self.backend.is_some()
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
        Some(SavedDevice::Net(Net::save(self)))
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

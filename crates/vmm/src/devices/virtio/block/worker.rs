//! The thread that services a virtio-blk request queue: an epoll loop over the
//! queue's notify EventFd and the stop signal, doing the I/O synchronously.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, MutexGuard};

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP,
};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::disk::{Disk, SECTOR_SIZE};
use super::request::{self, Request, RequestType};
use crate::devices::virtio::worker::{DeviceWorker, StopSignal};
use crate::devices::virtio::{VirtioInterrupt, VirtioInterruptType, avail_ring_in_reach};
use crate::vstate::memory::GuestMemory;

const QUEUE_TOKEN: u64 = 0;
const STOP_TOKEN: u64 = 1;

/// The drive ID answered to GET_ID: the first 20 bytes of the id, NUL-padded.
pub type DriveId = [u8; VIRTIO_BLK_ID_BYTES as usize];

/// Everything the worker thread owns.
pub struct Worker {
    pub disk: Arc<Disk>,
    pub drive_id: DriveId,
    pub mem: GuestMemory,
    pub queue: Arc<Mutex<Queue>>,
    pub notify: EventFd,
    pub interrupt: Arc<dyn VirtioInterrupt>,
    /// The queue's notifications and the stop signal.
    epoll: Epoll,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("disk", &self.disk)
            .field("drive_id", &self.drive_id)
            .field("mem", &self.mem)
            .field("queue", &self.queue)
            .field("notify", &self.notify)
            .field("epoll", &self.epoll)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// A worker for `queue`, woken by `notify` and by `stop`.
    pub fn new(
        disk: Arc<Disk>,
        drive_id: DriveId,
        mem: GuestMemory,
        queue: Arc<Mutex<Queue>>,
        notify: EventFd,
        interrupt: Arc<dyn VirtioInterrupt>,
        stop: &StopSignal,
    ) -> io::Result<Worker> {
        let epoll = Epoll::new()?;
        epoll.ctl(
            ControlOperation::Add,
            notify.as_raw_fd(),
            EpollEvent::new(EventSet::IN, QUEUE_TOKEN),
        )?;
        epoll.ctl(
            ControlOperation::Add,
            stop.as_raw_fd(),
            EpollEvent::new(EventSet::IN, STOP_TOKEN),
        )?;
        Ok(Worker {
            disk,
            drive_id,
            mem,
            queue,
            notify,
            interrupt,
            epoll,
        })
    }
}

impl DeviceWorker for Worker {
    /// Any request it is doing completes before it stops; requests not yet
    /// started stay in the queue.
    fn run(self, stop: &StopSignal) -> Self {
        let mut events = [EpollEvent::default(); 2];
        // The driver may have queued requests before DRIVER_OK without a kick.
        self.process_queue(stop);
        while !stop.requested() {
            let n = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("block worker epoll failed, stopping: {e}");
                    return self;
                }
            };
            for event in &events[..n] {
                match event.data() {
                    QUEUE_TOKEN => {
                        // Clears the counter; WouldBlock just means a spurious wake-up.
                        let _ = self.notify.read();
                        self.process_queue(stop);
                    }
                    _ => return self,
                }
            }
        }
        self
    }
}

impl Worker {
    fn lock_queue(&self) -> MutexGuard<'_, Queue> {
        // A poisoned lock only means another holder panicked; the queue state is
        // plain data and still consistent between requests.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Completes every available request, then raises the interrupt if the driver
    /// wants one.
    pub fn process_queue(&self, stop: &StopSignal) {
        let mut queue = self.lock_queue();
        let mut used_any = false;
        loop {
            if queue.event_idx_enabled()
                && let Err(e) = queue.disable_notification(&self.mem)
            {
                crate::warn_limited!("block queue: {e}");
                break;
            }
            while let Some(chain) = queue.pop_descriptor_chain(&self.mem) {
                let head = chain.head_index();
                let written = self.handle(request::parse(chain));
                if let Err(e) = queue.add_used(&self.mem, head, written) {
                    crate::warn_limited!("block queue: cannot return descriptor {head}: {e}");
                }
                used_any = true;
                if stop.requested() {
                    break;
                }
            }
            if !queue.event_idx_enabled() || stop.requested() {
                break;
            }
            // Re-enabling reports whether requests arrived meanwhile.
            match queue.enable_notification(&self.mem) {
                Ok(true) if avail_ring_in_reach(&mut queue, &self.mem, "block queue") => continue,
                Ok(_) => break,
                Err(e) => {
                    crate::warn_limited!("block queue: {e}");
                    break;
                }
            }
        }
        if !used_any {
            return;
        }
        match queue.needs_notification(&self.mem) {
            Ok(false) => {}
            Ok(true) | Err(_) => {
                // When in doubt, interrupt: a spurious one is harmless, a lost one hangs I/O.
                if let Err(e) = self.interrupt.trigger(VirtioInterruptType::Queue) {
                    crate::error_limited!("block queue: cannot raise the interrupt: {e}");
                }
            }
        }
    }

    /// Executes one request and writes its status; returns the number of bytes
    /// written into the chain's device-writable buffers.
    fn handle(&self, parsed: Result<Request, request::Malformed>) -> u32 {
        let req = match parsed {
            Ok(req) => req,
            Err(bad) => {
                tracing::debug!("malformed block request: {}", bad.error);
                return match bad.status {
                    Some(status) => self.finish(status, VIRTIO_BLK_S_IOERR, 0),
                    None => 0,
                };
            }
        };
        let (status, data_written) = self.execute(&req);
        self.finish(req.status, status, data_written)
    }

    fn finish(&self, status_addr: GuestAddress, status: u32, data_written: u32) -> u32 {
        // Status codes are below 256.
        let byte = status as u8;
        if let Err(e) = self.mem.write_obj(byte, status_addr) {
            crate::warn_limited!("block request: cannot write the status: {e}");
            return data_written;
        }
        data_written.saturating_add(1)
    }

    /// Returns the status and the data bytes placed in guest memory.
    fn execute(&self, req: &Request) -> (u32, u32) {
        let disk = &self.disk;
        match req.request_type {
            RequestType::In | RequestType::Out => {
                let len = req.data_len();
                if !disk.contains(req.sector, len / SECTOR_SIZE) {
                    tracing::debug!(
                        "block request beyond the disk: sector {} + {len} bytes",
                        req.sector
                    );
                    return (VIRTIO_BLK_S_IOERR, 0);
                }
                let is_read = req.request_type == RequestType::In;
                if !is_read && disk.read_only() {
                    return (VIRTIO_BLK_S_IOERR, 0);
                }
                // In range, so the byte offset cannot overflow.
                let mut offset = req.sector * SECTOR_SIZE;
                for seg in &req.data {
                    let result = if is_read {
                        disk.read_to_guest(&self.mem, seg.addr, seg.len as usize, offset)
                    } else {
                        disk.write_from_guest(&self.mem, seg.addr, seg.len as usize, offset)
                    };
                    if let Err(e) = result {
                        crate::warn_limited!("block I/O at byte {offset} failed: {e}");
                        return (VIRTIO_BLK_S_IOERR, 0);
                    }
                    offset += u64::from(seg.len);
                }
                // A chain holds less than 4 GiB, so the length fits.
                let written = if is_read { len as u32 } else { 0 };
                (VIRTIO_BLK_S_OK, written)
            }
            RequestType::Flush => {
                if disk.read_only() {
                    return (VIRTIO_BLK_S_OK, 0);
                }
                match disk.flush() {
                    Ok(()) => (VIRTIO_BLK_S_OK, 0),
                    Err(e) => {
                        crate::warn_limited!("block flush failed: {e}");
                        (VIRTIO_BLK_S_IOERR, 0)
                    }
                }
            }
            RequestType::GetId => {
                let mut id = &self.drive_id[..];
                let mut written = 0u32;
                for seg in &req.data {
                    if id.is_empty() {
                        break;
                    }
                    let n = id.len().min(seg.len as usize);
                    if self.mem.write_slice(&id[..n], seg.addr).is_err() {
                        return (VIRTIO_BLK_S_IOERR, 0);
                    }
                    id = &id[n..];
                    written += n as u32;
                }
                (VIRTIO_BLK_S_OK, written)
            }
            RequestType::Unsupported(_) => (VIRTIO_BLK_S_UNSUPP, 0),
        }
    }
}

/// The GET_ID answer for `id`: its first 20 bytes, NUL-padded when shorter.
pub fn drive_id(id: &str) -> DriveId {
    let mut out = DriveId::default();
    let n = id.len().min(out.len());
    out[..n].copy_from_slice(&id.as_bytes()[..n]);
    out
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    use super::super::testing::Driver;
    use super::*;
    use crate::devices::virtio::device::NoIrq;

    /// Found by the `block_request` fuzz target: with
    /// event_idx, a driver whose available index ran more than the queue
    /// size ahead had the worker spin for ever (no chain to pop, yet
    /// "more pending" each time notifications were re-enabled).
    #[test]
    fn an_available_index_beyond_the_queue_size_does_not_spin() {
        let image = tempfile::NamedTempFile::new().unwrap();
        image.as_file().set_len(16 * SECTOR_SIZE).unwrap();
        let disk = Arc::new(Disk::open(image.path(), false).unwrap());
        let mut driver = Driver::new();
        let mut queue = driver.queue();
        queue.set_event_idx(true);
        driver.set_avail_idx(Driver::QUEUE_SIZE + 1);
        let stop = StopSignal::new().unwrap();
        let worker = Worker::new(
            disk,
            drive_id("d"),
            driver.mem.clone(),
            Arc::new(Mutex::new(queue)),
            EventFd::new(EFD_NONBLOCK).unwrap(),
            Arc::new(NoIrq),
            &stop,
        )
        .unwrap();
        let (done, finished) = mpsc::channel();
        std::thread::spawn(move || {
            worker.process_queue(&stop);
            let _ = done.send(());
        });
        finished
            .recv_timeout(Duration::from_secs(10))
            .expect("the worker still spins on the broken ring");
    }
}

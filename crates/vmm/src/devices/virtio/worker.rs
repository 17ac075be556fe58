//! The thread behind an active virtio device: spawned at activation, parked
//! for a snapshot (stopped with its state kept), unparked on resume, stopped
//! on reset and on drop.
//!
//! A device's worker is a value moved onto its thread and handed back when
//! the thread stops, so whatever it holds (queues, connections, a frame in
//! flight) survives a pause. It waits on its own epoll set, into which it adds
//! [`StopSignal`]'s descriptor; a stop writes that eventfd and sets a flag a
//! long-running worker can poll between requests.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

/// What a device runs on its worker thread.
pub trait DeviceWorker: Send + Sized + 'static {
    /// Serves the device until `stop` is signalled (its descriptor becomes
    /// readable), then returns itself to be run again.
    fn run(self, stop: &StopSignal) -> Self;
}

/// Tells a worker thread to stop: an eventfd for its epoll set and a flag.
#[derive(Debug)]
pub struct StopSignal {
    evt: EventFd,
    requested: AtomicBool,
}

impl StopSignal {
    pub fn new() -> io::Result<Arc<StopSignal>> {
        Ok(Arc::new(StopSignal {
            evt: EventFd::new(EFD_NONBLOCK)?,
            requested: AtomicBool::new(false),
        }))
    }

    /// Whether the worker should return as soon as it is between requests.
    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::Acquire)
    }

    fn raise(&self) -> io::Result<()> {
        self.requested.store(true, Ordering::Release);
        self.evt.write(1)
    }

    /// Ready for the next run: the flag down and the eventfd drained, or the
    /// worker would stop again at once.
    fn clear(&self) {
        self.requested.store(false, Ordering::Release);
        // WouldBlock just means the worker drained it itself.
        let _ = self.evt.read();
    }
}

impl AsRawFd for StopSignal {
    fn as_raw_fd(&self) -> RawFd {
        self.evt.as_raw_fd()
    }
}

enum State<W> {
    Running(JoinHandle<W>),
    Parked(W),
}

/// A device's worker and the thread it runs on, if it runs.
pub struct WorkerThread<W: DeviceWorker> {
    name: String,
    stop: Arc<StopSignal>,
    /// `None` once the worker is lost: its thread panicked or could not be
    /// started again.
    state: Option<State<W>>,
}

impl<W: DeviceWorker> std::fmt::Debug for WorkerThread<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            Some(State::Running(_)) => "running",
            Some(State::Parked(_)) => "parked",
            None => "lost",
        };
        f.debug_struct("WorkerThread")
            .field("name", &self.name)
            .field("state", &state)
            .finish()
    }
}

impl<W: DeviceWorker> WorkerThread<W> {
    /// Starts `worker` on a thread called `name`; `stop` must be the signal
    /// whose descriptor the worker waits on.
    pub fn spawn(name: String, stop: Arc<StopSignal>, worker: W) -> io::Result<Self> {
        let thread = Self::start(&name, stop.clone(), worker)?;
        Ok(WorkerThread {
            name,
            stop,
            state: Some(State::Running(thread)),
        })
    }

    fn start(name: &str, stop: Arc<StopSignal>, worker: W) -> io::Result<JoinHandle<W>> {
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                crate::seccomp::apply_or_exit(crate::seccomp::ThreadKind::Device);
                worker.run(&stop)
            })
    }

    /// Whether the worker still exists (running or parked).
    pub fn is_alive(&self) -> bool {
        self.state.is_some()
    }

    /// The worker while parked.
    pub fn parked(&self) -> Option<&W> {
        match &self.state {
            Some(State::Parked(w)) => Some(w),
            _ => None,
        }
    }

    /// Stops the thread and keeps the worker, so neither guest memory nor the
    /// queues change until [`unpark`](Self::unpark). What the worker is doing
    /// completes first. A no-op when parked.
    pub fn park(&mut self) {
        self.state = match self.state.take() {
            Some(State::Running(thread)) => self.join(thread).map(State::Parked),
            other => other,
        };
    }

    /// Starts a parked worker again. A no-op when running; an error loses the
    /// worker.
    pub fn unpark(&mut self) -> io::Result<()> {
        match self.state.take() {
            Some(State::Parked(worker)) => {
                let thread = Self::start(&self.name, self.stop.clone(), worker)?;
                self.state = Some(State::Running(thread));
            }
            other => self.state = other,
        }
        Ok(())
    }

    /// Stops the thread and hands the worker back, unless it was lost.
    pub fn stop(mut self) -> Option<W> {
        self.park();
        match self.state.take() {
            Some(State::Parked(worker)) => Some(worker),
            _ => None,
        }
    }

    fn join(&self, thread: JoinHandle<W>) -> Option<W> {
        if let Err(e) = self.stop.raise() {
            // The flag alone still stops a worker that polls it.
            tracing::error!("{}: cannot signal the worker to stop: {e}", self.name);
        }
        let joined = thread.join();
        self.stop.clear();
        match joined {
            Ok(worker) => Some(worker),
            Err(_) => {
                tracing::error!("{}: the worker thread panicked", self.name);
                None
            }
        }
    }
}

impl<W: DeviceWorker> Drop for WorkerThread<W> {
    fn drop(&mut self) {
        self.park();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

    use super::*;

    /// Counts its runs and waits for the stop signal on an epoll set.
    struct Counter {
        runs: u32,
        epoll: Epoll,
        ran: mpsc::Sender<u32>,
    }

    impl DeviceWorker for Counter {
        fn run(mut self, stop: &StopSignal) -> Self {
            self.runs += 1;
            self.ran.send(self.runs).unwrap();
            let mut events = [EpollEvent::default(); 1];
            while !stop.requested() {
                let _ = self.epoll.wait(-1, &mut events);
            }
            self
        }
    }

    fn counter() -> (WorkerThread<Counter>, mpsc::Receiver<u32>) {
        let stop = StopSignal::new().unwrap();
        let epoll = Epoll::new().unwrap();
        epoll
            .ctl(
                ControlOperation::Add,
                stop.as_raw_fd(),
                EpollEvent::new(EventSet::IN, 0),
            )
            .unwrap();
        let (ran, runs) = mpsc::channel();
        let worker = Counter {
            runs: 0,
            epoll,
            ran,
        };
        (
            WorkerThread::spawn("test-worker".into(), stop, worker).unwrap(),
            runs,
        )
    }

    #[test]
    fn park_keeps_the_worker_and_unpark_runs_it_again() {
        let (mut t, runs) = counter();
        assert_eq!(runs.recv().unwrap(), 1);
        t.park();
        assert_eq!(t.parked().map(|w| w.runs), Some(1));
        t.park();
        assert!(t.is_alive());
        t.unpark().unwrap();
        assert_eq!(runs.recv().unwrap(), 2);
        assert!(t.parked().is_none());
        t.unpark().unwrap();
        assert_eq!(t.stop().map(|w| w.runs), Some(2));
    }

    #[test]
    fn drop_stops_the_thread() {
        let (t, runs) = counter();
        assert_eq!(runs.recv().unwrap(), 1);
        drop(t);
        // The worker (and its sender) is gone with its thread.
        assert!(runs.recv().is_err());
    }
}

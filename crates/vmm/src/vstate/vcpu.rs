//! vCPUs: per-vCPU boot state, and the thread that runs `KVM_RUN` and routes
//! its exits to the buses.
//!
//! Each vCPU runs on its own thread. The VMM talks to it through a request
//! channel and "kicks" it out of `KVM_RUN` with a signal; the thread answers
//! on a response channel. Exits that end the VM (reset, shutdown, a fault)
//! are reported through a callback.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{CpuId, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_api::{VcpuPhase, VcpuReport};
use vmm_sys_util::signal::{Killable, register_signal_handler};

use super::vcpu_state::{VcpuState, VcpuStateError};
use super::vm::Vm;
use crate::arch::x86_64::cpu_template::CpuTemplate;
use crate::arch::x86_64::{cpuid, msr, regs};
use crate::devices::bus::Bus;
use crate::devices::virtio::handoff::DeviceHandoff;

/// Why a vCPU stopped running the guest for good.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VcpuExitReason {
    /// The guest reset the machine (reboot, or reboot after a panic).
    Reset,
    /// The guest asked for power-off.
    Shutdown,
    /// A triple fault: KVM reports the CPU shut down. Carries the vCPU's
    /// control registers at that point, for the log.
    TripleFault(String),
    /// KVM could not run the guest any further.
    Error(String),
}

/// Called on the vCPU thread when the vCPU stops running the guest for good.
pub type ExitCallback = Arc<dyn Fn(u8, VcpuExitReason) + Send + Sync>;

#[derive(Debug)]
enum VcpuRequest {
    Pause,
    Resume,
    /// Capture the state (only served while paused) of these MSRs.
    Save(Arc<Vec<u32>>),
    /// Read where the vCPU is, for diagnostics, and go on.
    Describe,
    Exit,
}

#[derive(Debug)]
enum VcpuResponse {
    Paused,
    Resumed,
    Saved(Box<Result<VcpuState, VcpuStateError>>),
    /// A save was asked of a running vCPU.
    NotPaused,
    /// `(mp_state, registers)`.
    Described(String, String),
}

/// The kinds of `KVM_RUN` returns [`VcpuActivity`] records.
const EXIT_KINDS: [&str; 11] = [
    "none",
    "io_in",
    "io_out",
    "mmio_read",
    "mmio_write",
    "hlt",
    "shutdown",
    "system_event",
    "fail_entry",
    "interrupted",
    "other",
];

fn exit_kind(exit: &Result<VcpuExit<'_>, kvm_ioctls::Error>) -> u8 {
    match exit {
        Ok(VcpuExit::IoIn(..)) => 1,
        Ok(VcpuExit::IoOut(..)) => 2,
        Ok(VcpuExit::MmioRead(..)) => 3,
        Ok(VcpuExit::MmioWrite(..)) => 4,
        Ok(VcpuExit::Hlt) => 5,
        Ok(VcpuExit::Shutdown) => 6,
        Ok(VcpuExit::SystemEvent(..)) => 7,
        Ok(VcpuExit::FailEntry(..)) => 8,
        Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => 9,
        _ => 10,
    }
}

/// What a vCPU thread is doing, kept by the thread in atomics so another
/// thread can read it without stopping the vCPU (a few relaxed stores per
/// exit).
struct VcpuActivity {
    started: Instant,
    phase: AtomicU8,
    exits: AtomicU64,
    last_exit: AtomicU8,
    /// Milliseconds after `started`, plus one (0: no exit yet).
    last_exit_at: AtomicU64,
}

impl VcpuActivity {
    fn new(paused: bool) -> Self {
        let phase = if paused {
            VcpuPhase::Paused
        } else {
            VcpuPhase::InVmm
        };
        VcpuActivity {
            started: Instant::now(),
            phase: AtomicU8::new(phase as u8),
            exits: AtomicU64::new(0),
            last_exit: AtomicU8::new(0),
            last_exit_at: AtomicU64::new(0),
        }
    }

    fn set_phase(&self, phase: VcpuPhase) {
        self.phase.store(phase as u8, Ordering::Relaxed);
    }

    fn phase(&self) -> VcpuPhase {
        match self.phase.load(Ordering::Relaxed) {
            x if x == VcpuPhase::InGuest as u8 => VcpuPhase::InGuest,
            x if x == VcpuPhase::Paused as u8 => VcpuPhase::Paused,
            x if x == VcpuPhase::Exited as u8 => VcpuPhase::Exited,
            _ => VcpuPhase::InVmm,
        }
    }

    fn record_exit(&self, kind: u8) {
        self.set_phase(VcpuPhase::InVmm);
        self.exits.fetch_add(1, Ordering::Relaxed);
        self.last_exit.store(kind, Ordering::Relaxed);
        let at = self.started.elapsed().as_millis() as u64 + 1;
        self.last_exit_at.store(at, Ordering::Relaxed);
    }

    fn report(&self, id: u8) -> VcpuReport {
        let at = self.last_exit_at.load(Ordering::Relaxed);
        let kind = usize::from(self.last_exit.load(Ordering::Relaxed));
        VcpuReport {
            id,
            phase: self.phase(),
            exits: self.exits.load(Ordering::Relaxed),
            last_exit: EXIT_KINDS.get(kind).unwrap_or(&"other").to_string(),
            ms_since_last_exit: (at > 0)
                .then(|| (self.started.elapsed().as_millis() as u64 + 1).saturating_sub(at)),
            mp_state: None,
            registers: None,
            error: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("KVM vCPU ioctl {0} failed: {1}")]
    Kvm(&'static str, #[source] kvm_ioctls::Error),
    #[error("setting up vCPU registers: {0}")]
    Regs(#[from] regs::RegsError),
    #[error("building the MSR list")]
    Msrs,
    #[error("KVM accepted only {set} of {wanted} boot MSRs")]
    MsrsPartial { set: usize, wanted: usize },
    #[error("starting the vCPU thread: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("registering the vCPU kick signal: {0}")]
    Signal(#[source] vmm_sys_util::errno::Error),
    #[error("vCPU {0} did not answer within {1:?}")]
    Timeout(u8, Duration),
    #[error("vCPU {0} is gone")]
    Gone(u8),
    #[error("vCPU {0} state: {1}")]
    State(u8, #[source] VcpuStateError),
    #[error("vCPU {0} must be paused first")]
    NotPaused(u8),
}

/// The signal that kicks a vCPU thread out of `KVM_RUN`.
fn kick_signal() -> i32 {
    vmm_sys_util::signal::SIGRTMIN()
}

/// Installs the no-op handler for the kick signal, once per process. Without
/// `SA_RESTART`, the signal makes `KVM_RUN` return `EINTR`.
pub fn register_kick_signal() -> Result<(), VcpuError> {
    extern "C" fn noop(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}
    register_signal_handler(kick_signal(), noop).map_err(VcpuError::Signal)
}

pub struct Vcpu {
    id: u8,
    fd: VcpuFd,
    io_bus: Arc<Bus>,
    mmio_bus: Arc<Bus>,
    /// Where device status writes that start or stop a worker go: the
    /// vCPU waits for them after an MMIO write (see the handoff module).
    handoff: Arc<DeviceHandoff>,
    on_exit: ExitCallback,
}

impl std::fmt::Debug for Vcpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vcpu")
            .field("id", &self.id)
            .field("fd", &self.fd)
            .field("io_bus", &self.io_bus)
            .field("mmio_bus", &self.mmio_bus)
            .field("handoff", &self.handoff)
            .finish_non_exhaustive()
    }
}

impl Vcpu {
    pub fn new(
        vm: &Vm,
        id: u8,
        io_bus: Arc<Bus>,
        mmio_bus: Arc<Bus>,
        handoff: Arc<DeviceHandoff>,
        on_exit: ExitCallback,
    ) -> Result<Self, VcpuError> {
        let fd = vm
            .fd()
            .create_vcpu(u64::from(id))
            .map_err(|e| VcpuError::Kvm("CREATE_VCPU", e))?;
        Ok(Vcpu {
            id,
            fd,
            io_bus,
            mmio_bus,
            handoff,
            on_exit,
        })
    }

    /// Sets CPUID (from `supported`, the host's, under `template`), MSRs,
    /// FPU and LAPIC for vCPU `id` of `count`; the boot vCPU also gets the
    /// 64-bit entry state at `entry`.
    pub fn configure(
        &self,
        supported: &CpuId,
        template: Option<&CpuTemplate>,
        count: u8,
        entry: u64,
    ) -> Result<(), VcpuError> {
        let mut cpuid = supported.clone();
        cpuid::normalize(&mut cpuid, template, self.id, count);
        self.fd
            .set_cpuid2(&cpuid)
            .map_err(|e| VcpuError::Kvm("SET_CPUID2", e))?;

        let msrs = msr::boot_msrs().map_err(|_| VcpuError::Msrs)?;
        let set = self
            .fd
            .set_msrs(&msrs)
            .map_err(|e| VcpuError::Kvm("SET_MSRS", e))?;
        if set != msrs.as_slice().len() {
            return Err(VcpuError::MsrsPartial {
                set,
                wanted: msrs.as_slice().len(),
            });
        }

        regs::setup_fpu(&self.fd)?;
        regs::setup_lint(&self.fd)?;
        if self.id == 0 {
            regs::setup_regs(&self.fd, entry)?;
            regs::setup_sregs(&self.fd)?;
        }
        Ok(())
    }

    /// Loads a snapshot's state into this (new) vCPU.
    pub fn restore(&self, state: &VcpuState) -> Result<(), VcpuError> {
        state
            .restore(&self.fd)
            .map_err(|e| VcpuError::State(self.id, e))
    }

    pub fn fd(&self) -> &VcpuFd {
        &self.fd
    }

    /// Starts the vCPU thread; it runs the guest at once, or, when `paused`,
    /// once resumed.
    pub fn start(self, paused: bool) -> Result<VcpuHandle, VcpuError> {
        let id = self.id;
        let (request_tx, request_rx) = mpsc::channel();
        let (response_tx, response_rx) = mpsc::channel();
        let activity = Arc::new(VcpuActivity::new(paused));
        let thread_activity = activity.clone();
        let handoff = self.handoff.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || {
                // Before any guest code. Device activation, which makes
                // descriptors and threads, is handed to the controller.
                crate::seccomp::apply_or_exit(crate::seccomp::ThreadKind::Vcpu);
                let activity = &thread_activity;
                if paused && !self.stay_paused(&request_rx, &response_tx, activity) {
                    return;
                }
                self.run_loop(&request_rx, &response_tx, activity)
            })
            .map_err(VcpuError::Spawn)?;
        Ok(VcpuHandle {
            id,
            thread: Some(thread),
            requests: request_tx,
            responses: response_rx,
            activity,
            handoff,
        })
    }

    fn run_loop(
        mut self,
        requests: &Receiver<VcpuRequest>,
        responses: &Sender<VcpuResponse>,
        activity: &VcpuActivity,
    ) {
        loop {
            let exit = match self.run_once(activity) {
                Ok(None) => continue,
                Ok(Some(reason)) => Some(reason),
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => None,
                Err(e) => Some(VcpuExitReason::Error(format!("KVM_RUN failed: {e}"))),
            };
            if let Some(reason) = exit {
                activity.set_phase(VcpuPhase::Exited);
                (self.on_exit)(self.id, reason);
                // Stay parked until told to go, so the VMM can still join us.
                while !matches!(requests.recv(), Ok(VcpuRequest::Exit) | Err(_)) {}
                return;
            }
            // Kicked: serve every pending request before running again.
            if !self.serve_requests(requests, responses, activity) {
                return;
            }
        }
    }

    /// Returns false when the thread should end.
    fn serve_requests(
        &self,
        requests: &Receiver<VcpuRequest>,
        responses: &Sender<VcpuResponse>,
        activity: &VcpuActivity,
    ) -> bool {
        while let Ok(request) = requests.try_recv() {
            match request {
                VcpuRequest::Exit => return false,
                VcpuRequest::Resume => {
                    let _ = responses.send(VcpuResponse::Resumed);
                }
                VcpuRequest::Save(_) => {
                    let _ = responses.send(VcpuResponse::NotPaused);
                }
                VcpuRequest::Describe => {
                    let _ = responses.send(self.describe());
                }
                VcpuRequest::Pause => {
                    let _ = responses.send(VcpuResponse::Paused);
                    if !self.stay_paused(requests, responses, activity) {
                        return false;
                    }
                }
            }
        }
        true
    }

    /// Serves requests without running the guest until resumed; returns false
    /// when the thread should end.
    fn stay_paused(
        &self,
        requests: &Receiver<VcpuRequest>,
        responses: &Sender<VcpuResponse>,
        activity: &VcpuActivity,
    ) -> bool {
        activity.set_phase(VcpuPhase::Paused);
        loop {
            match requests.recv() {
                Ok(VcpuRequest::Resume) => {
                    activity.set_phase(VcpuPhase::InVmm);
                    let _ = responses.send(VcpuResponse::Resumed);
                    return true;
                }
                Ok(VcpuRequest::Describe) => {
                    let _ = responses.send(self.describe());
                }
                Ok(VcpuRequest::Pause) => {
                    let _ = responses.send(VcpuResponse::Paused);
                }
                Ok(VcpuRequest::Save(msrs)) => {
                    let state = VcpuState::save(&self.fd, &msrs);
                    let _ = responses.send(VcpuResponse::Saved(Box::new(state)));
                }
                Ok(VcpuRequest::Exit) | Err(_) => return false,
            }
        }
    }

    /// KVM's multiprocessing state and the registers, for diagnostics.
    fn describe(&self) -> VcpuResponse {
        let mp_state = match self.fd.get_mp_state() {
            Ok(mp) => match mp.mp_state {
                kvm_bindings::KVM_MP_STATE_RUNNABLE => "runnable".to_string(),
                kvm_bindings::KVM_MP_STATE_UNINITIALIZED => "uninitialized".to_string(),
                kvm_bindings::KVM_MP_STATE_INIT_RECEIVED => "init_received".to_string(),
                kvm_bindings::KVM_MP_STATE_HALTED => "halted".to_string(),
                kvm_bindings::KVM_MP_STATE_SIPI_RECEIVED => "sipi_received".to_string(),
                other => format!("{other}"),
            },
            Err(e) => format!("unreadable: {e}"),
        };
        VcpuResponse::Described(mp_state, self.describe_state())
    }

    /// The registers that tell where a dying guest was, for the log.
    fn describe_state(&self) -> String {
        match (self.fd.get_regs(), self.fd.get_sregs()) {
            (Ok(r), Ok(s)) => format!(
                "vcpu{} rip={:#x} rsp={:#x} rflags={:#x} cr0={:#x} cr2={:#x} cr3={:#x} cr4={:#x} efer={:#x}",
                self.id, r.rip, r.rsp, r.rflags, s.cr0, s.cr2, s.cr3, s.cr4, s.efer
            ),
            _ => format!("vcpu{}: registers unavailable", self.id),
        }
    }

    /// Runs the guest until one exit; `Some` when the VM must stop.
    fn run_once(
        &mut self,
        activity: &VcpuActivity,
    ) -> Result<Option<VcpuExitReason>, kvm_ioctls::Error> {
        activity.set_phase(VcpuPhase::InGuest);
        let exit = self.fd.run();
        activity.record_exit(exit_kind(&exit));
        let exit = match exit? {
            VcpuExit::IoIn(port, data) => {
                // Unclaimed ports read as zero, as on Firecracker; 0xff would make
                // Linux spin on the (absent) CMOS clock's update-in-progress bit.
                if !self.io_bus.read(u64::from(port), data) {
                    data.fill(0);
                }
                None
            }
            VcpuExit::IoOut(port, data) => {
                self.io_bus.write(u64::from(port), data);
                None
            }
            VcpuExit::MmioRead(addr, data) => {
                if !self.mmio_bus.read(addr, data) {
                    data.fill(0);
                }
                None
            }
            VcpuExit::MmioWrite(addr, data) => {
                self.mmio_bus.write(addr, data);
                // Not back into the guest before a handed-off status write
                // is applied; the device's lock is free again here.
                self.handoff.wait();
                None
            }
            // With the in-kernel irqchip KVM handles HLT itself; seeing it means
            // the vCPU halted with interrupts off, i.e. for good.
            VcpuExit::Hlt => Some(VcpuExitReason::Shutdown),
            VcpuExit::Shutdown => Some(VcpuExitReason::TripleFault(self.describe_state())),
            VcpuExit::SystemEvent(kind, _) => match kind {
                KVM_SYSTEM_EVENT_RESET => Some(VcpuExitReason::Reset),
                KVM_SYSTEM_EVENT_SHUTDOWN => Some(VcpuExitReason::Shutdown),
                other => Some(VcpuExitReason::Error(format!(
                    "unexpected system event {other}"
                ))),
            },
            VcpuExit::FailEntry(reason, cpu) => Some(VcpuExitReason::Error(format!(
                "KVM failed to enter the guest (hardware reason {reason:#x}, cpu {cpu})"
            ))),
            VcpuExit::InternalError => Some(VcpuExitReason::Error("KVM internal error".into())),
            other => Some(VcpuExitReason::Error(format!(
                "unexpected vCPU exit: {other:?}"
            ))),
        };
        Ok(exit)
    }
}

/// The VMM's side of a running vCPU thread.
pub struct VcpuHandle {
    id: u8,
    thread: Option<JoinHandle<()>>,
    requests: Sender<VcpuRequest>,
    responses: Receiver<VcpuResponse>,
    activity: Arc<VcpuActivity>,
    /// Run while waiting for the thread: it may be waiting for this.
    handoff: Arc<DeviceHandoff>,
}

impl std::fmt::Debug for VcpuHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VcpuHandle")
            .field("id", &self.id)
            .field("thread", &self.thread)
            .field("requests", &self.requests)
            .field("responses", &self.responses)
            .field("handoff", &self.handoff)
            .finish_non_exhaustive()
    }
}

/// How long a vCPU may take to acknowledge a request.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a request is re-kicked: a kick that lands while the thread is
/// outside `KVM_RUN` is lost, so keep kicking until it answers.
const KICK_INTERVAL: Duration = Duration::from_millis(1);

impl VcpuHandle {
    fn kick(&self) {
        if let Some(thread) = &self.thread {
            let _ = thread.kill(kick_signal());
        }
    }

    /// Sends `request` and waits for the answer `accept` takes (stale
    /// answers to earlier requests are skipped).
    fn request<T>(
        &self,
        request: VcpuRequest,
        accept: impl Fn(VcpuResponse) -> Option<Result<T, VcpuError>>,
    ) -> Result<T, VcpuError> {
        self.request_within(request, RESPONSE_TIMEOUT, accept)
    }

    fn request_within<T>(
        &self,
        request: VcpuRequest,
        timeout: Duration,
        accept: impl Fn(VcpuResponse) -> Option<Result<T, VcpuError>>,
    ) -> Result<T, VcpuError> {
        self.requests
            .send(request)
            .map_err(|_| VcpuError::Gone(self.id))?;
        let deadline = Instant::now() + timeout;
        loop {
            self.handoff.run();
            self.kick();
            match self.responses.recv_timeout(KICK_INTERVAL) {
                Ok(response) => {
                    if let Some(result) = accept(response) {
                        return result;
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return Err(VcpuError::Gone(self.id)),
                Err(RecvTimeoutError::Timeout) if Instant::now() >= deadline => {
                    return Err(VcpuError::Timeout(self.id, timeout));
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// Stops the vCPU at its next exit; returns once it is parked.
    pub fn pause(&self) -> Result<(), VcpuError> {
        self.request(VcpuRequest::Pause, |r| {
            matches!(r, VcpuResponse::Paused).then_some(Ok(()))
        })
    }

    pub fn resume(&self) -> Result<(), VcpuError> {
        self.request(VcpuRequest::Resume, |r| {
            matches!(r, VcpuResponse::Resumed).then_some(Ok(()))
        })
    }

    /// Captures the state of a paused vCPU, with the MSRs in `msrs`.
    pub fn save_state(&self, msrs: Arc<Vec<u32>>) -> Result<VcpuState, VcpuError> {
        let id = self.id;
        self.request(VcpuRequest::Save(msrs), |r| match r {
            VcpuResponse::Saved(state) => Some((*state).map_err(|e| VcpuError::State(id, e))),
            VcpuResponse::NotPaused => Some(Err(VcpuError::NotPaused(id))),
            _ => None,
        })
    }

    /// What the vCPU is doing: its thread's counters, and its registers
    /// when the thread answers a kick within `timeout` (an exited vCPU does
    /// not). A stale answer to an earlier, timed-out describe is skipped.
    pub fn report(&self, timeout: Duration) -> VcpuReport {
        let mut report = self.activity.report(self.id);
        if report.phase == VcpuPhase::Exited {
            return report;
        }
        match self.request_within(VcpuRequest::Describe, timeout, |r| match r {
            VcpuResponse::Described(mp, regs) => Some(Ok((mp, regs))),
            _ => None,
        }) {
            Ok((mp_state, registers)) => {
                report.mp_state = Some(mp_state);
                report.registers = Some(registers);
            }
            Err(e) => report.error = Some(e.to_string()),
        }
        report
    }

    /// Ends the thread and waits for it.
    pub fn stop(&mut self) {
        let _ = self.requests.send(VcpuRequest::Exit);
        if let Some(thread) = self.thread.take() {
            while !thread.is_finished() {
                self.handoff.run();
                let _ = thread.kill(kick_signal());
                std::thread::sleep(KICK_INTERVAL);
            }
            let _ = thread.join();
        }
    }
}

impl Drop for VcpuHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

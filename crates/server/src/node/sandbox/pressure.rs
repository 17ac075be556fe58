//! The manager's side of the memory pressure monitor (see
//! [`crate::node::pressure`]): which sandboxes are idle, pausing them one at a
//! time, and waking one on its next request.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Manager, PauseMode, Phase, ResumeMode, SandboxError};
use crate::node::clock::now_ms;
use crate::node::events::LifecycleKind;
use crate::node::pressure::{
    self, Candidate, PressureConfig, PressurePause, PressureReport, Reading,
};
use crate::node::store::{PauseReason, SandboxRecord, SandboxState};

impl Manager {
    /// Watches the host's memory every [`pressure::CHECK_EVERY`] and pauses
    /// idle sandboxes while it runs short (unless the node runs without,
    /// `--no-pressure-pause`). Stops with the manager.
    pub fn start_pressure_monitor(self: Arc<Self>) {
        let Some(config) = self.config.pressure.clone() else {
            tracing::info!("memory pressure: idle sandboxes are never paused (off)");
            return;
        };
        let total = host_mem::mem_total_mib().unwrap_or(u64::MAX);
        let floor = config.floor_mib(self.capacity.limits().memory_mib, total);
        let psi = match host_mem::pressure::Pressure::memory() {
            Ok(Some(_)) => format!("or PSI memory full avg10 above {} %", config.max_full_avg10),
            _ => "(this kernel reports no memory PSI: MemAvailable alone)".to_owned(),
        };
        tracing::info!(
            "memory pressure: idle sandboxes (no request for {} s) are paused while \
             MemAvailable is below {floor} MiB {psi}, at most {} a minute",
            config.idle.as_secs(),
            config.max_pauses_per_minute
        );
        let me = Arc::downgrade(&self);
        drop(self);
        tokio::spawn(async move {
            let mut last = None;
            loop {
                tokio::time::sleep(pressure::CHECK_EVERY).await;
                let Some(manager) = me.upgrade() else {
                    return;
                };
                manager.relieve_pressure(&config, floor, &mut last).await;
            }
        });
    }

    fn pressure_stats(&self) -> std::sync::MutexGuard<'_, pressure::PressureStats> {
        self.pressure.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One look at the host: while it is under pressure, pauses idle
    /// sandboxes one at a time (each written out and its VMM gone before
    /// the next look), within the rate bound.
    async fn relieve_pressure(
        &self,
        config: &PressureConfig,
        floor_mib: u64,
        last: &mut Option<Reading>,
    ) {
        // Sandboxes whose pause failed this time are not tried again at once.
        let mut failed = HashSet::new();
        loop {
            let now = match Reading::now() {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("memory pressure: reading /proc/meminfo: {e}");
                    return;
                }
            };
            let Some(why) = self.judge(config, floor_mib, now, last) else {
                return;
            };
            let Some(candidate) = self.pressure_candidate(config.idle, &failed) else {
                self.pressure_stats().nothing_to_pause_total += 1;
                tracing::warn!(
                    "memory pressure: {why}; no idle sandbox is left to pause (MemAvailable {} MiB)",
                    now.available_mib
                );
                return;
            };
            let started = Instant::now();
            let vmm_mib = self
                .registry()
                .get(&candidate.id)
                .and_then(|s| s.probe())
                .and_then(|p| host_mem::ProcessMemory::of(p.pid()).ok())
                .map(|m| host_mem::kib_to_mib(m.pss_kib));
            let paused = self
                .pause_for(&candidate.id, PauseMode::Full, PauseReason::MemoryPressure)
                .await;
            let id = &candidate.id;
            match paused {
                Ok(_) => {
                    let after = Reading::now().map_or(0, |r| r.available_mib);
                    let pause = PressurePause {
                        id: id.clone(),
                        at_ms: now_ms(),
                        reason: why,
                        available_before_mib: now.available_mib,
                        available_after_mib: after,
                        vmm_mib,
                        psi_full_avg10: now.full_avg10(),
                        took_ms: started.elapsed().as_millis() as u64,
                    };
                    tracing::warn!(
                        "sandbox {id}: paused for memory pressure ({}; {}auto-pause, idle {} s): \
                         its VMM used {} MiB; MemAvailable {} -> {after} MiB, PSI full avg10 {}; \
                         took {} ms; it resumes on its next request",
                        pause.reason,
                        if candidate.auto_pause { "" } else { "not " },
                        now_ms().saturating_sub(candidate.last_used_ms) / 1000,
                        vmm_mib.map_or("?".into(), |m| m.to_string()),
                        now.available_mib,
                        show(now.full_avg10()),
                        pause.took_ms
                    );
                    self.pressure_stats().record(pause);
                }
                Err(e) => {
                    // Busy (a request came, another change), or it failed
                    // and was left running.
                    tracing::warn!("sandbox {id}: not paused for memory pressure: {e}");
                    self.pressure_stats().failed_total += 1;
                    failed.insert(candidate.id);
                }
            }
        }
    }

    /// Whether `now` is pressure that calls for a pause now (its reason),
    /// keeping the episode's state and the reading for `GET /v1/node`.
    fn judge(
        &self,
        config: &PressureConfig,
        floor_mib: u64,
        now: Reading,
        last: &mut Option<Reading>,
    ) -> Option<String> {
        let mut stats = self.pressure_stats();
        let pausing = stats.pausing;
        let why = pressure::pressured(config, floor_mib, &now, last.as_ref(), pausing);
        *last = Some(now);
        stats.last = Some(now);
        let Some(why) = why else {
            if pausing {
                stats.pausing = false;
                tracing::info!(
                    "memory pressure relieved: MemAvailable {} MiB, PSI full avg10 {}",
                    now.available_mib,
                    show(now.full_avg10())
                );
            }
            return None;
        };
        if !pausing {
            stats.pausing = true;
            tracing::warn!("memory pressure: {why}; pausing idle sandboxes");
        }
        if !stats.may_pause(now.at_ms, config.max_pauses_per_minute) {
            tracing::debug!("memory pressure: {why}; at the bound of pauses a minute");
            return None;
        }
        Some(why)
    }

    /// The idle running sandbox to pause first (see [`pressure::choose`]).
    fn pressure_candidate(&self, idle: Duration, skip: &HashSet<String>) -> Option<Candidate> {
        let now = now_ms();
        let idle_ms = idle.as_millis() as u64;
        let sandboxes = self.registry().all();
        let candidates: Vec<Candidate> = sandboxes
            .into_iter()
            .filter(|s| {
                s.phase() == Phase::Running
                    && s.in_flight() == 0
                    && now.saturating_sub(s.last_used_ms()) >= idle_ms
                    && !skip.contains(&s.id)
            })
            .filter_map(|s| {
                let record = self.store.sandbox(&s.id).ok().flatten()?;
                (record.state == SandboxState::Running).then(|| Candidate {
                    id: s.id.clone(),
                    auto_pause: record.auto_pause,
                    last_used_ms: s.last_used_ms(),
                })
            })
            .collect();
        pressure::choose(&candidates).cloned()
    }

    /// For a request to sandbox `id`, which does not take traffic now: when
    /// the node paused it for memory pressure, resumes it with the timeout
    /// it had left and answers its vsock socket. `Ok(None)`: it is not one
    /// (not found, paused by its owner, killed, or its time is up).
    pub async fn wake(&self, id: &str) -> Result<Option<PathBuf>, SandboxError> {
        let Ok(sandbox) = self.sandbox(id) else {
            return Ok(None);
        };
        if matches!(sandbox.phase(), Phase::Pausing | Phase::Resuming) {
            // Let the change end: a pause under way may be the monitor's.
            drop(sandbox.guest.lock().await);
        }
        // A sandbox killed meanwhile (its timeout, a DELETE) is simply gone:
        // the request answers as for any unknown sandbox.
        let record = match self.get(id) {
            Err(SandboxError::NotFound(_)) => return Ok(None),
            other => other?,
        };
        if !paused_by_pressure(&record) {
            return Ok(self.vsock_path(id));
        }
        let left = record.end_at_ms.saturating_sub(now_ms());
        if left == 0 {
            return Ok(None);
        }
        let started = Instant::now();
        let resumed = match self
            .resume_unannounced(id, Duration::from_millis(left), ResumeMode::Restore)
            .await
        {
            Err(SandboxError::NotFound(_)) => return Ok(None),
            other => other?.1,
        };
        if resumed {
            tracing::info!(
                "sandbox {id}: resumed by a request after a memory pressure pause, in {} ms",
                started.elapsed().as_millis()
            );
        }
        Ok(self.vsock_path(id))
    }

    /// A sandbox the node paused for memory pressure whose clock has run
    /// out: it gets what its timeout would have done (an auto-pause one
    /// stays paused as if its timeout had paused it; others are killed).
    pub(super) async fn timeout_while_paused_by_pressure(&self, record: &SandboxRecord) {
        let id = &record.id;
        if record.auto_pause {
            tracing::info!("sandbox {id}: timeout reached while paused for memory pressure");
            let updated = self.store.update_sandbox(id, |s| {
                if paused_by_pressure(s) {
                    s.pause_reason = Some(PauseReason::Timeout);
                }
            });
            match updated {
                // Running for its owner until now: now it is paused.
                Ok(Some(paused)) => self.saw(LifecycleKind::Paused, &paused, None),
                Ok(None) => {}
                Err(e) => tracing::warn!("sandbox {id}: {e}"),
            }
            return;
        }
        tracing::info!(
            "sandbox {id}: timeout reached while paused for memory pressure, killing it"
        );
        if let Err(e) = self.kill_seen(id).await {
            tracing::warn!("sandbox {id}: killing at timeout: {e}");
        }
    }

    /// Whether the sandbox with access token `token` was paused by the node
    /// for memory pressure (a request carrying it wakes it).
    pub fn paused_by_pressure_with_token(&self, token: &str) -> Option<String> {
        let sandbox = self.registry().by_token(token)?;
        if sandbox.phase() != Phase::Paused {
            return None;
        }
        let record = self.get(&sandbox.id).ok()?;
        paused_by_pressure(&record).then(|| sandbox.id.clone())
    }

    /// Marks a proxied request to `id` under way until the guard drops.
    pub fn in_use(&self, id: &str) -> Option<super::live::InUse> {
        self.registry().get(id).map(|s| s.in_use())
    }

    /// The monitor's figures for `GET /v1/node`; None when it is off.
    pub fn pressure_report(&self) -> Option<PressureReport> {
        let config = self.config.pressure.as_ref()?;
        let total = host_mem::mem_total_mib().unwrap_or(u64::MAX);
        let stats = self.pressure_stats();
        let paused_now = self
            .store
            .sandboxes()
            .map(|all| all.iter().filter(|r| paused_by_pressure(r)).count())
            .unwrap_or(0);
        Some(PressureReport {
            last: stats.last,
            floor_mib: config.floor_mib(self.capacity.limits().memory_mib, total),
            max_full_avg10: config.max_full_avg10,
            idle: config.idle,
            pausing: stats.pausing,
            paused_total: stats.paused_total,
            paused_now,
            failed_total: stats.failed_total,
            nothing_to_pause_total: stats.nothing_to_pause_total,
            recent: stats.recent.iter().cloned().collect(),
        })
    }
}

fn paused_by_pressure(record: &SandboxRecord) -> bool {
    record.state == SandboxState::Paused && record.pause_reason == Some(PauseReason::MemoryPressure)
}

fn show(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.2} %"))
}

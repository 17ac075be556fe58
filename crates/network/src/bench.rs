//! Slot setup time, for `sandfork bench` (`net_slot_setup_ms`): a benchmark, never a timed test.

use std::time::{Duration, Instant};

use crate::error::Result;
use crate::host::Host;
use crate::pool::PoolConfig;
use crate::slot;

/// Setup times of `n` slots made one after another (then removed), sorted; and the times of
/// one policy replace on each (`net_policy_replace_ms`), sorted.
pub fn slot_setup_times(cfg: &PoolConfig, n: u32) -> Result<(Vec<Duration>, Vec<Duration>)> {
    let host = Host::open(&cfg.host)?;
    let mut times = Vec::with_capacity(n as usize);
    let mut made = Vec::new();
    let mut result = Ok(());
    for id in 1..=n.min(host.plan.slots) {
        let t = Instant::now();
        match slot::create(&host, id) {
            Ok(s) => {
                times.push(t.elapsed());
                made.push(s);
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    let mut replace = Vec::with_capacity(made.len());
    let deny = crate::policy::EgressPolicy::from_e2b(
        None,
        &["203.0.113.10".into()],
        &["0.0.0.0/0".into()],
    )?;
    for s in &mut made {
        if result.is_err() {
            break;
        }
        let t = Instant::now();
        if let Err(e) = slot::set_policy(s, deny.clone()) {
            result = Err(e);
            break;
        }
        replace.push(t.elapsed());
    }
    for s in made {
        slot::remove(&host, s)?;
    }
    host.remove_table()?;
    result?;
    times.sort();
    replace.sort();
    Ok((times, replace))
}

/// The `p`-th percentile (0..=100) of sorted `times`, in milliseconds.
pub fn percentile_ms(times: &[Duration], p: u32) -> f64 {
    if times.is_empty() {
        return 0.0;
    }
    let i = ((times.len() - 1) * p as usize).div_ceil(100);
    times[i.min(times.len() - 1)].as_secs_f64() * 1000.0
}

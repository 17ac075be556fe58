//! Slot setup time, for `sandfork bench` (`net_slot_setup_ms`): a benchmark, never a timed test;
//! and a namespace holding a slot's tap alone, for the bench's guest TCP figures.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::host::Host;
use crate::netns;
use crate::plan::TAP_NAME;
use crate::pool::PoolConfig;
use crate::rtnl::Rtnl;
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

/// Makes a namespace anchored at `anchor` holding a slot's tap alone, addressed as in every
/// slot (no veth, no NAT, no table): a VMM spawned in it gives its guest the network every
/// sandbox has, and a thread in it reaches the guest at [`crate::plan::GUEST_IP`] over the
/// tap and nothing else. Remove it with [`netns::remove_anchor`].
pub fn tap_namespace(anchor: &Path) -> Result<()> {
    netns::create_anchored(anchor, |_own| {
        crate::tap::create_persistent_tap(TAP_NAME)?;
        let tap =
            nix::net::if_::if_nametoindex(TAP_NAME).map_err(|e| Error::sys("tap0 index", e))?;
        let mut rt = Rtnl::open()?;
        rt.batch("configure the tap", |rt| {
            rt.set_up(1, None)?; // lo is always index 1 in a new namespace
            slot::address_tap(rt, tap)
        })
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::GATEWAY_IP;

    /// Makes a namespace: run as root with `--ignored`.
    #[test]
    #[ignore = "needs root: makes a network namespace"]
    fn a_tap_namespace_holds_the_tap_at_the_gateway_address() {
        let dir = tempfile::tempdir().unwrap();
        let anchor = dir.path().join("ns");
        tap_namespace(&anchor).unwrap();
        let seen = crate::run_in_netns(&anchor, || {
            let mut rt = Rtnl::open()?;
            let names: Vec<String> = rt.links()?.into_iter().map(|l| l.name).collect();
            Ok((names, rt.addresses()?))
        });
        netns::remove_anchor(&anchor).unwrap();
        let (names, addrs) = seen.unwrap();
        assert!(names.iter().any(|n| n == TAP_NAME), "{names:?}");
        assert!(addrs.contains(&GATEWAY_IP), "{addrs:?}");
    }
}

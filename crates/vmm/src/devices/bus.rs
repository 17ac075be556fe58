//! Address buses that route a vCPU's port I/O and MMIO exits to devices.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A device on a bus. `offset` is relative to the start of its range.
pub trait BusDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    #[error("bus range {base:#x}+{len:#x} overlaps another device or is empty")]
    Overlap { base: u64, len: u64 },
}

struct Range {
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
}

/// An immutable-after-build map from address ranges to devices. Lookups take
/// no bus-wide lock: only the target device's own mutex.
#[derive(Default)]
pub struct Bus {
    ranges: BTreeMap<u64, Range>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bus").finish_non_exhaustive()
    }
}

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(
        &mut self,
        device: Arc<Mutex<dyn BusDevice>>,
        base: u64,
        len: u64,
    ) -> Result<(), BusError> {
        let end = base.checked_add(len).filter(|_| len > 0);
        let Some(end) = end else {
            return Err(BusError::Overlap { base, len });
        };
        let clashes_below = self
            .ranges
            .range(..=base)
            .next_back()
            .is_some_and(|(b, r)| b + r.len > base);
        let clashes_above = self.ranges.range(base..end).next().is_some();
        if clashes_below || clashes_above {
            return Err(BusError::Overlap { base, len });
        }
        self.ranges.insert(base, Range { len, device });
        Ok(())
    }

    fn resolve(&self, addr: u64) -> Option<(u64, &Arc<Mutex<dyn BusDevice>>)> {
        let (base, range) = self.ranges.range(..=addr).next_back()?;
        (addr - base < range.len).then_some((addr - base, &range.device))
    }

    /// Reads from the device at `addr`; returns false if nothing is there.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.resolve(addr) {
            Some((offset, device)) => {
                // A poisoned lock means a device thread panicked; keep serving
                // the guest rather than taking the vCPU down with it.
                let mut device = device.lock().unwrap_or_else(|e| e.into_inner());
                device.read(offset, data);
                true
            }
            None => false,
        }
    }

    /// Writes to the device at `addr`; returns false if nothing is there.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.resolve(addr) {
            Some((offset, device)) => {
                let mut device = device.lock().unwrap_or_else(|e| e.into_inner());
                device.write(offset, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo(Vec<u8>);
    impl BusDevice for Echo {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, _offset: u64, data: &[u8]) {
            self.0.extend_from_slice(data);
        }
    }

    #[test]
    fn routes_by_range_with_offsets() {
        let mut bus = Bus::new();
        let dev = Arc::new(Mutex::new(Echo(Vec::new())));
        bus.insert(dev.clone(), 0x100, 0x10).unwrap();
        let mut data = [0u8; 1];
        assert!(bus.read(0x105, &mut data));
        assert_eq!(data[0], 5);
        assert!(!bus.read(0x110, &mut data));
        assert!(!bus.read(0xff, &mut data));
        assert!(bus.write(0x10f, &[7]));
        assert_eq!(dev.lock().unwrap().0, vec![7]);
    }

    #[test]
    fn rejects_overlaps_and_empty_ranges() {
        let mut bus = Bus::new();
        let dev = Arc::new(Mutex::new(Echo(Vec::new())));
        bus.insert(dev.clone(), 0x100, 0x10).unwrap();
        assert!(bus.insert(dev.clone(), 0x10f, 1).is_err());
        assert!(bus.insert(dev.clone(), 0xf0, 0x11).is_err());
        assert!(bus.insert(dev.clone(), 0x200, 0).is_err());
        assert!(bus.insert(dev.clone(), 0x110, 1).is_ok());
    }
}

//! What the guest puts in the balloon's queues, read out of its descriptor
//! chains: page frame numbers (inflate), statistics, and free page reports.
//! Everything here is guest input: lengths are capped, reads that fail end
//! the buffer, nothing panics.

use virtio_queue::DescriptorChain;
use vm_memory::{Address, Bytes, GuestMemory as GuestMemoryTrait};

/// The balloon's page size: PFNs count 4 KiB pages whatever the guest's own.
pub const PFN_SHIFT: u32 = 12;
/// Linux sends at most 256 PFNs per buffer; a buffer claiming more than this
/// is read only this far, so a hostile length cannot size a host allocation.
pub const MAX_PFNS_PER_CHAIN: usize = 4096;
/// Linux sends ten statistics; the rest of a longer buffer is ignored.
pub const MAX_STATS: usize = 64;
/// One statistic: a le16 tag and a le64 value, packed.
const STAT_LEN: u64 = 10;

/// A guest physical range: start and length in bytes.
pub type GuestRange = (u64, u64);

/// The PFNs in the device-readable buffers of an inflate chain, as ranges of
/// adjacent pages (sorted, merged).
pub fn pfn_ranges<M: GuestMemoryTrait>(mem: &M, chain: DescriptorChain<&M>) -> Vec<GuestRange> {
    let mut pfns = Vec::new();
    'chain: for desc in chain.readable() {
        let count = (desc.len() / 4) as usize;
        for i in 0..count {
            if pfns.len() >= MAX_PFNS_PER_CHAIN {
                break 'chain;
            }
            let Some(at) = desc.addr().checked_add(4 * i as u64) else {
                break;
            };
            match mem.read_obj::<u32>(at) {
                Ok(pfn) => pfns.push(u64::from(u32::from_le(pfn))),
                Err(_) => break,
            }
        }
    }
    merge_pfns(pfns)
}

/// Sorted, deduplicated PFNs as byte ranges of adjacent pages.
pub fn merge_pfns(mut pfns: Vec<u64>) -> Vec<GuestRange> {
    pfns.sort_unstable();
    pfns.dedup();
    let mut ranges: Vec<GuestRange> = Vec::new();
    for pfn in pfns {
        let start = pfn << PFN_SHIFT;
        match ranges.last_mut() {
            Some((s, len)) if *s + *len == start => *len += 1 << PFN_SHIFT,
            _ => ranges.push((start, 1 << PFN_SHIFT)),
        }
    }
    ranges
}

/// The `(tag, value)` statistics in a stats chain's readable buffers.
pub fn stats<M: GuestMemoryTrait>(mem: &M, chain: DescriptorChain<&M>) -> Vec<(u16, u64)> {
    let mut out = Vec::new();
    for desc in chain.readable() {
        let count = u64::from(desc.len()) / STAT_LEN;
        for i in 0..count {
            if out.len() >= MAX_STATS {
                return out;
            }
            let Some(at) = desc.addr().checked_add(i * STAT_LEN) else {
                break;
            };
            let mut raw = [0u8; STAT_LEN as usize];
            if mem.read_slice(&mut raw, at).is_err() {
                break;
            }
            let tag = u16::from_le_bytes([raw[0], raw[1]]);
            let mut value = [0u8; 8];
            value.copy_from_slice(&raw[2..]);
            out.push((tag, u64::from_le_bytes(value)));
        }
    }
    out
}

/// The free ranges of a page report: one per buffer (the guest hands the
/// device its free pages as device-writable buffers of whole pages).
pub fn reported_ranges<M: GuestMemoryTrait>(chain: DescriptorChain<&M>) -> Vec<GuestRange> {
    chain
        .map(|desc| (desc.addr().0, u64::from(desc.len())))
        .filter(|&(_, len)| len > 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_pfns_merge_into_ranges() {
        assert_eq!(
            merge_pfns(vec![5, 3, 4, 9, 4, 10, 20]),
            vec![(3 << 12, 3 << 12), (9 << 12, 2 << 12), (20 << 12, 1 << 12)]
        );
        assert_eq!(merge_pfns(vec![]), vec![]);
        // The largest PFN a u32 holds does not overflow the byte address.
        let top = u64::from(u32::MAX);
        assert_eq!(merge_pfns(vec![top]), vec![(top << 12, 4096)]);
    }
}

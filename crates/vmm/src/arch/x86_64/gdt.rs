//! The boot GDT: flat 64-bit code and data segments and a TSS, encoded both as
//! descriptor table entries (written to guest memory) and as the matching
//! `kvm_segment`s (loaded into the vCPU's segment registers).

use kvm_bindings::kvm_segment;

/// Selectors of the boot GDT's entries, in order.
pub const CODE_SELECTOR: u16 = 0x08;
pub const DATA_SELECTOR: u16 = 0x10;
pub const TSS_SELECTOR: u16 = 0x18;

/// Encodes a segment descriptor from its flags (the high nibble of byte 6 and
/// byte 5: G, D/B, L, AVL, P, DPL, S, type), base and limit.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << (56 - 24))
        | ((flags as u64 & 0x0000_f0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << (48 - 16))
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
}

/// The boot GDT: null, code (64-bit, execute/read), data (read/write), TSS.
pub const BOOT_GDT: [u64; 4] = [
    gdt_entry(0, 0, 0),
    gdt_entry(0xa09b, 0, 0xfffff),
    gdt_entry(0xc093, 0, 0xfffff),
    gdt_entry(0x808b, 0, 0xfffff),
];

fn base(entry: u64) -> u64 {
    ((entry & 0xff00_0000_0000_0000) >> 32)
        | ((entry & 0x0000_00ff_0000_0000) >> 16)
        | ((entry & 0x0000_0000_ffff_0000) >> 16)
}

fn limit(entry: u64) -> u32 {
    let raw = (((entry & 0x000f_0000_0000_0000) >> 32) | (entry & 0x0000_0000_0000_ffff)) as u32;
    // With 4 KiB granularity the limit counts pages.
    if granularity(entry) == 0 {
        raw
    } else {
        (raw << 12) | 0xfff
    }
}

fn bit(entry: u64, shift: u32) -> u8 {
    ((entry >> shift) & 1) as u8
}

fn granularity(entry: u64) -> u8 {
    bit(entry, 55)
}

/// The `kvm_segment` KVM expects for GDT entry `index` of `table`.
pub fn kvm_segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    kvm_segment {
        base: base(entry),
        limit: limit(entry),
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: bit(entry, 47),
        dpl: ((entry >> 45) & 0x3) as u8,
        db: bit(entry, 54),
        s: bit(entry, 44),
        l: bit(entry, 53),
        g: granularity(entry),
        avl: bit(entry, 52),
        padding: 0,
        unusable: u8::from(bit(entry, 47) == 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_segment_is_64_bit_present_and_flat() {
        let seg = kvm_segment_from_gdt(BOOT_GDT[1], 1);
        assert_eq!(seg.selector, CODE_SELECTOR);
        assert_eq!((seg.l, seg.db, seg.present, seg.s, seg.g), (1, 0, 1, 1, 1));
        assert_eq!(seg.type_, 0xb);
        assert_eq!(seg.base, 0);
        assert_eq!(seg.limit, 0xffff_ffff);
    }

    #[test]
    fn encode_decode_round_trip() {
        let entry = gdt_entry(0x008b, 0x1234_5678, 0xabcd);
        let seg = kvm_segment_from_gdt(entry, 3);
        assert_eq!(seg.base, 0x1234_5678);
        assert_eq!(seg.limit, 0xabcd);
        assert_eq!(seg.selector, TSS_SELECTOR);
        assert_eq!(seg.type_, 0xb);
    }
}

//! Just enough ELF64 reading for two questions: what a kernel module's `.modinfo`
//! says, and whether an executable is statically linked. Never panics on bad input.

fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        b.get(off..off.checked_add(2)?)?.try_into().ok()?,
    ))
}

fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(off..off.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn u64_at(b: &[u8], off: usize) -> Option<usize> {
    usize::try_from(u64::from_le_bytes(
        b.get(off..off.checked_add(8)?)?.try_into().ok()?,
    ))
    .ok()
}

/// Checks the magic, 64-bit class and little-endian encoding.
fn is_elf64_le(b: &[u8]) -> bool {
    b.len() >= 64 && b[..4] == *b"\x7fELF" && b[4] == 2 && b[5] == 1
}

/// The bytes of the section called `name`, if the file has one.
pub(crate) fn section<'a>(b: &'a [u8], name: &str) -> Option<&'a [u8]> {
    if !is_elf64_le(b) {
        return None;
    }
    let shoff = u64_at(b, 0x28)?;
    let shentsize = usize::from(u16_at(b, 0x3a)?);
    let shnum = usize::from(u16_at(b, 0x3c)?);
    let shstrndx = usize::from(u16_at(b, 0x3e)?);
    if shentsize < 0x40 {
        return None;
    }
    let header = |i: usize| -> Option<(usize, usize, usize)> {
        let h = shoff.checked_add(i.checked_mul(shentsize)?)?;
        let name = usize::try_from(u32_at(b, h)?).ok()?;
        Some((
            name,
            u64_at(b, h.checked_add(0x18)?)?,
            u64_at(b, h.checked_add(0x20)?)?,
        ))
    };
    let (_, str_off, str_size) = header(shstrndx)?;
    let strtab = b.get(str_off..str_off.checked_add(str_size)?)?;
    for i in 0..shnum {
        let (name_off, off, size) = header(i)?;
        let rest = strtab.get(name_off..)?;
        let end = rest.iter().position(|&c| c == 0)?;
        if &rest[..end] == name.as_bytes() {
            return b.get(off..off.checked_add(size)?);
        }
    }
    None
}

/// True when the ELF file has no program interpreter (PT_INTERP), i.e. is static.
/// None when it is not a readable ELF64 file.
pub(crate) fn is_static(b: &[u8]) -> Option<bool> {
    const PT_INTERP: u32 = 3;
    if !is_elf64_le(b) {
        return None;
    }
    let phoff = u64_at(b, 0x20)?;
    let phentsize = usize::from(u16_at(b, 0x36)?);
    let phnum = usize::from(u16_at(b, 0x38)?);
    for i in 0..phnum {
        let h = phoff.checked_add(i.checked_mul(phentsize)?)?;
        if u32_at(b, h)? == PT_INTERP {
            return Some(false);
        }
    }
    Some(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_is_not_elf() {
        assert_eq!(is_static(b"not an elf"), None);
        assert_eq!(section(b"\x7fELF", ".modinfo"), None);
        // A header that claims sections far past the end of the file.
        let mut b = vec![0u8; 64];
        b[..6].copy_from_slice(b"\x7fELF\x02\x01");
        b[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes());
        b[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        b[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        assert_eq!(section(&b, ".modinfo"), None);
    }

    #[test]
    fn host_binaries_link_as_expected() {
        // Every Debian host has a dynamically linked /bin/sh (dash).
        let sh = std::fs::read("/bin/sh").expect("read /bin/sh");
        assert_eq!(is_static(&sh), Some(false));
        assert!(section(&sh, ".text").is_some());
        assert!(section(&sh, ".modinfo").is_none());
    }
}

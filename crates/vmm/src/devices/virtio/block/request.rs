//! Parsing a virtio-blk request out of a descriptor chain.
//!
//! A request (virtio 1.2, 5.2.6) is a 16-byte header `{le32 type, le32 reserved,
//! le64 sector}` in device-readable buffers, then the data, then one status byte at
//! the very end of the device-writable buffers. VIRTIO_F_VERSION_1 frees the framing
//! (2.6.4), so the parser treats the readable and the writable descriptors as two byte
//! streams instead of expecting one descriptor per part.
//!
//! Every buffer is checked against guest memory here, before any I/O is done.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_queue::DescriptorChain;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

use super::disk::SECTOR_SIZE;
use crate::vstate::memory::GuestMemory;

/// Length of the request header.
pub const HEADER_LEN: u64 = 16;

/// A run of guest memory belonging to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub addr: GuestAddress,
    pub len: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestType {
    /// Read from the disk into the guest.
    In,
    /// Write guest data to the disk.
    Out,
    Flush,
    GetId,
    Unsupported(u32),
}

impl From<u32> for RequestType {
    fn from(value: u32) -> Self {
        match value {
            VIRTIO_BLK_T_IN => RequestType::In,
            VIRTIO_BLK_T_OUT => RequestType::Out,
            VIRTIO_BLK_T_FLUSH => RequestType::Flush,
            VIRTIO_BLK_T_GET_ID => RequestType::GetId,
            other => RequestType::Unsupported(other),
        }
    }
}

/// A well-formed request; its buffers all lie in guest memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub request_type: RequestType,
    pub sector: u64,
    /// The data buffers: device-readable for `Out`, device-writable (status byte
    /// excluded) for `In` and `GetId`; whatever follows the header otherwise.
    pub data: Vec<Segment>,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

impl Request {
    /// Total length of the data buffers in bytes.
    pub fn data_len(&self) -> u64 {
        total_len(&self.data)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("a descriptor lies outside guest memory")]
    OutsideMemory,
    #[error("a device-readable descriptor follows a device-writable one")]
    ReadableAfterWritable,
    #[error("the chain does not end in a device-writable status byte")]
    NoStatus,
    #[error("the header has {0} bytes, not {HEADER_LEN}")]
    ShortHeader(u64),
    #[error("the data buffers go the wrong way for a {0:?} request")]
    WrongDirection(RequestType),
    #[error("data length {0} is not a multiple of the sector size")]
    UnalignedLength(u64),
}

/// A chain that is not a valid request. With a status byte the device can still
/// answer IOERR; without one it can only return the chain unanswered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Malformed {
    pub error: ParseError,
    pub status: Option<GuestAddress>,
}

/// Parses the request in `chain`, reading its header from guest memory.
pub fn parse(chain: DescriptorChain<&GuestMemory>) -> Result<Request, Malformed> {
    let mem = chain.memory();
    let mut readable = Vec::new();
    let mut writable = Vec::new();
    let mut layout_error = None;
    // The iterator follows indirect tables and stops on loops (a chain holds at most
    // the queue size of descriptors) and at 4 GiB in total.
    for desc in chain.clone() {
        if desc.len() == 0 {
            continue;
        }
        let seg = Segment {
            addr: desc.addr(),
            len: desc.len(),
        };
        if !GuestMemoryBackend::check_range(mem, seg.addr, seg.len as usize) {
            layout_error.get_or_insert(ParseError::OutsideMemory);
        }
        if desc.is_write_only() {
            writable.push(seg);
        } else {
            if !writable.is_empty() {
                layout_error.get_or_insert(ParseError::ReadableAfterWritable);
            }
            readable.push(seg);
        }
    }

    let status = take_status(mem, &mut writable).ok_or(Malformed {
        error: ParseError::NoStatus,
        status: None,
    })?;
    let bad = |error| Malformed {
        error,
        status: Some(status),
    };
    if let Some(error) = layout_error {
        return Err(bad(error));
    }

    let readable_len = total_len(&readable);
    if readable_len < HEADER_LEN {
        return Err(bad(ParseError::ShortHeader(readable_len)));
    }
    let (header_segs, after_header) = split_at(&readable, HEADER_LEN);
    let mut header = [0u8; HEADER_LEN as usize];
    let mut filled = 0;
    for seg in header_segs {
        let end = filled + seg.len as usize;
        // Checked against guest memory above, so this cannot fail; answer IOERR if it does.
        mem.read_slice(&mut header[filled..end], seg.addr)
            .map_err(|_| bad(ParseError::OutsideMemory))?;
        filled = end;
    }
    let request_type = RequestType::from(u32::from_le_bytes([
        header[0], header[1], header[2], header[3],
    ]));
    let sector = u64::from_le_bytes([
        header[8], header[9], header[10], header[11], header[12], header[13], header[14],
        header[15],
    ]);

    let data = match request_type {
        RequestType::In | RequestType::GetId => {
            if !after_header.is_empty() {
                return Err(bad(ParseError::WrongDirection(request_type)));
            }
            writable
        }
        RequestType::Out => {
            if !writable.is_empty() {
                return Err(bad(ParseError::WrongDirection(request_type)));
            }
            after_header
        }
        // No data is defined for these; keep what there is for the record.
        RequestType::Flush | RequestType::Unsupported(_) => {
            let mut rest = after_header;
            rest.extend(writable);
            rest
        }
    };
    let data_len = total_len(&data);
    if matches!(request_type, RequestType::In | RequestType::Out)
        && !data_len.is_multiple_of(SECTOR_SIZE)
    {
        return Err(bad(ParseError::UnalignedLength(data_len)));
    }

    Ok(Request {
        request_type,
        sector,
        data,
        status,
    })
}

/// Takes the last byte of the writable stream as the status byte, if it lies in
/// guest memory.
fn take_status(mem: &GuestMemory, writable: &mut Vec<Segment>) -> Option<GuestAddress> {
    let last = writable.last_mut()?;
    let addr = last.addr.checked_add(u64::from(last.len) - 1)?;
    if !GuestMemoryBackend::check_range(mem, addr, 1) {
        return None;
    }
    last.len -= 1;
    if last.len == 0 {
        writable.pop();
    }
    Some(addr)
}

fn total_len(segs: &[Segment]) -> u64 {
    segs.iter().map(|s| u64::from(s.len)).sum()
}

/// Splits `segs` after the first `at` bytes (`at` must not exceed their total).
fn split_at(segs: &[Segment], at: u64) -> (Vec<Segment>, Vec<Segment>) {
    let mut head = Vec::new();
    let mut tail = Vec::new();
    let mut left = at;
    for &seg in segs {
        let len = u64::from(seg.len);
        if left >= len {
            head.push(seg);
            left -= len;
        } else if left > 0 {
            // `left` < `seg.len`, so it fits in u32 and the address does not overflow.
            let cut = left as u32;
            head.push(Segment {
                addr: seg.addr,
                len: cut,
            });
            tail.push(Segment {
                addr: seg.addr.unchecked_add(left),
                len: seg.len - cut,
            });
            left = 0;
        } else {
            tail.push(seg);
        }
    }
    (head, tail)
}

#[cfg(test)]
mod tests {
    use virtio_bindings::virtio_blk::VIRTIO_BLK_T_DISCARD;

    use super::super::testing::{Desc, Driver};
    use super::*;

    const HDR: u64 = 0x1_0000;
    const DATA: u64 = 0x2_0000;
    const STATUS: u64 = 0x3_0000;

    /// Lays out `descs` as one chain and parses it as the device would.
    fn parse_chain(driver: &mut Driver, descs: &[Desc]) -> Result<Request, Malformed> {
        let mut queue = driver.queue();
        driver.add_chain(descs);
        let mem = driver.mem.clone();
        let chain = virtio_queue::QueueT::pop_descriptor_chain(&mut queue, &mem).unwrap();
        parse(chain)
    }

    fn seg(addr: u64, len: u32) -> Segment {
        Segment {
            addr: GuestAddress(addr),
            len,
        }
    }

    #[test]
    fn three_descriptor_read() {
        let mut d = Driver::new();
        d.write_header(HDR, VIRTIO_BLK_T_IN, 7);
        let req = parse_chain(
            &mut d,
            &[Desc::r(HDR, 16), Desc::w(DATA, 1024), Desc::w(STATUS, 1)],
        )
        .unwrap();
        assert_eq!(
            req,
            Request {
                request_type: RequestType::In,
                sector: 7,
                data: vec![seg(DATA, 1024)],
                status: GuestAddress(STATUS),
            }
        );
    }

    #[test]
    fn free_framing_is_accepted() {
        // Header split over two descriptors, the first data bytes sharing the second;
        // the status byte at the end of the last data descriptor.
        let mut d = Driver::new();
        d.write_header(HDR, VIRTIO_BLK_T_OUT, u64::MAX - 1);
        let req = parse_chain(
            &mut d,
            &[
                Desc::r(HDR, 10),
                Desc::r(HDR + 10, 6 + 512),
                Desc::w(STATUS, 1),
            ],
        )
        .unwrap();
        assert_eq!(req.request_type, RequestType::Out);
        assert_eq!(req.sector, u64::MAX - 1);
        assert_eq!(req.data, vec![seg(HDR + 16, 512)]);

        let mut d = Driver::new();
        d.write_header(HDR, VIRTIO_BLK_T_IN, 1);
        let req = parse_chain(&mut d, &[Desc::r(HDR, 16), Desc::w(DATA, 513)]).unwrap();
        assert_eq!(req.data, vec![seg(DATA, 512)]);
        assert_eq!(req.status, GuestAddress(DATA + 512));
    }

    #[test]
    fn zero_length_descriptors_are_skipped() {
        let mut d = Driver::new();
        d.write_header(HDR, VIRTIO_BLK_T_FLUSH, 0);
        let req = parse_chain(
            &mut d,
            &[
                Desc::r(HDR, 16),
                Desc::w(DATA, 0),
                Desc::w(STATUS, 1),
                Desc::w(DATA, 0),
            ],
        )
        .unwrap();
        assert_eq!(req.request_type, RequestType::Flush);
        assert_eq!(req.status, GuestAddress(STATUS));
        assert!(req.data.is_empty());
    }

    #[test]
    fn unknown_type_parses_as_unsupported() {
        let mut d = Driver::new();
        d.write_header(HDR, VIRTIO_BLK_T_DISCARD, 0);
        let req = parse_chain(&mut d, &[Desc::r(HDR, 16), Desc::w(STATUS, 1)]).unwrap();
        assert_eq!(
            req.request_type,
            RequestType::Unsupported(VIRTIO_BLK_T_DISCARD)
        );
    }

    fn malformed(descs: &[Desc], kind: u32) -> Malformed {
        let mut d = Driver::new();
        d.write_header(HDR, kind, 0);
        parse_chain(&mut d, descs).unwrap_err()
    }

    #[test]
    fn chain_without_status_cannot_be_answered() {
        let m = malformed(&[Desc::r(HDR, 16), Desc::r(DATA, 512)], VIRTIO_BLK_T_OUT);
        assert_eq!(
            m,
            Malformed {
                error: ParseError::NoStatus,
                status: None
            }
        );
        // A status byte outside guest memory is no status byte either.
        let m = malformed(
            &[Desc::r(HDR, 16), Desc::w(Driver::MEM_SIZE, 1)],
            VIRTIO_BLK_T_FLUSH,
        );
        assert_eq!(m.error, ParseError::NoStatus);
    }

    #[test]
    fn malformed_chains_with_status_get_an_error() {
        let status = Some(GuestAddress(STATUS));
        let cases: Vec<(Vec<Desc>, u32, ParseError)> = vec![
            (
                vec![Desc::r(HDR, 8), Desc::w(STATUS, 1)],
                VIRTIO_BLK_T_FLUSH,
                ParseError::ShortHeader(8),
            ),
            (
                vec![Desc::r(HDR, 16), Desc::r(DATA, 512), Desc::w(STATUS, 1)],
                VIRTIO_BLK_T_IN,
                ParseError::WrongDirection(RequestType::In),
            ),
            (
                vec![Desc::r(HDR, 16), Desc::w(DATA, 512), Desc::w(STATUS, 1)],
                VIRTIO_BLK_T_OUT,
                ParseError::WrongDirection(RequestType::Out),
            ),
            (
                vec![Desc::r(HDR, 16), Desc::w(DATA, 100), Desc::w(STATUS, 1)],
                VIRTIO_BLK_T_IN,
                ParseError::UnalignedLength(100),
            ),
            (
                vec![
                    Desc::r(HDR, 16),
                    Desc::w(DATA, 512),
                    Desc::r(DATA, 512),
                    Desc::w(STATUS, 1),
                ],
                VIRTIO_BLK_T_IN,
                ParseError::ReadableAfterWritable,
            ),
            (
                vec![
                    Desc::r(HDR, 16),
                    Desc::w(Driver::MEM_SIZE - 512, 1024),
                    Desc::w(STATUS, 1),
                ],
                VIRTIO_BLK_T_IN,
                ParseError::OutsideMemory,
            ),
            (
                vec![Desc::r(u64::MAX - 8, 16), Desc::w(STATUS, 1)],
                VIRTIO_BLK_T_IN,
                ParseError::OutsideMemory,
            ),
        ];
        for (descs, kind, error) in cases {
            assert_eq!(
                malformed(&descs, kind),
                Malformed { error, status },
                "{descs:?}"
            );
        }
    }

    #[test]
    fn split_at_cuts_inside_a_segment() {
        let segs = [seg(0x100, 10), seg(0x200, 10)];
        let (head, tail) = split_at(&segs, 15);
        assert_eq!(head, vec![seg(0x100, 10), seg(0x200, 5)]);
        assert_eq!(tail, vec![seg(0x205, 5)]);
        let (head, tail) = split_at(&segs, 10);
        assert_eq!(head, vec![seg(0x100, 10)]);
        assert_eq!(tail, vec![seg(0x200, 10)]);
    }
}

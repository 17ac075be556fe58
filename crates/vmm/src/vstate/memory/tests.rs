use vm_memory::Bytes;

use super::*;

const MIB: u64 = 1 << 20;

fn write(ram: &GuestRam, addr: u64, bytes: &[u8]) {
    ram.guest_memory()
        .write_slice(bytes, GuestAddress(addr))
        .unwrap();
}

fn read(ram: &GuestRam, addr: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0; len];
    ram.guest_memory()
        .read_slice(&mut buf, GuestAddress(addr))
        .unwrap();
    buf
}

fn blocks(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn a_full_snapshot_holds_only_written_pages_and_restores_them() {
    let dir = tempfile::tempdir().unwrap();
    let mut ram = GuestRam::new(64 * MIB).unwrap();
    write(&ram, 0x1000, b"low memory");
    write(&ram, 40 * MIB, &[0xab; 8192]);
    let path = dir.path().join("mem");
    let (state, written) = ram.snapshot(MemorySnapshotKind::Full, &path).unwrap();
    assert_eq!(written.bytes, 3 * 4096);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 64 * MIB);
    assert!(blocks(&path) < MIB, "the memory file is sparse");
    assert_eq!(state.layers.len(), 1);
    assert!(state.layers[0].ranges.is_none());
    assert!(
        !dir.path().read_dir().unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .contains(".tmp")),
        "no temporary file is left"
    );

    // The VM keeps its content, now mapped from the file.
    assert_eq!(read(&ram, 0x1000, 10), b"low memory");
    let restored = GuestRam::restore(&state).unwrap();
    assert_eq!(read(&restored, 0x1000, 10), b"low memory");
    assert_eq!(read(&restored, 40 * MIB, 8192), vec![0xab; 8192]);
    assert_eq!(read(&restored, 20 * MIB, 4), vec![0; 4]);
}

#[test]
fn writes_after_a_restore_stay_private_to_that_vm() {
    let dir = tempfile::tempdir().unwrap();
    let mut ram = GuestRam::new(16 * MIB).unwrap();
    write(&ram, 0x2000, b"shared");
    let (state, _) = ram
        .snapshot(MemorySnapshotKind::Full, &dir.path().join("mem"))
        .unwrap();
    let a = GuestRam::restore(&state).unwrap();
    let b = GuestRam::restore(&state).unwrap();
    write(&a, 0x2000, b"AAAAAA");
    assert_eq!(read(&b, 0x2000, 6), b"shared");
    assert_eq!(read(&ram, 0x2000, 6), b"shared");
    let c = GuestRam::restore(&state).unwrap();
    assert_eq!(read(&c, 0x2000, 6), b"shared", "the file is unchanged");
}

#[test]
fn a_diff_snapshot_writes_only_pages_written_since_the_last_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut ram = GuestRam::new(32 * MIB).unwrap();
    let diff = dir.path().join("diff0");
    assert!(matches!(
        ram.snapshot(MemorySnapshotKind::Diff, &diff),
        Err(MemoryError::NoBaseForDiff)
    ));
    write(&ram, 0, &[1; 4096 * 4]);
    ram.snapshot(MemorySnapshotKind::Full, &dir.path().join("base"))
        .unwrap();

    write(&ram, 8192, b"second");
    write(&ram, 20 * MIB, b"far away");
    let (state, written) = ram
        .snapshot(MemorySnapshotKind::Diff, &dir.path().join("diff1"))
        .unwrap();
    assert_eq!(written.bytes, 2 * 4096);
    assert_eq!(state.layers.len(), 2);
    assert_eq!(
        state.layers[1].ranges.as_deref(),
        Some(&[(8192, 3 * 4096), (20 * MIB, 20 * MIB + 4096)][..])
    );

    // Nothing written since: an empty diff.
    let (state2, written) = ram
        .snapshot(MemorySnapshotKind::Diff, &dir.path().join("diff2"))
        .unwrap();
    assert_eq!(written.bytes, 0);
    assert_eq!(state2.layers.len(), 3);
    // A path one of its layers is mapped from is refused (a new file there
    // would be read for that layer's pages on a restore).
    write(&ram, 4096, b"again");
    assert!(matches!(
        ram.snapshot(MemorySnapshotKind::Diff, &dir.path().join("diff1")),
        Err(MemoryError::InUse { .. })
    ));
    write(&ram, 4096, &[1; 5]);

    let restored = GuestRam::restore(&state).unwrap();
    assert_eq!(read(&restored, 0, 4), vec![1; 4]);
    assert_eq!(read(&restored, 8192, 6), b"second");
    assert_eq!(read(&restored, 8192 + 6, 2), vec![1; 2]);
    assert_eq!(read(&restored, 20 * MIB, 8), b"far away");

    // A full snapshot of a layered VM folds every layer into one file.
    let (full, written) = ram
        .snapshot(MemorySnapshotKind::Full, &dir.path().join("full"))
        .unwrap();
    assert_eq!(full.layers.len(), 1);
    assert_eq!(written.bytes, 5 * 4096);
    let restored = GuestRam::restore(&full).unwrap();
    assert_eq!(read(&restored, 20 * MIB, 8), b"far away");
}

#[test]
fn a_memory_file_of_the_wrong_size_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut ram = GuestRam::new(16 * MIB).unwrap();
    let path = dir.path().join("mem");
    let (state, _) = ram.snapshot(MemorySnapshotKind::Full, &path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(
        GuestRam::restore(&state),
        Err(MemoryError::File { .. })
    ));
    std::fs::write(&path, b"short").unwrap();
    assert!(matches!(
        GuestRam::restore(&state),
        Err(MemoryError::FileSize { actual: 5, .. })
    ));
}

/// Found by the `snapshot_state` fuzz target: region lengths adding up past
/// `u64` overflowed (a panic with overflow checks, a wrapped size without).
#[test]
fn region_lengths_past_u64_are_refused() {
    let half = 1u64 << 63;
    let state = MemoryState {
        regions: vec![
            RegionLayout {
                guest_addr: 0,
                len: half,
                file_offset: 0,
            },
            RegionLayout {
                guest_addr: half,
                len: half,
                file_offset: half,
            },
        ],
        layers: vec![MemoryLayer {
            path: "/nonexistent".into(),
            ranges: None,
        }],
    };
    assert_eq!(state.size(), u64::MAX);
    assert!(matches!(
        GuestRam::restore(&state),
        Err(MemoryError::Layout(_))
    ));
}

#[test]
fn invalid_layouts_are_refused() {
    let state = MemoryState {
        regions: vec![RegionLayout {
            guest_addr: 0,
            len: 4096,
            file_offset: 0,
        }],
        layers: vec![],
    };
    assert!(matches!(
        GuestRam::restore(&state),
        Err(MemoryError::Layout(_))
    ));
    let overlay_outside = MemoryState {
        layers: vec![
            MemoryLayer {
                path: "/nonexistent".into(),
                ranges: None,
            },
            MemoryLayer {
                path: "/nonexistent".into(),
                ranges: Some(vec![(0, 8192)]),
            },
        ],
        ..state
    };
    assert!(matches!(
        GuestRam::restore(&overlay_outside),
        Err(MemoryError::Layout(_))
    ));
}

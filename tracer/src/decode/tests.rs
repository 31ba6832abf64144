use tracer_common::{rm_cmd, CLASS_PARAMS_MAX, PARAMS_MAX};

use super::*;
use crate::abi::{status, DriverVersion};

fn layout(major: u32, minor: u32, patch: u32) -> Layout {
    Layout::for_version(DriverVersion::new(major, minor, patch))
}

/// A params struct of `size` bytes with fields written at their verified offsets.
struct Buf(Vec<u8>);
impl Buf {
    fn new(size: usize) -> Self {
        Buf(vec![0; size])
    }
    fn u32(mut self, at: usize, v: u32) -> Self {
        self.0[at..at + 4].copy_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, at: usize, v: u64) -> Self {
        self.0[at..at + 8].copy_from_slice(&v.to_le_bytes());
        self
    }
}

fn rm(nr: u32, params: Buf, class_params: Vec<u8>) -> RawIoctl {
    let size = params.0.len() as u32;
    RawIoctl {
        fd: 7,
        cmd: rm_cmd(nr, size),
        escape_cmd: rm_cmd(nr, size),
        ret: 0,
        device: Some(Device::Ctl),
        flags: 0,
        file: 0,
        named_file: 0,
        params: params.0,
        class_params,
    }
}

fn uvm_raw(cmd: u32, params: Buf) -> RawIoctl {
    RawIoctl {
        fd: 9,
        cmd,
        escape_cmd: cmd,
        ret: 0,
        device: Some(Device::Uvm),
        flags: 0,
        file: 0,
        named_file: 0,
        params: params.0,
        class_params: vec![],
    }
}

fn memory_params(layout: &Layout, bytes: u64) -> Vec<u8> {
    Buf::new(layout.memory_params_size as usize).u64(64, bytes).0
}

fn alloc(event: Option<Event>) -> Alloc {
    match event {
        Some(Event::Alloc(a)) => a,
        other => panic!("expected an allocation, got {other:?}"),
    }
}

/// NVOS21 for each branch: status @24 before 535, @28 from 535 on.
#[test]
fn rm_alloc_nvos21_status_moves_at_535() {
    for (l, status_at) in [(layout(515, 65, 1), 24), (layout(525, 60, 13), 24), (layout(535, 104, 5), 28), (layout(580, 95, 5), 28)] {
        let params = Buf::new(32).u32(0, 0xc1d00001).u32(4, 0xbeef0001).u32(8, 0xcafe0001).u32(12, 0x40).u32(status_at, status::NO_MEMORY);
        let a = alloc(decode_ioctl(&l, &rm(escape::RM_ALLOC, params, memory_params(&l, 20 << 20))));
        assert_eq!(a.via, Via::RmAllocNvos21);
        assert_eq!((a.client, a.parent, a.object, a.class), (0xc1d00001, 0xbeef0001, 0xcafe0001, 0x40));
        assert_eq!(a.memory, Memory::Video);
        assert_eq!(a.bytes, 20 << 20);
        assert_eq!(a.status, status::NO_MEMORY, "status for {l:?}");
        assert!(!a.succeeded());
    }
}

/// NVOS64: 40 bytes with status @32 (515) or @36 (525); 48 bytes with status @40 from 535.
#[test]
fn rm_alloc_nvos64_every_variant() {
    for (l, size, status_at) in
        [(layout(515, 65, 1), 40, 32), (layout(525, 60, 13), 40, 36), (layout(535, 104, 5), 48, 40), (layout(595, 45, 4), 48, 40)]
    {
        let params = Buf::new(size).u32(0, 1).u32(4, 2).u32(8, 3).u32(12, 0x3e).u32(status_at, 0);
        let a = alloc(decode_ioctl(&l, &rm(escape::RM_ALLOC, params, memory_params(&l, 4096))));
        assert_eq!(a.via, Via::RmAllocNvos64);
        assert_eq!(a.memory, Memory::System);
        assert_eq!(a.bytes, 4096);
        assert!(a.succeeded());
    }
}

#[test]
fn rm_alloc_sizes_every_memory_class() {
    let l = layout(580, 95, 5);
    let cases: [(u32, Vec<u8>, Memory, u64); 5] = [
        (0x50a0, memory_params(&l, 1 << 30), Memory::Virtual, 1 << 30),
        (0x70, Buf::new(24).u64(8, 0x1ffffffffffff).0, Memory::Virtual, 0x2000000000000),
        (0x71, Buf::new(40).u64(24, 65535).0, Memory::System, 65536),
        (0xf8, Buf::new(48).u64(8, 512 << 20).0, Memory::Virtual, 512 << 20),
        (0x40, memory_params(&l, 7), Memory::Video, 7),
    ];
    for (hclass, class_params, memory, bytes) in cases {
        let params = Buf::new(48).u32(12, hclass);
        let a = alloc(decode_ioctl(&l, &rm(escape::RM_ALLOC, params, class_params)));
        assert_eq!((a.class, a.memory, a.bytes), (hclass, memory, bytes), "class {hclass:#x}");
    }
}

/// A fabric object (0xf8) made over existing memory (map.hVidMem@40) holds that memory unless it
/// is FLEXIBLE (allocFlags@24 bit 0), whose memory is attached later and not held.
#[test]
fn a_sticky_fabric_object_names_the_memory_it_holds() {
    let l = layout(580, 142, 0);
    let fabric = |flags: u32, vidmem: u32| {
        let params = Buf::new(48).u32(0, 0xc1d00001).u32(12, 0xf8);
        alloc(decode_ioctl(&l, &rm(escape::RM_ALLOC, params, Buf::new(48).u64(8, 2 << 20).u32(24, flags).u32(40, vidmem).0)))
    };
    assert_eq!(fabric(0, 0xcafe0001).holds, Some(0xcafe0001));
    assert_eq!(fabric(0b100, 0xcafe0001).holds, Some(0xcafe0001), "CONTIGUOUS is still sticky");
    assert_eq!(fabric(1, 0xcafe0001).holds, None, "flexible");
    assert_eq!(fabric(0, 0).holds, None, "made over nothing");
    assert_eq!((fabric(0, 0xcafe0001).memory, fabric(0, 0xcafe0001).bytes), (Memory::Virtual, 2 << 20));
}

/// EGM (0x42) is host memory (size in NV_MEMORY_ALLOCATION_PARAMS); multicast fabric (0xfd) is
/// address space, its params 40 bytes (allocSize@8) before 545 and 80 (allocSize@48) from 545.
#[test]
fn rm_alloc_of_egm_and_multicast_fabric() {
    for l in [layout(535, 288, 1), layout(580, 142, 0)] {
        let params = Buf::new(48).u32(12, 0x42);
        let egm = alloc(decode_ioctl(&l, &rm(escape::RM_ALLOC, params, memory_params(&l, 2 << 30))));
        assert_eq!((egm.memory, egm.bytes, egm.class), (Memory::System, 2 << 30, 0x42));
    }
    for (l, size, at) in [(layout(535, 288, 1), 40, 8), (layout(550, 163, 1), 80, 48), (layout(595, 45, 4), 80, 48)] {
        assert_eq!(l.class_params_size(0xfd), Some(size));
        let params = Buf::new(48).u32(12, 0xfd);
        let mc = alloc(decode_ioctl(&l, &rm(escape::RM_ALLOC, params, Buf::new(size as usize).u64(at, 512 << 20).0)));
        assert_eq!((mc.memory, mc.bytes), (Memory::Virtual, 512 << 20), "{size}-byte params");
    }
}

#[test]
fn rm_alloc_of_a_client_is_an_object_rooted_at_itself() {
    let l = layout(580, 95, 5);
    let params = Buf::new(32).u32(0, 0).u32(4, 0).u32(8, 0xc1d00042).u32(12, 0x41);
    assert_eq!(
        decode_ioctl(&l, &rm(escape::RM_ALLOC, params, vec![])),
        Some(Event::Object { fd: 7, client: 0xc1d00042, parent: 0, object: 0xc1d00042, class: 0x41, status: 0, gpu: None })
    );
}

#[test]
fn rm_alloc_of_a_device_names_its_gpu() {
    let l = layout(580, 95, 5);
    let params = Buf::new(48).u32(0, 0xc1d00042).u32(4, 0xc1d00042).u32(8, 0xde00).u32(12, 0x80);
    let event = decode_ioctl(&l, &rm(escape::RM_ALLOC, params, Buf::new(4).u32(0, 3).0));
    assert!(matches!(event, Some(Event::Object { class: 0x80, gpu: Some(3), .. })), "{event:?}");
    // Its params were not read (a fault): the device is still an object, its GPU unknown.
    let params = Buf::new(48).u32(0, 0xc1d00042).u32(4, 0xc1d00042).u32(8, 0xde00).u32(12, 0x80);
    let event = decode_ioctl(&l, &rm(escape::RM_ALLOC, params, vec![]));
    assert!(matches!(event, Some(Event::Object { class: 0x80, gpu: None, .. })), "{event:?}");
}

#[test]
fn rm_alloc_without_class_params_says_why() {
    let l = layout(580, 95, 5);
    let mut raw = rm(escape::RM_ALLOC, Buf::new(48).u32(12, 0x40), vec![]);
    raw.flags = ioctl_flag::CLASS_FAULT;
    match decode_ioctl(&l, &raw) {
        Some(Event::Undecodable { reason, .. }) => assert!(reason.contains("pAllocParms failed"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn vid_heap_control_alloc_size_by_location_and_flags() {
    let l = layout(525, 60, 13);
    let base = || Buf::new(184).u32(0, 0xc1d0).u32(4, 0xde71).u32(8, 2).u32(20, 0).u32(44, 0xabc).u64(88, 3 << 30);
    let video = alloc(decode_ioctl(&l, &rm(escape::RM_VID_HEAP_CONTROL, base().u32(56, 0), vec![])));
    assert_eq!((video.memory, video.bytes, video.object, video.client), (Memory::Video, 3 << 30, 0xabc, 0xc1d0));
    let pci = alloc(decode_ioctl(&l, &rm(escape::RM_VID_HEAP_CONTROL, base().u32(56, 1 << 25), vec![])));
    assert_eq!(pci.memory, Memory::System);
    let virt = alloc(decode_ioctl(&l, &rm(escape::RM_VID_HEAP_CONTROL, base().u32(52, 0x80000), vec![])));
    assert_eq!(virt.memory, Memory::Virtual);
    let failed = alloc(decode_ioctl(&l, &rm(escape::RM_VID_HEAP_CONTROL, base().u32(20, status::NO_MEMORY), vec![])));
    assert_eq!(failed.status, status::NO_MEMORY);
    // attr2 USE_EGM (bit 24, @144): EGM from 550 to 590, and not read before or after.
    for (l, egm) in [(layout(535, 288, 1), false), (layout(550, 40, 7), true), (layout(580, 142, 0), true), (layout(595, 45, 4), false)] {
        let a = alloc(decode_ioctl(&l, &rm(escape::RM_VID_HEAP_CONTROL, base().u32(144, 1 << 24), vec![])));
        let want = if egm { (Memory::System, 0x42) } else { (Memory::Video, 0x40) };
        assert_eq!((a.memory, a.class), want, "{l:?}");
    }
}

/// Only NO_MEMORY and INSUFFICIENT_RESOURCES mean the driver ran out: MEMORY_ERROR is a BAR,
/// NVLink or MMU fault, INVALID_HEAP "heap corrupted" (no open RM code returns it).
#[test]
fn out_of_memory_statuses() {
    assert!(status::is_out_of_memory(status::NO_MEMORY) && status::is_out_of_memory(status::INSUFFICIENT_RESOURCES));
    assert!(!status::is_out_of_memory(status::MEMORY_ERROR) && !status::is_out_of_memory(status::INVALID_HEAP));
}

#[test]
fn vid_heap_control_free_and_info() {
    let l = layout(580, 95, 5);
    let free = Buf::new(184).u32(0, 1).u32(4, 2).u32(8, 3).u32(44, 0xabc);
    assert_eq!(
        decode_ioctl(&l, &rm(escape::RM_VID_HEAP_CONTROL, free, vec![])),
        Some(Event::Free { fd: 7, via: Via::VidHeapControl, client: 1, parent: 2, object: 0xabc, status: 0 })
    );
    assert_eq!(decode_ioctl(&l, &rm(escape::RM_VID_HEAP_CONTROL, Buf::new(184).u32(8, 5), vec![])), None);
}

#[test]
fn rm_alloc_memory_is_limit_plus_one() {
    let l = layout(580, 95, 5);
    let params =
        Buf::new(56).u32(0, 1).u32(4, 2).u32(8, 3).u32(12, 0x71).u64(24, 0x7f0000000000).u64(32, (64 << 20) - 1).u32(40, 0).u32(48, 5);
    let a = alloc(decode_ioctl(&l, &rm(escape::RM_ALLOC_MEMORY, params, vec![])));
    assert_eq!((a.via, a.memory, a.bytes, a.object), (Via::RmAllocMemory, Memory::System, 64 << 20, 3));
}

/// What is not memory is never counted as memory: RM_ALLOC of LOCAL_PHYSICAL (a mapping of the
/// whole framebuffer) and RM_ALLOC_MEMORY of LOCAL_USER (the same), LOCAL_PRIVILEGED or a class not
/// known are objects; RM_ALLOC_MEMORY of MEMORY_VIRTUAL is address space.
#[test]
fn objects_that_are_not_memory_count_nothing() {
    let l = layout(580, 95, 5);
    let physical = decode_ioctl(&l, &rm(escape::RM_ALLOC, Buf::new(48).u32(8, 9).u32(12, 0xc2), Buf::new(24).u64(0, 80 << 30).0));
    assert!(matches!(physical, Some(Event::Object { class: 0xc2, object: 9, .. })), "{physical:?}");
    for hclass in [0x40, 0x3f, 0x1234] {
        let params = Buf::new(56).u32(0, 1).u32(4, 2).u32(8, 3).u32(12, hclass).u64(32, (80 << 30) - 1);
        let event = decode_ioctl(&l, &rm(escape::RM_ALLOC_MEMORY, params, vec![]));
        assert!(matches!(event, Some(Event::Object { object: 3, .. })), "class {hclass:#x}: {event:?}");
    }
    let params = Buf::new(56).u32(0, 1).u32(4, 2).u32(8, 3).u32(12, 0x70).u64(32, (1 << 40) - 1);
    let a = alloc(decode_ioctl(&l, &rm(escape::RM_ALLOC_MEMORY, params, vec![])));
    assert_eq!((a.memory, a.bytes), (Memory::Virtual, 1 << 40));
}

#[test]
fn rm_free_and_dup() {
    let l = layout(580, 95, 5);
    let free = Buf::new(16).u32(0, 0xc1d0).u32(4, 0xc1d0).u32(8, 0xc1d0).u32(12, 0);
    assert_eq!(
        decode_ioctl(&l, &rm(escape::RM_FREE, free, vec![])),
        Some(Event::Free { fd: 7, via: Via::RmFree, client: 0xc1d0, parent: 0xc1d0, object: 0xc1d0, status: 0 })
    );
    let dup = Buf::new(28).u32(0, 10).u32(4, 11).u32(8, 12).u32(12, 20).u32(16, 21).u32(24, 0);
    assert_eq!(
        decode_ioctl(&l, &rm(escape::RM_DUP_OBJECT, dup, vec![])),
        Some(Event::DupObject { fd: 7, client: 10, parent: 11, object: 12, src_client: 20, src_object: 21, status: 0 })
    );
}

/// RM_CONTROL's exports and imports of objects, their params behind NVOS54's pointer as the
/// kernel side copies them; another control, or one whose params were not read, says why.
#[test]
fn rm_control_exports_and_imports_objects() {
    let nvos54 =
        |cmd: u32, status: u32| Buf::new(32).u32(0, 0xc1d00001).u32(4, 0xc1d00001).u32(8, cmd).u64(16, 0x7000).u32(24, 24).u32(28, status);
    let l = layout(550, 54, 15);
    let export = Buf::new(24).u32(0, 1).u32(4, 0xde000001).u32(8, 0xde000001).u32(12, 0xcafe0007).u32(16, 11).0;
    assert_eq!(
        decode_ioctl(&l, &rm(escape::RM_CONTROL, nvos54(0x3d05, 0), export.clone())),
        Some(Event::ExportObject { fd: 7, client: 0xc1d00001, object: 0xcafe0007, to_fd: 11, status: 0 })
    );
    assert_eq!(
        decode_ioctl(&l, &rm(escape::RM_CONTROL, nvos54(0x3d05, 0x1f), export)),
        Some(Event::ExportObject { fd: 7, client: 0xc1d00001, object: 0xcafe0007, to_fd: 11, status: 0x1f })
    );
    let import = Buf::new(20).u32(0, 12).u32(4, 1).u32(8, 0xde000002).u32(12, 0xde000002).u32(16, 0xbeef0003).0;
    assert_eq!(
        decode_ioctl(&l, &rm(escape::RM_CONTROL, nvos54(0x3d06, 0), import.clone())),
        Some(Event::ImportObject { fd: 7, client: 0xc1d00001, parent: 0xde000002, object: 0xbeef0003, from_fd: 12, status: 0 })
    );
    let reason = |event: Option<Event>| match event {
        Some(Event::Undecodable { reason, .. }) => reason,
        other => panic!("expected undecodable, got {other:?}"),
    };
    assert!(reason(decode_ioctl(&l, &rm(escape::RM_CONTROL, nvos54(0x3d06, 0), import[..16].to_vec()))).contains("params behind NVOS54"));
    let mut faulted = rm(escape::RM_CONTROL, nvos54(0x3d05, 0), vec![]);
    faulted.flags = ioctl_flag::CLASS_FAULT;
    assert!(reason(decode_ioctl(&l, &faulted)).starts_with("RM_CONTROL 0x3d05: reading"));
    assert!(reason(decode_ioctl(&l, &rm(escape::RM_CONTROL, nvos54(0x2080_0101, 0), vec![0; 24]))).contains("not a control"));
}

/// The batched forms current libcuda uses (0x3d0b, 0x3d0c), as the kernel side packs them: the
/// head, the count and index, the first handles and, for an import, the types RM wrote back.
#[test]
fn rm_control_exports_and_imports_batches_of_objects() {
    use tracer_common::control::{PACKED_COUNT, PACKED_OBJECTS, PACKED_TYPES};
    let nvos54 = |cmd: u32| Buf::new(32).u32(0, 0xc1d00001).u32(4, 0xc1d00001).u32(8, cmd).u64(16, 0x7000).u32(24, 2128);
    let l = layout(580, 95, 5);
    let count = |n: u32, index: u32| n | index << 16;
    let export = Buf::new(PACKED_TYPES).u32(0, 11).u32(4, 0xde000001).u32(PACKED_COUNT, count(2, 3)).u32(PACKED_OBJECTS, 0xcafe0007);
    assert_eq!(
        decode_ioctl(&l, &rm(escape::RM_CONTROL, nvos54(0x3d0b), export.0)),
        Some(Event::ExportObjects { fd: 7, client: 0xc1d00001, objects: vec![0xcafe0007, 0], index: 3, more: 0, to_fd: 11, status: 0 })
    );
    // More handles than are followed: the first sixteen, and how many more.
    let big = Buf::new(PACKED_TYPES).u32(0, 11).u32(PACKED_COUNT, count(20, 0));
    match decode_ioctl(&l, &rm(escape::RM_CONTROL, nvos54(0x3d0b), big.0)) {
        Some(Event::ExportObjects { objects, more: 4, .. }) => assert_eq!(objects.len(), 16),
        other => panic!("{other:?}"),
    }
    let mut import = Buf::new(PACKED_TYPES + 16)
        .u32(0, 12)
        .u32(4, 0xde000002)
        .u32(PACKED_COUNT, count(2, 0))
        .u32(PACKED_OBJECTS, 0xbeef0003)
        .u32(PACKED_OBJECTS + 4, 0xbeef0004);
    import.0[PACKED_TYPES] = 1;
    assert_eq!(
        decode_ioctl(&l, &rm(escape::RM_CONTROL, nvos54(0x3d0c), import.0)),
        Some(Event::ImportObjects {
            fd: 7,
            client: 0xc1d00001,
            parent: 0xde000002,
            objects: vec![0xbeef0003, 0],
            index: 0,
            more: 0,
            from_fd: 12,
            status: 0
        }),
        "the second slot held nothing: RM wrote type NONE and made no handle"
    );
    match decode_ioctl(&l, &rm(escape::RM_CONTROL, nvos54(0x3d0c), vec![0; PACKED_TYPES])) {
        Some(Event::Undecodable { reason, .. }) => assert!(reason.contains("params behind NVOS54"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn failed_ioctl_reports_errno_not_the_stale_status() {
    let l = layout(580, 95, 5);
    let mut raw = rm(escape::RM_ALLOC, Buf::new(48).u32(12, 0x40), memory_params(&l, 4096));
    raw.ret = -14;
    let a = alloc(decode_ioctl(&l, &raw));
    assert_eq!(a.errno, Some(14));
    assert_eq!(a.status, status::GENERIC_FAILURE);
    assert!(!a.succeeded());
}

#[test]
fn uvm_commands_for_both_free_layouts() {
    for (l, free_size) in [(layout(580, 95, 5), 24), (layout(590, 44, 1), 16)] {
        let range = Buf::new(24).u64(0, 0x7000_0000_0000).u64(8, 1 << 30).u32(16, 0);
        let a = alloc(decode_ioctl(&l, &uvm_raw(uvm::CREATE_EXTERNAL_RANGE, range)));
        assert_eq!((a.memory, a.bytes, a.base), (Memory::Virtual, 1 << 30, Some(0x7000_0000_0000)));

        // head (base, length, offset) + tail (rmCtrlFd, hClient, hMemory, rmStatus)
        let map = Buf::new(40).u64(0, 0x7000_0000_0000).u64(8, 1 << 30).u64(16, 0).u32(24, 3).u32(28, 0xc1d0).u32(32, 0xabc).u32(36, 0);
        assert_eq!(
            decode_ioctl(&l, &uvm_raw(uvm::MAP_EXTERNAL_ALLOCATION, map)),
            Some(Event::UvmMap { fd: 9, base: 0x7000_0000_0000, length: 1 << 30, offset: 0, client: 0xc1d0, memory: 0xabc, status: 0 })
        );

        let pool = Buf::new(32).u64(0, 0x7100_0000_0000).u64(8, 2 << 20).u64(16, 1).u32(24, status::NO_MEMORY);
        let a = alloc(decode_ioctl(&l, &uvm_raw(uvm::ALLOC_SEMAPHORE_POOL, pool)));
        assert_eq!((a.via, a.memory, a.bytes, a.status), (Via::UvmAllocSemaphorePool, Memory::System, 2 << 20, status::NO_MEMORY));

        let free = Buf::new(free_size).u64(0, 0x7000_0000_0000).u32(free_size - 8, 0);
        assert_eq!(decode_ioctl(&l, &uvm_raw(uvm::FREE, free)), Some(Event::UvmFree { fd: 9, base: 0x7000_0000_0000, status: 0 }));

        // base, length, gpuUuid (16 bytes), rmStatus@32
        let unmap = Buf::new(40).u64(0, 0x7000_0000_0000).u64(8, 1 << 30).u32(32, 0);
        assert_eq!(
            decode_ioctl(&l, &uvm_raw(uvm::UNMAP_EXTERNAL, unmap)),
            Some(Event::UvmUnmap { fd: 9, base: 0x7000_0000_0000, length: 1 << 30, status: 0 })
        );
    }
}

#[test]
fn short_params_are_undecodable_not_a_panic() {
    let l = layout(580, 95, 5);
    for nr in [escape::RM_ALLOC, escape::RM_FREE, escape::RM_VID_HEAP_CONTROL, escape::RM_ALLOC_MEMORY, escape::RM_DUP_OBJECT] {
        let mut raw = rm(nr, Buf::new(48), vec![]);
        raw.params.truncate(3);
        assert!(matches!(decode_ioctl(&l, &raw), Some(Event::Undecodable { .. })), "escape {nr:#x}");
    }
    let mut raw = uvm_raw(uvm::FREE, Buf::new(24));
    raw.params.truncate(4);
    assert!(matches!(decode_ioctl(&l, &raw), Some(Event::Undecodable { .. })));
}

fn ioctl_record_bytes(escape_cmd: u32, flags: u8, params: &[u8]) -> Vec<u8> {
    let mut r = IoctlRecord {
        header: RecordHeader { kind: kind::IOCTL, tgid: 100, tid: 101, _pad: 0, ts_ns: 5_000 },
        fd: 4,
        cmd: rm_cmd(escape::IOCTL_XFER_CMD, 16),
        ret: 0,
        escape_cmd,
        params_len: params.len() as u32,
        class_len: 0,
        file: 0,
        named_file: 0,
        device: device::CTL,
        flags,
        _pad: [0; 2],
        params: [0; PARAMS_MAX],
        class_params: [0; CLASS_PARAMS_MAX],
    };
    r.params[..params.len()].copy_from_slice(params);
    let bytes = unsafe { std::slice::from_raw_parts(&r as *const IoctlRecord as *const u8, size_of::<IoctlRecord>()) };
    bytes.to_vec()
}

/// The kernel unwraps NV_ESC_IOCTL_XFER_CMD and re-encodes the inner escape; decoding then goes
/// through the same path as a direct call.
#[test]
fn xfer_wrapped_free_decodes_like_a_direct_one() {
    let free = Buf::new(16).u32(0, 1).u32(4, 2).u32(8, 3).0;
    let bytes = ioctl_record_bytes(rm_cmd(escape::RM_FREE, 16), ioctl_flag::XFER, &free);
    let raw = parse_record(&bytes).unwrap();
    assert_eq!((raw.ts, raw.pid, raw.tid), (5_000, 100, 101));
    let RawKind::Ioctl(ioctl) = raw.kind else { panic!() };
    assert_eq!(
        decode_ioctl(&layout(580, 95, 5), &ioctl),
        Some(Event::Free { fd: 4, via: Via::RmFree, client: 1, parent: 2, object: 3, status: 0 })
    );
}

#[test]
fn truncated_and_unknown_records_are_errors() {
    let bytes = ioctl_record_bytes(rm_cmd(escape::RM_FREE, 16), 0, &[0; 16]);
    assert!(matches!(parse_record(&bytes[..100]), Err(DecodeError::Truncated { .. })));
    assert_eq!(parse_record(&bytes[..3]), Err(DecodeError::Short(3)));
    let mut unknown = bytes.clone();
    unknown[0] = 99;
    assert_eq!(parse_record(&unknown), Err(DecodeError::UnknownKind(99)));
}

#[test]
fn params_fault_is_reported() {
    let mut raw = rm(escape::RM_FREE, Buf::new(16), vec![]);
    raw.flags = ioctl_flag::PARAMS_FAULT;
    assert!(matches!(decode_ioctl(&layout(580, 95, 5), &raw), Some(Event::Undecodable { .. })));
}

proptest::proptest! {
    /// Any bytes, any command: decoding returns, never panics.
    #[test]
    fn arbitrary_input_never_panics(cmd in proptest::prelude::any::<u32>(), params in proptest::collection::vec(0u8..=255, 0..200), uvm in proptest::bool::ANY) {
        let raw = RawIoctl { fd: 1, cmd, escape_cmd: cmd, ret: 0, device: Some(if uvm { Device::Uvm } else { Device::Ctl }), flags: 0, file: 0, named_file: 0, params: params.clone(), class_params: params.clone() };
        let _ = decode_ioctl(&layout(580, 95, 5), &raw);
        let _ = parse_record(&params);
    }
}

#[test]
fn request_lines_and_response_parts() {
    assert_eq!(request_line(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"), Some("POST /v1/completions".into()));
    assert_eq!(request_line(b"GET /health HTTP/1.1\r\n"), Some("GET /health".into()));
    assert_eq!(request_line(b"GET /health HTTP"), Some("GET /health".into()), "a head cut short");
    assert_eq!(request_line(b"{\"prompt\": 1}"), None, "a body continuation starts no request");
    assert_eq!(request_line(b""), None);
    assert_eq!(response_part(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control", 96), (Some(200), false));
    assert_eq!(response_part(b"HTTP/1.1 503 Service Unavailable\r\n", 120), (Some(503), false));
    assert_eq!(
        response_part(b"HTTP/1.1 200 OK\r\nA: b\r\n\r\ndata: {\"x\"", 200),
        (Some(200), true),
        "headers and first data in one write"
    );
    assert_eq!(response_part(b"HTTP/1.1 200 OK\r\nA: b\r\n\r\n", 25), (Some(200), false), "headers alone (25 bytes)");
    assert_eq!(response_part(b"data: {\"choices\":[]}\n\n", 60), (None, true));
    assert_eq!(response_part(b"", 5), (None, true), "short writes carry data too");
}

/// ATTACH_MEM and DETACH_MEM on fabric objects, as the kernel side copies them: the flexible
/// 0xf8 form packed (hMemory and offset of the first attachments, then the counts RM wrote
/// back), the multicast 0xfd form whole. Recorded only where RM dups what is attached (before
/// 570); from 570 on they are not memory events at all.
#[test]
fn fabric_attachments_are_decoded_where_they_hold_memory() {
    use tracer_common::control::{PACKED_ATTACH_COUNTS, PACKED_DETACH_COUNTS};
    let nvos54 = |cmd: u32, status: u32| Buf::new(32).u32(0, 0xc1d00001).u32(4, 0xfab00001).u32(8, cmd).u64(16, 0x7000).u32(28, status);
    let old = layout(550, 54, 14);
    // Three asked, two attached before RM failed.
    let attach = Buf::new(PACKED_ATTACH_COUNTS + 12)
        .u32(0, 0xcafe0001)
        .u64(8, 0)
        .u32(16, 0xcafe0002)
        .u64(24, 2 << 20)
        .u32(32, 0xcafe0003)
        .u64(40, 4 << 20)
        .u32(PACKED_ATTACH_COUNTS, 3)
        .u32(PACKED_ATTACH_COUNTS + 8, 2);
    let expected = Event::FabricAttach {
        fd: 7,
        client: 0xc1d00001,
        fabric: 0xfab00001,
        subdevice: 0,
        attachments: vec![(0xcafe0001, 0), (0xcafe0002, 2 << 20), (0xcafe0003, 4 << 20)],
        attached: 2,
        more: 0,
        status: 0x1f,
    };
    assert_eq!(decode_ioctl(&old, &rm(escape::RM_CONTROL, nvos54(0xf80103, 0x1f), attach.0.clone())), Some(expected));
    let detach = Buf::new(PACKED_DETACH_COUNTS + 12).u64(0, 2 << 20).u32(PACKED_DETACH_COUNTS, 10).u32(PACKED_DETACH_COUNTS + 8, 10);
    match decode_ioctl(&old, &rm(escape::RM_CONTROL, nvos54(0xf80104, 0), detach.0)) {
        Some(Event::FabricDetach { offsets, detached: 10, more: 3, subdevice: 0, .. }) => assert_eq!(offsets.len(), 7),
        other => panic!("{other:?}"),
    }
    let multicast = Buf::new(40).u32(0, 0x5b000001).u32(4, 0xcafe0001).u64(8, 2 << 20).u64(24, 2 << 20);
    assert_eq!(
        decode_ioctl(&old, &rm(escape::RM_CONTROL, nvos54(0xfd0102, 0), multicast.0.clone())),
        Some(Event::FabricAttach {
            fd: 7,
            client: 0xc1d00001,
            fabric: 0xfab00001,
            subdevice: 0x5b000001,
            attachments: vec![(0xcafe0001, 2 << 20)],
            attached: 1,
            more: 0,
            status: 0
        })
    );
    match decode_ioctl(&old, &rm(escape::RM_CONTROL, nvos54(0xfd0102, 0x1f), multicast.0.clone())) {
        Some(Event::FabricAttach { attached: 0, .. }) => {}
        other => panic!("a refused attach attaches nothing: {other:?}"),
    }
    let multicast_detach = Buf::new(24).u32(0, 0x5b000001).u64(8, 2 << 20);
    assert_eq!(
        decode_ioctl(&old, &rm(escape::RM_CONTROL, nvos54(0xfd0105, 0), multicast_detach.0)),
        Some(Event::FabricDetach {
            fd: 7,
            client: 0xc1d00001,
            fabric: 0xfab00001,
            subdevice: 0x5b000001,
            offsets: vec![2 << 20],
            detached: 1,
            more: 0,
            status: 0
        })
    );
    // 570 and later: an attachment holds nothing; nothing to record.
    assert_eq!(decode_ioctl(&layout(570, 86, 15), &rm(escape::RM_CONTROL, nvos54(0xfd0102, 0), multicast.0)), None);
    assert_eq!(decode_ioctl(&layout(580, 95, 5), &rm(escape::RM_CONTROL, nvos54(0xf80103, 0), attach.0)), None);
}

/// REGISTER_FD on a /dev/nvidiaN fd names the nvidiactl fd it joins (its 4-byte param); a failed
/// one joins nothing and is not recorded.
#[test]
fn register_fd_names_the_control_fd_it_joins() {
    let l = layout(580, 95, 5);
    let mut raw = rm(escape::REGISTER_FD, Buf::new(4).u32(0, 5), vec![]);
    raw.device = Some(Device::Gpu);
    assert_eq!(decode_ioctl(&l, &raw), Some(Event::RegisterFd { fd: 7, ctl_fd: 5 }));
    raw.ret = -22;
    assert_eq!(decode_ioctl(&l, &raw), None, "refused (EINVAL): nothing joined");
}

/// RM_SHARE (NVOS57, 24 bytes): the object, its policy (type u16@16, action u8@18, target@8)
/// and RM's status; refused by ioctl() itself, a generic failure.
#[test]
fn rm_share_is_decoded_with_its_policy() {
    let l = layout(580, 95, 5);
    let params = Buf::new(24).u32(0, 0xc1d0_0001).u32(4, 0xa).u32(8, 0xc1d0_0002).u32(16, 0x0001_0003);
    let mut raw = rm(escape::RM_SHARE, params, vec![]);
    let share = Event::Share { fd: 7, client: 0xc1d0_0001, object: 0xa, share_type: 3, target: 0xc1d0_0002, action: 1, status: 0 };
    assert_eq!(decode_ioctl(&l, &raw), Some(share));
    raw.ret = -14;
    assert!(matches!(decode_ioctl(&l, &raw), Some(Event::Share { status, .. }) if status == status::GENERIC_FAILURE));
    assert!(
        tracer_common::rm_command_traced(rm_cmd(escape::RM_SHARE, 24)) && !tracer_common::rm_command_traced(rm_cmd(escape::RM_SHARE, 28))
    );
}

fn exec_record_bytes(args: &[u8], args_len: u32, args_whole: u32) -> Vec<u8> {
    let mut r = ExecRecord {
        header: RecordHeader { kind: kind::EXEC, tgid: 100, tid: 100, _pad: 0, ts_ns: 5_000 },
        filename: [0; 64],
        args_len,
        args_whole,
        args: [0; tracer_common::EXEC_ARGS],
    };
    r.filename[..12].copy_from_slice(b"/bin/server\0");
    r.args[..args.len()].copy_from_slice(args);
    let bytes = unsafe { std::slice::from_raw_parts(&r as *const ExecRecord as *const u8, size_of::<ExecRecord>()) };
    bytes.to_vec()
}

/// An exec's argv as the kernel read it: only its first `args_len` bytes count (an empty
/// argument dropped, as /proc's are), whole only when the kernel says so and read something; a
/// length past the buffer is cut to it, never a panic; a short record is an error.
#[test]
fn an_exec_carries_its_argv() {
    let exec = |bytes: &[u8]| match parse_record(bytes).unwrap().kind {
        RawKind::Exec { filename, argv, argv_whole } => (filename, argv, argv_whole),
        k => panic!("{k:?}"),
    };
    let (filename, argv, whole) = exec(&exec_record_bytes(b"server\0--port\0\08000\0HOME=/root", 20, 1));
    assert_eq!((filename.as_str(), argv, whole), ("/bin/server", vec!["server".to_string(), "--port".into(), "8000".into()], true));
    // A part keeps only the arguments it holds whole: never `--max-num-seqs 25` of 2560.
    let (_, argv, whole) = exec(&exec_record_bytes(b"server\0--max-num-seqs\x0025", 22, 0));
    assert_eq!((argv, whole), (vec!["server".to_string(), "--max-num-seqs".into()], false));
    let (_, argv, whole) = exec(&exec_record_bytes(b"server-with-a-long-name", 23, 0));
    assert_eq!((argv, whole), (vec![], false));
    let (_, argv, whole) = exec(&exec_record_bytes(b"", 0, 1));
    assert_eq!((argv, whole), (vec![], false), "nothing read is not a whole argv");
    let (_, argv, whole) = exec(&exec_record_bytes(b"\0", 1, 1));
    assert_eq!((argv, whole), (vec![], false), "an argv of one empty argument names nothing");
    let (_, argv, _) = exec(&exec_record_bytes(b"a", u32::MAX, 1));
    assert_eq!(argv, ["a"]);
    let bytes = exec_record_bytes(b"a", 1, 1);
    assert!(parse_record(&bytes[..bytes.len() - 1]).is_err());
}

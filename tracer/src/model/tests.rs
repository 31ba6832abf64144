use super::*;
use crate::event::{Alloc, Device, Event, Memory, Record, Seen, Via};

const CLIENT: u32 = 0xc1d0_0001;
const DEVICE: u32 = 0xde00_0001;
const GIB: u64 = 1 << 30;

fn rec(ts: u64, pid: u32, event: Event) -> Record {
    Record::new(ts, pid, pid, event)
}

fn process(ts: u64, pid: u32, ppid: u32, seen: Seen) -> Record {
    rec(ts, pid, Event::Process { ppid, seen, command: vec![format!("proc{pid}")] })
}

fn open(ts: u64, pid: u32, fd: i32, file: u64, device: Device, cloexec: bool) -> Record {
    rec(ts, pid, Event::Open { fd, file, device, cloexec })
}

fn object(ts: u64, pid: u32, fd: i32, parent: u32, object: u32, class: u32) -> Record {
    let client = if class == 0x41 { object } else { CLIENT };
    rec(ts, pid, Event::Object { fd, client, parent, object, class, status: 0, gpu: None })
}

fn alloc(ts: u64, pid: u32, fd: i32, parent: u32, object: u32, bytes: u64, status: u32) -> Record {
    rec(ts, pid, Event::Alloc(Alloc { fd, status, ..Alloc::video(CLIENT, parent, object, bytes) }))
}

/// UVM_CREATE_EXTERNAL_RANGE by pid 10 on its fd 5: address space at `base`.
fn uvm_range(ts: u64, base: u64, bytes: u64) -> Record {
    let a = Alloc::uvm_range(5, base, bytes);
    rec(ts, 10, Event::Alloc(a))
}

fn free(ts: u64, pid: u32, object: u32) -> Record {
    rec(ts, pid, Event::Free { fd: 3, via: Via::RmFree, client: CLIENT, parent: 0, object, status: 0 })
}

/// A process with an nvidiactl file (fd 3, file 1), a client and a device.
fn setup(pid: u32, cloexec: bool) -> Vec<Record> {
    vec![
        process(1, pid, 1, Seen::Launched),
        open(2, pid, 3, 1, Device::Ctl, cloexec),
        object(3, pid, 3, 0, CLIENT, 0x41),
        object(4, pid, 3, CLIENT, DEVICE, 0x80),
    ]
}

fn freed(model: &Model, object: u32) -> Option<(u64, FreedBy)> {
    model.allocations.iter().find(|a| a.object == object).unwrap().freed
}

#[test]
fn explicit_free_and_peak() {
    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, 2 * GIB, 0));
    t.push(alloc(11, 10, 3, DEVICE, 0xb, GIB, 0));
    t.push(free(12, 10, 0xa));
    t.push(alloc(13, 10, 3, DEVICE, 0xc, GIB, 0));
    let m = Model::from_records(&t);
    let u = &m.processes[&10].usage;
    assert_eq!(u.live[&Memory::Video], 2 * GIB);
    assert_eq!(u.allocated[&Memory::Video], 4 * GIB);
    assert_eq!(u.freed[&Memory::Video], 2 * GIB);
    assert_eq!(u.peak_physical, 3 * GIB);
    assert_eq!(u.allocations, 3);
    assert_eq!(freed(&m, 0xa), Some((12, FreedBy::Explicit)));
}

#[test]
fn freeing_the_device_frees_its_subtree_and_freeing_the_client_frees_all() {
    let mut t = setup(10, false);
    t.push(object(5, 10, 3, DEVICE, 0x5000, 0x2080));
    t.push(alloc(10, 10, 3, 0x5000, 0xa, GIB, 0));
    t.push(alloc(11, 10, 3, DEVICE, 0xb, GIB, 0));
    t.push(free(12, 10, 0x5000));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), Some((12, FreedBy::Subtree)));
    assert_eq!(freed(&m, 0xb), None);

    t.push(free(13, 10, CLIENT));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xb), Some((13, FreedBy::Subtree)));
    assert_eq!(m.live(Memory::Video), 0);
}

#[test]
fn a_dup_keeps_memory_alive_until_its_last_handle() {
    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(rec(
        11,
        10,
        Event::DupObject { fd: 3, client: CLIENT, parent: DEVICE, object: 0xd, src_client: CLIENT, src_object: 0xa, status: 0 },
    ));
    t.push(free(12, 10, 0xa));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), None, "the dup still refers to it");
    assert_eq!(m.live(Memory::Video), GIB);
    t.push(free(13, 10, 0xd));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), Some((13, FreedBy::Explicit)));
    assert_eq!(m.allocations.len(), 1, "a dup is not new memory");
}

/// CUDA IPC through a file descriptor: pid 10 exports its memory to a second nvidiactl file,
/// passes that file to pid 20, which imports it, and both free their handles: the memory lives on
/// in the kernel's client of the export file until the last process holding it closes it.
#[test]
fn an_exported_object_lives_until_the_last_close_of_its_file() {
    let mut t = exported_and_imported(false);
    t.push(free(18, 10, 0xa));
    t.push(rec(19, 10, Event::Close { fd: 4 }));
    t.push(free_import(20));
    let m = Model::from_records(&t);
    assert_eq!(m.allocations.len(), 1, "an export and an import are not new memory");
    assert_eq!(freed(&m, 0xa), None, "pid 20 still holds the export file");
    assert_eq!(m.processes[&10].usage.physical_live(), 4 * GIB, "counted to the process that allocated it");
    assert_eq!(m.check_books(), Ok(()));
    let snapshot = m.snapshot();
    t.push(rec(30, 20, Event::Close { fd: 7 }));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), Some((30, FreedBy::FileRelease)), "freed with the export file's last close");
    assert_eq!(m.check_books(), Ok(()));
    // The snapshot carries the export: replayed, the close frees it the same way.
    let mut replay = Model::from_records(&snapshot);
    replay.apply(&rec(30, 20, Event::Close { fd: 7 }));
    assert_eq!(replay.live(Memory::Video), 0);
    assert_eq!(replay.allocations.iter().find(|a| a.bytes == 4 * GIB).unwrap().freed, Some((30, FreedBy::FileRelease)));
}

/// Pid 10 exports 4 GiB to a second nvidiactl file (its fd 4), and pid 20, with a client of its
/// own, receives that file as its fd 7 (SCM_RIGHTS) and imports it as 0xb; `in_flight`: pid 10
/// closes fd 4 as soon as it is sent, before pid 20 receives it.
fn exported_and_imported(in_flight: bool) -> Vec<Record> {
    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, 4 * GIB, 0));
    t.push(open(11, 10, 4, 2, Device::Ctl, false));
    t.push(rec(12, 10, Event::ExportObject { fd: 3, client: CLIENT, object: 0xa, to_fd: 4, status: 0 }));
    t.extend(in_flight.then(|| rec(12, 10, Event::Close { fd: 4 })));
    t.push(process(13, 20, 1, Seen::Launched));
    t.push(open(14, 20, 3, 3, Device::Ctl, false));
    t.push(rec(15, 20, Event::Object { fd: 3, client: IMPORTER, parent: IMPORTER, object: IMPORTER, class: 0x41, status: 0, gpu: None }));
    t.push(rec(16, 20, Event::FdFound { fd: 7, file: 2, device: Device::Ctl }));
    t.push(rec(17, 20, Event::ImportObject { fd: 3, client: IMPORTER, parent: IMPORTER, object: 0xb, from_fd: 7, status: 0 }));
    t
}

/// Pid 20's client in [`exported_and_imported`].
const IMPORTER: u32 = 0xc1d0_0002;

fn free_import(ts: u64) -> Record {
    rec(ts, 20, Event::Free { fd: 3, via: Via::RmFree, client: IMPORTER, parent: 0, object: 0xb, status: 0 })
}

/// The same, with the export file in flight over the socket at its sender's close (NCCL's proxy
/// sends and closes at once): that close, the last seen, releases the file, but it is met again
/// in pid 20, which imports from it. The import holds the memory after pid 10 frees its handle
/// and exits, and the file's last close in pid 20 frees it; a snapshot cut anywhere agrees.
#[test]
fn an_export_file_in_flight_at_its_senders_close_keeps_its_exports() {
    let mut t = exported_and_imported(true);
    t.push(free(18, 10, 0xa));
    t.push(rec(19, 10, Event::Exit { code: Some(0) }));
    let held = t.len();
    t.push(rec(20, 20, Event::Close { fd: 7 }));
    t.push(free_import(21));
    let m = Model::from_records(&t[..held]);
    assert_eq!(freed(&m, 0xa), None, "pid 20's import holds it");
    assert_eq!(m.check_books(), Ok(()));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), Some((21, FreedBy::Explicit)), "freed with pid 20's handle, the export file gone before");
    assert_eq!(m.check_books(), Ok(()));
    for cut in 0..=t.len() {
        for end in [held, t.len()] {
            let whole = Model::from_records(&t[..end.max(cut)]);
            let snapshot = Model::from_records(&t[..cut]).snapshot();
            let rebuilt = Model::from_records(snapshot.iter().chain(&t[cut..end.max(cut)]));
            assert_eq!(live_state(&rebuilt), live_state(&whole), "cut at {cut}, to {end}");
            assert_eq!(rebuilt.check_books(), Ok(()), "cut at {cut}");
        }
    }
}

/// A file met again long after its last close seen (a new file at a released one's kernel
/// address, its open unseen), or met as another device, is not the export file in flight: the
/// exports parked at the close are nobody's, and the memory goes with pid 10's handle. A
/// snapshot cut anywhere agrees: it never exports the parked ones through the new file at that
/// address, which would hold them (found by the property test).
#[test]
fn a_released_export_file_met_late_or_as_another_device_takes_nothing_back() {
    for (late, device) in [(IN_FLIGHT_NS + 13, Device::Ctl), (16, Device::Gpu)] {
        let mut t = exported_and_imported(true);
        for r in &mut t {
            if let Event::FdFound { fd: 7, .. } = r.event {
                *r = rec(late, 20, Event::FdFound { fd: 7, file: 2, device });
            }
        }
        t.push(free(late + 2, 10, 0xa));
        let m = Model::from_records(&t);
        assert_eq!(freed(&m, 0xa), Some((late + 2, FreedBy::Explicit)), "met at {late} as {device:?}");
        assert_eq!(m.check_books(), Ok(()));
        for cut in 0..=t.len() {
            let snapshot = Model::from_records(&t[..cut]).snapshot();
            let rebuilt = Model::from_records(snapshot.iter().chain(&t[cut..]));
            assert_eq!(live_state(&rebuilt), live_state(&m), "met at {late} as {device:?}, cut at {cut}");
        }
    }
}

/// The memory a sticky fabric object is made over outlives its own handle's RM_FREE until the
/// fabric object goes (its dup in `mem_fabric.c`); a dup of the fabric object keeps both.
#[test]
fn a_sticky_fabric_object_keeps_its_memory_until_it_goes() {
    let fabric = |ts: u64, object: u32, holds: u32| {
        rec(
            ts,
            10,
            Event::Alloc(Alloc {
                class: 0xf8,
                memory: Memory::Virtual,
                holds: Some(holds),
                ..Alloc::video(CLIENT, DEVICE, object, 2 << 20)
            }),
        )
    };
    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(fabric(11, 0xf, 0xa));
    t.push(free(12, 10, 0xa));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), None, "the fabric object holds it");
    assert_eq!(m.live(Memory::Video), GIB);
    assert_eq!(m.check_books(), Ok(()));
    t.push(free(13, 10, 0xf));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xf), Some((13, FreedBy::Explicit)));
    assert_eq!(freed(&m, 0xa), Some((13, FreedBy::Explicit)), "freed with the fabric object");
    assert_eq!(m.check_books(), Ok(()));
}

/// Before 570, RM dups memory attached to a fabric object (ATTACH_MEM): it outlives its handle
/// until DETACH_MEM at its offset, or the fabric object's end; the snapshot carries the
/// attachment. A failed multi-attach counts only what RM says it attached.
#[test]
fn memory_attached_to_a_fabric_object_lives_until_it_is_detached() {
    let multicast = |ts, object| {
        let a = Alloc { class: 0xfd, memory: Memory::Virtual, ..Alloc::video(CLIENT, DEVICE, object, 2 << 20) };
        rec(ts, 10, Event::Alloc(a))
    };
    let attach = |ts, attachments: Vec<(u32, u64)>, attached| {
        rec(ts, 10, Event::FabricAttach { fd: 3, client: CLIENT, fabric: 0xf, subdevice: 7, attachments, attached, more: 0, status: 0 })
    };
    let detach = |ts, offset| {
        rec(
            ts,
            10,
            Event::FabricDetach {
                fd: 3,
                client: CLIENT,
                fabric: 0xf,
                subdevice: 7,
                offsets: vec![offset],
                detached: 1,
                more: 0,
                status: 0,
            },
        )
    };
    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(alloc(11, 10, 3, DEVICE, 0xb, GIB, 0));
    t.push(alloc(12, 10, 3, DEVICE, 0xc, GIB, 0));
    t.push(multicast(13, 0xf));
    // 0xc's attachment failed (RM attached the first two only).
    t.push(attach(14, vec![(0xa, 0), (0xb, 2 << 20), (0xc, 4 << 20)], 2));
    for (ts, object) in [(15, 0xa), (16, 0xb), (17, 0xc)] {
        t.push(free(ts, 10, object));
    }
    let m = Model::from_records(&t);
    assert_eq!((freed(&m, 0xa), freed(&m, 0xb)), (None, None), "attached: held by RM's dups");
    assert_eq!(freed(&m, 0xc), Some((17, FreedBy::Explicit)), "not attached");
    assert_eq!(m.check_books(), Ok(()));
    let snapshot = m.snapshot();
    t.push(detach(18, 0));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), Some((18, FreedBy::Detached)));
    let mut replay = Model::from_records(&snapshot);
    replay.apply(&detach(18, 0));
    assert_eq!(replay.live(Memory::Video), GIB, "the snapshot carries both attachments; one is left");
    t.push(free(19, 10, 0xf));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xb), Some((19, FreedBy::Explicit)), "detached with the fabric object");
    assert_eq!(m.live(Memory::Video), 0);
    assert_eq!(m.check_books(), Ok(()));
}

/// RM keeps a multicast object's attachments per GPU: a detach through another subdevice handle
/// of the same GPU detaches, one of another GPU does not; a snapshot keeps the GPU (through a
/// stand-in subdevice of it).
#[test]
fn multicast_attachments_are_kept_by_gpu_not_by_subdevice_handle() {
    let device = |ts, object, gpu| {
        rec(ts, 10, Event::Object { fd: 3, client: CLIENT, parent: CLIENT, object, class: 0x80, status: 0, gpu: Some(gpu) })
    };
    let subdevice = |ts, handle, parent| object(ts, 10, 3, parent, handle, 0x2080);
    let detach = |ts, subdevice| {
        let event =
            Event::FabricDetach { fd: 3, client: CLIENT, fabric: 0xf, subdevice, offsets: vec![0], detached: 1, more: 0, status: 0 };
        rec(ts, 10, event)
    };
    let mut t = setup(10, false);
    t.push(device(5, 0xd1, 1));
    t.push(device(5, 0xd2, 2));
    t.push(subdevice(6, 0x51, 0xd1));
    t.push(subdevice(6, 0x52, 0xd1));
    t.push(subdevice(6, 0x53, 0xd2));
    t.push(alloc(7, 10, 3, 0xd1, 0xa, GIB, 0));
    let multicast = Alloc { class: 0xfd, memory: Memory::Virtual, ..Alloc::video(CLIENT, DEVICE, 0xf, 2 << 20) };
    t.push(rec(8, 10, Event::Alloc(multicast)));
    let attach = Event::FabricAttach {
        fd: 3,
        client: CLIENT,
        fabric: 0xf,
        subdevice: 0x51,
        attachments: vec![(0xa, 0)],
        attached: 1,
        more: 0,
        status: 0,
    };
    t.push(rec(9, 10, attach));
    t.push(free(10, 10, 0xa));
    let snapshot = Model::from_records(&t).snapshot();
    let mut other_gpu = t.clone();
    other_gpu.push(detach(11, 0x53));
    assert_eq!(freed(&Model::from_records(&other_gpu), 0xa), None, "GPU 2 has nothing attached at 0");
    t.push(detach(11, 0x52));
    assert_eq!(freed(&Model::from_records(&t), 0xa), Some((11, FreedBy::Detached)), "another handle of GPU 1");
    let mut replay = Model::from_records(&snapshot);
    replay.apply(&detach(11, 0x52));
    assert_eq!(replay.live(Memory::Video), 0, "the snapshot kept the attachment at GPU 1");
}

/// Only memory the fabric maps is attached (video memory or EGM, as RM's FLA check says), only
/// to a fabric object (address space): a trace claiming otherwise changes nothing, so holders
/// never chain.
#[test]
fn only_video_memory_and_egm_are_attached_and_only_to_address_space() {
    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(alloc(11, 10, 3, DEVICE, 0xb, GIB, 0));
    let attach = |fabric| Event::FabricAttach {
        fd: 3,
        client: CLIENT,
        fabric,
        subdevice: 0,
        attachments: vec![(0xb, 0)],
        attached: 1,
        more: 0,
        status: 0,
    };
    t.push(rec(12, 10, attach(0xa)));
    t.push(free(13, 10, 0xb));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xb), Some((13, FreedBy::Explicit)), "0xa is video memory, not a fabric object");
    assert_eq!(m.check_books(), Ok(()));
    // EGM (host memory of a Grace system) is attached and held; other system memory is not.
    let fabric = Alloc { class: 0xf8, memory: Memory::Virtual, ..Alloc::video(CLIENT, DEVICE, 0xf, 2 << 20) };
    t.push(rec(14, 10, Event::Alloc(fabric)));
    for (object, class) in [(0xc, 0x42), (0xd, 0x3e)] {
        t.push(rec(15, 10, Event::Alloc(Alloc { class, memory: Memory::System, ..Alloc::video(CLIENT, DEVICE, object, GIB) })));
    }
    let both = Event::FabricAttach {
        fd: 3,
        client: CLIENT,
        fabric: 0xf,
        subdevice: 0,
        attachments: vec![(0xc, 0), (0xd, 2 << 20)],
        attached: 2,
        more: 0,
        status: 0,
    };
    t.push(rec(16, 10, both));
    t.push(free(17, 10, 0xc));
    t.push(free(17, 10, 0xd));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xc), None, "EGM attached: held by RM's dup");
    assert_eq!(freed(&m, 0xd), Some((17, FreedBy::Explicit)), "plain system memory is never attached");
    assert_eq!(m.check_books(), Ok(()));
}

/// RM holds only video memory under a fabric object: a trace that claims a fabric object holds
/// another one (or itself, or system memory) gets no hold, so no chain of them can be built,
/// and a hundred thousand such claims replay without a deep recursion.
#[test]
fn only_video_memory_is_held_and_holds_never_chain() {
    let fabric = |ts: u64, object: u32, holds: u32| {
        let a = Alloc { class: 0xf8, memory: Memory::Virtual, holds: Some(holds), ..Alloc::video(CLIENT, DEVICE, object, 2 << 20) };
        rec(ts, 10, Event::Alloc(a))
    };
    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(fabric(11, 0x100, 0xa));
    for i in 1..100_000u32 {
        t.push(fabric(11 + u64::from(i), 0x100 + i, 0x100 + i - 1));
    }
    t.push(free(200_000, 10, 0xa));
    t.push(free(200_001, 10, 0x100));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), Some((200_001, FreedBy::Explicit)), "held by the first fabric object only");
    assert_eq!(freed(&m, 0x101), None, "the second holds nothing and lives on");
    assert_eq!(m.check_books(), Ok(()));
}

/// A file holds one export: RM refuses a second, so one a trace claims succeeded holds nothing
/// and the first stays held.
#[test]
fn a_second_export_to_the_same_file_holds_nothing() {
    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(alloc(11, 10, 3, DEVICE, 0xe, 2 * GIB, 0));
    t.push(open(12, 10, 4, 2, Device::Ctl, false));
    t.push(rec(13, 10, Event::ExportObject { fd: 3, client: CLIENT, object: 0xa, to_fd: 4, status: 0 }));
    t.push(rec(14, 10, Event::ExportObject { fd: 3, client: CLIENT, object: 0xe, to_fd: 4, status: 0 }));
    t.push(free(15, 10, 0xa));
    t.push(free(16, 10, 0xe));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), None, "the first export is held by the file");
    assert_eq!(freed(&m, 0xe), Some((16, FreedBy::Explicit)), "the second was refused by RM");
    assert_eq!(m.check_books(), Ok(()));
}

/// The batched export libcuda uses: slots of one file, each holding its memory until the file's
/// last close; a later batch replaces a slot (a 0 empties it, freeing memory nothing else holds);
/// an import names slots from its index on; the single form is refused on a file with exports.
#[test]
fn batched_exports_fill_slots_until_the_files_last_close() {
    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(alloc(11, 10, 3, DEVICE, 0xb, 2 * GIB, 0));
    t.push(open(12, 10, 4, 2, Device::Ctl, false));
    let export = |ts, objects: Vec<u32>, index| {
        rec(ts, 10, Event::ExportObjects { fd: 3, client: CLIENT, objects, index, more: 0, to_fd: 4, status: 0 })
    };
    t.push(export(13, vec![0xa, 0xb], 0));
    t.push(rec(14, 10, Event::ExportObject { fd: 3, client: CLIENT, object: 0xb, to_fd: 4, status: 0 }));
    t.push(free(15, 10, 0xa));
    t.push(free(16, 10, 0xb));
    let m = Model::from_records(&t);
    assert_eq!((freed(&m, 0xa), freed(&m, 0xb)), (None, None), "both held by their slots");
    // The second slot emptied: its memory goes; an import of slot 0 is a dup of the first.
    t.push(export(17, vec![0], 1));
    t.push(rec(
        18,
        10,
        Event::ImportObjects { fd: 3, client: CLIENT, parent: DEVICE, objects: vec![0xc, 0], index: 0, more: 0, from_fd: 4, status: 0 },
    ));
    t.push(rec(19, 10, Event::Close { fd: 4 }));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xb), Some((17, FreedBy::Explicit)), "emptied by the later batch");
    assert_eq!(freed(&m, 0xa), None, "the import's handle keeps it after the file went");
    assert_eq!(m.check_books(), Ok(()));
    let snapshot = m.snapshot();
    t.push(free(20, 10, 0xc));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), Some((20, FreedBy::Explicit)));
    let mut replay = Model::from_records(&snapshot);
    replay.apply(&free(20, 10, 0xc));
    assert_eq!(replay.live(Memory::Video), 0, "the snapshot carries the import");
}

/// A batch of more handles than the kernel side copies: the slots past the 16 it followed are
/// filled with what is not followed, so what they held before is released, and the handles are
/// counted as not followed.
#[test]
fn handles_past_the_followed_part_of_a_batch_release_their_slots_and_are_counted() {
    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(alloc(11, 10, 3, DEVICE, 0xb, GIB, 0));
    t.push(open(12, 10, 4, 2, Device::Ctl, false));
    let export = |ts, objects: Vec<u32>, index, more| {
        rec(ts, 10, Event::ExportObjects { fd: 3, client: CLIENT, objects, index, more, to_fd: 4, status: 0 })
    };
    t.push(export(13, vec![0xa], 20, 0));
    t.push(export(14, vec![0xb], 40, 0));
    t.push(free(15, 10, 0xa));
    t.push(free(16, 10, 0xb));
    // 20 handles from slot 4: 16 followed (slots 4..20), 4 not (slots 20..24, 0xa's among them).
    t.push(export(17, vec![0; 16], 4, 4));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), Some((17, FreedBy::Explicit)), "slot 20 filled by a handle not followed");
    assert_eq!(freed(&m, 0xb), None, "slot 40 untouched");
    assert_eq!(m.handles_not_followed, 4);
    assert_eq!(m.check_books(), Ok(()));
}

/// A failed export holds nothing; an export file closed unused frees nothing else.
#[test]
fn a_failed_export_holds_nothing() {
    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(open(11, 10, 4, 2, Device::Ctl, false));
    t.push(rec(12, 10, Event::ExportObject { fd: 3, client: CLIENT, object: 0xa, to_fd: 4, status: 0x1f }));
    t.push(free(13, 10, 0xa));
    assert_eq!(freed(&Model::from_records(&t), 0xa), Some((13, FreedBy::Explicit)));
}

#[test]
fn a_forked_child_keeps_the_file_and_its_memory_alive_after_the_parent_exits() {
    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, 8 * GIB, 0));
    t.push(process(11, 20, 10, Seen::Forked));
    t.push(rec(12, 10, Event::Exit { code: Some(0) }));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), None);
    assert_eq!(m.holders(1), vec![20]);
    assert_eq!(m.processes[&10].usage.physical_live(), 8 * GIB, "memory stays with the process that allocated it");
    t.push(rec(20, 20, Event::Exit { code: None }));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), Some((20, FreedBy::FileRelease)));
    assert_eq!(m.files[&1].released, Some(20));
}

#[test]
fn exec_closes_only_close_on_exec_files() {
    for (cloexec, expect) in [(true, Some((20, FreedBy::FileRelease))), (false, None)] {
        let mut t = setup(10, cloexec);
        t.push(alloc(10, 10, 3, DEVICE, 0xa, GIB, 0));
        t.push(rec(20, 10, Event::Exec { command: vec!["next".into()] }));
        assert_eq!(freed(&Model::from_records(&t), 0xa), expect, "cloexec={cloexec}");
    }
}

#[test]
fn set_cloexec_and_close_range_are_followed() {
    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(rec(11, 10, Event::SetCloexec { fd: 3, cloexec: true }));
    t.push(rec(12, 10, Event::Exec { command: vec![] }));
    assert_eq!(freed(&Model::from_records(&t), 0xa), Some((12, FreedBy::FileRelease)));

    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(rec(11, 10, Event::CloseRange { first: 3, last: u32::MAX, cloexec_only: true }));
    assert_eq!(freed(&Model::from_records(&t), 0xa), None);
    t.push(rec(12, 10, Event::CloseRange { first: 0, last: 2, cloexec_only: false }));
    assert_eq!(freed(&Model::from_records(&t), 0xa), None);
    t.push(rec(13, 10, Event::CloseRange { first: 3, last: 3, cloexec_only: false }));
    assert_eq!(freed(&Model::from_records(&t), 0xa), Some((13, FreedBy::FileRelease)));
}

#[test]
fn dup_and_dup2_over_an_open_fd_move_references() {
    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(rec(11, 10, Event::Dup { old_fd: 3, new_fd: 7, cloexec: false }));
    t.push(rec(12, 10, Event::Close { fd: 3 }));
    assert_eq!(freed(&Model::from_records(&t), 0xa), None, "fd 7 still refers to the file");
    // A second file dup2'ed onto fd 7 drops the first file's last reference.
    t.push(open(13, 10, 8, 2, Device::Ctl, false));
    t.push(rec(14, 10, Event::Dup { old_fd: 8, new_fd: 7, cloexec: false }));
    assert_eq!(freed(&Model::from_records(&t), 0xa), Some((14, FreedBy::FileRelease)));
}

#[test]
fn uvm_ranges_end_by_uvm_free_or_file_release() {
    let range = |ts, base| uvm_range(ts, base, GIB);
    let mut t = vec![process(1, 10, 1, Seen::Launched), open(2, 10, 5, 9, Device::Uvm, false), range(3, 0x1000), range(4, 0x2000)];
    t.push(rec(5, 10, Event::UvmFree { fd: 5, base: 0x1000, status: 0 }));
    t.push(rec(6, 10, Event::Close { fd: 5 }));
    let m = Model::from_records(&t);
    assert_eq!(m.allocations[0].freed, Some((5, FreedBy::Explicit)));
    assert_eq!(m.allocations[1].freed, Some((6, FreedBy::FileRelease)));
    assert_eq!(m.live(Memory::Virtual), 0);
    assert_eq!(m.live(Memory::Video), 0, "address space is never physical memory");
}

#[test]
fn failed_allocations_are_kept_and_not_live() {
    let mut t = setup(10, false);
    t.push(alloc(10, 10, 3, DEVICE, 0xa, 100 * GIB, 0x51));
    let m = Model::from_records(&t);
    assert_eq!(m.failures.len(), 1);
    assert_eq!(m.failures[0].bytes, 100 * GIB);
    assert_eq!(m.processes[&10].usage.failed, 1);
    assert_eq!(m.live(Memory::Video), 0);
}

#[test]
fn memory_of_a_client_made_before_tracing_still_ends_with_its_file() {
    // Traced with --pid: the fd was found by the /proc scan, the client was never seen created.
    let t = vec![
        process(1, 10, 1, Seen::Running),
        rec(2, 10, Event::FdFound { fd: 3, file: 4, device: Device::Ctl }),
        alloc(3, 10, 3, DEVICE, 0xa, GIB, 0),
        rec(4, 10, Event::Exit { code: None }),
    ];
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), Some((4, FreedBy::FileRelease)));
}

/// Where the driver is loaded, a device file is found by its kernel address at its first
/// command, its open unseen: a new file at the address of one released is a new file, whose
/// memory ends with its own release.
#[test]
fn a_file_found_at_a_released_files_address_is_a_new_file() {
    let found = |ts, fd| rec(ts, 10, Event::FdFound { fd, file: 1, device: Device::Ctl });
    let mut t =
        vec![process(1, 10, 1, Seen::Launched), found(2, 3), object(3, 10, 3, 0, CLIENT, 0x41), object(4, 10, 3, CLIENT, DEVICE, 0x80)];
    t.extend([alloc(5, 10, 3, DEVICE, 0xa, GIB, 0), rec(6, 10, Event::Close { fd: 3 })]);
    t.extend([
        found(7, 4),
        object(8, 10, 4, 0, CLIENT, 0x41),
        object(9, 10, 4, CLIENT, DEVICE, 0x80),
        alloc(10, 10, 4, DEVICE, 0xb, GIB, 0),
    ]);
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), Some((6, FreedBy::FileRelease)));
    assert_eq!((freed(&m, 0xb), m.live(Memory::Video)), (None, GIB), "the new file's memory is live");
    t.push(rec(11, 10, Event::Close { fd: 4 }));
    let m = Model::from_records(&t);
    assert_eq!((freed(&m, 0xb), m.live(Memory::Video)), (Some((11, FreedBy::FileRelease)), 0), "and goes with its release");
}

#[test]
fn requests_from_connection_traffic() {
    let server = 30;
    let sent = |ts, conn, status: Option<u16>, data| rec(ts, server, Event::Sent { conn, bytes: 100, status, data });
    let received = |ts, conn, line: Option<&str>| rec(ts, server, Event::Received { conn, bytes: 200, request: line.map(String::from) });
    let t = vec![
        process(1, server, 1, Seen::Launched),
        rec(2, server, Event::Bind { fd: 3, port: 8000 }),
        rec(5, server, Event::Listen { fd: 3 }),
        rec(10, server, Event::Accept { fd: 9, conn: 7 }),
        received(11, 7, Some("POST /v1/completions")),
        received(12, 7, None),
        sent(13, 7, Some(200), false),
        sent(40, 7, None, true),
        sent(50, 7, None, true),
        // keep-alive: a second request on the same connection ends the first
        received(60, 7, Some("POST /v1/completions")),
        rec(61, server, Event::Accept { fd: 10, conn: 8 }),
        received(62, 8, Some("GET /health")),
        sent(63, 8, Some(503), false),
        rec(64, server, Event::ConnClose { conn: 8 }),
        sent(80, 7, Some(200), true),
        rec(90, server, Event::Exit { code: Some(0) }),
    ];
    let m = Model::from_records(&t);
    let p = &m.processes[&server];
    assert_eq!((p.bound.clone(), p.listened), (vec![(2, 8000)], Some(5)));
    assert_eq!(m.requests.len(), 3);
    let first = &m.requests[0];
    assert_eq!(
        (first.arrived, first.bytes_in, first.headers_at, first.first_data_at, first.ended),
        (11, 400, Some(13), Some(40), Some(60))
    );
    assert_eq!(first.bytes_out, 300);
    // In arrival order: the second request on fd 7 (60) came before the health check (62).
    let health = &m.requests[2];
    assert_eq!((health.line.as_str(), health.status, health.first_data_at, health.ended), ("GET /health", Some(503), None, Some(64)));
    let second = &m.requests[1];
    assert_eq!(
        (second.headers_at, second.first_data_at, second.ended),
        (Some(80), Some(80), Some(90)),
        "headers and data together, ended by the exit"
    );
    assert_eq!(m.in_flight(62, None), 2);
    assert_eq!(m.in_flight(70, Some(&[server])), 1);
    assert_eq!(m.in_flight(95, None), 0);
}

proptest::proptest! {
    /// Whatever the order, the books balance: live = allocated - freed, never negative.
    #[test]
    fn books_balance(ops in proptest::collection::vec((0u8..8, 0u32..6, 1u64..1000), 0..200)) {
        let mut t = setup(10, false);
        t.push(process(5, 20, 10, Seen::Forked));
        for (i, (op, h, bytes)) in ops.into_iter().enumerate() {
            let ts = 10 + i as u64;
            let pid = if h % 2 == 0 { 10 } else { 20 };
            t.push(match op {
                0..=2 => alloc(ts, pid, 3, if h < 3 { DEVICE } else { 0x100 + h }, 0x1000 + h, bytes, 0),
                3 => free(ts, pid, 0x1000 + h),
                4 => object(ts, pid, 3, DEVICE, 0x100 + h, 0x2080),
                5 => rec(ts, pid, Event::DupObject { fd: 3, client: CLIENT, parent: DEVICE, object: 0x2000 + h, src_client: CLIENT, src_object: 0x1000 + h, status: 0 }),
                6 => rec(ts, pid, Event::Close { fd: 3 }),
                _ => free(ts, pid, 0x100 + h),
            });
        }
        let m = Model::from_records(&t);
        for p in m.processes.values() {
            let u = &p.usage;
            let get = |map: &std::collections::BTreeMap<Memory, u64>| map.get(&Memory::Video).copied().unwrap_or(0);
            proptest::prop_assert_eq!(get(&u.live), get(&u.allocated) - get(&u.freed));
        }
        let live: u64 = m.live_allocations().map(|a| a.bytes).sum();
        proptest::prop_assert_eq!(live, m.live(Memory::Video));
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
    /// Any sequence of allocations, frees, dups, closes, forks and exits keeps the books exact.
    #[test]
    fn any_sequence_keeps_the_books(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2000)) {
        let model = Model::from_records(&generate::records(&data));
        proptest::prop_assert_eq!(model.check_books(), Ok(()));
    }
}

/// Memory belongs to the GPU of the device it is under, through a subdevice too; a dup of it
/// under another device is still the same memory on the same GPU.
#[test]
fn allocations_belong_to_their_devices_gpu() {
    let mut t = setup(10, false);
    t[3] = rec(4, 10, Event::Object { fd: 3, client: CLIENT, parent: CLIENT, object: DEVICE, class: 0x80, status: 0, gpu: Some(2) });
    t.push(object(5, 10, 3, DEVICE, 0x5000, 0x2080));
    t.push(alloc(6, 10, 3, 0x5000, 0xa, GIB, 0));
    t.push(alloc(7, 10, 3, DEVICE, 0xb, GIB, 0x51));
    t.push(alloc(8, 10, 3, 0x9999, 0xc, GIB, 0));
    let model = Model::from_records(&t);
    assert_eq!(model.allocations[0].gpu, Some(2), "under the subdevice of GPU 2's device");
    assert_eq!(model.failures[0].gpu, Some(2));
    assert_eq!(model.allocations[1].gpu, None, "under a parent never seen: the GPU cannot be told");
}

/// A crafted trace: one process with a thousand device fds forks 1,100 times. Every fork copying
/// them all would be 1.1 million entries: past a million held, copies are counted, not kept.
#[test]
fn a_fork_storm_stays_bounded_and_says_so() {
    let mut t = vec![process(1, 10, 1, Seen::Launched)];
    for fd in 0..1000 {
        t.push(open(2, 10, 3 + fd, 1, Device::Ctl, false));
    }
    for child in 0..1100 {
        t.push(process(3, 1000 + child, 10, Seen::Forked));
    }
    let model = Model::from_records(&t);
    assert!(model.fd_refs <= 1 << 20, "{}", model.fd_refs);
    assert!(model.fd_refs_dropped >= 1000, "copies past the bound are counted: {}", model.fd_refs_dropped);
    assert_eq!(model.processes[&1005].fds.len(), 1000, "copies below the bound are kept");
}

/// cuMemRelease while mapped (VMM allocators): RM_FREE of the handle does not free memory a UVM
/// mapping holds; UVM_FREE of its range does, or the release of the UVM file. Unmapped first,
/// the handle's free is the one that frees it.
#[test]
fn memory_mapped_into_uvm_lives_until_its_range_goes() {
    let map =
        |ts, base, object| rec(ts, 10, Event::UvmMap { fd: 5, base, length: GIB, offset: 0, client: CLIENT, memory: object, status: 0 });
    let range = |ts, base| uvm_range(ts, base, 2 * GIB);
    let mut t = setup(10, false);
    t.push(open(5, 10, 5, 9, Device::Uvm, false));
    t.push(alloc(6, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(range(7, 0x10_0000));
    t.push(map(8, 0x10_0000 + GIB, 0xa));
    t.push(free(9, 10, 0xa));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), None, "released, still mapped");
    let released = |m: &Model| m.allocations.iter().find(|a| a.object == 0xa).unwrap().released;
    assert_eq!(released(&m), Some(9), "its handle's free shown as a release");
    assert_eq!(m.check_books(), Ok(()));
    let mut csv = Vec::new();
    crate::export::csv(&crate::trace::Header::default(), &m, &mut csv).unwrap();
    let row = String::from_utf8(csv).unwrap().lines().nth(1).unwrap().to_string();
    assert!(row.starts_with("6,,10,") && row.ends_with(",released_still_held,0,9"), "{row}");
    let mut unmapped = t.clone();
    unmapped.push(rec(10, 10, Event::UvmFree { fd: 5, base: 0x10_0000, status: 0 }));
    let m = Model::from_records(&unmapped);
    assert_eq!(freed(&m, 0xa), Some((10, FreedBy::Unmapped)), "the mapping lay in the range freed");
    assert_eq!(released(&m), Some(9), "released at 9, still mapped until 10");
    let mut closed = t.clone();
    closed.push(rec(11, 10, Event::Close { fd: 5 }));
    assert_eq!(freed(&Model::from_records(&closed), 0xa), Some((11, FreedBy::FileRelease)), "the UVM file's release");
    // cuMemUnmap: the mapping goes, the range (the reserved address space) stays.
    let mut unmapped = t.clone();
    unmapped.push(rec(10, 10, Event::UvmUnmap { fd: 5, base: 0x10_0000, length: 2 * GIB, status: 0 }));
    let m = Model::from_records(&unmapped);
    assert_eq!(freed(&m, 0xa), Some((10, FreedBy::Unmapped)));
    assert_eq!(m.live(Memory::Virtual), 2 * GIB, "the range is still reserved");
    // The other order: unmapped first, then the handle's free frees it.
    let mut t = setup(10, false);
    t.push(open(5, 10, 5, 9, Device::Uvm, false));
    t.push(alloc(6, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(range(7, 0x10_0000));
    t.push(map(8, 0x10_0000, 0xa));
    t.push(rec(9, 10, Event::UvmFree { fd: 5, base: 0x10_0000, status: 0 }));
    assert_eq!(freed(&Model::from_records(&t), 0xa), None);
    t.push(free(10, 10, 0xa));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), Some((10, FreedBy::Explicit)));
    assert_eq!(released(&m), None, "freed by its handle: never released while held");
}

/// A process exiting holds its nvidiactl file (fd 3) and a UVM file its memory is mapped through:
/// the kernel closes them from the lowest fd up, and which goes first decides whether the handle
/// outlived the mapping ("released, still mapped") or not. The same trace reads the same every
/// time (the files were closed in a hash map's order: a real-driver fixture's CSV changed from
/// one run to the next).
#[test]
fn an_exit_closes_its_files_in_the_kernels_order() {
    let released_at_exit = |uvm_fd: i32| {
        let mut t = setup(10, false);
        t.push(open(5, 10, uvm_fd, 9, Device::Uvm, false));
        t.push(alloc(6, 10, 3, DEVICE, 0xa, GIB, 0));
        t.push(rec(7, 10, Event::Alloc(Alloc::uvm_range(uvm_fd, 0x10_0000, 2 * GIB))));
        t.push(rec(8, 10, Event::UvmMap { fd: uvm_fd, base: 0x10_0000, length: GIB, offset: 0, client: CLIENT, memory: 0xa, status: 0 }));
        t.push(rec(12, 10, Event::Exit { code: Some(0) }));
        let runs: Vec<_> = (0..32)
            .map(|_| {
                let m = Model::from_records(&t);
                let a = m.allocations.iter().find(|a| a.object == 0xa).unwrap();
                (a.released, a.freed)
            })
            .collect();
        assert!(runs.iter().all(|r| *r == runs[0]), "uvm on fd {uvm_fd}: {runs:?}");
        runs[0]
    };
    assert_eq!(released_at_exit(5), (Some(12), Some((12, FreedBy::FileRelease))), "fd 3's clients first: released, then unmapped");
    assert_eq!(released_at_exit(2), (None, Some((12, FreedBy::FileRelease))), "the UVM file first: its handle frees it");
}

/// REGISTER_FD: a /dev/nvidiaN file registered with the nvidiactl file keeps it, and the memory of
/// its clients, until the device file closes too.
#[test]
fn a_registered_device_file_keeps_the_control_file_open() {
    let mut t = setup(10, false);
    t.push(open(5, 10, 4, 2, Device::Gpu, false));
    t.push(rec(6, 10, Event::RegisterFd { fd: 4, ctl_fd: 3 }));
    t.push(alloc(7, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(rec(8, 10, Event::Close { fd: 3 }));
    assert_eq!(freed(&Model::from_records(&t), 0xa), None, "the device file still holds the control file");
    t.push(rec(9, 10, Event::Close { fd: 4 }));
    assert_eq!(freed(&Model::from_records(&t), 0xa), Some((9, FreedBy::FileRelease)));
}

/// RM acts on a client only through the file that made it (rmclientValidate, strict by
/// default), or a device file registered with that file: a call the trace says succeeded
/// through another file (a fd re-pointed while its call ran, an edited trace) is refused and
/// counted, and cannot free, replace or add to another process's memory.
#[test]
fn a_client_is_reached_only_through_its_own_file() {
    let mut t = setup(10, false);
    t.push(alloc(5, 10, 3, DEVICE, 0xa, GIB, 0));
    // Another user's process, with an nvidiactl file of its own.
    t.push(process(6, 20, 1, Seen::Launched));
    t.push(open(7, 20, 3, 2, Device::Ctl, false));
    t.push(rec(8, 20, Event::Free { fd: 3, via: Via::RmFree, client: CLIENT, parent: 0, object: 0xa, status: 0 }));
    t.push(rec(9, 20, Event::Free { fd: 3, via: Via::RmFree, client: CLIENT, parent: 0, object: CLIENT, status: 0 }));
    t.push(object(10, 20, 3, 0, CLIENT, 0x41));
    t.push(alloc(11, 20, 3, DEVICE, 0xb, GIB, 0));
    let dup = Event::DupObject { fd: 3, client: CLIENT, parent: DEVICE, object: 0xc, src_client: CLIENT, src_object: 0xa, status: 0 };
    t.push(rec(12, 20, dup));
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), None, "pid 20's free of pid 10's handle never happened");
    assert_eq!(m.processes[&10].usage.physical_live(), GIB);
    assert!(m.allocations.iter().all(|a| a.object != 0xb), "nothing added to pid 10's client from pid 20's file");
    assert_eq!(m.foreign_client_calls, 5);
    assert_eq!(m.check_books(), Ok(()));
    // A failed call is no call: not counted.
    let mut failed = t.clone();
    failed.push(rec(13, 20, Event::Free { fd: 3, via: Via::RmFree, client: CLIENT, parent: 0, object: 0xa, status: 0x57 }));
    assert_eq!(Model::from_records(&failed).foreign_client_calls, 5);

    // The owner's own calls go on, through the file or a device file registered with it.
    t.push(open(20, 10, 4, 3, Device::Gpu, false));
    t.push(rec(21, 10, Event::Free { fd: 4, via: Via::RmFree, client: CLIENT, parent: 0, object: 0xa, status: 0 }));
    let mut registered = t.clone();
    registered.insert(t.len() - 1, rec(20, 10, Event::RegisterFd { fd: 4, ctl_fd: 3 }));
    let m = Model::from_records(&registered);
    assert_eq!(freed(&m, 0xa), Some((21, FreedBy::Explicit)), "a registered device file acts as its nvidiactl file");
    assert_eq!(m.foreign_client_calls, 5);
    // Its registration made before tracing began: inferred, within the process that holds both.
    let m = Model::from_records(&t);
    assert_eq!(freed(&m, 0xa), Some((21, FreedBy::Explicit)), "registered before tracing: inferred");
    assert_eq!(m.foreign_client_calls, 5);
    let mut closed = t.clone();
    closed.push(alloc(22, 10, 3, DEVICE, 0xe, GIB, 0));
    closed.push(rec(23, 10, Event::Close { fd: 3 }));
    assert_eq!(freed(&Model::from_records(&closed), 0xe), None, "the inferred registration holds the nvidiactl file open");
    // Pid 20's device file never reaches pid 10's client: it holds no file of pid 10's.
    let mut other = t.clone();
    other.push(open(24, 20, 4, 4, Device::Gpu, false));
    other.push(rec(25, 20, Event::Free { fd: 4, via: Via::RmFree, client: CLIENT, parent: 0, object: 0xe, status: 0 }));
    assert_eq!(Model::from_records(&other).foreign_client_calls, 6);
}

/// RM lets another process dup memory from its client only when it was shared (RM_SHARE, on
/// the object or one of its parents); the default policy is the same process's. A forged dup cannot keep another user's memory alive in the books; a shared one
/// (legacy CUDA IPC) does, and the snapshot keeps the share. A client made before tracing is
/// taken on the trace's word (its shares were not seen).
#[test]
fn another_process_takes_memory_only_when_it_was_shared() {
    const OTHER: u32 = 0xc1d0_0002;
    let mut t = setup(10, false);
    t.push(alloc(5, 10, 3, DEVICE, 0xa, GIB, 0));
    t.push(process(6, 20, 1, Seen::Launched));
    t.push(open(6, 20, 3, 2, Device::Ctl, false));
    t.push(rec(7, 20, Event::Object { fd: 3, client: OTHER, parent: OTHER, object: OTHER, class: 0x41, status: 0, gpu: None }));
    let dup = |ts, object| {
        rec(ts, 20, Event::DupObject { fd: 3, client: OTHER, parent: OTHER, object, src_client: CLIENT, src_object: 0xa, status: 0 })
    };
    let share = |ts, action| rec(ts, 10, Event::Share { fd: 3, client: CLIENT, object: 0xa, share_type: 1, target: 0, action, status: 0 });
    let mut forged = t.clone();
    forged.push(dup(8, 0xb));
    forged.push(free(9, 10, 0xa));
    let m = Model::from_records(&forged);
    assert_eq!(freed(&m, 0xa), Some((9, FreedBy::Explicit)), "not shared: no reference was taken");
    assert_eq!(m.foreign_client_calls, 1);
    // Shared through its parent device: the dup goes through.
    let mut parent = t.clone();
    parent.push(rec(8, 10, Event::Share { fd: 3, client: CLIENT, object: DEVICE, share_type: 1, target: 0, action: 0, status: 0 }));
    parent.push(dup(9, 0xb));
    assert_eq!(Model::from_records(&parent).foreign_client_calls, 0, "a share of a parent covers what is below it");
    // A destination client first met through the dup itself is the caller's.
    let mut unseen = t[..5].to_vec();
    unseen.extend([process(6, 20, 1, Seen::Launched), open(6, 20, 3, 2, Device::Ctl, false), dup(8, 0xb)]);
    assert_eq!(Model::from_records(&unseen).foreign_client_calls, 1, "the taker is the caller");
    // Shared with everyone: pid 20's dup holds it past its owner's free.
    t.push(share(8, 0));
    let cut = t.len();
    t.push(dup(9, 0xb));
    t.push(free(10, 10, 0xa));
    let m = Model::from_records(&t);
    assert_eq!((freed(&m, 0xa), m.foreign_client_calls), (None, 0), "shared: held by pid 20's handle");
    let snapshot = Model::from_records(&t[..cut]).snapshot();
    let replay = Model::from_records(snapshot.iter().chain(&t[cut..]));
    assert_eq!((replay.live(Memory::Video), replay.foreign_client_calls), (GIB, 0), "the snapshot keeps the share");
    // Revoked before the dup: refused again; revoking another type leaves the share.
    let mut revoked = t[..cut].to_vec();
    revoked.push(rec(9, 10, Event::Share { fd: 3, client: CLIENT, object: 0xa, share_type: 3, target: 0, action: 1, status: 0 }));
    revoked.push(dup(9, 0xb));
    assert_eq!(Model::from_records(&revoked).foreign_client_calls, 0, "a CLIENT share revoked, the ALL share stays");
    let mut revoked = t[..cut].to_vec();
    revoked.push(share(9, 1));
    revoked.push(dup(9, 0xb));
    assert_eq!(Model::from_records(&revoked).foreign_client_calls, 1);
    // A client met only through its calls (made before tracing): its shares are unknown.
    let mut early = vec![process(1, 10, 1, Seen::Running), open(2, 10, 3, 1, Device::Ctl, false), alloc(5, 10, 3, CLIENT, 0xa, GIB, 0)];
    early.extend(t[5..8].iter().cloned());
    early.push(dup(9, 0xb));
    early.push(free(10, 10, 0xa));
    let m = Model::from_records(&early);
    assert_eq!((freed(&m, 0xa), m.foreign_client_calls), (None, 0), "taken on the trace's word");
}

/// A UVM range with no file (fd -1: only a crafted trace has one) is kept as a handle, and the
/// books still balance, its handle counted as one.
#[test]
fn a_uvm_range_without_a_file_keeps_the_books() {
    let mut range = uvm_range(5, 0, GIB);
    if let Event::Alloc(a) = &mut range.event {
        a.fd = -1;
    }
    let mut t = setup(10, false);
    t.push(range);
    assert_eq!(Model::from_records(&t).check_books(), Ok(()));
    t.push(rec(6, 10, Event::Free { fd: 3, via: Via::RmFree, client: 0, parent: 0, object: 0, status: 0 }));
    let m = Model::from_records(&t);
    assert_eq!(m.check_books(), Ok(()));
    assert!(m.allocations.iter().all(|a| a.released.is_none()), "freed by its handle, never released while held");
}

/// Pinned host memory (RM_ALLOC_MEMORY, on a device file) of a process met after it registered
/// its device file: the client first met through the device file is reached through the
/// nvidiactl file too, and the other way round, each inferring the registration.
#[test]
fn a_registration_before_tracing_is_inferred_both_ways() {
    let pinned = |ts, fd, object| {
        let a = Alloc { fd, via: Via::RmAllocMemory, class: 0x71, memory: Memory::System, ..Alloc::video(CLIENT, DEVICE, object, GIB) };
        rec(ts, 10, Event::Alloc(a))
    };
    for device_first in [true, false] {
        let mut t = vec![process(1, 10, 1, Seen::Running), open(2, 10, 3, 1, Device::Ctl, false), open(2, 10, 4, 2, Device::Gpu, false)];
        if device_first {
            t.push(pinned(3, 4, 0xa));
            t.push(alloc(4, 10, 3, DEVICE, 0xb, GIB, 0));
        } else {
            t.push(alloc(3, 10, 3, DEVICE, 0xb, GIB, 0));
            t.push(pinned(4, 4, 0xa));
        }
        let m = Model::from_records(&t);
        assert_eq!(m.foreign_client_calls, 0, "device first: {device_first}");
        assert_eq!(m.allocations.len(), 2);
        assert_eq!(m.check_books(), Ok(()));
        // The client is the nvidiactl file's: it lives while the device file holds that open.
        t.push(rec(5, 10, Event::Close { fd: 3 }));
        assert_eq!(Model::from_records(&t).live_allocations().count(), 2, "device first: {device_first}");
        t.push(rec(6, 10, Event::Close { fd: 4 }));
        assert_eq!(Model::from_records(&t).live_allocations().count(), 0, "device first: {device_first}");
    }
}

/// What a snapshot must give back: the live allocations (time, pid, kind, size, GPU, class, when
/// released while held) and every process's fd table. Files are held to it through what their release frees: a
/// damaged trace can leave a descriptor on a file already released, which no snapshot can say.
type LiveState = (
    Vec<(u64, u32, Memory, u64, Option<u32>, u32, Option<u64>)>,
    Vec<(u32, Vec<(i32, FileId, bool)>)>,
    Vec<(u32, Option<u32>, Vec<(u32, u16)>)>,
);

fn live_state(m: &Model) -> LiveState {
    // Files the model named itself (fds met without their open) are compared by the order they
    // were named in, not by number.
    let mut named: Vec<FileId> = m.processes.values().flat_map(|p| p.held_files()).filter(|&f| f >= ORPHAN_FILE_BASE).collect();
    named.sort_unstable();
    named.dedup();
    let file = |f: FileId| named.iter().position(|&n| n == f).map_or(f, |i| ORPHAN_FILE_BASE + i as u64);
    let mut allocations: Vec<_> = m.live_allocations().map(|a| (a.ts, a.pid, a.memory, a.bytes, a.gpu, a.class, a.released)).collect();
    allocations.sort_unstable();
    let processes = m
        .processes
        .values()
        // Whether a process that holds nothing runs on is left out: a damaged trace can have
        // records for a pid after its exit, which a snapshot (keeping only the running) cannot.
        .filter(|p| !p.fds.is_empty())
        .map(|p| {
            let mut fds: Vec<_> = p.fds.iter().map(|(fd, f)| (*fd, file(f.file), f.cloexec)).collect();
            fds.sort_unstable();
            (p.pid, fds)
        })
        .collect();
    // Each client's maker and shares: which dups RM's share policy lets through later.
    let mut clients: Vec<_> = m
        .clients
        .iter()
        .map(|(&h, c)| {
            let mut shared: Vec<(u32, u16)> = c.shared.iter().copied().collect();
            shared.sort_unstable();
            (h, c.pid, shared)
        })
        .collect();
    clients.sort_unstable();
    (allocations, processes, clients)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(3000))]
    /// Cut anywhere: the snapshot of what came before, then what came after, leaves the same live
    /// state as the whole sequence. What a dump of `watch` stands on.
    #[test]
    fn a_snapshot_then_the_rest_is_the_whole(
        data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..1500),
        cut in proptest::prelude::any::<proptest::sample::Index>(),
    ) {
        let records = generate::records(&data);
        let at = cut.index(records.len() + 1);
        let whole = Model::from_records(&records);
        let snapshot = Model::from_records(&records[..at]).snapshot();
        let rebuilt = Model::from_records(snapshot.iter().chain(&records[at..]));
        proptest::prop_assert_eq!(live_state(&rebuilt), live_state(&whole));
        proptest::prop_assert_eq!(rebuilt.check_books(), Ok(()));
    }
}

/// A handle made anew under itself (a hostile or damaged trace: a dup into a device handle whose
/// parent is that handle) no longer inherits the GPU of the object it replaces: what was there is
/// gone first, as in RM, so a snapshot and its replay agree (found by the property test).
#[test]
fn a_handle_made_anew_takes_nothing_from_what_it_replaces() {
    let mut t = setup(10, false);
    t.push(rec(5, 10, Event::Object { fd: 3, client: CLIENT, parent: CLIENT, object: 0x259, class: 0x80, status: 0, gpu: Some(0) }));
    t.push(alloc(6, 10, 3, CLIENT, 0xa, GIB, 0));
    let dup = Event::DupObject { fd: 3, client: CLIENT, parent: 0x259, object: 0x259, src_client: CLIENT, src_object: 0xa, status: 0 };
    t.push(rec(7, 10, dup));
    let cut = t.len();
    t.push(alloc(8, 10, 3, 0x259, 0xb, GIB, 0));
    let whole = Model::from_records(&t);
    let snapshot = Model::from_records(&t[..cut]).snapshot();
    let rebuilt = Model::from_records(snapshot.iter().chain(&t[cut..]));
    assert_eq!(live_state(&rebuilt), live_state(&whole));
    assert_eq!(whole.allocations.iter().find(|a| a.object == 0xb).unwrap().gpu, None, "its parent went when the handle was made anew");
}
/// Past the processes it keeps at once, the model forgets the spent ones (exited 0, never
/// allocated, nobody's parent) and the files they alone opened; a server with memory, its
/// launcher and the forks it runs through stay. Where none can be forgotten, a new process's
/// records are counted, not followed.
#[test]
fn past_its_bound_the_model_forgets_spent_processes_and_counts_the_rest() {
    let rec = |ts: u64, pid: u32, event| Record::new(ts, pid, pid, event);
    let mut m = Model::with_process_limit(64);
    // A launcher (it exits 0 once it started the server, which it parented) and its server.
    m.apply(&rec(1, 10, Event::Process { ppid: 1, seen: Seen::Launched, command: vec!["launch.sh".into()] }));
    m.apply(&rec(2, 11, Event::Process { ppid: 10, seen: Seen::Forked, command: vec!["server".into()] }));
    m.apply(&rec(3, 11, Event::Open { fd: 3, file: 1, device: Device::Ctl, cloexec: false }));
    m.apply(&rec(4, 11, Event::Alloc(Alloc::video(1, 1, 0xa, 1 << 30))));
    m.apply(&rec(5, 10, Event::Exit { code: Some(0) }));
    // A thousand helpers, each opening nvidiactl, exiting 0; one fails (exit 1: kept).
    for i in 0..1000u32 {
        let (pid, ts) = (1000 + i, 10 + 3 * u64::from(i));
        m.apply(&rec(ts, pid, Event::Process { ppid: 1, seen: Seen::Launched, command: vec!["nvidia-smi".into()] }));
        m.apply(&rec(ts + 1, pid, Event::Open { fd: 3, file: 100 + u64::from(i), device: Device::Ctl, cloexec: false }));
        m.apply(&rec(ts + 2, pid, Event::Exit { code: Some(if i == 500 { 1 } else { 0 }) }));
    }
    assert!(m.processes.len() <= 64, "{}", m.processes.len());
    assert_eq!(m.records_not_kept, 0);
    assert!(m.processes_forgotten >= 900, "{}", m.processes_forgotten);
    assert!(
        m.processes.contains_key(&10) && m.processes.contains_key(&11) && m.processes.contains_key(&1500),
        "kept: the parent, the server, the failed"
    );
    assert!(m.files.len() < 100 && m.files.contains_key(&1), "{} files", m.files.len());
    assert_eq!(m.check_books(), Ok(()));
    // Alive at once past the bound: counted, and nothing of theirs followed.
    for i in 0..100u32 {
        m.apply(&rec(10_000, 5000 + i, Event::Process { ppid: 1, seen: Seen::Launched, command: vec!["sleep".into()] }));
    }
    m.apply(&rec(10_001, 5099, Event::Alloc(Alloc::video(9, 9, 0xb, 1 << 30))));
    assert!(m.processes.len() <= 64 && !m.processes.contains_key(&5099));
    assert!(m.records_not_kept >= 37, "{}", m.records_not_kept);
    assert_eq!(m.live(Memory::Video), 1 << 30, "the refused process's allocation is not in the books");
}

/// A crafted trace's command lines and places are cut at what the recorder reads of them.
#[test]
fn command_lines_and_places_are_cut_at_what_the_recorder_reads() {
    let long = "é".repeat(100_000);
    let mut m = Model::new();
    m.apply(&Record::new(1, 7, 7, Event::Process { ppid: 1, seen: Seen::Launched, command: vec![long.clone(), long.clone()] }));
    let place = crate::event::Place { cgroup: long.clone(), container: Some(long.clone()), ..Default::default() };
    m.apply(&Record::new(2, 7, 7, Event::Place(place)));
    let p = &m.processes[&7];
    let bytes: usize = p.command.iter().map(String::len).sum();
    assert!(bytes <= crate::procfs::command::MAX_COMMAND as usize && p.command.len() == 1, "{bytes} bytes in {} args", p.command.len());
    let place = p.place.as_ref().unwrap();
    assert!(place.cgroup.len() <= 4096 && place.container.as_ref().unwrap().len() <= 4096 && place.cgroup.starts_with('é'));
}

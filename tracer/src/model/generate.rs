//! Any bytes as a sequence of records that exercise the model: allocations, frees, dups (within a
//! process, or across processes with and without a share), exports and imports through files,
//! sticky fabric objects, closes,
//! forks and exits over a few pids, fds, files, clients and handles, so that they collide the
//! way real ones do. The input of the model's fuzz target and of its property tests, which hold
//! the model to [`Model::check_books`](super::Model::check_books).

use crate::event::{Alloc, Device, Event, Memory, Record, Seen, Via};

/// Reads the bytes as small numbers; past the end, zeros.
struct Bytes<'a> {
    data: &'a [u8],
    at: usize,
}

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        let b = self.data.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        b
    }
    fn one_in(&mut self, n: u8) -> bool {
        self.u8().is_multiple_of(n)
    }
    fn pick(&mut self, n: u8) -> u32 {
        u32::from(self.u8() % n)
    }
    fn size(&mut self) -> u64 {
        match self.u8() % 4 {
            0 => u64::MAX - u64::from(self.u8()),
            1 => u64::from(self.u8()) << 30,
            _ => u64::from(self.u8()) << 20,
        }
    }
}

const CLIENTS: [u32; 16] = [
    0xc1d0_0001,
    0xc1d0_0002,
    0xc1d0_0003,
    0xc1d0_0004,
    0xc1d0_0005,
    0xc1d0_0006,
    0xc1d0_0007,
    0xc1d0_0008,
    0xc1d0_0009,
    0xc1d0_000a,
    0xc1d0_000b,
    0xc1d0_000c,
    0xc1d0_000d,
    0xc1d0_000e,
    0xc1d0_000f,
    0xc1d0_0010,
];
const CLASS_CLIENT: u32 = 0x41;

/// Records for `data`, with non-decreasing times unless the bytes ask otherwise. Long, on
/// purpose: one flat table, a line or two per kind of event, reads better than sixteen helpers.
pub fn records(data: &[u8]) -> Vec<Record> {
    let mut b = Bytes { data, at: 0 };
    let mut out = Vec::new();
    let mut ts = 0u64;
    while b.at < data.len() && out.len() < 4096 {
        let op = b.u8();
        let pid = 1 + b.pick(4);
        let fd = 3 + b.pick(4) as i32;
        // RM takes a client only through the file that made it: mostly the fd's own client, now
        // and then another (a call the model refuses).
        let client = CLIENTS[if b.one_in(8) { b.pick(16) as usize } else { ((pid as usize - 1) * 4 + fd as usize - 3) % CLIENTS.len() }];
        // Mostly forward in time; sometimes backwards, as a damaged or hostile trace may be.
        ts = if op & 0x80 != 0 && op & 0x40 != 0 { ts.saturating_sub(u64::from(b.u8())) } else { ts + u64::from(b.u8()) };
        let event = match op % 31 {
            kind @ 0..=6 => process_or_file(kind, &mut b, pid, fd),
            kind @ 7..=17 => rm_or_uvm(kind, &mut b, fd, client),
            kind => sharing(kind, &mut b, fd, client),
        };
        out.push(Record::new(ts, pid, pid, event));
    }
    out
}

/// One of the client's handles, or the client itself.
fn handle(b: &mut Bytes, client: u32) -> u32 {
    if b.one_in(5) {
        client
    } else {
        0x100 + b.pick(8)
    }
}

/// A multicast attachment's subdevice: a handle with no GPU known, or one of the client's
/// objects, which may be under a device of a GPU.
fn subdevice(b: &mut Bytes) -> u32 {
    if b.one_in(2) {
        b.pick(2)
    } else {
        0x100 + b.pick(8)
    }
}

/// Processes and their files (kinds 0 to 6).
fn process_or_file(kind: u8, b: &mut Bytes, pid: u32, fd: i32) -> Event {
    match kind {
        0 => Event::Process {
            ppid: 1 + b.pick(4),
            seen: if b.one_in(2) { Seen::Forked } else { Seen::Running },
            command: vec![format!("p{pid}")],
        },
        // A process met running: what it listened on and the GPUs it held then.
        1 if b.one_in(5) => Event::Proxy {
            uid: 0,
            command: vec!["litellm".into()],
            config: format!("c{pid}.yaml"),
            deployments: vec![crate::event::Deployment {
                model: "m".into(),
                host: "h".into(),
                port: 8000,
                max_parallel_requests: Some(b.pick(64).into()),
                limit_from: "rpm".into(),
                local: if b.one_in(2) { None } else { Some(b.one_in(2)) },
            }],
            workers: b.one_in(2).then(|| b.pick(8).into()),
        },
        1 if b.one_in(3) => Event::Attached { listening: if b.one_in(2) { vec![8000] } else { vec![] }, gpus: vec![b.pick(3)] },
        1 => Event::Exec { command: vec![format!("e{pid}")] },
        2 => Event::Exit { code: Some(i32::from(b.u8())) },
        3 => Event::Open {
            fd,
            file: u64::from(b.pick(4)),
            device: [Device::Ctl, Device::Ctl, Device::Uvm, Device::Gpu][b.pick(4) as usize],
            cloexec: b.one_in(2),
        },
        4 => Event::Dup { old_fd: fd, new_fd: 3 + b.pick(4) as i32, cloexec: b.one_in(2) },
        5 => Event::Close { fd },
        _ => Event::CloseRange { first: b.pick(6), last: b.pick(8), cloexec_only: b.one_in(2) },
    }
}

/// Allocations, frees and dups, and UVM's ranges and mappings (kinds 7 to 17).
fn rm_or_uvm(kind: u8, b: &mut Bytes, fd: i32, client: u32) -> Event {
    match kind {
        7 => Event::Object { fd, client, parent: client, object: client, class: CLASS_CLIENT, status: 0, gpu: None },
        8 => {
            let (parent, object) = (handle(b, client), 0x100 + b.pick(8));
            Event::Object { fd, client, parent, object, class: 0x80, status: 0, gpu: Some(b.pick(3)) }
        }
        9 | 10 => {
            let (parent, object) = (handle(b, client), 0x100 + b.pick(8));
            let status = if b.one_in(6) { 0x51 } else { 0 };
            let memory = if b.one_in(4) { Memory::System } else { Memory::Video };
            Event::Alloc(Alloc { fd, memory, status, ..Alloc::video(client, parent, object, b.size()) })
        }
        11 => {
            let object = handle(b, client);
            Event::Free { fd, via: Via::RmFree, client, parent: 0, object, status: 0 }
        }
        12 => {
            // Within the client, or from another one: of the same process, or shared, or refused.
            let src_client = if b.one_in(2) { client } else { CLIENTS[b.pick(16) as usize] };
            let src_object = 0x100 + b.pick(8);
            Event::DupObject { fd, client, parent: handle(b, client), object: 0x100 + b.pick(8), src_client, src_object, status: 0 }
        }
        13 => {
            let base = u64::from(b.pick(4)) << 21;
            Event::Alloc(Alloc::uvm_range(fd, base, b.size()))
        }
        14 => Event::UvmFree { fd, base: u64::from(b.pick(4)) << 21, status: 0 },
        15 => {
            let base = (u64::from(b.pick(4)) << 21) + (u64::from(b.pick(2)) << 20);
            Event::UvmMap { fd, base, length: 1 << 20, offset: 0, client, memory: 0x100 + b.pick(8), status: 0 }
        }
        16 => Event::RegisterFd { fd, ctl_fd: 3 + b.pick(4) as i32 },
        _ => Event::UvmUnmap { fd, base: u64::from(b.pick(4)) << 21, length: u64::from(b.pick(3)) << 20, status: 0 },
    }
}

/// Exports, imports, fabric objects and their attachments, shares; the rest lost records.
fn sharing(kind: u8, b: &mut Bytes, fd: i32, client: u32) -> Event {
    match kind {
        18 => Event::ExportObject { fd, client, object: 0x100 + b.pick(8), to_fd: 3 + b.pick(4) as i32, status: 0 },
        19 => {
            let (parent, object) = (handle(b, client), 0x100 + b.pick(8));
            Event::ImportObject { fd, client, parent, object, from_fd: 3 + b.pick(4) as i32, status: 0 }
        }
        20 | 27 => {
            // A sticky fabric object over one of the client's handles, or one to attach to.
            // Among the first two handles, where attachments look for fabric objects.
            let (parent, object, held) = (handle(b, client), 0x100 + b.pick(2), 0x100 + b.pick(8));
            Event::Alloc(Alloc {
                fd,
                class: 0xf8,
                memory: Memory::Virtual,
                holds: b.one_in(2).then_some(held),
                ..Alloc::video(client, parent, object, b.size())
            })
        }
        21 => {
            // A batch: a few handles (some 0: slots emptied) from a small index on, and now and
            // then handles past those followed.
            let objects = (0..1 + b.pick(3)).map(|_| if b.one_in(4) { 0 } else { 0x100 + b.pick(8) }).collect();
            let more = if b.one_in(4) { b.pick(3) as u16 } else { 0 };
            Event::ExportObjects { fd, client, objects, index: b.pick(3) as u16, more, to_fd: 3 + b.pick(4) as i32, status: 0 }
        }
        22 => {
            let parent = handle(b, client);
            let objects = (0..1 + b.pick(3)).map(|_| if b.one_in(4) { 0 } else { 0x100 + b.pick(8) }).collect();
            Event::ImportObjects { fd, client, parent, objects, index: b.pick(3) as u16, more: 0, from_fd: 3 + b.pick(4) as i32, status: 0 }
        }
        23 | 25 | 26 => {
            // Attachments at a few offsets of a few GPUs, some of them failed.
            let attachments: Vec<(u32, u64)> = (0..1 + b.pick(3)).map(|_| (0x100 + b.pick(8), u64::from(b.pick(3)) << 21)).collect();
            let attached = b.pick(attachments.len() as u8 + 1) as u16;
            let (fabric, subdevice) = (0x100 + b.pick(2), subdevice(b));
            Event::FabricAttach { fd, client, fabric, subdevice, attachments, attached, more: 0, status: 0 }
        }
        24 | 28 => {
            let offsets: Vec<u64> = (0..1 + b.pick(2)).map(|_| u64::from(b.pick(3)) << 21).collect();
            let detached = b.pick(offsets.len() as u8 + 1) as u16;
            let (fabric, subdevice) = (0x100 + b.pick(2), subdevice(b));
            Event::FabricDetach { fd, client, fabric, subdevice, offsets, detached, more: 0, status: 0 }
        }
        29 => {
            // Shared beyond its process (ALL, a client, the process's own), or no longer.
            let object = handle(b, client);
            let (share_type, action) = ([1, 3, 4][b.pick(3) as usize], [0, 0, 1, 2][b.pick(4) as usize]);
            Event::Share { fd, client, object, share_type, target: 0, action, status: 0 }
        }
        _ => Event::Lost { records: b.size() },
    }
}

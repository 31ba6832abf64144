//! The window's own encoding of records: what `watch` holds ten minutes of. Each segment is
//! decodable on its own, records one after another:
//!
//! - a header byte: the event's tag (6 bits), whether the pid is the previous record's, whether
//!   the thread is not the process's main one (its tid follows);
//! - the time as the difference from the previous record's, the pid where it changed;
//! - the event's fields as varints, RM handles, connections and addresses as differences from the
//!   previous of their kind (a server's handles and connections count up), strings interned once
//!   per segment (a request line, a worker's command line).
//!
//! Every field of an event is described once, in [`fields`], and that one description both
//! writes and reads it: the two directions cannot disagree. Events too rare to be worth a layout
//! (samples, places, marks, fabric and batched export calls) are carried as JSON.

use std::collections::HashMap;

use bytes::{BufMut, Bytes, BytesMut};

use crate::event::{Alloc, Device, Event, Memory, Record, Seen, Via};

/// The values later ones are written as differences from, one per kind.
#[derive(Clone, Copy)]
enum Slot {
    Ts,
    Client,
    Parent,
    Object,
    Conn,
    Address,
}
const SLOTS: usize = 6;

/// A segment's strings interned at most: past it, strings are written out each time.
const MAX_INTERNED: usize = 4096;

/// The event carried as JSON (serde's externally tagged form, not a trace line's): a kind without
/// a layout of its own.
const TAG_JSON: u8 = 62;
/// The whole record carried as JSON: one with `--raw` bytes.
const TAG_RECORD_JSON: u8 = 63;
const SAME_PID: u8 = 1 << 6;
const OTHER_THREAD: u8 = 1 << 7;

/// One side of the encoding: a writer takes each value, a reader fills it in.
trait Io {
    fn uint(&mut self, v: &mut u64);
    /// A value written as its difference from the previous of its kind.
    fn delta(&mut self, slot: Slot, v: &mut u64);
    fn text(&mut self, s: &mut String);
    /// What was read is no record gputrace wrote: the segment's reading stops.
    fn fail(&mut self);
    /// Bytes left to read (a writer has no end).
    fn room(&self) -> u64;
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

fn u32_(io: &mut impl Io, v: &mut u32) {
    let mut x = u64::from(*v);
    io.uint(&mut x);
    *v = u32::try_from(x).unwrap_or_else(|_| {
        io.fail();
        0
    });
}

fn u16_(io: &mut impl Io, v: &mut u16) {
    let mut x = u32::from(*v);
    u32_(io, &mut x);
    *v = u16::try_from(x).unwrap_or_else(|_| {
        io.fail();
        0
    });
}

fn i32_(io: &mut impl Io, v: &mut i32) {
    let mut x = zigzag(i64::from(*v));
    io.uint(&mut x);
    *v = i32::try_from(unzigzag(x)).unwrap_or_else(|_| {
        io.fail();
        0
    });
}

/// A 32-bit value written as its difference from the previous of its kind (RM handles).
fn handle(io: &mut impl Io, slot: Slot, v: &mut u32) {
    let mut x = u64::from(*v);
    io.delta(slot, &mut x);
    *v = u32::try_from(x).unwrap_or_else(|_| {
        io.fail();
        0
    });
}

/// The client, parent and object handles of an RM call.
fn rm_handles(io: &mut impl Io, client: &mut u32, parent: &mut u32, object: &mut u32) {
    handle(io, Slot::Client, client);
    handle(io, Slot::Parent, parent);
    handle(io, Slot::Object, object);
}

/// Booleans (an option's presence among them) packed in one varint.
fn bits<const N: usize>(io: &mut impl Io, b: &mut [bool; N]) {
    let mut x = b.iter().enumerate().fold(0u64, |acc, (i, &set)| acc | (u64::from(set) << i));
    io.uint(&mut x);
    if x >> N != 0 {
        io.fail();
    }
    for (i, set) in b.iter_mut().enumerate() {
        *set = x & (1 << i) != 0;
    }
}

fn flag(io: &mut impl Io, v: &mut bool) {
    let mut b = [*v];
    bits(io, &mut b);
    *v = b[0];
}

/// One of a closed set of values, as its place in `all`.
fn pick<T: Copy + PartialEq>(io: &mut impl Io, v: &mut T, all: &[T]) {
    let mut i = all.iter().position(|x| x == v).unwrap_or(0) as u64;
    io.uint(&mut i);
    match all.get(i as usize) {
        Some(&x) => *v = x,
        None => io.fail(),
    }
}

/// An optional value: its presence, then the value where present.
fn option<I: Io, T: Default>(io: &mut I, v: &mut Option<T>, value: impl FnOnce(&mut I, &mut T)) {
    let mut present = v.is_some();
    flag(io, &mut present);
    *v = present.then(|| {
        let mut x = v.take().unwrap_or_default();
        value(io, &mut x);
        x
    });
}

fn strings(io: &mut impl Io, v: &mut Vec<String>) {
    let mut n = v.len() as u64;
    io.uint(&mut n);
    // Each string takes a byte at least: a count past what is left is no record of ours.
    if n > io.room() {
        return io.fail();
    }
    v.resize_with(n as usize, String::new);
    for s in v.iter_mut() {
        io.text(s);
    }
}

const DEVICES: [Device; 3] = [Device::Ctl, Device::Gpu, Device::Uvm];
const MEMORIES: [Memory; 3] = Memory::ALL;
const VIAS: [Via; 8] = [
    Via::RmAllocNvos21,
    Via::RmAllocNvos64,
    Via::VidHeapControl,
    Via::RmAllocMemory,
    Via::RmFree,
    Via::UvmCreateExternalRange,
    Via::UvmAllocSemaphorePool,
    Via::UvmFree,
];
const SEENS: [Seen; 3] = [Seen::Launched, Seen::Running, Seen::Forked];

// A value missing from its table would be written as the table's first: a new variant fails to
// compile here until it is in its table above.
const _: fn(Device, Memory, Via, Seen) = |device, memory, via, seen| {
    match device {
        Device::Ctl | Device::Gpu | Device::Uvm => {}
    }
    match memory {
        Memory::Video | Memory::System | Memory::Virtual => {}
    }
    match via {
        Via::RmAllocNvos21
        | Via::RmAllocNvos64
        | Via::VidHeapControl
        | Via::RmAllocMemory
        | Via::RmFree
        | Via::UvmCreateExternalRange
        | Via::UvmAllocSemaphorePool
        | Via::UvmFree => {}
    }
    match seen {
        Seen::Launched | Seen::Running | Seen::Forked => {}
    }
};

/// The tag of an event with a layout of its own; None: carried as JSON.
fn tag(e: &Event) -> Option<u8> {
    Some(match e {
        Event::Exit { .. } => 0,
        Event::Open { .. } => 1,
        Event::FdFound { .. } => 2,
        Event::Dup { .. } => 3,
        Event::Close { .. } => 4,
        Event::SetCloexec { .. } => 5,
        Event::Object { .. } => 6,
        Event::Alloc(_) => 7,
        Event::Free { .. } => 8,
        Event::DupObject { .. } => 9,
        Event::ExportObject { .. } => 10,
        Event::ImportObject { .. } => 11,
        Event::RegisterFd { .. } => 12,
        Event::UvmMap { .. } => 13,
        Event::UvmFree { .. } => 14,
        Event::UvmUnmap { .. } => 15,
        Event::Lost { .. } => 16,
        Event::Bind { .. } => 17,
        Event::Listen { .. } => 18,
        Event::Accept { .. } => 19,
        Event::Received { .. } => 20,
        Event::Sent { .. } => 21,
        Event::ConnClose { .. } => 22,
        Event::OomKill => 23,
        Event::Process { .. } => 24,
        Event::Exec { .. } => 25,
        Event::CloseRange { .. } => 26,
        _ => return None,
    })
}

/// The event of `tag` with every field empty, for [`fields`] to fill in.
fn blank(tag: u8) -> Option<Event> {
    let alloc = Alloc::video(0, 0, 0, 0);
    Some(match tag {
        0 => Event::Exit { code: None },
        1 => Event::Open { fd: 0, file: 0, device: Device::Ctl, cloexec: false },
        2 => Event::FdFound { fd: 0, file: 0, device: Device::Ctl },
        3 => Event::Dup { old_fd: 0, new_fd: 0, cloexec: false },
        4 => Event::Close { fd: 0 },
        5 => Event::SetCloexec { fd: 0, cloexec: false },
        6 => Event::Object { fd: 0, client: 0, parent: 0, object: 0, class: 0, status: 0, gpu: None },
        7 => Event::Alloc(alloc),
        8 => Event::Free { fd: 0, via: Via::RmFree, client: 0, parent: 0, object: 0, status: 0 },
        9 => Event::DupObject { fd: 0, client: 0, parent: 0, object: 0, src_client: 0, src_object: 0, status: 0 },
        10 => Event::ExportObject { fd: 0, client: 0, object: 0, to_fd: 0, status: 0 },
        11 => Event::ImportObject { fd: 0, client: 0, parent: 0, object: 0, from_fd: 0, status: 0 },
        12 => Event::RegisterFd { fd: 0, ctl_fd: 0 },
        13 => Event::UvmMap { fd: 0, base: 0, length: 0, offset: 0, client: 0, memory: 0, status: 0 },
        14 => Event::UvmFree { fd: 0, base: 0, status: 0 },
        15 => Event::UvmUnmap { fd: 0, base: 0, length: 0, status: 0 },
        16 => Event::Lost { records: 0 },
        17 => Event::Bind { fd: 0, port: 0 },
        18 => Event::Listen { fd: 0 },
        19 => Event::Accept { fd: 0, conn: 0 },
        20 => Event::Received { conn: 0, bytes: 0, request: None },
        21 => Event::Sent { conn: 0, bytes: 0, status: None, data: false },
        22 => Event::ConnClose { conn: 0 },
        23 => Event::OomKill,
        24 => Event::Process { ppid: 0, seen: Seen::Running, command: Vec::new() },
        25 => Event::Exec { command: Vec::new() },
        26 => Event::CloseRange { first: 0, last: 0, cloexec_only: false },
        _ => return None,
    })
}

/// Every field of an event with a layout, in order: written from it, or read into it.
fn fields(io: &mut impl Io, e: &mut Event) {
    match e {
        Event::Exit { code } => option(io, code, i32_),
        Event::Open { fd, file, device, cloexec } => {
            i32_(io, fd);
            io.uint(file);
            pick(io, device, &DEVICES);
            flag(io, cloexec);
        }
        Event::FdFound { fd, file, device } => {
            i32_(io, fd);
            io.uint(file);
            pick(io, device, &DEVICES);
        }
        Event::Dup { old_fd, new_fd, cloexec } => {
            i32_(io, old_fd);
            i32_(io, new_fd);
            flag(io, cloexec);
        }
        Event::Close { fd } | Event::Listen { fd } => i32_(io, fd),
        Event::SetCloexec { fd, cloexec } => {
            i32_(io, fd);
            flag(io, cloexec);
        }
        Event::Alloc(a) => alloc(io, a),
        Event::Object { .. }
        | Event::Free { .. }
        | Event::DupObject { .. }
        | Event::ExportObject { .. }
        | Event::ImportObject { .. }
        | Event::RegisterFd { .. }
        | Event::UvmMap { .. }
        | Event::UvmFree { .. }
        | Event::UvmUnmap { .. } => driver_fields(io, e),
        Event::Lost { records } => io.uint(records),
        Event::Bind { .. } | Event::Accept { .. } | Event::Received { .. } | Event::Sent { .. } | Event::ConnClose { .. } => {
            socket_fields(io, e)
        }
        Event::Process { ppid, seen, command } => {
            u32_(io, ppid);
            pick(io, seen, &SEENS);
            strings(io, command);
        }
        Event::Exec { command } => strings(io, command),
        Event::CloseRange { first, last, cloexec_only } => {
            u32_(io, first);
            u32_(io, last);
            flag(io, cloexec_only);
        }
        // No fields, or no layout (never given one: `tag` says JSON).
        _ => {}
    }
}

/// The fields of a driver call that is not an allocation: RM objects, frees, dups, exports and
/// imports, UVM mappings.
fn driver_fields(io: &mut impl Io, e: &mut Event) {
    match e {
        Event::Object { fd, client, parent, object, class, status, gpu } => {
            i32_(io, fd);
            rm_handles(io, client, parent, object);
            u32_(io, class);
            u32_(io, status);
            option(io, gpu, u32_);
        }
        Event::Free { fd, via, client, parent, object, status } => {
            i32_(io, fd);
            pick(io, via, &VIAS);
            rm_handles(io, client, parent, object);
            u32_(io, status);
        }
        Event::DupObject { fd, client, parent, object, src_client, src_object, status } => {
            i32_(io, fd);
            rm_handles(io, client, parent, object);
            handle(io, Slot::Client, src_client);
            handle(io, Slot::Object, src_object);
            u32_(io, status);
        }
        Event::ExportObject { fd, client, object, to_fd, status } => {
            i32_(io, fd);
            handle(io, Slot::Client, client);
            handle(io, Slot::Object, object);
            i32_(io, to_fd);
            u32_(io, status);
        }
        Event::ImportObject { fd, client, parent, object, from_fd, status } => {
            i32_(io, fd);
            rm_handles(io, client, parent, object);
            i32_(io, from_fd);
            u32_(io, status);
        }
        Event::RegisterFd { fd, ctl_fd } => {
            i32_(io, fd);
            i32_(io, ctl_fd);
        }
        Event::UvmMap { fd, base, length, offset, client, memory, status } => {
            i32_(io, fd);
            io.delta(Slot::Address, base);
            io.uint(length);
            io.uint(offset);
            handle(io, Slot::Client, client);
            handle(io, Slot::Object, memory);
            u32_(io, status);
        }
        Event::UvmFree { fd, base, status } => {
            i32_(io, fd);
            io.delta(Slot::Address, base);
            u32_(io, status);
        }
        Event::UvmUnmap { fd, base, length, status } => {
            i32_(io, fd);
            io.delta(Slot::Address, base);
            io.uint(length);
            u32_(io, status);
        }
        _ => {}
    }
}

/// The fields of a server's socket events.
fn socket_fields(io: &mut impl Io, e: &mut Event) {
    match e {
        Event::Bind { fd, port } => {
            i32_(io, fd);
            u16_(io, port);
        }
        Event::Accept { fd, conn } => {
            i32_(io, fd);
            io.delta(Slot::Conn, conn);
        }
        Event::Received { conn, bytes, request } => {
            io.delta(Slot::Conn, conn);
            io.uint(bytes);
            option(io, request, |io, r| io.text(r));
        }
        Event::Sent { conn, bytes, status, data } => {
            io.delta(Slot::Conn, conn);
            io.uint(bytes);
            option(io, status, u16_);
            flag(io, data);
        }
        Event::ConnClose { conn } => io.delta(Slot::Conn, conn),
        _ => {}
    }
}

fn alloc(io: &mut impl Io, a: &mut Alloc) {
    i32_(io, &mut a.fd);
    pick(io, &mut a.via, &VIAS);
    pick(io, &mut a.memory, &MEMORIES);
    io.uint(&mut a.bytes);
    u32_(io, &mut a.status);
    rm_handles(io, &mut a.client, &mut a.parent, &mut a.object);
    u32_(io, &mut a.class);
    // One varint says which of the rare fields follow.
    let mut present = [a.base.is_some(), a.errno.is_some(), a.holds.is_some()];
    bits(io, &mut present);
    let [base, errno, holds] = present;
    if base {
        let mut b = a.base.unwrap_or_default();
        io.delta(Slot::Address, &mut b);
        a.base = Some(b);
    }
    if errno {
        let mut e = a.errno.unwrap_or_default();
        i32_(io, &mut e);
        a.errno = Some(e);
    }
    if holds {
        let mut h = a.holds.unwrap_or_default();
        u32_(io, &mut h);
        a.holds = Some(h);
    }
}

/// Writes a segment's records; a new segment starts with a new encoder.
#[derive(Default)]
pub struct Encoder {
    prev: [u64; SLOTS],
    pid: Option<u32>,
    interned: HashMap<String, u64>,
}

struct Writer<'a> {
    out: &'a mut BytesMut,
    prev: &'a mut [u64; SLOTS],
    interned: &'a mut HashMap<String, u64>,
}

fn put_uint(out: &mut BytesMut, mut v: u64) {
    while v >= 0x80 {
        out.put_u8(v as u8 | 0x80);
        v >>= 7;
    }
    out.put_u8(v as u8);
}

impl Io for Writer<'_> {
    fn uint(&mut self, v: &mut u64) {
        put_uint(self.out, *v);
    }
    fn delta(&mut self, slot: Slot, v: &mut u64) {
        let prev = std::mem::replace(&mut self.prev[slot as usize], *v);
        put_uint(self.out, zigzag(v.wrapping_sub(prev) as i64));
    }
    fn text(&mut self, s: &mut String) {
        // 0: written out (and interned, while there is room); n: the (n-1)th interned string.
        if let Some(&n) = self.interned.get(s.as_str()) {
            return put_uint(self.out, n);
        }
        put_uint(self.out, 0);
        put_uint(self.out, s.len() as u64);
        self.out.put_slice(s.as_bytes());
        if self.interned.len() < MAX_INTERNED {
            let n = self.interned.len() as u64 + 1;
            self.interned.insert(s.clone(), n);
        }
    }
    fn fail(&mut self) {}
    fn room(&self) -> u64 {
        u64::MAX
    }
}

impl Encoder {
    /// Appends `record` to the segment `out`.
    pub fn put(&mut self, record: &Record, out: &mut BytesMut) {
        let tag = if record.raw.is_some() { TAG_RECORD_JSON } else { tag(&record.event).unwrap_or(TAG_JSON) };
        let mut header = tag;
        if self.pid == Some(record.pid) {
            header |= SAME_PID;
        }
        if record.tid != record.pid {
            header |= OTHER_THREAD;
        }
        out.put_u8(header);
        let mut w = Writer { out, prev: &mut self.prev, interned: &mut self.interned };
        w.delta(Slot::Ts, &mut { record.ts });
        if self.pid != Some(record.pid) {
            put_uint(w.out, u64::from(record.pid));
        }
        if record.tid != record.pid {
            put_uint(w.out, u64::from(record.tid));
        }
        self.pid = Some(record.pid);
        match tag {
            TAG_JSON | TAG_RECORD_JSON => {
                // Serialising our own types to memory cannot fail.
                let json = if tag == TAG_JSON { serde_json::to_vec(&record.event) } else { serde_json::to_vec(record) };
                let json = json.unwrap_or_default();
                put_uint(w.out, json.len() as u64);
                w.out.put_slice(&json);
            }
            // `fields` only reads what it writes from.
            _ => fields(&mut w, &mut record.event.clone()),
        }
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    prev: [u64; SLOTS],
    strings: Vec<String>,
    failed: bool,
}

impl Reader<'_> {
    fn take(&mut self, n: u64) -> Option<&[u8]> {
        let end = usize::try_from(n).ok().and_then(|n| self.at.checked_add(n)).filter(|&end| end <= self.bytes.len());
        match end {
            Some(end) => {
                let slice = &self.bytes[self.at..end];
                self.at = end;
                Some(slice)
            }
            None => {
                self.failed = true;
                None
            }
        }
    }

    fn read_uint(&mut self) -> u64 {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let Some(&b) = self.bytes.get(self.at) else { break };
            self.at += 1;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return v;
            }
        }
        self.failed = true;
        0
    }

    fn record(&mut self, pid: &mut Option<u32>) -> Option<Record> {
        let header = *self.bytes.get(self.at)?;
        self.at += 1;
        let mut ts = 0;
        self.delta(Slot::Ts, &mut ts);
        if header & SAME_PID == 0 {
            *pid = u32::try_from(self.read_uint()).ok();
        }
        let pid = (*pid)?;
        let tid = if header & OTHER_THREAD != 0 { u32::try_from(self.read_uint()).ok()? } else { pid };
        let tag = header & 0x3f;
        let record = match tag {
            TAG_JSON | TAG_RECORD_JSON => {
                let n = self.read_uint();
                let json = self.take(n)?;
                if tag == TAG_JSON {
                    Record::new(ts, pid, tid, serde_json::from_slice(json).ok()?)
                } else {
                    serde_json::from_slice(json).ok()?
                }
            }
            _ => {
                let mut event = blank(tag)?;
                fields(self, &mut event);
                Record::new(ts, pid, tid, event)
            }
        };
        (!self.failed).then_some(record)
    }
}

impl Io for Reader<'_> {
    fn uint(&mut self, v: &mut u64) {
        *v = self.read_uint();
    }
    fn delta(&mut self, slot: Slot, v: &mut u64) {
        let d = unzigzag(self.read_uint());
        *v = self.prev[slot as usize].wrapping_add(d as u64);
        self.prev[slot as usize] = *v;
    }
    fn text(&mut self, s: &mut String) {
        let n = self.read_uint();
        if n > 0 {
            match self.strings.get(n as usize - 1) {
                Some(known) => s.clone_from(known),
                None => self.failed = true,
            }
            return;
        }
        let len = self.read_uint();
        let Some(bytes) = self.take(len) else { return };
        match std::str::from_utf8(bytes) {
            Ok(text) => {
                *s = text.to_string();
                if self.strings.len() < MAX_INTERNED {
                    self.strings.push(s.clone());
                }
            }
            Err(_) => self.failed = true,
        }
    }
    fn fail(&mut self) {
        self.failed = true;
    }
    fn room(&self) -> u64 {
        (self.bytes.len() - self.at) as u64
    }
}

/// The records of a segment, in order. Bytes that are no record of ours (never seen: gputrace
/// wrote them) end the segment's reading rather than stopping the dump.
pub fn records(bytes: &Bytes) -> impl Iterator<Item = Record> + '_ {
    let mut reader = Reader { bytes, at: 0, prev: [0; SLOTS], strings: Vec::new(), failed: false };
    let mut pid = None;
    std::iter::from_fn(move || if reader.failed { None } else { reader.record(&mut pid) })
}

#[cfg(test)]
mod tests;

//! The model's live state written back as records: what a dump of an always-on trace starts
//! with, so that `report` on a short window still sees who held what before it began. Replaying
//! the snapshot builds a model with the same live state (processes, fd tables, open files and
//! their registrations, RM handle trees, UVM ranges and mappings, objects exported to files, live allocations with their
//! own time, pid and GPU, requests in flight and each server's readiness): the records after the
//! window then do to it what they did to the original.
//!
//! What is gone is left out: exited processes that own no live memory, freed allocations, ended
//! requests (but the first answered one of each process, and those before their first data when
//! a live allocation was made: what a request costs is measured from them), failures, all marks
//! but each process's latest, all samples but the latest. LiteLLM proxies are kept as their
//! configs were last read.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

use super::{AllocId, Allocation, FileId, Model, Request};
use crate::abi::class;
use crate::event::{Alloc, Device, Event, Record};

/// Ended requests kept for what they cost: the most recent this many.
const KEPT_PREFILLS: usize = 256;

/// Descriptor numbers lent to a process for the snapshot's own records (closed before it ends):
/// far above what a process holds.
const SPARE_FD: i32 = 1 << 30;
/// Handles for stand-in objects, far from the driver's own (which count up from 0xcaf00000 or
/// from a client's base).
const STAND_IN: u32 = 0x5eed_0000;

impl Model {
    pub fn snapshot(&self) -> Vec<Record> {
        let mut s = Snapshot::new(self);
        s.processes();
        s.files();
        s.clients();
        s.allocations();
        s.remaining_handles();
        s.uvm_mappings();
        s.attachments();
        s.exports();
        s.registrations();
        s.shares();
        s.requests();
        s.marks_and_sample();
        s.proxies();
        s.finish();
        s.out
    }
}

struct Snapshot<'a> {
    model: &'a Model,
    out: Vec<Record>,
    /// The processes written, and who holds each file among them.
    written: BTreeSet<u32>,
    holder: HashMap<FileId, (u32, i32)>,
    /// Fds lent for a record that had to name a file its process does not hold: (pid, file) ->
    /// fd, closed at the end.
    lent: BTreeMap<(u32, FileId), i32>,
    next_spare: i32,
    /// Handles written so far, by client.
    done: HashSet<(u32, u32)>,
    /// The handle each live allocation was written under first: later handles dup it.
    made: HashMap<AllocId, (u32, u32)>,
    /// Stand-in objects and clients, freed at the end: (client, handle, when). A stand-in that
    /// holds memory whose handles were all released goes at that release's own time.
    stand_ins: Vec<(u32, u32, u64)>,
    next_stand_in: u32,
    at: u64,
}

impl<'a> Snapshot<'a> {
    fn new(model: &'a Model) -> Self {
        Snapshot {
            model,
            out: Vec::new(),
            written: BTreeSet::new(),
            holder: HashMap::new(),
            lent: BTreeMap::new(),
            next_spare: SPARE_FD,
            done: HashSet::new(),
            made: HashMap::new(),
            stand_ins: Vec::new(),
            next_stand_in: STAND_IN,
            at: model.last_ts,
        }
    }

    fn push(&mut self, ts: u64, pid: u32, event: Event) {
        self.out.push(Record::new(ts, pid, 0, event));
    }

    /// Running processes, and exited ones whose memory lives on (a forked child holds their
    /// file) or that still name a file (records after an exit, in a damaged trace): all before any fd, so a forked one copies nothing from its parent here.
    fn processes(&mut self) {
        let owners: HashSet<u32> = self.model.live_allocations().map(|a| a.pid).collect();
        let mut keep: Vec<_> =
            self.model.processes.values().filter(|p| p.exited.is_none() || !p.fds.is_empty() || owners.contains(&p.pid)).collect();
        keep.sort_by_key(|p| (p.first_ts, p.pid));
        for p in keep {
            self.written.insert(p.pid);
            let event = Event::Process { ppid: p.ppid, seen: p.seen, command: p.command.clone() };
            self.push(p.first_ts, p.pid, event);
            if let Some(place) = &p.place {
                self.push(p.first_ts, p.pid, Event::Place(place.clone()));
            }
            for &(ts, port) in &p.bound {
                self.push(ts, p.pid, Event::Bind { fd: -1, port });
            }
            if let Some(ts) = p.listened {
                self.push(ts, p.pid, Event::Listen { fd: -1 });
            }
            if let Some(a) = &p.attached {
                self.push(a.ts, p.pid, Event::Attached { listening: a.listening.clone(), gpus: a.gpus.clone() });
            }
            if let Some(ts) = p.oom_killed {
                self.push(ts, p.pid, Event::OomKill);
            }
            // Before its fds: what an exited process still names stays named.
            if let Some(ts) = p.exited {
                self.push(ts, p.pid, Event::Exit { code: p.exit_code });
            }
        }
    }

    fn files(&mut self) {
        let pids: Vec<u32> = self.written.iter().copied().collect();
        for pid in pids {
            let mut fds: Vec<_> = self.model.processes[&pid].fds.iter().map(|(fd, f)| (*fd, *f)).collect();
            fds.sort_by_key(|(fd, _)| *fd);
            for (fd, f) in fds {
                let device = self.device(f.file);
                self.push(self.at, pid, Event::FdFound { fd, file: f.file, device });
                if f.cloexec {
                    self.push(self.at, pid, Event::SetCloexec { fd, cloexec: true });
                }
                self.holder.entry(f.file).or_insert((pid, fd));
            }
        }
    }

    fn device(&self, file: FileId) -> Device {
        self.model.files.get(&file).map_or(Device::Ctl, |f| f.device)
    }

    /// An fd of `pid` that refers to `file`: its own, or one lent for the snapshot.
    fn fd_for(&mut self, pid: u32, file: FileId) -> i32 {
        if let Some(fd) = self.model.processes.get(&pid).and_then(|p| p.fds.iter().find(|(_, f)| f.file == file)).map(|(fd, _)| *fd) {
            return fd;
        }
        if let Some(&fd) = self.lent.get(&(pid, file)) {
            return fd;
        }
        let fd = self.next_spare;
        self.next_spare += 1;
        self.lent.insert((pid, file), fd);
        let device = self.device(file);
        self.push(self.at, pid, Event::FdFound { fd, file, device });
        fd
    }

    /// Who writes a client and what it shared: a process holding the client's file (lent an
    /// fd where none does), or nobody (pid 0, no fd) for a client of no known file.
    fn writer_of(&mut self, c: &super::handles::Client) -> Option<(u32, i32)> {
        match c.file {
            Some(file) => self.someone_with(file),
            None => Some((0, -1)),
        }
    }

    /// Who can name `file`: a process holding it, else the first written (lent an fd).
    fn someone_with(&mut self, file: FileId) -> Option<(u32, i32)> {
        if let Some(&h) = self.holder.get(&file) {
            return Some(h);
        }
        let pid = *self.written.iter().next()?;
        Some((pid, self.fd_for(pid, file)))
    }

    /// Every client, through a process holding its file and then named as its maker's (RM's
    /// ProcID: which dups its share policy lets through), then its non-memory objects parents
    /// first (stopping at memory handles, whose subtrees follow their memory).
    fn clients(&mut self) {
        let model = self.model;
        let mut handles: Vec<u32> = model.clients.keys().copied().collect();
        handles.sort_unstable();
        for client in handles {
            let c = &model.clients[&client];
            let Some((pid, fd)) = self.writer_of(c) else { continue };
            let event = Event::Object { fd, client, parent: client, object: client, class: class::ROOT_CLIENT, status: 0, gpu: None };
            self.push(self.at, pid, event);
            if c.pid != Some(pid) {
                self.push(self.at, pid, Event::ClientMaker { client, maker: c.pid.unwrap_or(0) });
            }
            for handle in tree_order(c, false) {
                let o = &c.objects[&handle];
                let event = Event::Object { fd, client, parent: o.parent, object: handle, class: o.class, status: 0, gpu: o.gpu };
                self.push(self.at, pid, event);
                self.done.insert((client, handle));
            }
        }
    }

    /// Live allocations in the order they were made, each with its own time, pid and GPU.
    fn allocations(&mut self) {
        let model = self.model;
        let ranges: HashMap<AllocId, (FileId, u64)> = model.uvm_ranges.iter().map(|(&(file, base), &id)| (id, (file, base))).collect();
        let mut handles: HashMap<AllocId, Vec<(u32, u32)>> = HashMap::new();
        for (&client, c) in &model.clients {
            for (&h, o) in &c.objects {
                if let Some(id) = o.alloc {
                    handles.entry(id).or_default().push((client, h));
                }
            }
        }
        for list in handles.values_mut() {
            list.sort_unstable();
        }
        let mut live: Vec<AllocId> = (0..model.allocations.len()).filter(|&id| model.allocations[id].is_live()).collect();
        // In the order the model made them: what a sticky fabric object holds comes before it.
        live.sort_unstable();
        for id in live {
            let a = &model.allocations[id];
            let alloc = |fd, client, parent, object, base| Alloc {
                fd,
                via: a.via,
                memory: a.memory,
                bytes: a.bytes,
                status: 0,
                client,
                parent,
                object,
                class: a.class,
                base,
                errno: None,
                holds: None,
            };
            if let Some(&(file, base)) = ranges.get(&id) {
                let fd = self.fd_for(a.pid, file);
                self.out.push(Record::new(a.ts, a.pid, a.tid, Event::Alloc(alloc(fd, 0, 0, 0, Some(base)))));
                continue;
            }
            let list = handles.get(&id).map(Vec::as_slice).unwrap_or_default();
            let primary = list.iter().copied().find(|&h| h == (a.client, a.object)).or(list.first().copied());
            // Written in place when its parent is already there and gives it its GPU; otherwise
            // under a stand-in device of its GPU, and moved to its place with the other handles.
            // A sticky fabric object is written in the client of the memory it holds (RM's own
            // rule), and dup'ed from there to where it is now.
            let held = model.holds.get(&id).and_then(|held| self.made.get(held)).copied();
            let in_place = primary.and_then(|(client, h)| {
                let c = &model.clients[&client];
                let parent = c.objects[&h].parent;
                let ready = parent == h || !c.objects.contains_key(&parent) || self.done.contains(&(client, parent));
                let gpu = c.objects.get(&parent).filter(|_| parent != h).and_then(|p| p.gpu);
                let with_held = held.is_none_or(|(held_client, _)| held_client == client);
                (ready && gpu == a.gpu && with_held).then_some((client, parent, h))
            });
            let (client, parent, handle) = match in_place {
                Some(place) => {
                    self.done.insert((place.0, place.2));
                    place
                }
                None => self.stand_in_place(a, held, primary),
            };
            self.made.insert(id, (client, handle));
            let holds = held.map(|(_, h)| h);
            self.out.push(Record::new(a.ts, a.pid, a.tid, Event::Alloc(Alloc { holds, ..alloc(-1, client, parent, handle, None) })));
        }
    }

    /// Where memory goes that cannot be written in place: under a stand-in device of its GPU, in
    /// the client of the memory a fabric object holds, its own handle's client, or a stand-in
    /// client; then moved to its place with the other handles.
    fn stand_in_place(&mut self, a: &Allocation, held: Option<(u32, u32)>, primary: Option<(u32, u32)>) -> (u32, u32, u32) {
        let model = self.model;
        let client = match (held, primary) {
            (Some((held_client, _)), _) => held_client,
            (None, Some((client, _))) => client,
            (None, None) if model.clients.contains_key(&a.client) => a.client,
            (None, None) => {
                let client = self.stand_in(None);
                self.push(
                    self.at,
                    0,
                    Event::Object { fd: -1, client, parent: client, object: client, class: class::ROOT_CLIENT, status: 0, gpu: None },
                );
                client
            }
        };
        let device = self.stand_in(Some(client));
        // Memory no handle refers to (released, held by a mapping, an export or a
        // fabric object): its stand-in goes at its release's time, which it keeps.
        if let (None, Some(released)) = (primary, a.released) {
            if let Some(last) = self.stand_ins.last_mut() {
                last.2 = released;
            }
        }
        let event = Event::Object { fd: -1, client, parent: client, object: device, class: class::DEVICE, status: 0, gpu: a.gpu };
        self.push(self.at, 0, event);
        let handle = match primary {
            Some((c, h)) if c == client => h,
            _ => self.next_handle(),
        };
        (client, device, handle)
    }

    fn next_handle(&mut self) -> u32 {
        self.next_stand_in += 1;
        self.next_stand_in
    }

    /// A stand-in handle in `client` (a stand-in client when None), freed at the end.
    fn stand_in(&mut self, client: Option<u32>) -> u32 {
        let handle = self.next_handle();
        self.stand_ins.push((client.unwrap_or(handle), handle, self.at));
        handle
    }

    /// Memory handles not written in place (dups, those under a stand-in), and everything below
    /// memory handles, parents first.
    fn remaining_handles(&mut self) {
        let model = self.model;
        let mut clients: Vec<u32> = model.clients.keys().copied().collect();
        clients.sort_unstable();
        for client in clients {
            let c = &model.clients[&client];
            for handle in tree_order(c, true) {
                if self.done.contains(&(client, handle)) {
                    continue;
                }
                let o = &c.objects[&handle];
                let event = match o.alloc.and_then(|id| self.made.get(&id)) {
                    Some(&(src_client, src_object)) => {
                        Event::DupObject { fd: -1, client, parent: o.parent, object: handle, src_client, src_object, status: 0 }
                    }
                    None => Event::Object { fd: -1, client, parent: o.parent, object: handle, class: o.class, status: 0, gpu: o.gpu },
                };
                self.push(self.at, 0, event);
                self.done.insert((client, handle));
            }
        }
    }

    /// Memory attached to fabric objects, attached again from the fabric object's client (through
    /// a stand-in dup where the memory was written in another), at its GPU through a stand-in
    /// subdevice of that GPU, or at the handle that named it.
    fn attachments(&mut self) {
        let model = self.model;
        let mut attached: Vec<(AllocId, (u64, u64), AllocId)> =
            model.attachments.iter().flat_map(|(f, slots)| slots.iter().map(move |(key, held)| (*f, *key, *held))).collect();
        attached.sort_unstable();
        for (fabric, (at, offset), held) in attached {
            let (Some(&(client, fabric)), Some(&(held_client, memory))) = (self.made.get(&fabric), self.made.get(&held)) else { continue };
            let subdevice = match u32::try_from(at) {
                Ok(gpu) => {
                    let handle = self.stand_in(Some(client));
                    let object = Event::Object {
                        fd: -1,
                        client,
                        parent: client,
                        object: handle,
                        class: class::SUBDEVICE,
                        status: 0,
                        gpu: Some(gpu),
                    };
                    self.push(self.at, 0, object);
                    handle
                }
                Err(_) => at as u32,
            };
            let memory = if held_client == client {
                memory
            } else {
                let handle = self.stand_in(Some(client));
                let dup = Event::DupObject {
                    fd: -1,
                    client,
                    parent: client,
                    object: handle,
                    src_client: held_client,
                    src_object: memory,
                    status: 0,
                };
                self.push(self.at, 0, dup);
                handle
            };
            let attachments = vec![(memory, offset)];
            self.push(self.at, 0, Event::FabricAttach { fd: -1, client, fabric, subdevice, attachments, attached: 1, more: 0, status: 0 });
        }
    }

    fn uvm_mappings(&mut self) {
        let model = self.model;
        for (&(file, base), ids) in &model.uvm_maps {
            for id in ids {
                let Some(&(client, memory)) = self.made.get(id) else { continue };
                let Some((pid, fd)) = self.someone_with(file) else { continue };
                let event = Event::UvmMap { fd, base, length: 0, offset: 0, client, memory, status: 0 };
                self.push(self.at, pid, event);
            }
        }
    }

    /// Objects exported to files, each under the handle its memory was written with. Those of a
    /// released file whose memory lives on (parked) are exported to it through an fd lent for
    /// it, closed at the time of the file's last close seen: the replay parks them as then.
    fn exports(&mut self) {
        let model = self.model;
        let live = |id: &AllocId| model.allocations[*id].is_live();
        let parked = model.parked_exports.iter().map(|(f, (_, slots))| (f, slots));
        let mut exports: Vec<((FileId, u16), AllocId)> = (model.exports.iter().chain(parked))
            .flat_map(|(f, slots)| slots.iter().map(move |(slot, id)| ((*f, *slot), *id)))
            .filter(|(_, id)| live(id))
            .collect();
        exports.sort_unstable();
        for ((file, index), id) in exports {
            let Some(&(client, object)) = self.made.get(&id) else { continue };
            let Some((pid, to_fd)) = self.someone_with(file) else { continue };
            let objects = vec![object];
            self.push(self.at, pid, Event::ExportObjects { fd: -1, client, objects, index, more: 0, to_fd, status: 0 });
        }
        let mut closes: Vec<(FileId, u64)> = model.parked_exports.iter().map(|(f, (at, _))| (*f, *at)).collect();
        closes.sort_unstable();
        for (file, at) in closes {
            let Some((&(pid, _), &fd)) = self.lent.iter().find(|((_, f), _)| *f == file) else { continue };
            self.lent.remove(&(pid, file));
            self.push(at, pid, Event::Close { fd });
        }
    }

    /// What each client shared beyond its process, once every handle is there (a handle made
    /// anew drops its old shares).
    fn shares(&mut self) {
        let model = self.model;
        let mut clients: Vec<u32> = model.clients.keys().copied().collect();
        clients.sort_unstable();
        for client in clients {
            let c = &model.clients[&client];
            let Some((pid, fd)) = self.writer_of(c) else { continue };
            let mut shared: Vec<(u32, u16)> = c.shared.iter().copied().collect();
            shared.sort_unstable();
            for (object, share_type) in shared {
                self.push(self.at, pid, Event::Share { fd, client, object, share_type, target: 0, action: 0, status: 0 });
            }
        }
    }

    fn registrations(&mut self) {
        let mut pairs: Vec<(FileId, FileId)> = self.model.registered.iter().map(|(d, c)| (*d, *c)).collect();
        pairs.sort_unstable();
        for (device, ctl) in pairs {
            let Some((pid, fd)) = self.someone_with(device) else { continue };
            let ctl_fd = self.fd_for(pid, ctl);
            self.push(self.at, pid, Event::RegisterFd { fd, ctl_fd });
        }
    }

    /// Each process's first answered request (when its server became ready), the ended requests
    /// a live allocation was made during the prefill of (the most recent [`KEPT_PREFILLS`]),
    /// then every request in flight.
    fn requests(&mut self) {
        let model = self.model;
        let mut first_ok: HashMap<u32, &Request> = HashMap::new();
        for r in &model.requests {
            let ok = r.status.is_some_and(|s| (200..300).contains(&s)) && r.ended.is_some();
            if ok && self.written.contains(&r.pid) {
                first_ok
                    .entry(r.pid)
                    .and_modify(|f| {
                        if r.headers_at < f.headers_at {
                            *f = r;
                        }
                    })
                    .or_insert(r);
            }
        }
        let mut live: Vec<u64> = model.live_allocations().filter(|a| a.memory == crate::event::Memory::Video).map(|a| a.ts).collect();
        live.sort_unstable();
        let during_prefill = |r: &&Request| {
            let until = r.first_data_at.or(r.ended).unwrap_or(u64::MAX);
            live.get(live.partition_point(|&t| t < r.arrived)).is_some_and(|&t| t < until)
        };
        let first: HashSet<(u32, u64, u64)> = first_ok.values().map(|r| (r.pid, r.conn, r.arrived)).collect();
        let prefills = model.requests.iter().filter(|r| r.ended.is_some() && self.written.contains(&r.pid)).filter(during_prefill);
        let mut prefills: Vec<&Request> = prefills.filter(|r| !first.contains(&(r.pid, r.conn, r.arrived))).collect();
        prefills.drain(..prefills.len().saturating_sub(KEPT_PREFILLS));
        let mut ended: Vec<&Request> = first_ok.into_values().chain(prefills).collect();
        ended.sort_by_key(|r| r.arrived);
        ended.extend(model.requests.iter().filter(|r| r.ended.is_none() && self.written.contains(&r.pid)));
        for r in ended {
            self.push(r.arrived, r.pid, Event::Accept { fd: -1, conn: r.conn });
            let request = (!r.line.is_empty()).then(|| r.line.clone());
            self.push(r.arrived, r.pid, Event::Received { conn: r.conn, bytes: r.bytes_in, request });
            if let Some(ts) = r.headers_at {
                self.push(ts, r.pid, Event::Sent { conn: r.conn, bytes: r.bytes_out, status: r.status, data: false });
            }
            if let Some(ts) = r.first_data_at {
                self.push(ts, r.pid, Event::Sent { conn: r.conn, bytes: 0, status: None, data: true });
            }
            // Closed at its end even where the connection lives on: a later request on it is
            // written after, with an accept of its own.
            if let Some(ts) = r.ended {
                self.push(ts, r.pid, Event::ConnClose { conn: r.conn });
            }
        }
    }

    fn marks_and_sample(&mut self) {
        let mut latest: BTreeMap<u32, (u64, &str)> = BTreeMap::new();
        for (ts, pid, phase) in &self.model.marks {
            if self.written.contains(pid) {
                latest.insert(*pid, (*ts, phase.as_str()));
            }
        }
        let mut marks: Vec<_> = latest.into_iter().collect();
        marks.sort_by_key(|(_, (ts, _))| *ts);
        for (pid, (ts, phase)) in marks {
            self.push(ts, pid, Event::Mark { phase: phase.into() });
        }
        if let Some((ts, sample)) = self.model.samples.last() {
            self.push(*ts, 0, Event::Sample(sample.clone()));
        }
    }

    fn proxies(&mut self) {
        for (&pid, p) in &self.model.proxies {
            let event = Event::Proxy {
                uid: p.uid,
                command: p.command.clone(),
                config: p.config.clone(),
                deployments: p.deployments.clone(),
                workers: p.workers,
            };
            self.out.push(Record::new(p.ts, pid, 0, event));
        }
    }

    /// What the snapshot lent goes: fds and stand-ins.
    fn finish(&mut self) {
        for ((pid, _), fd) in std::mem::take(&mut self.lent) {
            self.push(self.at, pid, Event::Close { fd });
        }
        // Last made, first gone: a stand-in device (at its memory's release time) before the
        // stand-in client it is under.
        for (client, handle, ts) in std::mem::take(&mut self.stand_ins).into_iter().rev() {
            self.push(ts, 0, Event::Free { fd: -1, via: crate::event::Via::RmFree, client, parent: 0, object: handle, status: 0 });
        }
    }
}

/// A client's handles, parents before children (breadth first from those whose parent is not
/// in the client), without descending below memory handles unless `all`.
fn tree_order(c: &super::handles::Client, all: bool) -> Vec<u32> {
    let mut roots: Vec<u32> =
        c.objects.iter().filter(|(h, o)| o.parent == **h || !c.objects.contains_key(&o.parent)).map(|(h, _)| *h).collect();
    roots.sort_unstable();
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    let mut queue: VecDeque<u32> = roots.into();
    while let Some(h) = queue.pop_front() {
        if !seen.insert(h) {
            continue;
        }
        if c.objects[&h].alloc.is_some() && !all {
            continue;
        }
        order.push(h);
        if let Some(kids) = c.children.get(&h) {
            let mut kids: Vec<u32> = kids.iter().copied().filter(|k| c.objects.contains_key(k)).collect();
            kids.sort_unstable();
            queue.extend(kids);
        }
    }
    order
}

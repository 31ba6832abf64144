//! State built from the event sequence, and nothing else: processes and their fd tables, open
//! NVIDIA files and who holds them, RM clients and their handle trees, UVM ranges, and every
//! allocation with when and how it ended. `Model::apply` is the only way in, so the model is a
//! pure function of the trace.
//!
//! The driver frees memory in more ways than RM_FREE, and each is followed here:
//! - RM_FREE of a handle frees its subtree; of a client handle, the whole client;
//! - RM_DUP_OBJECT adds a handle to the same memory, which lives until its last handle goes;
//! - when the last descriptor of an nvidiactl file is gone (close, dup2 over it, close-on-exec,
//!   exit, in every process that shares it after fork), the driver frees every client created on
//!   it; closing a UVM file destroys its ranges.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Serialize;

use crate::event::{Alloc, Device, Event, Memory, Record, Seen, Via};

pub type FileId = u64;
pub type AllocId = usize;

/// How an allocation's memory went back to the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FreedBy {
    /// RM_FREE, VID_HEAP_CONTROL FREE or UVM_FREE of the object itself.
    Explicit,
    /// RM_FREE of an ancestor: the object's parent, device or client.
    Subtree,
    /// The driver released the file the client or range lived on.
    FileRelease,
    /// Its handle or UVM range was handed out again, which the driver does only after a free:
    /// that free is not in the trace (lost records, a reused pid).
    Unseen,
}

#[derive(Clone, Debug, Serialize)]
pub struct Allocation {
    pub ts: u64,
    pub pid: u32,
    pub tid: u32,
    pub memory: Memory,
    pub bytes: u64,
    pub via: Via,
    pub client: u32,
    pub object: u32,
    pub class: u32,
    /// The open file the memory lives on (the client's nvidiactl file, or the UVM file).
    pub file: Option<FileId>,
    pub freed: Option<(u64, FreedBy)>,
}

#[derive(Clone, Debug, Serialize)]
pub struct FailedAllocation {
    pub ts: u64,
    pub pid: u32,
    pub memory: Memory,
    pub bytes: u64,
    pub via: Via,
    pub status: u32,
    pub errno: Option<i32>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Usage {
    /// Bytes live now, by memory kind.
    pub live: BTreeMap<Memory, u64>,
    pub allocated: BTreeMap<Memory, u64>,
    pub freed: BTreeMap<Memory, u64>,
    /// Highest video + system bytes live at once.
    pub peak_physical: u64,
    pub allocations: u64,
    pub failed: u64,
}

impl Usage {
    pub fn physical_live(&self) -> u64 {
        self.live.get(&Memory::Video).copied().unwrap_or(0).saturating_add(self.live.get(&Memory::System).copied().unwrap_or(0))
    }
    fn add(&mut self, memory: Memory, bytes: u64) {
        // Figures come from a trace file: saturate rather than wrap or panic on absurd ones.
        add(self.live.entry(memory).or_default(), bytes);
        add(self.allocated.entry(memory).or_default(), bytes);
        self.allocations += 1;
        self.peak_physical = self.peak_physical.max(self.physical_live());
    }
    fn remove(&mut self, memory: Memory, bytes: u64) {
        let live = self.live.entry(memory).or_default();
        *live = live.saturating_sub(bytes);
        add(self.freed.entry(memory).or_default(), bytes);
    }
}

/// `total += n`, saturating: a trace may hold any number.
pub fn add(total: &mut u64, n: u64) {
    *total = total.saturating_add(n);
}

/// One HTTP request as the kernel saw it on a server's connection: from the read that brought
/// its request line to the connection's close or the next request on it (keep-alive).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Request {
    pub pid: u32,
    pub conn: u64,
    /// "POST /v1/completions", or "" when the bytes did not start with a request line.
    pub line: String,
    pub arrived: u64,
    pub bytes_in: u64,
    pub headers_at: Option<u64>,
    pub status: Option<u16>,
    /// The first body data sent: the end of prefill as the client sees it.
    pub first_data_at: Option<u64>,
    pub bytes_out: u64,
    pub ended: Option<u64>,
}

impl Request {
    /// In flight at `ts`: arrived, not yet ended.
    pub fn in_flight_at(&self, ts: u64) -> bool {
        self.arrived <= ts && self.ended.is_none_or(|end| end > ts)
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Process {
    pub pid: u32,
    pub ppid: u32,
    pub seen: Seen,
    pub command: Vec<String>,
    pub first_ts: u64,
    pub exited: Option<u64>,
    pub exit_code: Option<i32>,
    /// TCP ports it bound, and when it first listened.
    pub bound: Vec<(u64, u16)>,
    pub listened: Option<u64>,
    /// When the kernel's OOM killer chose it.
    pub oom_killed: Option<u64>,
    pub usage: Usage,
    #[serde(skip)]
    fds: HashMap<i32, FdRef>,
}

impl Process {
    pub fn command_line(&self) -> String {
        display_command(&self.command)
    }
    /// NVIDIA files this process holds open now.
    pub fn held_files(&self) -> impl Iterator<Item = FileId> + '_ {
        self.fds.values().map(|f| f.file)
    }
}

/// A command as ps shows it: the program's name, then its arguments.
pub fn display_command(argv: &[String]) -> String {
    match argv.split_first() {
        None => "?".into(),
        Some((program, args)) => {
            let name = program.rsplit('/').next().unwrap_or(program);
            std::iter::once(name).chain(args.iter().map(String::as_str)).collect::<Vec<_>>().join(" ")
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct FdRef {
    file: FileId,
    cloexec: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct File {
    pub id: FileId,
    pub device: Device,
    pub opened_by: u32,
    /// Descriptors referring to it, across every process.
    pub refs: u32,
    pub released: Option<u64>,
}

#[derive(Clone, Debug)]
struct Object {
    parent: u32,
    /// The allocation whose memory this handle refers to (several handles after a dup).
    alloc: Option<AllocId>,
}

#[derive(Clone, Debug, Default)]
struct Client {
    file: Option<FileId>,
    objects: HashMap<u32, Object>,
    /// Parent handle to child handles, so freeing a subtree never scans the whole client.
    children: HashMap<u32, HashSet<u32>>,
}

impl Client {
    fn new(file: Option<FileId>) -> Self {
        Client { file, ..Default::default() }
    }

    fn insert(&mut self, handle: u32, object: Object) {
        let parent = object.parent;
        if let Some(old) = self.objects.insert(handle, object) {
            if let Some(siblings) = self.children.get_mut(&old.parent) {
                siblings.remove(&handle);
            }
        }
        self.children.entry(parent).or_default().insert(handle);
    }

    /// Removes `handle` and everything below it; returns them with the handle itself first.
    fn remove_subtree(&mut self, handle: u32) -> Vec<(u32, Object)> {
        let mut removed = Vec::new();
        let mut stack = vec![handle];
        while let Some(h) = stack.pop() {
            if let Some(kids) = self.children.remove(&h) {
                stack.extend(kids);
            }
            if let Some(o) = self.objects.remove(&h) {
                if let Some(siblings) = self.children.get_mut(&o.parent) {
                    siblings.remove(&h);
                }
                removed.push((h, o));
            }
        }
        removed
    }
}

#[derive(Default, Debug)]
pub struct Model {
    pub processes: BTreeMap<u32, Process>,
    pub files: BTreeMap<FileId, File>,
    pub allocations: Vec<Allocation>,
    pub failures: Vec<FailedAllocation>,
    pub requests: Vec<Request>,
    /// Explicit phase marks: (ts, pid, phase).
    pub marks: Vec<(u64, u32, String)>,
    pub undecodable: u64,
    pub lost_records: u64,
    pub first_ts: Option<u64>,
    pub last_ts: u64,
    clients: HashMap<u32, Client>,
    /// Handles referring to each allocation; the memory is freed when it reaches zero.
    handle_refs: HashMap<AllocId, u32>,
    /// UVM ranges by (file, base).
    uvm_ranges: HashMap<(FileId, u64), AllocId>,
    /// Synthesised file ids for fds first seen by an ioctl with no Open/FdFound before it.
    next_orphan_file: FileId,
    /// Followed connections (by name) and the request open on each.
    connections: HashMap<u64, (u32, Option<usize>)>,
}

const ORPHAN_FILE_BASE: FileId = 1 << 62;

impl Model {
    pub fn new() -> Self {
        Model { next_orphan_file: ORPHAN_FILE_BASE, ..Default::default() }
    }

    pub fn from_records<'a>(records: impl IntoIterator<Item = &'a Record>) -> Self {
        let mut model = Model::new();
        for r in records {
            model.apply(r);
        }
        model
    }

    /// The books balance, as the driver's would: an allocation is live exactly while a handle
    /// (or a UVM range) still refers to it; for every process and kind, what was allocated equals
    /// what was freed plus what is live (exactly, wherever the sums fit in 64 bits). The fuzzer and
    /// the property tests hold the model to this after any sequence of events.
    pub fn check_books(&self) -> Result<(), String> {
        let mut referenced: HashSet<AllocId> = self.clients.values().flat_map(|c| c.objects.values().filter_map(|o| o.alloc)).collect();
        referenced.extend(self.uvm_ranges.values().copied());
        for (id, a) in self.allocations.iter().enumerate() {
            match (a.freed.is_none(), referenced.contains(&id)) {
                (true, false) => return Err(format!("allocation {id} ({} B, pid {}) is live with no handle left", a.bytes, a.pid)),
                (false, true) => {
                    return Err(format!("allocation {id} ({} B, pid {}) is freed while a handle still refers to it", a.bytes, a.pid))
                }
                _ => {}
            }
        }
        let mut sums: BTreeMap<(u32, Memory), (u128, u128)> = BTreeMap::new();
        for a in &self.allocations {
            let (allocated, freed) = sums.entry((a.pid, a.memory)).or_default();
            *allocated += u128::from(a.bytes);
            if a.freed.is_some() {
                *freed += u128::from(a.bytes);
            }
        }
        for ((pid, memory), (allocated, freed)) in sums {
            if allocated > u128::from(u64::MAX) {
                continue;
            }
            let usage = &self.processes[&pid].usage;
            let get = |m: &BTreeMap<Memory, u64>| u128::from(m.get(&memory).copied().unwrap_or(0));
            let books = (get(&usage.allocated), get(&usage.freed), get(&usage.live));
            if books != (allocated, freed, allocated - freed) {
                return Err(format!(
                    "pid {pid} {}: allocated/freed/live {books:?}, its allocations say {:?}",
                    memory.name(),
                    (allocated, freed, allocated - freed)
                ));
            }
        }
        for p in self.processes.values() {
            let failed = self.failures.iter().filter(|f| f.pid == p.pid).count() as u64;
            if p.usage.failed != failed {
                return Err(format!("pid {} counts {} failures, {failed} were recorded", p.pid, p.usage.failed));
            }
        }
        Ok(())
    }

    /// Live bytes of one kind across every process.
    pub fn live(&self, memory: Memory) -> u64 {
        self.processes.values().map(|p| p.usage.live.get(&memory).copied().unwrap_or(0)).fold(0, u64::saturating_add)
    }

    pub fn live_allocations(&self) -> impl Iterator<Item = &Allocation> {
        self.allocations.iter().filter(|a| a.freed.is_none())
    }

    /// Processes holding `file` open now.
    pub fn holders(&self, file: FileId) -> Vec<u32> {
        self.processes.values().filter(|p| p.exited.is_none() && p.fds.values().any(|f| f.file == file)).map(|p| p.pid).collect()
    }

    fn process(&mut self, pid: u32, ts: u64) -> &mut Process {
        self.processes.entry(pid).or_insert_with(|| Process {
            pid,
            ppid: 0,
            seen: Seen::Running,
            command: Vec::new(),
            first_ts: ts,
            exited: None,
            exit_code: None,
            bound: Vec::new(),
            listened: None,
            oom_killed: None,
            usage: Usage::default(),
            fds: HashMap::new(),
        })
    }

    pub fn apply(&mut self, r: &Record) {
        self.first_ts.get_or_insert(r.ts);
        self.last_ts = self.last_ts.max(r.ts);
        let (ts, pid) = (r.ts, r.pid);
        match &r.event {
            Event::Process { ppid, seen, command } => {
                let inherited = self.processes.get(ppid).map(|p| p.fds.clone());
                let p = self.process(pid, ts);
                p.ppid = *ppid;
                p.seen = *seen;
                p.command = command.clone();
                if *seen == Seen::Forked {
                    // fork copies the fd table: every NVIDIA file gains a reference.
                    if let Some(fds) = inherited {
                        for f in fds.values() {
                            if let Some(file) = self.files.get_mut(&f.file) {
                                file.refs += 1;
                            }
                        }
                        self.process(pid, ts).fds = fds;
                    }
                }
            }
            Event::Exec { command } => {
                let p = self.process(pid, ts);
                p.command = command.clone();
                let closed: Vec<i32> = p.fds.iter().filter(|(_, f)| f.cloexec).map(|(fd, _)| *fd).collect();
                for fd in closed {
                    self.close_fd(pid, fd, ts);
                }
            }
            Event::Exit { code } => {
                let conns: Vec<u64> = self.connections.iter().filter(|(_, (p, _))| *p == pid).map(|(c, _)| *c).collect();
                for conn in conns {
                    self.end_request(conn, ts);
                    self.connections.remove(&conn);
                }
                let fds: Vec<i32> = self.process(pid, ts).fds.keys().copied().collect();
                for fd in fds {
                    self.close_fd(pid, fd, ts);
                }
                let p = self.process(pid, ts);
                p.exited = Some(ts);
                if code.is_some() {
                    p.exit_code = *code;
                }
            }
            Event::Open { fd, file, device, cloexec } => {
                self.files.insert(*file, File { id: *file, device: *device, opened_by: pid, refs: 0, released: None });
                self.set_fd(pid, *fd, *file, *cloexec, ts);
            }
            Event::FdFound { fd, file, device } => {
                self.files.entry(*file).or_insert(File { id: *file, device: *device, opened_by: pid, refs: 0, released: None });
                let already = self.processes.get(&pid).and_then(|p| p.fds.get(fd)).map(|f| f.file);
                if already != Some(*file) {
                    self.set_fd(pid, *fd, *file, false, ts);
                }
            }
            Event::Dup { old_fd, new_fd, cloexec } => {
                if let Some(old) = self.processes.get(&pid).and_then(|p| p.fds.get(old_fd)).copied() {
                    self.set_fd(pid, *new_fd, old.file, *cloexec, ts);
                }
            }
            Event::Close { fd } => self.close_fd(pid, *fd, ts),
            Event::CloseRange { first, last, cloexec_only } => {
                let fds: Vec<i32> =
                    self.process(pid, ts).fds.keys().copied().filter(|&fd| fd >= 0 && (*first..=*last).contains(&(fd as u32))).collect();
                for fd in fds {
                    if *cloexec_only {
                        if let Some(f) = self.process(pid, ts).fds.get_mut(&fd) {
                            f.cloexec = true;
                        }
                    } else {
                        self.close_fd(pid, fd, ts);
                    }
                }
            }
            Event::SetCloexec { fd, cloexec } => {
                if let Some(f) = self.process(pid, ts).fds.get_mut(fd) {
                    f.cloexec = *cloexec;
                }
            }
            Event::Object { fd, client, parent, object, class, status } => {
                if *status != 0 {
                    return;
                }
                if crate::abi::class::is_client(*class) {
                    let file = self.file_of(pid, *fd, ts);
                    // RM never hands out a live handle twice: an old client by that handle was
                    // freed in a way the trace missed (lost records, a reused pid).
                    self.free_client(*client, ts, FreedBy::Unseen);
                    self.clients.insert(*client, Client::new(file));
                } else {
                    self.insert_object(*client, pid, *fd, ts, *object, Object { parent: *parent, alloc: None });
                }
            }
            Event::Alloc(a) => self.alloc(r, a),
            Event::Free { client, object, status, .. } => {
                if *status == 0 {
                    self.free_handle(*client, *object, ts);
                }
            }
            Event::DupObject { fd, client, parent, object, src_client, src_object, status } => {
                if *status != 0 {
                    return;
                }
                let alloc = self.clients.get(src_client).and_then(|c| c.objects.get(src_object)).and_then(|o| o.alloc);
                if let Some(id) = alloc {
                    *self.handle_refs.entry(id).or_default() += 1;
                }
                self.insert_object(*client, pid, *fd, ts, *object, Object { parent: *parent, alloc });
            }
            Event::RegisterFd { .. } | Event::UvmMap { .. } => {}
            Event::UvmFree { fd, base, status } => {
                if *status != 0 {
                    return;
                }
                let file = self.file_of(pid, *fd, ts);
                if let Some(id) = file.and_then(|f| self.uvm_ranges.remove(&(f, *base))) {
                    self.release(id, ts, FreedBy::Explicit);
                }
            }
            Event::Undecodable { .. } => self.undecodable += 1,
            Event::Lost { records } => add(&mut self.lost_records, *records),
            Event::Bind { port, .. } => self.process(pid, ts).bound.push((ts, *port)),
            Event::Listen { .. } => {
                let p = self.process(pid, ts);
                p.listened.get_or_insert(ts);
            }
            Event::Accept { conn, .. } => {
                self.connections.insert(*conn, (pid, None));
            }
            Event::Received { conn, bytes, request } => {
                let current = self.connections.get(conn).and_then(|(_, r)| *r);
                match (request, current) {
                    (None, Some(id)) => add(&mut self.requests[id].bytes_in, *bytes),
                    _ => {
                        self.end_request(*conn, ts);
                        let line = request.clone().unwrap_or_default();
                        let request = Request {
                            pid,
                            conn: *conn,
                            line,
                            arrived: ts,
                            bytes_in: *bytes,
                            headers_at: None,
                            status: None,
                            first_data_at: None,
                            bytes_out: 0,
                            ended: None,
                        };
                        self.requests.push(request);
                        self.connections.insert(*conn, (pid, Some(self.requests.len() - 1)));
                    }
                }
            }
            Event::Sent { conn, bytes, status, data } => {
                if let Some(id) = self.connections.get(conn).and_then(|(_, r)| *r) {
                    let r = &mut self.requests[id];
                    add(&mut r.bytes_out, *bytes);
                    if status.is_some() && r.headers_at.is_none() {
                        r.headers_at = Some(ts);
                        r.status = *status;
                    }
                    if *data && r.first_data_at.is_none() {
                        r.first_data_at = Some(ts);
                    }
                }
            }
            Event::ConnClose { conn } => {
                self.end_request(*conn, ts);
                self.connections.remove(conn);
            }
            Event::OomKill => {
                self.process(pid, ts).oom_killed.get_or_insert(ts);
            }
            Event::Mark { phase } => self.marks.push((ts, pid, phase.clone())),
        }
    }

    fn end_request(&mut self, conn: u64, ts: u64) {
        if let Some((_, current)) = self.connections.get_mut(&conn) {
            if let Some(id) = current.take() {
                self.requests[id].ended.get_or_insert(ts);
            }
        }
    }

    /// Requests in flight at `ts`, in the processes given (a service's), or everywhere.
    pub fn in_flight(&self, ts: u64, pids: Option<&[u32]>) -> usize {
        self.requests.iter().filter(|r| r.in_flight_at(ts) && pids.is_none_or(|p| p.contains(&r.pid))).count()
    }

    fn set_fd(&mut self, pid: u32, fd: i32, file: FileId, cloexec: bool, ts: u64) {
        // Reusing a number means the old file lost that reference (dup2 onto an open fd).
        if self.processes.get(&pid).is_some_and(|p| p.fds.contains_key(&fd)) {
            self.close_fd(pid, fd, ts);
        }
        self.process(pid, ts).fds.insert(fd, FdRef { file, cloexec });
        if let Some(f) = self.files.get_mut(&file) {
            f.refs += 1;
        }
    }

    fn close_fd(&mut self, pid: u32, fd: i32, ts: u64) {
        let Some(fd_ref) = self.processes.get_mut(&pid).and_then(|p| p.fds.remove(&fd)) else {
            return;
        };
        let Some(file) = self.files.get_mut(&fd_ref.file) else { return };
        file.refs = file.refs.saturating_sub(1);
        if file.refs == 0 && file.released.is_none() {
            file.released = Some(ts);
            self.release_file(fd_ref.file, ts);
        }
    }

    /// The driver's release of an open file: every client created on it, every UVM range in it.
    fn release_file(&mut self, file: FileId, ts: u64) {
        let clients: Vec<u32> = self.clients.iter().filter(|(_, c)| c.file == Some(file)).map(|(h, _)| *h).collect();
        for client in clients {
            self.free_client(client, ts, FreedBy::FileRelease);
        }
        let ranges: Vec<(FileId, u64)> = self.uvm_ranges.keys().filter(|(f, _)| *f == file).copied().collect();
        for key in ranges {
            if let Some(id) = self.uvm_ranges.remove(&key) {
                self.release(id, ts, FreedBy::FileRelease);
            }
        }
    }

    /// The file an fd of `pid` refers to; an NVIDIA fd never seen opened gets a file of its own.
    fn file_of(&mut self, pid: u32, fd: i32, ts: u64) -> Option<FileId> {
        if let Some(f) = self.processes.get(&pid).and_then(|p| p.fds.get(&fd)) {
            return Some(f.file);
        }
        if fd < 0 {
            return None;
        }
        let id = self.next_orphan_file;
        self.next_orphan_file += 1;
        self.files.insert(id, File { id, device: Device::Ctl, opened_by: pid, refs: 0, released: None });
        self.set_fd(pid, fd, id, false, ts);
        Some(id)
    }

    /// A client created before tracing began is met first through one of its objects.
    fn client_mut(&mut self, client: u32, pid: u32, fd: i32, ts: u64) -> &mut Client {
        if !self.clients.contains_key(&client) {
            let file = self.file_of(pid, fd, ts);
            self.clients.insert(client, Client::new(file));
        }
        self.clients.get_mut(&client).expect("inserted above")
    }

    fn alloc(&mut self, r: &Record, a: &Alloc) {
        let (ts, pid) = (r.ts, r.pid);
        if !a.succeeded() {
            self.process(pid, ts).usage.failed += 1;
            self.failures.push(FailedAllocation {
                ts,
                pid,
                memory: a.memory,
                bytes: a.bytes,
                via: a.via,
                status: a.status,
                errno: a.errno,
            });
            return;
        }
        let file = match a.base {
            Some(_) => self.file_of(pid, a.fd, ts),
            None => self.client_mut(a.client, pid, a.fd, ts).file,
        };
        let id = self.allocations.len();
        self.allocations.push(Allocation {
            ts,
            pid,
            tid: r.tid,
            memory: a.memory,
            bytes: a.bytes,
            via: a.via,
            client: a.client,
            object: a.object,
            class: a.class,
            file,
            freed: None,
        });
        self.process(pid, ts).usage.add(a.memory, a.bytes);
        self.handle_refs.insert(id, 1);
        match (a.base, file) {
            (Some(base), Some(file)) => {
                if let Some(old) = self.uvm_ranges.insert((file, base), id) {
                    self.release(old, ts, FreedBy::Unseen);
                }
            }
            _ => {
                let object = Object { parent: a.parent, alloc: Some(id) };
                self.insert_object(a.client, pid, a.fd, ts, a.object, object);
            }
        }
    }

    /// A new handle in a client. Like a client handle, a live one is never handed out twice: what
    /// was there before (and below it) was freed unseen, and is released now.
    fn insert_object(&mut self, client: u32, pid: u32, fd: i32, ts: u64, handle: u32, object: Object) {
        if let Some(c) = self.clients.get_mut(&client) {
            for (_, o) in c.remove_subtree(handle) {
                if let Some(id) = o.alloc {
                    self.drop_handle(id, ts, FreedBy::Unseen);
                }
            }
        }
        self.client_mut(client, pid, fd, ts).insert(handle, object);
    }

    fn free_handle(&mut self, client: u32, object: u32, ts: u64) {
        if client == object {
            self.free_client(client, ts, FreedBy::Explicit);
            return;
        }
        let Some(c) = self.clients.get_mut(&client) else { return };
        for (h, o) in c.remove_subtree(object) {
            if let Some(id) = o.alloc {
                self.drop_handle(id, ts, if h == object { FreedBy::Explicit } else { FreedBy::Subtree });
            }
        }
    }

    fn free_client(&mut self, client: u32, ts: u64, how: FreedBy) {
        let Some(c) = self.clients.remove(&client) else { return };
        let how = if how == FreedBy::Explicit { FreedBy::Subtree } else { how };
        for o in c.objects.into_values() {
            if let Some(id) = o.alloc {
                self.drop_handle(id, ts, how);
            }
        }
    }

    fn drop_handle(&mut self, id: AllocId, ts: u64, how: FreedBy) {
        let refs = self.handle_refs.entry(id).or_insert(1);
        *refs = refs.saturating_sub(1);
        if *refs == 0 {
            self.handle_refs.remove(&id);
            self.release(id, ts, how);
        }
    }

    fn release(&mut self, id: AllocId, ts: u64, how: FreedBy) {
        let a = &mut self.allocations[id];
        if a.freed.is_some() {
            return;
        }
        a.freed = Some((ts, how));
        let (pid, memory, bytes) = (a.pid, a.memory, a.bytes);
        if let Some(p) = self.processes.get_mut(&pid) {
            p.usage.remove(memory, bytes);
        }
    }
}

pub mod generate;

#[cfg(test)]
mod tests;

//! State built from the event sequence, and nothing else: processes and their fd tables, open
//! NVIDIA files and who holds them, RM clients and their handle trees, UVM ranges, and every
//! allocation with when and how it ended. `Model::apply` is the only way in, so the model is a
//! pure function of the trace.
//!
//! The driver frees memory in more ways than RM_FREE, and each is followed here:
//! - RM_FREE of a handle frees its subtree; of a client handle, the whole client;
//! - RM_DUP_OBJECT adds a handle to the same memory, which lives until its last handle goes;
//! - when the last descriptor of an nvidiactl file is gone (close, dup2 over it, close-on-exec,
//!   exit, in every process that shares it after fork), and every /dev/nvidiaN file registered
//!   with it (REGISTER_FD) is released too, the driver frees every client created on it; closing a
//!   UVM file destroys its ranges and the mappings in them.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Serialize;

use crate::event::{Device, Event, Memory, Place, Record, Seen, Via};
use crate::procfs::command::MAX_COMMAND;
use fds::FdRef;
use handles::Client;

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
    /// Its handles were freed while a UVM mapping still held it (cuMemRelease while mapped, as
    /// VMM allocators do): the driver freed it with the mapping, at UVM_FREE of its range (at the
    /// release of the UVM file it is `FileRelease`).
    Unmapped,
    /// Its handles were freed while it was attached to a fabric object (drivers before 570,
    /// where RM dups attached memory): freed at DETACH_MEM.
    Detached,
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
    /// The GPU (RM device instance) it was allocated under; None when its device was created
    /// before tracing began, or for UVM ranges.
    pub gpu: Option<u32>,
    pub freed: Option<(u64, FreedBy)>,
    /// When its last RM handle was freed while the driver still held the memory (mapped into a
    /// UVM range, exported to a file, attached to a fabric object): "released, still mapped
    /// until `freed`".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub released: Option<u64>,
}

impl Allocation {
    /// Not freed yet.
    pub fn is_live(&self) -> bool {
        self.freed.is_none()
    }
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
    /// The GPU it was asked of, as for [`Allocation::gpu`].
    pub gpu: Option<u32>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Usage {
    /// Bytes live now, by memory kind.
    pub live: BTreeMap<Memory, u64>,
    pub allocated: BTreeMap<Memory, u64>,
    pub freed: BTreeMap<Memory, u64>,
    /// Highest video + system bytes live at once.
    pub peak_physical: u64,
    /// Highest bytes of each kind live at once.
    pub peak: BTreeMap<Memory, u64>,
    pub allocations: u64,
    pub failed: u64,
}

impl Usage {
    pub fn physical_live(&self) -> u64 {
        self.live.get(&Memory::Video).copied().unwrap_or(0).saturating_add(self.live.get(&Memory::System).copied().unwrap_or(0))
    }
    fn add(&mut self, memory: Memory, bytes: u64) {
        // Figures come from a trace file: saturate rather than wrap or panic on absurd ones.
        add_saturating(self.live.entry(memory).or_default(), bytes);
        add_saturating(self.allocated.entry(memory).or_default(), bytes);
        self.allocations += 1;
        self.peak_physical = self.peak_physical.max(self.physical_live());
        let live = self.live[&memory];
        let peak = self.peak.entry(memory).or_default();
        *peak = (*peak).max(live);
    }
    fn remove(&mut self, memory: Memory, bytes: u64) {
        let live = self.live.entry(memory).or_default();
        *live = live.saturating_sub(bytes);
        add_saturating(self.freed.entry(memory).or_default(), bytes);
    }
}

/// `total += n`, saturating: a trace may hold any number.
pub fn add_saturating(total: &mut u64, n: u64) {
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
    /// Met running when tracing began: what it had then (see [`Event::Attached`]).
    pub attached: Option<Attached>,
    /// When the kernel's OOM killer chose it.
    pub oom_killed: Option<u64>,
    /// Its cgroup, container, pod and namespaced pid, where the recorder could read them.
    pub place: Option<crate::event::Place>,
    pub usage: Usage,
    #[serde(skip)]
    fds: HashMap<i32, FdRef>,
}

/// A LiteLLM proxy: its command line, config, and the deployments it names (see
/// [`Event::Proxy`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Proxy {
    /// When its config was last read as this.
    pub ts: u64,
    pub uid: u32,
    pub command: Vec<String>,
    pub config: String,
    pub deployments: Vec<crate::event::Deployment>,
    pub workers: Option<u64>,
}

/// Proxies kept: a trace naming more (a crafted one) keeps the first.
const MAX_PROXIES: usize = 256;

/// A process met running: what it had when tracing began.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Attached {
    pub ts: u64,
    /// TCP ports it listened on: a server already serving.
    pub listening: Vec<u16>,
    /// GPUs whose device files it held.
    pub gpus: Vec<u32>,
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

/// A command as ps shows it: the program's name, then its arguments, on one line whatever they
/// hold (see [`crate::units::one_line`]).
pub fn display_command(argv: &[String]) -> String {
    match argv.split_first() {
        None => "?".into(),
        Some((program, args)) => {
            let name = program.rsplit('/').next().unwrap_or(program);
            crate::units::one_line(&std::iter::once(name).chain(args.iter().map(String::as_str)).collect::<Vec<_>>().join(" "))
        }
    }
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

#[derive(Default, Debug)]
pub struct Model {
    pub processes: BTreeMap<u32, Process>,
    pub files: BTreeMap<FileId, File>,
    pub allocations: Vec<Allocation>,
    pub failures: Vec<FailedAllocation>,
    pub requests: Vec<Request>,
    /// Explicit phase marks: (ts, pid, phase).
    pub marks: Vec<(u64, u32, String)>,
    /// What NVML and the host said while recording, in time order.
    pub samples: Vec<(u64, crate::event::Sample)>,
    /// LiteLLM proxies met, by pid: what their configs said last.
    pub proxies: BTreeMap<u32, Proxy>,
    pub undecodable: u64,
    pub lost_records: u64,
    /// NVIDIA fds held in all processes now, and those not followed for being past the bound.
    fd_refs: usize,
    pub fd_refs_dropped: u64,
    /// Handles of batched exports and imports past the first 16 of each, which the kernel side
    /// does not copy: what they carry is not followed.
    pub handles_not_followed: u64,
    /// Calls the trace says succeeded on an RM client of another file, or taking a reference on
    /// another process's memory not shared with it: RM refuses them, so they are ignored (params
    /// or a fd changed by another thread while the call ran, lost records, a crafted trace).
    pub foreign_client_calls: u64,
    pub first_ts: Option<u64>,
    pub last_ts: u64,
    /// Exited processes forgotten to keep at most [`MAX_PROCESSES`] (see [`Model::room_for`]),
    /// and the records of processes not kept for want of room.
    pub processes_forgotten: u64,
    pub records_not_kept: u64,
    process_limit: usize,
    /// Processes that exited 0 since spent ones were last forgotten, and how many must have
    /// before the next pass: 1, doubled after each pass that freed little (a crafted trace whose
    /// passes free one process each would otherwise make every new pid cost a pass).
    exits_since_forgetting: usize,
    forget_after: usize,
    clients: HashMap<u32, Client>,
    /// Handles referring to each allocation; the memory is freed when it reaches zero.
    handle_refs: HashMap<AllocId, u32>,
    /// Of those, the RM handles in clients (not mappings, exports or fabric objects): when they
    /// reach zero first, the allocation is `released`.
    object_refs: HashMap<AllocId, u32>,
    /// UVM ranges by (file, base).
    uvm_ranges: HashMap<(FileId, u64), AllocId>,
    /// RM memory mapped into UVM (UVM_MAP_EXTERNAL_ALLOCATION): the mapping holds a reference
    /// on it until its range goes. By (file, base of the mapping), ordered: an unmap or a range's
    /// end finds its mappings by a range search, not a scan of all of them.
    uvm_maps: BTreeMap<(FileId, u64), Vec<AllocId>>,
    /// /dev/nvidiaN files registered with an nvidiactl file (REGISTER_FD): each holds that file
    /// open until it is released itself.
    registered: HashMap<FileId, FileId>,
    /// Objects exported to a file (RM_CONTROL EXPORT_OBJECT(S)_TO_FD), by the file and its slot: a
    /// reference on the memory held by the kernel's client of that nvidiactl file until its last
    /// close.
    exports: HashMap<FileId, BTreeMap<u16, AllocId>>,
    /// The exports of nvidiactl files released at their last close seen, while their memory
    /// lives on (other handles hold it), with that close's time: a file passed over a socket is
    /// in flight there, held by no fd, when its sender closes it before the receiver's first use
    /// (NCCL's proxy sends and closes at once), and is met again in the receiver within
    /// [`IN_FLIGHT_NS`], exports and all ([`Model::take_fd`]).
    parked_exports: HashMap<FileId, (u64, BTreeMap<u16, AllocId>)>,
    /// How many parked files there may be before those past their time or whose memory is gone
    /// are dropped.
    parked_limit: usize,
    /// Sticky fabric objects (by their allocation) and the memory each keeps alive until it goes.
    holds: HashMap<AllocId, AllocId>,
    /// Memory attached to fabric objects (ATTACH_MEM, drivers before 570): by the fabric
    /// object's allocation, then (where, offset), RM's dup of the memory attached there; where:
    /// the GPU of a multicast attachment's subdevice (RM keeps one per GPU), or the handle when
    /// its GPU is not known ([`handles::attach_point`]).
    attachments: HashMap<AllocId, BTreeMap<(u64, u64), AllocId>>,
    /// Synthesised file ids for fds first seen by an ioctl with no Open/FdFound before it.
    next_orphan_file: FileId,
    /// Followed connections (by name) and the request open on each.
    connections: HashMap<u64, (u32, Option<usize>)>,
}

const ORPHAN_FILE_BASE: FileId = 1 << 62;

/// Processes kept at once (about 2 KB each): past it, spent ones are forgotten, and where none
/// is, the records of new ones are counted, not followed. A crafted trace of a million
/// processes is read in bounded memory (SECURITY.md).
pub const MAX_PROCESSES: usize = 1 << 16;

/// Bytes of each field of a place kept (PATH_MAX): a crafted trace's longer ones are cut, as
/// command lines are at what the recorder reads of one.
const MAX_PLACE_FIELD: usize = 4096;

/// `text` cut to at most `max` bytes, at a character's boundary.
fn cut(text: &str, max: usize) -> String {
    let end = (0..=max.min(text.len())).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
    text[..end].to_string()
}

/// A command line of at most what the recorder reads of one ([`MAX_COMMAND`] bytes).
pub(crate) fn bounded_command(command: &[String]) -> Vec<String> {
    let mut left = MAX_COMMAND as usize;
    let mut out = Vec::new();
    for arg in command {
        if left == 0 {
            break;
        }
        let kept = cut(arg, left);
        left = left.saturating_sub(kept.len().max(1));
        out.push(kept);
    }
    out
}

/// A place with each field at most [`MAX_PLACE_FIELD`] bytes.
fn bounded_place(place: &Place) -> Place {
    let field = |f: &Option<String>| f.as_deref().map(|f| cut(f, MAX_PLACE_FIELD));
    Place {
        cgroup: cut(&place.cgroup, MAX_PLACE_FIELD),
        container: field(&place.container),
        pod: field(&place.pod),
        namespace: field(&place.namespace),
        pod_name: field(&place.pod_name),
        ns_pid: place.ns_pid,
        uid: place.uid,
    }
}

/// How long after its last close seen a file met again is taken to have been in flight over a
/// socket (a receiver takes it within milliseconds), not a new file at a released one's
/// kernel address (an open unseen: io_uring's, or a record lost).
const IN_FLIGHT_NS: u64 = 10_000_000_000;

impl Model {
    pub fn new() -> Self {
        Model { next_orphan_file: ORPHAN_FILE_BASE, process_limit: MAX_PROCESSES, forget_after: 1, ..Default::default() }
    }

    /// The same, keeping at most `limit` processes (tests).
    #[cfg(test)]
    pub(crate) fn with_process_limit(limit: usize) -> Self {
        Model { process_limit: limit, ..Model::new() }
    }

    /// Whether a record of `pid`, a process not kept yet, can be: under [`MAX_PROCESSES`], or once
    /// spent processes are forgotten. A pass over them is made once enough exited since the last
    /// (see `forget_after`): each costs what is kept, a pass that frees a sixteenth of the limit
    /// pays for itself, and one that frees less doubles the wait for the next.
    fn room_for(&mut self, pid: u32) -> bool {
        if self.processes.len() < self.process_limit || self.processes.contains_key(&pid) {
            return true;
        }
        if self.exits_since_forgetting >= self.forget_after {
            self.exits_since_forgetting = 0;
            let before = self.processes.len();
            self.forget_spent();
            let freed = before - self.processes.len();
            self.forget_after = if freed >= self.process_limit / 16 { 1 } else { self.forget_after.saturating_mul(2) };
        }
        self.processes.len() < self.process_limit
    }

    /// Forgets processes nothing the analyses read is theirs: exited 0, never allocated nor
    /// failed to, never bound a port, not killed by the OOM killer, and no kept process's parent
    /// (a service's tree runs through its parents); with the files they opened that are released,
    /// held by no descriptor and referred to by nothing.
    fn forget_spent(&mut self) {
        let mut parents: HashSet<u32> = self.processes.values().map(|p| p.ppid).collect();
        // Requests and marks name their process: its service reads them. A pass costs the
        // processes, requests and marks kept, once per sixteenth of the limit's exits.
        parents.extend(self.requests.iter().map(|r| r.pid).chain(self.marks.iter().map(|m| m.1)));
        let spent = |p: &Process| {
            p.exit_code == Some(0)
                && p.usage.allocations == 0
                && p.usage.failed == 0
                && p.bound.is_empty()
                && p.oom_killed.is_none()
                && !parents.contains(&p.pid)
        };
        let forgotten: HashSet<u32> = self.processes.values().filter(|p| spent(p)).map(|p| p.pid).collect();
        self.processes.retain(|pid, _| !forgotten.contains(pid));
        add_saturating(&mut self.processes_forgotten, forgotten.len() as u64);
        let mut in_use: HashSet<FileId> = self.allocations.iter().filter_map(|a| a.file).collect();
        in_use.extend(self.clients.values().filter_map(|c| c.file));
        in_use.extend(self.registered.iter().flat_map(|(a, b)| [*a, *b]));
        in_use.extend(self.exports.keys().chain(self.parked_exports.keys()).copied());
        self.files.retain(|id, f| !(forgotten.contains(&f.opened_by) && f.released.is_some() && f.refs == 0 && !in_use.contains(id)));
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
        let mut handles: HashMap<AllocId, u32> = HashMap::new();
        for id in self.clients.values().flat_map(|c| c.objects.values().filter_map(|o| o.alloc)) {
            *handles.entry(id).or_default() += 1;
        }
        if handles != self.object_refs {
            return Err("the RM handles counted for some allocation are not those in the clients".into());
        }
        for (id, a) in self.allocations.iter().enumerate() {
            if a.released.is_some() && handles.contains_key(&id) {
                return Err(format!("allocation {id} ({} B, pid {}) is released while an RM handle still refers to it", a.bytes, a.pid));
            }
        }
        let mut referenced: HashSet<AllocId> = handles.keys().copied().collect();
        referenced.extend(self.uvm_ranges.values().copied());
        referenced.extend(self.uvm_maps.values().flatten().copied());
        referenced.extend(self.exports.values().flat_map(|slots| slots.values().copied()));
        let holders_live = self.holds.iter().filter(|(fabric, _)| self.allocations[**fabric].is_live());
        referenced.extend(holders_live.map(|(_, held)| *held));
        let attached_live = self.attachments.iter().filter(|(fabric, _)| self.allocations[**fabric].is_live());
        referenced.extend(attached_live.flat_map(|(_, slots)| slots.values().copied()));
        for (id, a) in self.allocations.iter().enumerate() {
            match (a.is_live(), referenced.contains(&id)) {
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

    /// The trace's time zero, given when recording began (the header's monotonic clock): that,
    /// or the first record if one came earlier. Report and export times count from here.
    pub fn time_zero(&self, monotonic_start_ns: u64) -> u64 {
        monotonic_start_ns.min(self.first_ts.unwrap_or(u64::MAX))
    }

    /// Live bytes of one kind across every process.
    pub fn live(&self, memory: Memory) -> u64 {
        self.processes.values().map(|p| p.usage.live.get(&memory).copied().unwrap_or(0)).fold(0, u64::saturating_add)
    }

    pub fn live_allocations(&self) -> impl Iterator<Item = &Allocation> {
        self.allocations.iter().filter(|a| a.is_live())
    }

    /// Besides its client's file, the files that keep each allocation alive: those it was
    /// exported to or is mapped through (a process holding any of them holds the memory).
    /// Built once, for a report.
    pub fn other_files_keeping(&self) -> HashMap<AllocId, Vec<FileId>> {
        let mut keeping: HashMap<AllocId, Vec<FileId>> = HashMap::new();
        let exported = self.exports.iter().flat_map(|(f, slots)| slots.values().map(move |id| (*id, *f)));
        let mapped = self.uvm_maps.iter().flat_map(|((f, _), ids)| ids.iter().map(|id| (*id, *f)));
        for (id, file) in exported.chain(mapped) {
            keeping.entry(id).or_default().push(file);
        }
        keeping
    }

    /// Processes holding `file` open now.
    pub fn holders(&self, file: FileId) -> Vec<u32> {
        self.processes.values().filter(|p| p.exited.is_none() && p.fds.values().any(|f| f.file == file)).map(|p| p.pid).collect()
    }

    /// [`Model::holders`] of every file, in one pass (asked file by file, thousands of files
    /// cost thousands of passes over every process).
    pub fn holders_by_file(&self) -> HashMap<FileId, Vec<u32>> {
        let mut by_file: HashMap<FileId, Vec<u32>> = HashMap::new();
        for p in self.processes.values().filter(|p| p.exited.is_none()) {
            for f in p.fds.values() {
                let holders = by_file.entry(f.file).or_default();
                if holders.last() != Some(&p.pid) {
                    holders.push(p.pid);
                }
            }
        }
        by_file
    }

    /// Memory of exited processes still live, by the live process that keeps it (the lowest pid
    /// holding the file it lives on: a forked child of a killed server), then by the process
    /// that allocated it: physical bytes.
    pub fn kept_alive(&self) -> BTreeMap<u32, BTreeMap<u32, u64>> {
        let mut kept: BTreeMap<u32, BTreeMap<u32, u64>> = BTreeMap::new();
        let exited = |pid| self.processes.get(&pid).is_some_and(|p| p.exited.is_some());
        // Made when first needed: most models keep nothing alive.
        let mut holders: Option<HashMap<FileId, Vec<u32>>> = None;
        for a in self.allocations.iter().filter(|a| a.is_live() && a.memory != Memory::Virtual && exited(a.pid)) {
            let Some(file) = a.file else { continue };
            let keeper = holders.get_or_insert_with(|| self.holders_by_file()).get(&file).and_then(|h| h.first().copied());
            if let Some(keeper) = keeper {
                add_saturating(kept.entry(keeper).or_default().entry(a.pid).or_default(), a.bytes);
            }
        }
        kept
    }

    /// The GPU memory is on: its device's (`gpu`), or, under a device made before tracing (which
    /// names none), the one GPU its process held when it was met running. The trace keeps what
    /// it saw; this is the analyses' reading of it.
    pub fn gpu_for(&self, pid: u32, gpu: Option<u32>) -> Option<u32> {
        gpu.or_else(|| match self.processes.get(&pid)?.attached.as_ref()?.gpus.as_slice() {
            [only] => Some(*only),
            _ => None,
        })
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
            attached: None,
            oom_killed: None,
            place: None,
            usage: Usage::default(),
            fds: HashMap::new(),
        })
    }

    /// The only way in: one record at a time, each to the concern it belongs to (fds.rs: fd
    /// tables and files; handles.rs: RM handle trees and UVM ranges; requests.rs: connections).
    pub fn apply(&mut self, r: &Record) {
        self.first_ts.get_or_insert(r.ts);
        self.last_ts = self.last_ts.max(r.ts);
        let (ts, pid) = (r.ts, r.pid);
        if self.refused_by_rm(r) {
            add_saturating(&mut self.foreign_client_calls, 1);
            return;
        }
        // Host-wide records name no process the model keeps.
        let host_wide = matches!(r.event, Event::Sample(_) | Event::Lost { .. } | Event::Mark { .. } | Event::Proxy { .. });
        if !host_wide && !self.room_for(pid) {
            add_saturating(&mut self.records_not_kept, 1);
            return;
        }
        match &r.event {
            Event::Process { ppid, seen, command } => self.on_process(pid, ts, *ppid, *seen, command),
            Event::Exec { command } => self.on_exec(pid, ts, command),
            Event::Place(place) => self.process(pid, ts).place = Some(bounded_place(place)),
            Event::Exit { code } => self.on_exit(pid, ts, *code),
            Event::Open { fd, file, device, cloexec } => self.on_open(pid, ts, *fd, *file, *device, *cloexec),
            Event::FdFound { fd, file, device } => self.on_fd_found(pid, ts, *fd, *file, *device),
            Event::Dup { old_fd, new_fd, cloexec } => self.on_dup(pid, ts, *old_fd, *new_fd, *cloexec),
            Event::Close { fd } => self.close_fd(pid, *fd, ts),
            Event::CloseRange { first, last, cloexec_only } => self.on_close_range(pid, ts, *first, *last, *cloexec_only),
            Event::SetCloexec { fd, cloexec } => self.set_cloexec(pid, ts, *fd, *cloexec),
            // A failed call changed nothing in the driver.
            Event::Object { status, .. }
            | Event::Free { status, .. }
            | Event::DupObject { status, .. }
            | Event::ExportObject { status, .. }
            | Event::ImportObject { status, .. }
            | Event::ExportObjects { status, .. }
            | Event::ImportObjects { status, .. }
            | Event::UvmMap { status, .. }
            | Event::UvmFree { status, .. }
            | Event::UvmUnmap { status, .. }
            // A failed attach or detach may have failed before RM read it: its counts would be
            // the caller's own bytes (another user's handles, made-up offsets), so none is kept.
            | Event::FabricAttach { status, .. }
            | Event::FabricDetach { status, .. }
            | Event::Share { status, .. }
                if *status != 0 => {}
            Event::Share { client, object, share_type, action, .. } => self.on_share(*client, *object, *share_type, *action),
            Event::ClientMaker { client, maker } => self.on_client_maker(*client, *maker),
            Event::Object { fd, client, parent, object, class, gpu, .. } => {
                self.on_object(pid, ts, *fd, (*client, *parent, *object), *class, *gpu)
            }
            Event::Alloc(a) => self.alloc(r, a),
            Event::Free { client, object, .. } => self.free_handle(*client, *object, ts),
            Event::DupObject { fd, client, parent, object, src_client, src_object, .. } => {
                self.on_dup_object(pid, ts, *fd, (*client, *parent, *object), (*src_client, *src_object))
            }
            Event::ExportObject { client, object, to_fd, .. } => self.on_export(pid, ts, *client, &[*object], (None, 0), *to_fd),
            Event::ImportObject { fd, client, parent, object, from_fd, .. } => {
                self.on_import(pid, ts, *fd, (*client, *parent), &[*object], 0, *from_fd)
            }
            Event::ExportObjects { client, objects, index, more, to_fd, .. } => {
                add_saturating(&mut self.handles_not_followed, u64::from(*more));
                self.on_export(pid, ts, *client, objects, (Some(*index), u32::from(*more)), *to_fd)
            }
            Event::ImportObjects { fd, client, parent, objects, index, more, from_fd, .. } => {
                add_saturating(&mut self.handles_not_followed, u64::from(*more));
                self.on_import(pid, ts, *fd, (*client, *parent), objects, *index, *from_fd)
            }
            Event::RegisterFd { fd, ctl_fd } => self.on_register_fd(pid, ts, *fd, *ctl_fd),
            Event::FabricAttach { client, fabric, subdevice, attachments, attached, more, .. } => {
                add_saturating(&mut self.handles_not_followed, u64::from(*more));
                let done = attachments.iter().take(usize::from(*attached));
                self.on_fabric_attach((*client, *fabric), *subdevice, done)
            }
            Event::FabricDetach { client, fabric, subdevice, offsets, detached, more, .. } => {
                add_saturating(&mut self.handles_not_followed, u64::from(*more));
                let done = offsets.iter().take(usize::from(*detached));
                self.on_fabric_detach(ts, (*client, *fabric), *subdevice, done)
            }
            Event::UvmMap { fd, base, client, memory, .. } => self.on_uvm_map(pid, ts, *fd, *base, (*client, *memory)),
            Event::UvmFree { fd, base, .. } => self.on_uvm_free(pid, ts, *fd, *base),
            Event::UvmUnmap { fd, base, length, .. } => self.on_uvm_unmap(pid, ts, *fd, *base, *length),
            Event::Undecodable { .. } => self.undecodable += 1,
            Event::Lost { records } => add_saturating(&mut self.lost_records, *records),
            Event::Bind { .. }
            | Event::Listen { .. }
            | Event::Attached { .. }
            | Event::Accept { .. }
            | Event::Received { .. }
            | Event::Sent { .. }
            | Event::ConnClose { .. } => self.on_socket(pid, ts, &r.event),
            Event::OomKill => {
                self.process(pid, ts).oom_killed.get_or_insert(ts);
            }
            Event::Mark { phase } => self.marks.push((ts, pid, phase.clone())),
            Event::Sample(sample) => self.samples.push((ts, sample.clone())),
            Event::Proxy { .. } => self.on_proxy(pid, ts, &r.event),
        }
    }

    fn on_client_maker(&mut self, client: u32, maker: u32) {
        if let Some(c) = self.clients.get_mut(&client) {
            c.pid = (maker != 0).then_some(maker);
        }
    }

    /// A proxy seen with no deployments has stopped serving them.
    fn on_proxy(&mut self, pid: u32, ts: u64, event: &Event) {
        let Event::Proxy { uid, command, config, deployments, workers } = event else { return };
        if deployments.is_empty() {
            self.proxies.remove(&pid);
        } else if self.proxies.len() < MAX_PROXIES || self.proxies.contains_key(&pid) {
            // A crafted trace's proxy keeps what a scan would have.
            let deployments = deployments.iter().take(crate::litellm::MAX_DEPLOYMENTS).cloned().collect();
            let proxy = Proxy { ts, uid: *uid, command: command.clone(), config: config.clone(), deployments, workers: *workers };
            self.proxies.insert(pid, proxy);
        }
    }

    /// A call RM would have refused: on a client that is not its file's, or a dup of memory of
    /// another process's client that was not shared with the taker (the snapshot's own records,
    /// with no fd, excepted). The taker is the destination client's maker, or the caller where
    /// that is not known (a client first met now).
    fn refused_by_rm(&mut self, r: &Record) -> bool {
        if let Some((fd, client)) = r.event.client_call() {
            if !self.through_own_file(r.pid, fd, client) {
                return true;
            }
        }
        if let Event::DupObject { fd, client, src_client, src_object, status: 0, .. } = &r.event {
            let taker = self.clients.get(client).and_then(|c| c.pid).unwrap_or(r.pid);
            return *fd >= 0 && src_client != client && !self.may_take(taker, (*src_client, *src_object));
        }
        false
    }

    /// A server's sockets: bound, listening (or met listening), its connections and requests.
    fn on_socket(&mut self, pid: u32, ts: u64, event: &Event) {
        match event {
            Event::Bind { port, .. } => self.process(pid, ts).bound.push((ts, *port)),
            Event::Listen { .. } => {
                self.process(pid, ts).listened.get_or_insert(ts);
            }
            Event::Attached { listening, gpus } => {
                let p = self.process(pid, ts);
                if !listening.is_empty() {
                    p.listened.get_or_insert(ts);
                }
                p.attached = Some(Attached { ts, listening: listening.clone(), gpus: gpus.clone() });
            }
            Event::Accept { conn, .. } => {
                self.connections.insert(*conn, (pid, None));
            }
            Event::Received { conn, bytes, request } => self.on_received(pid, ts, *conn, *bytes, request.as_ref()),
            Event::Sent { conn, bytes, status, data } => self.on_sent(ts, *conn, *bytes, *status, *data),
            Event::ConnClose { conn } => self.on_conn_close(ts, *conn),
            _ => {}
        }
    }

    /// A process's command line as the samples first gave it.
    pub fn sampled_command(&self, pid: u32) -> Option<Vec<String>> {
        self.samples.iter().flat_map(|(_, s)| &s.processes).find(|p| p.pid == pid && !p.command.is_empty()).map(|p| p.command.clone())
    }

    /// The last sample taken at or before `ts`.
    pub fn sample_at(&self, ts: u64) -> Option<&crate::event::Sample> {
        match self.samples.partition_point(|(t, _)| *t <= ts) {
            0 => None,
            i => Some(&self.samples[i - 1].1),
        }
    }
}

mod fds;
mod handles;
mod requests;
mod snapshot;

pub mod generate;

#[cfg(test)]
mod tests;

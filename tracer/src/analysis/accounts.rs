//! What is known of a service, a GPU and what everyone else holds, at any moment of the trace:
//! the one account every analysis reads (the diagnosis, headroom and whatif alike), so that a
//! failure's evidence, the headroom before it and a replay of it agree on every figure.
//! Capacity (unified memory's too), memory live per GPU, what a service held before tracing,
//! what others held (traced, or as NVML counted it), the engine's command line, the proxies in
//! front, a service's pool for requests and the room for requests over time.

use std::collections::{HashMap, HashSet};

use serde::Serialize;

use super::cost::{Live, Pool};
use super::holders::{benign, prior_holder};
use super::proxy::Front;
use super::services::{Service, Services};
use super::Phase;
use crate::event::Memory;
use crate::model::{display_command, Allocation, Model};
use crate::trace::{Gpu, Header, PriorUse};

/// Who held memory outside a service.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Holder {
    pub pid: u32,
    pub command: String,
    /// None where nothing can tell: NVML was unavailable when recording began.
    pub bytes: Option<u64>,
    /// "traced" (seen allocating), "nvml" (held before recording began, as NVML counted it) or
    /// "proc" (had the device files open before recording began; NVML could not say how much).
    pub source: &'static str,
    /// The pid NVML counted it for, when another process keeps it now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvml_pid: Option<u32>,
}

/// Memory on a GPU at a moment: held outside a service (and by whom), and by the service itself.
pub struct Held {
    pub outside: u64,
    pub holders: Vec<Holder>,
    pub own: u64,
}

/// A service that had loaded when the trace began: met running (`record --pid`, `--all`, a
/// watch), or carried by the snapshot a watch's dump starts its window with. Its load, and the
/// requests it served before, are not in the trace.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct LoadedBefore {
    pub service: String,
    pub pid: u32,
    /// What NVML counted for its processes when tracing began; None where it said nothing of
    /// them (unavailable, or they held nothing then).
    pub nvml_bytes: Option<u64>,
    /// Its video memory from before the window that a dump's snapshot carries, allocation by
    /// allocation.
    pub snapshot_allocations: u64,
    pub snapshot_bytes: u64,
}

pub struct Accounts<'a> {
    pub header: &'a Header,
    pub model: &'a Model,
    pub services: Services<'a>,
}

impl<'a> Accounts<'a> {
    pub fn new(header: &'a Header, model: &'a Model) -> Self {
        Accounts { header, model, services: Services::new(model) }
    }

    pub fn start(&self) -> u64 {
        self.model.time_zero(self.header.monotonic_start_ns)
    }

    /// The GPU NVML described as `gpu`; with no GPU named, the only one there is.
    pub fn card(&self, gpu: Option<u32>) -> Option<&Gpu> {
        match gpu {
            Some(g) => self.header.gpus.iter().find(|c| c.index == g),
            None => self.header.gpus.iter().find(|_| self.header.gpus.len() == 1),
        }
    }

    pub fn capacity(&self, gpu: Option<u32>) -> Option<u64> {
        self.card(gpu).and_then(|c| c.total_bytes)
    }

    /// Unified memory (DGX Spark, Grace Hopper): NVML answered, but with no device memory size.
    pub fn unified(&self, gpu: Option<u32>) -> bool {
        self.header.nvml == "ok" && self.card(gpu).is_some_and(|c| c.total_bytes.is_none())
    }

    /// Whether memory on `memory_gpu` counts for `gpu`. Memory whose device was created before
    /// tracing has no GPU: it counts wherever there is only one GPU to be on.
    pub fn counts_on(&self, memory_gpu: Option<u32>, gpu: Option<u32>) -> bool {
        match (gpu, memory_gpu) {
            (None, _) => true,
            (Some(g), Some(m)) => g == m,
            (Some(_), None) => self.header.gpus.len() <= 1,
        }
    }

    /// Video memory live at `ts`, on every GPU.
    pub fn live_video_at(&self, ts: u64) -> impl Iterator<Item = &'a Allocation> + 'a {
        self.model.allocations.iter().filter(move |a| a.memory == Memory::Video && a.ts <= ts && a.freed.is_none_or(|(f, _)| f > ts))
    }

    /// Video memory live at `ts` by the GPU it is on (None: under a device made before tracing):
    /// `service`'s, and everyone else's.
    pub fn live_by_gpu(&self, service: &Service, ts: u64) -> HashMap<Option<u32>, (u64, u64)> {
        let mut by_gpu: HashMap<Option<u32>, (u64, u64)> = HashMap::new();
        for a in self.live_video_at(ts) {
            let (own, outside) = by_gpu.entry(self.model.gpu_for(a.pid, a.gpu)).or_default();
            let held = if service.has(a.pid) { own } else { outside };
            *held = held.saturating_add(a.bytes);
        }
        by_gpu
    }

    /// The GPUs `service` allocated on, or asked to, or held memory on when tracing began.
    pub fn gpus_of(&self, service: &Service) -> Vec<u32> {
        let allocated = self.model.allocations.iter().filter(|a| service.has(a.pid)).filter_map(|a| self.model.gpu_for(a.pid, a.gpu));
        let failed = self.model.failures.iter().filter(|f| service.has(f.pid)).filter_map(|f| self.model.gpu_for(f.pid, f.gpu));
        let before = self.header.prior_use.iter().filter(|p| service.has(p.pid) && p.used_bytes.unwrap_or(0) > 0).map(|p| p.gpu);
        let mut gpus: Vec<u32> = allocated.chain(failed).chain(before).collect();
        gpus.sort();
        gpus.dedup();
        gpus
    }

    /// What NVML said the service's processes held on `gpu` when tracing began (a recording
    /// attached to a server that had loaded): still theirs at `ts` while they run, since no free
    /// of it can be told from the trace.
    pub fn before_tracing(&self, service: &Service, ts: u64, gpu: Option<u32>) -> u64 {
        let running = |pid: u32| self.model.processes.get(&pid).is_none_or(|p| p.exited.is_none_or(|e| e > ts));
        self.header
            .prior_use
            .iter()
            .filter(|p| service.has(p.pid) && gpu.is_none_or(|g| p.gpu == g) && running(p.pid))
            .map(|p| p.used_bytes.unwrap_or(0))
            .fold(0, u64::saturating_add)
    }

    /// Services with GPU memory that had loaded before the trace began, in the order of the
    /// services. One pass over the allocations.
    pub fn loaded_before(&self) -> Vec<LoadedBefore> {
        let window = self.header.monotonic_start_ns;
        let n = self.services.list.len();
        let mut snapshot = vec![(0u64, 0u64); n];
        let before = self.model.allocations.iter().filter(|a| a.ts < window && a.memory == Memory::Video);
        for a in before {
            if let Some(i) = self.services.index_of(a.pid) {
                snapshot[i] = (snapshot[i].0 + 1, snapshot[i].1.saturating_add(a.bytes));
            }
        }
        let met = |pid: &u32| self.model.processes.get(pid).is_some_and(|p| p.seen == crate::event::Seen::Running);
        let held_files = |s: &Service| self.header.holders_at_start.iter().any(|h| s.has(h.pid));
        let mut out = Vec::new();
        for (s, (allocations, bytes)) in self.services.list.iter().zip(snapshot) {
            let nvml = self.header.prior_use.iter().filter(|p| s.has(p.pid)).map(|p| p.used_bytes.unwrap_or(0));
            let nvml_bytes = Some(nvml.fold(0u64, u64::saturating_add)).filter(|&b| b > 0);
            if allocations > 0 || (s.pids.iter().any(met) && (nvml_bytes.is_some() || held_files(s))) {
                out.push(LoadedBefore {
                    service: s.name.clone(),
                    pid: s.root,
                    nvml_bytes,
                    snapshot_allocations: allocations,
                    snapshot_bytes: bytes,
                });
            }
        }
        out
    }

    /// Memory held outside `service` at `ts` on `gpu`: other traced services, and what NVML said
    /// other processes held there when recording began. With who holds it, and what the service's
    /// own processes hold there, traced: one pass over the allocations for all of it (a pass per
    /// service cost services times allocations, which one user's forks can make minutes).
    pub fn held_outside(&self, service: &Service, ts: u64, gpu: Option<u32>) -> Held {
        let (mut total, mut own) = (0u64, 0u64);
        let mut by_service = vec![0u64; self.services.list.len()];
        for a in self.live_video_at(ts).filter(|a| self.counts_on(self.model.gpu_for(a.pid, a.gpu), gpu)) {
            match self.services.index_of(a.pid) {
                Some(i) if self.services.list[i].root == service.root => own = own.saturating_add(a.bytes),
                i => {
                    total = total.saturating_add(a.bytes);
                    if let Some(i) = i {
                        by_service[i] = by_service[i].saturating_add(a.bytes);
                    }
                }
            }
        }
        let mut holders = Vec::new();
        for (other, &held) in self.services.list.iter().zip(&by_service).filter(|(_, &held)| held > 0) {
            holders.push(Holder { pid: other.root, command: other.name.clone(), bytes: Some(held), source: "traced", nvml_pid: None });
        }
        for (prior, sampled) in self.nvml_outside(service, ts, gpu) {
            total = total.saturating_add(prior.used_bytes.unwrap_or(0));
            // A sampled process is named by the command it was seen with.
            let named = sampled.then(|| PriorUse { command: self.model.sampled_command(prior.pid).unwrap_or_default(), ..prior.clone() });
            let (pid, command) = prior_holder(self.header, named.as_ref().unwrap_or(prior), |pid| service.has(pid));
            holders.push(Holder { pid, command, bytes: prior.used_bytes, source: "nvml", nvml_pid: Some(prior.pid) });
        }
        // Without NVML, who had the device files open before recording is all there is to know:
        // each is a suspect of unknown size (benign holders aside), traced since or not (under
        // --all or a watch everyone is: what it held before is still unknown).
        if self.header.nvml != "ok" {
            let listed: std::collections::HashSet<u32> = holders.iter().map(|h| h.pid).collect();
            let outside =
                |h: &&crate::trace::HolderAtStart| !service.has(h.pid) && !listed.contains(&h.pid) && benign(h.exe.as_ref()).is_none();
            for h in self.header.holders_at_start.iter().filter(outside) {
                holders.push(Holder { pid: h.pid, command: display_command(&h.command), bytes: None, source: "proc", nvml_pid: None });
            }
        }
        Held { outside: total, holders, own }
    }

    /// What NVML last said of processes outside `service` that are not traced (sampled while
    /// recording), or failing that what it said when recording began. A traced process's NVML
    /// figure would count its traced memory twice: for those, only what they held before
    /// recording began. Each with whether it came from a sample (its command is not in it).
    pub fn nvml_outside(&self, service: &Service, ts: u64, gpu: Option<u32>) -> Vec<(&'a PriorUse, bool)> {
        let sampled = self.model.sample_at(ts).filter(|s| self.header.nvml == "ok" && !s.processes.is_empty());
        let on_gpu = |p: &&PriorUse| gpu.is_none_or(|g| p.gpu == g);
        let before = self.header.prior_use.iter().filter(on_gpu).filter(|p| !service.has(p.pid));
        match sampled {
            Some(s) => {
                let untraced = s.processes.iter().filter(on_gpu).filter(|p| self.services.of(p.pid).is_none()).map(|p| (p, true));
                untraced.chain(before.filter(|p| self.services.of(p.pid).is_some()).map(|p| (p, false))).collect()
            }
            None => before.map(|p| (p, false)).collect(),
        }
    }

    /// The LiteLLM deployments that send their requests to `service`.
    pub fn fronting(&self, service: &Service) -> Vec<Front> {
        super::proxy::fronting(self.model, &self.services.list, service)
    }

    /// The engine's command line, whose settings the fixes and limits read: of the service's
    /// processes that serve (listen, or allocate on a GPU) and are no wrapper, the first met of a
    /// known engine family, else the first met; a launcher's own command line (a script that
    /// starts `vllm serve ...`) carries none of the server's flags. With none serving, the first
    /// process of the service with a command line.
    pub fn engine(&self, service: &Service) -> &'a [String] {
        let root = &self.model.processes[&service.root].command;
        let in_service = || self.model.processes.values().filter(|p| service.has(p.pid) && !p.command.is_empty());
        let serving = |p: &&crate::model::Process| {
            (p.listened.is_some() || p.usage.allocations > 0 || p.attached.as_ref().is_some_and(|a| !a.listening.is_empty()))
                && !super::services::is_wrapper(p)
        };
        let mut servers: Vec<&crate::model::Process> = in_service().filter(serving).collect();
        servers.sort_by_key(|p| (p.first_ts, p.pid));
        let known = servers.iter().find(|p| super::server::ServerFamily::of(&p.command) != super::server::ServerFamily::Unknown);
        match known.or(servers.first()) {
            Some(p) => &p.command,
            None => in_service().map(|p| p.command.as_slice()).next().unwrap_or(root),
        }
    }

    /// The service's pool on `gpu`.
    pub fn pool(&self, service: &Service, gpu: Option<u32>) -> Pool<'_> {
        self.pool_of(service, gpu, |_| true)
    }

    /// The service's pool on `gpu`, of the allocations `reused` takes (memory the service keeps
    /// is held, not room a request reuses).
    pub fn pool_of(&self, service: &Service, gpu: Option<u32>, reused: impl Fn(&Allocation) -> bool) -> Pool<'_> {
        let pids: HashSet<u32> = service.pids.iter().copied().collect();
        let allocations: Vec<&Allocation> = self
            .model
            .allocations
            .iter()
            .filter(|a| a.memory == Memory::Video && pids.contains(&a.pid) && self.counts_on(self.model.gpu_for(a.pid, a.gpu), gpu))
            .filter(|a| self.services.phase(service, a.ts) == Phase::Prefill && reused(a))
            .collect();
        Pool::new(allocations)
    }

    /// The room for requests of `service` on `gpu` over time, with its `pool`; the GPU's size
    /// must be known.
    pub fn room_over_time<'d>(&'d self, service: &'d Service, gpu: Option<u32>, pool: Pool<'d>) -> Option<RoomOverTime<'d, 'a>> {
        let capacity = self.sized(gpu)?;
        let on_gpu = |a: &&Allocation| a.memory == Memory::Video && self.counts_on(self.model.gpu_for(a.pid, a.gpu), gpu);
        Some(RoomOverTime { accounts: self, service, gpu, capacity, all: Live::of(self.model.allocations.iter().filter(on_gpu)), pool })
    }

    /// The GPU's size: NVML's, or on unified memory the host's.
    pub fn sized(&self, gpu: Option<u32>) -> Option<u64> {
        let host = || self.model.samples.last().and_then(|(_, s)| s.host.as_ref()).map(|h| h.total_bytes);
        self.capacity(gpu).or_else(|| self.unified(gpu).then(host).flatten())
    }
}

/// The room for requests of one service on one GPU over time: the series headroom's moments
/// and whatif's replay are read from.
pub struct RoomOverTime<'d, 'a> {
    accounts: &'d Accounts<'a>,
    service: &'d Service,
    gpu: Option<u32>,
    capacity: u64,
    /// Every process's video memory on the GPU, and the service's prefill pool.
    pub all: Live,
    pub pool: Pool<'d>,
}

impl RoomOverTime<'_, '_> {
    /// Free on the GPU at `ts` by the same account as a diagnosis's, plus the pool: the room
    /// for requests.
    pub fn room(&self, ts: u64) -> u64 {
        let before = self.accounts.before_tracing(self.service, ts, self.gpu);
        let nvml = self
            .accounts
            .nvml_outside(self.service, ts, self.gpu)
            .iter()
            .map(|(p, _)| p.used_bytes.unwrap_or(0))
            .fold(0, u64::saturating_add);
        let held = self.all.at(ts).saturating_add(before).saturating_add(nvml);
        let mut free = self.capacity.saturating_sub(held);
        // On unified memory no more than the host has available either.
        if self.accounts.unified(self.gpu) {
            if let Some(host) = self.accounts.model.sample_at(ts).and_then(|s| s.host.as_ref()) {
                free = free.min(host.available_bytes);
            }
        }
        free.saturating_add(self.pool.at(ts))
    }
}

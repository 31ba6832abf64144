//! Which "CUDA out of memory" it was, with the evidence in numbers and what to change.
//!
//! The symptom (a failed allocation, a server refusing at start, an OOM kill, a crash) is not the
//! cause. Causes are checked in the order a careful engineer would:
//! 1. held-by-other-process: memory held outside the failing service covers the shortfall;
//! 2. does-not-fit-at-load: it failed before the service served a request;
//! 3. long-request: one request in flight, or one far larger than the others;
//! 4. concurrent-load: several in flight, each of which alone fits.
//!
//! Besides: host-oom (the kernel's OOM killer), none, and inconclusive (evidence missing or lost).
//! The evidence is typed ([`Evidence`]); each category's fix is its own function, which asks the
//! server's family ([`ServerFamily`]) what its settings are called.

use std::cell::OnceCell;
use std::collections::HashMap;

use serde::Serialize;
use serde_json::{json, Value};

use super::headroom::BYTES_PER_TOKEN;
use super::server::{flag, ServerFamily};
use super::{Phase, Service, Services};
use crate::abi::status;
use crate::event::Memory;
use crate::model::{display_command, Allocation, Model, Request};
use crate::trace::{Gpu, Header, PriorUse};
use crate::units::bytes;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Category {
    HeldByOtherProcess,
    DoesNotFitAtLoad,
    LongRequest,
    ConcurrentLoad,
    HostOom,
    None,
    Inconclusive,
}

impl Category {
    /// The name reports and scripts use (the same as in JSON).
    pub fn name(self) -> &'static str {
        match self {
            Category::HeldByOtherProcess => "held-by-other-process",
            Category::DoesNotFitAtLoad => "does-not-fit-at-load",
            Category::LongRequest => "long-request",
            Category::ConcurrentLoad => "concurrent-load",
            Category::HostOom => "host-oom",
            Category::None => "none",
            Category::Inconclusive => "inconclusive",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Symptom {
    FailedAllocation,
    /// The server exited during load with no failed allocation (vLLM's free-memory check).
    StartupRefusal,
    OomKill,
    Crash,
    None,
}

impl Symptom {
    /// The name reports and scripts use (the same as in JSON).
    pub fn name(self) -> &'static str {
        match self {
            Symptom::FailedAllocation => "failed-allocation",
            Symptom::StartupRefusal => "startup-refusal",
            Symptom::OomKill => "oom-kill",
            Symptom::Crash => "crash",
            Symptom::None => "none",
        }
    }
}

/// Fields a script reads, and the same said in words.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Said {
    pub fields: Value,
    pub text: String,
}

impl Said {
    fn new(fields: impl Serialize, text: String) -> Said {
        Said { fields: serde_json::to_value(fields).unwrap_or_default(), text }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Diagnosis {
    pub category: Category,
    pub symptom: Symptom,
    /// Nanoseconds since the trace start.
    pub ts: Option<u64>,
    pub pid: Option<u32>,
    pub service: Option<String>,
    /// The GPU it happened on (as in the evidence), when one can be told.
    pub gpu: Option<u32>,
    pub evidence: Said,
    pub fix: Said,
    /// The same failure again right after (a framework's retries: PyTorch frees its cache and
    /// asks once more), folded into this one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repeated: Option<Repeated>,
}

/// How many more times a failure came, the same in every figure, and when the last did.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Repeated {
    pub times: u64,
    /// Nanoseconds since the trace start.
    pub last_ts: Option<u64>,
}

impl Diagnosis {
    /// Said after the evidence when the failure repeated as it was (" The same failure 3 more
    /// time(s), the last at 1.20 s (retries)."), or nothing.
    pub fn repeats(&self) -> String {
        self.repeated
            .as_ref()
            .map(|r| {
                let until = r.last_ts.map(|t| format!(", the last at {:.2} s", t as f64 / 1e9)).unwrap_or_default();
                format!(" The same failure {} more time(s){until} (retries).", r.times)
            })
            .unwrap_or_default()
    }

    /// The same failure: one process, one GPU, the same figures and the same fix.
    fn same_as(&self, other: &Diagnosis) -> bool {
        (self.category, self.symptom, self.pid, self.gpu) == (other.category, other.symptom, other.pid, other.gpu)
            && self.evidence.text == other.evidence.text
            && self.fix.text == other.fix.text
    }
}

/// Folds each run of consecutive identical failures into its first.
fn fold_repeats(diagnoses: impl Iterator<Item = Diagnosis>) -> Vec<Diagnosis> {
    let mut out: Vec<Diagnosis> = Vec::new();
    for d in diagnoses {
        match out.last_mut() {
            Some(last) if last.same_as(&d) => {
                let r = last.repeated.get_or_insert(Repeated { times: 0, last_ts: None });
                r.times += 1;
                r.last_ts = d.ts;
            }
            _ => out.push(d),
        }
    }
    out
}

/// Who held memory outside the failing service.
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

/// What the diagnosis saw at the failure (the `evidence.fields` of the report's JSON). Figures
/// are for the GPU the failure happened on: every other GPU's memory is beside the point.
#[derive(Clone, Debug, Serialize)]
pub struct Evidence {
    /// The failing GPU (the RM device instance); None when it cannot be told (see [`Diagnoser::gpu_of`]).
    pub gpu: Option<u32>,
    pub gpu_name: Option<String>,
    /// The GPUs the service allocated on: several for a tensor-parallel server.
    pub service_gpus: Vec<u32>,
    /// Unified memory: capacity and free are the host's RAM (MemTotal, MemAvailable).
    pub host_memory: bool,
    pub capacity_bytes: Option<u64>,
    pub service_bytes: u64,
    pub held_outside_bytes: u64,
    /// The biggest [`MAX_HOLDERS`] of them, in the order found.
    pub holders_outside: Vec<Holder>,
    /// Holders past those, counted in `held_outside_bytes`, not listed.
    #[serde(skip_serializing_if = "is_zero")]
    pub holders_not_listed: usize,
    pub free_bytes: Option<u64>,
    pub failed_bytes: Option<u64>,
    pub phase: Phase,
    pub requests_in_flight: usize,
    pub request_bytes_received: Vec<u64>,
}

struct Failure {
    ts: u64,
    pid: u32,
    symptom: Symptom,
    /// Bytes the failed allocation asked for.
    bytes: Option<u64>,
    /// The GPU the failed allocation was asked of; None for a death, which names no GPU.
    gpu: Option<u32>,
}

/// One failure with everything a fix needs.
struct Case<'c> {
    failure: &'c Failure,
    service: &'c Service,
    /// The engine's command line (the first process of the service with one) and its family.
    engine: &'c [String],
    family: ServerFamily,
    in_flight: Vec<&'c Request>,
    evidence: Evidence,
}

/// Failures diagnosed one by one; a trace with more (a crafted one, a retry loop) gets the first
/// ones and a count of the rest.
pub const MAX_DIAGNOSED: usize = 100;

/// Holders outside a failing service listed in its evidence: the biggest are the ones to stop,
/// and every failure listing every service of a host (thousands of `sleep`s a user forked) made
/// reports of tens of megabytes.
pub const MAX_HOLDERS: usize = 16;

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The biggest `MAX_HOLDERS` (those of a known size first), in the order found, and how many
/// were left out.
fn biggest_holders(mut holders: Vec<Holder>) -> (Vec<Holder>, usize) {
    let left_out = holders.len().saturating_sub(MAX_HOLDERS);
    if left_out > 0 {
        let mut order: Vec<usize> = (0..holders.len()).collect();
        // Of holders as big, the last found, as the fix's choice of the biggest picks.
        order.sort_by_key(|&i| std::cmp::Reverse((holders[i].bytes.is_some(), holders[i].bytes.unwrap_or(0), i)));
        let mut keep = vec![false; holders.len()];
        order.into_iter().take(MAX_HOLDERS).for_each(|i| keep[i] = true);
        let mut kept = keep.into_iter();
        holders.retain(|_| kept.next().unwrap_or(false));
    }
    (holders, left_out)
}

/// Engines that do not say how much they reserve at start are judged as reserving this much.
const DEFAULT_RESERVE: f64 = 0.9;

pub struct Diagnoser<'a> {
    pub(super) header: &'a Header,
    pub(super) model: &'a Model,
    pub(super) services: Services<'a>,
    lost: u64,
    /// Found once: both the diagnoses and the count of those past [`MAX_DIAGNOSED`] read them.
    failures: OnceCell<Vec<Failure>>,
}

impl<'a> Diagnoser<'a> {
    pub fn new(header: &'a Header, model: &'a Model, lost: u64) -> Self {
        Diagnoser { header, model, services: Services::new(model), lost, failures: OnceCell::new() }
    }

    pub fn services(&self) -> &Services<'a> {
        &self.services
    }

    pub(super) fn start(&self) -> u64 {
        self.model.time_zero(self.header.monotonic_start_ns)
    }

    /// The GPU NVML described as `gpu`; with no GPU named, the only one there is.
    fn card(&self, gpu: Option<u32>) -> Option<&Gpu> {
        match gpu {
            Some(g) => self.header.gpus.iter().find(|c| c.index == g),
            None => self.header.gpus.iter().find(|_| self.header.gpus.len() == 1),
        }
    }

    pub(super) fn capacity(&self, gpu: Option<u32>) -> Option<u64> {
        self.card(gpu).and_then(|c| c.total_bytes)
    }

    /// Unified memory (DGX Spark, Grace Hopper): NVML answered, but with no device memory size.
    pub(super) fn unified(&self, gpu: Option<u32>) -> bool {
        self.header.nvml == "ok" && self.card(gpu).is_some_and(|c| c.total_bytes.is_none())
    }

    /// Whether memory on `memory_gpu` counts for `gpu`. Memory whose device was created before
    /// tracing has no GPU: it counts wherever there is only one GPU to be on.
    pub(super) fn counts_on(&self, memory_gpu: Option<u32>, gpu: Option<u32>) -> bool {
        match (gpu, memory_gpu) {
            (None, _) => true,
            (Some(g), Some(m)) => g == m,
            (Some(_), None) => self.header.gpus.len() <= 1,
        }
    }

    /// Video memory live at `ts`, on every GPU.
    fn live_video_at(&self, ts: u64) -> impl Iterator<Item = &'a Allocation> + 'a {
        self.model.allocations.iter().filter(move |a| a.memory == Memory::Video && a.ts <= ts && a.freed.is_none_or(|(f, _)| f > ts))
    }

    /// Video memory live at `ts` by the GPU it is on (None: under a device made before tracing):
    /// `service`'s, and everyone else's.
    fn live_by_gpu(&self, service: &Service, ts: u64) -> HashMap<Option<u32>, (u64, u64)> {
        let mut by_gpu: HashMap<Option<u32>, (u64, u64)> = HashMap::new();
        for a in self.live_video_at(ts) {
            let (own, outside) = by_gpu.entry(self.model.gpu_for(a.pid, a.gpu)).or_default();
            let held = if service.has(a.pid) { own } else { outside };
            *held = held.saturating_add(a.bytes);
        }
        by_gpu
    }

    /// The GPUs `service` allocated on, or asked to, or held memory on when tracing began.
    pub(super) fn gpus_of(&self, service: &Service) -> Vec<u32> {
        let allocated = self.model.allocations.iter().filter(|a| service.has(a.pid)).filter_map(|a| self.model.gpu_for(a.pid, a.gpu));
        let failed = self.model.failures.iter().filter(|f| service.has(f.pid)).filter_map(|f| self.model.gpu_for(f.pid, f.gpu));
        let before = self.header.prior_use.iter().filter(|p| service.has(p.pid) && p.used_bytes.unwrap_or(0) > 0).map(|p| p.gpu);
        let mut gpus: Vec<u32> = allocated.chain(failed).chain(before).collect();
        gpus.sort();
        gpus.dedup();
        gpus
    }

    /// The GPU a failure is judged on: the failed allocation's; for a death (which names none),
    /// the service's only GPU, or of several the one with least room left at that moment.
    fn gpu_of(&self, failure: &Failure, service: &Service, service_gpus: &[u32]) -> Option<u32> {
        if failure.gpu.is_some() {
            return failure.gpu;
        }
        match service_gpus {
            [] => self.header.gpus.iter().find(|_| self.header.gpus.len() == 1).map(|c| c.index),
            [only] => Some(*only),
            several => {
                // One pass over the allocations for all of them, not two per GPU.
                let live = self.live_by_gpu(service, failure.ts);
                several.iter().copied().min_by_key(|&g| {
                    let (mut own, mut outside) = live.get(&Some(g)).copied().unwrap_or_default();
                    if self.counts_on(None, Some(g)) {
                        let (o, out) = live.get(&None).copied().unwrap_or_default();
                        (own, outside) = (own.saturating_add(o), outside.saturating_add(out));
                    }
                    let nvml = self.nvml_outside(service, failure.ts, Some(g));
                    let held = nvml.iter().map(|(p, _)| p.used_bytes.unwrap_or(0)).fold(outside, u64::saturating_add);
                    let own = own.saturating_add(self.before_tracing(service, failure.ts, Some(g)));
                    self.capacity(Some(g)).map_or(u64::MAX, |c| c.saturating_sub(held.saturating_add(own)))
                })
            }
        }
    }

    /// What NVML said the service's processes held on `gpu` when tracing began (a recording
    /// attached to a server that had loaded): still theirs at `ts` while they run, since no free
    /// of it can be told from the trace.
    pub(super) fn before_tracing(&self, service: &Service, ts: u64, gpu: Option<u32>) -> u64 {
        let running = |pid: u32| self.model.processes.get(&pid).is_none_or(|p| p.exited.is_none_or(|e| e > ts));
        self.header
            .prior_use
            .iter()
            .filter(|p| service.has(p.pid) && gpu.is_none_or(|g| p.gpu == g) && running(p.pid))
            .map(|p| p.used_bytes.unwrap_or(0))
            .fold(0, u64::saturating_add)
    }

    /// Memory held outside `service` at `ts` on `gpu`: other traced services, and what NVML said
    /// other processes held there when recording began. With who holds it, and what the service's
    /// own processes hold there, traced: one pass over the allocations for all of it (a pass per
    /// service cost services times allocations, which one user's forks can make minutes).
    pub(super) fn held_outside(&self, service: &Service, ts: u64, gpu: Option<u32>) -> (u64, Vec<Holder>, u64) {
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
            let (pid, command) = super::prior_holder(self.header, named.as_ref().unwrap_or(prior), |pid| service.has(pid));
            holders.push(Holder { pid, command, bytes: prior.used_bytes, source: "nvml", nvml_pid: Some(prior.pid) });
        }
        // Without NVML, who had the device files open before recording is all there is to know:
        // each is a suspect of unknown size (benign holders aside), traced since or not (under
        // --all or a watch everyone is: what it held before is still unknown).
        if self.header.nvml != "ok" {
            let listed: std::collections::HashSet<u32> = holders.iter().map(|h| h.pid).collect();
            let outside = |h: &&crate::trace::HolderAtStart| {
                !service.has(h.pid) && !listed.contains(&h.pid) && super::benign(h.exe.as_ref()).is_none()
            };
            for h in self.header.holders_at_start.iter().filter(outside) {
                holders.push(Holder { pid: h.pid, command: display_command(&h.command), bytes: None, source: "proc", nvml_pid: None });
            }
        }
        (total, holders, own)
    }

    /// What NVML last said of processes outside `service` that are not traced (sampled while
    /// recording), or failing that what it said when recording began. A traced process's NVML
    /// figure would count its traced memory twice: for those, only what they held before
    /// recording began. Each with whether it came from a sample (its command is not in it).
    pub(super) fn nvml_outside(&self, service: &Service, ts: u64, gpu: Option<u32>) -> Vec<(&'a PriorUse, bool)> {
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

    /// The engine's command line: the first process of the service with one.
    /// The LiteLLM deployments that send their requests to `service`.
    pub(super) fn fronting(&self, service: &Service) -> Vec<super::proxy::Front> {
        super::proxy::fronting(self.model, &self.services.list, service)
    }

    pub(super) fn engine(&self, service: &Service) -> &'a [String] {
        let root = &self.model.processes[&service.root].command;
        let in_service = self.model.processes.values().filter(|p| service.has(p.pid));
        in_service.map(|p| p.command.as_slice()).find(|c| !c.is_empty()).unwrap_or(root)
    }

    fn failures(&self) -> &[Failure] {
        self.failures.get_or_init(|| self.find_failures())
    }

    fn find_failures(&self) -> Vec<Failure> {
        let mut failures: Vec<Failure> = self
            .model
            .failures
            .iter()
            .filter(|f| status::is_out_of_memory(f.status) && f.memory != Memory::Virtual)
            .map(|f| Failure {
                ts: f.ts,
                pid: f.pid,
                symptom: Symptom::FailedAllocation,
                bytes: Some(f.bytes),
                gpu: self.model.gpu_for(f.pid, f.gpu),
            })
            .collect();
        for p in self.model.processes.values() {
            if let Some(ts) = p.oom_killed {
                failures.push(Failure { ts, pid: p.pid, symptom: Symptom::OomKill, bytes: None, gpu: None });
            }
        }
        // A server that exited badly with no failure above: a refusal during load, or a crash. Only
        // one that had begun with the GPU: a command that never opened a device file (`false`,
        // a typo in its flags) failed for reasons that are not memory.
        // Each service's first failure and whether it touched a GPU, in one pass each (a scan per
        // service cost services times failures, allocations and files).
        let n = self.services.list.len();
        let (mut first_failure, mut touched_gpu) = (vec![u64::MAX; n], vec![false; n]);
        for f in &failures {
            if let Some(i) = self.services.index_of(f.pid) {
                first_failure[i] = first_failure[i].min(f.ts);
            }
        }
        let users = self.model.files.values().map(|f| f.opened_by).chain(self.model.allocations.iter().map(|a| a.pid));
        for i in users.filter_map(|pid| self.services.index_of(pid)) {
            touched_gpu[i] = true;
        }
        for (i, s) in self.services.list.iter().enumerate() {
            let root = &self.model.processes[&s.root];
            let (Some(code), Some(ts)) = (root.exit_code, root.exited) else { continue };
            let explained = first_failure[i] <= ts;
            if code == 0 || explained || !touched_gpu[i] {
                continue;
            }
            // SIGINT, SIGTERM and SIGKILL are a person's (the OOM killer's SIGKILL is recorded as
            // such, above): stopped, not crashed.
            let symptom = if code > 128 && ![130, 137, 143].contains(&code) {
                Symptom::Crash
            } else if self.services.phase(s, ts) == Phase::Load {
                Symptom::StartupRefusal
            } else {
                continue;
            };
            failures.push(Failure { ts, pid: s.root, symptom, bytes: None, gpu: None });
        }
        failures.sort_by_key(|f| f.ts);
        failures
    }

    /// Every failure, in time order; `none` when nothing failed.
    pub fn diagnose(&self) -> Vec<Diagnosis> {
        let failures = self.failures();
        if failures.is_empty() {
            let fields = json!({"failures": 0, "lost_records": self.lost});
            let (category, text) = if self.lost > 0 {
                (Category::Inconclusive, format!("No failure was seen, but {} kernel records were lost: one may be among them.", self.lost))
            } else {
                (Category::None, "No allocation failed, no server refused or was killed.".to_string())
            };
            return vec![Diagnosis {
                category,
                symptom: Symptom::None,
                ts: None,
                pid: None,
                service: None,
                gpu: None,
                evidence: Said { fields, text },
                fix: Said { fields: json!({}), text: "Nothing to change.".into() },
                repeated: None,
            }];
        }
        fold_repeats(failures.iter().take(MAX_DIAGNOSED).map(|f| self.diagnose_one(f)))
    }

    /// Failures past [`MAX_DIAGNOSED`], not diagnosed one by one.
    pub fn undiagnosed(&self) -> usize {
        self.failures().len().saturating_sub(MAX_DIAGNOSED)
    }

    /// The case a failure makes: its service, engine, requests in flight and the figures.
    fn case<'c>(&'c self, failure: &'c Failure, service: &'c Service) -> Case<'c> {
        let ts = failure.ts;
        // A death is judged by the state just before it: its exit ends its requests at once.
        let before = if failure.symptom == Symptom::FailedAllocation { ts } else { ts.saturating_sub(1) };
        let in_flight = self.services.in_flight(service, before);
        let service_gpus = self.gpus_of(service);
        let gpu = self.gpu_of(failure, service, &service_gpus);
        let (outside, holders, own) = self.held_outside(service, ts, gpu);
        let (holders, holders_not_listed) = biggest_holders(holders);
        let own = own.saturating_add(self.before_tracing(service, ts, gpu));
        // On unified memory the GPU's memory is the host's: its size and what is available.
        let host = self.unified(gpu).then(|| self.model.sample_at(ts).and_then(|s| s.host.clone())).flatten();
        let capacity = self.capacity(gpu).or(host.as_ref().map(|h| h.total_bytes));
        // What the driver's own accounting leaves; on unified memory no more than the host has
        // available either (MemAvailable also counts what the host itself uses).
        let left = capacity.map(|c| c.saturating_sub(outside.saturating_add(own)));
        let free = match &host {
            Some(h) => left.map(|l| l.min(h.available_bytes)),
            None => left,
        };
        let evidence = Evidence {
            gpu,
            gpu_name: self.card(gpu).map(|c| c.name.clone()),
            service_gpus,
            host_memory: host.is_some(),
            capacity_bytes: capacity,
            service_bytes: own,
            held_outside_bytes: outside,
            holders_outside: holders,
            holders_not_listed,
            free_bytes: free,
            failed_bytes: failure.bytes,
            phase: self.services.phase(service, before),
            requests_in_flight: in_flight.len(),
            request_bytes_received: in_flight.iter().map(|r| r.bytes_in).collect(),
        };
        let engine = self.engine(service);
        Case { failure, service, engine, family: ServerFamily::of(engine), in_flight, evidence }
    }

    fn diagnose_one(&self, f: &Failure) -> Diagnosis {
        let Some(service) = self.services.of(f.pid) else {
            return self.inconclusive(f, "the failing process belongs to no traced service".into());
        };
        let case = self.case(f, service);
        let e = &case.evidence;
        let phase = e.phase.name();
        let mut context = match f.symptom {
            Symptom::FailedAllocation => format!("An allocation of {} failed during {phase}", bytes(f.bytes.unwrap_or(0))),
            Symptom::StartupRefusal => "The server exited while loading, with no failed allocation (a refusal)".to_string(),
            Symptom::OomKill => format!("The kernel's OOM killer killed pid {} during {phase}", f.pid),
            Symptom::Crash | Symptom::None => format!("pid {} died with no failed allocation during {phase}", f.pid),
        };
        if let Some(g) = e.gpu.filter(|_| self.header.gpus.len() > 1 || e.service_gpus.len() > 1) {
            context += &format!(" on GPU {g}");
        }
        match (e.capacity_bytes, e.host_memory) {
            (Some(c), true) => {
                let available = e.free_bytes.map_or_else(|| "?".to_string(), bytes);
                context += &format!(
                    "; unified memory: the host's {} of RAM is the GPU's, {available} of it available, {} held by this service",
                    bytes(c),
                    bytes(e.service_bytes)
                );
            }
            (Some(c), false) => {
                let held = (bytes(e.service_bytes), bytes(e.held_outside_bytes));
                context += &format!("; the card has {}, {} held by this service, {} outside it", bytes(c), held.0, held.1);
            }
            (None, _) => {}
        }
        let category = match self.category(&case) {
            Ok(category) => category,
            Err(why) => return self.inconclusive(f, format!("{context}; {why}")),
        };
        let fix = match category {
            Category::HeldByOtherProcess => fix_held(&case),
            Category::DoesNotFitAtLoad => self.fix_load(&case),
            Category::LongRequest => self.fix_long(&case),
            Category::ConcurrentLoad => self.fix_concurrent(&case),
            _ => fix_host_oom(&case),
        };
        let text = format!("{context}, with {} request(s) in flight.", case.in_flight.len());
        Diagnosis {
            category,
            symptom: f.symptom,
            ts: Some(f.ts.saturating_sub(self.start())),
            pid: Some(f.pid),
            service: Some(service.name.clone()),
            gpu: case.evidence.gpu,
            evidence: Said::new(&case.evidence, text),
            fix,
            repeated: None,
        }
    }

    /// The category, in the order the module's doc gives; why none can be told, otherwise.
    fn category(&self, case: &Case) -> Result<Category, String> {
        let n = case.in_flight.len();
        Ok(if case.failure.symptom == Symptom::OomKill {
            Category::HostOom
        } else if self.lost > 0 {
            return Err(format!("{} kernel records were lost, so what else held memory is not known", self.lost));
        } else if self.held_by_other(case) {
            Category::HeldByOtherProcess
        } else if case.failure.symptom != Symptom::FailedAllocation
            && case.evidence.phase == Phase::Load
            && !memory_was_short(&case.evidence)
        {
            let e = &case.evidence;
            let free = e.free_bytes.map_or_else(|| "an unknown amount".to_string(), bytes);
            return Err(format!(
                "nothing the driver saw points at memory ({} held by the service, {free} free): its own log says why it exited",
                bytes(e.service_bytes)
            ));
        } else if case.evidence.phase == Phase::Load && room_unseen(case) {
            let e = &case.evidence;
            return Err(format!(
                "loading failed with {} free by the trace's account (the card's {} less {} held by this service and {} outside it): memory the trace cannot see was in use; `gputrace doctor` shows who holds the GPU",
                bytes(e.free_bytes.unwrap_or(0)),
                bytes(e.capacity_bytes.unwrap_or(0)),
                bytes(e.service_bytes),
                bytes(e.held_outside_bytes)
            ));
        } else if case.evidence.phase == Phase::Load {
            Category::DoesNotFitAtLoad
        } else if n == 1 || one_much_larger(&case.in_flight).is_some() {
            Category::LongRequest
        } else if n > 1 {
            Category::ConcurrentLoad
        } else {
            return Err("no request was in flight, so neither one request nor concurrency explains it".into());
        })
    }

    fn held_by_other(&self, case: &Case) -> bool {
        let (outside, free) = (case.evidence.held_outside_bytes, case.evidence.free_bytes);
        // A holder of unknown size (no NVML) is the suspect of a failure while loading: never a
        // confident does-not-fit-at-load while it may be what filled the GPU. Once the service
        // served, it fitted beside that holder: the holder is no explanation then.
        let unknown = case.evidence.holders_outside.iter().any(|h| h.bytes.is_none());
        if unknown && (case.evidence.phase == Phase::Load || case.failure.symptom == Symptom::StartupRefusal) {
            return true;
        }
        if outside == 0 {
            return false;
        }
        match (case.failure.symptom, case.failure.bytes, free) {
            // Freeing what is held outside would have made room.
            (Symptom::FailedAllocation, Some(b), Some(free)) => free < b && free.saturating_add(outside) >= b,
            (Symptom::FailedAllocation, Some(b), None) => outside >= b,
            // A refusal at start: what others held exceeds what the engine leaves unused.
            (Symptom::StartupRefusal, _, _) => {
                let reserve = reserve_of(case);
                case.evidence.capacity_bytes.is_none_or(|c| outside as f64 >= c as f64 * (1.0 - reserve))
            }
            _ => false,
        }
    }

    fn inconclusive(&self, f: &Failure, why: String) -> Diagnosis {
        Diagnosis {
            category: Category::Inconclusive,
            symptom: f.symptom,
            ts: Some(f.ts.saturating_sub(self.start())),
            pid: Some(f.pid),
            service: self.services.of(f.pid).map(|s| s.name.clone()),
            gpu: f.gpu,
            evidence: Said { fields: json!({"lost_records": self.lost}), text: why },
            fix: Said {
                fields: json!({}),
                text: "Record again with nothing lost (a larger ring buffer, fewer traced processes) to decide.".into(),
            },
            repeated: None,
        }
    }

    /// Smaller model or quantization; a smaller reserve where the engine reserves up front and
    /// refused, or a smaller context where the weights fit.
    fn fix_load(&self, case: &Case) -> Said {
        #[derive(Serialize)]
        struct Fields {
            load_bytes: u64,
            parameters_fp16_billions: f64,
            bytes_8bit: u64,
            bytes_4bit: u64,
            shortfall_bytes: u64,
            gpus: usize,
        }
        let (e, failed) = (&case.evidence, case.failure.bytes.unwrap_or(0));
        // What the failing GPU needed; a sharded (tensor-parallel) model needs as much on each.
        let wanted = e.service_bytes.saturating_add(failed);
        let gpus = e.service_gpus.len().max(1);
        let params = wanted as f64 * gpus as f64 / 2.0 / 1e9;
        let reserve = match (case.family.reserve(), case.family.context()) {
            // A smaller reserve helps only when the model itself fit: the engine refusing at start
            // (its budget exceeds what is free).
            (Some((name, _)), _) if case.failure.symptom == Symptom::StartupRefusal => {
                let fits = e.capacity_bytes.zip(e.free_bytes).map(|(c, free)| (free as f64 / c as f64 * 100.0).floor() / 100.0);
                fits.map(|u| format!("; or lower {name} from {} to {u}, what is free", reserve_of(case))).unwrap_or_default()
            }
            // Or a failure after the weights were loaded: the context reserve is what did not fit.
            (None, Some((setting, names))) if case.failure.bytes.is_some_and(|b| e.service_bytes > b) => {
                let now = flag(case.engine, names).unwrap_or_else(|| "its default".into());
                format!("; the weights fit, so a smaller context reserve may: lower {} (now {now})", setting.name())
            }
            _ => String::new(),
        };
        let card = e.capacity_bytes.map(bytes).unwrap_or_else(|| "?".into());
        let text = match (e.gpu, gpus) {
            (Some(g), 2..) => {
                let more = case.family.sharding().map_or_else(String::new, |(setting, names)| {
                    let now = flag(case.engine, names).unwrap_or_else(|| gpus.to_string());
                    format!(", or shard it over more GPUs ({}, now {now})", setting.name())
                });
                format!(
                    "Loading needed at least {} on GPU {g}, a {card} card, one of the {gpus} GPUs the model is sharded over ({params:.1}B parameters at FP16 in all): use a smaller model or quantize it (about {} per GPU at 8-bit, {} at 4-bit){more}{reserve}.",
                    bytes(wanted),
                    bytes(wanted / 2),
                    bytes(wanted / 4)
                )
            }
            _ => format!(
                "Loading needed at least {} ({params:.1}B parameters at FP16) on a {card} card: use a smaller model or quantize it (about {} at 8-bit, {} at 4-bit){reserve}.",
                bytes(wanted),
                bytes(wanted / 2),
                bytes(wanted / 4)
            ),
        };
        let fields = Fields {
            load_bytes: wanted,
            parameters_fp16_billions: (params * 10.0).round() / 10.0,
            bytes_8bit: wanted / 2,
            bytes_4bit: wanted / 4,
            shortfall_bytes: failed.saturating_sub(e.free_bytes.unwrap_or(0)),
            gpus,
        };
        Said::new(fields, text)
    }

    /// A lower maximum context: what the longest prompt that fits alone takes, from what a
    /// request costs and the room for requests.
    fn fix_long(&self, case: &Case) -> Said {
        #[derive(Serialize)]
        struct Fields<'s> {
            failed_request_bytes: u64,
            largest_served_request_bytes: u64,
            /// The largest prompt that fits alone, in bytes received, and in tokens at
            /// [`BYTES_PER_TOKEN`]; null when no request's cost was measured.
            largest_fitting_request_bytes: Option<u64>,
            context_tokens: Option<u64>,
            /// llama-server's slots that share the setting's value (1: it is one request's).
            context_slots: u64,
            /// No request's cost was measured (met serving): the figures are estimates from what
            /// the failing request needed at least.
            #[serde(skip_serializing_if = "std::ops::Not::not")]
            fits_estimated: bool,
            flag: &'s str,
        }
        let culprit = one_much_larger(&case.in_flight).or_else(|| case.in_flight.first().copied());
        let failed_in = culprit.map(|r| r.bytes_in).unwrap_or(0);
        let served_before = |r: &&Request| case.service.has(r.pid) && r.first_data_at.is_some_and(|d| d < case.failure.ts);
        let served = self.model.requests.iter().filter(served_before).map(|r| r.bytes_in).max();
        let room = self.room_for_requests(case);
        // Met serving, with no request measured since: the failing request, alone in flight, needed
        // at least what it grew the pool by and what it was refused: an estimate of its cost.
        let least = match (room.cost, culprit, case.failure.bytes, case.in_flight.len()) {
            (None, Some(r), Some(refused), 1) => {
                self.pool(case.service, case.evidence.gpu).least_need(r.arrived, case.failure.ts, refused, r.bytes_in)
            }
            _ => None,
        };
        let cost = room.cost.or(least);
        let fits = cost.map(|c| c.fits(room.bytes));
        let (prompt_tokens, tokens) = cost.map(|c| c.context(room.bytes)).unzip();
        let slots = case.family.context_slots(case.engine, None);
        let (setting, how) = match case.family.context() {
            Some((setting, names)) => {
                let now = flag(case.engine, names).unwrap_or_else(|| "its default".into());
                let shared = if slots > 1 { format!(", shared by its {slots} slots") } else { String::new() };
                let how = match tokens {
                    Some(tokens) => {
                        format!(" to about {tokens} tokens a request ({}, now {now}{shared})", setting.with(tokens.saturating_mul(slots)))
                    }
                    None => format!(" ({}, now {now}{shared})", setting.name()),
                };
                (setting.name(), how)
            }
            None => ("", " (the server's setting for it)".to_string()),
        };
        let why = match (fits, prompt_tokens) {
            (Some(fits), Some(prompt)) => format!(
                ": a request of {} fits alone, a prompt of about {prompt} tokens at {BYTES_PER_TOKEN} bytes a token of English text (fewer for code or other scripts), less 3% for the allocator's rounding",
                bytes(fits)
            ),
            _ => String::new(),
        };
        let why = match least {
            Some(c) => format!(
                "{why}. No request was measured since tracing began: this is an estimate from what the failing one needed at least ({} for its {}: what it allocated in prefill and the allocation refused; what it would have asked for after and what it reused from before tracing are not in it), and a request served while traced measures it",
                bytes(c.pool_bytes),
                bytes(c.received)
            ),
            None => why,
        };
        // Attached to a server already serving, the prompts it served before are not in the trace.
        let against = match served {
            Some(served) => format!("while prompts up to {} were served", bytes(served)),
            None => "alone, the first request seen since tracing began (the server was serving already)".to_string(),
        };
        let text = format!(
            "One request of {} received failed {against}: lower the maximum context{how} so longer requests are refused cleanly instead of failing the server{why}.",
            bytes(failed_in)
        );
        let fields = Fields {
            failed_request_bytes: failed_in,
            largest_served_request_bytes: served.unwrap_or(0),
            largest_fitting_request_bytes: fits,
            context_tokens: tokens,
            context_slots: slots,
            fits_estimated: least.is_some(),
            flag: setting,
        };
        Said::new(fields, text)
    }

    /// The room for requests at the failure on its GPU: what was free, plus the service's pool
    /// (what it allocated while requests were in prefill, reused by the next ones); and what a
    /// request costs, where measured.
    fn room_for_requests(&self, case: &Case) -> Room {
        let pool = self.pool(case.service, case.evidence.gpu);
        let completions = self.services.completions(case.service);
        Room {
            bytes: case.evidence.free_bytes.unwrap_or(0).saturating_add(pool.at(case.failure.ts)),
            pool: pool.at(case.failure.ts),
            cost: pool.cost(&completions),
        }
    }

    /// A concurrency cap computed from what one request costs (the largest in flight, by what a
    /// byte received cost), else the batch's share.
    fn fix_concurrent(&self, case: &Case) -> Said {
        #[derive(Serialize)]
        struct Fields {
            in_flight: u64,
            bytes_per_request: u64,
            per_request_measured_alone: bool,
            /// A batch's share, not one request measured alone, of a service that held memory
            /// before tracing began: what its allocator cached then counts as held, not as room,
            /// and is in no share, so the cap is an estimate.
            cap_estimated: bool,
            room_bytes: u64,
            max_concurrency: u64,
            flag: String,
            litellm_max_parallel_requests: u64,
            /// The LiteLLM deployments met that send to this server, where to set it.
            #[serde(skip_serializing_if = "Vec::is_empty")]
            litellm_deployments: Vec<super::proxy::Front>,
        }
        let room = self.room_for_requests(case);
        let n = case.in_flight.len().max(1) as u64;
        let largest = case.in_flight.iter().map(|r| r.bytes_in).max().unwrap_or(0);
        let batch_share = room.pool.saturating_add(case.failure.bytes.unwrap_or(0)) / n;
        let per_request = room.cost.map_or(batch_share, |c| c.of(largest)).max(1);
        let cap = (room.bytes / per_request).clamp(1, n.saturating_sub(1).max(1));
        let setting = case.family.concurrency().map_or_else(|| format!("the server's concurrency limit at {cap}"), |(s, _)| s.with(cap));
        let alone = room.cost.is_some_and(|c| c.alone);
        let how = if alone { "one request alone needed" } else { "the batch needed, per request," };
        let estimated = !alone && self.before_tracing(case.service, case.failure.ts, case.evidence.gpu) > 0;
        let estimate = if estimated {
            " This cap is an estimate: the cost is a batch's share, and the server held memory before tracing began, so what its allocator cached from earlier requests is counted as held instead of as room, and is in no share; it is off by about as many requests as that cache holds. The first request served alone while traced measures the cost."
        } else {
            ""
        };
        let fronts = self.fronting(case.service);
        // Deployments in front count together, each worker of a proxy on its own: each gets a share.
        let litellm_cap = super::proxy::share(&fronts, cap);
        let litellm = if fronts.is_empty() {
            format!("LiteLLM max_parallel_requests: {cap} in front of it")
        } else {
            let each: Vec<String> = fronts
                .iter()
                .map(|f| {
                    let now = f.max_parallel_requests.map_or_else(|| "no limit".to_string(), |v| format!("{v} by its `{}`", f.limit_from));
                    format!("{} (now {now})", f.name())
                })
                .collect();
            let (sends, together) = match (fronts.len(), fronts.iter().map(|f| f.workers).sum::<u64>()) {
                (1, 1) => ("sends to its port", String::new()),
                (1, _) => ("sends to its port", format!(": {cap} together over its workers")),
                (_, _) => ("send to its port", format!(": {cap} together")),
            };
            let past = super::proxy::past_any_share(&fronts, cap);
            format!("`max_parallel_requests: {litellm_cap}` for {}, which {sends}{together}{past}", each.join(" and for "))
        };
        let text = format!(
            "{n} requests were in flight; {how} {}, and {} was free for requests: cap concurrency at {cap} ({setting}, or {litellm}).{estimate}",
            bytes(per_request),
            bytes(room.bytes)
        );
        let fields = Fields {
            in_flight: n,
            bytes_per_request: per_request,
            per_request_measured_alone: alone,
            cap_estimated: estimated,
            room_bytes: room.bytes,
            max_concurrency: cap,
            flag: setting,
            litellm_max_parallel_requests: litellm_cap,
            litellm_deployments: fronts,
        };
        Said::new(fields, text)
    }
}

/// The room for requests at a failure (see [`Diagnoser::room_for_requests`]).
struct Room {
    bytes: u64,
    /// The service's pool within it.
    pool: u64,
    cost: Option<super::headroom::Cost>,
}

/// Whether a death while loading (no failed allocation) came with memory running short: a start-up
/// exit is an out-of-memory only then. Less than a tenth of
/// the GPU free; with its capacity unknown, that the service had allocated at all.
fn memory_was_short(e: &Evidence) -> bool {
    match (e.capacity_bytes, e.free_bytes) {
        (Some(c), Some(free)) => e.service_bytes > 0 && free < c / 10,
        _ => e.service_bytes > 0,
    }
}

/// Whether a failed allocation asked for no more than the trace's account says was free: then
/// it did not fail for want of room the service could see (something unseen held it), and
/// "does not fit" would be a guess.
fn room_unseen(case: &Case) -> bool {
    let e = &case.evidence;
    case.failure.symptom == Symptom::FailedAllocation && e.free_bytes.zip(case.failure.bytes).is_some_and(|(free, asked)| asked <= free)
}

/// The fraction the engine reserves: its flag's value, or its default.
fn reserve_of(case: &Case) -> f64 {
    match case.family.reserve() {
        Some((name, default)) => flag(case.engine, &[name]).and_then(|v| v.parse().ok()).unwrap_or(default),
        None => DEFAULT_RESERVE,
    }
}

/// The in-flight request that received far more than the others (4x their median), if any.
fn one_much_larger<'r>(in_flight: &[&'r Request]) -> Option<&'r Request> {
    if in_flight.len() < 2 {
        return None;
    }
    let mut sizes: Vec<u64> = in_flight.iter().map(|r| r.bytes_in).collect();
    sizes.sort();
    let largest = *sizes.last()?;
    let median_of_rest = sizes[(sizes.len() - 1) / 2];
    (largest >= median_of_rest.max(1).saturating_mul(4)).then(|| in_flight.iter().max_by_key(|r| r.bytes_in).copied()).flatten()
}

/// Stop the biggest holder outside the service.
fn fix_held(case: &Case) -> Said {
    #[derive(Serialize)]
    struct Fields<'h> {
        kill: u32,
        holders: &'h [Holder],
        held_outside_bytes: u64,
    }
    let e = &case.evidence;
    // The biggest known holder; else one whose size is unknown.
    let biggest = e.holders_outside.iter().max_by_key(|h| (h.bytes.is_some(), h.bytes.unwrap_or(0)));
    let (pid, command, held) = biggest.map_or((0, "?", Some(e.held_outside_bytes)), |h| (h.pid, h.command.as_str(), h.bytes));
    let text = match held {
        // The MPS server holds its clients' memory: killing it takes every client down with it.
        Some(held) if super::is_mps_server(command) => format!(
            "pid {pid} is the MPS server, which holds {} for MPS clients other than this server: stop those clients (`nvidia-smi` lists each with its memory), or, if none should be running, restart MPS: `echo quit | nvidia-cuda-mps-control`. Then start the server again.",
            bytes(held)
        ),
        Some(held) => format!(
            "Stop pid {pid} (`{command}`), which holds {} outside this server: `kill {pid}`. Then start the server again.",
            bytes(held)
        ),
        None => format!(
            "Stop pid {pid} (`{command}`), which held the GPU's device files before recording began (NVML was unavailable, so how much it holds is unknown; `gputrace doctor` says more): `kill {pid}`. Then start the server again."
        ),
    };
    Said::new(Fields { kill: pid, holders: &e.holders_outside, held_outside_bytes: e.held_outside_bytes }, text)
}

/// Host memory ran out: more of it, or a smaller model (or reserve).
fn fix_host_oom(case: &Case) -> Said {
    let reserve = case.family.reserve().map(|(name, _)| format!(", or lower {name}")).unwrap_or_default();
    let pid = case.failure.pid;
    let text = format!(
        "The kernel's OOM killer killed pid {pid}: host memory ran out, not the GPU's (on unified-memory machines GPU memory is host RAM). Give it more host memory (the cgroup's limit), or load a smaller or quantized model{reserve}."
    );
    Said::new(json!({"killed_pid": pid}), text)
}

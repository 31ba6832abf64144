//! Which "CUDA out of memory" it was: the evidence in numbers and what to change, as typed facts
//! (the report words them).
//!
//! The symptom (a failed allocation, a server refusing at start, an OOM kill, a crash) is not the
//! cause. Causes are checked in the order a careful engineer would:
//! 1. held-by-other-process: memory held outside the failing service covers the shortfall;
//! 2. does-not-fit-at-load: it failed before the service served a request;
//! 3. kept-by-service: the service's level at rest rose request after request (see `kept`), the
//!    load in flight was no larger than loads it served, and what it kept covers the shortfall;
//! 4. long-request: one request in flight, or one far larger than the others, larger by a
//!    quarter than every one served before it (or none was seen served);
//! 5. concurrent-load: several in flight, one of which alone fits and not all together.
//!
//! Each category holds only where its preconditions hold on the figures its verdict prints
//! (`preconditions`, which the tests check every verdict with); otherwise the verdict is
//! inconclusive and names the one that failed. Besides: host-oom (the kernel's OOM killer),
//! none, and inconclusive (evidence missing or lost).
//! The evidence is typed ([`Evidence`]); each category's fix is its own function, which asks the
//! server's family ([`ServerFamily`]) what its settings are called.

use serde::Serialize;

use super::accounts::{Accounts, Holder};
use super::cost::Cost;
use super::holders::is_mps_server;
use super::kept::{self, Kept, KeptAllocations};
use super::proxy::{share, Front};
use super::server::{cache_bound, flag, ServerFamily, Setting};
use super::services::Service;
use super::{Category, Phase, Symptom};
use crate::abi::status;
use crate::event::Memory;
use crate::model::Request;
use preconditions::Unmet;

pub mod preconditions;

/// One failure judged: its category, where and when, what was seen and what to change.
#[derive(Clone, Debug, PartialEq)]
pub struct Diagnosis {
    pub category: Category,
    pub symptom: Symptom,
    /// Nanoseconds since the trace start.
    pub ts: Option<u64>,
    pub pid: Option<u32>,
    pub service: Option<String>,
    /// The GPU it happened on (as in the evidence), when one can be told.
    pub gpu: Option<u32>,
    /// The host has several GPUs: the GPU is worth naming.
    pub several_gpus: bool,
    pub finding: Finding,
}

/// What the diagnosis found.
#[derive(Clone, Debug, PartialEq)]
pub enum Finding {
    /// Nothing failed (where records were lost, one may be among them).
    NothingFailed { lost_records: u64 },
    /// No category can be told: why, and what was seen where the failing process is a traced
    /// service's.
    Undecided { lost_records: u64, why: Undecided, evidence: Option<Evidence> },
    /// A category: what was seen at the failure, and what to change.
    Judged { evidence: Evidence, fix: Fix },
}

/// What to change, per category, with the figures it is computed from.
#[derive(Clone, Debug, PartialEq)]
pub enum Fix {
    StopHolder(StopHolder),
    SmallerLoad(SmallerLoad),
    ShorterContext(ShorterContext),
    CapConcurrency(CapConcurrency),
    BoundKept(BoundKept),
    MoreHostMemory {
        killed_pid: u32,
        /// The engine's reserve flag, where it has one.
        reserve: Option<&'static str>,
    },
}

/// Why no category can be told.
#[derive(Clone, Debug, PartialEq)]
pub enum Undecided {
    /// The failing process belongs to no traced service.
    NoService,
    /// Kernel records were lost, so what else held memory is not known.
    RecordsLost(u64),
    /// A start-up exit with nothing the driver saw pointing at memory.
    NotMemory,
    /// No request was in flight.
    NoRequestInFlight,
    /// The category the failure's shape points at (its phase, the requests in flight) has a
    /// precondition its figures do not meet.
    Unmet { category: Category, unmet: Unmet },
}

/// held-by-other-process: stop the biggest holder outside the service.
#[derive(Clone, Debug, PartialEq)]
pub struct StopHolder {
    pub kill: u32,
    pub command: String,
    /// What it holds; None where NVML could not say.
    pub held: Option<u64>,
    /// It is the MPS server, which holds its clients' memory: killing it takes every client down.
    pub mps_server: bool,
    /// The next biggest holders that must go too, with what each holds, where it alone does not
    /// cover what the allocation lacked.
    pub also: Vec<(u32, u64)>,
}

impl StopHolder {
    /// What the holders it stops hold together; None where the first's size is unknown.
    pub fn together(&self) -> Option<u64> {
        self.held.map(|held| self.also.iter().map(|(_, b)| *b).fold(held, u64::saturating_add))
    }
}

/// does-not-fit-at-load: a smaller or quantized model, or a smaller reserve.
#[derive(Clone, Debug, PartialEq)]
pub struct SmallerLoad {
    /// What the failing GPU needed: what the service held and the allocation refused.
    pub load_bytes: u64,
    /// Parameters at FP16 over every GPU it is sharded on.
    pub parameters_fp16: f64,
    pub shortfall_bytes: u64,
    /// The GPUs the model is sharded over (at least 1).
    pub gpus: usize,
    /// The setting that shards it, and its value now, where the engine has one.
    pub sharding: Option<(Setting, String)>,
    pub reserve: Reserve,
}

/// A reserve smaller than the load's that may fit.
#[derive(Clone, Debug, PartialEq)]
pub enum Reserve {
    /// None to suggest.
    None,
    /// The engine reserves a fraction of the card and refused: lower it to what is free.
    Fraction { flag: &'static str, now: f64, to: f64 },
    /// The weights fit: a smaller context reserve may (its setting and value now).
    Context { setting: Setting, now: String },
}

/// long-request: a lower maximum context.
#[derive(Clone, Debug, PartialEq)]
pub struct ShorterContext {
    pub failed_request_bytes: u64,
    /// None where none was served before it since tracing began (met serving).
    pub largest_served_request_bytes: Option<u64>,
    /// The largest prompt that fits alone, in bytes received and tokens; the context to set
    /// (less the allocator's margin). None where no request's cost was measured.
    pub largest_fitting_request_bytes: Option<u64>,
    pub prompt_tokens: Option<u64>,
    pub context_tokens: Option<u64>,
    /// llama-server's slots that share the setting's value (1: it is one request's).
    pub context_slots: u64,
    /// The setting and its value now, where the engine has one.
    pub setting: Option<(Setting, String)>,
    /// No request was measured since tracing began: an estimate from what the failing one
    /// needed at least.
    pub estimate: Option<Cost>,
    /// By what smaller requests cost the failing one fits alone, yet it failed: its cost grows
    /// faster than its length, and no context is computed from that cost.
    pub grows_faster: bool,
}

/// kept-by-service: bound what the server keeps, or fix the leak; never a context or a
/// concurrency cap.
#[derive(Clone, Debug, PartialEq)]
pub struct BoundKept {
    pub kept_bytes: u64,
    pub requests: u64,
    pub per_request_bytes: u64,
    /// What a restart gives back now: what it kept, besides what it reloads.
    pub restart_frees_bytes: u64,
    /// The requests a fresh start serves before one fails again: as many as it served this time;
    /// for a service met serving, the room at the failure and what was kept since, over what a
    /// request keeps (None where free memory is unknown).
    pub requests_from_fresh_start: Option<u64>,
    /// A setting on the command line that bounds a cache, and its value: the one to lower.
    pub cache_setting: Option<(String, String)>,
}

/// concurrent-load: a concurrency cap from what one request costs.
#[derive(Clone, Debug, PartialEq)]
pub struct CapConcurrency {
    pub in_flight: u64,
    pub bytes_per_request: u64,
    pub per_request_measured_alone: bool,
    /// A batch's share, not one request measured alone, of a service that held memory before
    /// tracing began: what its allocator cached then counts as held, not as room, and is in no
    /// share, so the cap is an estimate.
    pub cap_estimated: bool,
    pub room_bytes: u64,
    pub max_concurrency: u64,
    /// The engine's concurrency setting, where it has one, and its value on the command line.
    pub setting: Option<Setting>,
    pub now: Option<String>,
    /// Each LiteLLM deployment's share of the cap, and the deployments in front.
    pub litellm_max_parallel_requests: u64,
    pub litellm_deployments: Vec<Front>,
}

/// What the diagnosis saw at the failure (the `evidence.fields` of the report's JSON). Figures
/// are for the GPU the failure happened on: every other GPU's memory is beside the point.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Evidence {
    /// The failing GPU (the RM device instance); None when it cannot be told (see [`gpu_of`]).
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
    /// What the service kept at rest over the requests it served (kept-by-service only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept: Option<KeptEvidence>,
}

/// What a service kept, as a kept-by-service verdict shows it. Times are nanoseconds since
/// the trace start.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct KeptEvidence {
    /// At rest right before the first request seen (right after it became ready, or after
    /// attaching), and after the last request that ended before the failure.
    pub ready_bytes: u64,
    pub ready_ts: u64,
    pub now_bytes: u64,
    pub now_ts: u64,
    /// Requests that ended in between.
    pub requests_served: u64,
    /// What the level rose by over the requests served with no load larger than before, those
    /// requests, and what each kept on average.
    pub kept_bytes: u64,
    pub kept_over_requests: u64,
    pub kept_per_request_bytes: u64,
    /// The same among the latest half of them.
    pub recent_per_request_bytes: u64,
    /// When the level first rose with no larger load.
    pub began_ts: Option<u64>,
    /// The most requests in flight together had received, served; and the failing load.
    pub largest_served_load_bytes: u64,
    pub failing_load_bytes: u64,
    pub allocations: KeptAllocations,
    /// The service ran before tracing began: the growth is since attaching.
    pub since_attaching: bool,
}

/// Every failure's diagnosis, and how many more there were.
pub struct Diagnoses {
    /// In time order; one of category `none` when nothing failed.
    pub list: Vec<Diagnosis>,
    /// Failures past [`MAX_DIAGNOSED`], not diagnosed one by one.
    pub not_diagnosed: usize,
}

impl Diagnoses {
    /// The first failure: its process, and the GPU it was judged on.
    pub fn first_failure(&self) -> Option<(u32, Option<u32>)> {
        self.list.first().filter(|d| d.category != Category::None).and_then(|d| Some((d.pid?, d.gpu)))
    }
}

struct Failure {
    ts: u64,
    pid: u32,
    symptom: Symptom,
    /// Bytes the failed allocation asked for.
    bytes: Option<u64>,
    /// The GPU the failed allocation was asked of; None for a death, which names no GPU.
    gpu: Option<u32>,
    /// A death's exit status.
    exit_code: Option<i32>,
}

/// One failure with everything a fix needs.
struct Failing<'c> {
    failure: &'c Failure,
    service: &'c Service,
    /// The engine's command line (the first process of the service with one) and its family.
    engine: &'c [String],
    family: ServerFamily,
    in_flight: Vec<&'c Request>,
    /// The largest request the service served (sent data) before the failure, since tracing began.
    largest_served: Option<u64>,
    /// What the service kept, where it keeps memory.
    kept: Option<Kept>,
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

/// Engines that do not say how much they reserve at start are judged as reserving this much.
const DEFAULT_RESERVE: f64 = 0.9;

/// Every failure, in time order; `none` when nothing failed. `lost`: kernel records lost.
pub fn diagnose(accounts: &Accounts, lost: u64) -> Diagnoses {
    let failures = failures(accounts);
    if failures.is_empty() {
        let category = if lost > 0 { Category::Inconclusive } else { Category::None };
        let nothing = Diagnosis {
            category,
            symptom: Symptom::None,
            ts: None,
            pid: None,
            service: None,
            gpu: None,
            several_gpus: accounts.header.gpus.len() > 1,
            finding: Finding::NothingFailed { lost_records: lost },
        };
        return Diagnoses { list: vec![nothing], not_diagnosed: 0 };
    }
    let list = failures.iter().take(MAX_DIAGNOSED).map(|f| diagnose_one(accounts, lost, f)).collect();
    Diagnoses { list, not_diagnosed: failures.len().saturating_sub(MAX_DIAGNOSED) }
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

/// The GPU a failure is judged on: the failed allocation's; for a death (which names none),
/// the service's only GPU, or of several the one with least room left at that moment.
fn gpu_of(accounts: &Accounts, failure: &Failure, service: &Service, service_gpus: &[u32]) -> Option<u32> {
    if failure.gpu.is_some() {
        return failure.gpu;
    }
    let gpus = &accounts.header.gpus;
    match service_gpus {
        [] => gpus.iter().find(|_| gpus.len() == 1).map(|c| c.index),
        [only] => Some(*only),
        several => {
            // One pass over the allocations for all of them, not two per GPU.
            let live = accounts.live_by_gpu(service, failure.ts);
            several.iter().copied().min_by_key(|&g| {
                let (mut own, mut outside) = live.get(&Some(g)).copied().unwrap_or_default();
                if accounts.counts_on(None, Some(g)) {
                    let (o, out) = live.get(&None).copied().unwrap_or_default();
                    (own, outside) = (own.saturating_add(o), outside.saturating_add(out));
                }
                let nvml = accounts.nvml_outside(service, failure.ts, Some(g));
                let held = nvml.iter().map(|(p, _)| p.used_bytes.unwrap_or(0)).fold(outside, u64::saturating_add);
                let own = own.saturating_add(accounts.before_tracing(service, failure.ts, Some(g)));
                accounts.capacity(Some(g)).map_or(u64::MAX, |c| c.saturating_sub(held.saturating_add(own)))
            })
        }
    }
}

fn failures(accounts: &Accounts) -> Vec<Failure> {
    let (model, services) = (accounts.model, &accounts.services);
    let mut failures: Vec<Failure> = model
        .failures
        .iter()
        .filter(|f| status::is_out_of_memory(f.status) && f.memory != Memory::Virtual)
        .map(|f| Failure {
            ts: f.ts,
            pid: f.pid,
            symptom: Symptom::FailedAllocation,
            bytes: Some(f.bytes),
            gpu: model.gpu_for(f.pid, f.gpu),
            exit_code: None,
        })
        .collect();
    for p in model.processes.values() {
        if let Some(ts) = p.oom_killed {
            failures.push(Failure { ts, pid: p.pid, symptom: Symptom::OomKill, bytes: None, gpu: None, exit_code: None });
        }
    }
    // A server that exited badly with no failure above: a refusal during load, or a crash. Only
    // one that had begun with the GPU: a command that never opened a device file (`false`,
    // a typo in its flags) failed for reasons that are not memory.
    // Each service's first failure and whether it touched a GPU, in one pass each (a scan per
    // service cost services times failures, allocations and files).
    let n = services.list.len();
    let (mut first_failure, mut touched_gpu) = (vec![u64::MAX; n], vec![false; n]);
    for f in &failures {
        if let Some(i) = services.index_of(f.pid) {
            first_failure[i] = first_failure[i].min(f.ts);
        }
    }
    let users = model.files.values().map(|f| f.opened_by).chain(model.allocations.iter().map(|a| a.pid));
    for i in users.filter_map(|pid| services.index_of(pid)) {
        touched_gpu[i] = true;
    }
    for (i, s) in services.list.iter().enumerate() {
        let root = &model.processes[&s.root];
        let (Some(code), Some(ts)) = (root.exit_code, root.exited) else { continue };
        let explained = first_failure[i] <= ts;
        if code == 0 || explained || !touched_gpu[i] {
            continue;
        }
        // SIGINT, SIGTERM and SIGKILL are a person's (the OOM killer's SIGKILL is recorded as
        // such, above): stopped, not crashed.
        let symptom = if code > 128 && ![130, 137, 143].contains(&code) {
            Symptom::Crash
        } else if services.phase(s, ts) == Phase::Load {
            Symptom::StartupRefusal
        } else {
            continue;
        };
        failures.push(Failure { ts, pid: s.root, symptom, bytes: None, gpu: None, exit_code: Some(code) });
    }
    failures.sort_by_key(|f| f.ts);
    failures
}

/// The case a failure makes: its service, engine, requests in flight and the figures.
fn case<'c>(accounts: &'c Accounts, failure: &'c Failure, service: &'c Service) -> Failing<'c> {
    let ts = failure.ts;
    // A death is judged by the state just before it: its exit ends its requests at once.
    let before = if failure.symptom == Symptom::FailedAllocation { ts } else { ts.saturating_sub(1) };
    let in_flight = accounts.services.in_flight(service, before);
    let service_gpus = accounts.gpus_of(service);
    let gpu = gpu_of(accounts, failure, service, &service_gpus);
    let held = accounts.held_outside(service, ts, gpu);
    let (holders, holders_not_listed) = biggest_holders(held.holders);
    let own = held.own.saturating_add(accounts.before_tracing(service, ts, gpu));
    // On unified memory the GPU's memory is the host's: its size and what is available.
    let host = accounts.unified(gpu).then(|| accounts.model.sample_at(ts).and_then(|s| s.host.clone())).flatten();
    let capacity = accounts.capacity(gpu).or(host.as_ref().map(|h| h.total_bytes));
    // What the driver's own accounting leaves; on unified memory no more than the host has
    // available either (MemAvailable also counts what the host itself uses).
    let left = capacity.map(|c| c.saturating_sub(held.outside.saturating_add(own)));
    let free = match &host {
        Some(h) => left.map(|l| l.min(h.available_bytes)),
        None => left,
    };
    let evidence = Evidence {
        gpu,
        gpu_name: accounts.card(gpu).map(|c| c.name.clone()),
        service_gpus,
        host_memory: host.is_some(),
        capacity_bytes: capacity,
        service_bytes: own,
        held_outside_bytes: held.outside,
        holders_outside: holders,
        holders_not_listed,
        free_bytes: free,
        failed_bytes: failure.bytes,
        phase: accounts.services.phase(service, before),
        requests_in_flight: in_flight.len(),
        request_bytes_received: in_flight.iter().map(|r| r.bytes_in).collect(),
        kept: None,
    };
    let engine = accounts.engine(service);
    let kept = (evidence.phase != Phase::Load).then(|| kept::measure(accounts, service, gpu, before)).flatten().filter(Kept::keeps);
    let served_before = |r: &&Request| service.has(r.pid) && r.first_data_at.is_some_and(|d| d < ts);
    let largest_served = accounts.model.requests.iter().filter(served_before).map(|r| r.bytes_in).max();
    Failing { failure, service, engine, family: ServerFamily::of(engine), in_flight, largest_served, kept, evidence }
}

fn diagnose_one(accounts: &Accounts, lost: u64, f: &Failure) -> Diagnosis {
    let judged = Diagnosis {
        category: Category::Inconclusive,
        symptom: f.symptom,
        ts: Some(f.ts.saturating_sub(accounts.start())),
        pid: Some(f.pid),
        service: accounts.services.of(f.pid).map(|s| s.name.clone()),
        gpu: f.gpu,
        several_gpus: accounts.header.gpus.len() > 1,
        finding: Finding::Undecided { lost_records: lost, why: Undecided::NoService, evidence: None },
    };
    let Some(service) = accounts.services.of(f.pid) else { return judged };
    let mut case = case(accounts, f, service);
    let category = match category(&case, lost) {
        Ok(category) => category,
        Err(why) => {
            let finding = Finding::Undecided { lost_records: lost, why, evidence: Some(case.evidence) };
            return Diagnosis { finding, ..judged };
        }
    };
    let kept = case.kept.take();
    let fix = match (category, kept) {
        (Category::HeldByOtherProcess, _) => fix_held(&case),
        (Category::DoesNotFitAtLoad, _) => fix_load(&case),
        (Category::KeptByService, Some(kept)) => fix_kept(accounts, &mut case, kept),
        (Category::LongRequest, _) => fix_long(accounts, &case),
        (Category::ConcurrentLoad, _) => fix_concurrent(accounts, &case),
        _ => Fix::MoreHostMemory { killed_pid: f.pid, reserve: case.family.reserve().map(|(name, _)| name) },
    };
    // The fix against its own figures: a context that would refuse what was served, a cap on a
    // load that all fitted, a holder that holds nothing are no fix.
    if let Err(unmet) = preconditions::fix_holds(&case.evidence, &fix) {
        let why = Undecided::Unmet { category, unmet };
        return Diagnosis { finding: Finding::Undecided { lost_records: lost, why, evidence: Some(case.evidence) }, ..judged };
    }
    Diagnosis { category, gpu: case.evidence.gpu, finding: Finding::Judged { evidence: case.evidence, fix }, ..judged }
}

/// The category, in the order the module's doc gives; why none can be told, otherwise.
fn category(case: &Failing, lost: u64) -> Result<Category, Undecided> {
    let n = case.in_flight.len();
    let (phase, asked, free) = (case.evidence.phase, case.failure.bytes, case.evidence.free_bytes);
    let unmet = |category, unmet| Undecided::Unmet { category, unmet };
    Ok(if case.failure.symptom == Symptom::OomKill {
        Category::HostOom
    } else if lost > 0 {
        return Err(Undecided::RecordsLost(lost));
    } else if held_by_other(case) {
        Category::HeldByOtherProcess
    } else if case.failure.symptom != Symptom::FailedAllocation
        && (phase == Phase::Load || faulted(case.failure.exit_code))
        && !memory_was_short(&case.evidence)
    {
        // A death with room free is no OOM: while loading (a refusal for another reason), or a
        // fault at any time (a segfault while serving; an abort may be an allocator's OOM).
        return Err(Undecided::NotMemory);
    } else if phase == Phase::Load {
        let fails = asked.filter(|_| case.failure.symptom == Symptom::FailedAllocation).map(|b| preconditions::load_exceeds(b, free));
        fails.unwrap_or(Ok(())).map_err(|u| unmet(Category::DoesNotFitAtLoad, u))?;
        Category::DoesNotFitAtLoad
    } else if kept_explains(case) {
        Category::KeptByService
    } else if let Some(culprit) = one_much_larger(&case.in_flight).or_else(|| case.in_flight.first().copied().filter(|_| n == 1)) {
        // A long request is longer than those served: one no larger failed for another reason.
        preconditions::larger_than_served(culprit.bytes_in, case.largest_served).map_err(|u| unmet(Category::LongRequest, u))?;
        Category::LongRequest
    } else if n > 1 {
        Category::ConcurrentLoad
    } else {
        return Err(Undecided::NoRequestInFlight);
    })
}

fn held_by_other(case: &Failing) -> bool {
    let (outside, free) = (case.evidence.held_outside_bytes, case.evidence.free_bytes);
    if preconditions::unknown_suspect(case.failure.symptom, &case.evidence) {
        return true;
    }
    if outside == 0 {
        return false;
    }
    match (case.failure.symptom, case.failure.bytes) {
        // Freeing what is held outside would have made room.
        (Symptom::FailedAllocation, Some(b)) => preconditions::outside_covers(b, free, outside).is_ok(),
        // A refusal at start: what others held exceeds what the engine leaves unused.
        (Symptom::StartupRefusal, _) => {
            let reserve = reserve_of(case);
            case.evidence.capacity_bytes.is_none_or(|c| outside as f64 >= c as f64 * (1.0 - reserve))
        }
        _ => false,
    }
}

/// Smaller model or quantization; a smaller reserve where the engine reserves up front and
/// refused, or a smaller context where the weights fit.
fn fix_load(case: &Failing) -> Fix {
    let (e, failed) = (&case.evidence, case.failure.bytes.unwrap_or(0));
    // What the failing GPU needed; a sharded (tensor-parallel) model needs as much on each.
    let wanted = e.service_bytes.saturating_add(failed);
    let gpus = e.service_gpus.len().max(1);
    let reserve = match (case.family.reserve(), case.family.context()) {
        // A smaller reserve helps only when the model itself fit: the engine refusing at start
        // (its budget exceeds what is free).
        (Some((flag, _)), _) if case.failure.symptom == Symptom::StartupRefusal => {
            let fits = e.capacity_bytes.zip(e.free_bytes).map(|(c, free)| (free as f64 / c as f64 * 100.0).floor() / 100.0);
            // Lower than now and above nothing, or no fraction helps (the service itself filled it).
            let now = reserve_of(case);
            fits.filter(|&to| to > 0.0 && to < now).map_or(Reserve::None, |to| Reserve::Fraction { flag, now, to })
        }
        // Or a failure after the weights were loaded: the context reserve is what did not fit.
        (None, Some((setting, names))) if case.failure.bytes.is_some_and(|b| e.service_bytes > b) => {
            Reserve::Context { setting, now: flag(case.engine, names).unwrap_or_else(|| "its default".into()) }
        }
        _ => Reserve::None,
    };
    let sharding = case.family.sharding().map(|(setting, names)| (setting, flag(case.engine, names).unwrap_or_else(|| gpus.to_string())));
    Fix::SmallerLoad(SmallerLoad {
        load_bytes: wanted,
        parameters_fp16: wanted as f64 * gpus as f64 / 2.0 / 1e9,
        shortfall_bytes: failed.saturating_sub(e.free_bytes.unwrap_or(0)),
        gpus,
        sharding,
        reserve,
    })
}

/// A lower maximum context: what the longest prompt that fits alone takes, from what a
/// request costs and the room for requests.
fn fix_long(accounts: &Accounts, case: &Failing) -> Fix {
    let culprit = one_much_larger(&case.in_flight).or_else(|| case.in_flight.first().copied());
    let failed_in = culprit.map(|r| r.bytes_in).unwrap_or(0);
    let served = case.largest_served;
    let room = room_for_requests(accounts, case);
    // Met serving, with no request measured since: the failing request, alone in flight, needed
    // at least what it grew the pool by and what it was refused: an estimate of its cost.
    let least = match (room.cost, culprit, case.failure.bytes, case.in_flight.len()) {
        (None, Some(r), Some(refused), 1) => {
            accounts.pool(case.service, case.evidence.gpu).least_need(r.arrived, case.failure.ts, refused, r.bytes_in)
        }
        _ => None,
    };
    let cost = room.cost.or(least);
    // By what smaller requests cost, this one fits, yet alone it failed: its cost grows faster
    // than its length (attention at long context), and that cost's figures are no guide. The
    // context to set is then below the failing prompt's, and no figure from the cost is given.
    let fits = cost.map(|c| c.fits(room.bytes)).filter(|&fits| fits < failed_in);
    let cost = cost.filter(|_| fits.is_some());
    let (prompt_tokens, context_tokens) = cost.map(|c| c.context(room.bytes)).unzip();
    let setting = case.family.context().map(|(setting, names)| (setting, flag(case.engine, names).unwrap_or_else(|| "its default".into())));
    Fix::ShorterContext(ShorterContext {
        failed_request_bytes: failed_in,
        largest_served_request_bytes: served,
        largest_fitting_request_bytes: fits,
        prompt_tokens,
        context_tokens,
        context_slots: case.family.context_slots(case.engine, None),
        setting,
        estimate: least.filter(|_| fits.is_some()),
        grows_faster: room.cost.or(least).is_some() && fits.is_none(),
    })
}

/// The room for requests at a failure: what was free on its GPU, plus the service's pool
/// (what it allocated while requests were in prefill, reused by the next ones); and what a
/// request costs, where measured.
struct RoomForRequests {
    bytes: u64,
    /// The service's pool within it.
    pool: u64,
    cost: Option<Cost>,
}

fn room_for_requests(accounts: &Accounts, case: &Failing) -> RoomForRequests {
    let pool = accounts.pool(case.service, case.evidence.gpu);
    let completions = accounts.services.completions(case.service);
    RoomForRequests {
        bytes: case.evidence.free_bytes.unwrap_or(0).saturating_add(pool.at(case.failure.ts)),
        pool: pool.at(case.failure.ts),
        cost: pool.cost(&completions),
    }
}

/// A concurrency cap computed from what one request costs (the largest in flight, by what a
/// byte received cost), else the batch's share.
fn fix_concurrent(accounts: &Accounts, case: &Failing) -> Fix {
    let room = room_for_requests(accounts, case);
    let n = case.in_flight.len().max(1) as u64;
    let largest = case.in_flight.iter().map(|r| r.bytes_in).max().unwrap_or(0);
    let batch_share = room.pool.saturating_add(case.failure.bytes.unwrap_or(0)) / n;
    let per_request = room.cost.map_or(batch_share, |c| c.of(largest)).max(1);
    let cap = (room.bytes / per_request).clamp(1, n.saturating_sub(1).max(1));
    let alone = room.cost.is_some_and(|c| c.alone);
    let fronts = accounts.fronting(case.service);
    Fix::CapConcurrency(CapConcurrency {
        in_flight: n,
        bytes_per_request: per_request,
        per_request_measured_alone: alone,
        cap_estimated: !alone && accounts.before_tracing(case.service, case.failure.ts, case.evidence.gpu) > 0,
        room_bytes: room.bytes,
        max_concurrency: cap,
        setting: case.family.concurrency().map(|(s, _)| s),
        now: case.family.concurrency().and_then(|(_, names)| flag(case.engine, names)),
        // Deployments in front count together, each worker of a proxy on its own: each gets a share.
        litellm_max_parallel_requests: share(&fronts, cap),
        litellm_deployments: fronts,
    })
}

/// A death by a fault, never an allocator's way to give up: SIGSEGV, SIGBUS, SIGILL, SIGFPE.
fn faulted(code: Option<i32>) -> bool {
    matches!(code, Some(139 | 135 | 132 | 136))
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

/// The fraction the engine reserves: its flag's value, or its default.
fn reserve_of(case: &Failing) -> f64 {
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

/// The load in flight, all its requests received together.
fn failing_load(case: &Failing) -> u64 {
    case.in_flight.iter().map(|r| r.bytes_in).fold(0, u64::saturating_add)
}

/// The service keeps memory, the load in flight was no larger than loads it served (an eighth
/// more at most: the same prompt in other words), and what it kept covers what the failed
/// allocation lacked.
fn kept_explains(case: &Failing) -> bool {
    let Some(kept) = &case.kept else { return false };
    let asked = case.failure.bytes.filter(|_| case.failure.symptom == Symptom::FailedAllocation);
    preconditions::kept_covers(failing_load(case), kept.largest_load_bytes, asked, case.evidence.free_bytes, kept.kept_bytes).is_ok()
}

/// What it kept, moved into the evidence; a restart's gain and what a fresh start serves.
fn fix_kept(accounts: &Accounts, case: &mut Failing, k: Kept) -> Fix {
    let failing_load = failing_load(case);
    let since = |ts: u64| ts.saturating_sub(accounts.start());
    let mut allocations = kept::allocations(accounts, case.service, &k);
    allocations.first.iter_mut().for_each(|a| a.ts = since(a.ts));
    let per_request = k.per_request().max(1);
    case.evidence.kept = Some(KeptEvidence {
        ready_bytes: k.ready.bytes,
        ready_ts: since(k.ready.ts),
        now_bytes: k.now.bytes,
        now_ts: since(k.now.ts),
        requests_served: k.now.served.saturating_sub(k.ready.served),
        kept_bytes: k.kept_bytes,
        kept_over_requests: k.requests,
        kept_per_request_bytes: k.per_request(),
        recent_per_request_bytes: k.recent_per_request(),
        began_ts: k.began_at.map(since),
        largest_served_load_bytes: k.largest_load_bytes,
        failing_load_bytes: failing_load,
        allocations,
        since_attaching: k.since_attaching,
    });
    Fix::BoundKept(BoundKept {
        kept_bytes: k.kept_bytes,
        requests: k.requests,
        per_request_bytes: k.per_request(),
        restart_frees_bytes: k.kept_bytes,
        requests_from_fresh_start: if k.since_attaching {
            // What it kept before tracing is not known: from what is free and kept since.
            case.evidence.free_bytes.map(|free| free.saturating_add(k.kept_bytes) / per_request)
        } else {
            Some(k.now.served.saturating_sub(k.ready.served))
        },
        cache_setting: cache_bound(case.engine),
    })
}

/// Stop the holders outside the service that make room: the biggest known one where it alone
/// covers what the allocation lacked, else as many of the biggest as cover it together; a holder
/// of unknown size (no NVML) where the known ones cannot.
fn fix_held(case: &Failing) -> Fix {
    let e = &case.evidence;
    let short = e.failed_bytes.map(|asked| asked.saturating_sub(e.free_bytes.unwrap_or(0)));
    let mut known: Vec<&Holder> = e.holders_outside.iter().filter(|h| h.bytes.is_some_and(|b| b > 0)).collect();
    // Of holders as big, the last found.
    known.reverse();
    known.sort_by_key(|h| std::cmp::Reverse(h.bytes));
    let unknown = e.holders_outside.iter().find(|h| h.bytes.is_none());
    let all_known = known.iter().map(|h| h.bytes.unwrap_or(0)).fold(0, u64::saturating_add);
    let chosen: Vec<&Holder> = match (short, unknown) {
        // What it lacked is not in the trace's account (it asked no more than was free by it), or
        // more than the known holders hold: the holder of unknown size is the one.
        (Some(short), Some(u)) if short == 0 || all_known < short => vec![u],
        (Some(short), _) if short > 0 => {
            let mut sum = 0u64;
            known
                .iter()
                .take_while(|h| {
                    let before = sum;
                    sum = sum.saturating_add(h.bytes.unwrap_or(0));
                    before < short
                })
                .copied()
                .collect()
        }
        _ => known.first().copied().or(unknown).into_iter().collect(),
    };
    let first = chosen.first();
    let (kill, command, held) = first.map_or((0, "?", Some(e.held_outside_bytes)), |h| (h.pid, h.command.as_str(), h.bytes));
    let also = chosen.iter().skip(1).map(|h| (h.pid, h.bytes.unwrap_or(0))).collect();
    Fix::StopHolder(StopHolder { kill, command: command.to_string(), held, mps_server: is_mps_server(command), also })
}

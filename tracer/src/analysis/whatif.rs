//! `gputrace whatif`: the recorded load and requests replayed under a changed setting, from the
//! trace's own measures, to say whether the OOM would have happened, at which request, with what
//! margin, and what it becomes.
//!
//! The service's memory on its GPU is taken apart as it was recorded: what it loaded (its weights,
//! and the KV cache it reserved: vLLM's and SGLang's fill a fraction of the card, found as the
//! largest run of identical blocks; llama.cpp's one buffer sized by the context, its second
//! largest), its pool for requests and what each request cost ([`super::cost`]), and what
//! everyone else held. A setting changes one part: quantization the weights, the utilization or
//! the context the KV cache, the card its size, a concurrency cap when queued requests start, a
//! context which requests are admitted. Then the requests are replayed in their recorded order
//! and durations, each costing what its size costs, against the room left.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use serde::Serialize;

use super::accounts::{Accounts, RoomOverTime};
use super::cost::Cost;
use super::server::{count, flag, ServerFamily};
use super::services::Service;
use super::{Category, Phase};
use crate::event::Memory;
use crate::model::Request;

/// The settings tried; None leaves the recorded one.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Settings {
    /// Requests served at once (`--max-num-seqs`, `-np`): later ones wait for a place.
    pub max_concurrency: Option<u64>,
    /// The longest prompt admitted, in tokens (`--max-model-len`, `-c`); for llama.cpp also the
    /// KV cache's size, which its slots share when `-np` is given (each admits its share).
    pub max_context: Option<u64>,
    /// vLLM's `--gpu-memory-utilization`, SGLang's `--mem-fraction-static`.
    pub utilization: Option<f64>,
    /// Weights at 8 or 4 bits a parameter instead of the recorded 16.
    pub quantize: Option<u32>,
    /// The card's size.
    pub capacity: Option<u64>,
    /// GPUs the model is sharded over (`--tensor-parallel-size`; llama-server's `--tensor-split`
    /// entries): each holds that share of the weights, and of what a request costs, and of a KV
    /// cache sized by the context; an engine that reserves a fraction of each card fills what
    /// its weights leave.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensor_parallel: Option<u64>,
}

/// Most GPUs a model is taken to be sharded over.
pub const MAX_TENSOR_PARALLEL: u64 = 1024;

/// What the replay found.
#[derive(Clone, Debug, Serialize)]
pub struct Outcome {
    pub service: String,
    pub gpu: Option<u32>,
    pub settings: Settings,
    /// `none`, or the category the failure would be.
    pub category: Category,
    /// The request it would fail at (its number among the service's requests, from 1, and its
    /// size), and when it arrived (since the trace began); none at load.
    pub failing_request: Option<usize>,
    pub failing_request_bytes: Option<u64>,
    pub failing_ts: Option<u64>,
    /// The least room left over the replay; negative: short by that much.
    pub margin_bytes: i64,
    /// The GPU's traced peak the replay predicts.
    pub peak_bytes: u64,
    /// Requests past the context, refused cleanly.
    pub refused: usize,
    /// The load as recorded and as the settings make it: weights and KV cache. Where the
    /// recorded load failed, what it would have loaded after is unknown (unless the engine
    /// reserves a fraction of the card, which it fills): the figures, and the peak, are then at
    /// least.
    pub load_complete: bool,
    /// The weights are at least these (the load failed before they were all in): a verdict
    /// that they fit may not hold.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub weights_at_least: bool,
    pub weights_bytes: u64,
    pub kv_bytes: u64,
    pub weights_after_bytes: u64,
    pub kv_after_bytes: u64,
    /// A context was tried, and the recorded command line does not say its own (these flags;
    /// llama-server's default is the model's): the KV cache is replayed as recorded, which a
    /// lower context only shrinks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_unscaled: Option<&'static [&'static str]>,
    /// With `--search`: the largest concurrency, of the largest request served, and the
    /// context to set (in tokens, with the fix's margin) that fit under the settings.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub search: Option<Search>,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct Search {
    pub max_concurrency: u64,
    /// One request's; llama-server's `-c` is that times the slots that share it.
    pub max_context_tokens: u64,
    pub context_slots: u64,
}

/// Why a replay cannot be made of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WhyNot {
    /// No service served a request with its cost measured.
    NothingToReplay,
    /// The GPU's size is not in the trace (no NVML) and was not given.
    CapacityUnknown,
    /// The failure was memory the server kept request after request: a replay of the requests
    /// under other settings says nothing of what it keeps.
    KeptByService,
}

/// The failure a replay is made of: its process and the GPU it was judged on.
#[derive(Clone, Copy, Debug)]
pub struct Failed {
    pub pid: u32,
    pub gpu: Option<u32>,
}

/// A recorded request as the replay sees it.
struct Replayed {
    index: usize,
    arrived: u64,
    bytes: u64,
    /// How long its prefill took, and its whole life, as recorded (or the longest recorded, for
    /// one that failed before either ended).
    prefill: u64,
    life: u64,
}

/// The replay under `settings` of the service that `failed` (the busiest serving one when
/// nothing did), on the GPU it failed on.
pub fn whatif(accounts: &Accounts, failed: Option<Failed>, settings: &Settings, search: bool) -> Result<Outcome, WhyNot> {
    let services = &accounts.services;
    let service = match failed.and_then(|f| services.of(f.pid)) {
        Some(s) => s,
        None => {
            let serving = |s: &&Service| services.completions(s).len();
            services.list.iter().max_by_key(serving).filter(|s| serving(s) > 0).ok_or(WhyNot::NothingToReplay)?
        }
    };
    let gpu = failed.and_then(|f| f.gpu).or_else(|| accounts.gpus_of(service).first().copied());
    replay(accounts, service, gpu, settings, search)
}

/// The service's load and requests replayed under `settings` on `gpu`.
fn replay(accounts: &Accounts, service: &Service, gpu: Option<u32>, settings: &Settings, search: bool) -> Result<Outcome, WhyNot> {
    let capacity = accounts.capacity(gpu).ok_or(WhyNot::CapacityUnknown)?;
    let engine = accounts.engine(service);
    let family = ServerFamily::of(engine);
    // Sharded over more (or fewer) GPUs, each holds that much less (more) of what one held.
    let recorded_shards = shards(engine, family, accounts.gpus_of(service).len() as u64);
    let shard = |b: u64| {
        let sharded = |n: u64| u64::try_from(b as u128 * recorded_shards as u128 / n.max(1) as u128).unwrap_or(u64::MAX);
        settings.tensor_parallel.map_or(b, sharded)
    };
    let LoadParts { weights, kv, weights_known, failed } = load_parts(accounts, service, gpu, family);
    // An engine that reserves a fraction of the card loads that much, whatever its weights
    // (which, where its load failed before they were in, are at least those: whether they
    // fit is then not known for sure).
    let load_complete = weights_known || family.reserve().is_some();
    let new_capacity = settings.capacity.unwrap_or(capacity);
    let weights_after = shard(settings.quantize.map_or(weights, |q| weights / 16 * u64::from(q.clamp(1, 16))));
    let recorded_util = family.reserve().map(|(name, default)| flag(engine, &[name]).and_then(|v| v.parse().ok()).unwrap_or(default));
    let (kv_after, kv_unscaled) =
        kv_after(engine, family, settings, recorded_util, Load { weights, kv, weights_after, failed }, (capacity, new_capacity));
    // A KV cache sized by the context is split over the shards too; a reserved one fills the
    // budget, which is each card's.
    let kv_after = if recorded_util.is_some() { kv_after } else { shard(kv_after) };
    let mut outcome = Outcome {
        service: service.name.clone(),
        gpu,
        settings: settings.clone(),
        category: Category::None,
        failing_request: None,
        failing_request_bytes: None,
        failing_ts: None,
        margin_bytes: 0,
        peak_bytes: 0,
        refused: 0,
        load_complete,
        weights_at_least: !weights_known,
        weights_bytes: weights,
        kv_bytes: kv,
        weights_after_bytes: weights_after,
        kv_after_bytes: kv_after,
        kv_unscaled,
        search: None,
    };
    // The load: what others held when it began, and the new load on the new card.
    let others_at_start = accounts.held_outside(service, service.first_ts, gpu).outside;
    let needed_at_load = match recorded_util {
        Some(_) => (settings.utilization.or(recorded_util).unwrap_or(0.9) * new_capacity as f64) as u64,
        None => weights_after.saturating_add(kv_after),
    };
    let load_left = new_capacity as i128 - others_at_start as i128 - needed_at_load as i128;
    // An engine that reserves a budget needs its weights to leave room for a KV cache in it.
    let kv_room = if recorded_util.is_some() { needed_at_load as i128 - weights_after as i128 } else { i128::MAX };
    if load_left < 0 || kv_room <= 0 {
        outcome.category = if load_left < 0 && others_at_start > 0 && (needed_at_load as i128) <= new_capacity as i128 {
            Category::HeldByOtherProcess
        } else {
            Category::DoesNotFitAtLoad
        };
        outcome.margin_bytes = load_left.min(kv_room).clamp(i64::MIN as i128, 0) as i64;
        return Ok(outcome);
    }
    // What loading left, then what each request leaves.
    outcome.margin_bytes = load_left.min(i64::MAX as i128) as i64;
    let requests = accounts.services.completions(service);
    let pool = accounts.pool(service, gpu);
    let per_byte = recorded_shards as f64 / settings.tensor_parallel.unwrap_or(recorded_shards).max(1) as f64;
    let Some(cost) = pool.cost(&requests).map(|c| Cost { per_byte: c.per_byte * per_byte, ..c }) else {
        // Nothing to replay: it loads; the peak is the load.
        outcome.peak_bytes = others_at_start.saturating_add(needed_at_load);
        return Ok(outcome);
    };
    let room = accounts.room_over_time(service, gpu, pool).ok_or(WhyNot::CapacityUnknown)?;
    // Room for requests changes by what the load gives back, and the card's growth.
    let load_change = weights_after as i128 + kv_after as i128 - weights as i128 - kv as i128;
    let serving = Serving { requests: &requests, cost, room, shift: new_capacity as i128 - capacity as i128 - load_change, load_change };
    serve(accounts, &serving, engine, family, settings, search, &mut outcome);
    Ok(outcome)
}

/// What the requests are replayed against: the room for them as recorded, shifted by what the
/// changed load and card give or take, and what each costs.
struct Serving<'s, 'a> {
    requests: &'s [&'a Request],
    cost: Cost,
    room: RoomOverTime<'s, 'a>,
    /// Room gained (lost) for requests: the card's growth less what the load grew by.
    shift: i128,
    load_change: i128,
}

/// The requests replayed in their recorded order under the settings: into `outcome`, the first
/// to find no room, the margin, the refused, the peak and, with `search`, what fits.
fn serve(
    accounts: &Accounts,
    s: &Serving,
    engine: &[String],
    family: ServerFamily,
    settings: &Settings,
    search: bool,
    outcome: &mut Outcome,
) {
    let start = accounts.start();
    let cost = &s.cost;
    let replayed = replayed(s.requests);
    let slots = family.context_slots(engine, settings.max_concurrency);
    let admits = request_context(engine, family, settings, slots);
    let admitted: Vec<&Replayed> = replayed.iter().filter(|r| admits.is_none_or(|l| cost.tokens(r.bytes) <= l)).collect();
    outcome.refused = replayed.len() - admitted.len();
    let starts = schedule(&admitted, settings.max_concurrency);
    let room = |ts: u64| s.room.room(ts) as i128 + s.shift;
    let high_water = replay_requests(&admitted, &starts, cost, room, start, outcome);
    // The GPU's peak while it served, its pool replaced by the replay's and its load by the
    // new one.
    let (from, until) = (starts.first().copied().unwrap_or(start), accounts.model.last_ts);
    let (all, pool) = (&s.room.all, &s.room.pool);
    let held = all.steps().filter(|(t, _)| (from..=until).contains(t)).map(|(t, all)| all.saturating_sub(pool.at(t)));
    let held = held.chain(std::iter::once(all.at(from).saturating_sub(pool.at(from)))).max().unwrap_or(0);
    outcome.peak_bytes = (held as i128 + s.load_change + high_water as i128).max(0) as u64;
    if search {
        // Of the largest request served (one that failed says nothing of what is served).
        let tightest = starts.iter().map(|s| room(*s)).min().unwrap_or(0).max(0) as u64;
        let largest = s.requests.iter().filter(|r| r.first_data_at.is_some()).map(|r| r.bytes_in).max().unwrap_or(0);
        outcome.search = Some(Search {
            max_concurrency: tightest / cost.of(largest).max(1),
            max_context_tokens: cost.context(tightest).1,
            context_slots: slots,
        });
    }
}

/// The GPUs the recorded command line shards the model over: its count; llama-server's
/// `--tensor-split 3,1` (or `3/1`), a proportion per GPU, those above 0; without one, llama-server
/// splits over every GPU it sees: `gpus`, those the service allocated on. 1 where unknown.
pub(super) fn shards(engine: &[String], family: ServerFamily, gpus: u64) -> u64 {
    let Some((_, names)) = family.sharding() else { return 1 };
    let n = match (flag(engine, names), family) {
        (Some(split), ServerFamily::LlamaCpp) => {
            split.split([',', '/']).filter(|p| p.trim().parse::<f64>().is_ok_and(|v| v > 0.0)).count() as u64
        }
        (None, ServerFamily::LlamaCpp) => gpus,
        (Some(value), _) => count(&value).unwrap_or(1),
        (None, _) => 1,
    };
    n.clamp(1, MAX_TENSOR_PARALLEL)
}

/// The longest prompt one request is admitted with under the settings, in tokens: the context
/// tried, or where only the slots that split it change (`-np`), the recorded one; a slot's
/// share of it.
/// None: as recorded (what was refused then is not in the trace's completions).
fn request_context(engine: &[String], family: ServerFamily, settings: &Settings, slots: u64) -> Option<u64> {
    // `-c 0` is the model's own context: not known here.
    let recorded = || family.context().and_then(|(_, names)| flag(engine, names)).and_then(|v| count(&v)).filter(|&c| c > 0);
    let context = settings.max_context.or_else(|| recorded().filter(|_| slots > 1 && settings.max_concurrency.is_some()))?;
    Some(context / slots.max(1))
}

/// What the service loads, as recorded and with its weights after the change.
struct Load {
    weights: u64,
    kv: u64,
    weights_after: u64,
    /// The recorded load failed: its KV cache, if any, was not all in.
    failed: bool,
}

/// The KV cache under the changed settings, from the recorded one; where a context was tried
/// and the recorded one is not on the command line, as recorded, and the flags that say it.
fn kv_after(
    engine: &[String],
    family: ServerFamily,
    settings: &Settings,
    recorded_util: Option<f64>,
    load: Load,
    (capacity, new_capacity): (u64, u64),
) -> (u64, Option<&'static [&'static str]>) {
    let Load { weights, kv, weights_after, failed } = load;
    let kv_after = match (recorded_util, family.context()) {
        // An engine that reserves a fraction of the card fills it: the KV cache takes what the
        // weights leave of the new budget.
        (Some(util), _) => {
            let budget = |u: f64, c: u64| (u * c as f64) as i128;
            let new_budget = budget(settings.utilization.unwrap_or(util), new_capacity);
            // A load that failed had not all of it: what the weights leave of the budget; else
            // the recorded one, moved by what the budget and the weights moved.
            let after = match failed {
                true => new_budget - weights_after as i128,
                false => new_budget - budget(util, capacity) + kv as i128 + weights as i128 - weights_after as i128,
            };
            after.max(0) as u64
        }
        // One sized by the context: in proportion to it.
        (None, Some((_, names))) => match (settings.max_context, flag(engine, names).and_then(|v| count(&v))) {
            (Some(new), Some(now)) if now > 0 => (kv as f64 * new as f64 / now as f64) as u64,
            (Some(_), _) => return (kv, Some(names)),
            _ => kv,
        },
        _ => kv,
    };
    (kv_after, None)
}

/// The admitted requests replayed from their starts against the room at each (starts never go
/// back): each in prefill costs what its size costs. Into `outcome`, the tightest margin and, of
/// a burst, the first request to find no room. The high-water mark of what those in prefill
/// needed.
fn replay_requests(
    admitted: &[&Replayed],
    starts: &[u64],
    cost: &Cost,
    room: impl Fn(u64) -> i128,
    start: u64,
    outcome: &mut Outcome,
) -> u64 {
    let mut high_water = 0u64;
    // What is in prefill with each, of those started before it (starts never go back): each
    // costs what its size costs. Of a burst, the first to find no room is the one named.
    let mut prefilling: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
    let mut need = 0u64;
    for (r, begins) in admitted.iter().zip(starts) {
        while let Some(Reverse((_, costs))) = prefilling.peek().copied().filter(|Reverse((ends, _))| ends <= begins) {
            prefilling.pop();
            need = need.saturating_sub(costs);
        }
        prefilling.push(Reverse((begins.saturating_add(r.prefill), cost.of(r.bytes))));
        need = need.saturating_add(cost.of(r.bytes));
        high_water = high_water.max(need);
        let left = room(*begins) - need as i128;
        outcome.margin_bytes = outcome.margin_bytes.min(left.clamp(i64::MIN as i128, i64::MAX as i128) as i64);
        if left < 0 {
            let alone = room(*begins) < cost.of(r.bytes) as i128;
            outcome.category = if alone { Category::LongRequest } else { Category::ConcurrentLoad };
            outcome.failing_request = Some(r.index);
            outcome.failing_request_bytes = Some(r.bytes);
            outcome.failing_ts = Some(begins.saturating_sub(start));
            break;
        }
    }
    high_water
}

/// What the service loaded on `gpu`, live when it began serving (or when it failed): its
/// KV cache (an engine that reserves a fraction of the card: the largest run of four or more
/// identical blocks; llama.cpp: its second largest buffer, after the model's) and the rest,
/// counted as weights with what a failed load still asked for.
fn load_parts(accounts: &Accounts, service: &Service, gpu: Option<u32>, family: ServerFamily) -> LoadParts {
    let (model, services) = (accounts.model, &accounts.services);
    let failed_at_load = model.failures.iter().find(|f| service.has(f.pid) && services.phase(service, f.ts) == Phase::Load);
    let moment = service.ready_at.or(failed_at_load.map(|f| f.ts)).unwrap_or(model.last_ts);
    let mut sizes: Vec<u64> = model
        .allocations
        .iter()
        .filter(|a| a.memory == Memory::Video && service.has(a.pid) && accounts.counts_on(model.gpu_for(a.pid, a.gpu), gpu))
        .filter(|a| a.ts <= moment && a.freed.is_none_or(|(f, _)| f > moment) && services.phase(service, a.ts) == Phase::Load)
        .map(|a| a.bytes)
        .collect();
    let first = sizes.first().copied();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    let failed = failed_at_load.is_some();
    let live = sizes.iter().copied().fold(0, u64::saturating_add);
    let total = live.saturating_add(failed_at_load.map_or(0, |f| f.bytes));
    if family.reserve().is_some() {
        let runs = sizes.chunk_by(|a, b| a == b).filter(|run| run.len() >= 4);
        let run = runs.max_by_key(|run| run[0].saturating_mul(run.len() as u64));
        // The KV cache comes once the weights are in. A load that failed while a run of the
        // size its first allocation had was coming in was loading weights in chunks of one
        // size: no KV cache yet, and the weights at least what was asked.
        return match run {
            Some(run) if !failed || Some(run[0]) != first => {
                let kv = run[0].saturating_mul(run.len() as u64);
                // A failure within the KV cache: the weights were all in.
                LoadParts { weights: live.saturating_sub(kv), kv, weights_known: true, failed }
            }
            _ => LoadParts { weights: total, kv: 0, weights_known: !failed, failed },
        };
    }
    let kv = if family == ServerFamily::LlamaCpp { sizes.get(1).copied().unwrap_or(0) } else { 0 };
    LoadParts { weights: total.saturating_sub(kv), kv, weights_known: !failed, failed }
}

/// A service's load, split: its weights (at least, where not `weights_known`) and KV cache;
/// `failed`: the load failed before it was all in.
struct LoadParts {
    weights: u64,
    kv: u64,
    weights_known: bool,
    failed: bool,
}

/// The service's requests in arrival order, with their recorded durations.
fn replayed(requests: &[&Request]) -> Vec<Replayed> {
    let mut sorted: Vec<&Request> = requests.to_vec();
    sorted.sort_by_key(|r| r.arrived);
    let longest_prefill = sorted.iter().filter_map(|r| Some(r.first_data_at?.saturating_sub(r.arrived))).max().unwrap_or(0);
    let longest_life = sorted.iter().filter_map(|r| Some(r.ended?.saturating_sub(r.arrived))).max().unwrap_or(longest_prefill);
    sorted
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let prefill = r.first_data_at.map_or(longest_prefill, |d| d.saturating_sub(r.arrived)).max(1);
            Replayed {
                index: i + 1,
                arrived: r.arrived,
                bytes: r.bytes_in,
                prefill,
                life: r.ended.map_or(longest_life, |e| e.saturating_sub(r.arrived)).max(prefill),
            }
        })
        .collect()
}

/// When each request starts: at its arrival, or, under a cap, once one of the places is free
/// (first come, first served).
fn schedule(requests: &[&Replayed], cap: Option<u64>) -> Vec<u64> {
    // More places than requests is no cap.
    let Some(cap) = cap.map(|c| c.max(1)).filter(|&c| c < requests.len() as u64).map(|c| c as usize) else {
        return requests.iter().map(|r| r.arrived).collect();
    };
    // When each place frees, the soonest first.
    let mut places: BinaryHeap<Reverse<u64>> = BinaryHeap::with_capacity(cap);
    requests
        .iter()
        .map(|r| {
            let begins = if places.len() < cap { r.arrived } else { places.pop().map_or(r.arrived, |Reverse(free)| free.max(r.arrived)) };
            places.push(Reverse(begins.saturating_add(r.life)));
            begins
        })
        .collect()
}

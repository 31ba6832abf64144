//! Headroom: how many more requests a serving service takes before an allocation fails, and
//! whether its own limits let in more than that. The early form of the long-request and
//! concurrent-load fixes, before the failure.
//!
//! What a request costs is measured from the service's own memory. What its processes allocate
//! while requests are in prefill (activations, a caching allocator's pool, llama.cpp's compute
//! buffers) grows only past its high-water mark and is reused after, so the cost of a byte
//! received is that mark over what the requests in prefill had received when it was reached. The
//! room for requests at a moment is what is free on the GPU (the card less what this service
//! holds and what everyone else does) plus that pool; headroom is how many requests of the
//! largest size served fit in it.

use std::collections::{BTreeMap, HashSet};

use serde::Serialize;

use super::diagnosis::Diagnoser;
use super::proxy::Front;
use super::server::{count, flag_named, ServerFamily};
use super::sweep::{in_time_order, merged, LiveChanges};
use super::{is_completion, Phase, Service};
use crate::event::Memory;
use crate::model::{Allocation, Request};
use crate::units::bytes;

/// Per service and GPU, what requests cost and how many more fit.
#[derive(Clone, Debug, Serialize)]
pub struct Headroom {
    pub service: String,
    /// The service's root process.
    pub pid: u32,
    pub gpu: Option<u32>,
    /// The measure: the high-water mark of the memory allocated during prefill, the bytes the
    /// requests in prefill had received when it was reached, and whether one request was alone
    /// in prefill then (else the batch's share).
    pub measured_pool_bytes: u64,
    pub measured_request_bytes: u64,
    pub measured_alone: bool,
    /// The largest request served (sent its first data; before any was, received), and its
    /// cost by that measure.
    pub largest_request_bytes: u64,
    pub request_cost_bytes: u64,
    /// At the end of the trace (a watch: now), while every process of the service that
    /// allocated still runs.
    pub now: Option<Moment>,
    /// While it served, when the fewest more requests would have fit.
    pub tightest: Moment,
    /// The server's own limits that let in more than memory takes (now, or at the tightest).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub limits_exceeded: Vec<Limit>,
}

/// Headroom at one moment.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct Moment {
    /// Since the trace began.
    pub ts: u64,
    /// Free on the GPU, plus what the service reuses for requests.
    pub room_bytes: u64,
    pub in_flight: usize,
    /// Requests of the largest size served that fit at once, those in flight included.
    pub fit_at_once: u64,
    /// How many more of them fit beside those in flight.
    pub more_requests: u64,
    /// The largest request that fits with nothing else in flight, in bytes received.
    pub largest_fitting_request_bytes: u64,
}

/// A server's limit that lets in more than memory takes.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Limit {
    /// As the server's command line names it: `--max-num-seqs`, `-np`, `--max-model-len`.
    pub setting: String,
    pub value: u64,
    pub bounds: Bound,
    /// What memory takes, in the limit's unit: requests of the largest size served at once, or
    /// prompt tokens (at [`BYTES_PER_TOKEN`]) alone or in one batch.
    pub fits: u64,
    /// The value to set: what fits, less the allocator's margin for tokens (times the slots).
    pub cap: u64,
    /// llama-server's slots that share a context's value: each request has `value / slots`.
    pub slots: u64,
    /// Set in the configs of the LiteLLM deployments in front of the server (the value is what
    /// they let through together), not on its command line.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub proxies: Vec<Front>,
}

/// What a server's limit bounds.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Bound {
    /// Requests served at once (`--max-num-seqs`, `-np`).
    Concurrency,
    /// One request's context, in tokens (`--max-model-len`, `-c`).
    Context,
    /// The tokens of one batch, every request's together (`--max-num-batched-tokens`).
    BatchTokens,
}

impl Limit {
    /// What it lets in, in the unit of `fits`: a slot's share of a shared context.
    pub fn lets_in(&self) -> u64 {
        self.value / self.slots.max(1)
    }

    /// What it lets in against what memory takes, and the value to set.
    pub fn text(&self) -> String {
        let (setting, value, fits, cap) = (&self.setting, self.value, self.fits, self.cap);
        let slots = self.slots;
        match self.bounds {
            Bound::Concurrency if !self.proxies.is_empty() => {
                let fronts = &self.proxies;
                let each: Vec<String> = fronts
                    .iter()
                    .map(|f| {
                        let workers = if f.workers > 1 { format!(" in each of {} workers", f.workers) } else { String::new() };
                        format!("{} ({} by its `{}`{workers}, on port {})", f.name(), f.max_parallel_requests.unwrap_or(0), f.limit_from, f.port)
                    })
                    .collect();
                let (verb, place) = if fronts.len() > 1 { ("let", "in each") } else { ("lets", "there") };
                let counts = if fronts.iter().any(|f| f.workers > 1) { " (each worker keeps its own count)" } else { "" };
                format!(
                    "{} {verb} {value} requests at once through to it; memory fits {fits} of the largest served: set `max_parallel_requests: {}` {place}{counts}{}",
                    each.join(" and "),
                    super::proxy::share(fronts, cap),
                    super::proxy::past_any_share(fronts, cap)
                )
            }
            Bound::Concurrency => format!("`{setting} {value}` lets {value} run at once; memory fits {fits} of the largest served: cap at {cap}"),
            Bound::Context if slots > 1 => format!(
                "`{setting} {value}` lets each of its {slots} slots take a prompt of {} tokens; memory fits one of {fits} alone (at {BYTES_PER_TOKEN} bytes a token): set it to {cap}",
                self.lets_in()
            ),
            Bound::Context => format!(
                "`{setting} {value}` lets in a prompt of {value} tokens; memory fits one of {fits} alone (at {BYTES_PER_TOKEN} bytes a token): set it to {cap}"
            ),
            Bound::BatchTokens => format!(
                "`{setting} {value}` lets {value} tokens into one batch; memory fits {fits} at once (at {BYTES_PER_TOKEN} bytes a token): set it to {cap}"
            ),
        }
    }
}

impl Headroom {
    /// One line: what a request costs, how many more fit now, and when it was tightest.
    pub fn text(&self) -> String {
        let gpu = self.gpu.map(|g| format!(" on GPU {g}")).unwrap_or_default();
        let size = bytes(self.largest_request_bytes);
        let how = if self.measured_alone { "measured alone" } else { "the batch's share" };
        let mut line =
            format!("`{}`{gpu}: a request of {size} (the largest served) costs {} ({how})", self.service, bytes(self.request_cost_bytes));
        let at = |m: &Moment| {
            format!(
                "{} fit at once in {} of room, {} more beside the {} in flight; the largest request that fits alone is {}",
                m.fit_at_once,
                bytes(m.room_bytes),
                m.more_requests,
                m.in_flight,
                bytes(m.largest_fitting_request_bytes)
            )
        };
        if let Some(now) = &self.now {
            line += &format!("; now {}", at(now));
        }
        if self.now.as_ref() != Some(&self.tightest) {
            line += &format!("; at its tightest, at {:.2} s, {}", self.tightest.ts as f64 / 1e9, at(&self.tightest));
        }
        for l in &self.limits_exceeded {
            line += &format!(". {}", l.text());
        }
        line
    }
}

/// Video memory live over time for the allocations kept: (time, live from then on).
pub(super) struct Live(Vec<(u64, u64)>);

impl Live {
    fn of<'m>(allocations: impl Iterator<Item = &'m Allocation> + Clone + 'm) -> Live {
        let mut steps: Vec<(u64, u64)> = Vec::new();
        let mut live = 0i128;
        for (ts, delta, ()) in LiveChanges::of(allocations.map(|a| (a, ()))) {
            live += delta;
            let now = live.clamp(0, u64::MAX as i128) as u64;
            match steps.last_mut() {
                Some(last) if last.0 == ts => last.1 = now,
                _ => steps.push((ts, now)),
            }
        }
        Live(steps)
    }

    pub(super) fn at(&self, ts: u64) -> u64 {
        match self.0.partition_point(|(t, _)| *t <= ts) {
            0 => 0,
            i => self.0[i - 1].1,
        }
    }

    /// Each time it changes, and what is live from then on.
    pub(super) fn steps(&self) -> impl Iterator<Item = (u64, u64)> + Clone + '_ {
        self.0.iter().copied()
    }
}

/// Serving services whose headroom is computed, the busiest first (a host's few servers; a
/// crafted trace of thousands costs no more than this many).
const MAX_SERVICES: usize = 64;

/// How many of the pool's highest marks are tried for one with a request alone in prefill.
const MARKS_TRIED: usize = 16;

/// A service's pool on one GPU: its video memory allocated while it had requests in prefill
/// (activations, a caching allocator's blocks, compute buffers), reused by later requests.
pub(super) struct Pool<'m> {
    allocations: Vec<&'m Allocation>,
    live: Live,
}

/// What a request costs: the pool's high-water mark over what the requests in prefill had
/// received when it was reached. Where requests of two sizes were each measured alone, the
/// line through both: a request's bytes include a part that is no prompt (its headers, the
/// JSON around the prompt, a chat template), which costs nothing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Cost {
    pub per_byte: f64,
    /// Bytes of a request that cost nothing.
    pub overhead_bytes: u64,
    pub pool_bytes: u64,
    pub received: u64,
    /// One request was alone in prefill at that mark (else the batch's share).
    pub alone: bool,
}

impl Cost {
    /// What a request of `bytes` received costs.
    pub(super) fn of(&self, bytes: u64) -> u64 {
        (bytes.saturating_sub(self.overhead_bytes) as f64 * self.per_byte) as u64
    }

    /// The largest request, in bytes received, that `room` takes.
    pub(super) fn fits(&self, room: u64) -> u64 {
        ((room as f64 / self.per_byte) as u64).saturating_add(self.overhead_bytes)
    }

    /// The longest prompt `room` takes, in tokens at [`BYTES_PER_TOKEN`], and the context to
    /// set for it: less [`CONTEXT_MARGIN`].
    pub(super) fn context(&self, room: u64) -> (u64, u64) {
        let prompt = (room as f64 / self.per_byte) as u64 / BYTES_PER_TOKEN;
        (prompt, (prompt as f64 * CONTEXT_MARGIN) as u64)
    }

    /// A request's prompt tokens, from its bytes: what is no prompt left out.
    pub(super) fn tokens(&self, bytes: u64) -> u64 {
        bytes.saturating_sub(self.overhead_bytes) / BYTES_PER_TOKEN
    }
}

/// Bytes of a request per prompt token, to turn what fits into a context length: about four
/// characters a token for English text with the tokenizers of current models.
pub const BYTES_PER_TOKEN: u64 = 4;

/// Of the longest prompt that fits, the context suggested: allocators round each block up, so
/// a prompt right at the edge may not fit.
const CONTEXT_MARGIN: f64 = 0.97;

/// Two sizes measured alone make a line only when they differ by this much (a fifth).
const LINE_SPREAD: f64 = 1.2;

impl Pool<'_> {
    /// Live at `ts`: room a request can reuse.
    pub(super) fn at(&self, ts: u64) -> u64 {
        self.live.at(ts)
    }

    /// What a request that failed alone in prefill needed at least: what it grew the pool by
    /// since it arrived, and the allocation it was refused. A cost from it is an estimate, for a
    /// server met serving with no request measured since: the request would have asked for more
    /// after, and may have reused what the allocator cached before tracing; its bytes that are
    /// no prompt count as prompt.
    pub(super) fn least_need(&self, arrived: u64, failed_at: u64, refused: u64, received: u64) -> Option<Cost> {
        let need = self.at(failed_at).saturating_sub(self.at(arrived)).saturating_add(refused);
        (received > 0 && need > 0).then(|| Cost {
            per_byte: need as f64 / received as f64,
            overhead_bytes: 0,
            pool_bytes: need,
            received,
            alone: true,
        })
    }

    /// The cost from the pool's highest mark reached with one request alone in prefill (a
    /// batch's requests may not all have asked yet), else with several; only marks whose
    /// requests all finished their prefill (a request that failed had not asked for all it
    /// needed).
    pub(super) fn cost(&self, requests: &[&Request]) -> Option<Cost> {
        let mut marks: Vec<(u64, u64)> = Vec::new();
        for a in &self.allocations {
            let pool = self.live.at(a.ts);
            if pool > 0 && marks.last().is_none_or(|m| pool > m.0) {
                marks.push((pool, a.ts));
            }
        }
        let prefilling = |ts: u64| {
            let in_prefill = |r: &&&Request| r.arrived <= ts && r.first_data_at.is_none_or(|t| t > ts) && r.ended.is_none_or(|t| t > ts);
            let mut received = (0usize, 0u64);
            for r in requests.iter().filter(in_prefill) {
                r.first_data_at?;
                received = (received.0 + 1, received.1.saturating_add(r.bytes_in));
            }
            // A mark with nothing received says nothing of a byte's cost.
            Some(received).filter(|r| r.0 > 0 && r.1 > 0)
        };
        let measured: Vec<(u64, usize, u64)> =
            marks.iter().rev().take(MARKS_TRIED).filter_map(|&(pool, ts)| prefilling(ts).map(|(n, b)| (pool, n, b))).collect();
        let &(pool, n, received) = measured.iter().find(|m| m.1 == 1).or(measured.first())?;
        let proportional = Cost { per_byte: pool as f64 / received as f64, overhead_bytes: 0, pool_bytes: pool, received, alone: n == 1 };
        // The smallest request measured alone, against the highest mark's.
        let smallest =
            measured.iter().filter(|m| m.1 == 1 && (m.2 as f64) * LINE_SPREAD <= received as f64 && m.0 < pool).min_by_key(|m| m.2);
        let line = smallest.filter(|_| n == 1).and_then(|&(low_pool, _, low)| {
            let per_byte = (pool - low_pool) as f64 / (received - low) as f64;
            let overhead = received as f64 - pool as f64 / per_byte;
            // A line that says a request costs more than all of it, or nothing, is no measure.
            (0.0..low as f64).contains(&overhead).then_some(Cost { per_byte, overhead_bytes: overhead as u64, ..proportional })
        });
        Some(line.unwrap_or(proportional))
    }
}

/// One service on one GPU: the series the moments are read from.
pub(super) struct Books<'d, 'a> {
    d: &'d Diagnoser<'a>,
    service: &'d Service,
    gpu: Option<u32>,
    capacity: u64,
    /// Every process's video memory on the GPU, and the service's prefill pool.
    pub(super) all: Live,
    pub(super) pool: Pool<'d>,
}

impl Books<'_, '_> {
    /// Free on the GPU at `ts` by the same account as a diagnosis's, plus the pool: the room
    /// for requests.
    pub(super) fn room(&self, ts: u64) -> u64 {
        let before = self.d.before_tracing(self.service, ts, self.gpu);
        let nvml =
            self.d.nvml_outside(self.service, ts, self.gpu).iter().map(|(p, _)| p.used_bytes.unwrap_or(0)).fold(0, u64::saturating_add);
        let held = self.all.at(ts).saturating_add(before).saturating_add(nvml);
        let mut free = self.capacity.saturating_sub(held);
        // On unified memory no more than the host has available either.
        if self.d.unified(self.gpu) {
            if let Some(host) = self.d.model.sample_at(ts).and_then(|s| s.host.as_ref()) {
                free = free.min(host.available_bytes);
            }
        }
        free.saturating_add(self.pool.at(ts))
    }

    fn moment(&self, ts: u64, cost: &Cost, largest: u64) -> Moment {
        let room = self.room(ts);
        let in_flight = self.d.services.in_flight_count(self.service, ts);
        let fit_at_once = room / cost.of(largest).max(1);
        Moment {
            ts: ts.saturating_sub(self.d.start()),
            room_bytes: room,
            in_flight,
            fit_at_once,
            more_requests: fit_at_once.saturating_sub(in_flight as u64),
            largest_fitting_request_bytes: cost.fits(room),
        }
    }
}

impl<'a> Diagnoser<'a> {
    /// Headroom of every service that served requests, on each GPU it uses whose size is known.
    pub fn headroom(&self) -> Vec<Headroom> {
        // Each service's completions, in one pass: only services that served are looked at.
        let mut served: BTreeMap<u32, Vec<&Request>> = BTreeMap::new();
        for r in self.model.requests.iter().filter(|r| is_completion(r)) {
            if let Some(s) = self.services.of(r.pid) {
                served.entry(s.root).or_default().push(r);
            }
        }
        // Each costs a pass over the allocations: the busiest services only.
        let mut served: Vec<(u32, Vec<&Request>)> = served.into_iter().collect();
        served.sort_by_key(|(root, requests)| (std::cmp::Reverse(requests.len()), *root));
        served.truncate(MAX_SERVICES);
        let mut out = Vec::new();
        for (root, requests) in served {
            let Some(service) = self.services.of(root) else { continue };
            // Of the requests served (a request that failed says nothing of what is served);
            // before any was, of those received.
            let served = requests.iter().filter(|r| r.first_data_at.is_some()).map(|r| r.bytes_in).max();
            let Some(largest) = served.or_else(|| requests.iter().map(|r| r.bytes_in).max()).filter(|&b| b > 0) else {
                continue;
            };
            let gpus = self.gpus_of(service);
            let gpus: Vec<Option<u32>> = if gpus.is_empty() { vec![None] } else { gpus.into_iter().map(Some).collect() };
            for gpu in gpus {
                if let Some(h) = self.headroom_on(service, gpu, &requests, largest) {
                    out.push(h);
                }
            }
        }
        out
    }

    /// The service's pool on `gpu`.
    pub(super) fn pool(&self, service: &Service, gpu: Option<u32>) -> Pool<'_> {
        let pids: HashSet<u32> = service.pids.iter().copied().collect();
        let allocations: Vec<&Allocation> = self
            .model
            .allocations
            .iter()
            .filter(|a| a.memory == Memory::Video && pids.contains(&a.pid) && self.counts_on(self.model.gpu_for(a.pid, a.gpu), gpu))
            .filter(|a| self.services.phase(service, a.ts) == Phase::Prefill)
            .collect();
        Pool { live: Live::of(allocations.iter().copied()), allocations }
    }

    /// The books of `service` on `gpu`, whose size must be known.
    pub(super) fn books<'d>(&'d self, service: &'d Service, gpu: Option<u32>, pool: Pool<'d>) -> Option<Books<'d, 'a>> {
        let capacity = self.sized(gpu)?;
        let on_gpu = |a: &&Allocation| a.memory == Memory::Video && self.counts_on(self.model.gpu_for(a.pid, a.gpu), gpu);
        Some(Books { d: self, service, gpu, capacity, all: Live::of(self.model.allocations.iter().filter(on_gpu)), pool })
    }

    /// The GPU's size: NVML's, or on unified memory the host's.
    fn sized(&self, gpu: Option<u32>) -> Option<u64> {
        let host = || self.model.samples.last().and_then(|(_, s)| s.host.as_ref()).map(|h| h.total_bytes);
        self.capacity(gpu).or_else(|| self.unified(gpu).then(host).flatten())
    }

    fn headroom_on(&self, service: &Service, gpu: Option<u32>, requests: &[&Request], largest: u64) -> Option<Headroom> {
        // Nothing is built for a GPU of unknown size.
        self.sized(gpu)?;
        let pool = self.pool(service, gpu);
        let cost = pool.cost(requests)?;
        let books = self.books(service, gpu, pool)?;
        // Moments while it served (until a process of it that held memory exited): whenever what
        // is held on the GPU, or in flight, changed.
        let from = requests.iter().map(|r| r.arrived).min()?;
        let holders = self.model.processes.values().filter(|p| service.has(p.pid) && p.usage.allocations > 0);
        let exited = holders.filter_map(|p| p.exited).min();
        let until = exited.map_or(self.model.last_ts, |e| e.saturating_sub(1)).min(self.model.last_ts);
        let timeline = self.services.timeline(service).iter().map(|(t, _, _)| (*t, ()));
        let samples = self.model.samples.iter().map(|(t, _)| (*t, ()));
        let held = books.all.steps().map(|(t, _)| (t, ()));
        let streams = vec![in_time_order(held), in_time_order(timeline), in_time_order(samples)];
        let mut previous = None;
        let moments = merged(streams).map(|(t, ())| t).filter(|t| (from..=until).contains(t) && previous.replace(*t) != Some(*t));
        let last = books.moment(until, &cost, largest);
        let tightest = moments
            .map(|t| books.moment(t, &cost, largest))
            .min_by_key(|m| (m.more_requests, m.room_bytes))
            .filter(|m| (m.more_requests, m.room_bytes) < (last.more_requests, last.room_bytes))
            .unwrap_or(last);
        let now = exited.is_none().then_some(last);
        Some(Headroom {
            service: service.name.clone(),
            pid: service.root,
            gpu,
            measured_pool_bytes: cost.pool_bytes,
            measured_request_bytes: cost.received,
            measured_alone: cost.alone,
            largest_request_bytes: largest,
            request_cost_bytes: cost.of(largest),
            limits_exceeded: limits(self.engine(service), &self.fronting(service), &cost, &now.unwrap_or(tightest)),
            now,
            tightest,
        })
    }
}

/// The engine's limits its command line sets that let in more than memory takes at `at`: requests
/// at once against what fit then, one request's context and one batch's tokens against the
/// prompt that fits in the room then.
fn limits(engine: &[String], fronts: &[Front], cost: &Cost, at: &Moment) -> Vec<Limit> {
    let family = ServerFamily::of(engine);
    let (tokens, context) = cost.context(at.room_bytes);
    // llama-server's -c may be its slots' context together: each request's is its share.
    let slots = family.context_slots(engine, None);
    let checks = [
        (Bound::Concurrency, family.concurrency().map(|(_, names)| names), at.fit_at_once, at.fit_at_once, 1),
        (Bound::Context, family.context().map(|(_, names)| names), tokens, context, slots),
        (Bound::BatchTokens, family.batch_tokens(), tokens, context, 1),
    ];
    let mut exceeded: Vec<Limit> = checks
        .into_iter()
        .filter_map(|(bounds, names, fits, cap, slots)| {
            let (setting, value) = flag_named(engine, names?)?;
            let value = count(&value)?;
            let limit =
                Limit { setting: setting.to_string(), value, bounds, fits, cap: cap.saturating_mul(slots), slots, proxies: Vec::new() };
            // A cap of nothing (no room at all) is no value a server takes: the headroom says it.
            (limit.lets_in() > fits && cap > 0).then_some(limit)
        })
        .collect();
    // A proxy's limit matters where the server's own lets in more than fits (or it sets none,
    // and its default may): a server that caps itself queues what a proxy lets through.
    let own = family.concurrency().and_then(|(_, names)| flag_named(engine, names)).and_then(|(_, v)| count(&v));
    // The deployments count together: two that each fit may not together.
    let through = super::proxy::let_through(fronts).filter(|&n| n > at.fit_at_once);
    if let Some(value) = through.filter(|_| own.is_none_or(|own| own > at.fit_at_once) && at.fit_at_once > 0) {
        let mut from: Vec<&str> = fronts.iter().map(|f| f.limit_from.as_str()).collect();
        from.sort();
        from.dedup();
        let setting = format!("LiteLLM {}", from.join(", "));
        let (fits, cap) = (at.fit_at_once, at.fit_at_once);
        exceeded.push(Limit { setting, value, bounds: Bound::Concurrency, fits, cap, slots: 1, proxies: fronts.to_vec() });
    }
    exceeded
}

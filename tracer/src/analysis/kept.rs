//! Memory a service keeps: what its level at rest (no request in flight) rose by over the
//! requests it served. A pool or a caching allocator grows to the largest load it has met and
//! then stays (PyTorch's allocator, ggml's pool); warm-up grows it over the first requests, then
//! stops. Memory kept request after request (a cache with no bound, tensors kept per
//! conversation, a leak) grows with the count of requests, however large. So only what the
//! level rose by between two moments at rest with no load larger than one met before counts,
//! and a service keeps memory only while that still goes on among its latest requests.
//!
//! A watch forgets ended requests when it compacts its model: before it does, it folds what
//! they showed into a bounded [`RestSeries`] per service and GPU ([`feed`]), which its dumps
//! carry in their header. [`measure`] reads that series and carries on from the model.

use serde::Serialize;

use super::accounts::Accounts;
use super::cost::Live;
use super::services::Service;
use super::Phase;
use crate::event::Memory;
use crate::model::Allocation;
use crate::trace::{AtRest, RestSeries, Stretch};

/// One allocation the service kept: made over a stretch that counts, live since.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KeptAllocation {
    pub ts: u64,
    pub pid: u32,
    pub tid: u32,
    pub bytes: u64,
    pub phase: Phase,
}

/// The allocations behind what was kept.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct KeptAllocations {
    pub count: u64,
    pub bytes: u64,
    pub smallest: u64,
    pub largest: u64,
    /// How many were made in each phase, in [`Phase::ALL`]'s order, phases with none left out.
    pub by_phase: Vec<(Phase, u64)>,
    /// The first [`LISTED`] of them, in time order.
    pub first: Vec<KeptAllocation>,
}

/// Kept allocations listed one by one.
pub const LISTED: usize = 4;

/// What a service kept on one GPU over the requests it served, up to a moment.
#[derive(Clone, Debug, PartialEq)]
pub struct Kept {
    pub gpu: Option<u32>,
    /// Right before the first request seen (right after it became ready, or after attaching).
    pub ready: AtRest,
    /// The last moment at rest.
    pub now: AtRest,
    /// What the level rose by over the stretches that count (no load larger than before), and
    /// the requests served over them.
    pub kept_bytes: u64,
    pub requests: u64,
    /// Those stretches, and how many of them rose.
    pub stretches: u64,
    pub rises: u64,
    /// The same over the latest half of them (at most [`RECENT`]): the rate now, and since when.
    pub recent_bytes: u64,
    pub recent_requests: u64,
    pub recent_stretches: u64,
    pub recent_rises: u64,
    pub recent_since: u64,
    /// When the first stretch that counts and rose ended.
    pub began_at: Option<u64>,
    /// The most the requests in flight together had received, over every stretch served.
    pub largest_load_bytes: u64,
    /// The spans of the stretches that do not count: what was allocated then is a pool's.
    larger_spans: Vec<(u64, u64)>,
    /// The service was running before tracing began: what it kept before is not in these figures.
    pub since_attaching: bool,
}

/// Stretches that rose, at least, before a service is said to keep memory: fewer could be
/// warm-up (a graph captured, a workspace sized on the second request).
const MIN_RISES: u64 = 3;

/// Stretches a series keeps one by one (the rest are folded: twice what the rate now reads),
/// and the spans of larger ones.
const KEPT_STRETCHES: usize = 2 * RECENT;
const KEPT_SPANS: usize = 32;
/// The latest stretches the rate now is read from, at most.
pub const RECENT: usize = 64;
/// Series a watch keeps (a host's serving services on their GPUs), and those a dump's header
/// carries (the latest at rest; the header is one line, of at most `trace::MAX_LINE`).
const MAX_SERIES: usize = 64;
pub const DUMPED_SERIES: usize = 16;

impl Kept {
    /// What it kept a request, over every stretch that counts.
    pub fn per_request(&self) -> u64 {
        self.kept_bytes / self.requests.max(1)
    }

    /// What it kept a request among its latest: the rate a forecast uses.
    pub fn recent_per_request(&self) -> u64 {
        self.recent_bytes / self.recent_requests.max(1)
    }

    /// It keeps memory: its level rose over enough stretches with no larger load, and still
    /// does among the latest (at least a quarter of the overall rate, over two stretches or a
    /// quarter of them): a warm-up that stopped does not.
    pub fn keeps(&self) -> bool {
        self.rises >= MIN_RISES
            && self.kept_bytes > 0
            && self.recent_rises >= 2.max(self.recent_stretches / 4)
            && self.recent_per_request().saturating_mul(4) >= self.per_request()
    }

    /// An allocation of the service is part of what it kept: made over a stretch that counts
    /// (after the first request, in none larger) and live at the last moment at rest.
    pub fn holds(&self, a: &Allocation) -> bool {
        a.ts > self.ready.ts
            && a.ts <= self.now.ts
            && a.freed.is_none_or(|(f, _)| f > self.now.ts)
            && !self.larger_spans.iter().any(|&(start, end)| a.ts > start && a.ts <= end)
    }
}

/// The service's video memory on `gpu` over time, with what it held before tracing.
struct Level<'a> {
    live: Live,
    accounts: &'a Accounts<'a>,
    service: &'a Service,
    gpu: Option<u32>,
}

impl Level<'_> {
    fn at(&self, ts: u64) -> u64 {
        self.live.at(ts).saturating_add(self.accounts.before_tracing(self.service, ts, self.gpu))
    }
}

fn on_gpu(accounts: &Accounts, service: &Service, gpu: Option<u32>, a: &Allocation) -> bool {
    a.memory == Memory::Video && service.has(a.pid) && accounts.counts_on(accounts.model.gpu_for(a.pid, a.gpu), gpu)
}

/// The stretches the model shows after `after` (a moment at rest; its requests only, those that
/// arrived later and ended before `until`), `largest` the most received in flight together
/// before; with the new most. The first request's moment before, where `after` is none.
fn stretches(
    accounts: &Accounts,
    service: &Service,
    level: &Level,
    after: Option<AtRest>,
    mut largest: u64,
    until: u64,
) -> Option<(AtRest, Vec<Stretch>, u64)> {
    let from = after.map_or(0, |a| a.ts);
    // Only while its processes that hold memory run: a server that died is at no rest.
    let holders = accounts.model.processes.values().filter(|p| service.has(p.pid) && p.usage.allocations > 0);
    let until = holders.filter_map(|p| p.exited).fold(until, u64::min);
    let mut requests: Vec<_> =
        accounts.services.completions(service).into_iter().filter(|r| r.arrived < until && (after.is_none() || r.arrived > from)).collect();
    requests.sort_by_key(|r| r.arrived);
    let before_first = requests.first()?.arrived.saturating_sub(1);
    let mut last = after.unwrap_or(AtRest { ts: before_first, bytes: level.at(before_first), served: 0 });
    let start = last;
    // Arrivals add what a request received, ends take it away: at rest where none is left, once
    // one that ended was answered with data (a request cut off by its server's death is none,
    // and the level then is its exit's).
    let mut changes: Vec<(u64, i128, bool)> = Vec::new();
    for r in &requests {
        changes.push((r.arrived, i128::from(r.bytes_in), false));
        if let Some(end) = r.ended.filter(|&e| e < until) {
            changes.push((end, -i128::from(r.bytes_in), r.first_data_at.is_some_and(|d| d <= end)));
        }
    }
    changes.sort_by_key(|c| (c.0, c.1 < 0));
    let (mut in_flight, mut load, mut peak, mut served, mut answered) = (0usize, 0i128, 0u64, last.served, false);
    let mut out = Vec::new();
    let mut i = 0;
    while i < changes.len() {
        let ts = changes[i].0;
        while let Some(&(_, delta, with_data)) = changes.get(i).filter(|c| c.0 == ts) {
            if delta >= 0 {
                in_flight += 1;
            } else {
                (in_flight, served, answered) = (in_flight.saturating_sub(1), served.saturating_add(1), answered || with_data);
            }
            load += delta;
            peak = peak.max(load.clamp(0, i128::from(u64::MAX)) as u64);
            i += 1;
        }
        if in_flight == 0 && served > last.served && std::mem::take(&mut answered) {
            let end = AtRest { ts, bytes: level.at(ts), served };
            let delta = (i128::from(end.bytes) - i128::from(last.bytes)).clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
            out.push(Stretch { start: last.ts, end, delta, requests: served.saturating_sub(last.served), larger: peak > largest });
            (largest, peak, last) = (largest.max(peak), 0, end);
        }
    }
    Some((start, out, largest))
}

/// A series' arithmetic (the type is the trace's).
impl RestSeries {
    fn last_rest(&self) -> AtRest {
        self.stretches.last().map_or(self.ready, |s| s.end)
    }

    /// New stretches added; past [`KEPT_STRETCHES`], the oldest folded (a larger one's span
    /// kept, at most [`KEPT_SPANS`] of them).
    pub(super) fn extend(&mut self, new: Vec<Stretch>) {
        self.stretches.extend(new);
        let over = self.stretches.len().saturating_sub(KEPT_STRETCHES);
        for s in self.stretches.drain(..over) {
            if s.larger {
                self.larger_spans.push((s.start, s.end.ts));
                let spans = self.larger_spans.len();
                self.larger_spans.drain(..spans.saturating_sub(KEPT_SPANS));
                continue;
            }
            let f = &mut self.earlier;
            f.delta = f.delta.saturating_add(s.delta);
            f.requests = f.requests.saturating_add(s.requests);
            f.stretches = f.stretches.saturating_add(1);
            if s.delta > 0 {
                f.rises = f.rises.saturating_add(1);
                f.began_at.get_or_insert(s.end.ts);
            }
        }
    }
}

/// The series of `service` on `gpu` up to `until`: `known` (a watch's, or a dump's header's)
/// carried on with what the model shows after it.
fn series(accounts: &Accounts, service: &Service, gpu: Option<u32>, known: Option<&RestSeries>, until: u64) -> Option<RestSeries> {
    let model = accounts.model;
    let live = Live::of(model.allocations.iter().filter(|a| on_gpu(accounts, service, gpu, a)));
    let level = Level { live, accounts, service, gpu };
    let after = known.map(|k| k.last_rest());
    let largest = known.map_or(0, |k| k.largest);
    let mut out = known.cloned().unwrap_or(RestSeries { root: service.root, gpu, ..RestSeries::default() });
    match stretches(accounts, service, &level, after, largest, until) {
        Some((ready, new, largest)) => {
            if known.is_none() {
                out.ready = ready;
            }
            out.largest = largest;
            out.extend(new);
        }
        None if known.is_none() => return None,
        None => {}
    }
    Some(out)
}

/// A watch's series brought up to `until` from its live model, before it compacts (which forgets
/// ended requests): every serving service on each of its GPUs. A server that died keeps its
/// series (its failure's dump reads it); past [`MAX_SERIES`], those at rest longest go.
pub fn feed(history: &mut Vec<RestSeries>, accounts: &Accounts, until: u64) {
    for service in accounts.services.list.iter().filter(|s| s.ready_at.is_some()) {
        for gpu in gpus(accounts, service) {
            let at = history.iter().position(|s| s.root == service.root && same_gpu(accounts, s.gpu, gpu));
            // A series of an earlier process under the same pid starts anew.
            let known = at.map(|i| &history[i]).filter(|s| s.last_rest().ts >= service.first_ts);
            let Some(fed) = series(accounts, service, gpu, known, until) else { continue };
            match at {
                Some(i) => history[i] = fed,
                None => history.push(fed),
            }
        }
    }
    if history.len() > MAX_SERIES {
        history.sort_by_key(|s| std::cmp::Reverse(s.last_rest().ts));
        history.truncate(MAX_SERIES);
    }
}

/// Two ways of naming a GPU name the same one (None: the only GPU there is).
fn same_gpu(accounts: &Accounts, a: Option<u32>, b: Option<u32>) -> bool {
    a == b || (accounts.counts_on(a, b) && accounts.counts_on(b, a))
}

/// What a dump's header carries of a watch's history: the [`DUMPED_SERIES`] latest at rest.
pub fn for_dump(history: &[RestSeries]) -> Vec<RestSeries> {
    let mut latest: Vec<&RestSeries> = history.iter().collect();
    latest.sort_by_key(|s| std::cmp::Reverse(s.last_rest().ts));
    latest.into_iter().take(DUMPED_SERIES).cloned().collect()
}

/// The GPUs a service's level is followed on (None: the one GPU, or a GPU unknown).
fn gpus(accounts: &Accounts, service: &Service) -> Vec<Option<u32>> {
    let gpus = accounts.gpus_of(service);
    if gpus.is_empty() {
        vec![None]
    } else {
        gpus.into_iter().map(Some).collect()
    }
}

/// What `service` kept on `gpu` over the requests that ended before `until`, from the header's
/// series for it (a dump of a watch) and the model; None until a moment at rest was seen.
pub fn measure(accounts: &Accounts, service: &Service, gpu: Option<u32>, until: u64) -> Option<Kept> {
    // A crafted header's series is read no further than a watch writes one.
    let known = accounts.header.rest_history.iter().take(MAX_SERIES).find(|s| s.root == service.root && same_gpu(accounts, s.gpu, gpu));
    // A dump's series may run past the moment judged (it was fed up to the dump).
    let known = known.filter(|k| k.ready.ts < until).map(|k| RestSeries {
        stretches: k.stretches.iter().take(KEPT_STRETCHES).filter(|s| s.end.ts < until).copied().collect(),
        ..k.clone()
    });
    let mut s = series(accounts, service, gpu, known.as_ref(), until)?;
    s.larger_spans.truncate(KEPT_SPANS);
    let now = *s.stretches.last()?;
    let counted: Vec<&Stretch> = s.stretches.iter().filter(|s| !s.larger).collect();
    let sum = |list: &[&Stretch]| {
        let delta = list.iter().map(|s| i128::from(s.delta)).sum::<i128>();
        let rises = list.iter().filter(|s| s.delta > 0).count() as u64;
        (delta, list.iter().map(|s| s.requests).fold(0, u64::saturating_add), list.len() as u64, rises)
    };
    let (delta, requests, stretches, rises) = sum(&counted);
    let e = s.earlier;
    let recent = &counted[counted.len() - (counted.len() / 2).min(RECENT).max(counted.len().min(1))..];
    let (recent_delta, recent_requests, recent_stretches, recent_rises) = sum(recent);
    let bytes = |d: i128| d.clamp(0, i128::from(u64::MAX)) as u64;
    let larger_spans = s.larger_spans.iter().copied().chain(s.stretches.iter().filter(|s| s.larger).map(|s| (s.start, s.end.ts))).collect();
    let running_before = accounts.model.processes.get(&service.root).is_some_and(|p| p.seen == crate::event::Seen::Running);
    Some(Kept {
        gpu,
        ready: s.ready,
        now: now.end,
        kept_bytes: bytes(delta + i128::from(e.delta)),
        requests: requests.saturating_add(e.requests),
        stretches: stretches.saturating_add(e.stretches),
        rises: rises.saturating_add(e.rises),
        recent_bytes: bytes(recent_delta),
        recent_requests,
        recent_stretches,
        recent_rises,
        recent_since: recent.first().map_or(now.end.ts, |s| s.start),
        began_at: e.began_at.or_else(|| counted.iter().find(|s| s.delta > 0).map(|s| s.end.ts)),
        largest_load_bytes: s.largest,
        larger_spans,
        since_attaching: running_before || accounts.before_tracing(service, s.ready.ts, gpu) > 0,
    })
}

/// The service's allocations on `gpu` that are part of what it kept, listed.
pub fn allocations(accounts: &Accounts, service: &Service, kept: &Kept) -> KeptAllocations {
    let held = accounts.model.allocations.iter().filter(|a| on_gpu(accounts, service, kept.gpu, a) && kept.holds(a));
    let mut out = KeptAllocations { smallest: u64::MAX, ..KeptAllocations::default() };
    let mut phases = [0u64; Phase::ALL.len()];
    for a in held {
        let phase = accounts.services.phase(service, a.ts);
        out.count += 1;
        out.bytes = out.bytes.saturating_add(a.bytes);
        out.smallest = out.smallest.min(a.bytes);
        out.largest = out.largest.max(a.bytes);
        phases[Phase::ALL.iter().position(|&p| p == phase).unwrap_or(0)] += 1;
        if out.first.len() < LISTED {
            out.first.push(KeptAllocation { ts: a.ts, pid: a.pid, tid: a.tid, bytes: a.bytes, phase });
        }
    }
    out.smallest = out.smallest.min(out.largest);
    out.by_phase = Phase::ALL.into_iter().zip(phases).filter(|(_, n)| *n > 0).collect();
    out
}

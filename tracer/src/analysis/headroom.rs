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
//! largest size seen fit in it.

use std::collections::{BTreeMap, HashSet};

use serde::Serialize;

use super::diagnosis::Diagnoser;
use super::server::{flag, ServerFamily};
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
    /// The largest request received, and its cost by that measure.
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
    /// Requests of the largest size seen that fit at once, those in flight included.
    pub fit_at_once: u64,
    /// How many more of them fit beside those in flight.
    pub more_requests: u64,
    /// The largest request that fits with nothing else in flight, in bytes received.
    pub largest_fitting_request_bytes: u64,
}

/// A server's limit that lets in more than memory takes.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Limit {
    /// As the server's command line names it: `--max-num-seqs`, `-np`.
    pub setting: String,
    pub value: u64,
    /// What memory takes of the largest requests seen, at once.
    pub fits: u64,
}

impl Headroom {
    /// One line: what a request costs, how many more fit now, and when it was tightest.
    pub fn text(&self) -> String {
        let gpu = self.gpu.map(|g| format!(" on GPU {g}")).unwrap_or_default();
        let size = bytes(self.largest_request_bytes);
        let how = if self.measured_alone { "measured alone" } else { "the batch's share" };
        let mut line =
            format!("`{}`{gpu}: a request of {size} (the largest seen) costs {} ({how})", self.service, bytes(self.request_cost_bytes));
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
            line += &format!(
                ". `{} {}` lets {} run at once; memory fits {} of the largest seen: cap at {}",
                l.setting, l.value, l.value, l.fits, l.fits
            );
        }
        line
    }
}

/// Video memory live over time for the allocations kept: (time, live from then on).
struct Live(Vec<(u64, u64)>);

impl Live {
    fn of<'m>(allocations: impl Iterator<Item = &'m Allocation>) -> Live {
        let mut deltas: Vec<(u64, i128)> = Vec::new();
        for a in allocations {
            deltas.push((a.ts, a.bytes as i128));
            if let Some((freed, _)) = a.freed {
                deltas.push((freed, -(a.bytes as i128)));
            }
        }
        deltas.sort_by_key(|d| d.0);
        let mut steps: Vec<(u64, u64)> = Vec::with_capacity(deltas.len());
        let mut live = 0i128;
        for (ts, delta) in deltas {
            live += delta;
            let now = live.clamp(0, u64::MAX as i128) as u64;
            match steps.last_mut() {
                Some(last) if last.0 == ts => last.1 = now,
                _ => steps.push((ts, now)),
            }
        }
        Live(steps)
    }

    fn at(&self, ts: u64) -> u64 {
        match self.0.partition_point(|(t, _)| *t <= ts) {
            0 => 0,
            i => self.0[i - 1].1,
        }
    }
}

/// How many of the pool's highest marks are tried for one with a request alone in prefill.
const MARKS_TRIED: usize = 16;

/// One service on one GPU: the series the moments are read from.
struct Books<'d, 'a> {
    d: &'d Diagnoser<'a>,
    service: &'d Service,
    gpu: Option<u32>,
    capacity: u64,
    /// Every process's video memory on the GPU, and the service's prefill pool.
    all: Live,
    pool: Live,
}

impl Books<'_, '_> {
    /// Free on the GPU at `ts` by the same account as a diagnosis's, plus the pool.
    fn room(&self, ts: u64) -> u64 {
        let before = self.d.before_tracing(self.service, ts, self.gpu);
        let nvml = self.d.nvml_outside(self.service, ts, self.gpu).iter().map(|p| p.used_bytes.unwrap_or(0)).fold(0, u64::saturating_add);
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

    fn moment(&self, ts: u64, per_byte: f64, largest: u64) -> Moment {
        let room = self.room(ts);
        let in_flight = self.d.services.in_flight_count(self.service, ts);
        let fit_at_once = (room as f64 / (per_byte * largest as f64)).floor() as u64;
        Moment {
            ts: ts.saturating_sub(self.d.start()),
            room_bytes: room,
            in_flight,
            fit_at_once,
            more_requests: fit_at_once.saturating_sub(in_flight as u64),
            largest_fitting_request_bytes: (room as f64 / per_byte) as u64,
        }
    }
}

impl Diagnoser<'_> {
    /// Headroom of every service that served requests, on each GPU it uses whose size is known.
    pub fn headroom(&self) -> Vec<Headroom> {
        // Each service's completions, in one pass: only services that served are looked at.
        let mut served: BTreeMap<u32, Vec<&Request>> = BTreeMap::new();
        for r in self.model.requests.iter().filter(|r| is_completion(r)) {
            if let Some(s) = self.services.of(r.pid) {
                served.entry(s.root).or_default().push(r);
            }
        }
        let mut out = Vec::new();
        for (root, requests) in served {
            let Some(service) = self.services.of(root) else { continue };
            let Some(largest) = requests.iter().map(|r| r.bytes_in).max().filter(|&b| b > 0) else {
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

    fn headroom_on(&self, service: &Service, gpu: Option<u32>, requests: &[&Request], largest: u64) -> Option<Headroom> {
        let host = || self.model.samples.last().and_then(|(_, s)| s.host.as_ref()).map(|h| h.total_bytes);
        let capacity = self.capacity(gpu).or_else(|| self.unified(gpu).then(host).flatten())?;
        let on_gpu = |a: &&Allocation| a.memory == Memory::Video && self.counts_on(self.model.gpu_for(a.pid, a.gpu), gpu);
        let pids: HashSet<u32> = service.pids.iter().copied().collect();
        let mine = |a: &&Allocation| pids.contains(&a.pid);
        let in_prefill = |a: &&Allocation| self.services.phase(service, a.ts) == Phase::Prefill;
        let pool_allocations: Vec<&Allocation> = self.model.allocations.iter().filter(on_gpu).filter(mine).filter(in_prefill).collect();
        let books = Books {
            d: self,
            service,
            gpu,
            capacity,
            all: Live::of(self.model.allocations.iter().filter(on_gpu)),
            pool: Live::of(pool_allocations.iter().copied()),
        };
        // The pool's high-water marks, highest first: the highest reached with one request alone
        // in prefill (a batch's requests may not all have asked yet), else with several.
        let mut marks: Vec<(u64, u64)> = Vec::new();
        for a in &pool_allocations {
            let pool = books.pool.at(a.ts);
            if marks.last().is_none_or(|m| pool > m.0) {
                marks.push((pool, a.ts));
            }
        }
        let prefilling = |ts: u64| {
            let in_prefill = |r: &&&Request| r.arrived <= ts && r.first_data_at.is_none_or(|t| t > ts) && r.ended.is_none_or(|t| t > ts);
            let received = requests.iter().filter(in_prefill).map(|r| r.bytes_in);
            received.fold((0usize, 0u64), |(n, b), r| (n + 1, b.saturating_add(r)))
        };
        let measured: Vec<(u64, usize, u64)> =
            marks.iter().rev().take(MARKS_TRIED).map(|&(pool, ts)| (pool, prefilling(ts))).map(|(p, (n, b))| (p, n, b)).collect();
        let &(pool, n, received) = measured.iter().find(|m| m.1 == 1).or_else(|| measured.iter().find(|m| m.2 > 0))?;
        let per_byte = pool as f64 / received as f64;
        // Moments while it served (until a process of it that held memory exited): whenever what
        // is held on the GPU, or in flight, changed.
        let from = requests.iter().map(|r| r.arrived).min()?;
        let holders = self.model.processes.values().filter(|p| pids.contains(&p.pid) && p.usage.allocations > 0);
        let exited = holders.filter_map(|p| p.exited).min();
        let until = exited.map_or(self.model.last_ts, |e| e.saturating_sub(1)).min(self.model.last_ts);
        let timeline = self.services.timeline(service).iter().map(|(t, _, _)| *t);
        let samples = self.model.samples.iter().map(|(t, _)| *t);
        let mut moments: Vec<u64> =
            books.all.0.iter().map(|(t, _)| *t).chain(timeline).chain(samples).filter(|t| (from..=until).contains(t)).collect();
        moments.sort_unstable();
        moments.dedup();
        let last = books.moment(until, per_byte, largest);
        let tightest = moments
            .iter()
            .map(|&t| books.moment(t, per_byte, largest))
            .min_by_key(|m| (m.more_requests, m.room_bytes))
            .filter(|m| (m.more_requests, m.room_bytes) < (last.more_requests, last.room_bytes))
            .unwrap_or(last);
        let now = exited.is_none().then_some(last);
        Some(Headroom {
            service: service.name.clone(),
            pid: service.root,
            gpu,
            measured_pool_bytes: pool,
            measured_request_bytes: received,
            measured_alone: n == 1,
            largest_request_bytes: largest,
            request_cost_bytes: (per_byte * largest as f64) as u64,
            limits_exceeded: limits(self.engine(service), now.unwrap_or(tightest).fit_at_once),
            now,
            tightest,
        })
    }
}

/// The engine's concurrency limit where its command line sets one and it lets in more than fit.
fn limits(engine: &[String], fits: u64) -> Vec<Limit> {
    let Some((_, names)) = ServerFamily::of(engine).concurrency() else {
        return Vec::new();
    };
    let given = names.iter().find_map(|n| flag(engine, &[n]).and_then(|v| v.parse::<u64>().ok()).map(|v| (n, v)));
    given.filter(|&(_, value)| value > fits).map(|(name, value)| Limit { setting: name.to_string(), value, fits }).into_iter().collect()
}

//! Headroom: how many more requests a serving service takes before an allocation fails, and
//! whether its own limits let in more than that. The early form of the long-request and
//! concurrent-load fixes, before the failure.
//!
//! What a request costs is measured from the service's own memory ([`super::cost`]). The room
//! for requests at a moment is what is free on the GPU (the card less what this service holds
//! and what everyone else does) plus its pool ([`super::accounts::RoomOverTime`]); headroom is
//! how many requests of the largest size served fit in it. A service that keeps memory request
//! after request ([`super::kept`]) has its forecast: at that rate, how many more requests (and
//! seconds) before one no longer fits; what it keeps is held, not in its pool.

use std::collections::BTreeMap;

use serde::Serialize;

use super::accounts::{Accounts, RoomOverTime};
use super::cost::Cost;
use super::kept;
use super::proxy::Front;
use super::server::{count, flag_named, ServerFamily};
use super::services::{is_completion, Service};
use super::sweep::{in_time_order, merged};
use crate::model::Request;

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
    /// What it keeps per request served; absent until it was seen at rest after a request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept: Option<KeptRate>,
}

/// What a service keeps per request, and when it runs out at that rate.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct KeptRate {
    /// Over its latest requests; 0 where it gives everything back (or only warmed up).
    pub bytes_per_request: u64,
    /// What it kept since it was ready (or since tracing began), over how many requests.
    pub kept_bytes: u64,
    pub requests: u64,
    pub since_attaching: bool,
    /// At that rate, the requests of the largest size served that still fit before one does
    /// not, and the seconds at the recent request rate: while it keeps memory and runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests_until_full: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seconds_until_full: Option<f64>,
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
    /// prompt tokens (at [`super::cost::BYTES_PER_TOKEN`]) alone or in one batch.
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
}

/// Serving services whose headroom is computed, the busiest first (a host's few servers; a
/// crafted trace of thousands costs no more than this many).
const MAX_SERVICES: usize = 64;

/// Headroom of every service that served requests, on each GPU it uses whose size is known.
pub fn headroom(accounts: &Accounts) -> Vec<Headroom> {
    // Each service's completions, in one pass: only services that served are looked at.
    let mut served: BTreeMap<u32, Vec<&Request>> = BTreeMap::new();
    for r in accounts.model.requests.iter().filter(|r| is_completion(r)) {
        if let Some(s) = accounts.services.of(r.pid) {
            served.entry(s.root).or_default().push(r);
        }
    }
    // Each costs a pass over the allocations: the busiest services only.
    let mut served: Vec<(u32, Vec<&Request>)> = served.into_iter().collect();
    served.sort_by_key(|(root, requests)| (std::cmp::Reverse(requests.len()), *root));
    served.truncate(MAX_SERVICES);
    let mut out = Vec::new();
    for (root, requests) in served {
        let Some(service) = accounts.services.of(root) else { continue };
        // Of the requests served (a request that failed says nothing of what is served);
        // before any was, of those received.
        let served = requests.iter().filter(|r| r.first_data_at.is_some()).map(|r| r.bytes_in).max();
        let Some(largest) = served.or_else(|| requests.iter().map(|r| r.bytes_in).max()).filter(|&b| b > 0) else {
            continue;
        };
        let gpus = accounts.gpus_of(service);
        let gpus: Vec<Option<u32>> = if gpus.is_empty() { vec![None] } else { gpus.into_iter().map(Some).collect() };
        for gpu in gpus {
            if let Some(h) = headroom_on(accounts, service, gpu, &requests, largest) {
                out.push(h);
            }
        }
    }
    out
}

fn headroom_on(accounts: &Accounts, service: &Service, gpu: Option<u32>, requests: &[&Request], largest: u64) -> Option<Headroom> {
    // Nothing is built for a GPU of unknown size.
    accounts.sized(gpu)?;
    let kept = kept::measure(accounts, service, gpu, accounts.model.last_ts.saturating_add(1));
    let keeping = kept.as_ref().filter(|k| k.keeps());
    let pool = accounts.pool_of(service, gpu, |a| keeping.is_none_or(|k| !k.holds(a)));
    let cost = pool.cost(requests)?;
    let room = accounts.room_over_time(service, gpu, pool)?;
    // Moments while it served (until a process of it that held memory exited): whenever what
    // is held on the GPU, or in flight, changed.
    let from = requests.iter().map(|r| r.arrived).min()?;
    let model = accounts.model;
    let holders = model.processes.values().filter(|p| service.has(p.pid) && p.usage.allocations > 0);
    let exited = holders.filter_map(|p| p.exited).min();
    let until = exited.map_or(model.last_ts, |e| e.saturating_sub(1)).min(model.last_ts);
    let timeline = accounts.services.timeline(service).iter().map(|(t, _, _)| (*t, ()));
    let samples = model.samples.iter().map(|(t, _)| (*t, ()));
    let held = room.all.steps().map(|(t, _)| (t, ()));
    let streams = vec![in_time_order(held), in_time_order(timeline), in_time_order(samples)];
    let mut previous = None;
    let moments = merged(streams).map(|(t, ())| t).filter(|t| (from..=until).contains(t) && previous.replace(*t) != Some(*t));
    let at = |ts: u64| moment(accounts, &room, service, ts, &cost, largest);
    let last = at(until);
    let tightest = moments
        .map(at)
        .min_by_key(|m| (m.more_requests, m.room_bytes))
        .filter(|m| (m.more_requests, m.room_bytes) < (last.more_requests, last.room_bytes))
        .unwrap_or(last);
    let now = exited.is_none().then_some(last);
    let kept = kept.map(|k| rate(&k, now.as_ref(), cost.of(largest)));
    Some(Headroom {
        service: service.name.clone(),
        pid: service.root,
        gpu,
        measured_pool_bytes: cost.pool_bytes,
        measured_request_bytes: cost.received,
        measured_alone: cost.alone,
        largest_request_bytes: largest,
        request_cost_bytes: cost.of(largest),
        limits_exceeded: limits(accounts.engine(service), &accounts.fronting(service), &cost, &now.unwrap_or(tightest)),
        now,
        tightest,
        kept,
    })
}

/// What `k` keeps a request, and at `now` (while it runs) how long until a request of the
/// largest size served, costing `cost`, no longer fits.
fn rate(k: &kept::Kept, now: Option<&Moment>, cost: u64) -> KeptRate {
    let keeps = k.keeps();
    let each = if keeps { k.recent_per_request().max(1) } else { 0 };
    let requests_until_full = now.filter(|_| keeps).map(|m| m.room_bytes.saturating_sub(cost) / each);
    let span = k.now.ts.saturating_sub(k.recent_since) as f64 / 1e9;
    let per_second = (span > 0.0).then(|| k.recent_requests as f64 / span).filter(|r| *r > 0.0);
    KeptRate {
        bytes_per_request: each,
        kept_bytes: k.kept_bytes,
        requests: k.requests,
        since_attaching: k.since_attaching,
        requests_until_full,
        seconds_until_full: requests_until_full.zip(per_second).map(|(n, r)| (n as f64 / r * 10.0).round() / 10.0),
    }
}

/// Headroom at `ts`: the room then, and how many requests of the `largest` size fit in it.
fn moment(accounts: &Accounts, room: &RoomOverTime, service: &Service, ts: u64, cost: &Cost, largest: u64) -> Moment {
    let room_bytes = room.room(ts);
    let in_flight = accounts.services.in_flight_count(service, ts);
    let fit_at_once = room_bytes / cost.of(largest).max(1);
    Moment {
        ts: ts.saturating_sub(accounts.start()),
        room_bytes,
        in_flight,
        fit_at_once,
        more_requests: fit_at_once.saturating_sub(in_flight as u64),
        largest_fitting_request_bytes: cost.fits(room_bytes),
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

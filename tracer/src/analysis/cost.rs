//! What a request costs, measured from the service's own memory. What its processes allocate
//! while requests are in prefill (activations, a caching allocator's pool, llama.cpp's compute
//! buffers) grows only past its high-water mark and is reused after: the service's pool for
//! requests. The cost of a byte received is that mark over what the requests in prefill had
//! received when it was reached.

use super::sweep::LiveChanges;
use crate::model::{Allocation, Request};

/// Video memory live over time for the allocations kept: (time, live from then on).
pub struct Live(Vec<(u64, u64)>);

impl Live {
    pub fn of<'m>(allocations: impl Iterator<Item = &'m Allocation> + Clone + 'm) -> Live {
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

    pub fn at(&self, ts: u64) -> u64 {
        match self.0.partition_point(|(t, _)| *t <= ts) {
            0 => 0,
            i => self.0[i - 1].1,
        }
    }

    /// Each time it changes, and what is live from then on.
    pub fn steps(&self) -> impl Iterator<Item = (u64, u64)> + Clone + '_ {
        self.0.iter().copied()
    }
}

/// How many of the pool's highest marks are tried for one with a request alone in prefill.
const MARKS_TRIED: usize = 16;

/// A service's pool on one GPU: its video memory allocated while it had requests in prefill
/// (activations, a caching allocator's blocks, compute buffers), reused by later requests.
pub struct Pool<'m> {
    allocations: Vec<&'m Allocation>,
    live: Live,
}

/// What a request costs: the pool's high-water mark over what the requests in prefill had
/// received when it was reached. Where requests of two sizes were each measured alone, the
/// line through both: a request's bytes include a part that is no prompt (its headers, the
/// JSON around the prompt, a chat template), which costs nothing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cost {
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
    pub fn of(&self, bytes: u64) -> u64 {
        (bytes.saturating_sub(self.overhead_bytes) as f64 * self.per_byte) as u64
    }

    /// The largest request, in bytes received, that `room` takes.
    pub fn fits(&self, room: u64) -> u64 {
        ((room as f64 / self.per_byte) as u64).saturating_add(self.overhead_bytes)
    }

    /// The longest prompt `room` takes, in tokens at [`BYTES_PER_TOKEN`], and the context to
    /// set for it: less [`CONTEXT_MARGIN`].
    pub fn context(&self, room: u64) -> (u64, u64) {
        let prompt = (room as f64 / self.per_byte) as u64 / BYTES_PER_TOKEN;
        (prompt, (prompt as f64 * CONTEXT_MARGIN) as u64)
    }

    /// A request's prompt tokens, from its bytes: what is no prompt left out.
    pub fn tokens(&self, bytes: u64) -> u64 {
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

impl<'m> Pool<'m> {
    /// The pool of these allocations (a service's video memory on one GPU, allocated in prefill).
    pub fn new(allocations: Vec<&'m Allocation>) -> Pool<'m> {
        Pool { live: Live::of(allocations.iter().copied()), allocations }
    }

    /// Live at `ts`: room a request can reuse.
    pub fn at(&self, ts: u64) -> u64 {
        self.live.at(ts)
    }

    /// What a request that failed alone in prefill needed at least: what it grew the pool by
    /// since it arrived, and the allocation it was refused. A cost from it is an estimate, for a
    /// server met serving with no request measured since: the request would have asked for more
    /// after, and may have reused what the allocator cached before tracing; its bytes that are
    /// no prompt count as prompt.
    pub fn least_need(&self, arrived: u64, failed_at: u64, refused: u64, received: u64) -> Option<Cost> {
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
    pub fn cost(&self, requests: &[&Request]) -> Option<Cost> {
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

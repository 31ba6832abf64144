//! What the model means. Each question the analysis answers has a home of its own, and they
//! build on one another in the order below (each module uses only those above it; see
//! docs/architecture.md):
//! - `sweep`: intervals swept in time order;
//! - `services`: the process trees people think of as one server, and the phase each was in;
//! - `server`, `proxy`: each engine's family and settings, and the LiteLLM deployments in front;
//! - `holders`, `usage`, `nvml`: who holds what, per GPU and process, and NVML beside the trace;
//! - `cost`: what a request costs, from a service's pool for requests;
//! - `accounts`: what a service, a GPU and everyone else held at any moment;
//! - `kept`: what a service kept request after request (its level at rest);
//! - `diagnosis` (which cause), `headroom` (how much more fits) and `whatif` (what a setting
//!   would do): siblings on `accounts`, none importing another.
//!
//! Every module computes typed facts; the words are the report's. Reads the model and the trace
//! header; never the raw events. This file holds the words the analyses share: phases and
//! categories.

pub mod accounts;
pub mod cost;
pub mod diagnosis;
pub mod headroom;
pub mod holders;
pub mod kept;
pub mod nvml;
pub mod proxy;
pub mod server;
pub mod services;
pub mod sweep;
pub mod usage;
pub mod whatif;

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// From start until the service can serve: weights, KV reservation, warm-up.
    Load,
    /// A request has arrived and has not yet received its first data.
    Prefill,
    /// Requests are receiving data, none is in prefill.
    Decode,
    /// Serving, with no request in flight.
    Idle,
}

impl Phase {
    pub const ALL: [Phase; 4] = [Phase::Load, Phase::Prefill, Phase::Decode, Phase::Idle];
    pub fn name(self) -> &'static str {
        match self {
            Phase::Load => "load",
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
            Phase::Idle => "idle",
        }
    }

    pub fn parse(name: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.name() == name)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Category {
    HeldByOtherProcess,
    DoesNotFitAtLoad,
    KeptByService,
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
            Category::KeptByService => "kept-by-service",
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

#[cfg(test)]
pub(crate) mod tests;

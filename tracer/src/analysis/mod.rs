//! What the model means: services (the process trees people think of as one server), the phase
//! each service was in at any moment, and the diagnosis built on them. Reads the model and the
//! trace header; never the raw events.

pub mod diagnosis;

use std::collections::BTreeMap;

use serde::Serialize;

use crate::event::Seen;
use crate::model::{display_command, Model, Request};
use crate::trace::{Header, PriorUse};

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

/// A process tree that is one server: the launched command, or an attached process, and every
/// process it forked. Membership is decided at fork, so an orphan stays in its service.
#[derive(Clone, Debug, Serialize)]
pub struct Service {
    pub root: u32,
    pub name: String,
    pub pids: Vec<u32>,
    /// When it started serving (see [`Services::new`]); None if it never did.
    pub ready_at: Option<u64>,
    pub first_ts: u64,
}

pub struct Services<'m> {
    model: &'m Model,
    pub list: Vec<Service>,
    service_of: BTreeMap<u32, usize>,
}

fn is_completion(r: &Request) -> bool {
    r.line.starts_with("POST ")
}

impl<'m> Services<'m> {
    /// Groups processes into services and finds when each became ready:
    /// - a server that listens only after it allocated (vLLM, SGLang, TGI) is ready when it listens;
    /// - one that listens first and answers 503 while loading (llama-server, Ollama) is ready at its
    ///   first successful response.
    pub fn new(model: &'m Model) -> Services<'m> {
        let mut roots: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for p in model.processes.values() {
            let mut root = p.pid;
            let mut hops = 0;
            while let Some(parent) = model.processes.get(&model.processes[&root].ppid) {
                if model.processes[&root].seen != Seen::Forked || hops > 64 {
                    break;
                }
                root = parent.pid;
                hops += 1;
            }
            roots.entry(root).or_default().push(p.pid);
        }
        let mut list = Vec::new();
        let mut service_of = BTreeMap::new();
        for (root, pids) in roots {
            for &pid in &pids {
                service_of.insert(pid, list.len());
            }
            let first_alloc = model.allocations.iter().filter(|a| pids.contains(&a.pid)).map(|a| a.ts).min();
            let listened = pids.iter().filter_map(|p| model.processes[p].listened).min();
            let requests = model.requests.iter().filter(|r| pids.contains(&r.pid));
            let first_ok = requests.filter_map(|r| Some((r.headers_at?, r.status?))).filter(|(_, s)| (200..300).contains(s)).map(|(t, _)| t).min();
            let ready_at = match (listened, first_alloc) {
                (Some(l), Some(a)) if l > a => Some(l),
                (Some(_), _) => first_ok,
                (None, _) => None,
            };
            let root_p = &model.processes[&root];
            list.push(Service { root, name: root_p.command_line(), pids, ready_at, first_ts: root_p.first_ts });
        }
        Services { model, list, service_of }
    }

    pub fn of(&self, pid: u32) -> Option<&Service> {
        self.service_of.get(&pid).map(|&i| &self.list[i])
    }

    /// The service's completion requests in flight at `ts`.
    pub fn in_flight(&self, service: &Service, ts: u64) -> Vec<&'m Request> {
        self.model.requests.iter().filter(|r| is_completion(r) && service.pids.contains(&r.pid) && r.in_flight_at(ts)).collect()
    }

    /// The phase of `service` at `ts`: its latest explicit mark, else inferred.
    pub fn phase(&self, service: &Service, ts: u64) -> Phase {
        let marked = self.model.marks.iter().filter(|(t, pid, _)| *t <= ts && service.pids.contains(pid)).max_by_key(|(t, _, _)| *t);
        if let Some(phase) = marked.and_then(|(_, _, p)| Phase::parse(p)) {
            return phase;
        }
        if service.ready_at.is_none_or(|ready| ts < ready) {
            return Phase::Load;
        }
        let in_flight = self.in_flight(service, ts);
        if in_flight.iter().any(|r| r.first_data_at.is_none_or(|d| ts < d)) {
            Phase::Prefill
        } else if in_flight.is_empty() {
            Phase::Idle
        } else {
            Phase::Decode
        }
    }

    /// The phase a process's service was in at `ts`.
    pub fn phase_of(&self, pid: u32, ts: u64) -> Phase {
        self.of(pid).map_or(Phase::Load, |s| self.phase(s, ts))
    }
}

/// Who keeps memory NVML counted before recording: the process it names when that is still there
/// with the device files open, else the process outside `inside` that keeps them open (a forked
/// child of a dead owner, an orphaned worker). Its pid and command.
pub fn prior_holder(header: &Header, prior: &PriorUse, inside: impl Fn(u32) -> bool) -> (u32, String) {
    let holder = header
        .holders_at_start
        .iter()
        .find(|h| h.pid == prior.pid)
        .or_else(|| header.holders_at_start.iter().find(|h| !inside(h.pid) && prior.command.is_empty()));
    match holder {
        Some(h) => (h.pid, display_command(&h.command)),
        None => (prior.pid, display_command(&prior.command)),
    }
}

#[cfg(test)]
mod tests;

//! Services: the process trees people think of as one server, when each became ready, and the
//! phase each was in at any moment (from its sockets and marks, in one pass).

use std::collections::BTreeMap;

use serde::Serialize;

use super::{sweep, Phase};
use crate::event::Seen;
use crate::model::{Model, Request};

/// A process tree that is one server: the launched command, or an attached process, and every
/// process it forked. Membership is decided at fork, so an orphan stays in its service.
#[derive(Clone, Debug, Serialize)]
pub struct Service {
    pub root: u32,
    pub name: String,
    /// In ascending order (see [`Service::has`]).
    pub pids: Vec<u32>,
    /// When it started serving (see [`Services::new`]); None if it never did.
    pub ready_at: Option<u64>,
    pub first_ts: u64,
}

pub struct Services<'m> {
    model: &'m Model,
    pub list: Vec<Service>,
    service_of: BTreeMap<u32, usize>,
    /// Per service, the phase and the completions in flight from each instant they change on:
    /// a lookup is a binary search, not a scan of every request.
    timelines: Vec<Vec<(u64, Phase, u32)>>,
}

/// Bytes a request whose head went unseen must have received to count as a completion: a
/// prompt's body, not a health check.
const UNSEEN_HEAD_BODY: u64 = 1024;

/// A completion: a POST; or, on a connection accepted before tracing whose first read was
/// already under way (its head unseen), one that carried a body.
pub(super) fn is_completion(r: &Request) -> bool {
    r.line.starts_with("POST ") || (r.line.is_empty() && r.bytes_in >= UNSEEN_HEAD_BODY)
}

/// A gputrace process (a recording that wraps a server), by its program's name.
fn is_gputrace(p: &crate::model::Process) -> bool {
    p.command.first().is_some_and(|program| program.rsplit('/').next() == Some("gputrace"))
}

/// Programs that start services without being part of one: shells, the ways in (sudo, su, sshd,
/// login), terminal multiplexers, init and service managers, container runtimes' shims.
const NOT_A_SERVICE: [&str; 26] = [
    "sh",
    "bash",
    "dash",
    "zsh",
    "fish",
    "ksh",
    "tcsh",
    "csh",
    "sudo",
    "su",
    "doas",
    "sshd",
    "login",
    "tmux",
    "tmux: server",
    "screen",
    "SCREEN",
    "init",
    "systemd",
    "containerd-shim",
    "containerd-shim-runc-v2",
    "conmon",
    "runc",
    "crun",
    "tini",
    "dumb-init",
];

/// Programs that run a command without being it: a service started under one is named after
/// (and its settings read from) the server it runs. Known by the program's name as the process
/// was started (its argv[0]; the trace records no executable).
const WRAPPERS: [&str; 16] = [
    "timeout",
    "nice",
    "nohup",
    "setsid",
    "env",
    "numactl",
    "taskset",
    "ionice",
    "stdbuf",
    "chrt",
    "prlimit",
    "time",
    "tini",
    "dumb-init",
    "catatonit",
    "s6-svscan",
];

/// Project runners that run a command as their `run` subcommand: `uv run vllm serve ...`.
const RUNNERS: [&str; 5] = ["uv", "poetry", "conda", "pdm", "pipenv"];

/// Whether a process is a wrapper (see [`WRAPPERS`], [`RUNNERS`]) rather than the program it runs.
pub fn is_wrapper(p: &crate::model::Process) -> bool {
    let name = |a: &String| a.rsplit('/').next().unwrap_or(a).to_string();
    match p.command.first().map(name) {
        Some(program) if WRAPPERS.contains(&program.as_str()) => true,
        Some(program) if RUNNERS.contains(&program.as_str()) => p.command.get(1).is_some_and(|a| a == "run"),
        _ => false,
    }
}

/// The process a service is named after: its root, or where the root is a wrapper, the first of
/// its processes (in the order they were met) that is none.
fn named_after<'m>(model: &'m Model, root: u32, pids: &[u32]) -> &'m crate::model::Process {
    let root_p = &model.processes[&root];
    if !is_wrapper(root_p) {
        return root_p;
    }
    let runs = pids.iter().filter_map(|p| model.processes.get(p)).filter(|p| !is_wrapper(p) && !p.command.is_empty());
    runs.min_by_key(|p| (p.first_ts, p.pid)).unwrap_or(root_p)
}

/// Whether a process is one that starts services rather than one of them (by its program's
/// name, a login shell's `-bash` too).
fn starts_services(p: &crate::model::Process) -> bool {
    p.pid == 1
        || p.command.first().is_some_and(|program| {
            let name = program.rsplit('/').next().unwrap_or(program).trim_start_matches('-');
            NOT_A_SERVICE.contains(&name)
        })
}

/// The process a service is named after: what the person started. Climbing from `pid` through
/// its parents (forked ones, and those met running with it), up to but not into a shell, sudo,
/// a multiplexer, init or a container's shim; a launched command (`record -- CMD`) is its own
/// root, and `gputrace record -- CMD` is a wrapper as sudo is (a watch sees it as CMD's parent).
pub fn service_root(model: &Model, pid: u32) -> u32 {
    let mut root = pid;
    let mut hops = 0;
    while let (Some(me), Some(parent)) =
        (model.processes.get(&root), model.processes.get(&model.processes.get(&root).map_or(0, |p| p.ppid)))
    {
        if me.seen == Seen::Launched || hops > 64 || starts_services(parent) || is_gputrace(parent) {
            break;
        }
        root = parent.pid;
        hops += 1;
    }
    root
}

impl Service {
    /// Whether `pid` is one of the service's (a binary search: a service may have thousands).
    pub fn has(&self, pid: u32) -> bool {
        self.pids.binary_search(&pid).is_ok()
    }
}

impl<'m> Services<'m> {
    /// Groups processes into services and finds when each became ready:
    /// - a server that listens only after it allocated (vLLM, SGLang, TGI) is ready when it listens;
    /// - one that listens first and answers 503 while loading (llama-server, Ollama) is ready at its
    ///   first successful response.
    pub fn new(model: &'m Model) -> Services<'m> {
        let mut roots: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for p in model.processes.values() {
            roots.entry(service_root(model, p.pid)).or_default().push(p.pid);
        }
        let mut list: Vec<Service> = Vec::new();
        let mut service_of = BTreeMap::new();
        for (root, pids) in roots {
            for &pid in &pids {
                service_of.insert(pid, list.len());
            }
            let first_ts = model.processes[&root].first_ts;
            list.push(Service { root, name: named_after(model, root, &pids).command_line(), pids, ready_at: None, first_ts });
        }
        // One pass over allocations, requests and marks, each to its service (a trace with many
        // services costs no more than one with a few).
        let n = list.len();
        let mut first_alloc: Vec<Option<u64>> = vec![None; n];
        for a in &model.allocations {
            if let Some(&i) = service_of.get(&a.pid) {
                first_alloc[i] = Some(first_alloc[i].map_or(a.ts, |t: u64| t.min(a.ts)));
            }
        }
        let mut requests: Vec<Vec<&Request>> = vec![Vec::new(); n];
        for r in &model.requests {
            if let Some(&i) = service_of.get(&r.pid) {
                requests[i].push(r);
            }
        }
        let mut marks: Vec<Vec<(u64, Phase)>> = vec![Vec::new(); n];
        for (t, pid, phase) in &model.marks {
            if let (Some(&i), Some(phase)) = (service_of.get(pid), Phase::parse(phase)) {
                marks[i].push((*t, phase));
            }
        }
        for (i, s) in list.iter_mut().enumerate() {
            // Met already listening when tracing began: serving from then on, never loading.
            let attached = |p: &u32| model.processes[p].attached.as_ref().filter(|a| !a.listening.is_empty()).map(|a| a.ts);
            let serving = s.pids.iter().filter_map(attached).min();
            let listened = s.pids.iter().filter_map(|p| model.processes[p].listened).min();
            let served = requests[i].iter().filter_map(|r| Some((r.headers_at?, r.status?)));
            let first_ok = served.filter(|(_, status)| (200..300).contains(status)).map(|(t, _)| t).min();
            s.ready_at = match (serving, listened, first_alloc[i]) {
                (Some(t), _, _) => Some(t),
                (None, Some(l), Some(a)) if l > a => Some(l),
                (None, Some(_), _) => first_ok,
                (None, None, _) => None,
            };
        }
        let timelines = list.iter().zip(&requests).zip(marks).map(|((s, r), m)| timeline(s, r, m)).collect();
        Services { model, list, service_of, timelines }
    }

    pub fn of(&self, pid: u32) -> Option<&Service> {
        self.service_of.get(&pid).map(|&i| &self.list[i])
    }

    /// Where the service of `pid` is in `list`.
    pub fn index_of(&self, pid: u32) -> Option<usize> {
        self.service_of.get(&pid).copied()
    }

    /// The service's completion requests in flight at `ts` (a scan: for the few moments a
    /// diagnosis looks at; counts come from the timeline).
    pub fn in_flight(&self, service: &Service, ts: u64) -> Vec<&'m Request> {
        let mine = |r: &&Request| self.service_of.get(&r.pid).is_some_and(|&i| self.list[i].root == service.root);
        self.model.requests.iter().filter(|r| is_completion(r) && r.in_flight_at(ts)).filter(mine).collect()
    }

    /// Every completion the service received (a scan, for the few services a diagnosis asks about).
    pub fn completions(&self, service: &Service) -> Vec<&'m Request> {
        let mine = |r: &&Request| self.service_of.get(&r.pid).is_some_and(|&i| self.list[i].root == service.root);
        self.model.requests.iter().filter(|r| is_completion(r)).filter(mine).collect()
    }

    /// The service's phase and completions in flight from each instant either changes on, in
    /// time order (the first at 0).
    pub fn timeline(&self, service: &Service) -> &[(u64, Phase, u32)] {
        let index = self.service_of.get(&service.root).copied().expect("a service of this set");
        &self.timelines[index]
    }

    fn at(&self, service: &Service, ts: u64) -> (Phase, usize) {
        let timeline = self.timeline(service);
        match timeline.partition_point(|(t, _, _)| *t <= ts) {
            0 => (Phase::Load, 0),
            i => (timeline[i - 1].1, timeline[i - 1].2 as usize),
        }
    }

    /// The phase of `service` at `ts`: its latest explicit mark, else inferred.
    pub fn phase(&self, service: &Service, ts: u64) -> Phase {
        self.at(service, ts).0
    }

    /// How many completions of `service` were in flight at `ts`.
    pub fn in_flight_count(&self, service: &Service, ts: u64) -> usize {
        self.at(service, ts).1
    }

    /// The phase a process's service was in at `ts`.
    pub fn phase_of(&self, pid: u32, ts: u64) -> Phase {
        self.of(pid).map_or(Phase::Load, |s| self.phase(s, ts))
    }
}

/// The phase, and completions in flight, from every instant either changes on: one sweep over the
/// service's requests (arrival, first data, end), its readiness and its marks (those that name a
/// phase). 16 bytes an instant, and nothing kept but that: a million-event trace has hundreds
/// of thousands of them.
fn timeline(service: &Service, requests: &[&Request], mut marks: Vec<(u64, Phase)>) -> Vec<(u64, Phase, u32)> {
    // (ts, (change in prefill, change in decode)): each completion enters prefill at its
    // arrival, moves to decode at its first data (before its end), leaves at its end.
    let completions = || requests.iter().filter(|r| is_completion(r));
    let data_before_end = |r: &Request| r.first_data_at.filter(|&d| d < r.ended.unwrap_or(u64::MAX));
    let arrivals = sweep::in_time_order(completions().map(|r| (r.arrived, (1i8, 0i8))));
    let data = sweep::in_time_order(completions().filter_map(move |r| Some((data_before_end(r)?, (-1, 1)))));
    let ends = sweep::in_time_order(completions().map(move |r| match data_before_end(r) {
        Some(_) => (r.ended.unwrap_or(u64::MAX), (0, -1)),
        None => (r.ended.unwrap_or(u64::MAX), (-1, 0)),
    }));
    let mut changes = sweep::merged(vec![arrivals, data, ends]).peekable();
    // In time order: the latest at or before an instant is a search. Changes at one instant
    // are applied together, so their order among themselves does not matter.
    marks.sort_by_key(|m| m.0);
    // The instants that are not a request's: the start, readiness and the marks.
    let mut others: Vec<u64> = marks.iter().map(|m| m.0).chain(service.ready_at).chain([0]).collect();
    others.sort_unstable();
    let (mut prefill, mut decode) = (0i64, 0i64);
    let mut other = 0usize;
    let mut out = Vec::new();
    loop {
        let t = match (changes.peek(), others.get(other)) {
            (Some(c), Some(&o)) => c.0.min(o),
            (Some(c), None) => c.0,
            (None, Some(&o)) => o,
            (None, None) => break,
        };
        while let Some((_, (p, d))) = changes.next_if(|c| c.0 <= t) {
            prefill += i64::from(p);
            decode += i64::from(d);
        }
        while others.get(other).is_some_and(|&o| o <= t) {
            other += 1;
        }
        let marked = match marks.partition_point(|(mt, _)| *mt <= t) {
            0 => None,
            i => Some(marks[i - 1].1),
        };
        let inferred = if service.ready_at.is_none_or(|ready| t < ready) {
            Phase::Load
        } else if prefill > 0 {
            Phase::Prefill
        } else if decode > 0 {
            Phase::Decode
        } else {
            Phase::Idle
        };
        // Never negative, even for a trace whose requests end before they arrive.
        out.push((t, marked.unwrap_or(inferred), u32::try_from((prefill + decode).max(0)).unwrap_or(u32::MAX)));
    }
    out
}

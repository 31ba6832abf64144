//! Chrome Trace Event JSON, which Perfetto and chrome://tracing open: a track group per process,
//! counters of live memory by kind and by phase, a track group per GPU with its video memory,
//! capacity and failures, slices for phases and requests, instants for failures, OOM kills and
//! suspect contexts. Times are wall-clock µs.

use std::collections::BTreeMap;
use std::io::{self, Write};

use serde_json::{json, Value};

use super::{live_changes, saturate};
use crate::analysis::services::Services;
use crate::analysis::Phase;
use crate::event::Memory;
use crate::model::Model;
use crate::report::Report;
use crate::trace::Header;

/// The track group of every GPU together, with the verdict (no process has pid 0).
const GPU: u32 = 0;
/// Each GPU's own track group: above any pid (pid_max is at most 2^22).
const GPU_TRACKS: u32 = 1 << 30;

fn gpu_track(gpu: Option<u32>) -> u32 {
    gpu.map_or(GPU, |g| GPU_TRACKS.saturating_add(g))
}

/// Writes events one at a time into the `traceEvents` array.
struct Emitter<'w> {
    out: &'w mut dyn Write,
    first: bool,
    /// Wall clock and monotonic clock at the same instant, from the trace header.
    wall_start_ns: u64,
    mono_start_ns: u64,
}

impl Emitter<'_> {
    fn emit(&mut self, event: Value) -> io::Result<()> {
        self.out.write_all(if self.first { b"{\"traceEvents\":[\n" } else { b",\n" })?;
        self.first = false;
        serde_json::to_writer(&mut *self.out, &event).map_err(io::Error::other)
    }

    /// A record's monotonic time as wall-clock microseconds.
    fn us(&self, ts: u64) -> f64 {
        (i128::from(self.wall_start_ns) + i128::from(ts) - i128::from(self.mono_start_ns)) as f64 / 1000.0
    }

    /// A complete slice on the track (pid, tid), over the span (since, until).
    fn slice(&mut self, name: &str, cat: &str, (pid, tid): (u32, usize), (since, until): (u64, u64), args: Value) -> io::Result<()> {
        let (ts, dur) = (self.us(since), until.saturating_sub(since) as f64 / 1000.0);
        self.emit(json!({"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}))
    }
}

fn clamped<'k>(map: &BTreeMap<&'k str, i128>) -> BTreeMap<&'k str, i64> {
    map.iter().map(|(k, v)| (*k, saturate(*v))).collect()
}

pub fn perfetto(header: &Header, model: &Model, report: &Report, out: &mut dyn Write) -> io::Result<()> {
    let services = Services::new(model);
    let mut e = Emitter { out, first: true, wall_start_ns: header.wall_clock_start_ns, mono_start_ns: header.monotonic_start_ns };
    let first_ts = model.first_ts.unwrap_or(header.monotonic_start_ns);
    let last_ts = model.last_ts.max(first_ts);
    e.emit(json!({"name": "process_name", "ph": "M", "pid": GPU, "args": {"name": "GPUs"}}))?;
    for p in model.processes.values() {
        e.emit(json!({"name": "process_name", "ph": "M", "pid": p.pid, "args": {"name": format!("{} {}", p.pid, p.command_line())}}))?;
    }
    for g in report.gpus.iter().filter(|g| g.gpu.is_some()) {
        let name = format!("GPU {} {}", g.gpu.unwrap_or(0), g.name.as_deref().unwrap_or(""));
        e.emit(json!({"name": "process_name", "ph": "M", "pid": gpu_track(g.gpu), "args": {"name": name.trim_end()}}))?;
        if let Some(capacity) = g.capacity_bytes {
            for ts in [first_ts, last_ts] {
                e.emit(json!({"name": "capacity", "ph": "C", "pid": gpu_track(g.gpu), "ts": e.us(ts), "args": {"bytes": capacity}}))?;
            }
        }
    }
    counters(&mut e, model, &services)?;
    samples(&mut e, report, model)?;
    phase_slices(&mut e, model, &services, last_ts)?;
    request_slices(&mut e, model, last_ts)?;
    instants(&mut e, model, &services, report, last_ts)?;
    let d = &report.diagnosis;
    let verdict = json!({"category": d.category, "symptom": d.symptom, "evidence": d.evidence.text, "fix": d.fix.text});
    let at = d.ts.map_or(last_ts, |t| t.saturating_add(model.time_zero(header.monotonic_start_ns)));
    e.emit(json!({"name": "verdict", "cat": "diagnosis", "ph": "i", "s": "g", "pid": GPU, "ts": e.us(at), "args": verdict}))?;
    e.out.write_all(b"\n],\"displayTimeUnit\":\"ms\"}\n")
}

/// Live memory per process by kind, for the whole GPU, and per service by phase.
fn counters(e: &mut Emitter, model: &Model, services: &Services) -> io::Result<()> {
    let mut by_kind: BTreeMap<u32, BTreeMap<&str, i128>> = BTreeMap::new();
    let mut by_phase: BTreeMap<u32, BTreeMap<&str, i128>> = BTreeMap::new();
    let mut total: BTreeMap<&str, i128> = Memory::ALL.iter().map(|m| (m.name(), 0)).collect();
    let mut on_gpu: BTreeMap<u32, i128> = BTreeMap::new();
    for c in live_changes(model, services) {
        let kinds = by_kind.entry(c.pid).or_insert_with(|| Memory::ALL.iter().map(|m| (m.name(), 0)).collect());
        *kinds.entry(c.memory.name()).or_default() += c.delta;
        *total.entry(c.memory.name()).or_default() += c.delta;
        let ts = e.us(c.ts);
        e.emit(json!({"name": "live memory", "ph": "C", "pid": c.pid, "ts": ts, "args": clamped(kinds)}))?;
        e.emit(json!({"name": "live memory", "ph": "C", "pid": GPU, "ts": ts, "args": clamped(&total)}))?;
        if c.memory == Memory::Video && c.gpu.is_some() {
            let live = on_gpu.entry(gpu_track(c.gpu)).or_default();
            *live += c.delta;
            let args = json!({"bytes": saturate(*live)});
            e.emit(json!({"name": "live video memory", "ph": "C", "pid": gpu_track(c.gpu), "ts": ts, "args": args}))?;
        }
        if c.memory != Memory::Virtual {
            let root = services.of(c.pid).map_or(c.pid, |s| s.root);
            let phases = by_phase.entry(root).or_insert_with(|| Phase::ALL.iter().map(|p| (p.name(), 0)).collect());
            *phases.entry(c.phase.name()).or_default() += c.delta;
            e.emit(json!({"name": "live memory by phase", "ph": "C", "pid": root, "ts": ts, "args": clamped(phases)}))?;
        }
    }
    Ok(())
}

/// NVML's view beside the trace's, from the samples: each GPU's used memory on its track, the
/// host's available memory on the GPUs' (on unified memory, that is the GPU's memory).
fn samples(e: &mut Emitter, report: &Report, model: &Model) -> io::Result<()> {
    for (ts, s) in &model.samples {
        let at = e.us(*ts);
        for g in s.gpus.iter().filter(|g| report.gpus.iter().any(|r| r.gpu == Some(g.gpu))) {
            let args = json!({"bytes": g.used_bytes});
            e.emit(json!({"name": "NVML used", "ph": "C", "pid": gpu_track(Some(g.gpu)), "ts": at, "args": args}))?;
        }
        if let Some(h) = &s.host {
            let args = json!({"available": h.available_bytes, "swap free": h.swap_free_bytes});
            e.emit(json!({"name": "host memory", "ph": "C", "pid": GPU, "ts": at, "args": args}))?;
        }
    }
    Ok(())
}

/// Phase slices per service: the phase changes only where a request starts, gets data or ends,
/// where the service starts serving, or at a mark.
fn phase_slices(e: &mut Emitter, model: &Model, services: &Services, last_ts: u64) -> io::Result<()> {
    for s in &services.list {
        let mut edges: Vec<u64> = vec![s.first_ts, last_ts];
        edges.extend(s.ready_at);
        for r in model.requests.iter().filter(|r| s.pids.contains(&r.pid)) {
            edges.extend([Some(r.arrived), r.first_data_at, r.ended].into_iter().flatten());
        }
        edges.extend(model.marks.iter().filter(|(_, pid, _)| s.pids.contains(pid)).map(|(t, _, _)| *t));
        edges.retain(|&t| t >= s.first_ts && t <= last_ts);
        edges.sort();
        edges.dedup();
        let mut open: Option<(Phase, u64)> = None;
        for &t in &edges {
            let phase = services.phase(s, t);
            match open {
                Some((current, _)) if current == phase => {}
                Some((current, since)) => {
                    e.slice(current.name(), "phase", (s.root, 1), (since, t), json!({}))?;
                    open = Some((phase, t));
                }
                None => open = Some((phase, t)),
            }
        }
        if let Some((current, since)) = open {
            e.slice(current.name(), "phase", (s.root, 1), (since, last_ts.max(since)), json!({}))?;
        }
        e.emit(json!({"name": "thread_name", "ph": "M", "pid": s.root, "tid": 1, "args": {"name": "phase"}}))?;
    }
    Ok(())
}

/// Requests, arrival to end, each on the first lane free at its arrival (slices on one track
/// must not overlap).
fn request_slices(e: &mut Emitter, model: &Model, last_ts: u64) -> io::Result<()> {
    let mut lanes: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for r in &model.requests {
        let end = r.ended.unwrap_or(last_ts).max(r.arrived);
        let pid_lanes = lanes.entry(r.pid).or_default();
        let lane = match pid_lanes.iter().position(|&busy_until| busy_until <= r.arrived) {
            Some(i) => {
                pid_lanes[i] = end;
                i
            }
            None => {
                pid_lanes.push(end);
                pid_lanes.len() - 1
            }
        };
        let name = if r.line.is_empty() { "request" } else { r.line.as_str() };
        let ttfd = r.first_data_at.map(|d| d.saturating_sub(r.arrived) as f64 / 1000.0);
        let args = json!({"bytes_received": r.bytes_in, "bytes_sent": r.bytes_out, "status": r.status, "time_to_first_data_us": ttfd});
        e.slice(name, "request", (r.pid, 100 + lane), (r.arrived, end), args)?;
    }
    for (pid, pid_lanes) in &lanes {
        for lane in 0..pid_lanes.len() {
            e.emit(json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": 100 + lane, "args": {"name": format!("requests {lane}")}}))?;
        }
    }
    Ok(())
}

/// Failed allocations, OOM kills, and the contexts nobody freed.
fn instants(e: &mut Emitter, model: &Model, services: &Services, report: &Report, last_ts: u64) -> io::Result<()> {
    for f in &model.failures {
        let status = (format!("{:#x}", f.status), crate::abi::status::name(f.status));
        let args = json!({"bytes": f.bytes, "kind": f.memory.name(), "status": status.0, "status_name": status.1, "phase": services.phase_of(f.pid, f.ts).name()});
        let ts = e.us(f.ts);
        e.emit(json!({"name": "failed allocation", "cat": "failure", "ph": "i", "s": "p", "pid": f.pid, "ts": ts, "args": args}))?;
        if f.gpu.is_some() {
            let args = json!({"bytes": f.bytes, "pid": f.pid});
            e.emit(json!({"name": "out of memory here", "cat": "failure", "ph": "i", "s": "p", "pid": gpu_track(f.gpu), "ts": ts, "args": args}))?;
        }
    }
    for p in model.processes.values() {
        if let Some(ts) = p.oom_killed {
            let (ts, args) = (e.us(ts), json!({"command": p.command_line()}));
            e.emit(json!({"name": "OOM kill", "cat": "failure", "ph": "i", "s": "p", "pid": p.pid, "ts": ts, "args": args}))?;
        }
    }
    for c in &report.contexts_never_freed {
        let pid = if model.processes.contains_key(&c.pid) { c.pid } else { GPU };
        let args = json!({"pid": c.pid, "command": c.command, "bytes": c.bytes, "why": c.why});
        let ts = e.us(last_ts);
        e.emit(json!({"name": "context never freed", "cat": "suspect", "ph": "i", "s": "g", "pid": pid, "ts": ts, "args": args}))?;
    }
    Ok(())
}

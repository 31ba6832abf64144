//! Exports of a trace for looking at and for scripts: Perfetto (Chrome Trace Event JSON) and CSV.
//! Exporters only read the model and its analysis, and write as they go.

use std::collections::BTreeMap;
use std::io::{self, Write};

use serde_json::{json, Value};

use crate::analysis::{Phase, Services};
use crate::event::Memory;
use crate::model::{FreedBy, Model};
use crate::report::Report;
use crate::trace::Header;

/// One allocation as an export shows it.
pub struct Row<'a> {
    pub allocation: &'a crate::model::Allocation,
    pub command: String,
    pub service: String,
    pub phase: Phase,
    pub in_flight: usize,
}

/// Every allocation with its process, service, phase and requests in flight, in time order,
/// made one at a time as the export writes it.
pub fn rows<'a>(model: &'a Model, services: &'a Services<'a>) -> impl Iterator<Item = Row<'a>> + 'a {
    model.allocations.iter().map(move |a| {
        let service = services.of(a.pid);
        Row {
            allocation: a,
            command: model.processes.get(&a.pid).map(|p| p.command_line()).unwrap_or_default(),
            service: service.map(|s| s.name.clone()).unwrap_or_default(),
            phase: services.phase_of(a.pid, a.ts),
            in_flight: service.map(|s| services.in_flight_count(s, a.ts)).unwrap_or(0),
        }
    })
}

fn freed_by(f: Option<(u64, FreedBy)>) -> &'static str {
    match f.map(|(_, how)| how) {
        Some(FreedBy::Explicit) => "explicit",
        Some(FreedBy::Subtree) => "subtree",
        Some(FreedBy::FileRelease) => "file_release",
        None => "never",
    }
}

fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_string()
    }
}

/// One row per allocation (failed ones too, with their status). Times are ns since the trace start.
pub fn csv(header: &Header, model: &Model, out: &mut dyn Write) -> io::Result<()> {
    let start = header.monotonic_start_ns.min(model.first_ts.unwrap_or(u64::MAX));
    let services = Services::new(model);
    writeln!(out, "allocated_ns,freed_ns,pid,command,service,context,kind,bytes,phase,requests_in_flight,freed_by,status")?;
    for r in rows(model, &services) {
        let a = r.allocation;
        let context = if a.client != 0 { format!("client {:#x}", a.client) } else { "uvm".into() };
        writeln!(
            out,
            "{},{},{},{},{},{},{},{},{},{},{},0",
            a.ts - start,
            a.freed.map(|(t, _)| (t - start).to_string()).unwrap_or_default(),
            a.pid,
            csv_field(&r.command),
            csv_field(&r.service),
            context,
            a.memory.name(),
            a.bytes,
            r.phase.name(),
            r.in_flight,
            freed_by(a.freed),
        )?;
    }
    for f in &model.failures {
        let command = model.processes.get(&f.pid).map(|p| p.command_line()).unwrap_or_default();
        let service = services.of(f.pid).map(|s| s.name.clone()).unwrap_or_default();
        let in_flight = services.of(f.pid).map(|s| services.in_flight_count(s, f.ts)).unwrap_or(0);
        writeln!(
            out,
            "{},,{},{},{},,{},{},{},{},failed,{:#x}",
            f.ts - start,
            f.pid,
            csv_field(&command),
            csv_field(&service),
            f.memory.name(),
            f.bytes,
            services.phase_of(f.pid, f.ts).name(),
            in_flight,
            f.status
        )?;
    }
    Ok(())
}

/// Chrome Trace Event JSON, which Perfetto and chrome://tracing open: a track group per process,
/// counters of live memory by kind and by phase, the card's capacity, slices for phases and
/// requests, instants for failures, OOM kills and suspect contexts. Times are wall-clock µs.
pub fn perfetto(header: &Header, model: &Model, report: &Report, out: &mut dyn Write) -> io::Result<()> {
    let mono = header.monotonic_start_ns;
    let wall_us = |ts: u64| (header.wall_clock_start_ns as i128 + ts as i128 - mono as i128) as f64 / 1000.0;
    let services = Services::new(model);
    let mut first = true;
    let mut emit = |out: &mut dyn Write, event: Value| -> io::Result<()> {
        out.write_all(if first { b"{\"traceEvents\":[\n" } else { b",\n" })?;
        first = false;
        serde_json::to_writer(&mut *out, &event).map_err(io::Error::other)
    };
    const GPU: u32 = 0;
    emit(out, json!({"name": "process_name", "ph": "M", "pid": GPU, "args": {"name": "GPU"}}))?;
    for p in model.processes.values() {
        emit(out, json!({"name": "process_name", "ph": "M", "pid": p.pid, "args": {"name": format!("{} {}", p.pid, p.command_line())}}))?;
    }
    let (first_ts, last_ts) = (model.first_ts.unwrap_or(mono), model.last_ts.max(model.first_ts.unwrap_or(mono)));
    if let Some(capacity) = header.gpus.first().and_then(|g| g.total_bytes) {
        for ts in [first_ts, last_ts] {
            emit(out, json!({"name": "capacity", "ph": "C", "pid": GPU, "ts": wall_us(ts), "args": {"bytes": capacity}}))?;
        }
    }

    // Live memory: +bytes at allocation, -bytes at free, summed in time order per process and
    // per service phase.
    let mut changes: Vec<(u64, u32, Memory, Phase, i128)> = Vec::with_capacity(model.allocations.len() * 2);
    for a in &model.allocations {
        let phase = services.phase_of(a.pid, a.ts);
        changes.push((a.ts, a.pid, a.memory, phase, a.bytes as i128));
        if let Some((t, _)) = a.freed {
            changes.push((t, a.pid, a.memory, phase, -(a.bytes as i128)));
        }
    }
    changes.sort_by_key(|c| (c.0, c.4 > 0));
    let mut by_kind: BTreeMap<u32, BTreeMap<&str, i128>> = BTreeMap::new();
    let mut by_phase: BTreeMap<u32, BTreeMap<&str, i128>> = BTreeMap::new();
    let mut total: BTreeMap<&str, i128> = Memory::ALL.iter().map(|m| (m.name(), 0)).collect();
    for (ts, pid, memory, phase, delta) in changes {
        let kinds = by_kind.entry(pid).or_insert_with(|| Memory::ALL.iter().map(|m| (m.name(), 0)).collect());
        *kinds.entry(memory.name()).or_default() += delta;
        *total.entry(memory.name()).or_default() += delta;
        emit(out, json!({"name": "live memory", "ph": "C", "pid": pid, "ts": wall_us(ts), "args": kinds}))?;
        emit(out, json!({"name": "live memory", "ph": "C", "pid": GPU, "ts": wall_us(ts), "args": total}))?;
        if memory != Memory::Virtual {
            let root = services.of(pid).map_or(pid, |s| s.root);
            let phases = by_phase.entry(root).or_insert_with(|| Phase::ALL.iter().map(|p| (p.name(), 0)).collect());
            *phases.entry(phase.name()).or_default() += delta;
            emit(out, json!({"name": "live memory by phase", "ph": "C", "pid": root, "ts": wall_us(ts), "args": phases}))?;
        }
    }

    // Phase slices per service: the phase changes only where a request starts, gets data or ends,
    // where the service starts serving, or at a mark.
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
                    emit(out, json!({"name": current.name(), "cat": "phase", "ph": "X", "pid": s.root, "tid": 1, "ts": wall_us(since), "dur": (t - since) as f64 / 1000.0}))?;
                    open = Some((phase, t));
                }
                None => open = Some((phase, t)),
            }
        }
        if let Some((current, since)) = open {
            emit(out, json!({"name": current.name(), "cat": "phase", "ph": "X", "pid": s.root, "tid": 1, "ts": wall_us(since), "dur": (last_ts.max(since) - since) as f64 / 1000.0}))?;
        }
        emit(out, json!({"name": "thread_name", "ph": "M", "pid": s.root, "tid": 1, "args": {"name": "phase"}}))?;
    }

    // Requests, arrival to end, each on the first lane free at its arrival (slices on one track
    // must not overlap).
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
        let name = if r.line.is_empty() { "request".to_string() } else { r.line.clone() };
        let args = json!({"bytes_received": r.bytes_in, "bytes_sent": r.bytes_out, "status": r.status, "time_to_first_data_us": r.first_data_at.map(|d| (d - r.arrived) as f64 / 1000.0)});
        emit(out, json!({"name": name, "cat": "request", "ph": "X", "pid": r.pid, "tid": 100 + lane, "ts": wall_us(r.arrived), "dur": (end - r.arrived) as f64 / 1000.0, "args": args}))?;
    }
    for (pid, pid_lanes) in &lanes {
        for lane in 0..pid_lanes.len() {
            emit(out, json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": 100 + lane, "args": {"name": format!("requests {lane}")}}))?;
        }
    }

    for f in &model.failures {
        let args = json!({"bytes": f.bytes, "kind": f.memory.name(), "status": format!("{:#x}", f.status), "phase": services.phase_of(f.pid, f.ts).name()});
        emit(out, json!({"name": "failed allocation", "cat": "failure", "ph": "i", "s": "p", "pid": f.pid, "ts": wall_us(f.ts), "args": args}))?;
    }
    for p in model.processes.values() {
        if let Some(ts) = p.oom_killed {
            emit(out, json!({"name": "OOM kill", "cat": "failure", "ph": "i", "s": "p", "pid": p.pid, "ts": wall_us(ts), "args": {"command": p.command_line()}}))?;
        }
    }
    for c in &report.contexts_never_freed {
        let pid = if model.processes.contains_key(&c.pid) { c.pid } else { GPU };
        let args = json!({"pid": c.pid, "command": c.command, "bytes": c.bytes, "why": c.why});
        emit(out, json!({"name": "context never freed", "cat": "suspect", "ph": "i", "s": "g", "pid": pid, "ts": wall_us(last_ts), "args": args}))?;
    }
    let d = &report.diagnosis;
    let verdict = json!({"category": d.category, "symptom": d.symptom, "evidence": d.evidence.text, "fix": d.fix.text});
    emit(out, json!({"name": "verdict", "cat": "diagnosis", "ph": "i", "s": "g", "pid": GPU, "ts": wall_us(d.ts.map_or(last_ts, |t| t + first_ts.min(mono))), "args": verdict}))?;
    out.write_all(b"\n],\"displayTimeUnit\":\"ms\"}\n")?;
    Ok(())
}

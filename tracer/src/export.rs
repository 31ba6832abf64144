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
        Some(FreedBy::Unseen) => "unseen",
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
            a.ts.saturating_sub(start),
            a.freed.map(|(t, _)| t.saturating_sub(start).to_string()).unwrap_or_default(),
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
            f.ts.saturating_sub(start),
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
        emit(out, json!({"name": "live memory", "ph": "C", "pid": pid, "ts": wall_us(ts), "args": clamped(kinds)}))?;
        emit(out, json!({"name": "live memory", "ph": "C", "pid": GPU, "ts": wall_us(ts), "args": clamped(&total)}))?;
        if memory != Memory::Virtual {
            let root = services.of(pid).map_or(pid, |s| s.root);
            let phases = by_phase.entry(root).or_insert_with(|| Phase::ALL.iter().map(|p| (p.name(), 0)).collect());
            *phases.entry(phase.name()).or_default() += delta;
            emit(out, json!({"name": "live memory by phase", "ph": "C", "pid": root, "ts": wall_us(ts), "args": clamped(phases)}))?;
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
                    emit(
                        out,
                        json!({"name": current.name(), "cat": "phase", "ph": "X", "pid": s.root, "tid": 1, "ts": wall_us(since), "dur": t.saturating_sub(since) as f64 / 1000.0}),
                    )?;
                    open = Some((phase, t));
                }
                None => open = Some((phase, t)),
            }
        }
        if let Some((current, since)) = open {
            emit(
                out,
                json!({"name": current.name(), "cat": "phase", "ph": "X", "pid": s.root, "tid": 1, "ts": wall_us(since), "dur": (last_ts.max(since) - since) as f64 / 1000.0}),
            )?;
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
        let args = json!({"bytes_received": r.bytes_in, "bytes_sent": r.bytes_out, "status": r.status, "time_to_first_data_us": r.first_data_at.map(|d| d.saturating_sub(r.arrived) as f64 / 1000.0)});
        emit(
            out,
            json!({"name": name, "cat": "request", "ph": "X", "pid": r.pid, "tid": 100 + lane, "ts": wall_us(r.arrived), "dur": (end - r.arrived) as f64 / 1000.0, "args": args}),
        )?;
    }
    for (pid, pid_lanes) in &lanes {
        for lane in 0..pid_lanes.len() {
            emit(
                out,
                json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": 100 + lane, "args": {"name": format!("requests {lane}")}}),
            )?;
        }
    }

    for f in &model.failures {
        let args = json!({"bytes": f.bytes, "kind": f.memory.name(), "status": format!("{:#x}", f.status), "status_name": crate::abi::status::name(f.status), "phase": services.phase_of(f.pid, f.ts).name()});
        emit(
            out,
            json!({"name": "failed allocation", "cat": "failure", "ph": "i", "s": "p", "pid": f.pid, "ts": wall_us(f.ts), "args": args}),
        )?;
    }
    for p in model.processes.values() {
        if let Some(ts) = p.oom_killed {
            emit(
                out,
                json!({"name": "OOM kill", "cat": "failure", "ph": "i", "s": "p", "pid": p.pid, "ts": wall_us(ts), "args": {"command": p.command_line()}}),
            )?;
        }
    }
    for c in &report.contexts_never_freed {
        let pid = if model.processes.contains_key(&c.pid) { c.pid } else { GPU };
        let args = json!({"pid": c.pid, "command": c.command, "bytes": c.bytes, "why": c.why});
        emit(
            out,
            json!({"name": "context never freed", "cat": "suspect", "ph": "i", "s": "g", "pid": pid, "ts": wall_us(last_ts), "args": args}),
        )?;
    }
    let d = &report.diagnosis;
    let verdict = json!({"category": d.category, "symptom": d.symptom, "evidence": d.evidence.text, "fix": d.fix.text});
    emit(
        out,
        json!({"name": "verdict", "cat": "diagnosis", "ph": "i", "s": "g", "pid": GPU, "ts": wall_us(d.ts.map_or(last_ts, |t| t.saturating_add(first_ts.min(mono)))), "args": verdict}),
    )?;
    out.write_all(b"\n],\"displayTimeUnit\":\"ms\"}\n")?;
    Ok(())
}

/// Byte sums are kept exact in i128 and written as JSON's 64-bit integers, saturated: a trace
/// with absurd sizes still exports.
fn saturate(v: i128) -> i64 {
    v.clamp(i64::MIN.into(), i64::MAX.into()) as i64
}

fn clamped<'k>(map: &BTreeMap<&'k str, i128>) -> BTreeMap<&'k str, i64> {
    map.iter().map(|(k, v)| (*k, saturate(*v))).collect()
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Stacked series for the HTML chart: per stretch of time its peak and its end state (so drops
/// show where they happen), at most 2 x `points` instants.
fn stacked(changes: &[(u64, usize, i128)], names: &[String], first: u64, last: u64, points: u64) -> Vec<(u64, Vec<i128>)> {
    let width = ((last - first) / points).max(1);
    let mut live: Vec<i128> = vec![0; names.len()];
    let mut out: Vec<(u64, Vec<i128>)> = vec![(first, live.clone())];
    let mut bucket_peak: Option<(u64, Vec<i128>)> = None;
    let mut bucket = 0;
    let mut last_change = first;
    for &(ts, series, delta) in changes {
        let b = ts.saturating_sub(first) / width;
        if b != bucket {
            let peak = bucket_peak.take();
            if let Some((peak_ts, _)) = &peak {
                let end_state = (last_change.max(*peak_ts), live.clone());
                out.extend(peak);
                out.push(end_state);
            }
            bucket = b;
        }
        last_change = ts;
        live[series] += delta;
        let total: i128 = live.iter().sum();
        if bucket_peak.as_ref().is_none_or(|(_, v)| total >= v.iter().sum::<i128>()) {
            bucket_peak = Some((ts, live.clone()));
        }
    }
    out.extend(bucket_peak);
    out.push((last_change, live.clone()));
    out.push((last, live));
    out
}

/// One self-contained HTML page: verdict and fix, a timeline of memory by process and by phase
/// with the capacity line and a marker at each failure (zoom with the wheel, pan by dragging),
/// the contexts never freed, and per-process and per-phase tables.
pub fn html(header: &Header, model: &Model, report: &Report, out: &mut dyn Write) -> io::Result<()> {
    let services = Services::new(model);
    let first = model.first_ts.unwrap_or(header.monotonic_start_ns);
    let last = model.last_ts.max(first.saturating_add(1));
    let physical = || model.allocations.iter().filter(|a| a.memory != Memory::Virtual);
    let label = |pid: u32| format!("{pid} {}", model.processes.get(&pid).map(|p| p.command_line()).unwrap_or_default());
    let mut pids: Vec<u32> = physical().map(|a| a.pid).collect();
    pids.sort();
    pids.dedup();
    let process_names: Vec<String> = pids.iter().map(|&p| label(p)).collect();
    let phase_names: Vec<String> = Phase::ALL.iter().map(|p| p.name().to_string()).collect();
    // Changes name their series by index: a trace has far more changes than series.
    let mut by_process: Vec<(u64, usize, i128)> = Vec::new();
    let mut by_phase: Vec<(u64, usize, i128)> = Vec::new();
    for a in physical() {
        let process = pids.binary_search(&a.pid).expect("listed above");
        let phase = Phase::ALL.iter().position(|p| *p == services.phase_of(a.pid, a.ts)).expect("a phase");
        by_process.push((a.ts, process, a.bytes as i128));
        by_phase.push((a.ts, phase, a.bytes as i128));
        if let Some((t, _)) = a.freed {
            by_process.push((t, process, -(a.bytes as i128)));
            by_phase.push((t, phase, -(a.bytes as i128)));
        }
    }
    by_process.sort_by_key(|c| (c.0, c.2 > 0));
    by_phase.sort_by_key(|c| (c.0, c.2 > 0));
    let series = |changes: &[(u64, usize, i128)], names: &[String]| {
        let points: Vec<Value> = stacked(changes, names, first, last, 1000)
            .into_iter()
            .map(|(t, v)| json!([t.saturating_sub(first) as f64 / 1e9, v.into_iter().map(saturate).collect::<Vec<_>>()]))
            .collect();
        json!({"names": names, "points": points})
    };
    let mut markers: Vec<Value> = model
        .failures
        .iter()
        .map(|f| json!({"t": f.ts.saturating_sub(first) as f64 / 1e9, "label": format!("failed: {} (pid {})", crate::units::bytes(f.bytes), f.pid)}))
        .collect();
    markers.extend(
        model.processes.values().filter_map(|p| {
            Some(json!({"t": p.oom_killed?.saturating_sub(first) as f64 / 1e9, "label": format!("OOM kill: pid {}", p.pid)}))
        }),
    );
    let data = json!({
        "capacity": header.gpus.first().and_then(|g| g.total_bytes),
        "end": last.saturating_sub(first) as f64 / 1e9,
        "process": series(&by_process, &process_names),
        "phase": series(&by_phase, &phase_names),
        "markers": markers,
    });

    let d = &report.diagnosis;
    let (category, symptom) = (d.category.name(), d.symptom.name());
    let b = crate::units::bytes;
    let mut tables = String::new();
    if !report.contexts_never_freed.is_empty() {
        tables += "<h2>Contexts never freed</h2><table><tr><th>pid</th><th>command</th><th>bytes</th><th>why</th></tr>";
        for c in &report.contexts_never_freed {
            tables +=
                &format!("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", c.pid, escape(&c.command), b(c.bytes), escape(&c.why));
        }
        tables += "</table>";
    }
    tables += "<h2>Processes</h2><table><tr><th>pid</th><th>command</th><th>allocations</th><th>allocated</th><th>freed</th><th>peak</th><th>live at end</th><th>failed</th></tr>";
    for p in &report.processes {
        tables += &format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            p.pid,
            escape(&p.command),
            p.allocations,
            b(p.bytes_allocated),
            b(p.bytes_freed),
            b(p.bytes_peak),
            b(p.bytes_live),
            p.failed_allocations
        );
    }
    tables +=
        "</table><h2>Bytes allocated by phase</h2><table><tr><th>pid</th><th>load</th><th>prefill</th><th>decode</th><th>idle</th></tr>";
    for p in &report.processes {
        let get = |ph: &str| b(p.by_phase.get(ph).copied().unwrap_or(0));
        tables += &format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            p.pid,
            get("load"),
            get("prefill"),
            get("decode"),
            get("idle")
        );
    }
    tables += "</table>";
    let verdict = if category == "none" {
        format!("<div class=\"verdict ok\"><h1>No out-of-memory</h1><p>{}</p></div>", escape(&d.evidence.text))
    } else {
        format!(
            "<div class=\"verdict\"><h1>{} <small>({})</small></h1><p>{}</p><p class=\"fix\"><b>Fix:</b> {}</p></div>",
            escape(category),
            escape(symptom),
            escape(&d.evidence.text),
            escape(&d.fix.text)
        )
    };
    let loss = if report.loss.is_lossless() {
        "Lost events: 0.".to_string()
    } else {
        format!("INCOMPLETE: {} records lost in the kernel.", report.loss.lost_records)
    };
    write!(
        out,
        r##"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gputrace: {title}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.5em auto; max-width: 72em; padding: 0 1em; color: #222; }}
.verdict {{ border-left: 6px solid #c0392b; background: #fdf0ee; padding: .5em 1em; }}
.verdict.ok {{ border-color: #27ae60; background: #eefaf2; }}
.verdict h1 {{ margin: .2em 0; font-size: 1.5em; }} .fix {{ font-size: 1.1em; }}
#chart {{ width: 100%; height: 22em; border: 1px solid #ccc; cursor: grab; user-select: none; }}
table {{ border-collapse: collapse; margin: .5em 0 1.5em; }} td, th {{ border: 1px solid #ddd; padding: .2em .6em; text-align: right; }}
td:nth-child(2), th:nth-child(2), td:last-child {{ text-align: left; }}
.controls button {{ margin-right: .5em; }} .legend span {{ margin-right: 1em; white-space: nowrap; }}
.legend i {{ display: inline-block; width: .9em; height: .9em; margin-right: .3em; vertical-align: middle; }}
@media print {{ .controls {{ display: none; }} #chart {{ border: none; }} }}
</style></head><body>
{verdict}
<p class="meta">{trace} · driver {driver} · {events} events · {loss}</p>
<h2>Memory over time</h2>
<div class="controls"><button id="by-process">by process</button><button id="by-phase">by phase</button><button id="reset">reset zoom</button> wheel: zoom · drag: pan</div>
<svg id="chart" role="img" aria-label="GPU memory over time"></svg>
<div class="legend" id="legend"></div>
{tables}
<script>
const DATA = {data};
const svg = document.getElementById("chart"), NS = "http://www.w3.org/2000/svg";
const COLORS = ["#2e86de","#e67e22","#27ae60","#8e44ad","#c0392b","#16a085","#f1c40f","#7f8c8d","#d35400","#2c3e50"];
let mode = "process", view = [0, DATA.end || 1];
function gib(b) {{ const u = ["B","KiB","MiB","GiB","TiB"]; let i = 0; while (b >= 1024 && i < 4) {{ b /= 1024; i++; }} return (i ? b.toFixed(1) : b) + " " + u[i]; }}
function el(name, attrs, text) {{ const e = document.createElementNS(NS, name); for (const k in attrs) e.setAttribute(k, attrs[k]); if (text) e.textContent = text; svg.appendChild(e); return e; }}
function draw() {{
  svg.textContent = "";
  const W = svg.clientWidth || 900, H = svg.clientHeight || 350, L = 70, B = 30, T = 10;
  const s = DATA[mode], pts = s.points;
  let top = DATA.capacity || 0;
  for (const [, v] of pts) top = Math.max(top, v.reduce((a, b) => a + b, 0));
  top = top || 1;
  const x = t => L + (t - view[0]) / (view[1] - view[0]) * (W - L - 10), y = b => H - B - b / top * (H - B - T);
  el("clipPath", {{id: "plot"}}).appendChild(Object.assign(document.createElementNS(NS, "rect"), {{}})).setAttribute("x", L);
  const clip = svg.querySelector("#plot rect"); clip.setAttribute("y", 0); clip.setAttribute("width", W - L - 10); clip.setAttribute("height", H);
  const base = pts.map(() => 0);
  // Memory changes in steps: each value holds until the next instant.
  s.names.forEach((name, i) => {{
    const lo = base.slice(), hi = pts.map(([, v], j) => lo[j] + v[i]);
    let d = "";
    pts.forEach(([t], j) => {{ d += (j ? "L" + x(t) + "," + y(hi[j - 1]) + "L" : "M") + x(t) + "," + y(hi[j]); }});
    for (let j = pts.length - 1; j >= 0; j--) {{ const t = pts[j][0]; d += "L" + x(t) + "," + y(lo[j]) + (j ? "L" + x(t) + "," + y(lo[j - 1]) : ""); }}
    el("path", {{d: d + "Z", fill: COLORS[i % COLORS.length], opacity: .75, "clip-path": "url(#plot)"}}).appendChild(document.createElementNS(NS, "title")).textContent = name;
    hi.forEach((h, j) => base[j] = h);
  }});
  if (DATA.capacity) {{ el("line", {{x1: L, x2: W - 10, y1: y(DATA.capacity), y2: y(DATA.capacity), stroke: "#000", "stroke-dasharray": "6 4"}}); el("text", {{x: L + 4, y: y(DATA.capacity) + 14, "font-size": 12}}, "capacity " + gib(DATA.capacity)); }}
  for (const m of DATA.markers) {{ if (m.t < view[0] || m.t > view[1]) continue; el("line", {{class: "failure", x1: x(m.t), x2: x(m.t), y1: T, y2: H - B, stroke: "#c0392b", "stroke-width": 2}}); el("text", {{x: x(m.t) + 4, y: T + 14, fill: "#c0392b", "font-size": 12}}, m.label); }}
  el("line", {{x1: L, x2: W - 10, y1: H - B, y2: H - B, stroke: "#888"}});
  for (let k = 0; k <= 4; k++) {{ const b = top * k / 4; el("text", {{x: L - 6, y: y(b) + 4, "text-anchor": "end", "font-size": 11}}, gib(b)); }}
  for (let k = 0; k <= 5; k++) {{ const t = view[0] + (view[1] - view[0]) * k / 5; el("text", {{x: x(t), y: H - 10, "text-anchor": "middle", "font-size": 11}}, t.toFixed(2) + " s"); }}
  document.getElementById("legend").innerHTML = s.names.map((n, i) => '<span><i style="background:' + COLORS[i % COLORS.length] + '"></i>' + n.replace(/[<>&]/g, "") + "</span>").join("");
}}
svg.addEventListener("wheel", e => {{ e.preventDefault(); const r = svg.getBoundingClientRect(), f = (e.clientX - r.left - 70) / (r.width - 80), t = view[0] + f * (view[1] - view[0]), k = e.deltaY < 0 ? 0.8 : 1.25; view = [t - (t - view[0]) * k, t + (view[1] - t) * k]; draw(); }});
let drag = null;
svg.addEventListener("mousedown", e => drag = [e.clientX, view.slice()]);
window.addEventListener("mouseup", () => drag = null);
window.addEventListener("mousemove", e => {{ if (!drag) return; const dt = (drag[0] - e.clientX) / (svg.clientWidth - 80) * (drag[1][1] - drag[1][0]); view = [drag[1][0] + dt, drag[1][1] + dt]; draw(); }});
document.getElementById("by-process").onclick = () => {{ mode = "process"; draw(); }};
document.getElementById("by-phase").onclick = () => {{ mode = "phase"; draw(); }};
document.getElementById("reset").onclick = () => {{ view = [0, DATA.end || 1]; draw(); }};
window.addEventListener("resize", draw);
draw();
</script></body></html>
"##,
        title = escape(category),
        verdict = verdict,
        trace = escape(&report.trace),
        driver = escape(header.driver_version.as_deref().unwrap_or("unknown")),
        events = report.events,
        loss = loss,
        tables = tables,
        data = data.to_string().replace("</", "<\\/"),
    )
}

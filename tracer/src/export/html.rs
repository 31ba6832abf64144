//! One self-contained HTML page (no network, no external scripts or fonts): verdict and fix, a
//! timeline of memory by process and by phase with the capacity line and a marker at each failure
//! (zoom with the wheel, pan by dragging), one such timeline per GPU where there are several, the
//! contexts never freed, and per-GPU, per-process and per-phase tables. The page itself is page.html; this fills in its `@@NAME@@` places.

use std::io::{self, Write};

use serde::Serialize;
use serde_json::{json, Value};

use super::{live_changes, saturate};
use crate::analysis::services::Services;
use crate::analysis::Phase;
use crate::event::Memory;
use crate::model::Model;
use crate::report::Report;
use crate::trace::Header;
use crate::units::bytes;

const PAGE: &str = include_str!("page.html");

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Writes `template` with each `@@NAME@@` replaced by its value, in one pass: a value (a command
/// line, say) is never searched for places itself.
fn fill(template: &str, values: &[(&str, &str)], out: &mut dyn Write) -> io::Result<()> {
    let mut rest = template;
    while let Some(start) = rest.find("@@") {
        let after = &rest[start + 2..];
        let Some(end) = after.find("@@") else { break };
        let name = &after[..end];
        match values.iter().find(|(n, _)| *n == name) {
            Some((_, value)) => {
                out.write_all(&rest.as_bytes()[..start])?;
                out.write_all(value.as_bytes())?;
                rest = &after[end + 2..];
            }
            None => {
                out.write_all(&rest.as_bytes()[..start + 2])?;
                rest = after;
            }
        }
    }
    out.write_all(rest.as_bytes())
}

/// Stacked series for the HTML chart: per stretch of time its peak and its end state (so drops
/// show where they happen), at most 2 x `points` instants.
fn stacked(changes: &[(u64, usize, i128)], names: &[String], first: u64, last: u64, points: u64) -> Vec<(u64, Vec<i128>)> {
    let width = ((last - first) / points).max(1);
    let mut live: Vec<i128> = vec![0; names.len()];
    let mut out: Vec<(u64, Vec<i128>)> = vec![(first, live.clone())];
    // The bucket's peak: when, the state then, and its total.
    let mut bucket_peak: Option<(u64, Vec<i128>, i128)> = None;
    let (mut bucket, mut total) = (0, 0i128);
    let mut last_change = first;
    for &(ts, series, delta) in changes {
        let b = ts.saturating_sub(first) / width;
        if b != bucket {
            if let Some((peak_ts, peak, _)) = bucket_peak.take() {
                let end_state = (last_change.max(peak_ts), live.clone());
                out.push((peak_ts, peak));
                out.push(end_state);
            }
            bucket = b;
        }
        last_change = ts;
        live[series] += delta;
        total += delta;
        if bucket_peak.as_ref().is_none_or(|(_, _, peak)| total >= *peak) {
            bucket_peak = Some((ts, live.clone(), total));
        }
    }
    out.extend(bucket_peak.map(|(ts, peak, _)| (ts, peak)));
    out.push((last_change, live.clone()));
    out.push((last, live));
    out
}

/// Processes drawn as series of their own, the biggest at their peak; the rest are drawn as one,
/// `other` (a chart of thousands of series reads as nothing, and each cost every point a value).
const TOP_PROCESSES: usize = 24;

/// The series of each process's changes (`pids` in order): its own for the [`TOP_PROCESSES`]
/// biggest at their peak, the last one, `other`, for the rest; and the series' names.
fn process_series(changes: &[&super::Change], pids: &[u32], label: impl Fn(u32) -> String) -> (Vec<usize>, Vec<String>) {
    let index = |pid: u32| pids.binary_search(&pid).expect("listed");
    let (mut live, mut peak) = (vec![0i128; pids.len()], vec![0i128; pids.len()]);
    for c in changes {
        let i = index(c.pid);
        live[i] += c.delta;
        peak[i] = peak[i].max(live[i]);
    }
    if pids.len() <= TOP_PROCESSES {
        return ((0..pids.len()).collect(), pids.iter().map(|&p| label(p)).collect());
    }
    let mut biggest: Vec<usize> = (0..pids.len()).collect();
    biggest.sort_by_key(|&i| (std::cmp::Reverse(peak[i]), i));
    biggest.truncate(TOP_PROCESSES);
    biggest.sort();
    let mut series = vec![TOP_PROCESSES; pids.len()];
    for (s, &i) in biggest.iter().enumerate() {
        series[i] = s;
    }
    let mut names: Vec<String> = biggest.iter().map(|&i| label(pids[i])).collect();
    names.push(format!("other ({} processes)", pids.len() - TOP_PROCESSES));
    (series, names)
}

/// The chart's data: both stacked series (by process and by phase), the capacity and the markers;
/// with several GPUs the same for each GPU, the page opening on the one the verdict is about.
/// The page's data. The bands hold an edge per request (a busy server has hundreds of thousands):
/// typed vectors, serialised straight to text, not a JSON tree in memory.
#[derive(Serialize)]
struct Chart {
    end: f64,
    all: Value,
    gpus: Vec<Value>,
    initial: Option<usize>,
    bands: Vec<Band>,
    host_available: Vec<(f64, u64)>,
}

/// A service's phases, [from, until, phase], and its completions in flight, [at, count].
#[derive(Serialize)]
struct Band {
    name: String,
    phases: Vec<(f64, f64, &'static str)>,
    in_flight: Vec<(f64, usize)>,
}

fn chart(header: &Header, model: &Model, services: &Services, report: &Report) -> Chart {
    let first = model.first_ts.unwrap_or(header.monotonic_start_ns);
    let last = model.last_ts.max(first.saturating_add(1));
    let changes: Vec<_> = live_changes(model, services).filter(|c| c.memory != Memory::Virtual).collect();
    let at = |ts: u64| ts.saturating_sub(first) as f64 / 1e9;
    // A failure's marker says its verdict.
    let zero = model.time_zero(header.monotonic_start_ns);
    let label = |what: String, ts: u64| match report.diagnoses.iter().find(|d| d.ts.map(|t| t.saturating_add(zero)) == Some(ts)) {
        Some(d) => format!("{what}: {}", d.category.name()),
        None => what,
    };
    let failures = model.failures.iter().map(|f| {
        (model.gpu_for(f.pid, f.gpu), json!({"t": at(f.ts), "label": label(format!("failed: {} (pid {})", bytes(f.bytes), f.pid), f.ts)}))
    });
    let kills = model.processes.values().filter_map(|p| {
        let ts = p.oom_killed?;
        Some((None, json!({"t": at(ts), "label": label(format!("OOM kill: pid {}", p.pid), ts)})))
    });
    let markers: Vec<(Option<u32>, Value)> = failures.chain(kills).collect();
    // One view: the changes `keep` selects, stacked by process and by phase.
    let view = |keep: &dyn Fn(&super::Change) -> bool, capacity: Option<u64>, gpu: Option<u32>| {
        let changes: Vec<&super::Change> = changes.iter().filter(|c| keep(c)).collect();
        let mut pids: Vec<u32> = changes.iter().map(|c| c.pid).collect();
        pids.sort();
        pids.dedup();
        let label = |pid: u32| format!("{pid} {}", model.processes.get(&pid).map(|p| p.command_line()).unwrap_or_default());
        let (series_of, process_names) = process_series(&changes, &pids, label);
        let phase_names: Vec<String> = Phase::ALL.iter().map(|p| p.name().to_string()).collect();
        // Changes name their series by index: a trace has far more changes than series.
        let by_process: Vec<(u64, usize, i128)> =
            changes.iter().map(|c| (c.ts, series_of[pids.binary_search(&c.pid).expect("listed above")], c.delta)).collect();
        let by_phase: Vec<(u64, usize, i128)> =
            changes.iter().map(|c| (c.ts, Phase::ALL.iter().position(|p| *p == c.phase).expect("a phase"), c.delta)).collect();
        let series = |changes: &[(u64, usize, i128)], names: &[String]| {
            let points: Vec<Value> = stacked(changes, names, first, last, 1000)
                .into_iter()
                .map(|(t, v)| json!([at(t), v.into_iter().map(saturate).collect::<Vec<_>>()]))
                .collect();
            json!({"names": names, "points": points})
        };
        let markers: Vec<&Value> = markers.iter().filter(|(g, _)| gpu.is_none() || g.is_none() || *g == gpu).map(|(_, m)| m).collect();
        json!({
            "capacity": capacity,
            "process": series(&by_process, &process_names),
            "phase": series(&by_phase, &phase_names),
            "markers": markers,
        })
    };
    let single = report.gpus.len() <= 1;
    let all = view(&|_| true, if single { report.gpus.first().and_then(|g| g.capacity_bytes) } else { None }, None);
    let per_gpu: Vec<(Option<u32>, Value)> = if single {
        Vec::new()
    } else {
        report
            .gpus
            .iter()
            .filter(|g| g.peak_bytes > 0 || g.failed_allocations > 0)
            .map(|g| {
                let label = match g.gpu {
                    Some(i) => format!("GPU {i}"),
                    None => "GPU ?".to_string(),
                };
                let mut v = view(&|c| c.gpu == g.gpu && c.memory == Memory::Video, g.capacity_bytes, g.gpu);
                v["label"] = json!(label);
                (g.gpu, v)
            })
            .collect()
    };
    let initial = report.diagnosis.gpu.and_then(|d| per_gpu.iter().position(|(g, _)| *g == Some(d)));
    let bands = bands(model, services, first, last);
    // On unified memory the host's available memory is the GPU's: drawn over the chart.
    let unified = header.nvml == "ok" && !header.gpus.is_empty() && header.gpus.iter().all(|g| g.total_bytes.is_none());
    let host_available = if unified {
        model.samples.iter().filter_map(|(t, s)| Some((at(*t), s.host.as_ref()?.available_bytes))).collect()
    } else {
        Vec::new()
    };
    Chart { end: at(last), all, gpus: per_gpu.into_iter().map(|(_, v)| v).collect(), initial, bands, host_available }
}

/// Under the chart, per service that allocated or served: its phases as bands and its
/// completions in flight, so which of the four it was shows before any reading.
fn bands(model: &Model, services: &Services, first: u64, last: u64) -> Vec<Band> {
    let at = |ts: u64| ts.saturating_sub(first) as f64 / 1e9;
    // Which services allocated or served, in one pass (not one per service).
    let mut active = vec![false; services.list.len()];
    let users = model.allocations.iter().map(|a| a.pid).chain(model.requests.iter().map(|r| r.pid));
    for i in users.filter_map(|pid| services.index_of(pid)) {
        active[i] = true;
    }
    services
        .list
        .iter()
        .zip(active)
        .filter(|(_, active)| *active)
        .map(|(s, _)| {
            let timeline = services.timeline(s);
            let edges: Vec<(f64, &'static str, usize)> = timeline
                .iter()
                .map(|(t, phase, n)| (at((*t).max(s.first_ts)), phase.name(), *n as usize))
                .filter(|(t, _, _)| *t <= at(last))
                .collect();
            let mut phases: Vec<(f64, f64, &'static str)> = Vec::new();
            for (i, (t, phase, _)) in edges.iter().enumerate() {
                let until = edges.get(i + 1).map_or(at(last), |e| e.0);
                match phases.last_mut() {
                    Some(open) if open.2 == *phase => open.1 = until,
                    _ => phases.push((*t, until, phase)),
                }
            }
            let in_flight = edges.iter().map(|(t, _, n)| (*t, *n)).collect();
            Band { name: format!("{} {}", s.root, s.name), phases, in_flight }
        })
        .collect()
}

/// The verdict box and the tables under the chart.
fn verdict_and_tables(report: &Report) -> (String, String) {
    let d = &report.diagnosis;
    let (category, symptom) = (d.category.name(), d.symptom.name());
    let b = bytes;
    let mut tables = String::new();
    if !report.contexts_never_freed.is_empty() {
        tables += "<h2>Contexts never freed</h2><table><tr><th>pid</th><th>command</th><th>bytes</th><th>why</th></tr>";
        for c in &report.contexts_never_freed {
            tables += &format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                c.pid,
                escape(&c.command),
                c.bytes.map_or("?".into(), b),
                escape(&c.why.to_string())
            );
        }
        tables += "</table>";
    }
    if !report.nvml_vs_traced.is_empty() {
        tables += "<h2>NVML and the trace disagree</h2><table><tr><th>pid</th><th>command</th><th>at</th><th>NVML</th><th>traced</th><th>why</th></tr>";
        for d in &report.nvml_vs_traced {
            tables += &format!(
                "<tr><td>{}</td><td>{}</td><td>{:.2} s</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                d.pid,
                escape(&d.command),
                d.ts as f64 / 1e9,
                b(d.nvml_bytes),
                b(d.traced_bytes),
                escape(&d.why.to_string())
            );
        }
        tables += "</table>";
    }
    if report.gpus.len() > 1 {
        tables += "<h2>GPUs</h2><table><tr><th>gpu</th><th>name</th><th>capacity</th><th>held before recording</th><th>peak traced</th><th>live at end</th><th>failed</th></tr>";
        for g in &report.gpus {
            tables += &format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(&crate::report::reasons::gpu_label(g)),
                escape(g.name.as_deref().unwrap_or("?")),
                g.capacity_bytes.map_or("?".into(), b),
                b(g.held_before_bytes),
                b(g.peak_bytes),
                b(g.live_bytes),
                g.failed_allocations
            );
        }
        tables += "</table>";
    }
    tables += "<h2>Processes</h2><table><tr><th>pid</th><th>command</th><th>allocations</th><th>allocated</th><th>freed</th><th>peak</th><th>live at end</th><th>failed</th><th>NVML peak</th></tr>";
    for p in &report.processes {
        tables += &format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            p.pid,
            escape(&p.command),
            p.allocations,
            b(p.bytes_allocated),
            b(p.bytes_freed),
            b(p.bytes_peak),
            b(p.bytes_live),
            p.failed_allocations,
            p.nvml_peak_bytes.map_or_else(|| "-".into(), b)
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
    let headroom: String = report
        .headroom
        .iter()
        .map(|h| format!("<p class=\"headroom\"><b>Headroom:</b> {}.</p>", escape(&crate::report::headroom::line(h))))
        .collect();
    let verdict = if category == "none" {
        format!("<div class=\"verdict ok\"><h1>No out-of-memory</h1><p>{}</p>{headroom}</div>", escape(&d.evidence.text))
    } else {
        format!(
            "<div class=\"verdict\"><h1>{} <small>({})</small></h1><p>{}</p><p class=\"fix\"><b>Fix:</b> {}</p>{headroom}</div>",
            escape(category),
            escape(symptom),
            escape(&format!("{}{}", d.evidence.text, d.repeats())),
            escape(&d.fix.text)
        )
    };
    (verdict, tables)
}

pub fn html(header: &Header, model: &Model, report: &Report, out: &mut dyn Write) -> io::Result<()> {
    let services = Services::new(model);
    let data = serde_json::to_string(&chart(header, model, &services, report)).map_err(io::Error::other)?.replace("</", "<\\/");
    let (verdict, tables) = verdict_and_tables(report);
    let loss = if report.loss.is_lossless() {
        "Lost events: 0.".to_string()
    } else {
        format!("INCOMPLETE: {} records lost in the kernel.", report.loss.lost_records)
    };
    let values = [
        ("TITLE", escape(report.diagnosis.category.name())),
        ("VERDICT", verdict),
        ("TRACE", escape(&report.trace)),
        ("DRIVER", escape(header.driver_version.as_deref().unwrap_or("unknown"))),
        ("EVENTS", report.events.to_string()),
        ("LOSS", loss),
        ("TABLES", tables),
        ("DATA", data),
    ];
    let values: Vec<(&str, &str)> = values.iter().map(|(n, v)| (*n, v.as_str())).collect();
    fill(PAGE, &values, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gap to NVML is a table of the page, its command escaped.
    /// Thirty processes: the 24 biggest at their peak are drawn as themselves, in pid order, the
    /// other six as one; each change still counts in the series it is drawn in.
    #[test]
    fn the_biggest_processes_are_drawn_and_the_rest_as_one() {
        let change = |ts, pid, delta| super::super::Change { ts, pid, memory: Memory::Video, gpu: None, phase: Phase::Load, delta };
        // pid p peaks at p bytes, then frees it; pid 100 (the smallest at its end) peaked highest.
        let mut changes: Vec<super::super::Change> =
            (1..30).flat_map(|p| [change(p as u64, p, p.into()), change(100, p, -i128::from(p))]).collect();
        changes.extend([change(1, 100, 1000), change(2, 100, -999)]);
        let refs: Vec<&super::super::Change> = changes.iter().collect();
        let mut pids: Vec<u32> = changes.iter().map(|c| c.pid).collect();
        pids.sort();
        pids.dedup();
        let (series, names) = process_series(&refs, &pids, |p| p.to_string());
        let drawn: Vec<String> = (7..30).chain([100]).map(|p: u32| p.to_string()).collect();
        assert_eq!(names[..TOP_PROCESSES], drawn[..]);
        assert_eq!(names[TOP_PROCESSES], "other (6 processes)");
        assert_eq!(series[..6], [TOP_PROCESSES; 6], "pids 1 to 6");
        assert_eq!(series[6..], (0..TOP_PROCESSES).collect::<Vec<_>>()[..]);
        // Few processes: each its own, in order.
        let (series, names) = process_series(&refs[..4], &[1, 2], |p| p.to_string());
        assert_eq!((series, names), (vec![0, 1], vec!["1".to_string(), "2".to_string()]));
    }

    #[test]
    fn the_gap_to_nvml_is_shown() {
        use crate::report::{Disagreement, Loss, Report};
        let mut report = Report::new(&Header::default(), &Model::new(), String::new(), 0, Loss::default(), u64::MAX);
        let (_, tables) = verdict_and_tables(&report);
        assert!(!tables.contains("NVML and the trace disagree"));
        report.nvml_vs_traced.push(Disagreement {
            pid: 7,
            command: "<script>".into(),
            ts: 2_000_000_000,
            nvml_bytes: 4 << 30,
            traced_bytes: 1 << 30,
            why: crate::analysis::nvml::Gap::NvmlAbove,
        });
        let (_, tables) = verdict_and_tables(&report);
        assert!(tables.contains("<h2>NVML and the trace disagree</h2>") && tables.contains("2.00 s"), "{tables}");
        assert!(tables.contains("&lt;script&gt;") && !tables.contains("<script>"), "{tables}");
    }

    #[test]
    fn places_are_filled_once_and_values_never_rescanned() {
        let mut out = Vec::new();
        fill("<t>@@A@@</t>@@B@@ @@C@@", &[("A", "x@@B@@y"), ("B", "<b>")], &mut out).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "<t>x@@B@@y</t><b> @@C@@", "an unknown place stays as written");
    }
}

//! `/metrics` of `gputrace watch`, in Prometheus's text format: what is live now (from the
//! report of the live model), what has happened since watching began (the flight recorder's
//! counters) and what the tracer itself costs. Label sets are bounded: the services and
//! processes holding most, the rest summed under `other`. Names and units in docs/metrics.md.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::analysis::headroom::{Headroom, Moment};
use crate::flight::Counters;
use crate::model::Model;
use crate::report::{ProcessReport, Report};

/// Services and processes given a series of their own; the rest are summed.
pub const TOP_SERVICES: usize = 20;
pub const TOP_PROCESSES: usize = 10;
/// Label values (command lines, service names) are cut to this many characters.
const LABEL_CHARS: usize = 120;

/// What the watch knows beside the live model.
pub struct Figures<'a> {
    pub report: &'a Report,
    pub model: &'a Model,
    pub counters: &'a Counters,
    pub window_bytes: usize,
    /// Diagnoses of the dumps written so far, by category.
    pub diagnoses: &'a BTreeMap<String, u64>,
    pub now: u64,
}

#[derive(Default)]
struct Text {
    out: String,
}

impl Text {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }
    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }
    fn one(&mut self, name: &str, kind: &str, help: &str, value: f64) {
        self.family(name, kind, help);
        self.sample(name, &[], value);
    }
}

/// A label value as the format wants it: backslash, quote and newline escaped, cut short.
fn escape(value: &str) -> String {
    let mut out = String::new();
    for c in value.chars().take(LABEL_CHARS) {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c if c.is_control() => out.push('?'),
            c => out.push(c),
        }
    }
    out
}

/// The top `n` by value, the rest summed under `other`.
fn top<K: Ord + Clone + From<&'static str>>(mut items: Vec<(K, u64)>, n: usize) -> Vec<(K, u64)> {
    items.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    if items.len() > n {
        let rest: u64 = items[n..].iter().map(|i| i.1).fold(0, u64::saturating_add);
        items.truncate(n);
        items.push((K::from("other"), rest));
    }
    items
}

pub fn exposition(f: &Figures) -> String {
    let mut t = Text::default();
    let r = f.report;
    let keepers = keepers(r);
    let kept = live_by_service(&mut t, r, &keepers);
    processes(&mut t, r);
    keeping(&mut t, r);
    live_by_phase(&mut t, r, &keepers, &kept);
    gpus(&mut t, f);
    requests(&mut t, f, &kept);
    headroom(&mut t, r);
    counters(&mut t, f);
    own_cost(&mut t);
    t.out
}

/// A process's service: its own (its command where it has none).
fn service_of(p: &ProcessReport) -> String {
    if p.service.is_empty() {
        p.command.clone()
    } else {
        p.service.clone()
    }
}

/// Each exited process's keeper's service: the live process holding the file its memory lives
/// on (the last, where several do).
fn keepers(r: &Report) -> BTreeMap<u32, String> {
    r.processes.iter().filter(|p| !p.exited).flat_map(|p| p.keeps.iter().map(move |k| (k.pid, service_of(p)))).collect()
}

/// The service a process's live memory counts under: its own, or once it exited its keeper's;
/// None when nothing keeps it.
fn holding(keepers: &BTreeMap<u32, String>, p: &ProcessReport) -> Option<String> {
    if p.exited {
        keepers.get(&p.pid).cloned()
    } else {
        Some(service_of(p))
    }
}

/// Live memory by service and kind; the services kept as labels (the rest are "other").
fn live_by_service(t: &mut Text, r: &Report, keepers: &BTreeMap<u32, String>) -> Vec<String> {
    // Live memory by service and kind. An exited process's memory that a live one keeps alive
    // counts under the keeper's service: Prometheus sees who holds it.
    let mut by_service: BTreeMap<(String, &str), u64> = BTreeMap::new();
    for p in &r.processes {
        let Some(service) = holding(keepers, p) else { continue };
        for (kind, totals) in &p.by_kind {
            let v = by_service.entry((service.clone(), kind)).or_default();
            *v = v.saturating_add(totals.live);
        }
    }
    let mut services: BTreeMap<String, u64> = BTreeMap::new();
    for ((s, _), v) in &by_service {
        let e = services.entry(s.clone()).or_default();
        *e = e.saturating_add(*v);
    }
    let kept: Vec<String> = top(services.into_iter().collect(), TOP_SERVICES).into_iter().map(|(s, _)| s).collect();
    let mut series: BTreeMap<(String, &str), u64> = BTreeMap::new();
    for ((s, kind), v) in by_service {
        let s = if kept.contains(&s) { s } else { "other".into() };
        let e = series.entry((s, kind)).or_default();
        *e = e.saturating_add(v);
    }
    t.family("gputrace_live_bytes", "gauge", "GPU memory live now as traced, by service and memory kind (video, system, virtual).");
    for ((service, kind), v) in &series {
        t.sample("gputrace_live_bytes", &[("service", service), ("memory", kind)], *v as f64);
    }

    kept
}

fn processes(t: &mut Text, r: &Report) {
    // The processes holding most.
    // Where each runs: container id, and the pod's namespace and name where the node names them.
    let place = |p: &ProcessReport| {
        let get = |f: fn(&crate::event::Place) -> &Option<String>| p.place.as_ref().and_then(|pl| f(pl).clone()).unwrap_or_default();
        [get(|pl| &pl.container), get(|pl| &pl.namespace), get(|pl| &pl.pod_name)]
    };
    let procs: Vec<(String, u64)> = r
        .processes
        .iter()
        .filter(|p| !p.exited)
        .map(|p| {
            let [container, namespace, pod] = place(p);
            (format!("{}\u{0}{container}\u{0}{namespace}\u{0}{pod}\u{0}{}", p.pid, p.command), p.bytes_live.saturating_add(p.kept_bytes()))
        })
        .collect();
    t.family(
        "gputrace_process_live_bytes",
        "gauge",
        "Video and system memory live now, for the processes holding most, with what each keeps alive for exited processes (container, namespace, pod: where it runs in one).",
    );
    for (key, v) in top(procs, TOP_PROCESSES) {
        let parts: Vec<&str> = key.splitn(5, '\u{0}').collect();
        let labels: Vec<(&str, &str)> = match parts[..] {
            [pid, container, namespace, pod, command] => {
                vec![("pid", pid), ("container", container), ("namespace", namespace), ("pod", pod), ("command", command)]
            }
            _ => vec![("pid", "other")],
        };
        t.sample("gputrace_process_live_bytes", &labels, v as f64);
    }
}

fn keeping(t: &mut Text, r: &Report) {
    // Who keeps whose memory alive: a live process holding the file an exited one allocated on.
    let keeping: Vec<(String, u64)> = r
        .processes
        .iter()
        .filter(|p| !p.exited)
        .flat_map(|p| p.keeps.iter().map(move |k| (format!("{}\u{0}{}\u{0}{}\u{0}{}", p.pid, p.command, k.pid, k.command), k.bytes)))
        .collect();
    t.family(
        "gputrace_kept_bytes",
        "gauge",
        "Memory an exited process allocated that a live one keeps alive by holding its file (a forked child of a killed server), for the largest.",
    );
    for (key, v) in top(keeping, TOP_PROCESSES) {
        let labels: Vec<(&str, &str)> = match key.splitn(4, '\u{0}').collect::<Vec<_>>()[..] {
            [pid, command, allocator_pid, allocator] => {
                vec![("pid", pid), ("command", command), ("allocator_pid", allocator_pid), ("allocator", allocator)]
            }
            _ => vec![("pid", "other")],
        };
        t.sample("gputrace_kept_bytes", &labels, v as f64);
    }
}

fn live_by_phase(t: &mut Text, r: &Report, keepers: &BTreeMap<u32, String>, kept: &[String]) {
    // Live memory by the phase of its service when it was allocated: load (weights, the KV
    // reserve) against growth while serving (prefill, decode).
    let mut by_phase: BTreeMap<(String, &str), u64> = BTreeMap::new();
    for p in &r.processes {
        let Some(service) = holding(keepers, p) else { continue };
        let service = if kept.contains(&service) { service } else { "other".into() };
        for (phase, v) in &p.live_by_phase {
            let e = by_phase.entry((service.clone(), phase)).or_default();
            *e = e.saturating_add(*v);
        }
    }
    t.family(
        "gputrace_live_bytes_by_phase",
        "gauge",
        "Video and system memory live now, by service and the phase its allocation was made in (load, prefill, decode, idle).",
    );
    for ((service, phase), v) in &by_phase {
        t.sample("gputrace_live_bytes_by_phase", &[("service", service), ("phase", phase)], *v as f64);
    }
}

fn gpus(t: &mut Text, f: &Figures) {
    let r = f.report;
    // Each GPU: its capacity, the driver's count (NVML) and the traced one.
    let sample = f.model.samples.last().map(|(_, s)| s);
    t.family("gputrace_gpu_capacity_bytes", "gauge", "Each GPU's memory as NVML reports it (absent on unified memory without --capacity).");
    for g in &r.gpus {
        if let (Some(gpu), Some(total)) = (g.gpu, g.capacity_bytes) {
            t.sample("gputrace_gpu_capacity_bytes", &[("gpu", &gpu.to_string())], total as f64);
        }
    }
    t.family("gputrace_gpu_used_bytes", "gauge", "Each GPU's used memory as the driver counts it (NVML), beside the traced figure.");
    for u in sample.map(|s| s.gpus.as_slice()).unwrap_or_default() {
        t.sample("gputrace_gpu_used_bytes", &[("gpu", &u.gpu.to_string())], u.used_bytes as f64);
    }
    t.family(
        "gputrace_gpu_traced_live_bytes",
        "gauge",
        "Video memory live now on each GPU as traced (\"unknown\": allocated under a device set up before tracing).",
    );
    for g in &r.gpus {
        let gpu = g.gpu.map_or("unknown".to_string(), |g| g.to_string());
        t.sample("gputrace_gpu_traced_live_bytes", &[("gpu", &gpu)], g.live_bytes as f64);
    }
}

fn requests(t: &mut Text, f: &Figures, kept: &[String]) {
    let r = f.report;
    // Requests in flight, by service.
    let service_of: BTreeMap<u32, &str> =
        r.processes.iter().map(|p| (p.pid, if p.service.is_empty() { p.command.as_str() } else { p.service.as_str() })).collect();
    let mut in_flight: BTreeMap<String, u64> = BTreeMap::new();
    for q in f.model.requests.iter().filter(|q| q.in_flight_at(f.now)) {
        let s = service_of.get(&q.pid).copied().unwrap_or("other");
        let s = if kept.iter().any(|k| k == s) { s } else { "other" };
        *in_flight.entry(s.to_string()).or_default() += 1;
    }
    t.family("gputrace_requests_in_flight", "gauge", "HTTP requests a traced server has received and not yet finished.");
    for (s, n) in &in_flight {
        t.sample("gputrace_requests_in_flight", &[("service", s)], *n as f64);
    }
}

/// The flight recorder's counters and the dumps' verdicts.
fn counters(t: &mut Text, f: &Figures) {
    let r = f.report;
    t.one(
        "gputrace_contexts_never_freed",
        "gauge",
        "Contexts holding memory that no live, active service accounts for (stale holders).",
        r.contexts_never_freed.len() as f64,
    );

    let c = f.counters;
    t.one("gputrace_events_total", "counter", "Events traced since watching began.", c.records as f64);
    t.one("gputrace_allocations_total", "counter", "Allocations the driver granted.", c.allocations as f64);
    t.one("gputrace_allocation_failures_total", "counter", "Allocations the driver refused.", c.failures as f64);
    t.one("gputrace_frees_total", "counter", "Frees asked of the driver (RM_FREE, VID_HEAP_CONTROL FREE, UVM_FREE).", c.frees as f64);
    t.one("gputrace_lost_events_total", "counter", "Events the kernel side dropped (its ring buffer was full).", c.lost as f64);
    t.one("gputrace_dumps_total", "counter", "Dumps written.", c.dumps as f64);
    t.one("gputrace_triggers_total", "counter", "Dump triggers (failed allocations, OOM kills, asked).", c.triggers as f64);
    t.one(
        "gputrace_triggers_suppressed_total",
        "counter",
        "Triggers too soon after a dump (--min-interval), not dumped.",
        c.suppressed as f64,
    );
    t.family("gputrace_diagnoses_total", "counter", "Verdicts of the dumps written, by category.");
    for (category, n) in f.diagnoses {
        t.sample("gputrace_diagnoses_total", &[("category", category)], *n as f64);
    }
    t.one("gputrace_window_bytes", "gauge", "Bytes of encoded events the flight recorder's window holds.", f.window_bytes as f64);
    t.one("gputrace_encoded_bytes_total", "counter", "Bytes of events encoded into the window.", c.encoded_bytes as f64);
}

fn own_cost(t: &mut Text) {
    // The tracer's own cost, under the names Prometheus's client libraries use.
    if let Some(stat) = crate::procfs::stat(std::process::id()) {
        let cpu = stat.cpu_ticks as f64 / crate::procfs::ticks_per_second() as f64;
        t.one("process_cpu_seconds_total", "counter", "CPU time gputrace has used, user and system.", cpu);
    }
    if let Some(rss) = crate::procfs::resident_bytes(std::process::id()) {
        t.one("process_resident_memory_bytes", "gauge", "gputrace's resident memory.", rss as f64);
    }
}

/// One figure of a service's headroom now, where it has one.
type Figure = fn(&Headroom, &Moment) -> Option<f64>;

/// Headroom per running serving service and GPU, the tightest first (bounded: those are the
/// ones to see); and for a service that keeps memory request after request, its rate and when
/// it runs out.
fn headroom(t: &mut Text, r: &Report) {
    let mut rows: Vec<(&Headroom, Moment)> = r.headroom.iter().filter_map(|h| Some((h, h.now?))).collect();
    rows.sort_by_key(|(_, now)| (now.more_requests, now.room_bytes));
    rows.truncate(TOP_SERVICES);
    let per_gpu: [(&str, &str, Figure); 5] = [
        (
            "gputrace_headroom_requests",
            "More requests of the largest size served that fit now beside those in flight, from what one cost (per serving service and GPU).",
            |_, m| Some(m.more_requests as f64),
        ),
        (
            "gputrace_headroom_request_bytes",
            "The largest request, in bytes received, that fits now with nothing else in flight (per serving service and GPU).",
            |_, m| Some(m.largest_fitting_request_bytes as f64),
        ),
        (
            "gputrace_kept_bytes_per_request",
            "Video memory a serving service keeps per request served and never gives back, over its latest requests (0: it gives everything back), per GPU.",
            |h, _| Some(h.kept?.bytes_per_request as f64),
        ),
        (
            "gputrace_requests_until_full",
            "At the rate it keeps memory, requests of the largest size served it can still serve before one no longer fits; present while it keeps memory.",
            |h, _| Some(h.kept?.requests_until_full? as f64),
        ),
        (
            "gputrace_seconds_until_full",
            "The same in seconds, at the recent request rate; present while it keeps memory.",
            |h, _| h.kept?.seconds_until_full,
        ),
    ];
    for (name, help, value) in per_gpu {
        t.family(name, "gauge", help);
        for (h, now) in &rows {
            if let Some(v) = value(h, now) {
                let gpu = h.gpu.map_or_else(|| "unknown".to_string(), |g| g.to_string());
                t.sample(name, &[("service", &h.service), ("gpu", &gpu)], v);
            }
        }
    }
    let name = "gputrace_limit_exceeds_headroom";
    t.family(
        name,
        "gauge",
        "How far a server's own limit is past what memory fits, in its unit: requests at once (bounds concurrency), prompt tokens (context, batch-tokens); present while it is.",
    );
    for (h, _) in &rows {
        let gpu = h.gpu.map_or_else(|| "unknown".to_string(), |g| g.to_string());
        for l in &h.limits_exceeded {
            let limit = format!("{} {}", l.setting, l.value);
            let bounds = serde_json::to_value(l.bounds).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default();
            t.sample(
                name,
                &[("service", &h.service), ("gpu", &gpu), ("limit", &limit), ("bounds", &bounds)],
                l.lets_in().saturating_sub(l.fits) as f64,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped_and_bounded() {
        assert_eq!(escape("a\"b\\c\nd\x1b"), "a\\\"b\\\\c\\nd?");
        assert_eq!(escape(&"x".repeat(500)).len(), LABEL_CHARS);
    }

    /// A server's forked child keeps its memory after the server was killed: the child carries
    /// it in the per-process series and its service's, and the kept series names the allocator;
    /// the report's process table says the same.
    #[test]
    fn memory_kept_alive_is_charged_to_its_keeper() {
        use crate::event::{Alloc, Device, Event, Record, Seen};
        const GIB: u64 = 1 << 30;
        let rec = |ts: u64, pid: u32, event| Record::new(ts, pid, pid, event);
        let records = [
            rec(1, 10, Event::Process { ppid: 1, seen: Seen::Launched, command: vec!["server".into()] }),
            rec(2, 10, Event::Open { fd: 3, file: 1, device: Device::Ctl, cloexec: false }),
            rec(3, 10, Event::Object { fd: 3, client: 0xc1, parent: 0, object: 0xc1, class: 0x41, status: 0, gpu: None }),
            rec(4, 10, Event::Object { fd: 3, client: 0xc1, parent: 0xc1, object: 0xd1, class: 0x80, status: 0, gpu: Some(0) }),
            rec(5, 10, Event::Alloc(Alloc::video(0xc1, 0xd1, 0xa, 8 * GIB))),
            rec(6, 20, Event::Process { ppid: 10, seen: Seen::Forked, command: vec!["server".into(), "--helper".into()] }),
            rec(7, 10, Event::Exit { code: None }),
        ];
        let model = Model::from_records(&records);
        let report = Report::new(&crate::trace::Header::default(), &model, String::new(), 7, Default::default(), u64::MAX);
        let body = exposition(&Figures {
            report: &report,
            model: &model,
            counters: &Counters::default(),
            window_bytes: 0,
            diagnoses: &BTreeMap::new(),
            now: 8,
        });
        for line in [
            "gputrace_kept_bytes{pid=\"20\",command=\"server --helper\",allocator_pid=\"10\",allocator=\"server\"} 8589934592",
            "gputrace_process_live_bytes{pid=\"20\",container=\"\",namespace=\"\",pod=\"\",command=\"server --helper\"} 8589934592",
            "gputrace_live_bytes{service=\"server\",memory=\"video\"} 8589934592",
        ] {
            assert!(body.lines().any(|l| l == line), "{line} in\n{body}");
        }
        assert!(report.text().contains("keeps 8.0 GiB alive for pid 10 (`server`), which exited"), "{}", report.text());
    }

    #[test]
    fn the_rest_is_summed_under_other() {
        let items: Vec<(String, u64)> = (0..30).map(|i| (format!("s{i}"), i)).collect();
        let kept = top(items, 20);
        assert_eq!(kept.len(), 21);
        assert_eq!(kept[0], ("s29".to_string(), 29));
        assert_eq!(kept[20], ("other".to_string(), (0..10).sum()));
    }
}

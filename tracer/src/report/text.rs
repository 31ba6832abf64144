//! The report as text, for a person at a terminal: the verdict first, then per GPU, per process
//! and per phase, the holders nobody accounts for, where NVML disagrees, and what was lost. It
//! prints the facts the report assembled and computes none.

use std::fmt::Write as _;

use super::headroom::table;
use super::reasons::gpu_label;
use super::{GpuReport, ProcessReport, Report};
use crate::analysis::Category;
use crate::event::Memory;
use crate::units::bytes;

pub fn text(report: &Report) -> String {
    let mut out = String::new();
    partial(report, &mut out);
    verdict(report, &mut out);
    gpus(report, &mut out);
    if !report.processes.is_empty() {
        processes(report, &mut out);
        kept_places_and_phases(report, &mut out);
    }
    holders(report, &mut out);
    loss(report, &mut out);
    out
}

/// Whether to colour what goes to a stream: a terminal, and `NO_COLOR` not set (no-color.org).
pub fn colour_wanted(terminal: bool) -> bool {
    terminal && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// The report's text, already made safe for a terminal, with the verdict's headline and its
/// `help:` labels in colour (ANSI SGR): red for an OOM, green for none, yellow for what the trace
/// lacks and what cannot be told.
pub fn painted(text: &str) -> String {
    const RED: &str = "\x1b[1;31m";
    const GREEN: &str = "\x1b[1;32m";
    const YELLOW: &str = "\x1b[1;33m";
    const CYAN: &str = "\x1b[1;36m";
    const RESET: &str = "\x1b[0m";
    let mut out = String::with_capacity(text.len() + 64);
    for line in text.split_inclusive('\n') {
        let (body, end) = line.strip_suffix('\n').map_or((line, ""), |b| (b, "\n"));
        let colour = if body.starts_with("UNDECIDED:") || body.starts_with("UNKNOWN:") || body.starts_with("PARTIAL:") {
            Some(YELLOW)
        } else if body.starts_with("OOM ") {
            Some(RED)
        } else if body.starts_with("OK:") {
            Some(GREEN)
        } else {
            None
        };
        match (colour, body.strip_prefix("   = help:")) {
            (Some(c), _) => out.push_str(&format!("{c}{body}{RESET}{end}")),
            (None, Some(rest)) => out.push_str(&format!("   = {CYAN}help:{RESET}{rest}{end}")),
            (None, None) => out.push_str(line),
        }
    }
    out
}

/// The verdict in one line, where it happened after it (what a watch logs of each dump).
pub fn headline(report: &Report) -> String {
    let b = &report.block;
    match &b.location {
        Some(l) => format!("{}  --> {l}", b.headline),
        None => b.headline.clone(),
    }
}

/// What the trace lacks, before the verdict that rests on it: a verdict of none means nothing
/// failed in the part recorded.
fn partial(report: &Report, out: &mut String) {
    let l = &report.loss;
    let ends = report.duration_ns as f64 / 1e9;
    let none = report.diagnosis.category == Category::None;
    let so = if none { "; nothing failed in the part recorded, which is all a verdict of none says" } else { "" };
    if l.torn_tail || l.damaged_lines > 0 || l.write_error.is_some() {
        let how = match (&l.write_error, l.torn_tail) {
            (Some(e), _) => format!("the recorder stopped writing it ({e})"),
            (None, true) => "it was cut mid-line (the recorder killed, or the file read while written)".to_string(),
            (None, false) => format!("{} of its lines are damaged", l.damaged_lines),
        };
        let _ = writeln!(out, "PARTIAL: the trace ends at {ends:.2} s and {how}: what is not in it is not judged{so}.");
    }
    loaded_before(report, out);
    if l.records_of_processes_not_kept > 0 {
        let _ = writeln!(
            out,
            "PARTIAL: the trace has more than {} processes at once that cannot be forgotten: {} records of processes past them were not followed, and what they did is not judged{so}.",
            crate::model::MAX_PROCESSES,
            l.records_of_processes_not_kept
        );
    }
    if l.lost_records > 0 {
        let _ = writeln!(
            out,
            "PARTIAL: {} records were lost in the kernel (its ring buffer was full): what else held memory then is not known{so}.",
            l.lost_records
        );
    }
}

/// Services that had loaded before the trace began, the first few of them: what the trace
/// holds of them.
fn loaded_before(report: &Report, out: &mut String) {
    const SAID: usize = 4;
    for b in report.loaded_before.iter().take(SAID) {
        let nvml = b.nvml_bytes.map(|n| format!("NVML counted {} for it when tracing began", bytes(n)));
        let text = if b.snapshot_allocations > 0 {
            let nvml = nvml.map(|n| format!("; besides, {n}")).unwrap_or_default();
            format!(
                "`{}` (pid {}) had loaded before this window began: the snapshot at its start holds its {} allocation(s) of {} from before{nvml}; the requests it served before the window are not in it",
                b.service,
                b.pid,
                b.snapshot_allocations,
                bytes(b.snapshot_bytes)
            )
        } else {
            let held = nvml.map_or_else(
                || "how much it held then is unknown (NVML said nothing of it)".to_string(),
                |n| format!("{n}, judged as held from before tracing, not allocation by allocation"),
            );
            format!(
                "`{}` (pid {}) was running when tracing began: its load and the requests it served before are not in the trace; {held}",
                b.service, b.pid
            )
        };
        let _ = writeln!(out, "PARTIAL: {text}.");
    }
    let more = report.loaded_before.len().saturating_sub(SAID);
    if more > 0 {
        let _ = writeln!(out, "PARTIAL: and {more} more services had loaded before the trace began.");
    }
}

/// The verdict, its evidence and fix, notes, the failures after it, the headroom.
fn verdict(report: &Report, out: &mut String) {
    let d = &report.diagnosis;
    out.push_str(&report.block.text());
    if let Some(r) = &d.repeated {
        let last = r.last_ts.map(|t| format!(", the last at +{:.2} s", t as f64 / 1e9)).unwrap_or_default();
        let times = if r.times == 1 { "time" } else { "times" };
        let _ = writeln!(out, "   = the same failure {} more {times}{last} (retries)", r.times);
    }
    for note in &report.notes {
        let _ = writeln!(out, "NOTE: {note}");
    }
    for later in report.diagnoses.iter().skip(1) {
        let _ = writeln!(
            out,
            "then{}: {} — {}{}",
            later.ts.map(|t| format!(" at {:.2} s", t as f64 / 1e9)).unwrap_or_default(),
            later.category.name(),
            later.evidence.text,
            later.repeats()
        );
    }
    if report.failures_not_diagnosed > 0 {
        let _ = writeln!(out, "and {} more failures, not diagnosed one by one", report.failures_not_diagnosed);
    }
    if !report.headroom.is_empty() {
        out.push_str(&table(&report.headroom));
    }
}

/// How long the trace runs, and a row per GPU memory was traced on.
fn gpus(report: &Report, out: &mut String) {
    let seconds = report.duration_ns as f64 / 1e9;
    let _ = writeln!(out, "\n{} events over {seconds:.1} s in {}", report.events, report.trace);
    let traced = |g: &&GpuReport| g.peak_bytes > 0 || g.held_before_bytes > 0 || g.failed_allocations > 0;
    if report.gpus.iter().filter(traced).count() > 0 {
        let _ = writeln!(
            out,
            "\n{:<5} {:<24} {:>11} {:>11} {:>11} {:>9} {:>11} {:>6}",
            "GPU", "NAME", "CAPACITY", "BEFORE", "PEAK", "AT", "LIVE", "FAILED"
        );
        for g in report.gpus.iter().filter(traced) {
            let _ = writeln!(
                out,
                "{:<5} {:<24} {:>11} {:>11} {:>11} {:>9} {:>11} {:>6}",
                gpu_label(g),
                clip(g.name.as_deref().unwrap_or(if g.gpu.is_some() { "?" } else { "(device set up before tracing)" }), 24),
                g.capacity_bytes.map_or("?".into(), bytes),
                bytes(g.held_before_bytes),
                bytes(g.peak_bytes),
                g.peak_ts.map_or("-".into(), |t| format!("{:.2} s", t as f64 / 1e9)),
                bytes(g.live_bytes),
                g.failed_allocations
            );
        }
    }
}

/// A row per process: its allocations, peaks and what is live.
fn processes(report: &Report, out: &mut String) {
    // PEAK is video memory, what runs out on a discrete GPU; pinned host memory beside it.
    // NVML's own peak beside the traced one, where NVML counted any traced process.
    let nvml = report.processes.iter().any(|p| p.nvml_peak_bytes.is_some());
    let _ = writeln!(
        out,
        "\n{:>8}  {:<28} {:>7} {:>11} {:>11} {:>11} {:>11} {:>11} {:>6}{}",
        "PID",
        "COMMAND",
        "ALLOCS",
        "ALLOCATED",
        "FREED",
        "PEAK",
        "HOST PEAK",
        "LIVE",
        "FAILED",
        if nvml { format!(" {:>11}", "NVML PEAK") } else { String::new() }
    );
    for p in &report.processes {
        let peak = |kind: Memory| bytes(p.by_kind.get(kind.name()).map_or(0, |k| k.peak));
        let _ = writeln!(
            out,
            "{:>8}  {:<28} {:>7} {:>11} {:>11} {:>11} {:>11} {:>11} {:>6}{}",
            p.pid,
            clip(&p.command, 28),
            p.allocations,
            bytes(p.bytes_allocated),
            bytes(p.bytes_freed),
            peak(Memory::Video),
            peak(Memory::System),
            bytes(p.bytes_live),
            p.failed_allocations,
            if nvml { format!(" {:>11}", p.nvml_peak_bytes.map_or_else(|| "-".into(), bytes)) } else { String::new() }
        );
    }
}

/// Memory kept alive for exited processes, where each ran, and what each phase allocated.
fn kept_places_and_phases(report: &Report, out: &mut String) {
    // Memory whose allocator exited, under the live process that keeps it.
    for p in &report.processes {
        for k in &p.keeps {
            let _ = writeln!(
                out,
                "{:>8}  keeps {} alive for pid {} (`{}`), which exited: it holds the file that memory lives on",
                p.pid,
                bytes(k.bytes),
                k.pid,
                clip(&k.command, 60)
            );
        }
    }
    // Where each ran, only when some ran in a container, a pod or a pid namespace of its own.
    let placed: Vec<(&ProcessReport, &crate::event::Place)> = report
        .processes
        .iter()
        .filter_map(|p| Some((p, p.place.as_ref()?)))
        .filter(|(_, w)| w.container.is_some() || w.pod.is_some() || w.ns_pid.is_some())
        .collect();
    if !placed.is_empty() {
        let _ = writeln!(out, "\n{:>8}  {:>8}  {:<13} {:<36}   (where each ran)", "PID", "NS PID", "CONTAINER", "POD");
        for (p, w) in placed {
            let ns_pid = w.ns_pid.map_or_else(|| "-".to_string(), |n| n.to_string());
            // NAMESPACE/NAME where the node names the pod, else its UID.
            let pod = match (&w.namespace, &w.pod_name, &w.pod) {
                (Some(namespace), Some(name), _) => format!("{namespace}/{name}"),
                (_, _, Some(uid)) => uid.clone(),
                _ => "-".into(),
            };
            let _ = writeln!(out, "{:>8}  {:>8}  {:<13} {:<36}", p.pid, ns_pid, w.container.as_deref().unwrap_or("-"), pod);
        }
    }
    let _ =
        writeln!(out, "\n{:>8}  {:>11} {:>11} {:>11} {:>11}   (bytes allocated in each phase)", "PID", "LOAD", "PREFILL", "DECODE", "IDLE");
    for p in &report.processes {
        let get = |ph: &str| bytes(p.by_phase.get(ph).copied().unwrap_or(0));
        let _ = writeln!(out, "{:>8}  {:>11} {:>11} {:>11} {:>11}", p.pid, get("load"), get("prefill"), get("decode"), get("idle"));
    }
}

/// Contexts nobody accounts for, and where NVML and the trace disagree.
fn holders(report: &Report, out: &mut String) {
    if !report.contexts_never_freed.is_empty() {
        let _ = writeln!(out, "\nCONTEXTS NEVER FREED");
        for c in &report.contexts_never_freed {
            let since = c.since.map(|s| format!("since {:.2} s", s as f64 / 1e9)).unwrap_or_else(|| "since before recording".into());
            let held = c.bytes.map_or_else(|| "? bytes".to_string(), bytes);
            let _ = writeln!(out, "  pid {} `{}`: {held} {since}: {}", c.pid, clip(&c.command, 60), c.why);
        }
    }
    if !report.nvml_vs_traced.is_empty() {
        let _ = writeln!(out, "\nNVML AND THE TRACE DISAGREE");
        for d in &report.nvml_vs_traced {
            let _ = writeln!(
                out,
                "  pid {} `{}`: NVML {}, traced {} at {:.2} s: {}",
                d.pid,
                clip(&d.command, 40),
                bytes(d.nvml_bytes),
                bytes(d.traced_bytes),
                d.ts as f64 / 1e9,
                d.why
            );
        }
    }
}

/// What the trace may be missing: always said.
fn loss(report: &Report, out: &mut String) {
    let l = &report.loss;
    if let Some(why) = &l.write_error {
        let _ = writeln!(out, "TRACE CUT SHORT: {why}; the report above still covers the whole run, the trace file only up to the error.");
    }
    if l.processes_forgotten > 0 {
        let _ = writeln!(
            out,
            "{} exited processes that never allocated were forgotten as the trace went (more than {} at once): nothing judged was theirs.",
            l.processes_forgotten,
            crate::model::MAX_PROCESSES
        );
    }
    if l.is_lossless() {
        let _ = writeln!(out, "Lost events: 0.");
    } else {
        // The rarer losses, each named only when it happened.
        let rare = [
            (l.fds_not_followed, "device fds not followed (over a million held)"),
            (
                l.handles_not_followed,
                "exported or imported handles not followed (past the first 16 of a batch: their memory's lifetime is not known)",
            ),
            (
                l.own_file_table,
                "fd events in threads with a file table of their own not followed (unshare(CLONE_FILES), close_range(CLOSE_RANGE_UNSHARE): their fd numbers are not their process's)",
            ),
            (l.records_of_processes_not_kept, "records of processes past the bound on processes kept at once not followed"),
            (
                l.foreign_client_calls,
                "calls RM refuses ignored (on another file's client, or taking another process's memory it did not share: params or a fd changed by another thread while the call ran, records lost before, or an edited trace)",
            ),
        ];
        let rare: String = rare.iter().filter(|(n, _)| *n > 0).map(|(n, what)| format!(", {n} {what}")).collect();
        let _ = writeln!(
            out,
            "INCOMPLETE: {} records lost in the kernel (ring buffer full), {} driver calls unreadable, {} damaged trace lines{}{rare}.",
            l.lost_records,
            l.undecodable,
            l.damaged_lines,
            if l.torn_tail { ", torn last line" } else { "" },
        );
    }
}

fn clip(text: &str, width: usize) -> String {
    if text.chars().count() > width {
        text.chars().take(width - 1).collect::<String>() + "…"
    } else {
        text.to_string()
    }
}

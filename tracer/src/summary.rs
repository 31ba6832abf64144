//! The end-of-recording summary: per process what it allocated, freed, peaked at and still held,
//! and what the trace may be missing. Text for a person, JSON for scripts (the per-process part of
//! the report schema, docs/report-schema.md).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::event::Memory;
use crate::model::{Model, Process};

pub const SCHEMA: &str = "gputrace-report/1";

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct KindTotals {
    pub allocated: u64,
    pub freed: u64,
    pub live: u64,
}

/// Physical bytes are video + system; virtual address space is only in `by_kind`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ProcessSummary {
    pub pid: u32,
    pub ppid: u32,
    pub command: String,
    pub allocations: u64,
    pub failed_allocations: u64,
    pub bytes_allocated: u64,
    pub bytes_freed: u64,
    pub bytes_peak: u64,
    pub bytes_live: u64,
    pub by_kind: BTreeMap<&'static str, KindTotals>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    pub exited: bool,
}

/// What the trace may be missing, always reported.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Loss {
    /// Records the kernel had no ring buffer room for.
    pub lost_records: u64,
    /// Followed driver calls whose params could not be read.
    pub undecodable: u64,
    /// Lines of the trace file that were damaged or torn.
    pub damaged_lines: u64,
    pub torn_tail: bool,
}

impl Loss {
    pub fn is_lossless(&self) -> bool {
        *self == Loss::default()
    }
}

/// How the kernel-side fd filter behaved while recording (absent for a report of a trace file).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct FdFilter {
    /// Fds the kernel met without their open and asked about, once each.
    pub questions: u64,
    /// ioctls on such fds sent before the answer, dropped because the fd was not NVIDIA.
    pub pending_dropped: u64,
}

/// Memory still live at the end of the trace on one open file, and who keeps that file open.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Held {
    pub bytes: u64,
    /// Processes that allocated it.
    pub allocated_by: Vec<u32>,
    /// Live processes holding the file open; empty when gputrace saw no holder.
    pub holders: Vec<Holder>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Holder {
    pub pid: u32,
    pub command: String,
    /// The holder did not allocate the memory (a forked child, a process the fd was passed to).
    pub inherited: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub schema: &'static str,
    pub trace: String,
    pub duration_ns: u64,
    pub events: u64,
    pub processes: Vec<ProcessSummary>,
    pub held_at_end: Vec<Held>,
    pub loss: Loss,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fd_filter: Option<FdFilter>,
}

fn physical(map: &BTreeMap<Memory, u64>) -> u64 {
    map.get(&Memory::Video).copied().unwrap_or(0) + map.get(&Memory::System).copied().unwrap_or(0)
}

pub fn process_summary(p: &Process) -> ProcessSummary {
    let u = &p.usage;
    let by_kind = Memory::ALL
        .iter()
        .map(|m| {
            let get = |map: &BTreeMap<Memory, u64>| map.get(m).copied().unwrap_or(0);
            (m.name(), KindTotals { allocated: get(&u.allocated), freed: get(&u.freed), live: get(&u.live) })
        })
        .collect();
    ProcessSummary {
        pid: p.pid,
        ppid: p.ppid,
        command: p.command_line(),
        allocations: u.allocations,
        failed_allocations: u.failed,
        bytes_allocated: physical(&u.allocated),
        bytes_freed: physical(&u.freed),
        bytes_peak: u.peak_physical,
        bytes_live: physical(&u.live),
        by_kind,
        exit_code: p.exit_code,
        exited: p.exited.is_some(),
    }
}

impl Summary {
    pub fn new(model: &Model, trace: String, events: u64, loss: Loss) -> Summary {
        let processes = model
            .processes
            .values()
            .filter(|p| p.usage.allocations > 0 || p.usage.failed > 0)
            .map(process_summary)
            .collect();
        let duration_ns = model.first_ts.map(|f| model.last_ts - f).unwrap_or(0);
        Summary { schema: SCHEMA, trace, duration_ns, events, processes, held_at_end: held(model), loss, fd_filter: None }
    }

    pub fn text(&self) -> String {
        let mut out = String::new();
        let seconds = self.duration_ns as f64 / 1e9;
        let _ = writeln!(out, "gputrace: {} events over {seconds:.1} s written to {}", self.events, self.trace);
        if self.processes.is_empty() {
            let _ = writeln!(out, "No GPU memory was allocated through the NVIDIA driver by the traced processes.");
        } else {
            let _ = writeln!(
                out,
                "\n{:>8}  {:<28} {:>7} {:>11} {:>11} {:>11} {:>11} {:>6}",
                "PID", "COMMAND", "ALLOCS", "ALLOCATED", "FREED", "PEAK", "LIVE", "FAILED"
            );
            for p in &self.processes {
                let mut command = p.command.clone();
                if command.chars().count() > 28 {
                    command = command.chars().take(27).collect::<String>() + "…";
                }
                let _ = writeln!(
                    out,
                    "{:>8}  {:<28} {:>7} {:>11} {:>11} {:>11} {:>11} {:>6}",
                    p.pid,
                    command,
                    p.allocations,
                    bytes(p.bytes_allocated),
                    bytes(p.bytes_freed),
                    bytes(p.bytes_peak),
                    bytes(p.bytes_live),
                    p.failed_allocations
                );
            }
            let _ = writeln!(out, "(bytes are video + system memory; virtual address space is in --json)");
        }
        for h in &self.held_at_end {
            let by: Vec<String> = h.allocated_by.iter().map(|p| p.to_string()).collect();
            let _ = write!(out, "\nStill live at the end: {} allocated by pid {}", bytes(h.bytes), by.join(", "));
            if h.holders.is_empty() {
                let _ = writeln!(out, "; no live holder was seen (held outside the traced processes?)");
            }
            for (i, holder) in h.holders.iter().enumerate() {
                let why = if holder.inherited { " (did not allocate it: inherited or received the file)" } else { "" };
                let lead = if i == 0 { ", held open by" } else { "      and" };
                let _ = writeln!(out, "{lead} pid {} `{}`{why}", holder.pid, holder.command);
            }
        }
        let l = &self.loss;
        if l.is_lossless() {
            let _ = writeln!(out, "Lost events: 0.");
        } else {
            let _ = writeln!(
                out,
                "INCOMPLETE: {} records lost in the kernel (ring buffer full), {} driver calls unreadable, {} damaged trace lines{}.",
                l.lost_records,
                l.undecodable,
                l.damaged_lines,
                if l.torn_tail { ", torn last line" } else { "" }
            );
        }
        out
    }
}

/// Groups the physical memory still live by the file it lives on, with that file's holders.
fn held(model: &Model) -> Vec<Held> {
    let mut by_file: BTreeMap<Option<u64>, (u64, Vec<u32>)> = BTreeMap::new();
    for a in model.live_allocations().filter(|a| a.memory != Memory::Virtual) {
        let entry = by_file.entry(a.file).or_default();
        entry.0 += a.bytes;
        if !entry.1.contains(&a.pid) {
            entry.1.push(a.pid);
        }
    }
    by_file
        .into_iter()
        .map(|(file, (bytes, allocated_by))| {
            let holders = file
                .map(|f| model.holders(f))
                .unwrap_or_default()
                .into_iter()
                .map(|pid| Holder {
                    pid,
                    command: model.processes.get(&pid).map(|p| p.command_line()).unwrap_or_else(|| "?".into()),
                    inherited: !allocated_by.contains(&pid),
                })
                .collect();
            Held { bytes, allocated_by, holders }
        })
        .collect()
}

/// Binary units, as people read memory sizes.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_in_binary_units() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(20 << 20), "20.0 MiB");
        assert_eq!(bytes(80 << 30), "80.0 GiB");
    }
}

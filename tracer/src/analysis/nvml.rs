//! NVML beside the trace: where NVML's count for a traced process and the traced allocations
//! disagree, each process's NVML peak, and memory used on a GPU that no process's figure
//! includes.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use super::sweep::LiveChanges;
use crate::event::Memory;
use crate::model::{add_saturating, Model};
use crate::trace::Header;

/// Where NVML's count for a traced process and the traced allocations disagree, and why.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Disagreement {
    pub pid: u32,
    pub command: String,
    /// When NVML was asked (ns since the trace start).
    pub ts: u64,
    pub nvml_bytes: u64,
    /// Video memory the trace shows live for it at that moment.
    pub traced_bytes: u64,
    /// Worded by the report (`report/reasons.rs`), in its text and its JSON alike.
    pub why: Gap,
}

/// Why NVML and the trace disagree about a process.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Gap {
    /// NVML above: the process allocated before recording began.
    BeforeRecording,
    /// NVML above: memory no traced ioctl shows (its context's own, managed memory, the driver's).
    NvmlAbove,
    /// The trace above: memory shared with or handed to another process, or not yet backed.
    TraceAbove,
}

/// Memory used on a GPU that no process's NVML figure includes: the widest, and when.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Unaccounted {
    pub gpu: u32,
    pub bytes: u64,
    /// Since the trace start.
    pub ts: u64,
}

/// How long before its exit a process counts as exiting, for NVML comparisons.
const EXITING_NS: u64 = 1_000_000_000;

/// NVML's per-process figures against the traced video memory of each traced process, at every
/// sample taken while recording (not only the last: a process that frees before it exits hides
/// its gap from the end): for each process, the sample where they differ most, when that is by
/// 256 MiB and 10% or more.
pub fn disagreements(header: &Header, model: &Model) -> Vec<Disagreement> {
    if header.nvml != "ok" {
        return Vec::new();
    }
    let start = model.time_zero(header.monotonic_start_ns);
    // Traced live video bytes per pid, swept forward through the samples: each allocation's
    // start and end in time order, applied up to each sample's time (what is live at `ts`).
    let mut changes = LiveChanges::of(model.allocations.iter().filter(|a| a.memory == Memory::Video).map(|a| (a, a.pid)));
    let mut samples: Vec<&(u64, crate::event::Sample)> = model.samples.iter().filter(|(_, s)| !s.processes.is_empty()).collect();
    samples.sort_by_key(|(ts, _)| *ts);
    let mut live: HashMap<u32, i128> = HashMap::new();
    let mut worst: BTreeMap<u32, (u64, u64, u64)> = BTreeMap::new();
    // Which way each pid's gap went at the previous sample (true: NVML above the trace). A gap
    // is judged only when it held over two samples: NVML lags the frees a process makes.
    let mut was_above: HashMap<u32, bool> = HashMap::new();
    for (ts, sample) in samples {
        while let Some((_, delta, pid)) = changes.next_if(|c| c.0 <= *ts) {
            let bytes = live.entry(pid).or_default();
            *bytes += delta;
            // Only what is live stays: each sample looks at NVML's pids and these, not at every
            // process ever seen (a day of `record --all` forks).
            if *bytes == 0 {
                live.remove(&pid);
            }
        }
        let mut nvml_of: BTreeMap<u32, u64> = BTreeMap::new();
        for u in &sample.processes {
            add_saturating(nvml_of.entry(u.pid).or_default(), u.used_bytes.unwrap_or(0));
        }
        let mut pids: Vec<u32> = nvml_of.keys().chain(live.keys()).copied().filter(|pid| model.processes.contains_key(pid)).collect();
        pids.sort_unstable();
        pids.dedup();
        let mut above_now = HashMap::new();
        for pid in pids {
            let nvml = nvml_of.get(&pid).copied().unwrap_or(0);
            let traced = u64::try_from(live.get(&pid).copied().unwrap_or(0).max(0)).unwrap_or(u64::MAX);
            let gap = nvml.abs_diff(traced);
            // A process in its last second is tearing down: its frees are traced before NVML sees them.
            let exiting = model.processes[&pid].exited.is_some_and(|exit| (*ts).saturating_add(EXITING_NS) >= exit);
            if gap < 256 << 20 || gap < nvml.max(traced) / 10 || exiting {
                continue;
            }
            above_now.insert(pid, nvml > traced);
            if was_above.get(&pid) != Some(&(nvml > traced)) {
                continue;
            }
            let entry = worst.entry(pid).or_insert((*ts, nvml, traced));
            if gap > entry.1.abs_diff(entry.2) {
                *entry = (*ts, nvml, traced);
            }
        }
        was_above = above_now;
    }
    let mut out = Vec::new();
    for (pid, (ts, nvml, traced)) in worst {
        let p = &model.processes[&pid];
        let before = header.prior_use.iter().any(|u| u.pid == pid && u.used_bytes.unwrap_or(0) > 0);
        let why = if nvml > traced && (before || p.seen == crate::event::Seen::Running) {
            Gap::BeforeRecording
        } else if nvml > traced {
            Gap::NvmlAbove
        } else {
            Gap::TraceAbove
        };
        out.push(Disagreement {
            pid,
            command: p.command_line(),
            ts: ts.saturating_sub(start),
            nvml_bytes: nvml,
            traced_bytes: traced,
            why,
        });
    }
    out
}

/// Per pid, the most device memory NVML counted for it in one sample (summed over its GPUs).
pub fn nvml_peaks(model: &Model) -> HashMap<u32, u64> {
    let mut peaks: HashMap<u32, u64> = HashMap::new();
    for (_, sample) in &model.samples {
        let mut used: HashMap<u32, u64> = HashMap::new();
        for u in &sample.processes {
            add_saturating(used.entry(u.pid).or_default(), u.used_bytes.unwrap_or(0));
        }
        for (pid, bytes) in used {
            let peak = peaks.entry(pid).or_default();
            *peak = (*peak).max(bytes);
        }
    }
    peaks
}

/// Memory used on a GPU that no process's NVML figure includes, beyond what was so at the first
/// sample, when it held over two samples: managed memory touched on the GPU is in the device's
/// used memory and in no process's figure (seen on the real driver). The widest per GPU.
pub fn unaccounted(model: &Model) -> Vec<Unaccounted> {
    let start = model.first_ts.unwrap_or(0);
    let mut samples: Vec<&(u64, crate::event::Sample)> = model.samples.iter().filter(|(_, s)| !s.gpus.is_empty()).collect();
    samples.sort_by_key(|(ts, _)| *ts);
    // Per GPU: the figure at its first sample, at the previous one, and the widest that held.
    let mut first: BTreeMap<u32, u64> = BTreeMap::new();
    let mut previous: BTreeMap<u32, u64> = BTreeMap::new();
    let mut widest: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for (ts, sample) in samples {
        let mut now = BTreeMap::new();
        for g in &sample.gpus {
            let on_it = sample.processes.iter().filter(|p| p.gpu == g.gpu);
            // A process NVML gives no figure for: nothing can be told of this GPU at this sample.
            let Some(counted) = on_it.map(|p| p.used_bytes).try_fold(0u64, |sum, b| Some(sum.saturating_add(b?))) else {
                continue;
            };
            let beyond =
                g.used_bytes.saturating_sub(counted).saturating_sub(*first.entry(g.gpu).or_insert(g.used_bytes.saturating_sub(counted)));
            now.insert(g.gpu, beyond);
            let held = beyond.min(previous.get(&g.gpu).copied().unwrap_or(0));
            if held >= 256 << 20 && widest.get(&g.gpu).is_none_or(|w| held > w.1) {
                widest.insert(g.gpu, (*ts, held));
            }
        }
        previous = now;
    }
    widest.into_iter().map(|(gpu, (ts, bytes))| Unaccounted { gpu, bytes, ts: ts.saturating_sub(start) }).collect()
}

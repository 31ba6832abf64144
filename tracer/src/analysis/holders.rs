//! Holders nobody accounts for: driver contexts still holding memory at the end that no live,
//! active service accounts for, and memory other processes held before recording.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Serialize;

use super::Services;
use crate::event::Memory;
use crate::model::Model;
use crate::trace::Header;

/// A driver context (an open nvidiactl file and the clients on it) still holding memory that no
/// live, active service accounts for; or memory held before recording by another process.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct SuspectContext {
    pub pid: u32,
    pub command: String,
    /// None when nothing can tell (a holder from before recording, with NVML unavailable).
    pub bytes: Option<u64>,
    /// Nanoseconds since the trace start; None when it was already held before recording.
    pub since: Option<u64>,
    pub last_activity: Option<u64>,
    pub why: String,
}

/// Contexts still holding memory at the end that no live, active service accounts for, and
/// memory other processes held before recording.
pub fn suspects(header: &Header, model: &Model, services: &Services, idle_ns: u64) -> Vec<SuspectContext> {
    let start = model.time_zero(header.monotonic_start_ns);
    let end = model.last_ts;
    let mut out = Vec::new();
    // Live memory grouped by the files that keep it: its client's, and those it was exported to
    // or mapped through (memory shared with another process is a suspect of its own).
    let keeping = model.other_files_keeping();
    let holders_of = model.holders_by_file();
    // Each process's last allocation or request, in one pass (not one per group below).
    let mut active: HashMap<u32, u64> = HashMap::new();
    let times = model.allocations.iter().map(|a| (a.pid, a.ts)).chain(model.requests.iter().map(|r| (r.pid, r.ended.unwrap_or(r.arrived))));
    for (pid, ts) in times {
        let last = active.entry(pid).or_insert(ts);
        *last = (*last).max(ts);
    }
    let mut by_files: BTreeMap<(Option<u64>, Vec<u64>), Vec<&crate::model::Allocation>> = BTreeMap::new();
    for (id, a) in model.allocations.iter().enumerate().filter(|(_, a)| a.freed.is_none() && a.memory != Memory::Virtual) {
        let mut others: Vec<u64> = keeping.get(&id).into_iter().flatten().copied().filter(|&f| Some(f) != a.file).collect();
        others.sort_unstable();
        others.dedup();
        by_files.entry((a.file, others)).or_default().push(a);
    }
    for ((file, others), allocs) in by_files {
        let owner = allocs[0].pid;
        let bytes = allocs.iter().map(|a| a.bytes).fold(0, u64::saturating_add);
        let since = allocs.iter().map(|a| a.ts).min().unwrap_or(start);
        // Whoever holds the client's file comes first; then whoever holds a file it went to.
        let (mut holders, mut listed): (Vec<u32>, HashSet<u32>) = (Vec::new(), HashSet::new());
        for f in file.into_iter().chain(others) {
            let these = holders_of.get(&f).map_or(&[][..], Vec::as_slice);
            holders.extend(these.iter().copied().filter(|&h| listed.insert(h)));
        }
        let last_activity = holders.iter().filter_map(|h| active.get(h)).max().copied();
        let owner_exited = model.processes.get(&owner).is_some_and(|p| p.exited.is_some());
        let orphan =
            holders.iter().find(|&&h| model.processes.get(&model.processes[&h].ppid).is_some_and(|parent| parent.exited.is_some()));
        let why = if owner_exited && !holders.is_empty() {
            let h = holders[0];
            format!(
                "its owner pid {owner} exited; pid {h} (`{}`) still holds the device file, without having allocated it",
                model.processes[&h].command_line()
            )
        } else if let Some(&h) = orphan {
            format!("pid {h} is an orphan: its parent pid {} exited", model.processes[&h].ppid)
        } else if last_activity.is_some_and(|t| end.saturating_sub(t) >= idle_ns) {
            format!("no allocation or request for {} s", end.saturating_sub(last_activity.unwrap_or(end)) / 1_000_000_000)
        } else {
            continue;
        };
        let holder = holders.first().copied().unwrap_or(owner);
        let command = model.processes.get(&holder).map(|p| p.command_line()).unwrap_or_default();
        out.push(SuspectContext {
            pid: holder,
            command,
            bytes: Some(bytes),
            since: Some(since.saturating_sub(start)),
            last_activity: last_activity.map(|t| t.saturating_sub(start)),
            why,
        });
    }
    for prior in &header.prior_use {
        if services.of(prior.pid).is_some() {
            continue;
        }
        let (pid, command) = crate::analysis::prior_holder(header, prior, |pid| services.of(pid).is_some());
        let why = if pid == prior.pid {
            "held before recording began, by a process outside the traced ones".to_string()
        } else {
            format!("NVML counts it for pid {}, which is gone; pid {pid} keeps the device files open", prior.pid)
        };
        out.push(SuspectContext { pid, command, bytes: prior.used_bytes, since: None, last_activity: None, why });
    }
    // Without NVML: who had the device files open before recording, outside the traced ones.
    if header.nvml != "ok" {
        let outside = |h: &&crate::trace::HolderAtStart| services.of(h.pid).is_none() && crate::analysis::benign(h.exe.as_ref()).is_none();
        for h in header.holders_at_start.iter().filter(outside) {
            out.push(SuspectContext {
                pid: h.pid,
                command: crate::model::display_command(&h.command),
                bytes: None,
                since: None,
                last_activity: None,
                why: "had the GPU's device files open before recording began; NVML was unavailable, so how much it holds is unknown".into(),
            });
        }
    }
    out
}

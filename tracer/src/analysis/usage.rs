//! What was used, per GPU and per process: the video memory traced on each GPU (its peak and
//! when), and each process's allocations by kind and by its service's phase, with what it keeps
//! alive for processes that exited. Facts the report assembles and the outputs print.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::Serialize;

use super::services::Services;
use super::sweep::LiveChanges;
use super::Phase;
use crate::event::Memory;
use crate::model::{add_saturating, Allocation, Model, Process};
use crate::trace::Header;

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct KindTotals {
    pub allocated: u64,
    pub freed: u64,
    pub live: u64,
    /// The most of this kind live at once.
    pub peak: u64,
}

/// One GPU: what NVML said of it and the video memory traced on it. `gpu` is None for memory
/// whose device was set up before tracing began (which GPU it is on cannot be told).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct GpuReport {
    pub gpu: Option<u32>,
    pub name: Option<String>,
    pub capacity_bytes: Option<u64>,
    /// What NVML counted for processes on it when recording began.
    pub held_before_bytes: u64,
    /// Traced video memory: the most live at once (and when), and live at the end.
    pub peak_bytes: u64,
    pub peak_ts: Option<u64>,
    pub live_bytes: u64,
    pub failed_allocations: u64,
    /// Processes that allocated on it.
    pub pids: Vec<u32>,
    /// On the row of memory whose GPU cannot be told (`gpu` null): the GPUs it may be on, those
    /// whose device files its processes held when met running.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub one_of: Vec<u32>,
}

/// Physical bytes are video + system; virtual address space is only in `by_kind`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ProcessReport {
    pub pid: u32,
    pub ppid: u32,
    pub command: String,
    /// The service (the process tree it belongs to), by its root's command.
    pub service: String,
    pub allocations: u64,
    pub failed_allocations: u64,
    pub bytes_allocated: u64,
    pub bytes_freed: u64,
    pub bytes_peak: u64,
    pub bytes_live: u64,
    pub by_kind: BTreeMap<&'static str, KindTotals>,
    /// Physical bytes allocated in each phase of its service.
    pub by_phase: BTreeMap<&'static str, u64>,
    /// Of those, what is live now.
    pub live_by_phase: BTreeMap<&'static str, u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    pub exited: bool,
    /// Its cgroup, container, pod and pid inside its container, where recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub place: Option<crate::event::Place>,
    /// The most device memory NVML counted for it at once (over every sample and GPU): beside the
    /// traced video peak, what no ioctl shows (the context's own, managed memory) is visible.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvml_peak_bytes: Option<u64>,
    /// Memory of exited processes that this one keeps alive by holding the file it lives on
    /// (not in its own figures above): who allocated it, and how much.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub keeps: Vec<KeptAlive>,
}

/// Physical memory an exited process allocated, kept alive by another.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct KeptAlive {
    /// The process that allocated it (exited).
    pub pid: u32,
    pub command: String,
    pub bytes: u64,
}

impl ProcessReport {
    /// What it keeps alive for exited processes, in all.
    pub fn kept_bytes(&self) -> u64 {
        self.keeps.iter().map(|k| k.bytes).fold(0, u64::saturating_add)
    }
}

fn physical(map: &BTreeMap<Memory, u64>) -> u64 {
    map.get(&Memory::Video).copied().unwrap_or(0).saturating_add(map.get(&Memory::System).copied().unwrap_or(0))
}

/// `p`'s report; `allocations`: its own (see [`allocations_by_pid`]).
pub fn process_report(
    p: &Process,
    allocations: &[&Allocation],
    model: &Model,
    services: &Services,
    nvml_peak_bytes: Option<u64>,
    keeps: Option<&BTreeMap<u32, u64>>,
) -> ProcessReport {
    let u = &p.usage;
    let by_kind = Memory::ALL
        .iter()
        .map(|m| {
            let get = |map: &BTreeMap<Memory, u64>| map.get(m).copied().unwrap_or(0);
            (m.name(), KindTotals { allocated: get(&u.allocated), freed: get(&u.freed), live: get(&u.live), peak: get(&u.peak) })
        })
        .collect();
    let mut by_phase: BTreeMap<&'static str, u64> = Phase::ALL.iter().map(|ph| (ph.name(), 0)).collect();
    let mut live_by_phase = by_phase.clone();
    for a in allocations.iter().filter(|a| a.memory != Memory::Virtual) {
        let phase = services.phase_of(a.pid, a.ts).name();
        add_saturating(by_phase.entry(phase).or_default(), a.bytes);
        if a.freed.is_none() {
            add_saturating(live_by_phase.entry(phase).or_default(), a.bytes);
        }
    }
    ProcessReport {
        pid: p.pid,
        ppid: p.ppid,
        command: p.command_line(),
        service: services.of(p.pid).map(|s| s.name.clone()).unwrap_or_default(),
        allocations: u.allocations,
        failed_allocations: u.failed,
        bytes_allocated: physical(&u.allocated),
        bytes_freed: physical(&u.freed),
        bytes_peak: u.peak_physical,
        bytes_live: physical(&u.live),
        by_kind,
        by_phase,
        live_by_phase,
        exit_code: p.exit_code,
        exited: p.exited.is_some(),
        place: p.place.clone(),
        nvml_peak_bytes,
        keeps: keeps
            .into_iter()
            .flatten()
            .map(|(&pid, &bytes)| KeptAlive {
                pid,
                command: model.processes.get(&pid).map(Process::command_line).unwrap_or_default(),
                bytes,
            })
            .collect(),
    }
}

/// The model's allocations grouped by process, in one pass (a scan per process cost processes
/// times allocations).
pub fn allocations_by_pid(model: &Model) -> HashMap<u32, Vec<&Allocation>> {
    let mut by_pid: HashMap<u32, Vec<&Allocation>> = HashMap::new();
    for a in &model.allocations {
        by_pid.entry(a.pid).or_default().push(a);
    }
    by_pid
}

/// Every GPU NVML described and every GPU memory was traced on, in order (memory on a GPU that
/// cannot be told last): each one's own peak, so a tensor-parallel rank that filled up shows.
pub fn gpu_reports(header: &Header, model: &Model) -> Vec<GpuReport> {
    let start = model.time_zero(header.monotonic_start_ns);
    // The GPUs in order, allocations on a GPU not known last.
    let mut keys: BTreeSet<(bool, Option<u32>)> = header.gpus.iter().map(|g| (false, Some(g.index))).collect();
    let video_gpus = model.allocations.iter().filter(|a| a.memory == Memory::Video).map(|a| model.gpu_for(a.pid, a.gpu));
    let failed_gpus = model.failures.iter().filter(|f| f.memory == Memory::Video).map(|f| model.gpu_for(f.pid, f.gpu));
    keys.extend(video_gpus.chain(failed_gpus).map(|k| (k.is_none(), k)));
    keys.into_iter()
        .map(|(_, gpu)| {
            let card = gpu.and_then(|g| header.gpus.iter().find(|c| c.index == g));
            let video = || model.allocations.iter().filter(move |a| model.gpu_for(a.pid, a.gpu) == gpu && a.memory == Memory::Video);
            let (mut live, mut peak, mut peak_ts) = (0i128, 0i128, None);
            for (t, d, ()) in LiveChanges::of(video().map(|a| (a, ()))) {
                live += d;
                if live > peak {
                    (peak, peak_ts) = (live, Some(t.saturating_sub(start)));
                }
            }
            let mut pids: Vec<u32> = video().map(|a| a.pid).collect();
            pids.sort();
            pids.dedup();
            let clamp = |v: i128| v.clamp(0, u64::MAX.into()) as u64;
            let mut one_of: Vec<u32> = match gpu {
                Some(_) => Vec::new(),
                None => pids.iter().filter_map(|pid| model.processes.get(pid)?.attached.as_ref()).flat_map(|a| a.gpus.clone()).collect(),
            };
            one_of.sort_unstable();
            one_of.dedup();
            GpuReport {
                gpu,
                name: card.map(|c| c.name.clone()),
                capacity_bytes: card.and_then(|c| c.total_bytes),
                held_before_bytes: header
                    .prior_use
                    .iter()
                    .filter(|p| Some(p.gpu) == gpu)
                    .map(|p| p.used_bytes.unwrap_or(0))
                    .fold(0, u64::saturating_add),
                peak_bytes: clamp(peak),
                peak_ts,
                live_bytes: clamp(live),
                failed_allocations: model
                    .failures
                    .iter()
                    .filter(|f| model.gpu_for(f.pid, f.gpu) == gpu && f.memory == Memory::Video)
                    .count() as u64,
                pids,
                one_of,
            }
        })
        .collect()
}

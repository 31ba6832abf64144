//! What NVML says: when tracing starts, each GPU's capacity and the memory each process already
//! held, which no ioctl traced from now on can show; while recording, samples of the same beside
//! the host's memory ([`Sampler`]).

use std::collections::HashSet;

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

use crate::event::{GpuUse, HostMemory, Sample};
use crate::trace::{clocks, Gpu, PriorUse};

pub struct Snapshot {
    pub gpus: Vec<Gpu>,
    pub prior_use: Vec<PriorUse>,
    /// "ok", or why NVML could not be asked, in words.
    pub note: String,
}

pub fn snapshot() -> Snapshot {
    match query_nvml() {
        Ok((gpus, prior_use)) => Snapshot { gpus, prior_use, note: "ok".into() },
        Err(e) => Snapshot {
            gpus: vec![],
            prior_use: vec![],
            note: format!("NVML unavailable ({e}): GPU capacity and what each process holds are unknown"),
        },
    }
}

fn query_nvml() -> Result<(Vec<Gpu>, Vec<PriorUse>), NvmlError> {
    let nvml = Nvml::init()?;
    let mut gpus = Vec::new();
    let mut prior_use = Vec::new();
    for index in 0..nvml.device_count()? {
        let device = nvml.device_by_index(index)?;
        // Unified-memory parts (DGX Spark) answer NOT_SUPPORTED here: capacity unknown, not zero.
        let memory = device.memory_info().ok();
        gpus.push(Gpu {
            index,
            name: device.name().unwrap_or_else(|_| "unknown".into()),
            total_bytes: memory.as_ref().map(|m| m.total),
            used_bytes: memory.as_ref().map(|m| m.used),
        });
        prior_use.extend(processes(&device, index, |_| true));
    }
    Ok((gpus, prior_use))
}

/// What NVML counts for each process on `device`, with its command line where `named` asks.
fn processes(device: &nvml_wrapper::Device, index: u32, mut named: impl FnMut(u32) -> bool) -> Vec<PriorUse> {
    let running = device.running_compute_processes().unwrap_or_default();
    running
        .into_iter()
        .map(|process| {
            let used_bytes = match process.used_gpu_memory {
                UsedGpuMemory::Used(bytes) => Some(bytes),
                UsedGpuMemory::Unavailable => None,
            };
            let command = if named(process.pid) { crate::procfs::command::command(process.pid).unwrap_or_default() } else { Vec::new() };
            PriorUse { pid: process.pid, gpu: index, used_bytes, command }
        })
        .collect()
}

/// Samples NVML and the host's memory: each GPU's used memory, each process's, MemAvailable and
/// memory pressure. Owned by one thread, off the event path; each call costs a few NVML calls
/// and two small /proc reads.
pub struct Sampler {
    nvml: Option<Nvml>,
    /// Pids whose command line was already given.
    named: HashSet<u32>,
}

impl Sampler {
    pub fn new() -> Sampler {
        Sampler { nvml: Nvml::init().ok(), named: HashSet::new() }
    }

    pub fn sample(&mut self) -> Sample {
        let mut sample = Sample { host: host_memory(), ..Sample::default() };
        let Some(nvml) = &self.nvml else { return sample };
        for index in 0..nvml.device_count().unwrap_or(0) {
            let Ok(device) = nvml.device_by_index(index) else { continue };
            if let Ok(memory) = device.memory_info() {
                sample.gpus.push(GpuUse { gpu: index, used_bytes: memory.used });
            }
            // A command line once per process: later samples name it by pid only.
            sample.processes.extend(processes(&device, index, |pid| self.named.insert(pid)));
        }
        sample
    }
}

impl Default for Sampler {
    fn default() -> Self {
        Sampler::new()
    }
}

/// MemTotal, MemAvailable, SwapFree, and PSI's memory "some avg10" where the kernel has PSI.
fn host_memory() -> Option<HostMemory> {
    let (total_bytes, available_bytes) = crate::procfs::meminfo()?;
    Some(HostMemory {
        total_bytes,
        available_bytes,
        swap_free_bytes: crate::procfs::meminfo_field("SwapFree:").unwrap_or(0),
        pressure_some_avg10: crate::procfs::memory_pressure(),
    })
}

/// How often NVML and the host's memory are sampled into the trace.
const SAMPLE_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// NVML and /proc/meminfo on a thread of their own, every [`SAMPLE_EVERY`]: a slow NVML call
/// never holds up events. A sample is stamped with the time its query began: what was traced
/// after that may be missing from NVML's answer.
pub fn sampler() -> anyhow::Result<tokio::sync::mpsc::Receiver<(u64, Sample)>> {
    let (sample_tx, sample_rx) = tokio::sync::mpsc::channel::<(u64, Sample)>(4);
    std::thread::Builder::new()
        .name("gputrace-sampler".into())
        .spawn(move || {
            let mut sampler = Sampler::new();
            while sample_tx.blocking_send((clocks().1, sampler.sample())).is_ok() {
                std::thread::sleep(SAMPLE_EVERY);
            }
        })
        .map_err(|e| anyhow::anyhow!("starting the sampler thread: {e}"))?;
    Ok(sample_rx)
}

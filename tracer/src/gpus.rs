//! What NVML says when tracing starts: each GPU's capacity, and the memory each process already
//! held, which no ioctl traced from now on can show.

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

use crate::files::{ProcResolver, Resolver};
use crate::trace::{Gpu, PriorUse};

pub struct Snapshot {
    pub gpus: Vec<Gpu>,
    pub prior_use: Vec<PriorUse>,
    /// "ok", or why NVML could not be asked, in words.
    pub note: String,
}

pub fn snapshot() -> Snapshot {
    match ask() {
        Ok((gpus, prior_use)) => Snapshot { gpus, prior_use, note: "ok".into() },
        Err(e) => Snapshot {
            gpus: vec![],
            prior_use: vec![],
            note: format!("NVML unavailable ({e}): GPU capacity and what each process holds are unknown"),
        },
    }
}

fn ask() -> Result<(Vec<Gpu>, Vec<PriorUse>), NvmlError> {
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
        for process in device.running_compute_processes().unwrap_or_default() {
            let used_bytes = match process.used_gpu_memory {
                UsedGpuMemory::Used(bytes) => Some(bytes),
                UsedGpuMemory::Unavailable => None,
            };
            let command = ProcResolver.command(process.pid).unwrap_or_default();
            prior_use.push(PriorUse { pid: process.pid, gpu: index, used_bytes, command });
        }
    }
    Ok((gpus, prior_use))
}

//! The reasons the analyses give in words: why a context is a suspect holder, why NVML and the
//! trace disagree, memory no process's NVML figure includes, and how a GPU is named. A reason
//! reads the same in the text and in the JSON (its `Serialize` is its words).

use std::fmt;

use serde::{Serialize, Serializer};

use crate::analysis::holders::Suspicion;
use crate::analysis::nvml::{Gap, Unaccounted};
use crate::analysis::server::{flag, ServerFamily};
use crate::analysis::usage::GpuReport;
use crate::units::bytes;

impl fmt::Display for Suspicion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Suspicion::OwnerExited { owner, holder, command } => write!(
                f,
                "its owner pid {owner} exited; pid {holder} (`{command}`) still holds the device file, without having allocated it"
            ),
            Suspicion::Orphan { pid, parent } => write!(f, "pid {pid} is an orphan: its parent pid {parent} exited"),
            Suspicion::Idle { seconds } => write!(f, "no allocation or request for {seconds} s"),
            Suspicion::HeldBefore => f.write_str("held before recording began, by a process outside the traced ones"),
            Suspicion::CountedForGone { counted, holder } => {
                write!(f, "NVML counts it for pid {counted}, which is gone; pid {holder} keeps the device files open")
            }
            Suspicion::OpenBefore => {
                f.write_str("had the GPU's device files open before recording began; NVML was unavailable, so how much it holds is unknown")
            }
        }
    }
}

impl Serialize for Suspicion {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl fmt::Display for Gap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Gap::BeforeRecording => "it allocated memory before recording began, which no traced ioctl shows",
            Gap::NvmlAbove => "NVML counts memory no traced ioctl shows: the CUDA context's own (a few hundred MiB), managed memory (cudaMallocManaged), or memory the driver allocates itself",
            Gap::TraceAbove => "the trace counts memory NVML does not count for it: memory shared with or handed to another process, or not yet backed",
        })
    }
}

impl Serialize for Gap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A note of memory no process's NVML figure includes.
pub fn unaccounted(u: &Unaccounted) -> String {
    format!(
        "{} used on GPU {} that no process's NVML figure includes (at {:.1} s, beyond what was so when sampling began): managed memory (cudaMallocManaged) touched on the GPU, which NVML counts for the device and not the process, or the driver's own.",
        bytes(u.bytes),
        u.gpu,
        u.ts as f64 / 1e9
    )
}

/// The GPU as a reader is told it: its index, or "one of 2, 3", or "?".
pub fn gpu_label(g: &GpuReport) -> String {
    match (g.gpu, g.one_of.as_slice()) {
        (Some(i), _) => i.to_string(),
        (None, []) => "?".into(),
        (None, some) => format!("one of {}", some.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")),
    }
}

/// The program and the sizing flags with their values; never other arguments (paths, keys,
/// tokens): `vllm serve ... --max-num-seqs 256`.
pub fn short_command(command: &[String]) -> String {
    let family = ServerFamily::of(command);
    let program = command.first().map(|a| a.rsplit('/').next().unwrap_or(a)).unwrap_or_default();
    let mut out = program.to_string();
    // The subcommand (`vllm serve`, `ollama serve`) or the module a Python runs
    // (`python3 -m sglang.launch_server`): what names the server, never a value such as a model's
    // path (llama-server's `-m`).
    match (command.get(1).map(String::as_str), command.get(2)) {
        (Some("serve"), _) => out += " serve",
        (Some("-m"), Some(module)) if program.starts_with("python") => {
            out += &format!(" -m {}", module.chars().take(48).collect::<String>())
        }
        _ => {}
    }
    let sizing =
        [family.context(), family.concurrency(), family.sharding()].into_iter().flatten().flat_map(|(_, names)| names.iter().copied());
    let reserve = family.reserve().map(|(name, _)| name);
    let flags: Vec<String> = sizing
        .chain(reserve)
        // A sizing value is a number (or llama's split, `1,1`): anything else after a flag of
        // that name is no setting of an engine's (`-c postgres://...`), and may be a secret.
        .filter_map(|name| flag(command, &[name]).filter(|v| is_figure(v)).map(|v| format!("{name} {v}")))
        .collect();
    if command.len() > 1 {
        out += " ...";
    }
    for f in flags {
        out += &format!(" {f}");
    }
    out
}

/// A setting's value as engines take them: digits, a point, commas, a size's letter.
pub fn is_figure(value: &str) -> bool {
    !value.is_empty() && value.len() <= 24 && value.chars().all(|c| c.is_ascii_digit() || ".,kKmMgG".contains(c))
}

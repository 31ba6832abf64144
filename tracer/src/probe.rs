//! Loading and attaching the kernel programs, and the maps userspace reads and writes: the ring
//! buffer, the fd map (answers to the kernel's questions), the traced set and the counters.

use std::path::Path;

use aya::maps::{Array, HashMap, MapData, PerCpuArray, RingBuf};
use aya::programs::TracePoint;
use aya::Ebpf;
use thiserror::Error;
use tracer_common::{stat, traced, Config, FdKey, KernelOffsets, UvmWindow};

use crate::abi::Layout;

/// The compiled eBPF object, built by build.rs from tracer-ebpf.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tracer"));

const TRACEFS: &str = "/sys/kernel/tracing";

/// Programs and the tracepoints they attach to, in attach order: process lifecycle first, so no
/// child of a traced process is missed; the ioctl hooks last, once their fds can be followed.
const HOOKS: &[(&str, &str, &str)] = &[
    ("task_newtask", "task", "task_newtask"),
    ("process_exec", "sched", "sched_process_exec"),
    ("process_exit", "sched", "sched_process_exit"),
    ("openat_enter", "syscalls", "sys_enter_openat"),
    ("open_enter_legacy", "syscalls", "sys_enter_open"),
    ("open_exit", "syscalls", "sys_exit_openat"),
    ("open_exit", "syscalls", "sys_exit_open"),
    ("close_enter", "syscalls", "sys_enter_close"),
    ("dup_enter_plain", "syscalls", "sys_enter_dup"),
    ("dup2_enter", "syscalls", "sys_enter_dup2"),
    ("dup3_enter", "syscalls", "sys_enter_dup3"),
    ("fcntl_enter", "syscalls", "sys_enter_fcntl"),
    ("dup_exit", "syscalls", "sys_exit_dup"),
    ("dup_exit", "syscalls", "sys_exit_dup2"),
    ("dup_exit", "syscalls", "sys_exit_dup3"),
    ("dup_exit", "syscalls", "sys_exit_fcntl"),
    ("close_range_enter", "syscalls", "sys_enter_close_range"),
    ("bind_enter", "syscalls", "sys_enter_bind"),
    ("listen_enter", "syscalls", "sys_enter_listen"),
    ("accept_exit", "syscalls", "sys_exit_accept"),
    ("accept_exit", "syscalls", "sys_exit_accept4"),
    ("read_enter", "syscalls", "sys_enter_read"),
    ("read_enter", "syscalls", "sys_enter_recvfrom"),
    ("read_exit", "syscalls", "sys_exit_read"),
    ("read_exit", "syscalls", "sys_exit_recvfrom"),
    ("write_enter", "syscalls", "sys_enter_write"),
    ("write_enter", "syscalls", "sys_enter_sendto"),
    ("writev_enter", "syscalls", "sys_enter_writev"),
    ("oom_victim", "oom", "mark_victim"),
    ("ioctl_enter", "syscalls", "sys_enter_ioctl"),
    ("ioctl_exit", "syscalls", "sys_exit_ioctl"),
];

#[derive(Debug, Error)]
pub enum ProbeError {
    #[error("gputrace needs root or CAP_BPF+CAP_PERFMON to load its kernel probes: run it with sudo")]
    NotPrivileged,
    #[error("tracefs is not mounted at {TRACEFS} and mounting it failed ({0}): run `sudo mount -t tracefs nodev {TRACEFS}`")]
    NoTracefs(String),
    #[error("the kernel has no tracepoint {0}: gputrace needs a kernel with syscall tracepoints (CONFIG_FTRACE_SYSCALLS=y)")]
    NoTracepoint(String),
    #[error("the kernel refused gputrace's eBPF programs: {reason}{hint}")]
    Load { reason: String, hint: &'static str },
    #[error("attaching {program} to {tracepoint} failed: {reason}")]
    Attach { program: String, tracepoint: String, reason: String },
    #[error("the eBPF object lacks map {0}: the binary was built from mismatched sources; rebuild with `cargo build --release`")]
    MissingMap(&'static str),
    #[error("updating the kernel map {map} failed: {reason}")]
    Map { map: &'static str, reason: String },
}

/// Checks what loading needs, before trying, so the failure is one actionable sentence.
pub fn preflight() -> Result<(), ProbeError> {
    if !privileged() {
        return Err(ProbeError::NotPrivileged);
    }
    if !Path::new(TRACEFS).join("events").exists() {
        let target = std::ffi::CString::new(TRACEFS).unwrap();
        let fstype = std::ffi::CString::new("tracefs").unwrap();
        // SAFETY: plain mount(2) with valid C strings.
        let rc = unsafe { libc::mount(fstype.as_ptr(), target.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
        if rc != 0 {
            return Err(ProbeError::NoTracefs(std::io::Error::last_os_error().to_string()));
        }
    }
    for (_, category, name) in HOOKS {
        if !Path::new(TRACEFS).join("events").join(category).join(name).exists() {
            return Err(ProbeError::NoTracepoint(format!("{category}:{name}")));
        }
    }
    Ok(())
}

/// Root, or the capabilities that loading tracing programs needs (CAP_SYS_ADMIN covers both).
fn privileged() -> bool {
    const CAP_SYS_ADMIN: u32 = 21;
    const CAP_PERFMON: u32 = 38;
    const CAP_BPF: u32 = 39;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let effective =
        status.lines().find_map(|l| l.strip_prefix("CapEff:")).and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok()).unwrap_or(0);
    let has = |cap: u32| effective & (1 << cap) != 0;
    has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON))
}

pub struct Probe {
    /// Keeps the programs and their links alive.
    _ebpf: Ebpf,
    pub events: Option<RingBuf<MapData>>,
    fds: HashMap<MapData, FdKey, u8>,
    traced: HashMap<MapData, u32, u8>,
    stats: PerCpuArray<MapData, u64>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Records the ring buffer had no room for.
    pub lost: u64,
    /// Questions the kernel asked about fds it had not seen opened.
    pub questions: u64,
}

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> ProbeError {
    move |e| ProbeError::Map { map, reason: e.to_string() }
}

impl Probe {
    /// Loads the programs for a driver layout and attaches every hook.
    pub fn load(layout: &Layout, trace_all: bool) -> Result<Probe, ProbeError> {
        // The kernel accounts BPF memory by memcg on current kernels; raising the old locked-memory
        // limit only matters on old ones and may be refused (no CAP_SYS_RESOURCE): not an error.
        let unlimited = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
        // SAFETY: setrlimit with a valid struct.
        unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) };

        let mut ebpf = Ebpf::load(EBPF_OBJECT).map_err(|e| ProbeError::Load {
            reason: e.to_string(),
            hint: if Path::new("/sys/kernel/btf/vmlinux").exists() {
                ""
            } else {
                " (this kernel has no BTF at /sys/kernel/btf/vmlinux: gputrace needs Linux 5.8 or newer built with CONFIG_DEBUG_INFO_BTF=y)"
            },
        })?;

        let take = |ebpf: &mut Ebpf, name: &'static str| ebpf.take_map(name).ok_or(ProbeError::MissingMap(name));
        let mut config: Array<MapData, Config> = Array::try_from(take(&mut ebpf, "CONFIG")?).map_err(map_err("CONFIG"))?;
        config.set(0, Config { trace_all: trace_all as u32, _pad: 0 }, 0).map_err(map_err("CONFIG"))?;
        let mut windows: HashMap<MapData, u32, UvmWindow> =
            HashMap::try_from(take(&mut ebpf, "UVM_WINDOWS")?).map_err(map_err("UVM_WINDOWS"))?;
        for (cmd, window) in layout.uvm_windows() {
            windows.insert(cmd, window, 0).map_err(map_err("UVM_WINDOWS"))?;
        }
        let mut classes: HashMap<MapData, u32, u32> =
            HashMap::try_from(take(&mut ebpf, "CLASS_PARAMS")?).map_err(map_err("CLASS_PARAMS"))?;
        for (class, size) in layout.class_params_table() {
            classes.insert(class, size, 0).map_err(map_err("CLASS_PARAMS"))?;
        }
        let mut offsets: Array<MapData, KernelOffsets> = Array::try_from(take(&mut ebpf, "OFFSETS")?).map_err(map_err("OFFSETS"))?;
        // Without them the kernel reports no file identity and userspace falls back to kcmp(2).
        if let Ok(found) = crate::btf::running_kernel_offsets() {
            offsets.set(0, found, 0).map_err(map_err("OFFSETS"))?;
        }
        let fds = HashMap::try_from(take(&mut ebpf, "FDS")?).map_err(map_err("FDS"))?;
        let traced = HashMap::try_from(take(&mut ebpf, "TRACED")?).map_err(map_err("TRACED"))?;
        let stats = PerCpuArray::try_from(take(&mut ebpf, "STATS")?).map_err(map_err("STATS"))?;
        let events = RingBuf::try_from(take(&mut ebpf, "EVENTS")?).map_err(map_err("EVENTS"))?;

        let mut loaded = std::collections::HashSet::new();
        for (program, category, name) in HOOKS {
            let attach_err =
                |reason: String| ProbeError::Attach { program: program.to_string(), tracepoint: format!("{category}:{name}"), reason };
            let tp: &mut TracePoint = ebpf
                .program_mut(program)
                .ok_or_else(|| attach_err("the program is missing from the eBPF object".into()))?
                .try_into()
                .map_err(|e: aya::programs::ProgramError| attach_err(e.to_string()))?;
            if loaded.insert(*program) {
                tp.load().map_err(|e| ProbeError::Load { reason: verifier_message(program, &e), hint: "" })?;
            }
            tp.attach(category, name).map_err(|e| attach_err(e.to_string()))?;
        }
        Ok(Probe { _ebpf: ebpf, events: Some(events), fds, traced, stats })
    }

    /// Traces `pid` and, from now on, every process it forks.
    pub fn trace_pid(&mut self, pid: u32) -> Result<(), ProbeError> {
        self.traced.insert(pid, traced::YES, 0).map_err(map_err("TRACED"))
    }

    pub fn untrace_pid(&mut self, pid: u32) {
        let _ = self.traced.remove(&pid);
    }

    /// Records what a fd is (the answer to a question, a /proc scan result).
    pub fn set_fd(&mut self, pid: u32, fd: i32, state: u8) -> Result<(), ProbeError> {
        self.fds.insert(FdKey { tgid: pid, fd: fd as u32 }, state, 0).map_err(map_err("FDS"))
    }

    pub fn forget_fd(&mut self, pid: u32, fd: i32) {
        // Absent already is fine: the kernel side may have removed it on close.
        let _ = self.fds.remove(&FdKey { tgid: pid, fd: fd as u32 });
    }

    pub fn counters(&self) -> Counters {
        let sum = |index: u32| self.stats.get(&index, 0).map(|values| values.iter().sum()).unwrap_or(0);
        Counters { lost: sum(stat::LOST), questions: sum(stat::QUESTIONS) }
    }
}

/// aya's error for a refused program carries the verifier log; keep the part a person can use.
fn verifier_message(program: &str, e: &aya::programs::ProgramError) -> String {
    let text = format!("{e:?}");
    let tail: String = text.lines().rev().take(12).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
    format!("program {program}: {e}\n{tail}")
}

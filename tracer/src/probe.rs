//! Loading and attaching the kernel programs, and the maps userspace reads and writes: the ring
//! buffer, the fd map (answers to the kernel's questions), the traced set and the counters.

use std::path::Path;

use aya::maps::{Array, HashMap, MapData, PerCpuArray, RingBuf};
use aya::programs::TracePoint;
use aya::Ebpf;
use thiserror::Error;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tracer_common::{device, stat, traced, Config, FdKey, KernelOffsets, Reading, UvmWindow, PID_SLOTS};

use crate::abi::Layout;
use crate::tracefs;

/// The compiled eBPF object, built by build.rs from tracer-ebpf.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tracer"));

pub const TRACEFS: &str = "/sys/kernel/tracing";

/// A program and the tracepoint it attaches to.
pub struct Hook {
    pub program: &'static str,
    pub category: &'static str,
    pub name: &'static str,
    /// Without it gputrace would miss memory; an optional one only exists on some kernels and
    /// what it sees has another way in (openat for open, dup3 for dup2 on arm64's syscall table;
    /// close_range from 5.9).
    pub required: bool,
    /// The program loaded instead where the kernel refuses this one: the ioctl programs keep a
    /// call in flight with BPF's atomics (5.12 and later), and without them in an LRU map.
    pub fallback: Option<&'static str>,
}

const fn hook(program: &'static str, category: &'static str, name: &'static str) -> Hook {
    Hook { program, category, name, required: true, fallback: None }
}

const fn optional(program: &'static str, category: &'static str, name: &'static str) -> Hook {
    Hook { program, category, name, required: false, fallback: None }
}

const fn or_else(hook: Hook, fallback: &'static str) -> Hook {
    Hook { fallback: Some(fallback), ..hook }
}

/// Programs and the tracepoints they attach to, in attach order: process lifecycle first, so no
/// child of a traced process is missed; the ioctl hooks last, once their fds can be followed.
pub const HOOKS: &[Hook] = &[
    hook("task_newtask", "task", "task_newtask"),
    hook("process_exec", "sched", "sched_process_exec"),
    hook("process_exit", "sched", "sched_process_exit"),
    hook("openat_enter", "syscalls", "sys_enter_openat"),
    optional("open_enter_legacy", "syscalls", "sys_enter_open"),
    hook("open_exit", "syscalls", "sys_exit_openat"),
    optional("open_exit", "syscalls", "sys_exit_open"),
    optional("openat2_enter", "syscalls", "sys_enter_openat2"),
    optional("open_exit", "syscalls", "sys_exit_openat2"),
    hook("close_enter", "syscalls", "sys_enter_close"),
    hook("dup_enter_plain", "syscalls", "sys_enter_dup"),
    optional("dup2_enter", "syscalls", "sys_enter_dup2"),
    hook("dup3_enter", "syscalls", "sys_enter_dup3"),
    hook("fcntl_enter", "syscalls", "sys_enter_fcntl"),
    hook("dup_exit", "syscalls", "sys_exit_dup"),
    optional("dup_exit", "syscalls", "sys_exit_dup2"),
    hook("dup_exit", "syscalls", "sys_exit_dup3"),
    hook("dup_exit", "syscalls", "sys_exit_fcntl"),
    optional("close_range_enter", "syscalls", "sys_enter_close_range"),
    hook("bind_enter", "syscalls", "sys_enter_bind"),
    hook("listen_enter", "syscalls", "sys_enter_listen"),
    hook("accept_exit", "syscalls", "sys_exit_accept"),
    hook("accept_exit", "syscalls", "sys_exit_accept4"),
    hook("read_enter", "syscalls", "sys_enter_read"),
    hook("read_enter", "syscalls", "sys_enter_recvfrom"),
    hook("read_exit", "syscalls", "sys_exit_read"),
    hook("read_exit", "syscalls", "sys_exit_recvfrom"),
    hook("write_enter", "syscalls", "sys_enter_write"),
    hook("write_enter", "syscalls", "sys_enter_sendto"),
    hook("writev_enter", "syscalls", "sys_enter_writev"),
    optional("oom_victim", "oom", "mark_victim"),
    // The exit first: an exit with no entry seen does nothing, an entry with no exit holds its
    // thread's slot until the thread ends.
    or_else(hook("ioctl_exit", "syscalls", "sys_exit_ioctl"), "ioctl_exit_lru"),
    or_else(hook("ioctl_enter", "syscalls", "sys_enter_ioctl"), "ioctl_enter_lru"),
];

#[derive(Debug, Error)]
pub enum ProbeError {
    #[error("gputrace needs root or CAP_BPF+CAP_PERFMON to load its kernel probes: run it with sudo")]
    NotPrivileged,
    #[error("tracefs is not mounted at {TRACEFS} and mounting it failed ({0}): run `sudo mount -t tracefs nodev {TRACEFS}`")]
    NoTracefs(String),
    #[error("the kernel has no syscall tracepoints ({0} is missing): gputrace needs a kernel built with CONFIG_FTRACE_SYSCALLS=y")]
    NoSyscallTracepoints(String),
    #[error("the kernel has no tracepoint {0}, which gputrace needs: please report this kernel (`uname -r`) to the gputrace project")]
    NoTracepoint(String),
    #[error("this kernel lays out a tracepoint differently from what gputrace reads: {0}; please report this kernel (`uname -r`)")]
    Layout(String),
    #[error("the kernel refused gputrace's eBPF programs: {reason}{hint}")]
    Load { reason: String, hint: &'static str },
    #[error("attaching {program} to {tracepoint} failed: {reason}")]
    Attach { program: String, tracepoint: String, reason: String },
    #[error("the eBPF object lacks map {0}: the binary was built from mismatched sources; rebuild with `cargo build --release`")]
    MissingMap(&'static str),
    #[error("updating the kernel map {map} failed: {reason}")]
    Map { map: &'static str, reason: String },
    #[error(
        "{FDS_ENTRIES}={0:?} is not a number of entries between 16 and 1048576 (each costs kernel memory): unset it for the default, 65536"
    )]
    FdsEntries(String),
}

/// Sizes the kernel's table of followed fds (NVIDIA files and accepted connections, 65536 by
/// default): larger for a host with more, smaller to see what a full table does (the tests).
pub const FDS_ENTRIES: &str = "GPUTRACE_FDS_ENTRIES";

fn fds_entries() -> Result<Option<u32>, ProbeError> {
    let Ok(value) = std::env::var(FDS_ENTRIES) else { return Ok(None) };
    match value.parse::<u32>() {
        Ok(n) if (16..=1 << 20).contains(&n) => Ok(Some(n)),
        _ => Err(ProbeError::FdsEntries(value)),
    }
}

/// What the running kernel offers, as preflight found it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Kernel {
    /// Optional tracepoints it lacks (arm64's syscall table has no open or dup2), not attached.
    pub absent: Vec<String>,
    /// Where sched_process_exit records say whether the whole process died (recent kernels); 0 when
    /// they do not say (6.1 and older), and the thread group leader's exit stands for the process's.
    pub group_dead_at: u32,
}

/// Checks what loading needs, before trying, so the failure is one actionable sentence: the
/// privileges, tracefs, every required tracepoint, and the layout of every record the programs
/// read.
pub fn preflight() -> Result<Kernel, ProbeError> {
    check_privileges()?;
    let tracefs = Path::new(TRACEFS);
    if !tracefs.join("events").exists() {
        let target = std::ffi::CString::new(TRACEFS).unwrap();
        let fstype = std::ffi::CString::new("tracefs").unwrap();
        // SAFETY: plain mount(2) with valid C strings.
        let rc = unsafe { libc::mount(fstype.as_ptr(), target.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
        if rc != 0 {
            return Err(ProbeError::NoTracefs(std::io::Error::last_os_error().to_string()));
        }
    }
    let mut kernel = Kernel::default();
    for hook in HOOKS {
        let tracepoint = format!("{}:{}", hook.category, hook.name);
        match tracefs::format(tracefs, hook.category, hook.name) {
            Some(format) => tracefs::check(hook.category, hook.name, &format).map_err(ProbeError::Layout)?,
            None if !hook.required => kernel.absent.push(tracepoint),
            None if !tracefs.join("events/syscalls").exists() => return Err(ProbeError::NoSyscallTracepoints(tracepoint)),
            None => return Err(ProbeError::NoTracepoint(tracepoint)),
        }
    }
    let exit = tracefs::format(tracefs, "sched", "sched_process_exit").unwrap_or_default();
    kernel.group_dead_at = tracefs::field(&exit, "group_dead").map_or(0, |f| f.offset);
    Ok(kernel)
}

/// The privileges loading needs, checked before anything is created (a watch's dump directory).
pub fn check_privileges() -> Result<(), ProbeError> {
    if privileged() {
        Ok(())
    } else {
        Err(ProbeError::NotPrivileged)
    }
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
    conn_pids: Array<MapData, u8>,
    fd_pids: Array<MapData, u8>,
    reads: HashMap<MapData, u64, Reading>,
    traced: HashMap<MapData, u32, u8>,
    stats: PerCpuArray<MapData, u64>,
    config: Array<MapData, Config>,
    settings: Config,
    /// Whether the kernel side can read a file's device number (its offsets are in the BTF).
    numbers_readable: bool,
    /// Taken out of the object to be filled: held so the programs' reference to it stays valid.
    _cgroups: Option<aya::maps::CgroupArray<MapData>>,
    /// With `--kernel-log`: the programs' diagnostics, to flush when its fd is readable.
    pub kernel_log: Option<aya_log::EbpfLogger<KernelLog>>,
    /// Why the kernel refused the ioctl programs that keep calls in flight in per-thread slots
    /// (BPF's atomics), when it did: the pair that keeps them in an LRU map runs instead.
    pub calls_in_map_only: Option<String>,
    /// Answers userspace could not store in the kernel's maps (a map full): counted with the
    /// kernel's own refused inserts.
    refused_answers: u64,
}

/// NVIDIA's majors as the kernel side is told them: none where it cannot read device numbers,
/// so that it reads the paths of opens rather than leave every device file to a question.
fn kernel_majors(majors: Option<crate::devices::Majors>, numbers_readable: bool) -> (u32, u32) {
    match majors {
        Some(m) if numbers_readable => (m.nvidia, m.uvm),
        _ => (0, 0),
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Records the ring buffer had no room for.
    pub lost: u64,
    /// Questions the kernel asked about fds it had not seen opened.
    pub questions: u64,
    /// Map inserts the kernel refused because a map was full.
    pub insert_failed: u64,
    /// Opens of NVIDIA paths whose file had another device number: not followed.
    pub impostors: u64,
    /// fd changes and ioctls in threads with a file table of their own: not followed.
    pub own_file_table: u64,
    /// Followed calls kept in the LRU map of calls in flight, not in their thread's slot.
    pub calls_in_map: u64,
}

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> ProbeError {
    move |e| ProbeError::Map { map, reason: e.to_string() }
}

/// What the kernel side traces, and how.
#[derive(Clone, Copy, Default)]
pub struct Selection<'a> {
    /// Every process, not only those attached or launched and their children.
    pub trace_all: bool,
    /// A cgroup v2 directory, opened, whose processes are traced too.
    pub cgroup: Option<&'a std::fs::File>,
    /// NVIDIA's device numbers on this host, None to know its files by path alone.
    pub majors: Option<crate::devices::Majors>,
    /// The programs' own diagnostics (`--kernel-log`), read from [`Probe::kernel_log`].
    pub kernel_log: bool,
}

/// The eBPF programs' diagnostics, printed to stderr as gputrace's own lines, at most
/// [`KernelLog::LINES_PER_SECOND`] (each CPU logs a few a second; a host has hundreds of CPUs).
#[derive(Default)]
pub struct KernelLog {
    /// The second (since the logger began) the count is for, and lines in it.
    window: std::sync::Mutex<(u64, u64)>,
    began: std::sync::OnceLock<std::time::Instant>,
}

impl KernelLog {
    pub const LINES_PER_SECOND: u64 = 20;

    /// Whether a line at `second` may be printed; the first line of a second after some were
    /// dropped says how many.
    fn admit(&self, second: u64) -> (bool, u64) {
        let mut window = self.window.lock().unwrap_or_else(|e| e.into_inner());
        let mut dropped = 0;
        if window.0 != second {
            dropped = window.1.saturating_sub(Self::LINES_PER_SECOND);
            *window = (second, 0);
        }
        window.1 += 1;
        (window.1 <= Self::LINES_PER_SECOND, dropped)
    }
}

impl log::Log for KernelLog {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, record: &log::Record) {
        let second = self.began.get_or_init(std::time::Instant::now).elapsed().as_secs();
        let (print, dropped) = self.admit(second);
        if dropped > 0 {
            eprintln!("gputrace: kernel: {dropped} more lines in the last second were not printed");
        }
        if print {
            eprintln!("gputrace: kernel: {}", record.args());
        }
    }
    fn flush(&self) {}
}

/// Loads each hook's program once and attaches it to its tracepoint, skipping the optional
/// ones this kernel does not have. The programs with a fallback go together (the ioctl pair
/// shares where a call waits for its exit): where the kernel refuses any of them, all fall back,
/// and the refusal is returned.
fn attach(ebpf: &mut Ebpf, kernel: &Kernel) -> Result<Option<String>, ProbeError> {
    let mut loaded = std::collections::HashSet::new();
    let refused = HOOKS.iter().filter(|h| h.fallback.is_some()).find_map(|h| load(ebpf, h.program, &mut loaded).err());
    let fall_back = refused.is_some();
    for Hook { program, category, name, fallback, .. } in
        HOOKS.iter().filter(|h| !kernel.absent.contains(&format!("{}:{}", h.category, h.name)))
    {
        let program = if fall_back { fallback.unwrap_or(*program) } else { *program };
        let attach_err =
            |reason: String| ProbeError::Attach { program: program.to_string(), tracepoint: format!("{category}:{name}"), reason };
        load(ebpf, program, &mut loaded)?;
        let tp: &mut TracePoint = traced_program(ebpf, program).map_err(attach_err)?;
        tp.attach(category, name).map_err(|e| attach_err(e.to_string()))?;
    }
    Ok(refused.map(|e| e.to_string()))
}

/// `program` of the object as a tracepoint program.
fn traced_program<'a>(ebpf: &'a mut Ebpf, program: &str) -> Result<&'a mut TracePoint, String> {
    ebpf.program_mut(program)
        .ok_or_else(|| format!("the program {program} is missing from the eBPF object"))?
        .try_into()
        .map_err(|e: aya::programs::ProgramError| e.to_string())
}

/// Loads `program` into the kernel once, however many tracepoints it is attached to.
fn load(ebpf: &mut Ebpf, program: &'static str, loaded: &mut std::collections::HashSet<&'static str>) -> Result<(), ProbeError> {
    if loaded.contains(program) {
        return Ok(());
    }
    let reason = |reason: String| ProbeError::Load { reason, hint: "" };
    let tp = traced_program(ebpf, program).map_err(reason)?;
    tp.load().map_err(|e| reason(verifier_message(program, &e)))?;
    loaded.insert(program);
    Ok(())
}

impl Probe {
    /// Loads the programs for a driver layout and attaches every hook.
    pub fn load(layout: &Layout, selection: Selection, kernel: &Kernel) -> Result<Probe, ProbeError> {
        let Selection { trace_all, cgroup, majors, kernel_log } = selection;
        // The kernel accounts BPF memory by memcg on current kernels; raising the old locked-memory
        // limit only matters on old ones and may be refused (no CAP_SYS_RESOURCE): not an error.
        let unlimited = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
        // SAFETY: setrlimit with a valid struct.
        unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) };

        // aya-log's levels: 0 silences every diagnostic, 2 lets warnings through.
        let log_level: u8 = if kernel_log { 2 } else { 0 };
        let btf = aya::Btf::from_sys_fs().ok();
        let mut loader = aya::EbpfLoader::new();
        loader.btf(btf.as_ref()).override_global("AYA_LOG_LEVEL", &log_level, true);
        if let Some(entries) = fds_entries()? {
            loader.map_max_entries("FDS", entries);
        }
        let mut ebpf = loader.load(EBPF_OBJECT).map_err(|e| ProbeError::Load {
            reason: e.to_string(),
            hint: if Path::new("/sys/kernel/btf/vmlinux").exists() {
                ""
            } else {
                " (this kernel has no BTF at /sys/kernel/btf/vmlinux: gputrace needs Linux 5.8 or newer built with CONFIG_DEBUG_INFO_BTF=y)"
            },
        })?;

        let take = |ebpf: &mut Ebpf, name: &'static str| ebpf.take_map(name).ok_or(ProbeError::MissingMap(name));
        let mut config: Array<MapData, Config> = Array::try_from(take(&mut ebpf, "CONFIG")?).map_err(map_err("CONFIG"))?;
        let offsets = crate::btf::running_kernel_offsets().ok();
        // The kernel side tells files by their device numbers (and a fd found so by its
        // close-on-exec bit) only where it can read them; elsewhere it reads every open's path,
        // and userspace checks numbers in /proc.
        let numbers_readable =
            offsets.is_some_and(|o| o.file_inode != 0 && o.inode_rdev != 0 && o.fdtable_fd != 0 && o.fdtable_close_on_exec != 0);
        let (nvidia_major, uvm_major) = kernel_majors(majors, numbers_readable);
        let settings = Config {
            trace_all: trace_all as u32,
            group_dead_at: kernel.group_dead_at,
            cgroup: cgroup.is_some() as u32,
            nvidia_major,
            uvm_major,
            attaching: 1,
        };
        config.set(0, settings, 0).map_err(map_err("CONFIG"))?;
        let cgroups = match cgroup {
            Some(dir) => {
                let mut cgroups = aya::maps::CgroupArray::try_from(take(&mut ebpf, "CGROUPS")?).map_err(map_err("CGROUPS"))?;
                cgroups.set(0, std::os::fd::AsFd::as_fd(dir), 0).map_err(map_err("CGROUPS"))?;
                Some(cgroups)
            }
            None => None,
        };
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
        let mut offsets_map: Array<MapData, KernelOffsets> = Array::try_from(take(&mut ebpf, "OFFSETS")?).map_err(map_err("OFFSETS"))?;
        // Without them the kernel reports no file identity and userspace falls back to kcmp(2).
        if let Some(found) = offsets {
            offsets_map.set(0, found, 0).map_err(map_err("OFFSETS"))?;
        }
        let fds = HashMap::try_from(take(&mut ebpf, "FDS")?).map_err(map_err("FDS"))?;
        let conn_pids = Array::try_from(take(&mut ebpf, "CONN_PIDS")?).map_err(map_err("CONN_PIDS"))?;
        let fd_pids = Array::try_from(take(&mut ebpf, "FD_PIDS")?).map_err(map_err("FD_PIDS"))?;
        let reads = HashMap::try_from(take(&mut ebpf, "READS")?).map_err(map_err("READS"))?;
        let traced = HashMap::try_from(take(&mut ebpf, "TRACED")?).map_err(map_err("TRACED"))?;
        let stats = PerCpuArray::try_from(take(&mut ebpf, "STATS")?).map_err(map_err("STATS"))?;
        let kernel_log = match kernel_log {
            true => Some(
                aya_log::EbpfLogger::init_with_logger(&mut ebpf, KernelLog::default())
                    .map_err(|e| ProbeError::Map { map: "AYA_LOGS", reason: e.to_string() })?,
            ),
            false => None,
        };
        let events = RingBuf::try_from(take(&mut ebpf, "EVENTS")?).map_err(map_err("EVENTS"))?;

        let calls_in_map_only = attach(&mut ebpf, kernel)?;
        Ok(Probe {
            _ebpf: ebpf,
            events: Some(events),
            fds,
            conn_pids,
            fd_pids,
            reads,
            traced,
            stats,
            config,
            settings,
            numbers_readable,
            _cgroups: cgroups,
            kernel_log,
            calls_in_map_only,
            refused_answers: 0,
        })
    }

    /// NVIDIA's device numbers, read again since the load (a module loaded later).
    pub fn set_majors(&mut self, majors: Option<crate::devices::Majors>) -> Result<(), ProbeError> {
        (self.settings.nvidia_major, self.settings.uvm_major) = kernel_majors(majors, self.numbers_readable);
        self.config.set(0, self.settings, 0).map_err(map_err("CONFIG"))
    }

    /// The processes met running are scanned: from now on a child is marked inheriting only when
    /// its parent may hold followed fds.
    pub fn attached(&mut self) -> Result<(), ProbeError> {
        self.settings.attaching = 0;
        self.config.set(0, self.settings, 0).map_err(map_err("CONFIG"))
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
        // The process's slots first, as the kernel's own inserts do: its closes are looked at,
        // and a connection met already accepted has its reads looked at.
        self.fd_pids.set(pid % PID_SLOTS, 1, 0).map_err(map_err("FD_PIDS"))?;
        if state == device::CONN {
            self.conn_pids.set(pid % PID_SLOTS, 1, 0).map_err(map_err("CONN_PIDS"))?;
        }
        self.fds.insert(FdKey { tgid: pid, fd: fd as u32 }, state, 0).map_err(map_err("FDS"))
    }

    /// A read already under way on a followed connection (see [`crate::files::KernelUpdate::BlockedRead`]).
    pub fn set_reading(&mut self, pid: u32, tid: u32, fd: i32, buf: u64) -> Result<(), ProbeError> {
        self.reads.insert((u64::from(pid) << 32) | u64::from(tid), Reading { buf, fd, _pad: 0 }, 0).map_err(map_err("READS"))
    }

    pub fn forget_reading(&mut self, pid: u32, tid: u32) {
        let _ = self.reads.remove(&((u64::from(pid) << 32) | u64::from(tid)));
    }

    /// An answer that could not be stored (see [`Counters::insert_failed`]); whether it is the
    /// first.
    pub fn count_refused_answer(&mut self) -> bool {
        self.refused_answers += 1;
        self.refused_answers == 1
    }

    pub fn forget_fd(&mut self, pid: u32, fd: i32) {
        // Absent already is fine: the kernel side may have removed it on close.
        let _ = self.fds.remove(&FdKey { tgid: pid, fd: fd as u32 });
    }

    pub fn counters(&self) -> Counters {
        let sum = |index: u32| self.stats.get(&index, 0).map(|values| values.iter().sum()).unwrap_or(0);
        Counters {
            lost: sum(stat::LOST),
            questions: sum(stat::QUESTIONS),
            insert_failed: sum(stat::INSERT_FAILED) + self.refused_answers,
            impostors: sum(stat::IMPOSTORS),
            own_file_table: sum(stat::OWN_FILE_TABLE),
            calls_in_map: sum(stat::CALLS_IN_MAP),
        }
    }
}

/// aya's error for a refused program carries the verifier log; keep the part a person can use.
fn verifier_message(program: &str, e: &aya::programs::ProgramError) -> String {
    let text = format!("{e:?}");
    let tail: String = text.lines().rev().take(12).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
    format!("program {program}: {e}\n{tail}")
}

/// The eBPF programs' log, woken on by the event loop.
pub type KernelLogRing = AsyncFd<aya_log::EbpfLogger<KernelLog>>;

/// The kernel's ring buffer of events, and its log's where `--kernel-log` asked for it, each
/// woken on by the event loop.
pub fn rings(probe: &mut Probe) -> anyhow::Result<(AsyncFd<RingBuf<MapData>>, Option<KernelLogRing>)> {
    let ring = probe.events.take().ok_or_else(|| anyhow::anyhow!("the ring buffer was already taken"))?;
    // SAFETY: the ring buffer's fd stays open as long as the AsyncFd that owns it.
    let ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
        .map_err(|e| anyhow::anyhow!("watching the ring buffer: {}", e.into_parts().1))?;
    let kernel_log = match probe.kernel_log.take() {
        // SAFETY: the log ring's fd stays open as long as the AsyncFd that owns the logger.
        Some(logger) => Some(
            unsafe { AsyncFd::register_with_interest(logger, Interest::READABLE) }
                .map_err(|e| anyhow::anyhow!("watching the kernel's log: {}", e.into_parts().1))?,
        ),
        None => None,
    };
    Ok((ring, kernel_log))
}

/// Prints what the eBPF programs logged. aya-log panics on a record it cannot parse: then the log
/// stops (false), recording goes on.
pub fn flush_kernel_log(logger: &mut aya_log::EbpfLogger<KernelLog>) -> bool {
    let parsed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| logger.flush())).is_ok();
    if !parsed {
        eprintln!("gputrace: the kernel's log had a record that could not be read; --kernel-log stops here, recording goes on");
    }
    parsed
}

#[cfg(test)]
mod tests {
    use super::KernelLog;

    #[test]
    fn the_kernel_log_is_capped_per_second_and_says_what_it_dropped() {
        let log = KernelLog::default();
        let printed = (0..100).filter(|_| log.admit(0).0).count() as u64;
        assert_eq!(printed, KernelLog::LINES_PER_SECOND);
        assert_eq!(log.admit(1), (true, 100 - KernelLog::LINES_PER_SECOND), "the next second says how many");
        assert_eq!(log.admit(1), (true, 0));
    }
}

//! Kernel side of gputrace: syscall and process tracepoints that follow NVIDIA device files and
//! copy the params of the memory-relevant ioctls into a ring buffer.
//!
//! The hot path is an ioctl on a fd that is not an NVIDIA device: command arithmetic at entry
//! (one FDS lookup when the command looks NVIDIA's) and array reads at exit (the process's slot
//! in FD_PIDS, then the thread's in CALLS; the LRU map only while a call waits there). Nothing
//! is sent.
#![no_std]
#![no_main]
// BPF's atomic compare-and-exchange (core's atomics lack it on the bpf targets).
#![feature(core_intrinsics)]
#![allow(internal_features)]

use aya_ebpf::{
    bindings::{BPF_EXIST, BPF_NOEXIST},
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_current_task, bpf_ktime_get_ns, bpf_probe_read_kernel, bpf_probe_read_kernel_str_bytes,
        bpf_probe_read_user_str_bytes, generated::bpf_probe_read_user,
    },
    macros::{map, tracepoint},
    maps::{Array, CgroupArray, HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::TracePointContext,
    EbpfContext,
};
// Diagnostics (`--kernel-log`): userspace sets AYA_LOG_LEVEL to 0 unless asked, so each costs
// one global read, and only on the failure paths where they sit.
use aya_log_ebpf::warn;
use tracer_common::{
    alloc, control, control_params_size, device, escape, ioc_nr, ioc_size, ioctl_flag, kind, rm_cmd, rm_command_traced, rm_escape_traced,
    stat, traced, u32_at, u64_at, uvm_command_traced, xfer, Config, ExecRecord, FdKey, FdRecord, IoctlRecord, KernelOffsets, OpenRecord,
    Reading, RecordHeader, SockRecord, UvmWindow, CALL_SLOTS, CLASS_PARAMS_MAX, EXEC_ARGS, PARAMS_MAX, PID_SLOTS, SOCK_HEAD_MAX,
};

#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(16 << 20, 0);
/// What each (process, fd) is; absent means never seen.
#[map]
static FDS: HashMap<FdKey, u8> = HashMap::with_max_entries(1 << 16, 0);
/// Processes that ever had an entry in FDS (see PID_SLOTS): every other process's closes end at
/// this array read, which the kernel inlines, before any hash lookup.
#[map]
static FD_PIDS: Array<u8> = Array::with_max_entries(PID_SLOTS, 0);

/// Whether `tgid`'s slot in one of the per-process arrays (FD_PIDS, CONN_PIDS) is set.
#[inline(always)]
fn slot_set(slots: &Array<u8>, tgid: u32) -> bool {
    slots.get(tgid % PID_SLOTS) == Some(&1)
}

/// Sets `tgid`'s slot in one of the per-process arrays, before the entry it stands for goes in.
#[inline(always)]
fn set_slot(slots: &Array<u8>, tgid: u32) {
    if let Some(slot) = slots.get_ptr_mut(tgid % PID_SLOTS) {
        // SAFETY: an array slot, valid for the map's life; a racing write stores the same 1.
        unsafe { *slot = 1 };
    }
}

/// Whether process `tgid` may have entries in FDS, or be inheriting its parent's.
#[inline(always)]
fn may_hold_fds(tgid: u32) -> bool {
    slot_set(&FD_PIDS, tgid)
}

/// Marks `tgid` as one that may hold followed fds.
#[inline(always)]
fn holds_fds(tgid: u32) {
    set_slot(&FD_PIDS, tgid)
}

/// Every insert into FDS: the process's slot is set first, so a close that finds it unset has
/// no entry to miss.
#[inline(always)]
fn remember_fd(key: &FdKey, state: u8, flags: u64) -> Result<(), i32> {
    holds_fds(key.tgid);
    FDS.insert(key, &state, flags)
}

/// Processes being traced (tgid → `traced::*`), unless Config::trace_all.
#[map]
static TRACED: HashMap<u32, u8> = HashMap::with_max_entries(1 << 15, 0);
#[map]
static CONFIG: Array<Config> = Array::with_max_entries(1, 0);
/// The cgroup v2 directory whose processes (and their descendants' cgroups) are traced, when
/// Config::cgroup says so.
#[map]
static CGROUPS: CgroupArray = CgroupArray::with_max_entries(1, 0);
/// Written by userspace from the kernel's BTF before attaching.
#[map]
static OFFSETS: Array<KernelOffsets> = Array::with_max_entries(1, 0);
#[map]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(stat::COUNT, 0);

#[inline(always)]
fn bump(index: u32) {
    if let Some(counter) = STATS.get_ptr_mut(index) {
        unsafe { *counter += 1 };
    }
}

/// What a syscall's entry left for its exit, forgotten as it is taken. LRU maps, though a plain
/// hash map's insert costs a followed escape about 45 ns less: a user's threads blocked inside
/// syscalls (reads on their own server's sockets, ioctls on a FUSE file) keep their entries
/// while they live, and would fill a plain map so that other users' calls went unfollowed; in
/// an LRU map they are evicted instead.
#[inline(always)]
fn take<T: Copy>(map: &LruHashMap<u64, T>, key: u64) -> Option<T> {
    let value = unsafe { map.get(&key) }.copied()?;
    let _ = map.remove(&key);
    Some(value)
}

/// Counts a refused map insert (the map is full): userspace reports them.
#[inline(always)]
fn count_refused<E>(map: &'static str, inserted: Result<(), E>) {
    if inserted.is_err() {
        bump(stat::INSERT_FAILED);
        let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
        if may_log() {
            warn!(&(), "the map {} is full: an entry for pid {} was refused, and what it was for is not followed", map, tgid);
        }
    }
}

#[derive(Clone, Copy)]
struct LogBudget {
    second: u64,
    lines: u32,
}
/// Lines each CPU may log per second: a full map fails every insert, and a log line per
/// failure would flood the log ring and the terminal.
#[map]
static LOG_BUDGET: PerCpuArray<LogBudget> = PerCpuArray::with_max_entries(1, 0);
const LOG_LINES_PER_SECOND: u32 = 4;

/// Whether this CPU may log one more line this second (`--kernel-log`).
#[inline(always)]
fn may_log() -> bool {
    let Some(budget) = LOG_BUDGET.get_ptr_mut(0) else { return false };
    let second = unsafe { bpf_ktime_get_ns() } / 1_000_000_000;
    // SAFETY: a per-CPU value, touched only by programs on this CPU, which do not preempt each other.
    let budget = unsafe { &mut *budget };
    if budget.second != second {
        budget.second = second;
        budget.lines = 0;
    }
    budget.lines += 1;
    budget.lines <= LOG_LINES_PER_SECOND
}

#[inline(always)]
/// Whether the current process (`tgid`) is traced: everyone, a process followed since its
/// attach or fork, or (watch --cgroup) any process under the chosen cgroup.
fn is_traced(tgid: u32) -> bool {
    let cgroup = match CONFIG.get(0) {
        Some(config) if config.trace_all != 0 => return true,
        Some(config) => config.cgroup != 0,
        None => false,
    };
    if unsafe { TRACED.get(&tgid).is_some() } {
        return true;
    }
    // Followed from now on, wherever it goes, and known by pid to the hooks that run in another
    // process's context (the OOM killer's).
    let joined = cgroup && CGROUPS.current_task_under_cgroup(0) == Ok(true);
    if joined {
        count_refused("TRACED", TRACED.insert(&tgid, &traced::YES, 0));
    }
    joined
}

/// Whether process `tgid`, not necessarily the current one, is traced.
#[inline(always)]
fn is_followed(tgid: u32) -> bool {
    CONFIG.get(0).is_some_and(|c| c.trace_all != 0) || unsafe { TRACED.get(&tgid).is_some() }
}

#[inline(always)]
fn is_nvidia(state: u8) -> bool {
    matches!(state, device::CTL | device::GPU | device::UVM)
}

/// A field of the tracepoint's record at `offset`: a load from the context the verifier allows
/// (aligned, past the common header's first 8 bytes, read only), not a helper call, which every
/// program paid several times a run.
#[inline(always)]
fn arg<T: Copy>(ctx: &TracePointContext, offset: usize) -> T {
    unsafe { (ctx.as_ptr() as *const u8).add(offset).cast::<T>().read() }
}

/// Argument `n` (from 0) of a `sys_enter_*` record: 8 bytes each, after the common header and
/// the syscall number (userspace checks the kernel's format files agree before loading).
#[inline(always)]
fn sys_arg(ctx: &TracePointContext, n: usize) -> u64 {
    arg(ctx, 16 + 8 * n)
}

/// The return value of a `sys_exit_*` record.
#[inline(always)]
fn sys_ret(ctx: &TracePointContext) -> i64 {
    arg(ctx, 16)
}

// Fields of the other tracepoints, where userspace has checked the running kernel puts them
// (tracer/src/tracefs.rs).
const NEWTASK_PID: usize = 8;
const NEWTASK_CLONE_FLAGS: usize = 32;
const EXEC_FILENAME_LOC: usize = 8;
const OOM_VICTIM_PID: usize = 8;

#[inline(always)]
fn header(kind: u32) -> RecordHeader {
    let pid_tgid = bpf_get_current_pid_tgid();
    RecordHeader { kind, tgid: (pid_tgid >> 32) as u32, tid: pid_tgid as u32, _pad: 0, ts_ns: unsafe { bpf_ktime_get_ns() } }
}

fn send_fd_record(kind: u32, a: i64, b: i64, c: i64) {
    let record = FdRecord { header: header(kind), a, b, c };
    if EVENTS.output::<FdRecord>(&record, wake_for(kind)).is_err() {
        bump(stat::LOST);
    }
}

/// bpf_ringbuf_submit's flags, from the kernel's uapi.
const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;

/// A new process wakes the reader at once, whatever escapes wait unread before it: userspace
/// copies its fds and reads its /proc entries while they are there. Everything else keeps the
/// kernel's default (a wake-up only when the reader has caught up).
#[inline(always)]
fn wake_for(kind: u32) -> u64 {
    if kind == kind::FORK || kind == kind::EXEC {
        BPF_RB_FORCE_WAKEUP
    } else {
        0
    }
}

/// Copies `len` user bytes into `dst`. Sizes are matched against the constants the ABI uses so the
/// verifier sees a constant length; any other size copies nothing and reports a fault.
#[inline(always)]
fn read_user(dst: *mut u8, dst_len: usize, src: u64, len: u32) -> bool {
    macro_rules! sized {
        ($($n:literal)*) => {
            match len {
                $($n if $n as usize <= dst_len => unsafe {
                    bpf_probe_read_user(dst as *mut _, $n, src as *const _) == 0
                },)*
                0 => true,
                _ => false,
            }
        };
    }
    sized!(4 8 12 16 20 24 28 32 40 48 56 64 72 80 88 96 104 112 120 128 136 144 152 160 168 176 184 192)
}

/// `current->files->fdt->fd[fd]`: the open file description behind a fd of the current process.
/// At NVIDIA opens, questions, and each ioctl on a followed fd where the driver's majors are
/// known (never for other programs' ioctls). 0 when unknown.
fn file_of(fd: u32) -> u64 {
    FdSlot::of(fd).file()
}

/// A fd of the current process, its table walked once for what is read of it: the file and,
/// after the fd is remembered, its close-on-exec bit (the walk is most of their cost; a table
/// another thread grows in between is read as it was, still valid under RCU).
#[derive(Clone, Copy)]
struct FdSlot {
    /// `current->files->fdt`, where the fd is within it; 0 otherwise (or where fds cannot be read).
    fdt: u64,
    fd: u32,
}

impl FdSlot {
    #[inline(always)]
    fn of(fd: u32) -> FdSlot {
        FdSlot { fdt: OFFSETS.get(0).map_or(0, |o| fd_table(o, fd)), fd }
    }

    /// `fdt->fd[fd]`; 0 when it cannot be read.
    #[inline(always)]
    fn file(self) -> u64 {
        let Some(o) = OFFSETS.get(0) else { return 0 };
        let table = if self.fdt == 0 { 0 } else { read_pointer(self.fdt + o.fdtable_fd as u64) };
        let file = if table == 0 { 0 } else { read_pointer(table + 8 * self.fd as u64) };
        if file == 0 && may_log() {
            let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
            warn!(&(), "pid {} fd {}: the open file behind it could not be read; userspace tells files apart by kcmp", tgid, self.fd);
        }
        file
    }

    /// Whether the fd is close-on-exec (its bit in `fdt->close_on_exec`); None when it cannot be
    /// read.
    #[inline(always)]
    fn close_on_exec(self) -> Option<bool> {
        let o = OFFSETS.get(0)?;
        if self.fdt == 0 || o.fdtable_close_on_exec == 0 {
            return None;
        }
        let bits = read_pointer(self.fdt + o.fdtable_close_on_exec as u64);
        if bits == 0 {
            return None;
        }
        let fd = self.fd;
        // An array of unsigned longs: 64 bits each on the 64-bit kernels gputrace runs on.
        let word = unsafe { bpf_probe_read_kernel((bits + 8 * (fd / 64) as u64) as *const u64) }.ok()?;
        Some((word >> (fd % 64)) & 1 != 0)
    }
}

#[inline(always)]
fn read_pointer(addr: u64) -> u64 {
    unsafe { bpf_probe_read_kernel(addr as *const u64) }.unwrap_or(0)
}

/// `current->files->fdt`, where `fd` is within it; 0 otherwise (or where fds cannot be read).
fn fd_table(o: &KernelOffsets, fd: u32) -> u64 {
    if o.fdtable_fd == 0 {
        return 0;
    }
    let read = read_pointer;
    let task = unsafe { bpf_get_current_task() };
    let files = read(task + o.task_files as u64);
    if files == 0 {
        return 0;
    }
    let fdt = read(files + o.files_fdt as u64);
    if fdt == 0 {
        return 0;
    }
    let max_fds = unsafe { bpf_probe_read_kernel((fdt + o.fdtable_max_fds as u64) as *const u32) }.unwrap_or(0);
    if fd >= max_fds {
        return 0;
    }
    fdt
}

/// Whether the current thread has a file table of its own (unshare(CLONE_FILES), or a clone
/// without CLONE_FILES): its fd numbers are not its process's, by which FDS is keyed, so what it
/// does with fds is not followed (and counted). False when it cannot be told, and once the
/// group leader has exited (its table is gone; the survivors' is the process's).
#[inline(always)]
fn own_file_table() -> bool {
    // The group leader (its tid is the tgid) is the process: no read of the task needed.
    let pid_tgid = bpf_get_current_pid_tgid();
    if pid_tgid as u32 == (pid_tgid >> 32) as u32 {
        return false;
    }
    let Some(o) = OFFSETS.get(0) else { return false };
    if o.task_group_leader == 0 || o.task_files == 0 {
        return false;
    }
    let task = unsafe { bpf_get_current_task() };
    let leader = read_pointer(task + o.task_group_leader as u64);
    if leader == 0 || leader == task {
        return false;
    }
    let leader_files = read_pointer(leader + o.task_files as u64);
    let own = leader_files != 0 && leader_files != read_pointer(task + o.task_files as u64);
    if own {
        bump(stat::OWN_FILE_TABLE);
    }
    own
}

/// Whether the current task's file table is shared with other tasks (threads, or processes
/// made with CLONE_FILES): close_range's CLOSE_RANGE_UNSHARE then closes in a copy of its own.
/// False when it cannot be told.
#[inline(always)]
fn file_table_shared() -> bool {
    let Some(o) = OFFSETS.get(0) else { return false };
    if o.files_count_plus_one == 0 || o.task_files == 0 {
        return false;
    }
    let files = read_pointer(unsafe { bpf_get_current_task() } + o.task_files as u64);
    if files == 0 {
        return false;
    }
    let count = unsafe { bpf_probe_read_kernel((files + o.files_count_plus_one as u64 - 1) as *const u32) }.unwrap_or(0);
    count > 1
}

/// Whether the driver's majors, nvidia's and nvidia-uvm's, are both known: then any file can be
/// told NVIDIA's or not by its device number.
#[inline(always)]
fn majors_known() -> bool {
    CONFIG.get(0).is_some_and(|c| c.nvidia_major != 0 && c.uvm_major != 0)
}

/// What NVIDIA device `file` is by its device number alone (nvidiactl, a GPU, or UVM), where
/// the driver's majors are known: for a fd never seen opened, and for one once answered not
/// NVIDIA whose number may since have been reused, unseen, for NVIDIA's file.
#[inline(always)]
fn nvidia_device_of(file: u64) -> Option<u8> {
    let c = CONFIG.get(0)?;
    if c.nvidia_major == 0 {
        return None;
    }
    let (major, minor) = device_number(file)?;
    match (major, minor) {
        (m, 255) if m == c.nvidia_major => Some(device::CTL),
        (m, 0..=247) if m == c.nvidia_major => Some(device::GPU),
        // Minor 0 only: nvidia-uvm-tools (minor 1, open to all) is not UVM, and asking about it
        // at each of its commands would cost the tracer a question each time.
        (m, 0) if m == c.uvm_major && m != 0 => Some(device::UVM),
        _ => None,
    }
}

/// The (major, minor) of the device file `file`, where it can be read.
#[inline(always)]
fn device_number(file: u64) -> Option<(u32, u32)> {
    let o = OFFSETS.get(0)?;
    if file == 0 || o.file_inode == 0 || o.inode_rdev == 0 {
        return None;
    }
    let inode = read_pointer(file + o.file_inode as u64);
    if inode == 0 {
        return None;
    }
    let rdev = unsafe { bpf_probe_read_kernel((inode + o.inode_rdev as u64) as *const u32) }.ok()?;
    // The kernel's own dev_t: the major above 20 bits of minor.
    Some((rdev >> 20, rdev & 0xfffff))
}

/// Whether `file`, opened at an NVIDIA path as `device`, is NVIDIA's device: its major is the
/// driver's (from userspace's reading of /proc/devices) and its minor the device's (255 for
/// nvidiactl, 0 to 247 for a GPU: nv-chardev-numbers.h). Where that driver
/// (or the UVM module) was not found, or the device number cannot be read, the path stands alone.
fn nvidia_device_number(device: u8, file: u64) -> bool {
    let Some(c) = CONFIG.get(0) else { return true };
    let want = if device == device::UVM { c.uvm_major } else { c.nvidia_major };
    if want == 0 {
        return true;
    }
    let Some((major, minor)) = device_number(file) else { return true };
    major == want
        && match device {
            device::CTL => minor == 255,
            device::GPU => minor <= 247,
            // Any minor of UVM's major: nvidia-uvm-tools (minor 1) at UVM's path answers every
            // command followed with -EINVAL (uvm_tools.c), a failure that changes nothing.
            _ => true,
        }
}

mod fds;
mod ioctl;
mod process;
mod sockets;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";

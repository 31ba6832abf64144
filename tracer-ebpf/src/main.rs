//! Kernel side of gputrace: syscall and process tracepoints that follow NVIDIA device files and
//! copy the params of the memory-relevant ioctls into a ring buffer.
//!
//! The hot path is an ioctl on a fd that is not an NVIDIA device: one FDS lookup at entry (plus
//! command arithmetic when the fd is unknown) and one INFLIGHT lookup at exit. Nothing is sent.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_current_task, bpf_ktime_get_ns, bpf_probe_read_kernel, bpf_probe_read_kernel_str_bytes,
        bpf_probe_read_user_str_bytes, generated::bpf_probe_read_user,
    },
    macros::{map, tracepoint},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::TracePointContext,
};
use tracer_common::{
    device, escape, ioc_nr, ioc_size, ioctl_flag, kind, rm_cmd, rm_command_traced, rm_escape_traced, stat, traced, uvm_command_traced,
    Config, ExecRecord, FdKey, FdRecord, Header, IoctlRecord, KernelOffsets, OpenRecord, SockRecord, UvmWindow, CLASS_PARAMS_MAX,
    PARAMS_MAX, PATH_MAX, SOCK_HEAD_MAX, XFER_SIZE,
};

#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(16 << 20, 0);
/// What each (process, fd) is; absent means never seen.
#[map]
static FDS: HashMap<FdKey, u8> = HashMap::with_max_entries(1 << 16, 0);
/// Processes being traced (tgid → `traced::*`), unless Config::trace_all.
#[map]
static TRACED: HashMap<u32, u8> = HashMap::with_max_entries(1 << 15, 0);
#[map]
static CONFIG: Array<Config> = Array::with_max_entries(1, 0);
/// Per UVM command, the bytes to copy for the running driver version (written by userspace).
#[map]
static UVM_WINDOWS: HashMap<u32, UvmWindow> = HashMap::with_max_entries(16, 0);
/// Per RM class, the size of its allocation params for the running driver version.
#[map]
static CLASS_PARAMS: HashMap<u32, u32> = HashMap::with_max_entries(64, 0);
/// Written by userspace from the kernel's BTF before attaching.
#[map]
static OFFSETS: Array<KernelOffsets> = Array::with_max_entries(1, 0);
#[map]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(stat::COUNT, 0);

#[derive(Clone, Copy)]
struct Inflight {
    arg: u64,
    file: u64,
    fd: i32,
    cmd: u32,
    device: u8,
    flags: u8,
}
/// Entry state kept until the syscall exits, keyed by pid_tgid. LRU so a thread killed inside a
/// syscall cannot leak entries.
#[map]
static IOCTLS: LruHashMap<u64, Inflight> = LruHashMap::with_max_entries(1 << 14, 0);

#[derive(Clone, Copy)]
struct Opening {
    flags: i32,
    device: u8,
    path: [u8; PATH_MAX],
}
#[map]
static OPENS: LruHashMap<u64, Opening> = LruHashMap::with_max_entries(1 << 12, 0);

#[derive(Clone, Copy)]
struct Duping {
    old_fd: i32,
    cloexec: i32,
    state: u8,
}
#[map]
static DUPS: LruHashMap<u64, Duping> = LruHashMap::with_max_entries(1 << 12, 0);

const CLONE_THREAD: u64 = 0x10000;
const O_CLOEXEC: i32 = 0o2000000;
const F_DUPFD: u64 = 0;
const F_SETFD: u64 = 2;
const F_DUPFD_CLOEXEC: u64 = 1030;
const FD_CLOEXEC: u64 = 1;

#[inline(always)]
fn bump(index: u32) {
    if let Some(counter) = STATS.get_ptr_mut(index) {
        unsafe { *counter += 1 };
    }
}

#[inline(always)]
fn is_traced(tgid: u32) -> bool {
    if let Some(config) = CONFIG.get(0) {
        if config.trace_all != 0 {
            return true;
        }
    }
    unsafe { TRACED.get(&tgid).is_some() }
}

#[derive(Clone, Copy)]
struct Reading {
    buf: u64,
    fd: i32,
}
/// A read on an accepted connection, until it returns.
#[map]
static READS: LruHashMap<u64, Reading> = LruHashMap::with_max_entries(1 << 12, 0);

#[inline(always)]
fn is_nvidia(state: u8) -> bool {
    matches!(state, device::CTL | device::GPU | device::UVM)
}

#[inline(always)]
fn arg<T>(ctx: &TracePointContext, offset: usize) -> T
where
    T: Default,
{
    unsafe { ctx.read_at::<T>(offset) }.unwrap_or_default()
}

#[inline(always)]
fn header(kind: u32) -> Header {
    let pid_tgid = bpf_get_current_pid_tgid();
    Header { kind, tgid: (pid_tgid >> 32) as u32, tid: pid_tgid as u32, _pad: 0, ts_ns: unsafe { bpf_ktime_get_ns() } }
}

fn send_fd_record(kind: u32, a: i64, b: i64, c: i64) {
    let record = FdRecord { header: header(kind), a, b, c };
    if EVENTS.output::<FdRecord>(&record, 0).is_err() {
        bump(stat::LOST);
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
/// Only at NVIDIA opens and questions, never on the hot path. 0 when unknown.
fn file_of(fd: u32) -> u64 {
    let Some(o) = OFFSETS.get(0) else { return 0 };
    if o.fdtable_fd == 0 {
        return 0;
    }
    let read = |addr: u64| -> u64 { unsafe { bpf_probe_read_kernel(addr as *const u64) }.unwrap_or(0) };
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
    let table = read(fdt + o.fdtable_fd as u64);
    if table == 0 {
        return 0;
    }
    read(table + 8 * fd as u64)
}

// ---- ioctl ----------------------------------------------------------------------------------

#[tracepoint]
pub fn ioctl_enter(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let fd: u64 = arg(&ctx, 16);
    let cmd = arg::<u64>(&ctx, 24) as u32;
    let key = FdKey { tgid, fd: fd as u32 };
    let looks_nvidia = |cmd: u32| rm_command_traced(cmd) || uvm_command_traced(cmd);
    let (state, flags) = match unsafe { FDS.get(&key) } {
        Some(&device::NOT_NVIDIA) | Some(&device::CONN) => return 0,
        Some(&device::PENDING) => {
            if !looks_nvidia(cmd) {
                return 0;
            }
            (device::PENDING, ioctl_flag::PENDING)
        }
        Some(&device::UVM) => {
            if !uvm_command_traced(cmd) {
                return 0;
            }
            (device::UVM, 0)
        }
        Some(&state) => {
            if !rm_command_traced(cmd) {
                return 0;
            }
            (state, 0)
        }
        None => {
            if !looks_nvidia(cmd) || !is_traced(tgid) {
                return 0;
            }
            // Inherited, dup'ed before tracing or received over a socket: ask once.
            if FDS.insert(&key, &device::PENDING, BPF_NOEXIST as u64).is_err() {
                return 0;
            }
            bump(stat::QUESTIONS);
            (device::PENDING, ioctl_flag::QUESTION)
        }
    };
    let file = if flags == ioctl_flag::QUESTION { file_of(fd as u32) } else { 0 };
    let inflight = Inflight { arg: arg(&ctx, 32), file, fd: fd as i32, cmd, device: state, flags };
    let _ = IOCTLS.insert(&pid_tgid, &inflight, 0);
    0
}

#[tracepoint]
pub fn ioctl_exit(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(inflight) = (unsafe { IOCTLS.get(&pid_tgid) }).copied() else {
        return 0;
    };
    let _ = IOCTLS.remove(&pid_tgid);
    let ret: i64 = arg(&ctx, 16);
    let Some(mut entry) = EVENTS.reserve::<IoctlRecord>(0) else {
        bump(stat::LOST);
        return 0;
    };
    let record = entry.as_mut_ptr();
    let ok = unsafe { fill_ioctl(&mut *record, &inflight, ret) };
    if ok {
        entry.submit(0);
    } else {
        entry.discard(0);
    }
    0
}

/// Returns false when the record is not worth sending (an XFER wrapping an untraced escape).
#[inline(always)]
unsafe fn fill_ioctl(record: &mut IoctlRecord, inflight: &Inflight, ret: i64) -> bool {
    record.header = header(kind::IOCTL);
    record.fd = inflight.fd;
    record.cmd = inflight.cmd;
    record.arg = inflight.arg;
    record.ret = ret;
    record.device = inflight.device;
    record.flags = inflight.flags;
    record._pad = [0; 2];
    record.params_len = 0;
    record.class_len = 0;
    record.file = inflight.file;
    record.escape_cmd = inflight.cmd;
    let params = record.params.as_mut_ptr();

    if uvm_command_traced(inflight.cmd) {
        let Some(window) = (unsafe { UVM_WINDOWS.get(&inflight.cmd) }).copied() else {
            return false;
        };
        let head = window.head_len.min(PARAMS_MAX as u32);
        let mut ok = read_user(params, PARAMS_MAX, inflight.arg, head);
        if head as usize + 16 <= PARAMS_MAX {
            let tail_dst = unsafe { params.add(head as usize) };
            ok &= read_user(tail_dst, 16, inflight.arg + window.tail_offset as u64, window.tail_len);
        }
        record.params_len = head + window.tail_len;
        if !ok {
            record.flags |= ioctl_flag::PARAMS_FAULT;
        }
        return true;
    }

    let mut src = inflight.arg;
    let mut size = ioc_size(inflight.cmd);
    let mut nr = ioc_nr(inflight.cmd);
    if nr == escape::IOCTL_XFER_CMD {
        let mut xfer = [0u8; XFER_SIZE];
        if !read_user(xfer.as_mut_ptr(), XFER_SIZE, inflight.arg, XFER_SIZE as u32) {
            record.flags |= ioctl_flag::PARAMS_FAULT;
            return true;
        }
        nr = u32::from_ne_bytes([xfer[0], xfer[1], xfer[2], xfer[3]]);
        size = u32::from_ne_bytes([xfer[4], xfer[5], xfer[6], xfer[7]]);
        src = u64::from_ne_bytes([xfer[8], xfer[9], xfer[10], xfer[11], xfer[12], xfer[13], xfer[14], xfer[15]]);
        if !rm_escape_traced(nr, size) {
            return false;
        }
        record.escape_cmd = rm_cmd(nr, size);
        record.flags |= ioctl_flag::XFER;
    }
    if !read_user(params, PARAMS_MAX, src, size) {
        record.flags |= ioctl_flag::PARAMS_FAULT;
        return true;
    }
    record.params_len = size;

    if nr == escape::RM_ALLOC {
        // NVOS21 and NVOS64 share hClass@12 and pAllocParms@16. RM copies the class's own
        // size, not paramsSize, so the size comes from the class table.
        let p = &record.params;
        let class = u32::from_ne_bytes([p[12], p[13], p[14], p[15]]);
        let alloc_params = u64::from_ne_bytes([p[16], p[17], p[18], p[19], p[20], p[21], p[22], p[23]]);
        if let Some(&class_len) = unsafe { CLASS_PARAMS.get(&class) } {
            if alloc_params != 0 {
                if read_user(record.class_params.as_mut_ptr(), CLASS_PARAMS_MAX, alloc_params, class_len) {
                    record.class_len = class_len;
                } else {
                    record.flags |= ioctl_flag::CLASS_FAULT;
                }
            }
        }
    }
    true
}

// ---- file descriptors -----------------------------------------------------------------------

/// `/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia<N>`; anything else (including
/// nvidia-uvm-tools, nvidia-modeset, nvidia-caps) is not followed.
#[inline(always)]
fn classify(path: &[u8; PATH_MAX]) -> Option<u8> {
    const PREFIX: &[u8; 11] = b"/dev/nvidia";
    let mut i = 0;
    while i < PREFIX.len() {
        if path[i] != PREFIX[i] {
            return None;
        }
        i += 1;
    }
    let rest = &path[11..];
    if rest[..4] == *b"ctl\0" {
        return Some(device::CTL);
    }
    if rest[..5] == *b"-uvm\0" {
        return Some(device::UVM);
    }
    let mut j = 0;
    while j < 4 {
        let c = rest[j];
        if c == 0 {
            return if j > 0 { Some(device::GPU) } else { None };
        }
        if !c.is_ascii_digit() {
            return None;
        }
        j += 1;
    }
    None
}

fn open_enter(ctx: &TracePointContext, path_offset: usize, flags_offset: usize) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !is_traced((pid_tgid >> 32) as u32) {
        return 0;
    }
    let filename: u64 = arg(ctx, path_offset);
    let mut opening = Opening { flags: arg::<u64>(ctx, flags_offset) as i32, device: 0, path: [0; PATH_MAX] };
    if unsafe { bpf_probe_read_user_str_bytes(filename as *const u8, &mut opening.path) }.is_err() {
        return 0;
    }
    let Some(device) = classify(&opening.path) else {
        return 0;
    };
    opening.device = device;
    let _ = OPENS.insert(&pid_tgid, &opening, 0);
    0
}

#[tracepoint]
pub fn openat_enter(ctx: TracePointContext) -> u32 {
    open_enter(&ctx, 24, 32)
}

#[tracepoint]
pub fn open_enter_legacy(ctx: TracePointContext) -> u32 {
    open_enter(&ctx, 16, 24)
}

#[tracepoint]
pub fn open_exit(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(opening) = (unsafe { OPENS.get(&pid_tgid) }).copied() else {
        return 0;
    };
    let _ = OPENS.remove(&pid_tgid);
    let fd: i64 = arg(&ctx, 16);
    if fd < 0 {
        return 0;
    }
    let _ = FDS.insert(&FdKey { tgid: (pid_tgid >> 32) as u32, fd: fd as u32 }, &opening.device, 0);
    let record = OpenRecord {
        header: header(kind::OPEN),
        fd: fd as i32,
        flags: opening.flags,
        file: file_of(fd as u32),
        device: opening.device,
        _pad: [0; 7],
        path: opening.path,
    };
    if EVENTS.output::<OpenRecord>(&record, 0).is_err() {
        bump(stat::LOST);
    }
    0
}

/// Forgets what `fd` was; tells userspace when it was an NVIDIA file (a reference dropped), or
/// when it may be one inherited by a child whose fds userspace has not copied yet.
#[inline(always)]
fn forget_fd(tgid: u32, fd: u32) {
    let key = FdKey { tgid, fd };
    match unsafe { FDS.get(&key) } {
        Some(&state) => {
            let _ = FDS.remove(&key);
            if is_nvidia(state) {
                send_fd_record(kind::CLOSE, fd as i64, 0, 0);
            } else if state == device::CONN {
                send_fd_record(kind::CONN_CLOSE, fd as i64, 0, 0);
            }
        }
        None => {
            if unsafe { TRACED.get(&tgid) } == Some(&traced::INHERITING) {
                send_fd_record(kind::CLOSE, fd as i64, 1, 0);
            }
        }
    }
}

#[tracepoint]
pub fn close_enter(ctx: TracePointContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    forget_fd(tgid, arg::<u64>(&ctx, 16) as u32);
    0
}

fn dup_enter(ctx: &TracePointContext, new_fd: Option<u32>, cloexec: i32) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let old_fd = arg::<u64>(ctx, 16) as u32;
    if let Some(new_fd) = new_fd {
        if new_fd == old_fd {
            return 0;
        }
        // dup2/dup3 onto an open fd closes it first.
        forget_fd(tgid, new_fd);
    }
    if let Some(&state) = unsafe { FDS.get(&FdKey { tgid, fd: old_fd }) } {
        let _ = DUPS.insert(&pid_tgid, &Duping { old_fd: old_fd as i32, cloexec, state }, 0);
    }
    0
}

#[tracepoint]
pub fn dup_enter_plain(ctx: TracePointContext) -> u32 {
    dup_enter(&ctx, None, 0)
}

#[tracepoint]
pub fn dup2_enter(ctx: TracePointContext) -> u32 {
    let new_fd = arg::<u64>(&ctx, 24) as u32;
    dup_enter(&ctx, Some(new_fd), 0)
}

#[tracepoint]
pub fn dup3_enter(ctx: TracePointContext) -> u32 {
    let new_fd = arg::<u64>(&ctx, 24) as u32;
    let flags = arg::<u64>(&ctx, 32) as i32;
    dup_enter(&ctx, Some(new_fd), flags & O_CLOEXEC)
}

#[tracepoint]
pub fn fcntl_enter(ctx: TracePointContext) -> u32 {
    let fcntl_cmd: u64 = arg(&ctx, 24);
    match fcntl_cmd {
        F_DUPFD => dup_enter(&ctx, None, 0),
        F_DUPFD_CLOEXEC => dup_enter(&ctx, None, O_CLOEXEC),
        F_SETFD => {
            let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
            let fd = arg::<u64>(&ctx, 16) as u32;
            if let Some(&state) = unsafe { FDS.get(&FdKey { tgid, fd }) } {
                if is_nvidia(state) {
                    let value: u64 = arg(&ctx, 32);
                    send_fd_record(kind::SET_CLOEXEC, fd as i64, (value & FD_CLOEXEC) as i64, 0);
                }
            }
            0
        }
        _ => 0,
    }
}

/// Exit of dup, dup2, dup3 and fcntl: the new fd shares the old one's file.
#[tracepoint]
pub fn dup_exit(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(duping) = (unsafe { DUPS.get(&pid_tgid) }).copied() else {
        return 0;
    };
    let _ = DUPS.remove(&pid_tgid);
    let new_fd: i64 = arg(&ctx, 16);
    if new_fd < 0 {
        return 0;
    }
    let _ = FDS.insert(&FdKey { tgid: (pid_tgid >> 32) as u32, fd: new_fd as u32 }, &duping.state, 0);
    if is_nvidia(duping.state) || duping.state == device::CONN {
        send_fd_record(kind::DUP, duping.old_fd as i64, new_fd, duping.cloexec as i64);
    }
    0
}

/// The range may be huge (3..~0), so userspace, which mirrors FDS, does the forgetting.
#[tracepoint]
pub fn close_range_enter(ctx: TracePointContext) -> u32 {
    if !is_traced((bpf_get_current_pid_tgid() >> 32) as u32) {
        return 0;
    }
    let first: u64 = arg(&ctx, 16);
    let last: u64 = arg(&ctx, 24);
    let flags: u64 = arg(&ctx, 32);
    send_fd_record(kind::CLOSE_RANGE, first as i64, last as u32 as i64, flags as i64);
    0
}

// ---- sockets: when a server listens, when requests arrive, when responses start ----------

#[tracepoint]
pub fn bind_enter(ctx: TracePointContext) -> u32 {
    if !is_traced((bpf_get_current_pid_tgid() >> 32) as u32) {
        return 0;
    }
    let fd: u64 = arg(&ctx, 16);
    let addr: u64 = arg(&ctx, 24);
    // sockaddr_in and sockaddr_in6 both keep the port, big-endian, at byte 2.
    let mut head = [0u8; 4];
    if !read_user(head.as_mut_ptr(), 4, addr, 4) {
        return 0;
    }
    let family = u16::from_ne_bytes([head[0], head[1]]);
    if family == 2 || family == 10 {
        send_fd_record(kind::BIND, fd as i64, u16::from_be_bytes([head[2], head[3]]) as i64, 0);
    }
    0
}

#[tracepoint]
pub fn listen_enter(ctx: TracePointContext) -> u32 {
    if is_traced((bpf_get_current_pid_tgid() >> 32) as u32) {
        send_fd_record(kind::LISTEN, arg::<u64>(&ctx, 16) as i64, 0, 0);
    }
    0
}

/// Exit of accept and accept4: the new fd is a connection whose traffic is followed.
#[tracepoint]
pub fn accept_exit(ctx: TracePointContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let fd: i64 = arg(&ctx, 16);
    if fd < 0 || !is_traced(tgid) {
        return 0;
    }
    let _ = FDS.insert(&FdKey { tgid, fd: fd as u32 }, &device::CONN, 0);
    send_fd_record(kind::ACCEPT, fd, 0, 0);
    0
}

fn send_sock_io(fd: i32, inbound: bool, len: i64, buf: u64) {
    let Some(mut entry) = EVENTS.reserve::<SockRecord>(0) else {
        bump(stat::LOST);
        return;
    };
    let record = unsafe { &mut *entry.as_mut_ptr() };
    record.header = header(kind::SOCK_IO);
    record.fd = fd;
    record.inbound = inbound as u32;
    record.len = len;
    record._pad = 0;
    record.head = [0; SOCK_HEAD_MAX];
    // As much of the head as the bytes go, in the sizes the verifier sees as constants.
    let take: u32 = match len {
        64.. => 64,
        48..=63 => 48,
        32..=47 => 32,
        16..=31 => 16,
        8..=15 => 8,
        _ => 0,
    };
    record.head_len = if take > 0 && read_user(record.head.as_mut_ptr(), SOCK_HEAD_MAX, buf, take) { take } else { 0 };
    entry.submit(0);
}

#[inline(always)]
fn conn(fd: u64) -> bool {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    (unsafe { FDS.get(&FdKey { tgid, fd: fd as u32 }) }) == Some(&device::CONN)
}

/// Enter of read and recvfrom (fd @16, buffer @24).
#[tracepoint]
pub fn read_enter(ctx: TracePointContext) -> u32 {
    let fd: u64 = arg(&ctx, 16);
    if conn(fd) {
        let _ = READS.insert(&bpf_get_current_pid_tgid(), &Reading { buf: arg(&ctx, 24), fd: fd as i32 }, 0);
    }
    0
}

#[tracepoint]
pub fn read_exit(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(reading) = (unsafe { READS.get(&pid_tgid) }).copied() else {
        return 0;
    };
    let _ = READS.remove(&pid_tgid);
    let len: i64 = arg(&ctx, 16);
    if len > 0 {
        send_sock_io(reading.fd, true, len, reading.buf);
    }
    0
}

/// Enter of write and sendto (fd @16, buffer @24, length @32).
#[tracepoint]
pub fn write_enter(ctx: TracePointContext) -> u32 {
    let fd: u64 = arg(&ctx, 16);
    if conn(fd) {
        send_sock_io(fd as i32, false, arg(&ctx, 32), arg(&ctx, 24));
    }
    0
}

/// writev and sendmsg carry iovecs: the first one's bytes are the start of what is sent.
#[tracepoint]
pub fn writev_enter(ctx: TracePointContext) -> u32 {
    let fd: u64 = arg(&ctx, 16);
    if !conn(fd) {
        return 0;
    }
    let vec: u64 = arg(&ctx, 24);
    let mut iov = [0u8; 16];
    if read_user(iov.as_mut_ptr(), 16, vec, 16) {
        let base = u64::from_ne_bytes([iov[0], iov[1], iov[2], iov[3], iov[4], iov[5], iov[6], iov[7]]);
        let len = u64::from_ne_bytes([iov[8], iov[9], iov[10], iov[11], iov[12], iov[13], iov[14], iov[15]]);
        send_sock_io(fd as i32, false, len as i64, base);
    }
    0
}

/// The kernel's OOM killer chose a victim: recorded when it is a traced process.
#[tracepoint]
pub fn oom_victim(ctx: TracePointContext) -> u32 {
    let victim: i32 = arg(&ctx, 8);
    if is_traced(victim as u32) {
        send_fd_record(kind::OOM_VICTIM, victim as i64, 0, 0);
    }
    0
}

// ---- processes ------------------------------------------------------------------------------

/// Runs in the parent. A new process (not a thread) of a traced process is traced too.
#[tracepoint]
pub fn task_newtask(ctx: TracePointContext) -> u32 {
    let clone_flags: u64 = arg(&ctx, 32);
    if clone_flags & CLONE_THREAD != 0 {
        return 0;
    }
    let parent = (bpf_get_current_pid_tgid() >> 32) as u32;
    if !is_traced(parent) {
        return 0;
    }
    let child: i32 = arg(&ctx, 8);
    let _ = TRACED.insert(&(child as u32), &traced::INHERITING, 0);
    send_fd_record(kind::FORK, child as i64, 0, 0);
    0
}

#[tracepoint]
pub fn process_exec(ctx: TracePointContext) -> u32 {
    if !is_traced((bpf_get_current_pid_tgid() >> 32) as u32) {
        return 0;
    }
    let Some(mut entry) = EVENTS.reserve::<ExecRecord>(0) else {
        bump(stat::LOST);
        return 0;
    };
    let record = unsafe { &mut *entry.as_mut_ptr() };
    record.header = header(kind::EXEC);
    record.filename = [0; 64];
    let data_loc: u32 = arg(&ctx, 8);
    let src = unsafe { (aya_ebpf::EbpfContext::as_ptr(&ctx) as *const u8).add((data_loc & 0xffff) as usize) };
    let _ = unsafe { bpf_probe_read_kernel_str_bytes(src, &mut record.filename) };
    entry.submit(0);
    0
}

#[tracepoint]
pub fn process_exit(ctx: TracePointContext) -> u32 {
    let group_dead: u8 = arg(&ctx, 32);
    if group_dead == 0 {
        return 0;
    }
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if !is_traced(tgid) {
        return 0;
    }
    let _ = TRACED.remove(&tgid);
    send_fd_record(kind::EXIT, 0, 0, 0);
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";

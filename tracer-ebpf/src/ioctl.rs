//! ioctl enter and exit: the NVIDIA escapes and UVM commands, their params copied to the ring
//! buffer; an unknown fd with an NVIDIA-looking command is asked about once.

use core::intrinsics::{atomic_cxchg, atomic_xadd, atomic_xchg, atomic_xsub, AtomicOrdering::SeqCst};
// Words other threads write atomically are read with volatile loads: the bpf targets have no
// atomic load (a plain one is as atomic for an aligned word).
use core::ptr::read_volatile;

use super::*;

#[derive(Clone, Copy)]
struct Inflight {
    arg: u64,
    file: u64,
    fd: i32,
    cmd: u32,
    device: u8,
    flags: u8,
}
/// Entry state kept until the syscall exits, keyed by pid_tgid, for a call whose thread's slot
/// in CALLS is taken (or on a kernel without BPF's atomics). LRU so a thread killed inside a
/// syscall cannot leak entries.
#[map]
static IOCTLS: LruHashMap<u64, Inflight> = LruHashMap::with_max_entries(1 << 14, 0);

/// A call in flight in its thread's slot: `owner` is the thread's pid_tgid while it is inside
/// the call, 0 when the slot is free.
#[repr(C)]
#[derive(Clone, Copy)]
struct Slot {
    owner: u64,
    call: Inflight,
}
/// Calls in flight by thread number modulo CALL_SLOTS: an array, whose lookups the kernel
/// inlines, where an LRU map's insert, lookup and delete cost a followed escape about 400 ns.
/// Two threads of the same number modulo are told apart by the atomic claim of `owner`: the
/// second, while the first is inside its call, keeps its own in IOCTLS.
#[map]
static CALLS: Array<Slot> = Array::with_max_entries(CALL_SLOTS, 0);

/// How many calls the slots' programs have kept in IOCTLS: counted up before one is kept there,
/// down as one is taken. While none is, an exit whose slot is not its own (every ioctl of a
/// process holding NVIDIA's files that is not followed) looks nothing up. An entry the LRU map
/// evicts is never counted down: the count errs high, which costs only lookups.
#[map]
static SPILLED: Array<u64> = Array::with_max_entries(1, 0);

/// `pid_tgid`'s slot in CALLS, by its thread number.
#[inline(always)]
fn slot_of(pid_tgid: u64) -> Option<*mut Slot> {
    CALLS.get_ptr_mut(pid_tgid as u32 % CALL_SLOTS)
}

/// Keeps a call for its exit: in its thread's slot when it can claim it (free, or left claimed
/// by this very thread, whose exit was not seen), else in IOCTLS. `SLOTS` is false where the
/// kernel refuses BPF's atomics (before 5.12): IOCTLS alone.
#[inline(always)]
fn keep<const SLOTS: bool>(pid_tgid: u64, call: &Inflight) {
    if SLOTS {
        if let Some(slot) = slot_of(pid_tgid) {
            // SAFETY: an array value, valid for the map's life, its owner word 8-byte aligned.
            let (before, _) = unsafe { atomic_cxchg::<u64, { SeqCst }, { SeqCst }>(&raw mut (*slot).owner, 0, pid_tgid) };
            if before == 0 || before == pid_tgid {
                // SAFETY: as above; no other thread writes a slot it does not own.
                unsafe { (*slot).call = *call };
                return;
            }
        }
        if let Some(spilled) = SPILLED.get_ptr_mut(0) {
            // SAFETY: an array value, valid for the map's life.
            unsafe { atomic_xadd::<u64, u64, { SeqCst }>(spilled, 1) };
        }
    }
    bump(stat::CALLS_IN_MAP);
    count_refused("IOCTLS", IOCTLS.insert(&pid_tgid, call, 0));
}

/// The call this thread's entry kept, forgotten as it is taken (its slot freed).
#[inline(always)]
fn take_call<const SLOTS: bool>(pid_tgid: u64) -> Option<Inflight> {
    if SLOTS {
        if let Some(slot) = slot_of(pid_tgid) {
            // SAFETY: as in keep; only this thread sets the owner to its own pid_tgid.
            if unsafe { read_volatile(&raw const (*slot).owner) } == pid_tgid {
                let call = unsafe { (*slot).call };
                // An atomic exchange, a full barrier: the next owner's writes come after the
                // reads above on every architecture.
                unsafe { atomic_xchg::<u64, { SeqCst }>(&raw mut (*slot).owner, 0) };
                return Some(call);
            }
        }
        let spilled = SPILLED.get_ptr_mut(0)?;
        // SAFETY: an array value, valid for the map's life; this thread's own count up, if it
        // kept its call there, came before in its own program order.
        if unsafe { read_volatile(spilled) } == 0 {
            return None;
        }
        let call = take(&IOCTLS, pid_tgid)?;
        unsafe { atomic_xsub::<u64, u64, { SeqCst }>(spilled, 1) };
        return Some(call);
    }
    take(&IOCTLS, pid_tgid)
}

/// Frees the slot of a thread that exits holding it (its call's exit never seen: a run the kernel
/// skipped), so that no later thread of its number keeps its calls in IOCTLS for good, nor takes
/// that call for one of its own. Only the owner frees a slot: a plain store.
#[inline(always)]
pub(crate) fn forget_call(pid_tgid: u64) {
    if let Some(slot) = slot_of(pid_tgid) {
        // SAFETY: as in keep.
        unsafe {
            if read_volatile(&raw const (*slot).owner) == pid_tgid {
                (*slot).owner = 0;
            }
        }
    }
}

/// Per UVM command, the bytes to copy for the running driver version (written by userspace).
#[map]
static UVM_WINDOWS: HashMap<u32, UvmWindow> = HashMap::with_max_entries(16, 0);
/// Per RM class, the size of its allocation params for the running driver version.
#[map]
static CLASS_PARAMS: HashMap<u32, u32> = HashMap::with_max_entries(64, 0);

#[tracepoint]
pub fn ioctl_enter(ctx: TracePointContext) -> u32 {
    enter::<true>(&ctx)
}

/// ioctl_enter where the kernel refuses BPF's atomics (before 5.12, 5.18 on arm64): userspace
/// loads it and ioctl_exit_lru then.
#[tracepoint]
pub fn ioctl_enter_lru(ctx: TracePointContext) -> u32 {
    enter::<false>(&ctx)
}

#[inline(always)]
fn enter<const SLOTS: bool>(ctx: &TracePointContext) -> u32 {
    let cmd = sys_arg(ctx, 1) as u32;
    // The close-on-exec flag set or cleared by ioctl, as fcntl(F_SETFD) does.
    if cmd == FIOCLEX || cmd == FIONCLEX {
        return fds::set_cloexec(sys_arg(ctx, 0) as u32, cmd == FIOCLEX);
    }
    // RM_CONTROL is the commonest escape: only the exports and imports of objects go on, told
    // by NVOS54's cmd before anything else is looked up.
    if cmd == RM_CONTROL_CMD && !control_followed(sys_arg(ctx, 2)) {
        return 0;
    }
    // Every branch below needs an NVIDIA-looking command: arithmetic ends the ioctls of every
    // other program here, before any map is read.
    if !(rm_command_traced(cmd) || uvm_command_traced(cmd)) {
        return 0;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let fd = sys_arg(ctx, 0);
    let key = FdKey { tgid, fd: fd as u32 };
    let known = unsafe { FDS.get(&key) }.copied();
    if matches!(known, Some(device::CONN)) || (known == Some(device::NOT_NVIDIA) && !reused_for_nvidia(&key)) {
        return 0;
    }
    // A thread with a file table of its own is checked only once the call would be recorded:
    // other processes' NVIDIA calls (an untraced fd) never pay for it.
    let (state, flags, file) = match known {
        Some(device::PENDING) => {
            if own_file_table() {
                return 0;
            }
            (device::PENDING, ioctl_flag::PENDING, 0)
        }
        Some(device::UVM) => {
            if !uvm_command_traced(cmd) || own_file_table() || repointed(&key, device::UVM) {
                return 0;
            }
            (device::UVM, 0, 0)
        }
        Some(state) if state != device::NOT_NVIDIA => {
            if !rm_command_traced(cmd) || own_file_table() || repointed(&key, state) {
                return 0;
            }
            (state, 0, 0)
        }
        // Never seen (inherited, dup'ed before tracing, received over a socket, opened other
        // than for reading and writing), or once not NVIDIA and now NVIDIA's device.
        _ => {
            if !is_traced(tgid) || own_file_table() {
                return 0;
            }
            match first_call(&key, known.is_none(), cmd) {
                Some(first) => first,
                None => return 0,
            }
        }
    };
    let inflight = Inflight { arg: sys_arg(ctx, 2), file, fd: fd as i32, cmd, device: state, flags };
    keep::<SLOTS>(pid_tgid, &inflight);
    0
}

/// The first NVIDIA-looking call on a fd the kernel has no answer for (`unseen`: no entry at
/// all): its state, flags and file, or None when it is not to be recorded. Where the driver's
/// majors are known, the file's device number says at once what it is: no question for
/// userspace, whose answer could come after the fd was closed unseen (a dup, used once). Other
/// files, and every file where the majors are not known, are asked about once.
#[inline(always)]
fn first_call(key: &FdKey, unseen: bool, cmd: u32) -> Option<(u8, u8, u64)> {
    let slot = FdSlot::of(key.fd);
    let file = slot.file();
    let found = if majors_known() { nvidia_device_of(file) } else { None };
    // A device found by number is remembered only at a command followed on it, whose record
    // names the fd to userspace: remembered at another, its later calls would reach userspace
    // as known without its having heard of the fd (and be dropped on an older answer of its
    // own for that number).
    let followed = |device| if device == device::UVM { uvm_command_traced(cmd) } else { rm_command_traced(cmd) };
    if found.is_some_and(|device| !followed(device)) {
        return None;
    }
    let state = found.unwrap_or(device::PENDING);
    let flag = if unseen { BPF_NOEXIST } else { BPF_EXIST };
    match remember_fd(key, state, flag as u64) {
        Ok(()) if found.is_none() => bump(stat::QUESTIONS),
        Ok(()) => {}
        // Another thread's first call on this fd came just before: this one is sent with what
        // its own reading found, or pending for the same answer.
        Err(EEXIST) if unseen && found.is_none() => return Some((device::PENDING, ioctl_flag::PENDING, file)),
        Err(EEXIST) if unseen => {}
        // Gone since (closed): nothing to follow.
        Err(ENOENT) => return None,
        Err(e) => {
            count_refused("FDS", Err(e));
            return None;
        }
    }
    // The close-on-exec bit is read by the kernel, not from /proc by userspace (its answer could
    // come after the flag changed, and /proc/PID/fdinfo of whatever the number names by then, an
    // epoll fd's, can be made costly), and after the fd is remembered, so that an F_SETFD from
    // another thread entering after that is followed (see fds::open_exit for the race left).
    let cloexec = if slot.close_on_exec() == Some(true) { ioctl_flag::CLOEXEC } else { 0 };
    let flags = if found.is_some() { ioctl_flag::BY_NUMBER } else { ioctl_flag::QUESTION };
    Some((state, flags | cloexec, file))
}

/// Whether a fd answered not NVIDIA now names NVIDIA's device: its number reused where no
/// syscall tracepoint saw it (io_uring's open). Only where the driver's majors are known, and
/// only for NVIDIA-looking commands, so other programs' ioctls never pay for it.
#[inline(always)]
fn reused_for_nvidia(key: &FdKey) -> bool {
    CONFIG.get(0).is_some_and(|c| c.nvidia_major != 0) && nvidia_device_of(file_of(key.fd)).is_some()
}

/// Whether a followed fd's file is no longer NVIDIA's device: the fd was closed and its number
/// reused where no syscall tracepoint saw it (io_uring's close and open). Then the fd is
/// forgotten (its close sent). Only where the driver's majors are known.
#[inline(always)]
fn repointed(key: &FdKey, state: u8) -> bool {
    if CONFIG.get(0).is_none_or(|c| c.nvidia_major == 0) || nvidia_device_number(state, file_of(key.fd)) {
        return false;
    }
    // Forgotten, not marked: the next NVIDIA ioctl on that number is a question for userspace,
    // so a mismatch seen by a thread with a file table of its own hides nothing for good.
    fds::forget_fd(key.tgid, key.fd);
    bump(stat::IMPOSTORS);
    true
}

/// bpf_map_update_elem's refusals, negated errnos.
const EEXIST: i32 = -17;
const ENOENT: i32 = -2;

const RM_CONTROL_CMD: u32 = rm_cmd(escape::RM_CONTROL, 32);
/// asm-generic/ioctls.h, on x86 and arm64 alike.
const FIONCLEX: u32 = 0x5450;
const FIOCLEX: u32 = 0x5451;

/// bpf_ringbuf_query's flag, from the kernel's uapi.
const BPF_RB_AVAIL_DATA: u64 = 0;
/// Unread bytes in the ring (16 MiB) past which an escape wakes the reader: a few milliseconds
/// of records at the highest rates, far from full.
const WAKE_AT: u64 = 1 << 20;

/// Whether the NVOS54 at `arg` carries a control gputrace follows (one 4-byte read).
#[inline(always)]
fn control_followed(arg: u64) -> bool {
    let mut cmd = [0u8; 4];
    read_user(cmd.as_mut_ptr(), 4, arg + control::CMD as u64, 4) && control_params_size(u32::from_ne_bytes(cmd)).is_some()
}

#[tracepoint]
pub fn ioctl_exit(ctx: TracePointContext) -> u32 {
    exit::<true>(&ctx)
}

/// ioctl_exit for a kernel that refuses BPF's atomics, with ioctl_enter_lru.
#[tracepoint]
pub fn ioctl_exit_lru(ctx: TracePointContext) -> u32 {
    exit::<false>(&ctx)
}

#[inline(always)]
fn exit<const SLOTS: bool>(ctx: &TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    // Entries are left only on fds in FDS: every other process's ioctls end here.
    if !may_hold_fds((pid_tgid >> 32) as u32) {
        return 0;
    }
    let Some(inflight) = take_call::<SLOTS>(pid_tgid) else {
        return 0;
    };
    let ret = sys_ret(ctx);
    let Some(mut entry) = EVENTS.reserve::<IoctlRecord>(0) else {
        bump(stat::LOST);
        unsent(pid_tgid, &inflight);
        return 0;
    };
    let record = entry.as_mut_ptr();
    let ok = unsafe { fill_ioctl(&mut *record, &inflight, ret) };
    if ok {
        // Waking the reader is most of a record's cost: escapes wake it only once a batch has
        // built up (it drains on its own every 100 ms too); a question is answered at once.
        let wake = if inflight.flags & ioctl_flag::QUESTION != 0 || EVENTS.query(BPF_RB_AVAIL_DATA) >= WAKE_AT {
            BPF_RB_FORCE_WAKEUP
        } else {
            BPF_RB_NO_WAKEUP
        };
        entry.submit(wake);
    } else {
        entry.discard(0);
        unsent(pid_tgid, &inflight);
    }
    0
}

/// A call not sent to userspace: when it was the one that found its device by number, whose
/// record was to name the fd to userspace, the fd is forgotten, so that its next call finds it
/// again (sent as known, its calls could be dropped on an older answer userspace kept).
#[inline(always)]
fn unsent(pid_tgid: u64, inflight: &Inflight) {
    if inflight.flags & ioctl_flag::BY_NUMBER != 0 {
        let _ = FDS.remove(&FdKey { tgid: (pid_tgid >> 32) as u32, fd: inflight.fd as u32 });
    }
}

/// Copies a followed control's params into `out`: the whole struct, or a batch's parts (its
/// head, its count and index, its first handles and, for an import, their types written back).
#[inline(always)]
fn copy_control(cmd: u32, ptr: u64, out: &mut [u8; CLASS_PARAMS_MAX], len: u32) -> bool {
    let base = out.as_mut_ptr();
    let at = |offset: usize| unsafe { base.add(offset) };
    const HANDLES: u32 = 4 * control::OBJECTS_FOLLOWED as u32;
    let left = |offset: usize| CLASS_PARAMS_MAX - offset;
    let (objects, count) = match cmd {
        control::EXPORT_OBJECTS_TO_FD => (control::EXPORT_OBJECTS_AT, control::EXPORT_COUNT_AT),
        control::IMPORT_OBJECTS_FROM_FD => (control::IMPORT_OBJECTS_AT, control::IMPORT_COUNT_AT),
        control::FABRIC_ATTACH_MEM | control::FABRIC_DETACH_MEM => return copy_fabric(cmd, ptr, out),
        _ => return read_user(at(0), CLASS_PARAMS_MAX, ptr, len),
    };
    let mut ok = read_user(at(control::PACKED_HEAD), 8, ptr, 8)
        && read_user(at(control::PACKED_COUNT), left(control::PACKED_COUNT), ptr + count as u64, 4)
        && read_user(at(control::PACKED_OBJECTS), left(control::PACKED_OBJECTS), ptr + objects as u64, HANDLES);
    if cmd == control::IMPORT_OBJECTS_FROM_FD {
        ok = ok
            && read_user(
                at(control::PACKED_TYPES),
                left(control::PACKED_TYPES),
                ptr + control::IMPORT_TYPES_AT as u64,
                control::OBJECTS_FOLLOWED as u32,
            );
    }
    ok
}

/// A flexible fabric object's ATTACH_MEM or DETACH_MEM: of each of the first memInfos its
/// hMemory and offset (16 bytes of 32), or the first offsets, then the counts.
#[inline(always)]
fn copy_fabric(cmd: u32, ptr: u64, out: &mut [u8; CLASS_PARAMS_MAX]) -> bool {
    let base = out.as_mut_ptr();
    let attach = cmd == control::FABRIC_ATTACH_MEM;
    let (stride, len, counts_at, packed_counts) = if attach {
        (control::FABRIC_INFO_SIZE, 16, control::FABRIC_COUNTS_AT, control::PACKED_ATTACH_COUNTS)
    } else {
        (8, 8, control::FABRIC_DETACH_COUNTS_AT, control::PACKED_DETACH_COUNTS)
    };
    let mut ok = true;
    let mut i = 0;
    while i < control::FABRIC_FOLLOWED {
        let dst = unsafe { base.add(i * len as usize) };
        ok &= read_user(dst, CLASS_PARAMS_MAX - i * len as usize, ptr + (i as u32 * stride) as u64, len);
        i += 1;
    }
    let counts = unsafe { base.add(packed_counts) };
    ok && read_user(counts, CLASS_PARAMS_MAX - packed_counts, ptr + counts_at as u64, 12)
}

/// Returns false when the record is not worth sending (an XFER wrapping an untraced escape).
#[inline(always)]
unsafe fn fill_ioctl(record: &mut IoctlRecord, inflight: &Inflight, ret: i64) -> bool {
    record.header = header(kind::IOCTL);
    record.fd = inflight.fd;
    record.cmd = inflight.cmd;
    record.ret = ret;
    record.device = inflight.device;
    record.flags = inflight.flags;
    record._pad = [0; 2];
    record.params_len = 0;
    record.class_len = 0;
    record.file = inflight.file;
    record.named_file = 0;
    record.escape_cmd = inflight.cmd;
    if uvm_command_traced(inflight.cmd) {
        return fill_uvm(record, inflight);
    }
    let escape = match unwrap_xfer(record, inflight) {
        Unwrapped::Escape(escape) => escape,
        Unwrapped::Unreadable => return true,
        Unwrapped::NotFollowed => return false,
    };
    if !read_user(record.params.as_mut_ptr(), PARAMS_MAX, escape.params, escape.size) {
        // A control whose cmd cannot be read is not known to be followed: dropped, as at entry.
        if escape.nr == escape::RM_CONTROL {
            return false;
        }
        record.flags |= ioctl_flag::PARAMS_FAULT;
        return true;
    }
    record.params_len = escape.size;
    match escape.nr {
        escape::RM_CONTROL => fill_control(record, ret),
        escape::RM_ALLOC => {
            fill_alloc_class(record);
            true
        }
        _ => true,
    }
}

/// The RM escape a command carries: its number, its params' size and where they lie.
struct Escape {
    nr: u32,
    size: u32,
    params: u64,
}

enum Unwrapped {
    Escape(Escape),
    /// The XFER itself could not be read: sent with PARAMS_FAULT and no params.
    Unreadable,
    /// It wraps an escape gputrace does not follow.
    NotFollowed,
}

/// The escape itself, or the one an XFER wraps (nv_ioctl_xfer_t, read from user memory).
#[inline(always)]
fn unwrap_xfer(record: &mut IoctlRecord, inflight: &Inflight) -> Unwrapped {
    let nr = ioc_nr(inflight.cmd);
    if nr != escape::IOCTL_XFER_CMD {
        return Unwrapped::Escape(Escape { nr, size: ioc_size(inflight.cmd), params: inflight.arg });
    }
    let mut x = [0u8; xfer::SIZE];
    if !read_user(x.as_mut_ptr(), xfer::SIZE, inflight.arg, xfer::SIZE as u32) {
        record.flags |= ioctl_flag::PARAMS_FAULT;
        return Unwrapped::Unreadable;
    }
    let (nr, size) = (u32_at(&x, xfer::CMD), u32_at(&x, xfer::PARAMS_SIZE));
    if !rm_escape_traced(nr, size) {
        return Unwrapped::NotFollowed;
    }
    record.escape_cmd = rm_cmd(nr, size);
    record.flags |= ioctl_flag::XFER;
    Unwrapped::Escape(Escape { nr, size, params: u64_at(&x, xfer::PARAMS) })
}

/// A UVM command: the head of its params and a 16-byte window at the version's tail offset
/// (where the status lies).
#[inline(always)]
fn fill_uvm(record: &mut IoctlRecord, inflight: &Inflight) -> bool {
    let Some(window) = (unsafe { UVM_WINDOWS.get(&inflight.cmd) }).copied() else {
        return false;
    };
    let params = record.params.as_mut_ptr();
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
    true
}

/// A followed control (an export, an import, a fabric attachment). A wrapped control was not
/// filtered at entry: dropped here when it is not one of them. The control's own params follow
/// behind NVOS54's pointer, read at exit: an import writes its new handle back.
#[inline(always)]
fn fill_control(record: &mut IoctlRecord, ret: i64) -> bool {
    let cmd = u32_at(&record.params, control::CMD);
    let Some(len) = control_params_size(cmd) else {
        return false;
    };
    if !copy_control(cmd, u64_at(&record.params, control::PARAMS), &mut record.class_params, len) {
        record.flags |= ioctl_flag::CLASS_FAULT;
        return true;
    }
    record.class_len = len;
    // The fd an export or import names (a fabric attachment names none).
    let at = match cmd {
        control::EXPORT_OBJECT_TO_FD => control::EXPORT_FD_AT,
        control::IMPORT_OBJECT_FROM_FD => control::IMPORT_FD_AT,
        control::EXPORT_OBJECTS_TO_FD | control::IMPORT_OBJECTS_FROM_FD => control::PACKED_HEAD,
        _ => return true,
    };
    // RM took the named fd for an nvidiactl file: its close is followed from now on, even one
    // that comes before userspace has read this record (an importer that closes at once).
    if ret == 0 && u32_at(&record.params, control::STATUS) == 0 {
        let fd = u32_at(&record.class_params, at);
        let slot = FdSlot::of(fd);
        record.named_file = slot.file();
        if nvidia_device_number(device::CTL, record.named_file) {
            let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
            let _ = remember_fd(&FdKey { tgid, fd }, device::CTL, BPF_NOEXIST as u64);
        }
        // Read after the fd is remembered, as in first_call. Userspace meets the fd here, not
        // at its open (one received over a socket): an exec closes it when this is set.
        if slot.close_on_exec() == Some(true) {
            record.flags |= ioctl_flag::NAMED_CLOEXEC;
        }
    }
    true
}

/// An RM_ALLOC's class params. RM copies the class's own size, not paramsSize, so the size
/// comes from the class table; classes not in it carry none.
#[inline(always)]
fn fill_alloc_class(record: &mut IoctlRecord) {
    let class = u32_at(&record.params, alloc::CLASS);
    let alloc_params = u64_at(&record.params, alloc::PARAMS);
    let Some(&class_len) = (unsafe { CLASS_PARAMS.get(&class) }) else {
        return;
    };
    if alloc_params == 0 {
        return;
    }
    if read_user(record.class_params.as_mut_ptr(), CLASS_PARAMS_MAX, alloc_params, class_len) {
        record.class_len = class_len;
    } else {
        record.flags |= ioctl_flag::CLASS_FAULT;
    }
}

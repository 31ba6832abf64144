//! File descriptors: opens of NVIDIA device files, closes, dups, close-on-exec, close_range.

use super::*;

#[derive(Clone, Copy)]
struct Opening {
    flags: i32,
    device: u8,
}
#[map]
static OPENS: LruHashMap<u64, Opening> = LruHashMap::with_max_entries(1 << 12, 0);

/// Threads inside an open whose path could not be read at its entry, by thread number modulo
/// CALL_SLOTS: the opener's pid_tgid, so that its exit looks in OPENS where its process holds
/// no followed fd (and is not marked as one that may, until the file is found NVIDIA's). A
/// thread of the same number modulo overwrites it: that open is then found at its first command.
#[map]
static UNREAD_OPENS: Array<u64> = Array::with_max_entries(CALL_SLOTS, 0);

#[derive(Clone, Copy)]
struct Duping {
    old_fd: i32,
    cloexec: i32,
    state: u8,
}
#[map]
static DUPS: LruHashMap<u64, Duping> = LruHashMap::with_max_entries(1 << 12, 0);

/// Bytes of an opened path looked at ("/dev/nvidia-uvm-tools" is 21).
const PATH_MAX: usize = 32;
const O_CLOEXEC: i32 = 0o2000000;
const O_ACCMODE: i32 = 0o3;
const O_RDWR: i32 = 0o2;
/// A fd that names a file without opening it: no ioctl can be sent on it.
const O_PATH: i32 = 0o10000000;
const F_DUPFD: u64 = 0;
const F_SETFD: u64 = 2;
const F_DUPFD_CLOEXEC: u64 = 1030;
const FD_CLOEXEC: u64 = 1;

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

/// `filename` and `flags`: the syscall's arguments (openat has a directory first; the callers
/// read them, at offsets the verifier sees are constant). `by_number`: the path is not to be
/// trusted to say what the file is (see openat2_enter).
fn open_enter(filename: u64, flags: i32, by_number: bool) -> u32 {
    // Where the driver's majors are known, only an open for reading and writing (as NVIDIA's
    // libraries open its devices) has its path read, the costliest part of this program: a
    // device opened any other way is found by its device number at its first NVIDIA-looking
    // ioctl (ioctl::first_call), before anything of it is recorded.
    if flags & O_PATH != 0 || (flags & O_ACCMODE != O_RDWR && majors_known()) {
        return 0;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    if !is_traced((pid_tgid >> 32) as u32) {
        return 0;
    }
    // Every process's opens come here: eight bytes tell almost all of them apart before the
    // path is copied whole.
    let mut head = [0u8; 8];
    let read = !by_number && read_user(head.as_mut_ptr(), 8, filename, 8);
    if read && head != *b"/dev/nvi" {
        return 0;
    }
    let mut opening = Opening { flags, device: device::PENDING };
    let mut path = [0u8; PATH_MAX];
    let path_read = read && unsafe { bpf_probe_read_user_str_bytes(filename as *const u8, &mut path) }.is_ok();
    if path_read {
        let Some(device) = classify(&path) else {
            return 0;
        };
        opening.device = device;
    } else if !majors_known() {
        // Found at its first NVIDIA-looking command, by userspace's answer.
        return 0;
    }
    // Else a path in a page not faulted in yet (a tracepoint cannot fault it in; the open will),
    // or one not trusted:
    // the exit tells the file by its device number, so that the open is seen where it happens,
    // before a fork or dup of it. Rare, and only for reading and writing (a short path ending by
    // unmapped memory comes here too).
    if own_file_table() {
        return 0;
    }
    if path_read {
        // Set before the entry, as for FDS: the exit looks only where it is set.
        holds_fds((pid_tgid >> 32) as u32);
    } else if let Some(slot) = UNREAD_OPENS.get_ptr_mut(pid_tgid as u32 % CALL_SLOTS) {
        // SAFETY: an array value, valid for the map's life; written only by threads of this
        // number modulo, each for its own open.
        unsafe { *slot = pid_tgid };
    }
    count_refused("OPENS", OPENS.insert(&pid_tgid, &opening, 0));
    0
}

/// Whether this thread is inside an open whose path could not be read; forgotten as it is asked.
#[inline(always)]
fn take_unread_open(pid_tgid: u64) -> bool {
    let Some(slot) = UNREAD_OPENS.get_ptr_mut(pid_tgid as u32 % CALL_SLOTS) else { return false };
    // SAFETY: as in open_enter.
    unsafe {
        if *slot != pid_tgid {
            return false;
        }
        *slot = 0;
    }
    true
}

#[tracepoint]
pub fn openat_enter(ctx: TracePointContext) -> u32 {
    open_enter(sys_arg(&ctx, 1), sys_arg(&ctx, 2) as i32, false)
}

#[tracepoint]
pub fn open_enter_legacy(ctx: TracePointContext) -> u32 {
    open_enter(sys_arg(&ctx, 0), sys_arg(&ctx, 1) as i32, false)
}

/// openat2(2): told by its file's device number alone, where the driver's majors are known (its
/// resolve flags can root an absolute path under a directory the caller chose, and they are in
/// user memory another thread can change before the kernel copies them); otherwise found at its
/// first command, its flags unread. Its flags (`struct open_how`'s first field) are read for traced processes
/// only, to pass over what other opens pass over; one whose flags cannot be read is taken as an
/// open for reading and writing. Its close-on-exec bit is read from the fd table at the exit.
#[tracepoint]
pub fn openat2_enter(ctx: TracePointContext) -> u32 {
    if !majors_known() || !is_traced((bpf_get_current_pid_tgid() >> 32) as u32) {
        return 0;
    }
    let mut flags = [0u8; 8];
    let flags = if read_user(flags.as_mut_ptr(), 8, sys_arg(&ctx, 2), 8) { u64::from_ne_bytes(flags) as i32 } else { O_RDWR };
    open_enter(sys_arg(&ctx, 1), flags, true)
}

#[tracepoint]
pub fn open_exit(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !take_unread_open(pid_tgid) && !may_hold_fds((pid_tgid >> 32) as u32) {
        return 0;
    }
    let Some(opening) = take(&OPENS, pid_tgid) else {
        return 0;
    };
    let fd = sys_ret(&ctx);
    if fd < 0 {
        return 0;
    }
    let slot = FdSlot::of(fd as u32);
    let file = slot.file();
    let key = FdKey { tgid: (pid_tgid >> 32) as u32, fd: fd as u32 };
    let device = match opening.device {
        // Told by its device number alone: NVIDIA's, or not followed.
        device::PENDING => match nvidia_device_of(file) {
            Some(device) => device,
            None => return 0,
        },
        // A file at an NVIDIA path that is not NVIDIA's device (one a user mounted there in a
        // namespace of their own) is never followed: its ioctls would be made-up memory.
        device if !nvidia_device_number(device, file) => {
            bump(stat::IMPOSTORS);
            // Answered here, so its ioctls never become questions userspace would ask /proc about.
            let _ = remember_fd(&key, device::NOT_NVIDIA, 0);
            return 0;
        }
        device => device,
    };
    count_refused("FDS", remember_fd(&key, device, 0));
    // The close-on-exec bit as the fd table has it, read after the fd is remembered: an F_SETFD
    // from another thread that enters after that is followed (one that entered before and has
    // not yet changed the bit changes it unseen: a race left open). The open's own flag where
    // the table cannot be read.
    let cloexec = slot.close_on_exec().unwrap_or(opening.flags & O_CLOEXEC != 0);
    let flags = if cloexec { opening.flags | O_CLOEXEC } else { opening.flags & !O_CLOEXEC };
    let record = OpenRecord { header: header(kind::OPEN), fd: fd as i32, flags, file, device, _pad: [0; 7] };
    if EVENTS.output::<OpenRecord>(&record, 0).is_err() {
        bump(stat::LOST);
    }
    0
}

/// Forgets what `fd` was; tells userspace when it was an NVIDIA file (a reference dropped), or
/// when it may be one inherited by a child whose fds userspace has not copied yet. Not for a
/// thread with a file table of its own: its fd is not the process's.
#[inline(always)]
pub(crate) fn forget_fd(tgid: u32, fd: u32) {
    if !may_hold_fds(tgid) {
        return;
    }
    let key = FdKey { tgid, fd };
    let state = unsafe { FDS.get(&key) }.copied();
    // The process's state is looked up once, and only for an fd not followed.
    let inheriting = state.is_none() && unsafe { TRACED.get(&tgid) } == Some(&traced::INHERITING);
    if (state.is_none() && !inheriting) || own_file_table() {
        return;
    }
    match state {
        Some(state) => {
            let _ = FDS.remove(&key);
            if is_nvidia(state) {
                send_fd_record(kind::CLOSE, fd as i64, 0, 0);
            } else if state == device::CONN {
                send_fd_record(kind::CONN_CLOSE, fd as i64, 0, 0);
            }
        }
        None => send_fd_record(kind::CLOSE, fd as i64, 1, 0),
    }
}

#[tracepoint]
pub fn close_enter(ctx: TracePointContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    forget_fd(tgid, sys_arg(&ctx, 0) as u32);
    0
}

#[inline(always)]
fn dup_enter(ctx: &TracePointContext, new_fd: Option<u32>, cloexec: i32) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let old_fd = sys_arg(ctx, 0) as u32;
    if let Some(new_fd) = new_fd {
        if new_fd == old_fd {
            return 0;
        }
        // dup2/dup3 onto an open fd closes it first.
        forget_fd(tgid, new_fd);
    }
    if let Some(&state) = unsafe { FDS.get(&FdKey { tgid, fd: old_fd }) } {
        if own_file_table() {
            return 0;
        }
        count_refused("DUPS", DUPS.insert(&pid_tgid, &Duping { old_fd: old_fd as i32, cloexec, state }, 0));
    }
    0
}

#[tracepoint]
pub fn dup_enter_plain(ctx: TracePointContext) -> u32 {
    dup_enter(&ctx, None, 0)
}

#[tracepoint]
pub fn dup2_enter(ctx: TracePointContext) -> u32 {
    let new_fd = sys_arg(&ctx, 1) as u32;
    dup_enter(&ctx, Some(new_fd), 0)
}

#[tracepoint]
pub fn dup3_enter(ctx: TracePointContext) -> u32 {
    let new_fd = sys_arg(&ctx, 1) as u32;
    let flags = sys_arg(&ctx, 2) as i32;
    dup_enter(&ctx, Some(new_fd), flags & O_CLOEXEC)
}

#[tracepoint]
pub fn fcntl_enter(ctx: TracePointContext) -> u32 {
    let fcntl_cmd = sys_arg(&ctx, 1);
    match fcntl_cmd {
        F_DUPFD => dup_enter(&ctx, None, 0),
        F_DUPFD_CLOEXEC => dup_enter(&ctx, None, O_CLOEXEC),
        F_SETFD => set_cloexec(sys_arg(&ctx, 0) as u32, sys_arg(&ctx, 2) & FD_CLOEXEC != 0),
        _ => 0,
    }
}

/// fcntl(F_SETFD), or ioctl(FIOCLEX/FIONCLEX), on a followed NVIDIA fd: whether an exec closes it.
#[inline(always)]
pub(crate) fn set_cloexec(fd: u32, cloexec: bool) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if let Some(&state) = unsafe { FDS.get(&FdKey { tgid, fd }) } {
        if is_nvidia(state) && !own_file_table() {
            send_fd_record(kind::SET_CLOEXEC, fd as i64, cloexec as i64, 0);
        }
    }
    0
}

/// Exit of dup, dup2, dup3 and fcntl: the new fd shares the old one's file.
#[tracepoint]
pub fn dup_exit(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    // Entries are left only for fds in FDS.
    if !may_hold_fds((pid_tgid >> 32) as u32) {
        return 0;
    }
    let Some(duping) = take(&DUPS, pid_tgid) else {
        return 0;
    };
    let new_fd = sys_ret(&ctx);
    if new_fd < 0 {
        return 0;
    }
    count_refused("FDS", remember_fd(&FdKey { tgid: (pid_tgid >> 32) as u32, fd: new_fd as u32 }, duping.state, 0));
    if is_nvidia(duping.state) || duping.state == device::CONN {
        send_fd_record(kind::DUP, duping.old_fd as i64, new_fd, duping.cloexec as i64);
    }
    0
}

/// close_range's flag: the caller's table is copied first when shared, and the closes happen in
/// the copy.
const CLOSE_RANGE_UNSHARE: u64 = 2;

/// The range may be huge (3..~0), so userspace, which mirrors FDS, does the forgetting.
#[tracepoint]
pub fn close_range_enter(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !is_traced((pid_tgid >> 32) as u32) || own_file_table() {
        return 0;
    }
    let (first, last, flags) = (sys_arg(&ctx, 0), sys_arg(&ctx, 1), sys_arg(&ctx, 2));
    // A thread other than the leader closing in a table of its own, made for the call: the
    // process (whose table is the leader's here) keeps its files. The leader's copy becomes
    // the process's table, so its closes count.
    let leader = pid_tgid as u32 == (pid_tgid >> 32) as u32;
    if flags & CLOSE_RANGE_UNSHARE != 0 && !leader && file_table_shared() {
        bump(stat::OWN_FILE_TABLE);
        return 0;
    }
    send_fd_record(kind::CLOSE_RANGE, first as i64, last as u32 as i64, flags as i64);
    0
}

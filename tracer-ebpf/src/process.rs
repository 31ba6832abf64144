//! Processes: a traced process's children are traced from their fork, execs are named, exits
//! end a process, and the OOM killer's victims are recorded.

use super::*;

const CLONE_THREAD: u64 = 0x10000;

/// Runs in the parent. A new process (not a thread) of a traced process is traced too.
#[tracepoint]
pub fn task_newtask(ctx: TracePointContext) -> u32 {
    let clone_flags: u64 = arg(&ctx, NEWTASK_CLONE_FLAGS);
    if clone_flags & CLONE_THREAD != 0 {
        return 0;
    }
    let parent = (bpf_get_current_pid_tgid() >> 32) as u32;
    if !is_traced(parent) {
        return 0;
    }
    let child: i32 = arg(&ctx, NEWTASK_PID);
    // A child inherits followed fds only from a parent that may hold some (or, while userspace
    // is still scanning the processes it met running, any parent): it is marked so its closes
    // are looked at until userspace has copied them. Any other child's closes stay outside FDS's
    // lookups from the start.
    let attaching = CONFIG.get(0).is_some_and(|c| c.attaching != 0);
    let state = if attaching || may_hold_fds(parent) {
        holds_fds(child as u32);
        traced::INHERITING
    } else {
        traced::YES
    };
    count_refused("TRACED", TRACED.insert(&(child as u32), &state, 0));
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
    let data_loc: u32 = arg(&ctx, EXEC_FILENAME_LOC);
    let src = unsafe { (aya_ebpf::EbpfContext::as_ptr(&ctx) as *const u8).add((data_loc & 0xffff) as usize) };
    let _ = unsafe { bpf_probe_read_kernel_str_bytes(src, &mut record.filename) };
    read_argv(record);
    entry.submit(wake_for(kind::EXEC));
    0
}

/// The new program's argv, from `current->mm->arg_start..arg_end` (exec has just copied it
/// there): a program that exits at once is still named by its command line, which /proc can no
/// longer give once userspace reads the record.
#[inline(always)]
fn read_argv(record: &mut ExecRecord) {
    record.args_len = 0;
    record.args_whole = 0;
    let Some(o) = OFFSETS.get(0) else { return };
    if o.task_mm == 0 || o.mm_arg_end == 0 {
        return;
    }
    let mm = read_pointer(unsafe { bpf_get_current_task() } + o.task_mm as u64);
    if mm == 0 {
        return;
    }
    let (start, end) = (read_pointer(mm + o.mm_arg_start as u64), read_pointer(mm + o.mm_arg_end as u64));
    let total = end.wrapping_sub(start);
    if start == 0 || total == 0 || total > 1 << 20 {
        return;
    }
    // Never past arg_end: the environment follows it. The mask is applied to what a volatile
    // read gives back, so the compiler keeps it: a verifier before 5.11 bounds the length only by
    // it (it does not carry a bound checked on one register to a copy of it).
    let len = total.min(EXEC_ARGS as u64 - 1);
    let len = unsafe { core::ptr::read_volatile(&len) } & (EXEC_ARGS as u64 - 1);
    if unsafe { bpf_probe_read_user(record.args.as_mut_ptr() as *mut _, len as u32, start as *const _) } == 0 {
        record.args_len = len as u32;
        record.args_whole = (len == total) as u32;
    }
}

/// Runs for every thread that exits; only the end of the whole process counts, but for the
/// thread's slot of calls in flight.
#[tracepoint]
pub fn process_exit(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    super::ioctl::forget_call(pid_tgid);
    let tgid = (pid_tgid >> 32) as u32;
    let group_dead_at = CONFIG.get(0).map_or(0, |c| c.group_dead_at) as usize;
    let whole_process = match group_dead_at {
        // Kernels whose records do not say (6.1): the thread group leader's exit stands for it.
        0 => pid_tgid as u32 == tgid,
        // An offset known only at run time: the verifier takes no variable load from the
        // context, so a helper reads it.
        at => unsafe { ctx.read_at::<u8>(at) }.is_ok_and(|dead| dead != 0),
    };
    if !whole_process {
        return 0;
    }
    if !is_traced(tgid) {
        return 0;
    }
    let _ = TRACED.remove(&tgid);
    // do_exit has stored the wait status by now: a watch has no waitpid to learn it from.
    match exit_status() {
        Some(status) => send_fd_record(kind::EXIT, status as i64, 1, 0),
        None => send_fd_record(kind::EXIT, 0, 0, 0),
    }
    0
}

/// `current->exit_code`, where the kernel's BTF gave its offset.
fn exit_status() -> Option<i32> {
    let at = OFFSETS.get(0)?.task_exit_code;
    if at == 0 {
        return None;
    }
    let task = unsafe { bpf_get_current_task() };
    unsafe { bpf_probe_read_kernel((task + at as u64) as *const i32) }.ok()
}

/// The kernel's OOM killer chose a victim: recorded when it is a traced process.
#[tracepoint]
pub fn oom_victim(ctx: TracePointContext) -> u32 {
    let victim: i32 = arg(&ctx, OOM_VICTIM_PID);
    // The victim is not the current task (that is whoever's allocation woke the OOM killer).
    if is_followed(victim as u32) {
        send_fd_record(kind::OOM_VICTIM, victim as i64, 0, 0);
    }
    0
}

//! Sockets: when a server binds and listens, when requests arrive on an accepted connection, and
//! when responses start (the first bytes of each read and write).

use super::*;

/// Processes that ever held a followed connection, by tgid modulo its size: set at accept,
/// never cleared (a reused pid or a shared slot only costs the exact lookup after it), so the
/// reads and writes of every other process end at one array read, which the kernel inlines.
#[map]
static CONN_PIDS: Array<u8> = Array::with_max_entries(PID_SLOTS, 0);

/// A read on an accepted connection, until it returns.
#[map]
static READS: LruHashMap<u64, Reading> = LruHashMap::with_max_entries(1 << 12, 0);

#[tracepoint]
pub fn bind_enter(ctx: TracePointContext) -> u32 {
    if !is_traced((bpf_get_current_pid_tgid() >> 32) as u32) {
        return 0;
    }
    let (fd, addr) = (sys_arg(&ctx, 0), sys_arg(&ctx, 1));
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
        send_fd_record(kind::LISTEN, sys_arg(&ctx, 0) as i64, 0, 0);
    }
    0
}

/// Exit of accept and accept4: the new fd is a connection whose traffic is followed.
#[tracepoint]
pub fn accept_exit(ctx: TracePointContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let fd = sys_ret(&ctx);
    if fd < 0 || !is_traced(tgid) {
        return 0;
    }
    set_slot(&CONN_PIDS, tgid);
    count_refused("FDS", remember_fd(&FdKey { tgid, fd: fd as u32 }, device::CONN, 0));
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
fn holds_conns(tgid: u32) -> bool {
    slot_set(&CONN_PIDS, tgid)
}

#[inline(always)]
fn conn(fd: u64) -> bool {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if !holds_conns(tgid) {
        return false;
    }
    (unsafe { FDS.get(&FdKey { tgid, fd: fd as u32 }) }) == Some(&device::CONN)
}

/// Enter of read and recvfrom (fd @16, buffer @24).
#[tracepoint]
pub fn read_enter(ctx: TracePointContext) -> u32 {
    let fd = sys_arg(&ctx, 0);
    if conn(fd) {
        count_refused("READS", READS.insert(&bpf_get_current_pid_tgid(), &Reading { buf: sys_arg(&ctx, 1), fd: fd as i32, _pad: 0 }, 0));
    }
    0
}

#[tracepoint]
pub fn read_exit(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    // Entries are left only on connections, by the kernel or by userspace (after the fd's).
    if !holds_conns((pid_tgid >> 32) as u32) {
        return 0;
    }
    let Some(reading) = take(&READS, pid_tgid) else {
        return 0;
    };
    let len = sys_ret(&ctx);
    if len > 0 {
        send_sock_io(reading.fd, true, len, reading.buf);
    }
    0
}

/// Enter of write and sendto (fd @16, buffer @24, length @32).
#[tracepoint]
pub fn write_enter(ctx: TracePointContext) -> u32 {
    let fd = sys_arg(&ctx, 0);
    if conn(fd) {
        send_sock_io(fd as i32, false, sys_arg(&ctx, 2) as i64, sys_arg(&ctx, 1));
    }
    0
}

/// writev and sendmsg carry iovecs: the first one's bytes are the start of what is sent.
#[tracepoint]
pub fn writev_enter(ctx: TracePointContext) -> u32 {
    let fd = sys_arg(&ctx, 0);
    if !conn(fd) {
        return 0;
    }
    let vec = sys_arg(&ctx, 1);
    let mut iov = [0u8; 16];
    if read_user(iov.as_mut_ptr(), 16, vec, 16) {
        let (base, len) = (u64_at(&iov, 0), u64_at(&iov, 8));
        send_sock_io(fd as i32, false, len as i64, base);
    }
    0
}

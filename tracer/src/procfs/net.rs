//! Network namespaces as /proc shows them: the addresses local to each, the TCP sockets that
//! matter to a server met running, the ports a process listens on, the threads blocked reading a
//! connection, and whether a fd is a Unix socket.

use super::fds::{fd_path, open_fds};
use super::{all_pids, read_bounded};

/// The IP addresses local to the network namespace `pid` is in: IPv4 from its view of
/// `net/fib_trie` (each address followed by `/32 host LOCAL`), IPv6 from `net/if_inet6`. None
/// where they cannot all be known (unreadable, or past [`MAX_NET_FILE`] or
/// [`MAX_LOCAL_ADDRESSES`]).
pub fn local_addresses(pid: u32) -> Option<Vec<std::net::IpAddr>> {
    let trie = read_bounded(&format!("/proc/{pid}/net/fib_trie"), MAX_NET_FILE + 1)?;
    let inet6 = read_bounded(&format!("/proc/{pid}/net/if_inet6"), MAX_NET_FILE + 1).unwrap_or_default();
    if trie.len() as u64 > MAX_NET_FILE || inet6.len() as u64 > MAX_NET_FILE {
        return None;
    }
    Some(parse_local_addresses(&trie, &inet6)).filter(|found| found.len() < MAX_LOCAL_ADDRESSES)
}

/// The addresses of every network namespace on the host (one process's view of each: another
/// of the namespace's is tried where one has gone), or None where one could not be read or
/// there are more than [`MAX_NAMESPACES`].
pub fn host_addresses() -> Option<Vec<std::net::IpAddr>> {
    let mut read = std::collections::HashMap::new();
    let mut all = Vec::new();
    for pid in all_pids() {
        let Ok(namespace) = std::fs::read_link(format!("/proc/{pid}/ns/net")) else { continue };
        let done = read.entry(namespace).or_insert(false);
        if *done {
            continue;
        }
        if let Some(found) = local_addresses(pid) {
            *done = true;
            all.extend(found);
        }
        if read.len() > MAX_NAMESPACES {
            return None;
        }
    }
    read.values().all(|&done| done).then_some(all)
}

/// Network namespaces [`host_addresses`] reads at most.
const MAX_NAMESPACES: usize = 512;
/// Bytes of a namespace's fib_trie or if_inet6 read at most.
const MAX_NET_FILE: u64 = 1 << 20;
/// Local addresses of one namespace told apart at most.
const MAX_LOCAL_ADDRESSES: usize = 4096;

fn parse_local_addresses(fib_trie: &str, if_inet6: &str) -> Vec<std::net::IpAddr> {
    let mut found = Vec::new();
    let mut last: Option<std::net::Ipv4Addr> = None;
    for line in fib_trie.lines() {
        let line = line.trim_start();
        if let Some(address) = line.strip_prefix("|-- ") {
            last = address.trim().parse().ok();
        } else if line.starts_with("/32 host LOCAL") {
            found.extend(last.take().map(std::net::IpAddr::V4));
        }
    }
    for line in if_inet6.lines() {
        let Some(hex) = line.split_whitespace().next().filter(|h| h.len() == 32) else { continue };
        if let Ok(bits) = u128::from_str_radix(hex, 16) {
            found.push(std::net::IpAddr::V6(bits.into()));
        }
    }
    found.sort();
    found.dedup();
    found
}

/// TCP ports the process listens on (IPv4 and IPv6), from the socket inodes its fds hold and
/// its network namespace's tables, each namespace's read once into `tables` (by its inode): a
/// host of thousands of holders in one namespace full of sockets reads its tables once, not once
/// a holder.
pub fn listening_ports(pid: u32, tables: &mut std::collections::HashMap<u64, Sockets>) -> Vec<u16> {
    let inodes: Vec<u64> = open_fds(pid)
        .into_iter()
        .filter_map(|fd| fd_path(pid, fd)?.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok())
        .collect();
    if inodes.is_empty() {
        return Vec::new();
    }
    let Some(namespace) = net_namespace(pid) else { return Vec::new() };
    let table = tables.entry(namespace).or_insert_with(|| sockets(pid));
    let mut ports: Vec<u16> = inodes.iter().filter_map(|i| table.listening.get(i).copied()).collect();
    ports.sort();
    ports.dedup();
    ports
}

/// The identity of a process's network namespace: its inode.
pub fn net_namespace(pid: u32) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/net")).ok().map(|m| m.ino())
}

/// A network namespace's TCP sockets that matter to a server met running, by inode.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sockets {
    /// Listening, with the port.
    pub listening: std::collections::HashMap<u64, u16>,
    /// Connections a server accepted: established on a port something listens on (an outgoing
    /// connection's local port is an ephemeral one).
    pub accepted: std::collections::HashSet<u64>,
}

/// The TCP sockets of the process's network namespace (IPv4 and IPv6); each table read to
/// 8 MiB at most (a cut last line is not parsed).
pub fn sockets(pid: u32) -> Sockets {
    let lines: Vec<(u64, u16, String)> = ["tcp", "tcp6"]
        .iter()
        .filter_map(|table| read_bounded(&format!("/proc/{pid}/net/{table}"), 8 << 20))
        .flat_map(|t| parse_sockets(&t))
        .collect();
    let listening: std::collections::HashMap<u64, u16> =
        lines.iter().filter(|(_, _, state)| state == "0A").map(|&(inode, port, _)| (inode, port)).collect();
    let ports: std::collections::HashSet<u16> = listening.values().copied().collect();
    // ESTABLISHED (01) or CLOSE_WAIT (08: the client is done sending, a response may be going).
    let accepted = lines
        .iter()
        .filter(|(inode, port, state)| (state == "01" || state == "08") && ports.contains(port) && *inode != 0)
        .map(|&(inode, _, _)| inode)
        .collect();
    Sockets { listening, accepted }
}

/// The syscall numbers the kernel side follows as reads on a connection: read and recvfrom.
#[cfg(target_arch = "x86_64")]
const READ_SYSCALLS: [u64; 2] = [0, 45];
#[cfg(target_arch = "aarch64")]
const READ_SYSCALLS: [u64; 2] = [63, 207];
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const READ_SYSCALLS: [u64; 0] = [];

/// The threads of `pid` blocked in a read or recvfrom now: (tid, fd, buffer), from
/// /proc/PID/task/TID/syscall (at most 1,024 threads).
pub fn blocked_reads(pid: u32) -> Vec<(u32, i32, u64)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks
        .flatten()
        .take(1024)
        .filter_map(|t| t.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|tid| {
            let (fd, buf) = parse_blocked_read(&read_bounded(&format!("/proc/{pid}/task/{tid}/syscall"), 256)?)?;
            Some((tid, fd, buf))
        })
        .collect()
}

/// "NR ARG0 ARG1 ..." (the number in decimal, the arguments in hex): the fd and buffer of a
/// read or recvfrom.
fn parse_blocked_read(line: &str) -> Option<(i32, u64)> {
    let mut fields = line.split_whitespace();
    let nr: u64 = fields.next()?.parse().ok()?;
    let mut arg = || u64::from_str_radix(fields.next()?.strip_prefix("0x")?, 16).ok();
    let (fd, buf) = (arg()?, arg()?);
    READ_SYSCALLS.contains(&nr).then_some((i32::try_from(fd).ok()?, buf))
}

/// The inode, local port and state of each whole line of /proc/net/tcp.
fn parse_sockets(text: &str) -> Vec<(u64, u16, String)> {
    let whole = text.rfind('\n').map_or("", |end| &text[..end]);
    whole
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (local, state, inode) = (f.get(1)?, f.get(3)?, f.get(9)?.parse::<u64>().ok()?);
            Some((inode, u16::from_str_radix(local.rsplit(':').next()?, 16).ok()?, state.to_string()))
        })
        .collect()
}

/// Whether `fd` of `pid` is a Unix socket, by the protocol name a socket gives as an extended
/// attribute ("UNIX", "UNIX-STREAM"): three questions about that one fd, whatever the host's
/// socket table holds and whichever network namespace the socket is in. (/proc/net/unix, read
/// whole at each listen, cost the event loop 20 ms a call on a host of 20,000 sockets, which any
/// user can make, and lists only this namespace's.) The file is pinned (O_PATH) and found to be
/// a socket, by its cached attributes, before the attribute is asked of it: asked of a FUSE file
/// put under the number meanwhile, the question would wait on that file's server.
pub fn is_unix_socket(pid: u32, fd: i32) -> bool {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let Ok(path) = std::ffi::CString::new(format!("/proc/{pid}/fd/{fd}")) else { return false };
    // SAFETY: open with a NUL-terminated path; the fd is owned from here on.
    let pinned = unsafe { libc::open(path.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
    if pinned < 0 {
        return false;
    }
    let pinned = unsafe { OwnedFd::from_raw_fd(pinned) };
    // SAFETY: statx of the fd itself (an empty path), into the zeroed struct it is given.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let flags = libc::AT_EMPTY_PATH | libc::AT_STATX_DONT_SYNC;
    let rc = unsafe { libc::statx(pinned.as_raw_fd(), c"".as_ptr(), flags, libc::STATX_TYPE, &mut stx) };
    if rc != 0 || u32::from(stx.stx_mode) & libc::S_IFMT != libc::S_IFSOCK {
        return false;
    }
    let Ok(own) = std::ffi::CString::new(format!("/proc/self/fd/{}", pinned.as_raw_fd())) else { return false };
    let mut name = [0u8; 32];
    // SAFETY: getxattr with NUL-terminated path and name, into a buffer of the size given.
    let got = unsafe { libc::getxattr(own.as_ptr(), c"system.sockprotoname".as_ptr(), name.as_mut_ptr().cast(), name.len()) };
    usize::try_from(got).is_ok_and(|n| name[..n.min(name.len())].starts_with(b"UNIX"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_addresses_from_fib_trie_and_if_inet6() {
        let trie = "Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 0.0.0.0\n        /0 universe UNICAST\n           |-- 127.0.0.1\n              /32 host LOCAL\n           |-- 192.0.2.0\n              /24 link UNICAST\n           |-- 192.0.2.2\n              /32 host LOCAL\n        |-- 192.0.2.255\n           /32 link BROADCAST\nLocal:\n           |-- 192.0.2.2\n              /32 host LOCAL\n           |-- nonsense\n              /32 host LOCAL\n";
        let inet6 = "fd000000000000000000000000000002 04 40 00 82     eth0\n00000000000000000000000000000001 01 80 10 80       lo\nzz 01\n";
        let found = parse_local_addresses(trie, inet6);
        assert!(
            local_addresses(std::process::id()).is_some_and(|own| own.iter().any(|a| a.is_loopback())),
            "this process's namespace has loopback"
        );
        assert!(host_addresses().is_some_and(|all| all.iter().any(|a| a.is_loopback())), "the host's namespaces have loopback");
        let want: Vec<std::net::IpAddr> = ["127.0.0.1", "192.0.2.2", "::1", "fd00::2"].iter().map(|a| a.parse().unwrap()).collect();
        assert_eq!(found.len(), 4, "{found:?}");
        assert!(want.iter().all(|a| found.contains(a)), "{found:?}");
        assert!(parse_local_addresses("", "").is_empty());
    }

    #[test]
    fn listening_sockets() {
        let tcp = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 555 1 0 100 0 0 10 0
   1: 0100007F:1F41 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 556 1 0 100 0 0 10 0
   2: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 999 1 0 100 0 0 10 0
";
        let listening: Vec<(u64, u16)> = parse_sockets(tcp).into_iter().filter(|s| s.2 == "0A").map(|s| (s.0, s.1)).collect();
        assert_eq!(listening, vec![(555, 8000), (999, 22)], "listening sockets");
        assert_eq!(parse_sockets(tcp)[1], (556, 8001, "01".to_string()));
        // A cut last line is never parsed.
        let cut = &tcp[..tcp.len() - 20];
        assert_eq!(parse_sockets(cut).len(), 2);
    }

    #[test]
    fn unix_sockets_are_told_from_the_others() {
        use std::os::fd::AsRawFd;
        let pid = std::process::id();
        let (stream, _) = std::os::unix::net::UnixStream::pair().unwrap();
        let datagram = std::os::unix::net::UnixDatagram::unbound().unwrap();
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let file = std::fs::File::open("/proc/self/status").unwrap();
        assert!(is_unix_socket(pid, stream.as_raw_fd()) && is_unix_socket(pid, datagram.as_raw_fd()));
        assert!(!is_unix_socket(pid, tcp.as_raw_fd()) && !is_unix_socket(pid, file.as_raw_fd()));
        assert!(!is_unix_socket(pid, 1 << 20), "no such fd");
    }

    #[test]
    fn a_thread_blocked_in_a_read() {
        let read = READ_SYSCALLS[0];
        assert_eq!(parse_blocked_read(&format!("{read} 0x8 0x7f00aa00 0x2000 0x0 0x0 0x0 0x7ffd 0x7f01\n")), Some((8, 0x7f00aa00)));
        assert_eq!(parse_blocked_read("running"), None);
        assert_eq!(parse_blocked_read("-1 0x7ffd 0x7f01"), None, "blocked, but not in a syscall");
        assert_eq!(parse_blocked_read("232 0x8 0x7f00aa00 0x2000"), None, "another syscall (epoll_wait)");
        assert_eq!(parse_blocked_read(&format!("{read} 0xffffffffff 0x1")), None, "no fd that big");
    }
}

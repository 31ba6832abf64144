//! Everything gputrace reads from /proc, in one place, each read bounded: a process controls its
//! own command line and can make it megabytes long.

use std::io::Read;
use std::path::PathBuf;

/// A process sets its own argv, up to a quarter of its stack limit: keep what a person reads.
pub const MAX_COMMAND: u64 = 16 * 1024;

/// The fields of /proc/PID/stat gputrace uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Stat {
    /// R, S, D, Z, T...
    pub state: char,
    pub ppid: u32,
    /// Process group and session: a job's members share its leader's pid.
    pub pgrp: u32,
    pub session: u32,
    /// User + system CPU time, in clock ticks.
    pub cpu_ticks: u64,
    /// When it started, in clock ticks since boot.
    pub start_ticks: u64,
}

/// Parses /proc/PID/stat. The command name may hold spaces and parentheses: the fields start
/// after the last ')' (field 3, the state); a line cut short yields what it holds.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    let number = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    Some(Stat {
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        pgrp: number(2) as u32,
        session: number(3) as u32,
        cpu_ticks: number(11).saturating_add(number(12)),
        start_ticks: number(19),
    })
}

/// Clock ticks per second, the unit of /proc's times.
pub fn ticks_per_second() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as u64
    } else {
        100
    }
}

/// Seconds since boot, from /proc/uptime.
pub fn uptime_seconds() -> Option<f64> {
    read_bounded("/proc/uptime", 128)?.split_whitespace().next()?.parse().ok()
}

/// A /proc file's text, at most `limit` bytes of it.
pub fn read_bounded(path: &str, limit: u64) -> Option<String> {
    let mut raw = Vec::new();
    std::fs::File::open(path).ok()?.take(limit).read_to_end(&mut raw).ok()?;
    Some(String::from_utf8_lossy(&raw).into_owned())
}

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

/// Its control group path, where a container shows: the first that names a container (on a
/// hybrid host Docker's may be in the v1 hierarchies only), else cgroup v2's, else the first.
pub fn cgroup(pid: u32) -> Option<String> {
    pick_cgroup(&read_bounded(&format!("/proc/{pid}/cgroup"), 16 * 1024)?)
}

fn pick_cgroup(text: &str) -> Option<String> {
    let paths: Vec<(&str, &str)> = text.lines().filter_map(|l| l.split_once(':').and_then(|(_, rest)| rest.split_once(':'))).collect();
    let named = paths.iter().find(|(_, p)| container_of(p).is_some() || pod_of(p).is_some());
    let v2 = paths.iter().find(|(controllers, p)| controllers.is_empty() && *p != "/");
    named.or(v2).or(paths.first()).map(|(_, p)| p.to_string())
}

/// The container a cgroup path names: the 64-hex id Docker, containerd, CRI-O and Podman put in
/// it, shortened as `docker ps` shows it.
pub fn container_of(cgroup: &str) -> Option<String> {
    cgroup
        .split(['/', '-', '.', ':'])
        .find(|part| part.len() == 64 && part.bytes().all(|b| b.is_ascii_hexdigit()))
        .map(|id| id[..12].to_string())
}

/// The Kubernetes pod UID a cgroup path names: `pod<uid>` (cgroupfs driver) or
/// `kubepods-...-pod<uid with _>.slice` (systemd driver).
/// Only below a top-level `kubepods` cgroup, which only root (the kubelet) can make: a user with
/// a delegated subtree cannot name a pod of their choosing.
pub fn pod_of(cgroup: &str) -> Option<String> {
    let mut parts = cgroup.strip_prefix('/')?.split('/');
    if !parts.next()?.starts_with("kubepods") {
        return None;
    }
    parts.find_map(|part| {
        let (_, after) = part.rsplit_once("pod")?;
        let uid = after.trim_end_matches(".slice").replace('_', "-");
        (uid.len() == 36 && uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')).then_some(uid)
    })
}

/// The last NSpid of /proc/PID/status: the pid inside the innermost pid namespace, where that
/// differs from the host's.
fn ns_pid(status: &str) -> Option<u32> {
    let pids: Vec<u32> = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?.split_whitespace().filter_map(|p| p.parse().ok()).collect();
    (pids.len() > 1).then(|| *pids.last().expect("more than one"))
}

/// Where the kubelet keeps each pod's container logs, one directory per pod named
/// `NAMESPACE_NAME_UID` (neither name may hold `_`): the pod's names without the API server.
const POD_LOGS: &str = "/var/log/pods";

/// The namespace and name of pod `uid`, from the kubelet's log directories under `dir`. Reads
/// at most a few thousand entries (a node runs at most a few hundred pods).
pub fn pod_names_in(dir: &std::path::Path, uid: &str) -> Option<(String, String)> {
    let suffix = format!("_{uid}");
    std::fs::read_dir(dir).ok()?.take(4096).filter_map(Result::ok).find_map(|entry| {
        let name = entry.file_name().into_string().ok()?;
        let (namespace, pod) = name.strip_suffix(&suffix)?.split_once('_')?;
        (!namespace.is_empty() && !pod.is_empty() && !pod.contains('_')).then(|| (namespace.to_string(), pod.to_string()))
    })
}

/// Where a process runs (cgroup, container, pod, pid in its namespace); None when it is gone.
pub fn place(pid: u32) -> Option<crate::event::Place> {
    let cgroup = cgroup(pid)?;
    let status = read_bounded(&format!("/proc/{pid}/status"), 64 * 1024).unwrap_or_default();
    let pod = pod_of(&cgroup);
    let (namespace, pod_name) = pod.as_deref().and_then(|uid| pod_names_in(std::path::Path::new(POD_LOGS), uid)).unzip();
    let uid = uid_in(&status);
    Some(crate::event::Place { container: container_of(&cgroup), pod, namespace, pod_name, ns_pid: ns_pid(&status), cgroup, uid })
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

/// The host's memory: MemTotal and MemAvailable, in bytes (what "free" means on unified memory).
pub fn meminfo() -> Option<(u64, u64)> {
    Some((meminfo_field("MemTotal:")?, meminfo_field("MemAvailable:")?))
}

/// One field of /proc/meminfo ("SwapFree:"), in bytes.
pub fn meminfo_field(name: &str) -> Option<u64> {
    let text = read_bounded("/proc/meminfo", 64 * 1024)?;
    let kib: u64 = text.lines().find_map(|l| l.strip_prefix(name)?.split_whitespace().next()?.parse().ok())?;
    Some(kib.saturating_mul(1024))
}

/// PSI's memory pressure, "some avg10": the share of the last 10 s in which some task waited for
/// memory. None where the kernel has no PSI.
pub fn memory_pressure() -> Option<f64> {
    let text = read_bounded("/proc/pressure/memory", 1024)?;
    text.lines().find(|l| l.starts_with("some "))?.split_whitespace().find_map(|f| f.strip_prefix("avg10=")?.parse().ok())
}

pub fn stat(pid: u32) -> Option<Stat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Still running: present and not a zombie waiting for a parent that may never reap it.
pub fn running(pid: u32) -> bool {
    stat(pid).is_some_and(|s| s.state != 'Z')
}

pub fn parent(pid: u32) -> Option<u32> {
    stat(pid).map(|s| s.ppid)
}

/// What a command line that could not be read in time is shown as.
pub const UNREADABLE: &str = "unknown (unreadable)";

/// An argv as the kernel keeps it (NUL-separated, as /proc/PID/cmdline gives it): its non-empty
/// arguments.
pub fn argv(raw: &[u8]) -> Vec<String> {
    raw.split(|&b| b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect()
}

/// Its argv, at most [`MAX_COMMAND`] bytes of it; None when gone or empty (a kernel thread).
/// Read within [`mm::DEADLINE`]: past it (the process holds its own memory lock, see [`mm`]),
/// the command is [`UNREADABLE`].
pub fn command(pid: u32) -> Option<Vec<String>> {
    let raw = match mm::read(pid, "cmdline", MAX_COMMAND) {
        mm::Read::Done(raw) => raw?,
        mm::Read::Late => return Some(vec![UNREADABLE.to_string()]),
    };
    let args = argv(&raw);
    (!args.is_empty()).then_some(args)
}

/// Reads of /proc files that take the target's memory-map lock (cmdline, environ, maps). Any
/// user can make such a read block in the kernel for as long as they like: a process whose own
/// lock is held in a page fault that a FUSE server of theirs never answers, with a writer queued
/// behind it. So each read runs on a worker thread and is waited for [`DEADLINE`] at most; past
/// it the caller goes on without it. A worker stuck in such a read stays stuck until the kernel
/// lets it go; while one is stuck on some uid's process, reads of that uid's processes are not
/// tried (one frozen process costs one deadline, not one per fork of it), and at most
/// [`WORKERS`] exist at once (past that, every read is late until one comes back). Reads that
/// are slow without ever being late (a lock held in stretches just under the deadline, a
/// process forking at every stretch) are bounded too: each uid's processes may cost the caller
/// [`BUDGET`] of waiting in any [`BUDGET_WINDOW`], past which they are late at once.
pub mod mm {
    use std::collections::HashMap;
    use std::io::Read as _;
    use std::os::unix::fs::MetadataExt;
    use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    pub const DEADLINE: Duration = Duration::from_millis(250);
    pub const WORKERS: usize = 8;
    pub const BUDGET: Duration = Duration::from_millis(100);
    pub const BUDGET_WINDOW: Duration = Duration::from_secs(1);

    pub enum Read {
        /// The bytes (at most the limit), or None: the process or the file is gone.
        Done(Option<Vec<u8>>),
        /// Not read within the deadline, or not tried (its owner's reads are stuck).
        Late,
    }

    struct Job {
        path: String,
        limit: u64,
        uid: u32,
        state: Arc<Mutex<State>>,
        reply: SyncSender<Option<Vec<u8>>>,
    }

    #[derive(Default)]
    struct State {
        finished: bool,
        abandoned: bool,
    }

    #[derive(Default)]
    struct Pool {
        /// Each idle worker's channel: a job, or None to end (see [`retire`]).
        idle: Vec<SyncSender<Option<Job>>>,
        workers: usize,
        /// Raised by [`retire`]: a worker of an earlier generation ends after its read.
        generation: u64,
        /// Reads abandoned and still blocked, by the uid owning the process read.
        stuck: HashMap<u32, usize>,
        /// The waiting each uid's processes cost in the current window: (its start, the total).
        spent: HashMap<u32, (Instant, Duration)>,
    }

    impl Pool {
        /// Whether `uid`'s processes have had their share of waiting in this window.
        fn spent_up(&mut self, uid: u32, now: Instant) -> bool {
            self.spent.get(&uid).is_some_and(|(start, spent)| now.duration_since(*start) < BUDGET_WINDOW && *spent >= BUDGET)
        }

        fn charge(&mut self, uid: u32, now: Instant, waited: Duration) {
            if self.spent.len() > 4096 {
                self.spent.retain(|_, (start, _)| now.duration_since(*start) < BUDGET_WINDOW);
            }
            let (start, spent) = self.spent.entry(uid).or_insert((now, Duration::ZERO));
            if now.duration_since(*start) >= BUDGET_WINDOW {
                (*start, *spent) = (now, Duration::ZERO);
            }
            *spent += waited;
        }
    }

    static POOL: Mutex<Option<Pool>> = Mutex::new(None);

    fn pool<T>(f: impl FnOnce(&mut Pool) -> T) -> T {
        let mut guard = POOL.lock().unwrap_or_else(|e| e.into_inner());
        f(guard.get_or_insert_with(Pool::default))
    }

    fn work(jobs: Receiver<Option<Job>>, me: SyncSender<Option<Job>>, generation: u64) {
        while let Ok(Some(job)) = jobs.recv() {
            let read = (|| {
                let mut raw = Vec::new();
                std::fs::File::open(&job.path).ok()?.take(job.limit).read_to_end(&mut raw).ok()?;
                Some(raw)
            })();
            let _ = job.reply.try_send(read);
            let kept = pool(|p| {
                let mut state = job.state.lock().unwrap_or_else(|e| e.into_inner());
                state.finished = true;
                if state.abandoned {
                    if let Some(n) = p.stuck.get_mut(&job.uid) {
                        *n = n.saturating_sub(1);
                        if *n == 0 {
                            p.stuck.remove(&job.uid);
                        }
                    }
                }
                if p.generation != generation {
                    p.workers -= 1;
                    return false;
                }
                p.idle.push(me.clone());
                true
            });
            if !kept {
                return;
            }
        }
    }

    /// Ends every worker: the idle ones now, a busy one when its read ends (one stuck ends when
    /// the kernel lets it go). Capabilities are each thread's own: a worker started before
    /// gputrace dropped its capabilities would keep them all, while one started after inherits
    /// what the dropping thread kept.
    pub fn retire() {
        pool(|p| {
            p.generation += 1;
            for worker in p.idle.drain(..) {
                if worker.try_send(None).is_ok() {
                    p.workers -= 1;
                }
            }
        })
    }

    /// /proc/PID/FILE, at most `limit` bytes, within [`DEADLINE`].
    pub fn read(pid: u32, file: &str, limit: u64) -> Read {
        // The owner from the directory's inode: no lock of the target's taken.
        let Ok(uid) = std::fs::metadata(format!("/proc/{pid}")).map(|m| m.uid()) else { return Read::Done(None) };
        let began = Instant::now();
        let worker = pool(|p| {
            if p.stuck.contains_key(&uid) || p.spent_up(uid, began) {
                return None;
            }
            if let Some(w) = p.idle.pop() {
                return Some(w);
            }
            if p.workers >= WORKERS {
                return None;
            }
            let (tx, rx) = sync_channel::<Option<Job>>(1);
            let (me, generation) = (tx.clone(), p.generation);
            std::thread::Builder::new().name("gputrace-proc".into()).spawn(move || work(rx, me, generation)).ok()?;
            p.workers += 1;
            Some(tx)
        });
        let Some(worker) = worker else { return Read::Late };
        let (reply, answer) = sync_channel(1);
        let state = Arc::new(Mutex::new(State::default()));
        let job = Job { path: format!("/proc/{pid}/{file}"), limit, uid, state: state.clone(), reply };
        if worker.send(Some(job)).is_err() {
            return Read::Late;
        }
        let answered = answer.recv_timeout(DEADLINE);
        pool(|p| p.charge(uid, began, began.elapsed()));
        if let Ok(read) = answered {
            return Read::Done(read);
        }
        // Decided under the pool's lock, as the worker's end is: a read that ended just now is
        // taken, one still blocked counts against its owner until it ends.
        pool(|p| {
            let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
            if s.finished {
                return Read::Done(answer.try_recv().ok().flatten());
            }
            s.abandoned = true;
            *p.stuck.entry(uid).or_default() += 1;
            Read::Late
        })
    }
}

/// The program a process runs, from /proc/PID/exe (its argv[0] is whatever the process says):
/// what decides that a holder is a daemon that holds the GPU by design.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Executable {
    /// Its path as the process sees it (inside its container), " (deleted)" if replaced since.
    pub path: String,
    /// The file's identity: two processes run the same program when these match.
    pub dev: u64,
    pub ino: u64,
    /// Owned by root, writable by no one else, in a directory likewise: no ordinary user could
    /// have put it there or changed it.
    pub system: bool,
}

impl Executable {
    /// The program's file name.
    pub fn name(&self) -> &str {
        let path = self.path.strip_suffix(" (deleted)").unwrap_or(&self.path);
        path.rsplit('/').next().unwrap_or(path)
    }
}

/// Root's, and no one else may write it.
fn root_only(stx: &libc::statx) -> bool {
    stx.stx_uid == 0 && u32::from(stx.stx_mode) & 0o022 == 0
}

/// A file's attributes as the kernel has them cached: a plain stat of a file on FUSE asks its
/// server, which may never answer.
fn cached_stat(path: &str) -> Option<libc::statx> {
    let path = std::ffi::CString::new(path).ok()?;
    // SAFETY: statx writes into the zeroed struct it is given; the path is NUL-terminated.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let mask = libc::STATX_TYPE | libc::STATX_MODE | libc::STATX_UID | libc::STATX_INO;
    let rc = unsafe { libc::statx(libc::AT_FDCWD, path.as_ptr(), libc::AT_STATX_DONT_SYNC, mask, &mut stx) };
    (rc == 0).then_some(stx)
}

/// What /proc/PID/exe names; None when gone (or a kernel thread).
pub fn executable(pid: u32) -> Option<Executable> {
    let path = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?.to_string_lossy().into_owned();
    // The link leads to the file itself, whatever its path has become.
    let file = cached_stat(&format!("/proc/{pid}/exe"))?;
    // Its directory, as the process sees it (through its root: a container's own /usr/bin).
    let dir = std::path::Path::new(&path).parent().map(|d| format!("/proc/{pid}/root{}", d.display()));
    let dir_ok = !path.ends_with(" (deleted)") && dir.and_then(|d| cached_stat(&d)).is_some_and(|d| root_only(&d));
    let dev = libc::makedev(file.stx_dev_major, file.stx_dev_minor);
    Some(Executable { system: root_only(&file) && dir_ok, dev, ino: file.stx_ino, path })
}

/// The real uid that owns a process, from /proc/PID/status.
pub fn owner(pid: u32) -> Option<u32> {
    uid_in(&read_bounded(&format!("/proc/{pid}/status"), 64 * 1024)?)
}

/// The real uid of a /proc/PID/status text.
fn uid_in(status: &str) -> Option<u32> {
    status.lines().find_map(|l| l.strip_prefix("Uid:"))?.split_whitespace().next()?.parse().ok()
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

/// Resident memory (VmRSS), in bytes.
pub fn resident_bytes(pid: u32) -> Option<u64> {
    let status = read_bounded(&format!("/proc/{pid}/status"), 64 * 1024)?;
    let kib: u64 = status.lines().find_map(|l| l.strip_prefix("VmRSS:")?.split_whitespace().next()?.parse().ok())?;
    Some(kib.saturating_mul(1024))
}

/// The path an open fd refers to, None when the process or fd is gone.
pub fn fd_path(pid: u32, fd: i32) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).ok()
}

/// The device number (major, minor) of the character device behind a fd ((0, 0) for any other
/// file: a block device's number is another namespace); None when the fd is gone.
pub fn fd_device_number(pid: u32, fd: i32) -> Option<(u32, u32)> {
    // Attributes as cached (a device number never changes while the file is open).
    let stx = cached_stat(&format!("/proc/{pid}/fd/{fd}"))?;
    let character = u32::from(stx.stx_mode) & libc::S_IFMT == libc::S_IFCHR;
    Some(if character { (stx.stx_rdev_major, stx.stx_rdev_minor) } else { (0, 0) })
}

/// Whether a fd is close-on-exec: /proc/PID/fdinfo/FD's `flags`, in octal, hold O_CLOEXEC when
/// its bit is set. None when the fd is gone.
pub fn fd_cloexec(pid: u32, fd: i32) -> Option<bool> {
    let text = read_bounded(&format!("/proc/{pid}/fdinfo/{fd}"), 4096)?;
    cloexec_in_fdinfo(&text)
}

fn cloexec_in_fdinfo(text: &str) -> Option<bool> {
    let flags = text.lines().find_map(|l| l.strip_prefix("flags:"))?;
    let flags = u32::from_str_radix(flags.trim(), 8).ok()?;
    Some(flags & libc::O_CLOEXEC as u32 != 0)
}

/// The fds a process has open now.
pub fn open_fds(pid: u32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect()
}

/// Whether two fds refer to the same open file description (kcmp(2)).
pub fn same_file(a: (u32, i32), b: (u32, i32)) -> bool {
    const KCMP_FILE: libc::c_long = 0;
    // SAFETY: kcmp only compares; invalid pids or fds return an error.
    let rc = unsafe {
        libc::syscall(libc::SYS_kcmp, a.0 as libc::pid_t, b.0 as libc::pid_t, KCMP_FILE, a.1 as libc::c_long, b.1 as libc::c_long)
    };
    rc == 0
}

/// Every process but gputrace itself.
pub fn all_pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).filter(|&pid| pid != std::process::id()).collect()
}

/// The given pids and every process below them now.
/// The processes in a cgroup v2 directory and those below it (cgroup.procs of each, bounded).
pub fn cgroup_pids(dir: &std::path::Path) -> Vec<u32> {
    let mut pids = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    // A few thousand cgroups at most: a pod or a container holds a handful.
    while let Some(d) = dirs.pop().filter(|_| pids.len() < 1 << 16) {
        let procs = read_bounded(&d.join("cgroup.procs").to_string_lossy(), 1 << 20).unwrap_or_default();
        pids.extend(procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        let subdirs = std::fs::read_dir(&d).into_iter().flatten().filter_map(Result::ok).take(4096);
        dirs.extend(subdirs.filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()));
    }
    pids
}

pub fn with_descendants(roots: &[u32]) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = all_pids().into_iter().filter_map(|pid| Some((pid, parent(pid)?))).collect();
    descendants(roots, &parents)
}

/// `roots` and every process below them, given (pid, parent) pairs.
fn descendants(roots: &[u32], parents: &[(u32, u32)]) -> Vec<u32> {
    let mut out: Vec<u32> = roots.to_vec();
    let mut i = 0;
    while i < out.len() {
        let parent = out[i];
        let children: Vec<u32> = parents.iter().filter(|(pid, ppid)| *ppid == parent && !out.contains(pid)).map(|(pid, _)| *pid).collect();
        out.extend(children);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn local_addresses_from_fib_trie_and_if_inet6() {
        let trie = "Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 0.0.0.0\n        /0 universe UNICAST\n           |-- 127.0.0.1\n              /32 host LOCAL\n           |-- 192.0.2.0\n              /24 link UNICAST\n           |-- 192.0.2.2\n              /32 host LOCAL\n        |-- 192.0.2.255\n           /32 link BROADCAST\nLocal:\n           |-- 192.0.2.2\n              /32 host LOCAL\n           |-- nonsense\n              /32 host LOCAL\n";
        let inet6 = "fd000000000000000000000000000002 04 40 00 82     eth0\n00000000000000000000000000000001 01 80 10 80       lo\nzz 01\n";
        let found = super::parse_local_addresses(trie, inet6);
        assert!(
            super::local_addresses(std::process::id()).is_some_and(|own| own.iter().any(|a| a.is_loopback())),
            "this process's namespace has loopback"
        );
        assert!(super::host_addresses().is_some_and(|all| all.iter().any(|a| a.is_loopback())), "the host's namespaces have loopback");
        let want: Vec<std::net::IpAddr> = ["127.0.0.1", "192.0.2.2", "::1", "fd00::2"].iter().map(|a| a.parse().unwrap()).collect();
        assert_eq!(found.len(), 4, "{found:?}");
        assert!(want.iter().all(|a| found.contains(a)), "{found:?}");
        assert!(super::parse_local_addresses("", "").is_empty());
    }

    use super::*;

    /// What an open with and without O_CLOEXEC shows in fdinfo, read from this process; and what
    /// a damaged or missing flags line gives.
    #[test]
    fn a_fds_close_on_exec_flag_from_fdinfo() {
        use std::os::fd::AsRawFd;
        let cloexec = std::fs::File::open("/proc/self/stat").unwrap();
        // SAFETY: open(2) of a C string, closed below.
        let plain = unsafe { libc::open(c"/proc/self/stat".as_ptr(), libc::O_RDONLY) };
        assert!(plain >= 0);
        let pid = std::process::id();
        assert_eq!((fd_cloexec(pid, cloexec.as_raw_fd()), fd_cloexec(pid, plain)), (Some(true), Some(false)));
        unsafe { libc::close(plain) };
        assert_eq!(fd_cloexec(pid, i32::MAX), None, "no such fd");
        assert_eq!(cloexec_in_fdinfo("pos:\t0\nflags:\t02100002\nmnt_id:\t25\n"), Some(true));
        assert_eq!(cloexec_in_fdinfo("pos:\t0\nflags:\t0100002\n"), Some(false));
        assert_eq!(cloexec_in_fdinfo("flags:\t9\n"), None);
        assert_eq!(cloexec_in_fdinfo("pos:\t0\n"), None);
    }

    #[test]
    fn the_cgroup_that_names_the_container() {
        let hex = "b".repeat(64);
        let hybrid = format!("4:memory:/docker/{hex}\n1:name=systemd:/docker/{hex}\n0::/\n");
        assert_eq!(pick_cgroup(&hybrid), Some(format!("/docker/{hex}")), "v1's, where v2's is the root");
        assert_eq!(pick_cgroup("0::/user.slice/session-1.scope\n"), Some("/user.slice/session-1.scope".into()));
        assert_eq!(pick_cgroup("4:memory:/\n0::/\n"), Some("/".into()));
    }

    #[test]
    fn containers_pods_and_namespaced_pids() {
        let hex = "a".repeat(64);
        let cgroupfs = format!("/kubepods/burstable/pod0b3c2d1e-aaaa-bbbb-cccc-0123456789ab/{hex}");
        assert_eq!(pod_of(&cgroupfs).as_deref(), Some("0b3c2d1e-aaaa-bbbb-cccc-0123456789ab"));
        assert_eq!(container_of(&cgroupfs).as_deref(), Some("aaaaaaaaaaaa"));
        let systemd = format!("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0b3c2d1e_aaaa_bbbb_cccc_0123456789ab.slice/cri-containerd-{hex}.scope");
        assert_eq!(pod_of(&systemd).as_deref(), Some("0b3c2d1e-aaaa-bbbb-cccc-0123456789ab"));
        assert_eq!(pod_of("/system.slice/docker-x.scope"), None);
        let delegated = "/user.slice/user-1000.slice/user@1000.service/kubepods/pod0b3c2d1e-aaaa-bbbb-cccc-0123456789ab";
        assert_eq!(pod_of(delegated), None, "a pod is named only below the kubelet's top-level cgroup");
        let logs = std::env::temp_dir().join(format!("gputrace-pod-logs-{}", std::process::id()));
        for dir in
            ["kube-system_coredns-5d78c9869d-abcde_11111111-2222-3333-4444-555555555555", "llm_vllm-0_0b3c2d1e-aaaa-bbbb-cccc-0123456789ab"]
        {
            std::fs::create_dir_all(logs.join(dir)).unwrap();
        }
        assert_eq!(pod_names_in(&logs, "0b3c2d1e-aaaa-bbbb-cccc-0123456789ab"), Some(("llm".into(), "vllm-0".into())));
        assert_eq!(pod_names_in(&logs, "99999999-aaaa-bbbb-cccc-0123456789ab"), None);
        assert_eq!(pod_names_in(&logs.join("absent"), "0b3c2d1e-aaaa-bbbb-cccc-0123456789ab"), None);
        std::fs::remove_dir_all(&logs).ok();
        assert_eq!(ns_pid("Name:\tsleep\nNSpid:\t4242\t1\n"), Some(1));
        assert_eq!(ns_pid("NSpid:\t4242\n"), None, "the host's own namespace");
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
    fn stat_fields_after_the_last_parenthesis() {
        let line = "42 (a) b (c)) S 7 40 39 0 -1 4194560 10 0 0 0 250 50 0 0 20 0 3 0 12345 0 0";
        let s = parse_stat(line).unwrap();
        assert_eq!((s.state, s.ppid, s.pgrp, s.session, s.cpu_ticks, s.start_ticks), ('S', 7, 40, 39, 300, 12345));
        assert_eq!(parse_stat("43 (zombie) Z 1 43"), Some(Stat { state: 'Z', ppid: 1, pgrp: 43, ..Stat::default() }));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn listening_sockets_and_containers() {
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
        let docker = "/system.slice/docker-4f2a9c1e0b7d3a5f6e8c9b0a1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e.scope";
        assert_eq!(container_of(docker).as_deref(), Some("4f2a9c1e0b7d"));
        assert_eq!(container_of("/user.slice/user-1000.slice/session-3.scope"), None);
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

    #[test]
    fn a_tree_below_its_roots() {
        let parents = [(2, 1), (3, 2), (4, 3), (5, 1), (6, 5)];
        let mut found = descendants(&[2], &parents);
        found.sort();
        assert_eq!(found, vec![2, 3, 4]);
    }

    #[test]
    fn this_process_reads_back() {
        let me = std::process::id();
        assert!(running(me));
        assert!(command(me).is_some_and(|argv| !argv.is_empty()));
        // SAFETY: getuid has no preconditions.
        assert_eq!(owner(me), Some(unsafe { libc::getuid() }));
        assert!(!open_fds(me).is_empty());
        let exe = executable(me).expect("its program");
        assert_eq!(exe, executable(me).unwrap());
        assert!(!exe.name().is_empty() && exe.ino != 0);
    }
}

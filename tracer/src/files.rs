//! Which NVIDIA file each traced fd refers to, decided at record time, when /proc and kcmp(2) can
//! still be asked. It answers the kernel's questions about fds it did not see opened, gives each
//! open file description an identity (so a dup, a fork or a descriptor received over a socket is
//! known to share it), and mirrors the kernel's fd map so it can clean up what the kernel cannot
//! iterate (close_range, exec, exit).
//!
//! Every change to the kernel map is returned as a [`KernelUpdate`], so this logic runs in tests
//! without root.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use tracer_common::device;

use crate::devices::{admitted, device_of_path, gpu_minor_of_path, Majors};
use crate::event::{Device, Event, Seen};
use crate::procfs;

/// What a resolver knows about running processes (the real one reads /proc and calls kcmp).
pub trait Resolver {
    /// The path an open fd refers to, None when the process or fd is gone.
    fn fd_path(&self, pid: u32, fd: i32) -> Option<PathBuf>;
    /// Whether two fds refer to the same open file description.
    fn same_file(&self, a: (u32, i32), b: (u32, i32)) -> bool;
    fn command(&self, pid: u32) -> Option<Vec<String>>;
    fn parent(&self, pid: u32) -> Option<u32>;
    /// The fds a running process has open now.
    fn open_fds(&self, pid: u32) -> Vec<i32>;
    /// Whether a fd is a Unix socket (a server's readiness is its TCP listening, not a control
    /// socket's: gputrace record's own mark socket, an admin socket).
    fn is_unix_socket(&self, _pid: u32, _fd: i32) -> bool {
        false
    }
    /// Where a process runs (see [`crate::event::Place`]).
    fn place(&self, _pid: u32) -> Option<crate::event::Place> {
        None
    }
    /// The device number (major, minor) behind a fd, None when the process or fd is gone.
    fn fd_device_number(&self, _pid: u32, _fd: i32) -> Option<(u32, u32)> {
        None
    }
    /// Whether a fd is close-on-exec; false when the process or fd is gone. Read once per fd of
    /// a process met running (the kernel reads the bit of the fds it asks about).
    fn fd_cloexec(&self, _pid: u32, _fd: i32) -> bool {
        false
    }
    /// The identity of a process's network namespace (so a host of processes reads each
    /// namespace's socket table once).
    fn net_namespace(&self, _pid: u32) -> Option<u64> {
        None
    }
    /// The threads of a process blocked in a read now: (tid, fd, buffer).
    fn blocked_reads(&self, _pid: u32) -> Vec<(u32, i32, u64)> {
        Vec::new()
    }
    /// The TCP sockets of a process's network namespace: listening, and accepted connections.
    fn sockets(&self, _pid: u32) -> procfs::net::Sockets {
        procfs::net::Sockets::default()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelUpdate {
    SetFd {
        pid: u32,
        fd: i32,
        state: u8,
    },
    ForgetFd {
        pid: u32,
        fd: i32,
    },
    /// The child's inherited fds are copied: it is an ordinary traced process now.
    Traced {
        pid: u32,
    },
    /// A thread met blocked in a read of a connection accepted before tracing: what that read
    /// returns is the request's head, looked at when it exits as if its enter had been seen.
    BlockedRead {
        pid: u32,
        tid: u32,
        fd: i32,
        buf: u64,
    },
}

fn kernel_state(device: Device) -> u8 {
    match device {
        Device::Ctl => device::CTL,
        Device::Gpu => device::GPU,
        Device::Uvm => device::UVM,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    Nvidia {
        device: Device,
        file: u64,
        cloexec: bool,
    },
    NotNvidia,
    /// An accepted connection the kernel follows, named across its fds.
    Conn {
        conn: u64,
    },
}

/// The fewest addresses of files kept before those of released files are forgotten.
const MIN_ADDRESSES_BOUND: usize = 1 << 16;

impl Answer {
    /// The file or connection it names.
    fn file(&self) -> Option<u64> {
        match self {
            Answer::Nvidia { file, .. } => Some(*file),
            Answer::Conn { conn } => Some(*conn),
            Answer::NotNvidia => None,
        }
    }
}

pub struct FileTable<R: Resolver> {
    resolver: R,
    /// Ordered, so one process's fds are a range (exec, exit, close_range).
    fds: BTreeMap<(u32, i32), Answer>,
    /// The fds known to refer to each file gputrace named (an NVIDIA file, a followed
    /// connection): a connection closes with its last.
    refs: HashMap<u64, u32>,
    /// The kernel's `struct file *` of each file gputrace named: the identity of an open file
    /// description, valid even after every fd the kcmp fallback could compare against is gone.
    kernel_files: HashMap<u64, u64>,
    /// The same, by file: a file named by an address is never asked about by kcmp for a fd at
    /// another one (a fd at a new address costs no question per known file).
    addresses: HashMap<u64, u64>,
    /// Past this many addresses, those of files no known fd refers to are forgotten.
    addresses_bound: usize,
    next_file: u64,
    pub questions_answered: u64,
    /// ioctls sent while their fd's question was open, dropped because it was not NVIDIA.
    pub pending_dropped: u64,
    /// Fds at an NVIDIA path whose file is not NVIDIA's device: not followed.
    pub impostors: u64,
    /// NVIDIA's device numbers on this host; None: no driver, paths alone (see [`Majors`]).
    majors: Option<Majors>,
    /// Where each live process was last seen to run.
    places: HashMap<u32, crate::event::Place>,
    /// Which GPU each /dev/nvidiaN is.
    gpu_indexes: crate::devices::GpuIndexes,
    /// The sockets of each network namespace met while attaching (read once each), and the
    /// connection each accepted socket met is (a socket's fds, dups or a child's, are one).
    sockets: HashMap<u64, procfs::net::Sockets>,
    conn_of_socket: HashMap<u64, u64>,
}

const CLOSE_RANGE_CLOEXEC: u32 = 4;

impl<R: Resolver> FileTable<R> {
    /// Where `pid` runs, when that is news: first seen, or changed since its parent's or its
    /// own last (a fork into a container, an exec after joining a cgroup). Kept per live process.
    pub fn place_if_new(&mut self, pid: u32, parent: Option<u32>) -> Option<crate::event::Place> {
        let place = self.resolver.place(pid)?;
        let before = self.places.get(&pid).or_else(|| parent.and_then(|p| self.places.get(&p)));
        let news = before != Some(&place);
        self.places.insert(pid, place.clone());
        news.then_some(place)
    }

    /// Whether userspace holds `fd` of `pid` to be an NVIDIA file, or to be none.
    pub fn knows_nvidia(&self, pid: u32, fd: i32) -> bool {
        matches!(self.fds.get(&(pid, fd)), Some(Answer::Nvidia { .. }))
    }
    pub fn knows_not_nvidia(&self, pid: u32, fd: i32) -> bool {
        matches!(self.fds.get(&(pid, fd)), Some(Answer::NotNvidia))
    }

    /// Whether `fd` of `pid` is a Unix socket (see [`Resolver::is_unix_socket`]).
    pub fn is_unix_socket(&self, pid: u32, fd: i32) -> bool {
        self.resolver.is_unix_socket(pid, fd)
    }

    pub fn new(resolver: R) -> Self {
        FileTable {
            resolver,
            fds: BTreeMap::new(),
            refs: HashMap::new(),
            kernel_files: HashMap::new(),
            addresses: HashMap::new(),
            addresses_bound: MIN_ADDRESSES_BOUND,
            next_file: 1,
            questions_answered: 0,
            pending_dropped: 0,
            impostors: 0,
            majors: None,
            places: HashMap::new(),
            gpu_indexes: crate::devices::GpuIndexes::default(),
            sockets: HashMap::new(),
            conn_of_socket: HashMap::new(),
        }
    }

    /// Which GPU each /dev/nvidiaN file is, for the processes met running.
    pub fn set_gpu_indexes(&mut self, indexes: crate::devices::GpuIndexes) {
        self.gpu_indexes = indexes;
    }

    /// Attaching is over: the sockets tables read for it are stale from now on.
    pub fn attached(&mut self) {
        self.sockets.clear();
        self.conn_of_socket.clear();
    }

    /// NVIDIA's device numbers, as read at start or since (a module loaded later).
    pub fn set_majors(&mut self, majors: Option<Majors>) {
        self.majors = majors;
    }

    fn new_file(&mut self) -> u64 {
        let id = self.next_file;
        self.next_file += 1;
        id
    }

    pub fn device(&self, pid: u32, fd: i32) -> Option<Device> {
        match self.fds.get(&(pid, fd)) {
            Some(Answer::Nvidia { device, .. }) => Some(*device),
            _ => None,
        }
    }

    /// `kernel_file`: the kernel's `struct file *`, 0 when unknown.
    pub fn opened(&mut self, pid: u32, fd: i32, device: Device, cloexec: bool, kernel_file: u64) -> Event {
        let file = self.new_file();
        self.set((pid, fd), Answer::Nvidia { device, file, cloexec });
        // A new open at an address a released file had is a new file: the mapping is replaced.
        self.name_address(kernel_file, file);
        Event::Open { fd, file, device, cloexec }
    }

    /// A close the kernel sent. It forgot its own entry at the close, and the fd's number may
    /// have been reused since (an open the kernel already followed): only a close by a child
    /// still inheriting, for which the kernel had none, forgets the entry the copy of its
    /// parent's fds made.
    pub fn closed(&mut self, pid: u32, fd: i32, inheriting: bool, updates: &mut Vec<KernelUpdate>) -> Option<Event> {
        match self.unset((pid, fd)) {
            Some(Answer::Nvidia { .. }) => {
                if inheriting {
                    updates.push(KernelUpdate::ForgetFd { pid, fd });
                }
                Some(Event::Close { fd })
            }
            Some(Answer::NotNvidia) | Some(Answer::Conn { .. }) | None => None,
        }
    }

    /// An accepted connection: a new name, mirrored so exec and exit forget the kernel's entry.
    pub fn accepted(&mut self, pid: u32, fd: i32) -> Event {
        let conn = self.new_file();
        self.set((pid, fd), Answer::Conn { conn });
        Event::Accept { fd, conn }
    }

    /// Every change to the mirror goes through here and `unset`, so the counts of fds per file
    /// stay true.
    fn set(&mut self, key: (u32, i32), answer: Answer) {
        if let Some(file) = answer.file() {
            *self.refs.entry(file).or_default() += 1;
        }
        if let Some(old) = self.fds.insert(key, answer) {
            self.forget_ref(old);
        }
    }

    fn unset(&mut self, key: (u32, i32)) -> Option<Answer> {
        let old = self.fds.remove(&key)?;
        self.forget_ref(old);
        Some(old)
    }

    fn forget_ref(&mut self, answer: Answer) {
        let Some(file) = answer.file() else { return };
        if let Some(refs) = self.refs.get_mut(&file) {
            *refs -= 1;
            if *refs == 0 {
                self.refs.remove(&file);
            }
        }
    }

    /// Names `file` by the kernel's address of it (0: none known). Past the bound, the
    /// addresses of files no known fd refers to any more are forgotten, and the bound is set to
    /// twice what is left: a user opening and closing a device in a loop would otherwise grow
    /// them for the life of a watch. (A fd met later at such an address is then joined to its
    /// file only by kcmp, against the fds known.)
    fn name_address(&mut self, address: u64, file: u64) {
        if address == 0 {
            return;
        }
        if let Some(before) = self.kernel_files.insert(address, file) {
            self.addresses.remove(&before);
        }
        self.addresses.insert(file, address);
        if self.kernel_files.len() > self.addresses_bound {
            let refs = &self.refs;
            self.kernel_files.retain(|_, file| refs.contains_key(file));
            self.addresses.retain(|file, _| refs.contains_key(file));
            self.addresses_bound = (2 * self.kernel_files.len()).max(MIN_ADDRESSES_BOUND);
        }
    }

    /// The connection `fd` refers to, if followed.
    pub fn conn(&self, pid: u32, fd: i32) -> Option<u64> {
        match self.fds.get(&(pid, fd)) {
            Some(Answer::Conn { conn }) => Some(*conn),
            _ => None,
        }
    }

    /// One fd of a connection closed; the connection closes with its last fd.
    pub fn conn_closed(&mut self, pid: u32, fd: i32) -> Option<Event> {
        let conn = self.conn(pid, fd)?;
        self.unset((pid, fd));
        (!self.refs.contains_key(&conn)).then_some(Event::ConnClose { conn })
    }

    pub fn duplicated(&mut self, pid: u32, old_fd: i32, new_fd: i32, cloexec: bool) -> Option<Event> {
        match self.fds.get(&(pid, old_fd)).copied()? {
            Answer::Nvidia { device, file, .. } => {
                self.set((pid, new_fd), Answer::Nvidia { device, file, cloexec });
                Some(Event::Dup { old_fd, new_fd, cloexec })
            }
            // Another fd of the same connection: nothing for the trace, one more name for it.
            conn @ Answer::Conn { .. } => {
                self.set((pid, new_fd), conn);
                None
            }
            Answer::NotNvidia => None,
        }
    }

    pub fn set_cloexec(&mut self, pid: u32, fd: i32, value: bool) -> Option<Event> {
        match self.fds.get_mut(&(pid, fd)) {
            Some(Answer::Nvidia { cloexec, .. }) => {
                *cloexec = value;
                Some(Event::SetCloexec { fd, cloexec: value })
            }
            _ => None,
        }
    }

    fn fds_of(&self, pid: u32) -> Vec<i32> {
        self.fds.range((pid, i32::MIN)..=(pid, i32::MAX)).map(|((_, fd), _)| *fd).collect()
    }

    pub fn close_range(&mut self, pid: u32, first: u32, last: u32, flags: u32, updates: &mut Vec<KernelUpdate>) -> Event {
        let cloexec_only = flags & CLOSE_RANGE_CLOEXEC != 0;
        for fd in self.fds_of(pid) {
            if fd < 0 || !(first..=last).contains(&(fd as u32)) {
                continue;
            }
            if cloexec_only {
                if let Some(Answer::Nvidia { cloexec, .. }) = self.fds.get_mut(&(pid, fd)) {
                    *cloexec = true;
                }
            } else {
                self.unset((pid, fd));
                updates.push(KernelUpdate::ForgetFd { pid, fd });
            }
        }
        Event::CloseRange { first, last, cloexec_only }
    }

    /// fork copies the fd table: the child's kernel entries are the parent's NVIDIA ones.
    pub fn forked(&mut self, parent: u32, child: u32, seen: Seen, updates: &mut Vec<KernelUpdate>) -> Event {
        let inherited: Vec<(i32, Answer)> = self
            .fds
            .range((parent, i32::MIN)..=(parent, i32::MAX))
            .filter(|(_, a)| matches!(a, Answer::Nvidia { .. }))
            .map(|((_, fd), a)| (*fd, *a))
            .collect();
        for (fd, answer) in inherited {
            self.set((child, fd), answer);
            if let Answer::Nvidia { device, .. } = answer {
                updates.push(KernelUpdate::SetFd { pid: child, fd, state: kernel_state(device) });
            }
        }
        updates.push(KernelUpdate::Traced { pid: child });
        let command = self.resolver.command(child).or_else(|| self.resolver.command(parent)).unwrap_or_default();
        Event::Process { ppid: parent, seen, command }
    }

    /// exec closes close-on-exec fds and drops the kernel's negative answers (asked again if used).
    /// Its command is the argv the kernel side read at the exec when it read all of it (a program
    /// that fails at once is gone from /proc by now), else /proc's where it begins with the part
    /// the kernel read (not a later exec's, nor a reused pid's), else that part, else the file it
    /// ran.
    pub fn exec(&mut self, pid: u32, filename: &str, argv: Vec<String>, argv_whole: bool, updates: &mut Vec<KernelUpdate>) -> Event {
        for fd in self.fds_of(pid) {
            let keep = matches!(self.fds.get(&(pid, fd)), Some(Answer::Nvidia { cloexec: false, .. }));
            if !keep {
                self.unset((pid, fd));
                updates.push(KernelUpdate::ForgetFd { pid, fd });
            }
        }
        // A whole argv needs no read of /proc (one on every exec, within its deadline).
        if argv_whole {
            return Event::Exec { command: argv };
        }
        let command = match self.resolver.command(pid) {
            Some(read) if read != [procfs::command::UNREADABLE] && read.starts_with(&argv) => read,
            _ if !argv.is_empty() => argv,
            Some(read) => read,
            None => vec![filename.to_string()],
        };
        Event::Exec { command }
    }

    pub fn exited(&mut self, pid: u32, updates: &mut Vec<KernelUpdate>) {
        self.places.remove(&pid);
        for fd in self.fds_of(pid) {
            self.unset((pid, fd));
            updates.push(KernelUpdate::ForgetFd { pid, fd });
        }
    }

    /// The answer to the kernel's question about (pid, fd), from the mirror or from /proc.
    /// Returns the device (None: not NVIDIA, or the fd is gone) and the FdFound event to record
    /// when gputrace learned of this NVIDIA fd only now. `asked`: the kernel's own question (it
    /// had no entry, or one saying not NVIDIA for a fd whose device number is NVIDIA's now), or
    /// a call the kernel sent as NVIDIA's on a state of its own, so a not-NVIDIA answer in the
    /// mirror may be stale (the number closed and reused, unseen, for a received or
    /// io_uring-opened NVIDIA file; the kernel forgets a fd it was told is not NVIDIA at its
    /// close without a word) and /proc is asked again; one about a fd gone since is forgotten.
    /// `cloexec`: the fd's close-on-exec bit as the kernel read it when it asked.
    pub fn answer(
        &mut self,
        pid: u32,
        (fd, asked, cloexec): (i32, bool, bool),
        kernel_file: u64,
        updates: &mut Vec<KernelUpdate>,
    ) -> (Option<Device>, Vec<Event>) {
        match self.fds.get(&(pid, fd)).copied() {
            Some(Answer::Nvidia { device, .. }) => {
                updates.push(KernelUpdate::SetFd { pid, fd, state: kernel_state(device) });
                return (Some(device), Vec::new());
            }
            Some(Answer::NotNvidia) if !asked => {
                updates.push(KernelUpdate::SetFd { pid, fd, state: device::NOT_NVIDIA });
                return (None, Vec::new());
            }
            // A connection the kernel no longer follows under that number: ask /proc afresh.
            Some(Answer::NotNvidia) | Some(Answer::Conn { .. }) | None => {}
        }
        self.questions_answered += 1;
        // A fd already gone leaves nothing to answer; the kernel dropped its entry on close.
        let Some(device) = self.nvidia_fd(pid, fd) else {
            if matches!(self.fds.get(&(pid, fd)), Some(Answer::NotNvidia)) {
                self.unset((pid, fd));
            }
            return (None, Vec::new());
        };
        match device {
            None => {
                self.set((pid, fd), Answer::NotNvidia);
                updates.push(KernelUpdate::SetFd { pid, fd, state: device::NOT_NVIDIA });
                (None, Vec::new())
            }
            Some(device) => {
                let events = self.found(pid, fd, device, kernel_file, cloexec);
                updates.push(KernelUpdate::SetFd { pid, fd, state: kernel_state(device) });
                (Some(device), events)
            }
        }
    }

    /// A fd that an ioctl's params name (an export's or import's nvidiactl file), known from the
    /// kernel's `struct file *` when no ioctl comes on it: a fd received over a socket is named
    /// and joined to its file. Nothing when it is known already.
    pub fn named(
        &mut self,
        pid: u32,
        fd: i32,
        device: Device,
        kernel_file: u64,
        cloexec: bool,
        updates: &mut Vec<KernelUpdate>,
    ) -> Vec<Event> {
        if fd < 0 || self.knows_nvidia(pid, fd) {
            return Vec::new();
        }
        // RM checked the file when it took it; one gone since is taken on RM's word, one that
        // is another device now was re-pointed since and is not followed.
        if admitted(self.majors, device, || self.resolver.fd_device_number(pid, fd)) == Some(false) {
            self.impostors += 1;
            return Vec::new();
        }
        updates.push(KernelUpdate::SetFd { pid, fd, state: kernel_state(device) });
        self.found(pid, fd, device, kernel_file, cloexec)
    }

    /// An NVIDIA fd met without its open: names the open file description it shares, if known,
    /// by the kernel's `struct file *`, else by kcmp against the live fds of known files. Its
    /// FdFound event, then its close-on-exec flag when it is set (an exec closes it). Also what
    /// the kernel sends for a fd it found NVIDIA's by its file's device number at its first call
    /// (its entry there is set already): no /proc reading, the fd may be closed by now.
    pub fn found(&mut self, pid: u32, fd: i32, device: Device, kernel_file: u64, cloexec: bool) -> Vec<Event> {
        let by_kernel = self.kernel_files.get(&kernel_file).copied().filter(|_| kernel_file != 0);
        // A file the kernel named by another address is another open file description.
        let may_be = |file: &u64| kernel_file == 0 || !self.addresses.contains_key(file);
        let known = by_kernel.or_else(|| {
            self.fds.iter().find_map(|(&(p, f), a)| match a {
                Answer::Nvidia { device: d, file, .. } if *d == device && may_be(file) && self.resolver.same_file((pid, fd), (p, f)) => {
                    Some(*file)
                }
                _ => None,
            })
        });
        let file = known.unwrap_or_else(|| self.new_file());
        self.set((pid, fd), Answer::Nvidia { device, file, cloexec });
        self.name_address(kernel_file, file);
        let mut events = vec![Event::FdFound { fd, file, device }];
        events.extend(cloexec.then_some(Event::SetCloexec { fd, cloexec }));
        events
    }

    /// The NVIDIA device a fd is, by its path and its device number, or (where the driver is
    /// loaded) by its device number alone when its node is elsewhere; None when the fd is gone.
    fn nvidia_fd(&mut self, pid: u32, fd: i32) -> Option<Option<Device>> {
        let path = self.resolver.fd_path(pid, fd)?;
        let Some(device) = path.to_str().and_then(device_of_path) else {
            let Some(majors) = self.majors else { return Some(None) };
            return Some(self.resolver.fd_device_number(pid, fd).and_then(|number| majors.device_of(number)));
        };
        if !admitted(self.majors, device, || self.resolver.fd_device_number(pid, fd))? {
            self.impostors += 1;
            return Some(None);
        }
        Some(Some(device))
    }

    /// A process already running when tracing began: its command, the NVIDIA fds it holds, and
    /// what it had then ([`Event::Attached`]: the ports it listened on, the GPUs it held). Its
    /// place is asked for apart ([`FileTable::place_if_new`]), once it is worth a record.
    pub fn scan(&mut self, pid: u32, updates: &mut Vec<KernelUpdate>) -> Vec<Event> {
        let command = self.resolver.command(pid).unwrap_or_default();
        let ppid = self.resolver.parent(pid).unwrap_or(0);
        let mut events = vec![Event::Process { ppid, seen: Seen::Running, command }];
        let (mut gpus, mut sockets) = (Vec::new(), Vec::new());
        for fd in self.resolver.open_fds(pid) {
            let path = self.resolver.fd_path(pid, fd).map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
            if let Some(inode) = path.strip_prefix("socket:[").and_then(|p| p.strip_suffix(']')?.parse::<u64>().ok()) {
                sockets.push((fd, inode));
                continue;
            }
            let Some(Some(device)) = self.nvidia_fd(pid, fd) else {
                continue;
            };
            if let Some(minor) = gpu_minor_of_path(&path).filter(|_| device == Device::Gpu) {
                gpus.push(self.gpu_indexes.of_minor(minor));
            }
            let cloexec = self.resolver.fd_cloexec(pid, fd);
            events.extend(self.found(pid, fd, device, 0, cloexec));
            updates.push(KernelUpdate::SetFd { pid, fd, state: kernel_state(device) });
        }
        let (listening, accepted) = if sockets.is_empty() { (Vec::new(), Vec::new()) } else { self.sockets_of(pid, &sockets) };
        // Connections accepted before tracing are followed from now on: a proxy's pooled
        // keep-alive connections carry every request a late attach will see.
        for &(fd, socket) in &accepted {
            match self.conn_of_socket.get(&socket) {
                Some(&conn) => self.set((pid, fd), Answer::Conn { conn }),
                None => {
                    let accept = self.accepted(pid, fd);
                    if let Event::Accept { conn, .. } = accept {
                        self.conn_of_socket.insert(socket, conn);
                    }
                    events.push(accept);
                }
            }
            updates.push(KernelUpdate::SetFd { pid, fd, state: tracer_common::device::CONN });
        }
        // A read already waiting on one of them would otherwise lose the request it returns.
        let blocked = if accepted.is_empty() { Vec::new() } else { self.resolver.blocked_reads(pid) };
        for &(tid, fd, buf) in blocked.iter().filter(|(_, fd, _)| accepted.iter().any(|(a, _)| a == fd)) {
            updates.push(KernelUpdate::BlockedRead { pid, tid, fd, buf });
        }
        gpus.sort_unstable();
        gpus.dedup();
        if !listening.is_empty() || !gpus.is_empty() {
            events.push(Event::Attached { listening, gpus });
        }
        events
    }

    /// The ports of `sockets` (inodes) that listen, from the process's namespace's table.
    /// Of a process's sockets (fd, inode): the ports it listens on, and the connections it
    /// accepted (fd, inode), from its namespace's tables.
    fn sockets_of(&mut self, pid: u32, sockets: &[(i32, u64)]) -> (Vec<u16>, Vec<(i32, u64)>) {
        let Some(namespace) = self.resolver.net_namespace(pid) else { return (Vec::new(), Vec::new()) };
        let table = match self.sockets.entry(namespace) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(self.resolver.sockets(pid)),
        };
        let mut ports: Vec<u16> = sockets.iter().filter_map(|(_, inode)| table.listening.get(inode).copied()).collect();
        ports.sort_unstable();
        ports.dedup();
        let accepted = sockets.iter().filter(|(_, inode)| table.accepted.contains(inode)).copied().collect();
        (ports, accepted)
    }
}

/// The real resolver: /proc and kcmp(2).
pub struct ProcResolver;

impl Resolver for ProcResolver {
    fn fd_path(&self, pid: u32, fd: i32) -> Option<PathBuf> {
        procfs::fds::fd_path(pid, fd)
    }
    fn same_file(&self, a: (u32, i32), b: (u32, i32)) -> bool {
        procfs::fds::same_file(a, b)
    }
    fn command(&self, pid: u32) -> Option<Vec<String>> {
        procfs::command::command(pid)
    }
    fn parent(&self, pid: u32) -> Option<u32> {
        procfs::parent(pid)
    }
    fn open_fds(&self, pid: u32) -> Vec<i32> {
        procfs::fds::open_fds(pid)
    }
    fn is_unix_socket(&self, pid: u32, fd: i32) -> bool {
        procfs::net::is_unix_socket(pid, fd)
    }
    fn place(&self, pid: u32) -> Option<crate::event::Place> {
        procfs::place::place(pid)
    }
    fn fd_device_number(&self, pid: u32, fd: i32) -> Option<(u32, u32)> {
        procfs::fds::fd_device_number(pid, fd)
    }
    fn fd_cloexec(&self, pid: u32, fd: i32) -> bool {
        procfs::fds::fd_cloexec(pid, fd).unwrap_or(false)
    }
    fn net_namespace(&self, pid: u32) -> Option<u64> {
        procfs::net::net_namespace(pid)
    }
    fn sockets(&self, pid: u32) -> procfs::net::Sockets {
        procfs::net::sockets(pid)
    }
    fn blocked_reads(&self, pid: u32) -> Vec<(u32, i32, u64)> {
        procfs::net::blocked_reads(pid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fds as a test sets them up: (pid, fd) -> (path, open file description id).
    #[derive(Default)]
    struct FakeProc {
        fds: HashMap<(u32, i32), (String, u32)>,
        /// Each fd's device number, when a test sets them.
        rdev: HashMap<(u32, i32), (u32, u32)>,
        /// The one network namespace's sockets.
        sockets: procfs::net::Sockets,
        /// Threads blocked in a read now: (tid, fd, buffer).
        blocked: Vec<(u32, i32, u64)>,
        /// Fds that are close-on-exec.
        cloexec: Vec<(u32, i32)>,
        /// kcmp questions asked.
        asked: std::cell::Cell<u32>,
    }

    impl Resolver for FakeProc {
        fn fd_path(&self, pid: u32, fd: i32) -> Option<PathBuf> {
            self.fds.get(&(pid, fd)).map(|(p, _)| PathBuf::from(p))
        }
        fn same_file(&self, a: (u32, i32), b: (u32, i32)) -> bool {
            self.asked.set(self.asked.get() + 1);
            matches!((self.fds.get(&a), self.fds.get(&b)), (Some(x), Some(y)) if x.1 == y.1)
        }
        fn command(&self, pid: u32) -> Option<Vec<String>> {
            match pid {
                GONE => None,
                LATE => Some(vec![procfs::command::UNREADABLE.to_string()]),
                _ => Some(vec![format!("cmd{pid}")]),
            }
        }
        fn parent(&self, _pid: u32) -> Option<u32> {
            Some(1)
        }
        fn open_fds(&self, pid: u32) -> Vec<i32> {
            let mut fds: Vec<i32> = self.fds.keys().filter(|(p, _)| *p == pid).map(|(_, fd)| *fd).collect();
            fds.sort();
            fds
        }
        fn fd_device_number(&self, pid: u32, fd: i32) -> Option<(u32, u32)> {
            self.rdev.get(&(pid, fd)).copied()
        }
        fn fd_cloexec(&self, pid: u32, fd: i32) -> bool {
            self.cloexec.contains(&(pid, fd))
        }
        fn net_namespace(&self, _pid: u32) -> Option<u64> {
            Some(1)
        }
        fn sockets(&self, _pid: u32) -> procfs::net::Sockets {
            self.sockets.clone()
        }
        fn blocked_reads(&self, _pid: u32) -> Vec<(u32, i32, u64)> {
            self.blocked.clone()
        }
    }

    /// A process already gone from /proc, and one whose command line cannot be read in time.
    const GONE: u32 = 900;
    const LATE: u32 = 901;

    fn table(fds: &[((u32, i32), &str, u32)]) -> FileTable<FakeProc> {
        let mut proc = FakeProc::default();
        for (key, path, description) in fds {
            proc.fds.insert(*key, (path.to_string(), *description));
        }
        FileTable::new(proc)
    }

    #[test]
    fn a_question_is_answered_once_from_proc_then_from_the_mirror() {
        let mut t = table(&[((10, 5), "socket:[99]", 1), ((10, 6), "/dev/nvidiactl", 2)]);
        let mut updates = vec![];
        assert_eq!(t.answer(10, (5, true, false), 0, &mut updates), (None, vec![]));
        assert_eq!(updates, vec![KernelUpdate::SetFd { pid: 10, fd: 5, state: device::NOT_NVIDIA }]);
        let (device, event) = t.answer(10, (6, true, false), 0, &mut updates);
        assert_eq!(device, Some(Device::Ctl));
        assert!(matches!(event[..], [Event::FdFound { fd: 6, device: Device::Ctl, .. }]));
        assert_eq!(t.questions_answered, 2);
        // Pending ioctls that arrive after the answer are settled from the mirror.
        assert_eq!(t.answer(10, (5, false, false), 0, &mut updates).0, None);
        assert_eq!(t.answer(10, (6, false, false), 0, &mut updates), (Some(Device::Ctl), vec![]));
        assert_eq!(t.questions_answered, 2);
        // The kernel asks again about a fd answered not NVIDIA only when it may be stale (its
        // number closed and reused for NVIDIA's file where no tracepoint saw it): /proc again.
        t.resolver.fds.insert((10, 5), ("/dev/nvidiactl".into(), 3));
        let (device, event) = t.answer(10, (5, true, false), 0, &mut updates);
        assert_eq!(device, Some(Device::Ctl));
        assert!(matches!(event[..], [Event::FdFound { fd: 5, device: Device::Ctl, .. }]));
        assert_eq!(t.questions_answered, 3);
        // Asked again about a number answered not NVIDIA whose fd is gone since: the old answer
        // is forgotten (the caller takes the kernel's word for a call it sent as NVIDIA's).
        t.set((10, 7), Answer::NotNvidia);
        assert_eq!(t.answer(10, (7, true, false), 0, &mut updates), (None, vec![]));
        assert!(!t.knows_not_nvidia(10, 7));
    }

    /// Where the driver is loaded, a file at an NVIDIA path is followed only with NVIDIA's device
    /// number: one a user mounted there (a FUSE file, another device) is answered as not NVIDIA,
    /// asked about or found by the scan alike.
    #[test]
    fn a_file_at_an_nvidia_path_with_another_device_number_is_not_followed() {
        let mut t = table(&[
            ((10, 6), "/dev/nvidiactl", 1),
            ((10, 7), "/dev/nvidiactl", 2),
            ((10, 8), "/dev/nvidia-uvm", 3),
            ((10, 9), "/dev/nvidia0", 4),
        ]);
        t.set_majors(Some(Majors { nvidia: 195, uvm: 509 }));
        t.resolver.rdev = HashMap::from([((10, 6), (195, 255)), ((10, 7), (0, 0)), ((10, 8), (509, 0)), ((10, 9), (509, 0))]);
        let mut updates = vec![];
        assert_eq!(t.answer(10, (6, true, false), 0, &mut updates).0, Some(Device::Ctl));
        assert_eq!(t.answer(10, (7, true, false), 0, &mut updates), (None, vec![]), "a FUSE file at /dev/nvidiactl");
        assert_eq!(updates.last(), Some(&KernelUpdate::SetFd { pid: 10, fd: 7, state: device::NOT_NVIDIA }));
        assert_eq!(t.answer(10, (8, true, false), 0, &mut updates).0, Some(Device::Uvm));
        assert_eq!(t.answer(10, (9, true, false), 0, &mut updates).0, None, "UVM's major at a GPU's path");
        assert_eq!(t.impostors, 2);
        let found = t.scan(10, &mut updates).iter().filter(|e| matches!(e, Event::FdFound { .. })).count();
        assert_eq!(found, 2, "the scan admits the same two");
        // NVIDIA's own node elsewhere (made or bind-mounted at another path) is NVIDIA's by its
        // number; nvidia-uvm-tools (UVM's major, minor 1) and a plain file are not.
        t.resolver.fds.extend([
            ((10, 11), ("/tmp/ctl".into(), 5)),
            ((10, 12), ("/tmp/tools".into(), 6)),
            ((10, 13), ("/etc/passwd".into(), 7)),
        ]);
        t.resolver.rdev.extend([((10, 11), (195, 255)), ((10, 12), (509, 1)), ((10, 13), (0, 0))]);
        assert_eq!(t.answer(10, (11, true, false), 0, &mut updates).0, Some(Device::Ctl));
        assert_eq!(t.answer(10, (12, true, false), 0, &mut updates).0, None);
        assert_eq!(t.answer(10, (13, true, false), 0, &mut updates).0, None);
        // Without the driver (the fake GPU), paths alone.
        let mut t = table(&[((10, 7), "/dev/nvidiactl", 2), ((10, 11), "/tmp/ctl", 5)]);
        assert_eq!(t.answer(10, (7, true, false), 0, &mut updates).0, Some(Device::Ctl));
        assert_eq!(t.answer(10, (11, true, false), 0, &mut updates).0, None);
    }

    /// A fd gone before it could be checked is gone, not an impostor; UVM's module loaded after
    /// gputrace read the majors leaves its files to their path until the next reading.
    #[test]
    fn device_numbers_that_cannot_be_read_or_are_not_known_yet() {
        let mut t = table(&[((10, 6), "/dev/nvidiactl", 1), ((10, 8), "/dev/nvidia-uvm", 3)]);
        t.set_majors(Some(Majors { nvidia: 195, uvm: 0 }));
        t.resolver.rdev = HashMap::from([((10, 8), (511, 0))]);
        let mut updates = vec![];
        assert_eq!(t.answer(10, (6, true, false), 0, &mut updates), (None, vec![]), "its number could not be read: gone");
        assert!(updates.is_empty(), "no answer that could go stale");
        assert_eq!(t.answer(10, (8, true, false), 0, &mut updates).0, Some(Device::Uvm), "UVM loaded since the reading");
        assert_eq!(t.impostors, 0);
        t.set_majors(Some(Majors { nvidia: 195, uvm: 509 }));
        assert_eq!(t.scan(10, &mut updates).iter().filter(|e| matches!(e, Event::FdFound { .. })).count(), 0, "511 is not 509");
        assert_eq!(t.impostors, 1);
    }

    /// The nvidiactl file an export names is taken on RM's word when it is gone already (an
    /// importer that closed it at once), and refused when it is another device by now.
    #[test]
    fn a_named_file_is_checked_where_it_can_be() {
        let mut t = table(&[((10, 7), "/dev/nvidiactl", 2)]);
        t.set_majors(Some(Majors { nvidia: 195, uvm: 509 }));
        let mut updates = vec![];
        assert!(!t.named(10, 5, Device::Ctl, 0xf00, false, &mut updates).is_empty(), "gone: RM checked it");
        t.resolver.rdev.insert((10, 7), (1, 3));
        assert_eq!(t.named(10, 7, Device::Ctl, 0xf08, false, &mut updates), [], "re-pointed to the null device");
        assert_eq!(t.impostors, 1);
        t.resolver.rdev.insert((10, 7), (195, 255));
        assert!(!t.named(10, 7, Device::Ctl, 0xf08, false, &mut updates).is_empty());
    }

    #[test]
    fn a_gone_fd_gets_no_answer_that_could_go_stale() {
        let mut t = table(&[]);
        let mut updates = vec![];
        assert_eq!(t.answer(10, (5, true, false), 0, &mut updates), (None, vec![]));
        assert!(updates.is_empty());
    }

    #[test]
    fn a_received_fd_is_known_to_share_the_senders_file() {
        // Process 20 got fd 9 over a socket: same open file description (2) as 10's fd 6.
        let mut t = table(&[((10, 6), "/dev/nvidiactl", 2), ((20, 9), "/dev/nvidiactl", 2), ((20, 4), "/dev/nvidiactl", 3)]);
        let Event::Open { file, .. } = t.opened(10, 6, Device::Ctl, false, 0) else { panic!() };
        let mut updates = vec![];
        let (_, found) = t.answer(20, (9, true, false), 0, &mut updates);
        assert_eq!(found, [Event::FdFound { fd: 9, file, device: Device::Ctl }]);
        let (_, other) = t.answer(20, (4, true, false), 0, &mut updates);
        assert!(matches!(other[..], [Event::FdFound { file: f, .. }] if f != file), "a different description is a different file");
    }

    /// The sender may be gone before the question is answered: the kernel's `struct file *`
    /// still names the file, where kcmp has nothing left to compare with.
    #[test]
    fn the_kernels_file_identity_outlives_the_sender() {
        let mut t = table(&[((20, 9), "/dev/nvidiactl", 2)]);
        let Event::Open { file, .. } = t.opened(10, 6, Device::Ctl, false, 0xffff_8880_1234_5600) else { panic!() };
        let mut updates = vec![];
        t.exited(10, &mut updates);
        let (_, found) = t.answer(20, (9, true, false), 0xffff_8880_1234_5600, &mut updates);
        assert_eq!(found, [Event::FdFound { fd: 9, file, device: Device::Ctl }]);
        // A later open that reuses the address is a different file.
        let Event::Open { file: reopened, .. } = t.opened(30, 3, Device::Ctl, false, 0xffff_8880_1234_5600) else { panic!() };
        assert_ne!(reopened, file);
    }

    /// Fds met without their open keep their close-on-exec flag: those held when tracing began
    /// from /proc, those asked about as the kernel read it. An exec closes those that have it,
    /// in the mirror as in the kernel, and keeps the others.
    #[test]
    fn a_fd_met_without_its_open_keeps_its_close_on_exec_flag() {
        let mut t = table(&[
            ((10, 5), "/dev/nvidiactl", 1),
            ((10, 6), "/dev/nvidia0", 2),
            ((10, 7), "/dev/nvidiactl", 3),
            ((10, 8), "/dev/nvidiactl", 4),
        ]);
        t.resolver.cloexec = vec![(10, 5), (10, 7), (10, 8)];
        let mut updates = vec![];
        let scanned = t.scan(10, &mut updates);
        let set: Vec<(i32, bool)> =
            scanned.iter().filter_map(|e| if let Event::SetCloexec { fd, cloexec } = e { Some((*fd, *cloexec)) } else { None }).collect();
        assert_eq!(set, [(5, true), (7, true), (8, true)], "{scanned:?}");
        // Closed, then met again under the same number (the mirror forgot them).
        assert_eq!(t.closed(10, 7, false, &mut updates), Some(Event::Close { fd: 7 }));
        let (_, asked) = t.answer(10, (7, true, true), 0, &mut updates);
        assert!(matches!(asked[..], [Event::FdFound { fd: 7, .. }, Event::SetCloexec { fd: 7, cloexec: true }]), "{asked:?}");
        // As the kernel read it, not as /proc says now.
        t.closed(10, 8, false, &mut updates);
        assert!(matches!(t.answer(10, (8, true, false), 0, &mut updates).1[..], [Event::FdFound { fd: 8, .. }]));
        // Named by an export (received over a socket with MSG_CMSG_CLOEXEC): the kernel's bit.
        let named = t.named(10, 9, Device::Ctl, 0xf10, true, &mut updates);
        assert!(matches!(named[..], [Event::FdFound { fd: 9, .. }, Event::SetCloexec { fd: 9, cloexec: true }]), "{named:?}");
        assert!(matches!(t.named(10, 11, Device::Ctl, 0xf18, false, &mut updates)[..], [Event::FdFound { fd: 11, .. }]));
        updates.clear();
        t.exec(10, "/bin/true", vec!["true".into()], true, &mut updates);
        assert_eq!(updates, [5, 7, 9].map(|fd| KernelUpdate::ForgetFd { pid: 10, fd }), "fds 6, 8 and 11, not close-on-exec, are kept");
    }

    /// A fd the kernel found NVIDIA's by its device number needs nothing from /proc: one
    /// already closed (a dup used once) is found all the same, joined to its file by the
    /// kernel's `struct file *`; its close-on-exec flag is kept, so an exec closes it.
    #[test]
    fn a_fd_found_by_number_needs_no_proc_and_keeps_its_close_on_exec_flag() {
        let mut t = table(&[]);
        let file_ptr = 0xffff_8880_4321_0000;
        let found = t.found(10, 5, Device::Gpu, file_ptr, true);
        let [Event::FdFound { fd: 5, file, device: Device::Gpu }, Event::SetCloexec { fd: 5, cloexec: true }] = found[..] else {
            panic!("{found:?}")
        };
        // Gone from /proc already (the table knows no fd 7): the same file, no flag.
        assert_eq!(t.found(10, 7, Device::Gpu, file_ptr, false), [Event::FdFound { fd: 7, file, device: Device::Gpu }]);
        assert_eq!(t.questions_answered, 0, "nothing was asked of /proc");
        let mut updates = vec![];
        t.exec(10, "/bin/true", vec!["true".into()], true, &mut updates);
        assert!(!t.knows_nvidia(10, 5) && t.knows_nvidia(10, 7), "the exec closed the close-on-exec fd only");
    }

    /// A fd at an address no file has is never compared (kcmp) with fds of files named by
    /// another address: one user's thousands of fds each found by number cost no question per
    /// fd known. Files known without an address (met in /proc) are still compared.
    #[test]
    fn a_fd_at_a_new_address_is_compared_only_with_files_known_without_one() {
        let mut t = table(&[((10, 20), "/dev/nvidiactl", 7), ((10, 21), "/dev/nvidiactl", 7)]);
        for fd in 3..10 {
            t.found(10, fd, Device::Ctl, 0x1000 * fd as u64, false);
        }
        assert_eq!(t.resolver.asked.get(), 0);
        let [Event::FdFound { file: unaddressed, .. }] = t.found(10, 20, Device::Ctl, 0, false)[..] else { panic!() };
        let asked = t.resolver.asked.get();
        assert!(asked > 0, "without an address, every file is a candidate");
        let [Event::FdFound { file, .. }] = t.found(10, 21, Device::Ctl, 0xabc000, false)[..] else { panic!() };
        assert_eq!(file, unaddressed, "joined by kcmp to the file known without an address");
        assert_eq!(t.resolver.asked.get() - asked, 1, "only that file's fd was asked about");
    }

    /// Opening and closing a device in a loop leaves no address behind past the bound, while a
    /// file still open keeps its own: a fd met later at it is that file.
    #[test]
    fn addresses_of_released_files_are_forgotten_past_the_bound() {
        let mut t = table(&[]);
        let mut updates = vec![];
        let Event::Open { file: kept, .. } = t.opened(10, 3, Device::Ctl, false, 0xdead_0000) else { panic!() };
        for address in 1..=2 * MIN_ADDRESSES_BOUND as u64 {
            t.opened(10, 4, Device::Ctl, false, address << 12);
            t.closed(10, 4, false, &mut updates);
        }
        assert!(t.kernel_files.len() <= MIN_ADDRESSES_BOUND && t.addresses.len() == t.kernel_files.len(), "{}", t.kernel_files.len());
        assert_eq!(t.found(11, 9, Device::Ctl, 0xdead_0000, false), [Event::FdFound { fd: 9, file: kept, device: Device::Ctl }]);
    }

    /// A server reading through a dup of the accepted fd still has one connection, closed with
    /// its last fd.
    #[test]
    fn a_connection_is_one_across_its_fds() {
        let mut t = table(&[]);
        let Event::Accept { conn, .. } = t.accepted(10, 8) else { panic!() };
        assert_eq!(t.duplicated(10, 8, 5, false), None);
        assert_eq!(t.conn(10, 5), Some(conn));
        assert_eq!(t.conn_closed(10, 5), None, "fd 8 still refers to it");
        assert_eq!(t.conn_closed(10, 8), Some(Event::ConnClose { conn }));
        assert_eq!(t.conn_closed(10, 8), None);
    }

    #[test]
    fn fork_copies_nvidia_fds_into_the_childs_kernel_entries() {
        let mut t = table(&[]);
        t.opened(10, 6, Device::Ctl, false, 0);
        t.opened(10, 7, Device::Uvm, true, 0);
        let mut updates = vec![];
        t.answer(10, (3, true, false), 0, &mut updates); // not NVIDIA (gone): nothing copied for it
        updates.clear();
        let event = t.forked(10, 11, Seen::Forked, &mut updates);
        assert!(matches!(event, Event::Process { ppid: 10, seen: Seen::Forked, .. }));
        assert!(updates.contains(&KernelUpdate::SetFd { pid: 11, fd: 6, state: device::CTL }));
        assert!(updates.contains(&KernelUpdate::SetFd { pid: 11, fd: 7, state: device::UVM }));
        assert_eq!(updates.last(), Some(&KernelUpdate::Traced { pid: 11 }));
        // The child's close of an inherited fd is an NVIDIA close; sent while it was inheriting,
        // the entry the copy made is forgotten.
        updates.clear();
        assert_eq!(t.closed(11, 6, true, &mut updates), Some(Event::Close { fd: 6 }));
        assert_eq!(updates, [KernelUpdate::ForgetFd { pid: 11, fd: 6 }]);
        assert_eq!(t.closed(11, 6, true, &mut updates), None);
        // Sent once the copy was in, the kernel forgot its entry itself: a reopen of the number
        // since keeps the one its open made.
        updates.clear();
        assert_eq!(t.closed(11, 7, false, &mut updates), Some(Event::Close { fd: 7 }));
        assert!(updates.is_empty(), "{updates:?}");
    }

    #[test]
    fn exec_keeps_only_nvidia_fds_without_close_on_exec() {
        let mut t = table(&[((10, 5), "socket:[1]", 1)]);
        t.opened(10, 6, Device::Ctl, false, 0);
        t.opened(10, 7, Device::Uvm, true, 0);
        let mut updates = vec![];
        t.answer(10, (5, true, false), 0, &mut updates);
        updates.clear();
        t.exec(10, "/bin/next", vec![], false, &mut updates);
        assert!(updates.contains(&KernelUpdate::ForgetFd { pid: 10, fd: 5 }));
        assert!(updates.contains(&KernelUpdate::ForgetFd { pid: 10, fd: 7 }));
        assert!(!updates.contains(&KernelUpdate::ForgetFd { pid: 10, fd: 6 }));
        assert_eq!(t.device(10, 6), Some(Device::Ctl));
    }

    /// The command an exec is named by: the kernel's argv when whole, even where /proc could
    /// answer (it may already show a later exec's); /proc's over a part it begins with, the part
    /// over /proc's when it does not; a part over nothing; the file run when nothing else is
    /// known.
    #[test]
    fn an_exec_is_named_by_the_argv_the_kernel_read() {
        let mut t = table(&[]);
        let mut updates = vec![];
        let argv = || vec!["fake-server".to_string(), "--server".to_string(), "llama".to_string()];
        let command = |e: Event| match e {
            Event::Exec { command } => command,
            e => panic!("{e:?}"),
        };
        assert_eq!(command(t.exec(10, "/bin/fake-server", argv(), true, &mut updates)), argv());
        assert_eq!(command(t.exec(GONE, "/bin/fake-server", argv(), true, &mut updates)), argv());
        assert_eq!(command(t.exec(10, "/bin/fake-server", vec!["cmd10".into()], false, &mut updates)), ["cmd10"]);
        // /proc shows another program's: the part the kernel read is this exec's.
        assert_eq!(command(t.exec(10, "/bin/fake-server", argv(), false, &mut updates)), argv());
        assert_eq!(command(t.exec(10, "/bin/fake-server", vec![], false, &mut updates)), ["cmd10"]);
        assert_eq!(command(t.exec(GONE, "/bin/fake-server", argv(), false, &mut updates)), argv());
        assert_eq!(command(t.exec(LATE, "/bin/fake-server", argv(), false, &mut updates)), argv());
        assert_eq!(command(t.exec(LATE, "/bin/fake-server", vec![], false, &mut updates)), [procfs::command::UNREADABLE]);
        assert_eq!(command(t.exec(GONE, "/bin/fake-server", vec![], false, &mut updates)), ["/bin/fake-server"]);
    }

    #[test]
    fn close_range_forgets_or_marks() {
        let mut t = table(&[]);
        t.opened(10, 3, Device::Ctl, false, 0);
        t.opened(10, 40, Device::Uvm, false, 0);
        let mut updates = vec![];
        t.close_range(10, 3, u32::MAX, CLOSE_RANGE_CLOEXEC, &mut updates);
        assert!(updates.is_empty());
        t.exec(10, "x", vec![], false, &mut updates);
        assert_eq!(t.device(10, 3), None, "marked close-on-exec by close_range");
        let mut t = table(&[]);
        t.opened(10, 3, Device::Ctl, false, 0);
        t.opened(10, 40, Device::Uvm, false, 0);
        updates.clear();
        t.close_range(10, 10, 100, 0, &mut updates);
        assert_eq!(updates, vec![KernelUpdate::ForgetFd { pid: 10, fd: 40 }]);
        assert_eq!(t.device(10, 3), Some(Device::Ctl));
    }

    #[test]
    fn scan_finds_the_nvidia_fds_of_a_running_process() {
        let mut t = table(&[
            ((10, 3), "/dev/nvidiactl", 1),
            ((10, 4), "/dev/null", 2),
            ((10, 5), "/dev/nvidia0", 3),
            ((10, 6), "/dev/nvidiactl", 1),
        ]);
        let mut updates = vec![];
        let events = t.scan(10, &mut updates);
        assert!(matches!(&events[0], Event::Process { seen: Seen::Running, .. }));
        let found: Vec<(i32, u64)> = events
            .iter()
            .filter_map(|e| match e {
                Event::FdFound { fd, file, .. } => Some((*fd, *file)),
                _ => None,
            })
            .collect();
        assert_eq!(found.len(), 3);
        let file_of = |fd| found.iter().find(|(f, _)| *f == fd).unwrap().1;
        assert_eq!(file_of(3), file_of(6), "fds 3 and 6 share one description");
        assert_ne!(file_of(3), file_of(5));
        assert_eq!(updates.len(), 3);
    }

    /// A server met running: the port it listens on, and the connections it accepted before
    /// tracing, followed from now on (named, and marked in the kernel as connections).
    #[test]
    fn scan_follows_the_connections_a_server_accepted_before() {
        let mut t = table(&[
            ((10, 3), "socket:[555]", 1),
            ((10, 7), "socket:[556]", 2),
            ((10, 8), "socket:[557]", 3),
            ((10, 9), "socket:[556]", 2),
        ]);
        t.resolver.sockets.listening.insert(555, 8000);
        t.resolver.sockets.accepted.insert(556);
        // One thread waits on the connection, another on the outgoing socket.
        t.resolver.blocked = vec![(11, 9, 0x7000), (12, 8, 0x8000)];
        let mut updates = vec![];
        let events = t.scan(10, &mut updates);
        let accepted: Vec<i32> = events.iter().filter_map(|e| if let Event::Accept { fd, .. } = e { Some(*fd) } else { None }).collect();
        assert_eq!(accepted, [7], "the accepted connection once, not the listener nor an outgoing socket");
        assert!(events.iter().any(|e| matches!(e, Event::Attached { listening, .. } if listening == &[8000])));
        let conn = tracer_common::device::CONN;
        assert!(
            matches!(updates[..], [KernelUpdate::SetFd { fd: 7, state: a, .. }, KernelUpdate::SetFd { fd: 9, state: b, .. }, KernelUpdate::BlockedRead { pid: 10, tid: 11, fd: 9, buf: 0x7000 }] if a == conn && b == conn),
            "the read already waiting on the connection is followed, the outgoing socket's is not: {updates:?}"
        );
        assert_eq!((t.conn(10, 7), t.conn(10, 9)), (Some(1), Some(1)), "its fds are one connection");
        // It closes with its last fd.
        assert_eq!(t.conn_closed(10, 9), None);
        assert!(t.conn_closed(10, 7).is_some());
    }
}

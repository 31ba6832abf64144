//! Fd tables and open files: which NVIDIA file each fd of each process refers to, and the
//! driver's release of a file when its last descriptor goes (close, dup2 over it, close-on-exec,
//! exit, in every process that shares it after fork).

use std::collections::BTreeMap;

use super::{AllocId, File, FileId, FreedBy, Model};

/// NVIDIA fds followed across every process at once: far above what real workloads hold, and
/// what keeps a crafted trace (every fork copying thousands) from using unbounded memory.
const MAX_FD_REFS: usize = 1 << 20;
use crate::event::{Device, Seen};

#[derive(Clone, Copy, Debug)]
pub(super) struct FdRef {
    pub(super) file: FileId,
    pub(super) cloexec: bool,
}

impl Model {
    pub(super) fn on_process(&mut self, pid: u32, ts: u64, ppid: u32, seen: Seen, command: &[String]) {
        // A damaged trace may name a process its own parent: it copies nothing from itself.
        let parent = self.processes.get(&ppid).filter(|_| ppid != pid);
        let inherited = parent.map(|p| p.fds.clone());
        // A fork runs where its parent runs, as the same user, until a Place says otherwise.
        let place = parent.and_then(|p| p.place.clone()).filter(|_| seen == Seen::Forked);
        let p = self.process(pid, ts);
        // A pid handed out again: a new process, whatever the old one left in the books.
        if p.exited.is_some() {
            (p.exited, p.exit_code, p.oom_killed, p.listened) = (None, None, None, None);
            p.place = None;
            p.bound.clear();
            p.first_ts = ts;
        }
        p.ppid = ppid;
        p.seen = seen;
        p.command = super::bounded_command(command);
        // What it had when met running comes after this (see Event::Attached); a new process
        // had nothing.
        p.attached = None;
        if seen != Seen::Forked {
            return;
        }
        if place.is_some() {
            p.place = place;
        }
        // A fork over a pid still holding files: its old descriptors went unseen.
        for fd in self.fds_in_order(pid, ts, |_| true) {
            self.close_fd(pid, fd, ts);
        }
        // fork copies the fd table: every NVIDIA file gains a reference. A trace can make every
        // fork copy thousands (real processes hold a handful): past MAX_FD_REFS held in all, the
        // copy is not followed, and that is counted.
        if let Some(fds) = inherited {
            if self.fd_refs.saturating_add(fds.len()) > MAX_FD_REFS {
                self.fd_refs_dropped = self.fd_refs_dropped.saturating_add(fds.len() as u64);
                return;
            }
            self.fd_refs += fds.len();
            for f in fds.values() {
                if let Some(file) = self.files.get_mut(&f.file) {
                    file.refs += 1;
                }
            }
            self.process(pid, ts).fds = fds;
        }
    }

    pub(super) fn on_exec(&mut self, pid: u32, ts: u64, command: &[String]) {
        let p = self.process(pid, ts);
        p.command = super::bounded_command(command);
        let closed: Vec<i32> = p.fds.iter().filter(|(_, f)| f.cloexec).map(|(fd, _)| *fd).collect();
        for fd in closed {
            self.close_fd(pid, fd, ts);
        }
    }

    pub(super) fn on_exit(&mut self, pid: u32, ts: u64, code: Option<i32>) {
        self.end_connections_of(pid, ts);
        for fd in self.fds_in_order(pid, ts, |_| true) {
            self.close_fd(pid, fd, ts);
        }
        let p = self.process(pid, ts);
        // Each process's exit counts once towards the next pass (a trace may repeat it).
        let first = p.exited.is_none();
        p.exited = Some(ts);
        if code.is_some() {
            p.exit_code = code;
        }
        if code == Some(0) && first {
            self.exits_since_forgetting = self.exits_since_forgetting.saturating_add(1);
        }
    }

    pub(super) fn on_open(&mut self, pid: u32, ts: u64, fd: i32, file: FileId, device: Device, cloexec: bool) {
        self.claim_file_id(file);
        self.take_fd(pid, ts, fd, file, device, cloexec);
    }

    /// `fd` of `pid` now refers to `file`, opened or found. A file met again after its release
    /// is held anew: a descriptor of it went unseen (passed over a socket after its sender's
    /// last close: its exports, parked at that close, hold their memory again), or the kernel
    /// gave a new file the address a released one had (where the driver is loaded, a device file
    /// is found by that address at its first command, its open unseen; an open's file is always
    /// a new one). Met while still held, its release went unseen (lost records), and the
    /// descriptors that hold it count on.
    fn take_fd(&mut self, pid: u32, ts: u64, fd: i32, file: FileId, device: Device, cloexec: bool) {
        // The number's old file goes first: it may be this very file, released just now.
        self.close_fd(pid, fd, ts);
        let met_again = match self.files.get_mut(&file) {
            Some(f) if f.released.is_none() => {
                f.device = device;
                false
            }
            _ => {
                self.files.insert(file, File { id: file, device, opened_by: pid, refs: 0, released: None });
                true
            }
        };
        self.set_fd(pid, fd, file, cloexec, ts);
        // Only an nvidiactl file the fd now holds (one over the fd limit is not held).
        let held = self.processes.get(&pid).and_then(|p| p.fds.get(&fd)).is_some_and(|f| f.file == file);
        if met_again && device == Device::Ctl && held {
            self.unpark_exports(file, ts);
        } else if met_again {
            // Another file at a parked one's address: that one was released for good (no file
            // in flight keeps the address a live one has), and its exports are nobody's.
            self.parked_exports.remove(&file);
        }
    }

    pub(super) fn on_fd_found(&mut self, pid: u32, ts: u64, fd: i32, file: FileId, device: Device) {
        self.claim_file_id(file);
        let already = self.processes.get(&pid).and_then(|p| p.fds.get(&fd)).map(|f| f.file);
        if already != Some(file) {
            self.take_fd(pid, ts, fd, file, device, false);
        }
    }

    pub(super) fn on_dup(&mut self, pid: u32, ts: u64, old_fd: i32, new_fd: i32, cloexec: bool) {
        // dup2 onto itself changes nothing (dup3 refuses it).
        if old_fd == new_fd {
            return;
        }
        if let Some(old) = self.processes.get(&pid).and_then(|p| p.fds.get(&old_fd)).copied() {
            self.set_fd(pid, new_fd, old.file, cloexec, ts);
        }
    }

    /// The process's fds that `keep` selects, in the kernel's order when it closes several
    /// (close_files and close_range walk the table from the lowest up): which of a process's
    /// files goes first decides whether memory mapped through one is freed by the other's
    /// release or outlives its handles ("released, still mapped").
    fn fds_in_order(&mut self, pid: u32, ts: u64, keep: impl Fn(i32) -> bool) -> Vec<i32> {
        let mut fds: Vec<i32> = self.process(pid, ts).fds.keys().copied().filter(|&fd| keep(fd)).collect();
        fds.sort_unstable();
        fds
    }

    pub(super) fn on_close_range(&mut self, pid: u32, ts: u64, first: u32, last: u32, cloexec_only: bool) {
        for fd in self.fds_in_order(pid, ts, |fd| fd >= 0 && (first..=last).contains(&(fd as u32))) {
            if cloexec_only {
                self.set_cloexec(pid, ts, fd, true);
            } else {
                self.close_fd(pid, fd, ts);
            }
        }
    }

    pub(super) fn set_cloexec(&mut self, pid: u32, ts: u64, fd: i32, cloexec: bool) {
        if let Some(f) = self.process(pid, ts).fds.get_mut(&fd) {
            f.cloexec = cloexec;
        }
    }

    pub(super) fn set_fd(&mut self, pid: u32, fd: i32, file: FileId, cloexec: bool, ts: u64) {
        // Reusing a number means the old file lost that reference (dup2 onto an open fd).
        if self.processes.get(&pid).is_some_and(|p| p.fds.contains_key(&fd)) {
            self.close_fd(pid, fd, ts);
        }
        if self.fd_refs >= MAX_FD_REFS {
            self.fd_refs_dropped = self.fd_refs_dropped.saturating_add(1);
            return;
        }
        self.fd_refs += 1;
        self.process(pid, ts).fds.insert(fd, FdRef { file, cloexec });
        if let Some(f) = self.files.get_mut(&file) {
            f.refs += 1;
        }
    }

    pub(super) fn close_fd(&mut self, pid: u32, fd: i32, ts: u64) {
        let Some(fd_ref) = self.processes.get_mut(&pid).and_then(|p| p.fds.remove(&fd)) else {
            return;
        };
        self.fd_refs = self.fd_refs.saturating_sub(1);
        self.drop_file_ref(fd_ref.file, ts);
    }

    /// One reference to an open file gone (a descriptor, or a registered /dev/nvidiaN file): at
    /// the last, the driver releases it.
    fn drop_file_ref(&mut self, id: FileId, ts: u64) {
        let Some(file) = self.files.get_mut(&id) else { return };
        file.refs = file.refs.saturating_sub(1);
        if file.refs == 0 && file.released.is_none() {
            file.released = Some(ts);
            self.release_file(id, ts);
        }
    }

    /// REGISTER_FD: the /dev/nvidiaN file `fd` takes a reference on the nvidiactl file `ctl_fd`
    /// (escape.c keeps it until the nvidiaN file closes): the clients on it outlive its last
    /// descriptor while the device file is open.
    pub(super) fn on_register_fd(&mut self, pid: u32, ts: u64, fd: i32, ctl_fd: i32) {
        let (Some(device), Some(ctl)) = (self.file_of(pid, fd, ts), self.file_of(pid, ctl_fd, ts)) else { return };
        self.register(device, ctl);
    }

    /// `device` registered with `ctl`: it holds `ctl` open, and RM calls through it act as
    /// `ctl`'s. Once only, and never with itself.
    pub(super) fn register(&mut self, device: FileId, ctl: FileId) {
        if device == ctl || self.registered.contains_key(&device) {
            return;
        }
        if let Some(file) = self.files.get_mut(&ctl) {
            file.refs += 1;
            self.registered.insert(device, ctl);
        }
    }

    /// The file RM calls through `file` act as: the nvidiactl file it is registered with, or itself.
    pub(super) fn acting(&self, file: FileId) -> FileId {
        self.registered.get(&file).copied().unwrap_or(file)
    }

    /// The driver's release of an open file: every client created on it, every UVM range in it,
    /// and its hold on the nvidiactl file it was registered with.
    fn release_file(&mut self, file: FileId, ts: u64) {
        if let Some(ctl) = self.registered.remove(&file) {
            self.drop_file_ref(ctl, ts);
        }
        // The kernel's client of an export goes with the file (rm_cleanup_file_private).
        if let Some(slots) = self.exports.remove(&file) {
            for &id in slots.values() {
                self.drop_handle(id, ts, FreedBy::FileRelease);
            }
            if self.files.get(&file).is_some_and(|f| f.device == Device::Ctl) {
                self.park_exports(file, ts, slots);
            }
        }
        // In a fixed order: the same trace reads the same every time.
        let mut clients: Vec<u32> = self.clients.iter().filter(|(_, c)| c.file == Some(file)).map(|(h, _)| *h).collect();
        clients.sort_unstable();
        for client in clients {
            self.free_client(client, ts, FreedBy::FileRelease);
        }
        self.unmap(ts, FreedBy::FileRelease, file, 0, u64::MAX);
        let mut ranges: Vec<(FileId, u64)> = self.uvm_ranges.keys().filter(|(f, _)| *f == file).copied().collect();
        ranges.sort_unstable();
        for key in ranges {
            if let Some(id) = self.uvm_ranges.remove(&key) {
                self.release(id, ts, FreedBy::FileRelease);
            }
        }
    }

    /// Keeps what a released nvidiactl file's exports still refer to, for the file met again
    /// soon (see `parked_exports`); those past their time or whose memory is gone are dropped as
    /// the parked files double.
    pub(super) fn park_exports(&mut self, file: FileId, ts: u64, mut slots: BTreeMap<u16, AllocId>) {
        let allocations = &self.allocations;
        let live = |id: &AllocId| allocations[*id].is_live();
        slots.retain(|_, id| live(id));
        if slots.is_empty() {
            return;
        }
        self.parked_exports.insert(file, (ts, slots));
        if self.parked_exports.len() > self.parked_limit {
            self.parked_exports.retain(|_, (at, slots)| ts.saturating_sub(*at) <= super::IN_FLIGHT_NS && slots.values().any(live));
            self.parked_limit = (2 * self.parked_exports.len()).max(64);
        }
    }

    /// A released nvidiactl file met again soon after, holding what it was exported: it was in
    /// flight, never released. Its exports hold their memory again until its last close.
    fn unpark_exports(&mut self, file: FileId, ts: u64) {
        let Some((at, slots)) = self.parked_exports.remove(&file) else { return };
        if ts.saturating_sub(at) > super::IN_FLIGHT_NS {
            return;
        }
        let slots: BTreeMap<u16, AllocId> = slots.into_iter().filter(|(_, id)| self.allocations[*id].is_live()).collect();
        for id in slots.values() {
            *self.handle_refs.entry(*id).or_default() += 1;
        }
        if !slots.is_empty() {
            self.exports.insert(file, slots);
        }
    }

    /// A snapshot names the files it synthesised earlier: new ones are numbered past them.
    fn claim_file_id(&mut self, file: FileId) {
        if file >= super::ORPHAN_FILE_BASE {
            self.next_orphan_file = self.next_orphan_file.max(file.saturating_add(1));
        }
    }

    /// The file an fd of `pid` refers to; an NVIDIA fd never seen opened gets a file of its own.
    pub(super) fn file_of(&mut self, pid: u32, fd: i32, ts: u64) -> Option<FileId> {
        if let Some(f) = self.processes.get(&pid).and_then(|p| p.fds.get(&fd)) {
            return Some(f.file);
        }
        if fd < 0 {
            return None;
        }
        let id = self.next_orphan_file;
        self.next_orphan_file += 1;
        self.files.insert(id, File { id, device: Device::Ctl, opened_by: pid, refs: 0, released: None });
        self.set_fd(pid, fd, id, false, ts);
        Some(id)
    }
}

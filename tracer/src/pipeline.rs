//! Ring buffer records to trace records: parse each, decode its ioctl for the driver's layout and
//! give every fd its file (see [`crate::files`]). The one way in from the kernel, and the only
//! place where decoding and the files meet.

use tracer_common::ioctl_flag;

use crate::abi::Layout;
use crate::decode::{decode_ioctl, parse_record, request_line, response_part, Raw, RawIoctl, RawKind};
use crate::event::{Device, Event, Record, Seen};
use crate::files::{FileTable, KernelUpdate, Resolver};

const O_CLOEXEC: i32 = 0o2000000;

pub struct Pipeline<R: Resolver> {
    layout: Layout,
    pub files: FileTable<R>,
    /// Keep the params bytes of each ioctl in its record (`record --raw`).
    raw: bool,
    /// The recorder's own pid: a process it forks is the command it launched.
    launcher: Option<u32>,
    /// Ring buffer records that could not be parsed.
    pub unparsed: u64,
}

impl<R: Resolver> Pipeline<R> {
    pub fn new(layout: Layout, resolver: R, raw: bool, launcher: Option<u32>) -> Self {
        Pipeline { layout, files: FileTable::new(resolver), raw, launcher, unparsed: 0 }
    }

    /// One ring buffer record: its trace records into `out`, the answers the kernel needs into
    /// `updates`; one that cannot be parsed is counted.
    pub fn take(&mut self, bytes: &[u8], out: &mut Vec<Record>, updates: &mut Vec<KernelUpdate>) {
        match parse_record(bytes) {
            Ok(raw) => self.handle(raw, out, updates),
            Err(_) => self.unparsed += 1,
        }
    }

    fn handle(&mut self, raw: Raw, out: &mut Vec<Record>, updates: &mut Vec<KernelUpdate>) {
        let before = out.len();
        self.decode(raw, out, updates);
        // With --all (and so in a watch) the kernel sends gputrace's own calls too (its NVML
        // samples, its sockets): answered, never recorded. What it launches is recorded.
        if let Some(me) = self.launcher {
            let new = out.split_off(before);
            out.extend(new.into_iter().filter(|r| r.pid != me));
        }
    }

    fn decode(&mut self, raw: Raw, out: &mut Vec<Record>, updates: &mut Vec<KernelUpdate>) {
        let Raw { ts, pid, tid, kind } = raw;
        let mut push = |pid: u32, event: Event, raw_bytes: Option<String>| out.push(Record { ts, pid, tid, event, raw: raw_bytes });
        match kind {
            RawKind::Ioctl(ioctl) => self.ioctl((ts, pid, tid), ioctl, out, updates),
            RawKind::Open { fd, flags, device: Some(device), file, .. } => {
                push(pid, self.files.opened(pid, fd, device, flags & O_CLOEXEC != 0, file), None)
            }
            RawKind::Open { device: None, .. } => {}
            RawKind::Close { fd, inheriting } => {
                if let Some(event) = self.files.closed(pid, fd, inheriting, updates) {
                    push(pid, event, None);
                }
            }
            RawKind::Dup { old_fd, new_fd, cloexec } => {
                if let Some(event) = self.files.duplicated(pid, old_fd, new_fd, cloexec) {
                    push(pid, event, None);
                }
            }
            RawKind::CloseRange { first, last, flags } => push(pid, self.files.close_range(pid, first, last, flags, updates), None),
            RawKind::SetCloexec { fd, cloexec } => {
                if let Some(event) = self.files.set_cloexec(pid, fd, cloexec) {
                    push(pid, event, None);
                }
            }
            RawKind::Fork { child } => {
                let seen = if Some(pid) == self.launcher { Seen::Launched } else { Seen::Forked };
                push(child, self.files.forked(pid, child, seen, updates), None);
                // The recorder's own place is not the launched command's parent's to compare with.
                let parent = (seen == Seen::Forked).then_some(pid);
                if let Some(place) = self.files.place_if_new(child, parent) {
                    push(child, Event::Place(place), None);
                }
            }
            RawKind::Exec { filename, argv, argv_whole } => {
                push(pid, self.files.exec(pid, &filename, argv, argv_whole, updates), None);
                if let Some(place) = self.files.place_if_new(pid, None) {
                    push(pid, Event::Place(place), None);
                }
            }
            RawKind::Exit { status } => {
                self.files.exited(pid, updates);
                push(pid, Event::Exit { code: status.map(exit_code) }, None);
            }
            RawKind::Bind { fd, port } => push(pid, Event::Bind { fd, port }, None),
            RawKind::Listen { fd } if self.files.is_unix_socket(pid, fd) => {}
            RawKind::Listen { fd } => push(pid, Event::Listen { fd }, None),
            RawKind::Accept { fd } => push(pid, self.files.accepted(pid, fd), None),
            RawKind::ConnClose { fd } => {
                if let Some(event) = self.files.conn_closed(pid, fd) {
                    push(pid, event, None);
                }
            }
            RawKind::SockIo { fd, inbound, len, head } => {
                let Some(conn) = self.files.conn(pid, fd) else { return };
                let bytes = len.max(0) as u64;
                let event = if inbound {
                    Event::Received { conn, bytes, request: request_line(&head) }
                } else {
                    let (status, data) = response_part(&head, len);
                    Event::Sent { conn, bytes, status, data }
                };
                push(pid, event, None)
            }
            RawKind::OomVictim { victim } => push(victim, Event::OomKill, None),
        }
    }

    /// A driver call: on a fd known (or now found) to be NVIDIA's, its event, after the file
    /// an export or import names where only the kernel knew it.
    fn ioctl(&mut self, (ts, pid, tid): (u64, u32, u32), ioctl: RawIoctl, out: &mut Vec<Record>, updates: &mut Vec<KernelUpdate>) {
        let mut push = |pid: u32, event: Event, raw_bytes: Option<String>| out.push(Record { ts, pid, tid, event, raw: raw_bytes });
        let device = match ioctl.device {
            Some(device) if self.files.knows_nvidia(pid, ioctl.fd) => Some(device),
            Some(device) if ioctl.flags & ioctl_flag::BY_NUMBER != 0 => {
                let cloexec = ioctl.flags & ioctl_flag::CLOEXEC != 0;
                for found in self.files.found(pid, ioctl.fd, device, ioctl.file, cloexec) {
                    push(pid, found, None);
                }
                Some(device)
            }
            // Asked, or the kernel still holding an entry userspace has dropped: an exec
            // closed the fd and the program reused its number (a received fd, say) before
            // the kernel heard of the exec. Asked afresh either way. A call the kernel sends
            // as NVIDIA's on its own word (a device it found by number whose first record was
            // not sent) is checked in /proc too, not settled by an older answer for the number.
            kernel => {
                let asked = ioctl.flags & ioctl_flag::QUESTION != 0 || kernel.is_some();
                let cloexec = ioctl.flags & ioctl_flag::CLOEXEC != 0;
                let (device, found) = self.files.answer(pid, (ioctl.fd, asked, cloexec), ioctl.file, updates);
                for found in found {
                    push(pid, found, None);
                }
                if device.is_none() && ioctl.flags & ioctl_flag::PENDING != 0 {
                    self.files.pending_dropped += 1;
                }
                // Gone by now (not refused as not NVIDIA): the kernel's word stands.
                device.or_else(|| kernel.filter(|_| !self.files.knows_not_nvidia(pid, ioctl.fd)))
            }
        };
        let Some(device) = device else { return };
        let ioctl = RawIoctl { device: Some(device), ..ioctl };
        if let Some(event) = decode_ioctl(&self.layout, &ioctl) {
            // The file an export or import names may be known only by the kernel's word.
            let named = match event {
                Event::ExportObject { to_fd: fd, status: 0, .. }
                | Event::ImportObject { from_fd: fd, status: 0, .. }
                | Event::ExportObjects { to_fd: fd, status: 0, .. }
                | Event::ImportObjects { from_fd: fd, status: 0, .. } => Some(fd),
                _ => None,
            };
            let cloexec = ioctl.flags & ioctl_flag::NAMED_CLOEXEC != 0;
            for found in named.map(|fd| self.files.named(pid, fd, Device::Ctl, ioctl.named_file, cloexec, updates)).unwrap_or_default() {
                push(pid, found, None);
            }
            let bytes = self.raw.then(|| hex(&ioctl.params, &ioctl.class_params));
            push(pid, event, bytes);
        }
    }
}

fn hex(params: &[u8], class_params: &[u8]) -> String {
    let mut s = String::with_capacity(2 * (params.len() + class_params.len()) + 1);
    for b in params {
        s.push_str(&format!("{b:02x}"));
    }
    if !class_params.is_empty() {
        s.push('|');
        for b in class_params {
            s.push_str(&format!("{b:02x}"));
        }
    }
    s
}

/// A wait status as a shell reports it: the exit status, or 128 + the signal that ended it.
pub fn exit_code(status: i32) -> i32 {
    match status & 0x7f {
        0 => (status >> 8) & 0xff,
        signal => 128 + signal,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn wait_statuses_as_a_shell_reports_them() {
        assert_eq!(super::exit_code(0), 0);
        assert_eq!(super::exit_code(1 << 8), 1);
        assert_eq!(super::exit_code(9), 137, "SIGKILL");
        assert_eq!(super::exit_code(11 | 0x80), 139, "SIGSEGV with a core dump");
    }
}

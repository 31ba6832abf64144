//! The fake NVIDIA driver behind the FUSE files: RM clients and handle trees, memory that is only
//! accounted (so an 80 GiB card and a 16 GiB model are realistic) per GPU, each GPU opened as an
//! RM device by its instance (NV0080's deviceId), UVM ranges, and the driver's own ground truth. Semantics follow the open kernel modules: RM_FREE frees a subtree (a client
//! handle frees the client), freeing an unknown handle is NV_OK, dups are reference counted, and
//! releasing an nvidiactl file frees every client created on it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::abi::{class, esc, get16, get32, get64, put16, put32, put64, status, uvm, Abi};
use crate::fuse::{Caller, Files, IoctlReply};
use crate::truth::{monotonic_ns, DriverLine, DriverOp, Log};

mod rm_escapes;
mod uvm_commands;

pub const CTL_INODE: u64 = 2;
pub const UVM_INODE: u64 = 4;
/// /dev/nvidiaN is inode GPU_INODES + N.
pub const GPU_INODES: u64 = 16;
/// RM_FREE of this handle (no object has it: freeing it is NV_OK) is answered only after half a
/// second: a call that stays in flight while another thread makes its own (`fake-workload
/// collide`).
pub const SLOW_FREE_HANDLE: u32 = 0x5105_0001;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Video,
    System,
    Virtual,
}

impl Kind {
    fn name(self) -> String {
        match self {
            Kind::Video => "video",
            Kind::System => "system",
            Kind::Virtual => "virtual",
        }
        .into()
    }
}

struct Memory {
    /// The process that allocated it, for the fake NVML's per-process figures.
    pid: u32,
    /// The GPU whose video memory it takes (None for system and virtual memory).
    gpu: Option<usize>,
    client: u32,
    object: u32,
    kind: Kind,
    bytes: u64,
    handles: u32,
    /// A sticky fabric object's: the memory it dup'ed (mem_fabric.c), let go when it goes.
    holds: Option<u64>,
    /// A fabric object's attachments by (GPU, offset) (ATTACH_MEM; GPU 0 on a flexible object,
    /// the subdevice's on a multicast one): before 570 RM dups each memory attached, let go at
    /// DETACH_MEM or when the fabric object goes; from 570 they hold nothing and are not kept
    /// here.
    attached: BTreeMap<(usize, u64), u64>,
}

struct Object {
    parent: u32,
    memory: Option<u64>,
    /// A device's GPU, inherited by everything under it.
    gpu: Option<usize>,
}

struct Client {
    file: u64,
    objects: HashMap<u32, Object>,
}

struct OpenFile {
    inode: u64,
    /// The process that opened it.
    opener: u32,
    /// A /dev/nvidiaN file's nvidiactl file (REGISTER_FD), held open until this one goes.
    registered_ctl: Option<u64>,
    uvm_ready: bool,
    /// UVM ranges by base: (length, memory id when the range holds memory of its own).
    ranges: HashMap<u64, (u64, Option<u64>)>,
    /// RM memory mapped into this file's ranges: (base of the mapping, memory id). Each holds a
    /// reference, as uvm_map_external.c's duplicate of the memory object does.
    maps: Vec<(u64, u64)>,
    /// The memory each slot of this nvidiactl file's exports refers to: a reference held by the
    /// kernel's client of the file until its release (rmobjexportimport.c). The single export
    /// takes slot 0 of a file that holds none; a batch fills slots from its index on.
    exports: BTreeMap<u16, u64>,
}

pub struct Config {
    pub version: String,
    /// Each GPU's video memory: /dev/nvidia0, /dev/nvidia1...
    pub gpus: Vec<u64>,
    pub system_capacity: u64,
    /// A unified-memory part (DGX Spark): NVML reports no device memory.
    pub unified: bool,
}

pub struct Driver {
    abi: Abi,
    version: String,
    gpus: Vec<u64>,
    system_capacity: u64,
    /// Video memory in use on each GPU, and system memory.
    video_used: Vec<u64>,
    system_used: u64,
    names: Vec<(&'static str, u64)>,
    files: HashMap<u64, OpenFile>,
    clients: HashMap<u32, Client>,
    memory: HashMap<u64, Memory>,
    next_fh: u64,
    next_client: u32,
    next_object: u32,
    next_memory: u64,
    log: Log,
    tgids: HashMap<u32, u32>,
    open_files: Arc<AtomicUsize>,
    unified: bool,
    /// Where the fake NVML reads the device's figures.
    state_path: Option<std::path::PathBuf>,
    /// nvidiactl files released by the kernel while a registered device file still holds them.
    held_ctl: HashSet<u64>,
}

fn device_name(inode: u64) -> String {
    match inode {
        CTL_INODE => "ctl".into(),
        UVM_INODE => "uvm".into(),
        _ => format!("gpu{}", inode - GPU_INODES),
    }
}

fn read_mem(tid: u32, addr: u64, len: usize) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: len };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len };
    // SAFETY: reads another process's memory into our buffer; the kernel checks the range.
    let n = unsafe { libc::process_vm_readv(tid as libc::pid_t, &local, 1, &remote, 1, 0) };
    (n == len as isize).then_some(buf)
}

fn write_mem(tid: u32, addr: u64, data: &[u8]) -> bool {
    let local = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: data.len() };
    // SAFETY: writes our buffer into another process's memory; the kernel checks the range.
    let n = unsafe { libc::process_vm_writev(tid as libc::pid_t, &local, 1, &remote, 1, 0) };
    n == data.len() as isize
}

const EINVAL: i32 = -libc::EINVAL;
const EFAULT: i32 = -libc::EFAULT;

impl Driver {
    pub fn new(config: &Config, log_path: Option<&Path>) -> std::io::Result<Driver> {
        // Names live as long as the mount: a handful of short strings, leaked once.
        let gpu_names = (0..config.gpus.len()).map(|n| (&*Box::leak(format!("nvidia{n}").into_boxed_str()), GPU_INODES + n as u64));
        Ok(Driver {
            abi: Abi::for_version(&config.version),
            version: config.version.clone(),
            gpus: config.gpus.clone(),
            system_capacity: config.system_capacity,
            video_used: vec![0; config.gpus.len()],
            system_used: 0,
            names: [("nvidiactl", CTL_INODE), ("nvidia-uvm", UVM_INODE)].into_iter().chain(gpu_names).collect(),
            files: HashMap::new(),
            clients: HashMap::new(),
            memory: HashMap::new(),
            next_fh: 1,
            next_client: 0xc1d0_0001,
            next_object: 0xcaf0_0001,
            next_memory: 1,
            log: Log::create(log_path)?,
            tgids: HashMap::new(),
            open_files: Arc::new(AtomicUsize::new(0)),
            unified: config.unified,
            state_path: None,
            held_ctl: HashSet::new(),
        })
    }

    /// Keeps the fake NVML's state file at `path` up to date from now on.
    pub fn publish_state(&mut self, path: &Path) -> std::io::Result<()> {
        self.state_path = Some(path.to_path_buf());
        self.write_state()
    }

    /// Written whole to a temporary file and renamed, so a reader never sees half of it.
    fn write_state(&self) -> std::io::Result<()> {
        let Some(path) = &self.state_path else { return Ok(()) };
        let devices: Vec<serde_json::Value> = self
            .gpus
            .iter()
            .enumerate()
            .map(|(gpu, &total)| {
                let mut per_pid: HashMap<u32, u64> = HashMap::new();
                for m in self.memory.values().filter(|m| m.gpu == Some(gpu)) {
                    *per_pid.entry(m.pid).or_default() += m.bytes;
                }
                let mut processes: Vec<(u32, u64)> = per_pid.into_iter().collect();
                processes.sort();
                let name = if self.unified { "NVIDIA GB10".to_string() } else { format!("NVIDIA H100 {}GB HBM3", total >> 30) };
                serde_json::json!({"name": name, "total": total, "used": self.video_used[gpu], "processes": processes})
            })
            .collect();
        let state = serde_json::json!({"version": self.version, "unified": self.unified, "devices": devices});
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, state.to_string())?;
        std::fs::rename(tmp, path)
    }

    /// Files open now, readable from another thread: the launcher waits for it to reach zero so
    /// the log has every release before it exits.
    pub fn open_files_counter(&self) -> Arc<AtomicUsize> {
        self.open_files.clone()
    }

    fn tgid(&mut self, tid: u32) -> u32 {
        if let Some(&t) = self.tgids.get(&tid) {
            return t;
        }
        let status = std::fs::read_to_string(format!("/proc/{tid}/status")).unwrap_or_default();
        let tgid = status.lines().find_map(|l| l.strip_prefix("Tgid:")).and_then(|v| v.trim().parse().ok()).unwrap_or(tid);
        self.tgids.insert(tid, tgid);
        tgid
    }

    fn record(&mut self, caller: Caller, op: DriverOp) {
        let pid = if caller.tid == 0 { 0 } else { self.tgid(caller.tid) };
        self.log.write(&DriverLine { ts: monotonic_ns(), pid, tid: caller.tid, op });
    }

    /// Room left for `kind` on `gpu` (video memory is per GPU; the host's is shared).
    fn room(&self, kind: Kind, gpu: usize) -> u64 {
        match kind {
            Kind::Video => self.gpus[gpu].saturating_sub(self.video_used[gpu]),
            Kind::System => self.system_capacity.saturating_sub(self.system_used),
            Kind::Virtual => u64::MAX,
        }
    }

    fn account(&mut self, kind: Kind, gpu: usize, bytes: i128) {
        let used = match kind {
            Kind::Video => &mut self.video_used[gpu],
            Kind::System => &mut self.system_used,
            Kind::Virtual => return,
        };
        *used = (*used as i128 + bytes) as u64;
    }

    /// The GPU of `parent` in `client`: the device it is or is under. RM refuses memory outside
    /// a device; the fake puts it on GPU 0.
    fn gpu_under(&self, client: u32, parent: u32) -> usize {
        self.clients.get(&client).and_then(|c| c.objects.get(&parent)).and_then(|o| o.gpu).unwrap_or(0)
    }

    fn new_object_handle(&mut self) -> u32 {
        let h = self.next_object;
        self.next_object += 1;
        h
    }

    /// Allocates accounted memory on `gpu`; None when it does not fit. `rm` is the RM identity
    /// (client, object, class), zeros for UVM.
    fn take(&mut self, caller: Caller, rm: (u32, u32, u32), kind: Kind, gpu: usize, bytes: u64, via: &str) -> Result<u64, u32> {
        let (client, object, class) = rm;
        let fits = bytes <= self.room(kind, gpu);
        let status = if fits { status::OK } else { status::NO_MEMORY };
        let on = (kind == Kind::Video).then_some(gpu);
        self.record(caller, DriverOp::Alloc { client, object, class, kind: kind.name(), bytes, status, via: via.into(), gpu: on });
        if !fits {
            return Err(status::NO_MEMORY);
        }
        self.account(kind, gpu, i128::from(bytes));
        let id = self.next_memory;
        self.next_memory += 1;
        let pid = self.tgid(caller.tid);
        self.memory.insert(id, Memory { pid, gpu: on, client, object, kind, bytes, handles: 1, holds: None, attached: BTreeMap::new() });
        let _ = self.write_state();
        Ok(id)
    }

    fn drop_handle(&mut self, caller: Caller, id: u64, how: &str) {
        let Some(m) = self.memory.get_mut(&id) else { return };
        m.handles -= 1;
        if m.handles > 0 {
            return;
        }
        let m = self.memory.remove(&id).unwrap();
        self.account(m.kind, m.gpu.unwrap_or(0), -i128::from(m.bytes));
        self.record(caller, DriverOp::Free { client: m.client, object: m.object, kind: m.kind.name(), bytes: m.bytes, how: how.into() });
        let _ = self.write_state();
        if let Some(held) = m.holds {
            self.drop_handle(caller, held, how);
        }
        for held in m.attached.into_values() {
            self.drop_handle(caller, held, how);
        }
    }

    fn free_client(&mut self, caller: Caller, client: u32, how: &str) {
        if let Some(c) = self.clients.remove(&client) {
            let mut ids: Vec<u64> = c.objects.values().filter_map(|o| o.memory).collect();
            ids.sort();
            for id in ids {
                self.drop_handle(caller, id, how);
            }
        }
    }

    fn free_subtree(&mut self, caller: Caller, client: u32, handle: u32) {
        let Some(c) = self.clients.get_mut(&client) else { return };
        let mut doomed = HashSet::from([handle]);
        loop {
            let before = doomed.len();
            for (h, o) in &c.objects {
                if doomed.contains(&o.parent) {
                    doomed.insert(*h);
                }
            }
            if doomed.len() == before {
                break;
            }
        }
        let mut freed: Vec<(u32, u64)> =
            doomed.iter().filter_map(|h| c.objects.remove(h).and_then(|o| o.memory.map(|m| (*h, m)))).collect();
        freed.sort();
        for (h, id) in freed {
            self.drop_handle(caller, id, if h == handle { "explicit" } else { "subtree" });
        }
    }

    fn parent_ok(&self, client: u32, parent: u32) -> Result<(), u32> {
        let Some(c) = self.clients.get(&client) else { return Err(status::INVALID_CLIENT) };
        if parent == client || c.objects.contains_key(&parent) {
            Ok(())
        } else {
            Err(status::INVALID_OBJECT_PARENT)
        }
    }

    fn insert_object(&mut self, client: u32, handle: u32, parent: u32, memory: Option<u64>, gpu: Option<usize>) {
        let gpu = gpu.or_else(|| self.clients.get(&client)?.objects.get(&parent)?.gpu);
        if let Some(c) = self.clients.get_mut(&client) {
            c.objects.insert(handle, Object { parent, memory, gpu });
        }
    }

    fn class_params_size(&self, hclass: u32) -> usize {
        match hclass {
            class::LOCAL_USER | class::SYSTEM | class::NV50_MEMORY_VIRTUAL | class::EXTENDED_USER => self.abi.memory_params_size,
            class::MULTICAST_FABRIC => self.abi.multicast_params.0,
            class::DEVICE => 56,
            class::VASPACE => {
                if self.abi.major >= 580 {
                    56
                } else {
                    48
                }
            }
            class::CHANNEL_GROUP => 20,
            class::MEMORY_FABRIC => 48,
            _ => 0,
        }
    }
}

impl Files for Driver {
    fn names(&self) -> &[(&'static str, u64)] {
        &self.names
    }

    fn open(&mut self, caller: Caller, inode: u64) -> u64 {
        let fh = self.next_fh;
        self.next_fh += 1;
        let opener = self.tgid(caller.tid);
        self.files.insert(
            fh,
            OpenFile {
                inode,
                opener,
                registered_ctl: None,
                uvm_ready: false,
                ranges: HashMap::new(),
                maps: Vec::new(),
                exports: BTreeMap::new(),
            },
        );
        self.open_files.fetch_add(1, Ordering::SeqCst);
        self.record(caller, DriverOp::Open { device: device_name(inode), handle: fh });
        fh
    }

    fn ioctl(&mut self, caller: Caller, fh: u64, cmd: u32, arg: u64, input: &[u8], _out_size: u32) -> IoctlReply {
        let Some(inode) = self.files.get(&fh).map(|f| f.inode) else { return IoctlReply { result: EINVAL, out: vec![] } };
        if inode == UVM_INODE {
            return IoctlReply { result: self.uvm_ioctl(caller, fh, cmd, arg), out: vec![] };
        }
        // The driver decodes only _IOC_NR and _IOC_SIZE.
        let (nr, size) = (cmd & 0xff, ((cmd >> 16) & 0x3fff) as usize);
        if input.len() != size {
            return IoctlReply { result: EINVAL, out: vec![] };
        }
        let mut p = input.to_vec();
        if nr == esc::XFER && size == 16 {
            let (inner_nr, inner_size, ptr) = (get32(&p, 0), get32(&p, 4) as usize, get64(&p, 8));
            let Some(mut inner) = read_mem(caller.tid, ptr, inner_size) else { return IoctlReply { result: EFAULT, out: vec![] } };
            if let Err(errno) = self.rm_escape(caller, fh, inode, inner_nr, &mut inner) {
                return IoctlReply { result: errno, out: vec![] };
            }
            let result = if write_mem(caller.tid, ptr, &inner) { 0 } else { EFAULT };
            return IoctlReply { result, out: p };
        }
        match self.rm_escape(caller, fh, inode, nr, &mut p) {
            Ok(()) => IoctlReply { result: 0, out: p },
            Err(errno) => IoctlReply { result: errno, out: vec![] },
        }
    }

    fn release(&mut self, caller: Caller, fh: u64) {
        let Some(file) = self.files.remove(&fh) else { return };
        self.open_files.fetch_sub(1, Ordering::SeqCst);
        self.record(caller, DriverOp::Release { device: device_name(file.inode), handle: fh });
        // An nvidiactl file a device file still holds (REGISTER_FD) keeps its clients until then.
        if self.files.values().any(|f| f.registered_ctl == Some(fh)) {
            self.held_ctl.insert(fh);
            return;
        }
        self.free_clients_of(caller, fh);
        if let Some(ctl) = file.registered_ctl.filter(|ctl| !self.files.values().any(|f| f.registered_ctl == Some(*ctl))) {
            if self.held_ctl.remove(&ctl) {
                self.free_clients_of(caller, ctl);
            }
        }
        let mut ids: Vec<u64> = file
            .ranges
            .values()
            .filter_map(|(_, m)| *m)
            .chain(file.maps.iter().map(|(_, id)| *id))
            .chain(file.exports.values().copied())
            .collect();
        ids.sort();
        for id in ids {
            self.drop_handle(caller, id, "release");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::rm_cmd;
    use crate::truth::read_lines;

    const GIB: u64 = 1 << 30;

    fn me() -> Caller {
        // SAFETY: gettid has no preconditions.
        Caller { tid: unsafe { libc::gettid() } as u32, uid: 0 }
    }

    struct Rig {
        driver: Driver,
        log: std::path::PathBuf,
        abi: Abi,
        ctl: u64,
    }

    impl Rig {
        fn new(version: &str, video: u64) -> Rig {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = N.fetch_add(1, Ordering::SeqCst);
            let log = std::env::temp_dir().join(format!("fakegpu-driver-test-{}-{n}.jsonl", std::process::id()));
            let config = Config { version: version.into(), gpus: vec![video, GIB], system_capacity: 4 * GIB, unified: false };
            let mut driver = Driver::new(&config, Some(&log)).unwrap();
            let ctl = driver.open(me(), CTL_INODE);
            Rig { driver, log, abi: Abi::for_version(version), ctl }
        }

        /// An RM escape on `fh`: returns ioctl's result and leaves the driver's answer in `p`.
        fn rm(&mut self, fh: u64, nr: u32, p: &mut [u8]) -> i32 {
            let input = p.to_vec();
            let reply = self.driver.ioctl(me(), fh, rm_cmd(nr, p.len()), p.as_mut_ptr() as u64, &input, p.len() as u32);
            if reply.result == 0 {
                p.copy_from_slice(&reply.out);
            }
            reply.result
        }

        /// RM_ALLOC in the version's NVOS64 form; returns (handle, status).
        fn alloc(&mut self, client: u32, parent: u32, hclass: u32, bytes: u64) -> (u32, u32) {
            let mut params = vec![0u8; self.abi.memory_params_size.max(56)];
            put64(&mut params, 64, bytes);
            self.alloc_with(client, parent, hclass, &mut params)
        }

        /// A device of GPU `instance` (NV0080's deviceId); returns (handle, status).
        fn device(&mut self, client: u32, instance: u32) -> (u32, u32) {
            let mut params = vec![0u8; 56];
            put32(&mut params, 0, instance);
            self.alloc_with(client, client, class::DEVICE, &mut params)
        }

        fn alloc_with(&mut self, client: u32, parent: u32, hclass: u32, params: &mut [u8]) -> (u32, u32) {
            let mut p = vec![0u8; self.abi.nvos64_size];
            put32(&mut p, 0, client);
            put32(&mut p, 4, parent);
            put32(&mut p, 12, hclass);
            put64(&mut p, 16, params.as_mut_ptr() as u64);
            assert_eq!(self.rm(self.ctl, esc::RM_ALLOC, &mut p), 0);
            (get32(&p, 8), get32(&p, self.abi.nvos64_status))
        }

        fn client(&mut self) -> u32 {
            let mut p = vec![0u8; 32];
            put32(&mut p, 12, class::ROOT_CLIENT);
            assert_eq!(self.rm(self.ctl, esc::RM_ALLOC, &mut p), 0);
            assert_eq!(get32(&p, self.abi.nvos21_status), status::OK);
            get32(&p, 8)
        }

        fn free(&mut self, client: u32, handle: u32) -> u32 {
            let mut p = vec![0u8; 16];
            put32(&mut p, 0, client);
            put32(&mut p, 8, handle);
            assert_eq!(self.rm(self.ctl, esc::RM_FREE, &mut p), 0);
            get32(&p, 12)
        }

        /// The driver's own account of each freed memory object: (object, how).
        fn frees(&self) -> Vec<(u32, String)> {
            read_lines::<DriverLine>(&self.log)
                .unwrap()
                .into_iter()
                .filter_map(|l| match l.op {
                    DriverOp::Free { object, how, .. } => Some((object, how)),
                    _ => None,
                })
                .collect()
        }
    }

    impl Drop for Rig {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.log);
        }
    }

    #[test]
    fn freeing_a_device_frees_its_subtree_and_a_client_handle_frees_the_client() {
        let mut rig = Rig::new("580.95.05", 80 * GIB);
        let client = rig.client();
        let (device, _) = rig.alloc(client, client, class::DEVICE, 0);
        let (subdevice, _) = rig.alloc(client, device, class::SUBDEVICE, 0);
        let (a, status) = rig.alloc(client, subdevice, class::LOCAL_USER, GIB);
        assert_eq!(status, status::OK);
        let (b, _) = rig.alloc(client, device, class::LOCAL_USER, 2 * GIB);
        assert_eq!(rig.driver.video_used[0], 3 * GIB);
        assert_eq!(rig.free(client, subdevice), status::OK);
        assert_eq!(rig.frees(), vec![(a, "subtree".into())]);
        assert_eq!(rig.free(client, client), status::OK);
        assert_eq!(rig.frees(), vec![(a, "subtree".into()), (b, "subtree".into())]);
        assert_eq!(rig.driver.video_used[0], 0);
        // Freeing what does not exist is NV_OK, as RS_COMPATABILITY_MODE makes it.
        assert_eq!(rig.free(client, 0xdead), status::OK);
    }

    #[test]
    fn a_dup_holds_the_memory_until_its_last_handle() {
        let mut rig = Rig::new("580.95.05", 80 * GIB);
        let client = rig.client();
        let (device, _) = rig.alloc(client, client, class::DEVICE, 0);
        let (memory, _) = rig.alloc(client, device, class::LOCAL_USER, GIB);
        let mut p = vec![0u8; 28];
        put32(&mut p, 0, client);
        put32(&mut p, 4, device);
        put32(&mut p, 12, client);
        put32(&mut p, 16, memory);
        assert_eq!(rig.rm(rig.ctl, esc::RM_DUP_OBJECT, &mut p), 0);
        assert_eq!(get32(&p, 24), status::OK);
        let alias = get32(&p, 8);
        rig.free(client, memory);
        assert_eq!(rig.driver.video_used[0], GIB, "the dup still holds it");
        rig.free(client, alias);
        assert_eq!(rig.driver.video_used[0], 0);
        assert_eq!(rig.frees(), vec![(memory, "explicit".into())]);
    }

    #[test]
    fn releasing_the_file_frees_every_client_on_it() {
        let mut rig = Rig::new("580.95.05", 80 * GIB);
        let (c1, c2) = (rig.client(), rig.client());
        let (d1, _) = rig.alloc(c1, c1, class::DEVICE, 0);
        let (d2, _) = rig.alloc(c2, c2, class::DEVICE, 0);
        let (m1, _) = rig.alloc(c1, d1, class::LOCAL_USER, GIB);
        let (m2, _) = rig.alloc(c2, d2, class::SYSTEM, GIB);
        let other = rig.driver.open(me(), CTL_INODE);
        assert_eq!(rig.driver.open_files_counter().load(Ordering::SeqCst), 2);
        rig.driver.release(me(), rig.ctl);
        assert_eq!(rig.frees(), vec![(m1, "release".into()), (m2, "release".into())]);
        assert_eq!(rig.driver.open_files_counter().load(Ordering::SeqCst), 1);
        rig.driver.release(me(), other);
    }

    #[test]
    fn an_allocation_past_capacity_fails_with_no_memory() {
        let mut rig = Rig::new("580.95.05", 4 * GIB);
        let client = rig.client();
        let (device, _) = rig.alloc(client, client, class::DEVICE, 0);
        assert_eq!(rig.alloc(client, device, class::LOCAL_USER, 3 * GIB).1, status::OK);
        assert_eq!(rig.alloc(client, device, class::LOCAL_USER, 2 * GIB).1, status::NO_MEMORY);
        assert_eq!(rig.driver.video_used[0], 3 * GIB, "a failed allocation takes nothing");
        assert_eq!(rig.alloc(client, 0xbad, class::LOCAL_USER, 1).1, status::INVALID_OBJECT_PARENT);
        assert_eq!(rig.alloc(0xbad, 0xbad, class::LOCAL_USER, 1).1, status::INVALID_CLIENT);
    }

    /// Each GPU has its own video memory, chosen by the device's instance; the host's is shared.
    #[test]
    fn each_gpu_is_a_device_instance_with_its_own_memory() {
        let mut rig = Rig::new("580.95.05", 8 * GIB);
        let client = rig.client();
        let ((gpu0, _), (gpu1, _)) = (rig.device(client, 0), rig.device(client, 1));
        let (subdevice1, _) = rig.alloc(client, gpu1, class::SUBDEVICE, 0);
        assert_eq!(rig.alloc(client, subdevice1, class::LOCAL_USER, 2 * GIB).1, status::NO_MEMORY, "GPU 1 has 1 GiB");
        assert_eq!(rig.alloc(client, gpu0, class::LOCAL_USER, 2 * GIB).1, status::OK, "GPU 0 has 8 GiB");
        assert_eq!(rig.alloc(client, subdevice1, class::LOCAL_USER, GIB).1, status::OK);
        assert_eq!(rig.driver.video_used, vec![2 * GIB, GIB]);
        assert_eq!(rig.device(client, 2).1, status::INVALID_ARGUMENT, "there is no third GPU");
        let gpus: Vec<Option<usize>> = read_lines::<DriverLine>(&rig.log)
            .unwrap()
            .into_iter()
            .filter_map(|l| match l.op {
                DriverOp::Alloc { gpu, .. } => Some(gpu),
                _ => None,
            })
            .collect();
        assert_eq!(gpus, vec![Some(1), Some(0), Some(1)], "the log says which GPU each allocation asked of");
    }

    /// A sticky fabric object holds the memory it is made over: freeing the memory's handle
    /// leaves it allocated until the fabric object is freed; a FLEXIBLE one holds nothing.
    #[test]
    fn a_sticky_fabric_object_keeps_its_memory() {
        let mut rig = Rig::new("580.95.05", 8 * GIB);
        let client = rig.client();
        let (device, _) = rig.alloc(client, client, class::DEVICE, 0);
        for flexible in [false, true] {
            let (memory, _) = rig.alloc(client, device, class::LOCAL_USER, GIB);
            let mut params = [0u8; 48];
            put64(&mut params, 8, 2 << 20);
            put32(&mut params, 24, u32::from(flexible));
            put32(&mut params, 40, memory);
            let (fabric, status) = rig.alloc_with(client, device, class::MEMORY_FABRIC, &mut params);
            assert_eq!(status, status::OK);
            assert_eq!(rig.free(client, memory), status::OK);
            assert_eq!(rig.driver.video_used[0], if flexible { 0 } else { GIB }, "flexible={flexible}");
            assert_eq!(rig.free(client, fabric), status::OK);
            assert_eq!(rig.driver.video_used[0], 0, "gone with the fabric object");
        }
    }

    /// An object exported to a file is held by that file: freeing every handle (the original
    /// and an import's) leaves the memory until the export file is released.
    #[test]
    fn an_exported_object_lives_until_its_file_is_released() {
        let mut rig = Rig::new("580.95.05", 8 * GIB);
        let client = rig.client();
        let (device, _) = rig.alloc(client, client, class::DEVICE, 0);
        let (memory, _) = rig.alloc(client, device, class::LOCAL_USER, GIB);
        let share = rig.driver.open(me(), CTL_INODE);
        let control = |rig: &mut Rig, cmd: u32, params: &mut [u8]| {
            let mut p = vec![0u8; 32];
            put32(&mut p, 0, client);
            put32(&mut p, 4, client);
            put32(&mut p, 8, cmd);
            put64(&mut p, 16, params.as_mut_ptr() as u64);
            put32(&mut p, 24, params.len() as u32);
            assert_eq!(rig.rm(rig.ctl, esc::RM_CONTROL, &mut p), 0);
            get32(&p, 28)
        };
        let mut export = [0u8; 24];
        put32(&mut export, 0, 1);
        put32(&mut export, 12, memory);
        assert_eq!(control(&mut rig, 0x3d05, &mut export), status::OK);
        assert_eq!(control(&mut rig, 0x3d05, &mut export), status::INVALID_ARGUMENT, "a file holds one export");
        let mut import = [0u8; 20];
        put32(&mut import, 4, 1);
        put32(&mut import, 12, device);
        assert_eq!(control(&mut rig, 0x3d06, &mut import), status::OK);
        let imported = get32(&import, 16);
        assert_ne!(imported, 0, "the new handle is written back");
        assert_eq!(rig.free(client, memory), status::OK);
        assert_eq!(rig.free(client, imported), status::OK);
        assert_eq!(rig.driver.video_used[0], GIB, "the export file still holds it");
        rig.driver.release(me(), share);
        assert_eq!(rig.driver.video_used[0], 0, "gone with the export file");
        assert!(rig.frees().contains(&(memory, "release".into())));
    }

    /// A UVM mapping holds the memory it maps: RM_FREE of the handle leaves it allocated until
    /// UVM_FREE of the range (as uvm_map_external.c's duplicate of the memory object does).
    #[test]
    fn a_uvm_mapping_keeps_memory_after_its_handle_is_freed() {
        let mut rig = Rig::new("580.95.05", 8 * GIB);
        let client = rig.client();
        let (device, _) = rig.alloc(client, client, class::DEVICE, 0);
        let (memory, _) = rig.alloc(client, device, class::LOCAL_USER, GIB);
        let uvm = rig.driver.open(me(), UVM_INODE);
        let call =
            |rig: &mut Rig, cmd: u32, p: &mut [u8]| assert_eq!(rig.driver.ioctl(me(), uvm, cmd, p.as_mut_ptr() as u64, &[], 0).result, 0);
        call(&mut rig, uvm::INITIALIZE, &mut [0u8; 16]);
        let mut range = [0u8; 24];
        put64(&mut range, 0, 0x7f00_0000_0000);
        put64(&mut range, 8, GIB);
        call(&mut rig, uvm::CREATE_EXTERNAL_RANGE, &mut range);
        let size = rig.abi.uvm_map_external_size;
        let mut map = vec![0u8; size];
        put64(&mut map, 0, 0x7f00_0000_0000);
        put64(&mut map, 8, GIB);
        put32(&mut map, size - 12, client);
        put32(&mut map, size - 8, memory);
        call(&mut rig, uvm::MAP_EXTERNAL_ALLOCATION, &mut map);
        assert_eq!(get32(&map, size - 4), status::OK);
        assert_eq!(rig.free(client, memory), status::OK);
        assert_eq!(rig.driver.video_used[0], GIB, "still mapped");
        let mut free = vec![0u8; rig.abi.uvm_free_size];
        put64(&mut free, 0, 0x7f00_0000_0000);
        call(&mut rig, uvm::FREE, &mut free);
        assert_eq!(rig.driver.video_used[0], 0, "gone with its range");
        assert!(rig.frees().contains(&(memory, "unmapped".into())));
        rig.driver.release(me(), uvm);
    }

    /// REGISTER_FD: the device file holds the nvidiactl file, and its clients' memory, until it is
    /// released too.
    #[test]
    fn a_registered_device_file_keeps_the_control_file() {
        let mut rig = Rig::new("580.95.05", 8 * GIB);
        let client = rig.client();
        let (device, _) = rig.alloc(client, client, class::DEVICE, 0);
        rig.alloc(client, device, class::LOCAL_USER, GIB);
        let gpu = rig.driver.open(me(), GPU_INODES);
        let mut fd = 3u32.to_le_bytes();
        assert_eq!(rig.rm(gpu, esc::REGISTER_FD, &mut fd), 0);
        rig.driver.release(me(), rig.ctl);
        assert_eq!(rig.driver.video_used[0], GIB, "held by the registered device file");
        rig.driver.release(me(), gpu);
        assert_eq!(rig.driver.video_used[0], 0, "released with it");
    }

    /// Every presented version writes status where that version's layout has it.
    #[test]
    fn every_version_answers_in_its_own_layout() {
        for version in crate::abi::VERSIONS {
            let mut rig = Rig::new(version, 80 * GIB);
            let abi = rig.abi;
            let mut p = vec![0u8; 32];
            put32(&mut p, 12, class::DEVICE);
            put32(&mut p, 0, 0xbad);
            assert_eq!(rig.rm(rig.ctl, esc::RM_ALLOC, &mut p), 0);
            assert_eq!(get32(&p, abi.nvos21_status), status::INVALID_CLIENT, "{version}: NVOS21 status");
            let client = rig.client();
            let (device, status) = rig.alloc(client, client, class::DEVICE, 0);
            assert_eq!(status, status::OK, "{version}");
            assert_ne!(device, 0);
            // An NVOS64 of the other era's size is refused as the driver refuses a size mismatch.
            let wrong = if abi.nvos64_size == 48 { 40 } else { 48 };
            let mut p = vec![0u8; wrong];
            assert_eq!(rig.rm(rig.ctl, esc::RM_ALLOC, &mut p), -libc::EINVAL, "{version}");
            let mut q = [0u8; 72];
            assert_eq!(rig.rm(rig.ctl, esc::CHECK_VERSION_STR, &mut q), 0);
            assert_eq!(&q[8..8 + version.len()], version.as_bytes());
        }
    }

    #[test]
    fn escapes_go_only_to_the_files_that_accept_them() {
        let mut rig = Rig::new("580.95.05", 80 * GIB);
        let mut p = vec![0u8; 56];
        assert_eq!(rig.rm(rig.ctl, esc::RM_ALLOC_MEMORY, &mut p), -libc::EINVAL, "RM_ALLOC_MEMORY is for /dev/nvidiaN");
        let gpu = rig.driver.open(me(), GPU_INODES);
        let mut free = vec![0u8; 16];
        assert_eq!(rig.rm(gpu, esc::RM_FREE, &mut free), -libc::EINVAL, "RM_FREE is for /dev/nvidiactl");
    }

    #[test]
    fn uvm_needs_initialize_and_follows_its_ranges() {
        let mut rig = Rig::new("590.44.01", 80 * GIB);
        let uvm = rig.driver.open(me(), UVM_INODE);
        let call = |rig: &mut Rig, cmd: u32, p: &mut [u8]| rig.driver.ioctl(me(), uvm, cmd, p.as_mut_ptr() as u64, &[], 0).result;
        let mut range = [0u8; 24];
        put64(&mut range, 0, 0x7000_0000);
        put64(&mut range, 8, GIB);
        assert_eq!(call(&mut rig, uvm::CREATE_EXTERNAL_RANGE, &mut range), 0);
        assert_eq!(get32(&range, 16), status::ILLEGAL_ACTION, "before UVM_INITIALIZE");
        let mut init = [0u8; 16];
        assert_eq!(call(&mut rig, uvm::INITIALIZE, &mut init), 0);
        assert_eq!(call(&mut rig, uvm::CREATE_EXTERNAL_RANGE, &mut range), 0);
        assert_eq!(get32(&range, 16), status::OK);
        assert_eq!(call(&mut rig, uvm::CREATE_EXTERNAL_RANGE, &mut range), 0);
        assert_eq!(get32(&range, 16), status::UVM_ADDRESS_IN_USE);
        let mut pool = vec![0u8; rig.abi.uvm_semaphore_pool_size];
        put64(&mut pool, 0, 0x9000_0000);
        put64(&mut pool, 8, 1 << 20);
        assert_eq!(call(&mut rig, uvm::ALLOC_SEMAPHORE_POOL, &mut pool), 0);
        let status_at = pool.len() - 8;
        assert_eq!(get32(&pool, status_at), status::OK);
        // 590: UVM_FREE is 16 bytes, rmStatus @8.
        let mut free = [0u8; 16];
        put64(&mut free, 0, 0x7000_0000);
        assert_eq!(call(&mut rig, uvm::FREE, &mut free), 0);
        assert_eq!(get32(&free, 8), status::OK);
        rig.driver.release(me(), uvm);
        let kinds: Vec<String> = read_lines::<DriverLine>(&rig.log)
            .unwrap()
            .into_iter()
            .filter_map(|l| match l.op {
                DriverOp::Free { kind, how, .. } => Some(format!("{kind}/{how}")),
                _ => None,
            })
            .collect();
        assert_eq!(kinds, vec!["virtual/explicit", "system/release"]);
    }
}

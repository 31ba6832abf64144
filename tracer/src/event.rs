//! Typed events: what decode produces, what the trace stores (one per record) and what the model
//! consumes. Nothing here knows about BPF records or byte offsets.

use serde::{Deserialize, Serialize};

mod tagged;

/// One event, where and when it happened. `ts` is CLOCK_MONOTONIC in nanoseconds, the clock of
/// bpf_ktime_get_ns; the trace header maps it to wall-clock time. Serialised as a trace line
/// (`tagged`): `tid` when not 0, the event's name under `ev` followed by its fields, `raw` when
/// there.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub ts: u64,
    pub pid: u32,
    pub tid: u32,
    pub event: Event,
    /// The params bytes as the kernel copied them, hex, when recorded with `--raw`.
    pub raw: Option<String>,
}

impl Record {
    /// A record with no raw params: every record but a decoded ioctl's under `--raw`.
    pub fn new(ts: u64, pid: u32, tid: u32, event: Event) -> Record {
        Record { ts, pid, tid, event, raw: None }
    }
}

fn is_zero_u16(v: &u16) -> bool {
    *v == 0
}
fn is_false(v: &bool) -> bool {
    !*v
}

/// Which NVIDIA device file an fd refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    /// /dev/nvidiactl: RM clients live on its open files.
    Ctl,
    /// /dev/nvidiaN.
    Gpu,
    /// /dev/nvidia-uvm: one VA space per open file.
    Uvm,
}

/// What an allocation holds. Virtual address space is never counted as physical memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Memory {
    Video,
    System,
    Virtual,
}

impl Memory {
    pub const ALL: [Memory; 3] = [Memory::Video, Memory::System, Memory::Virtual];
    pub fn name(self) -> &'static str {
        match self {
            Memory::Video => "video",
            Memory::System => "system",
            Memory::Virtual => "virtual",
        }
    }
}

/// The driver call an allocation came through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Via {
    /// NV_ESC_RM_ALLOC with the 32-byte NVOS21.
    RmAllocNvos21,
    /// NV_ESC_RM_ALLOC with NVOS64 (48 bytes; 40 before 535).
    RmAllocNvos64,
    /// NV_ESC_RM_VID_HEAP_CONTROL, ALLOC_SIZE or FREE.
    VidHeapControl,
    /// NV_ESC_RM_ALLOC_MEMORY (NVOS02) on /dev/nvidiaN.
    RmAllocMemory,
    /// NV_ESC_RM_FREE.
    RmFree,
    UvmCreateExternalRange,
    UvmAllocSemaphorePool,
    UvmFree,
}

/// How the process was first seen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Seen {
    /// Started by `gputrace record -- CMD`.
    Launched,
    /// Already running when tracing began (`--pid`, `--all`).
    Running,
    /// Forked by a traced process.
    Forked,
}

/// Serialised externally tagged; a record puts its name under `ev` among its fields (`tagged`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    /// A process enters the trace. `command` is its argv (empty when it exited before it was read).
    Process {
        ppid: u32,
        seen: Seen,
        command: Vec<String>,
    },
    Exec {
        command: Vec<String>,
    },
    /// Where the record's process runs, when it is first seen or that changed (a fork into a
    /// container, an exec after joining a cgroup).
    Place(Place),
    /// The whole process is gone; its file descriptors with it. `code` when the recorder reaped it.
    Exit {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        code: Option<i32>,
    },
    /// An NVIDIA device file opened while tracing. `file` names the open file description.
    Open {
        fd: i32,
        file: u64,
        device: Device,
        #[serde(default, skip_serializing_if = "is_false")]
        cloexec: bool,
    },
    /// An NVIDIA fd learned another way: the /proc scan at start, or the kernel's question about a
    /// fd it had not seen opened (inherited, received over a socket). `file` is the description it
    /// shares, when gputrace already knew it.
    FdFound {
        fd: i32,
        file: u64,
        device: Device,
    },
    Dup {
        old_fd: i32,
        new_fd: i32,
        #[serde(default, skip_serializing_if = "is_false")]
        cloexec: bool,
    },
    Close {
        fd: i32,
    },
    /// close_range(first, last): closes, or with `cloexec_only` marks close-on-exec.
    CloseRange {
        first: u32,
        last: u32,
        #[serde(default, skip_serializing_if = "is_false")]
        cloexec_only: bool,
    },
    SetCloexec {
        fd: i32,
        cloexec: bool,
    },
    /// An RM object that is not memory: a client, device, VA space, channel group...
    Object {
        fd: i32,
        client: u32,
        parent: u32,
        object: u32,
        class: u32,
        status: u32,
        /// For a device (NV01_DEVICE_0): the GPU it opens, NV0080's `deviceId` (the device
        /// instance). Everything allocated under the device is on that GPU.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gpu: Option<u32>,
    },
    /// Memory, or address space, requested from the driver; `status` != 0 means it failed.
    Alloc(Alloc),
    /// NV_ESC_RM_FREE (the handle and everything under it) or VID_HEAP_CONTROL FREE.
    Free {
        fd: i32,
        via: Via,
        client: u32,
        parent: u32,
        object: u32,
        status: u32,
    },
    /// RM_DUP_OBJECT: a second handle to the same memory, not new memory.
    DupObject {
        fd: i32,
        client: u32,
        parent: u32,
        object: u32,
        src_client: u32,
        src_object: u32,
        status: u32,
    },
    /// RM_SHARE: `object` of `client` shared as the policy says (RS_SHARE_TYPE_* `share_type`,
    /// `target` a client for type CLIENT, `action` RS_SHARE_ACTION_* bits: REVOKE 1, REQUIRE 2).
    Share {
        fd: i32,
        client: u32,
        object: u32,
        share_type: u16,
        target: u32,
        action: u8,
        status: u32,
    },
    /// The process that made `client` (RM's ProcID; 0: not known), where a snapshot wrote the
    /// client through another process that holds its file. Never from the kernel side.
    ClientMaker {
        client: u32,
        maker: u32,
    },
    /// RM_CONTROL EXPORT_OBJECT_TO_FD: the object is dup'ed into a client the kernel keeps for
    /// the nvidiactl file behind `to_fd`; its memory lives until that file's last close.
    ExportObject {
        fd: i32,
        client: u32,
        object: u32,
        to_fd: i32,
        status: u32,
    },
    /// RM_CONTROL IMPORT_OBJECT_FROM_FD: a new handle in the caller's client to the object the
    /// file behind `from_fd` holds: a dup, not new memory.
    ImportObject {
        fd: i32,
        client: u32,
        parent: u32,
        object: u32,
        from_fd: i32,
        status: u32,
    },
    /// RM_CONTROL EXPORT_OBJECTS_TO_FD, the batched form current libcuda uses: `objects` go into
    /// the slots of the file behind `to_fd` from `index` on (a 0 empties its slot); the file keeps
    /// each until its last close. `more`: handles of the batch past the ones followed.
    ExportObjects {
        fd: i32,
        client: u32,
        objects: Vec<u32>,
        index: u16,
        #[serde(default, skip_serializing_if = "is_zero_u16")]
        more: u16,
        to_fd: i32,
        status: u32,
    },
    /// RM_CONTROL IMPORT_OBJECTS_FROM_FD: `objects[i]`, under `parent`, is a new handle to what
    /// slot `index + i` of the file behind `from_fd` holds (0 where nothing was imported).
    ImportObjects {
        fd: i32,
        client: u32,
        parent: u32,
        objects: Vec<u32>,
        index: u16,
        #[serde(default, skip_serializing_if = "is_zero_u16")]
        more: u16,
        from_fd: i32,
        status: u32,
    },
    /// RM_CONTROL ATTACH_MEM on the fabric object `fabric` (flexible 0xf8, or multicast 0xfd on
    /// the GPU whose subdevice handle is `subdevice`; 0 for 0xf8): the first `attached` of
    /// `attachments` (memory handle, offset) were attached (RM counts them, on failure too).
    /// Recorded only for drivers whose attachment holds the memory (before 570.86.15, RM dups
    /// it). `more`: attachments past those followed.
    FabricAttach {
        fd: i32,
        client: u32,
        fabric: u32,
        subdevice: u32,
        attachments: Vec<(u32, u64)>,
        attached: u16,
        #[serde(default, skip_serializing_if = "is_zero_u16")]
        more: u16,
        status: u32,
    },
    /// RM_CONTROL DETACH_MEM: the first `detached` of `offsets` were detached, each releasing
    /// what was attached there.
    FabricDetach {
        fd: i32,
        client: u32,
        fabric: u32,
        subdevice: u32,
        offsets: Vec<u64>,
        detached: u16,
        #[serde(default, skip_serializing_if = "is_zero_u16")]
        more: u16,
        status: u32,
    },
    /// REGISTER_FD: /dev/nvidiaN fd `fd` joined the ctl fd `ctl_fd`.
    RegisterFd {
        fd: i32,
        ctl_fd: i32,
    },
    /// UVM_MAP_EXTERNAL_ALLOCATION: RM memory mapped into a UVM range; not new memory.
    UvmMap {
        fd: i32,
        base: u64,
        length: u64,
        offset: u64,
        client: u32,
        memory: u32,
        status: u32,
    },
    /// UVM_FREE: destroys the UVM range that starts at `base`.
    UvmFree {
        fd: i32,
        base: u64,
        status: u32,
    },
    /// UVM_UNMAP_EXTERNAL (cuMemUnmap): removes the mappings in [base, base + length); the
    /// range stays.
    UvmUnmap {
        fd: i32,
        base: u64,
        length: u64,
        status: u32,
    },
    /// A driver call gputrace follows but could not read (user memory fault, unknown size).
    Undecodable {
        fd: i32,
        cmd: u32,
        reason: String,
    },
    /// Records the kernel side dropped since the last such event (ring buffer full).
    Lost {
        records: u64,
    },
    /// A socket bound to a TCP port (vLLM binds early, before loading).
    Bind {
        fd: i32,
        port: u16,
    },
    /// The process started accepting connections on that socket.
    Listen {
        fd: i32,
    },
    /// What a process met running had when tracing began (`record --pid`, `--all`, a watch's
    /// start, a process joining a watched cgroup): the TCP ports it listened on (a server that
    /// already serves: ready, never loading) and the GPUs whose device files it held (the GPU of
    /// handles it made before tracing, where the host tells it).
    Attached {
        #[serde(default)]
        listening: Vec<u16>,
        #[serde(default)]
        gpus: Vec<u32>,
    },
    /// A connection accepted on `fd`: its reads and writes are followed. `conn` names it across
    /// the fds that refer to it (a server may read through a dup of the accepted fd).
    Accept {
        fd: i32,
        conn: u64,
    },
    /// Bytes read from a connection; `request` is the request line when they start a request.
    Received {
        conn: u64,
        bytes: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request: Option<String>,
    },
    /// Bytes written to a connection: `status` when they start a response's headers, `data` when
    /// they carry body data (the first data ends prefill, not the headers).
    Sent {
        conn: u64,
        bytes: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        status: Option<u16>,
        data: bool,
    },
    /// A followed connection closed: its last fd is gone.
    ConnClose {
        conn: u64,
    },
    /// A LiteLLM proxy (the record's pid, not itself traced) and the deployments its config
    /// routes to: found by a scan of /proc off the event path, again when they change (at most
    /// once a minute); with no deployments, it is gone.
    Proxy {
        /// Its (real) uid: a proxy is tied only to servers of its own user, or root's proxy to any.
        #[serde(default)]
        uid: u32,
        command: Vec<String>,
        /// The config file as its command line names it.
        config: String,
        deployments: Vec<Deployment>,
        /// Its worker processes, counted when read (uvicorn's spawned workers, gunicorn's forks
        /// of it): each keeps its own count of a deployment's requests. None: none seen.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        workers: Option<u64>,
    },
    /// The kernel's OOM killer chose this process (the record's pid) as its victim.
    OomKill,
    /// An explicit phase mark for the record's pid (`gputrace mark`): its service is in `phase`
    /// from now on, whatever inference says, until the next mark.
    Mark {
        phase: String,
    },
    /// What NVML and the host said at this moment (sampled a few times a second, off the event
    /// path): the driver's own accounting, beside the traced allocations. Pid 0.
    Sample(Sample),
}

/// One entry of a LiteLLM config's `model_list`: where it sends requests, and how many at once.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deployment {
    /// `model_name`: what clients ask for.
    pub model: String,
    /// `api_base`'s host and port.
    pub host: String,
    pub port: u16,
    /// The requests LiteLLM lets through to it at once, as LiteLLM computes it: its
    /// `max_parallel_requests`, else its `rpm`, else its `tpm` / 1000 × 6, else the router's
    /// `default_max_parallel_requests`; None: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_parallel_requests: Option<u64>,
    /// The key that value came from.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub limit_from: String,
    /// Whether its host is the proxy's own (loopback, `localhost`, an address of its network
    /// namespace): false for an address that is not, which names another machine; None for a
    /// name, which is not resolved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<bool>,
}

/// Where a process runs: its control group, the container and Kubernetes pod that names, and its
/// pid as seen inside its own pid namespace (what `ps` in its container shows).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Place {
    pub cgroup: String,
    /// The container id, shortened as `docker ps` shows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// The Kubernetes pod's UID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// The pod's namespace and name, where the kubelet's log directory on this node names them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    /// Its pid in its own pid namespace, where that is not the host's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ns_pid: Option<u32>,
    /// The user it runs as (its real uid): whose dumps its failures spend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Each GPU's used device memory, where NVML reports it (not on unified memory).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<GpuUse>,
    /// Each process's memory on each GPU, as NVML counts it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<ProcessUse>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostMemory>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuUse {
    pub gpu: u32,
    pub used_bytes: u64,
}

/// A process's memory on a GPU, as NVML counts it (its context's own memory included).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcessUse {
    pub pid: u32,
    pub gpu: u32,
    pub used_bytes: Option<u64>,
    /// Its command line, the first time it is met (empty if it could not be read).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
}

/// The host's memory (/proc/meminfo, /proc/pressure/memory): on unified memory (DGX Spark) it is
/// the GPU's memory too.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostMemory {
    pub total_bytes: u64,
    /// MemAvailable: what can be had without swapping.
    pub available_bytes: u64,
    pub swap_free_bytes: u64,
    /// PSI: the share of the last 10 s some task waited for memory, where the kernel has PSI.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pressure_some_avg10: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Alloc {
    pub fd: i32,
    pub via: Via,
    pub memory: Memory,
    pub bytes: u64,
    /// NV_STATUS (RM) or rmStatus (UVM). Non-zero: the driver refused.
    pub status: u32,
    /// RM identity (0 for UVM ranges).
    pub client: u32,
    pub parent: u32,
    pub object: u32,
    pub class: u32,
    /// UVM ranges: the range's base address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<u64>,
    /// ioctl() itself failed with this errno (the driver never looked at the request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub errno: Option<i32>,
    /// A sticky fabric object (class 0xf8 not FLEXIBLE, `map.hVidMem` set): the handle, in the
    /// same client, of the memory it keeps alive until it is freed itself (`mem_fabric.c`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holds: Option<u32>,
}

impl Event {
    /// The fd and RM client of a driver call that succeeded on a client: RM checks the client
    /// belongs to that fd's file before it acts (`Model`'s `through_own_file`).
    pub fn client_call(&self) -> Option<(i32, u32)> {
        match *self {
            Event::Object { fd, client, status: 0, .. }
            | Event::Free { fd, client, status: 0, .. }
            | Event::DupObject { fd, client, status: 0, .. }
            | Event::ExportObject { fd, client, status: 0, .. }
            | Event::ImportObject { fd, client, status: 0, .. }
            | Event::ExportObjects { fd, client, status: 0, .. }
            | Event::ImportObjects { fd, client, status: 0, .. }
            | Event::FabricAttach { fd, client, status: 0, .. }
            | Event::FabricDetach { fd, client, status: 0, .. }
            | Event::Share { fd, client, status: 0, .. } => Some((fd, client)),
            Event::Alloc(ref a) if a.succeeded() && a.base.is_none() => Some((a.fd, a.client)),
            _ => None,
        }
    }
}

impl Alloc {
    /// Video memory asked of RM (RM_ALLOC with NVOS64, class 0x40) on fd 3, granted: the
    /// allocation tests and benchmarks build most.
    pub fn video(client: u32, parent: u32, object: u32, bytes: u64) -> Alloc {
        Alloc {
            fd: 3,
            via: Via::RmAllocNvos64,
            memory: Memory::Video,
            bytes,
            status: 0,
            client,
            parent,
            object,
            class: 0x40,
            base: None,
            errno: None,
            holds: None,
        }
    }

    /// UVM_CREATE_EXTERNAL_RANGE on UVM fd `fd`, granted: address space at `base`, no memory.
    pub fn uvm_range(fd: i32, base: u64, bytes: u64) -> Alloc {
        Alloc {
            fd,
            via: Via::UvmCreateExternalRange,
            memory: Memory::Virtual,
            bytes,
            status: 0,
            client: 0,
            parent: 0,
            object: 0,
            class: 0,
            base: Some(base),
            errno: None,
            holds: None,
        }
    }

    pub fn succeeded(&self) -> bool {
        self.status == 0 && self.errno.is_none()
    }
}

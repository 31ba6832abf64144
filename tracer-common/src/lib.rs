//! Records the kernel side writes and the maps both sides share. Plain `#[repr(C)]` data, no logic
//! beyond the ioctl-number arithmetic both sides must agree on.
#![no_std]

/// Bytes of an escape's params struct the kernel copies (NVOS32, the largest traced, is 184).
pub const PARAMS_MAX: usize = 192;
/// Bytes of an RM_ALLOC class params struct the kernel copies (NV_MEMORY_ALLOCATION_PARAMS is 128).
pub const CLASS_PARAMS_MAX: usize = 128;

/// What a file descriptor is, as the kernel map records it.
pub mod device {
    /// Asked userspace, no answer yet: ioctls are sent flagged, userspace decides.
    pub const PENDING: u8 = 0;
    pub const CTL: u8 = 1;
    pub const GPU: u8 = 2;
    pub const UVM: u8 = 3;
    /// A connection a traced process accepted: its reads and writes are sent (the first bytes),
    /// so userspace can see requests arrive and responses start.
    pub const CONN: u8 = 4;
    /// Userspace answered: not an NVIDIA device file. Its ioctls cost one lookup and are never sent.
    pub const NOT_NVIDIA: u8 = 0xff;
}

/// Slots of the kernel's per-process arrays ("ever held a followed connection", "ever had a fd
/// in FDS"), indexed by tgid modulo their size: set before the fd's entry goes in, by the kernel
/// or by userspace, never cleared (a shared or reused slot costs only the exact lookup after it).
pub const PID_SLOTS: u32 = 1 << 16;
/// Slots of the kernel side's calls in flight, one per thread number modulo this.
pub const CALL_SLOTS: u32 = 1 << 14;

/// Record kinds, first field of every ring buffer record.
pub mod kind {
    pub const IOCTL: u32 = 1;
    pub const OPEN: u32 = 2;
    pub const CLOSE: u32 = 3;
    pub const DUP: u32 = 4;
    pub const CLOSE_RANGE: u32 = 5;
    pub const FORK: u32 = 6;
    pub const EXEC: u32 = 7;
    pub const EXIT: u32 = 8;
    pub const SET_CLOEXEC: u32 = 9;
    pub const BIND: u32 = 10;
    pub const LISTEN: u32 = 11;
    pub const ACCEPT: u32 = 12;
    pub const CONN_CLOSE: u32 = 13;
    pub const SOCK_IO: u32 = 14;
    pub const OOM_VICTIM: u32 = 15;
}

/// Bytes of a socket read or write the kernel copies: enough for an HTTP request line, a status
/// line, or the start of an SSE event.
pub const SOCK_HEAD_MAX: usize = 64;

/// A read (`inbound`) or write on an accepted connection: its length and first bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SockRecord {
    pub header: RecordHeader,
    pub fd: i32,
    pub inbound: u32,
    /// Bytes read (the return value) or bytes asked to be written.
    pub len: i64,
    pub head_len: u32,
    pub _pad: u32,
    pub head: [u8; SOCK_HEAD_MAX],
}

/// `IoctlRecord::flags` bits.
pub mod ioctl_flag {
    /// First NVIDIA-looking ioctl on a fd the kernel did not know: a question for userspace.
    pub const QUESTION: u8 = 1;
    /// The fd's question is not answered yet: userspace keeps the record only if the answer is NVIDIA.
    pub const PENDING: u8 = 2;
    /// Reading the params struct from user memory failed.
    pub const PARAMS_FAULT: u8 = 4;
    /// Reading the RM_ALLOC class params from user memory failed.
    pub const CLASS_FAULT: u8 = 8;
    /// The command came wrapped in NV_ESC_IOCTL_XFER_CMD; `escape_cmd` is the inner one.
    pub const XFER: u8 = 16;
    /// First NVIDIA-looking ioctl on a fd the kernel did not know, which it found NVIDIA's by
    /// the device number of its file (`device` says which, `file` is that file): no question.
    pub const BY_NUMBER: u8 = 32;
    /// With BY_NUMBER or QUESTION: the fd was close-on-exec when the kernel found it or asked.
    pub const CLOEXEC: u8 = 64;
    /// A followed export or import: the fd it names (`named_file`'s) was close-on-exec.
    pub const NAMED_CLOEXEC: u8 = 128;
}

/// Values of the TRACED map.
pub mod traced {
    pub const YES: u8 = 1;
    /// A new child of a traced process whose inherited NVIDIA fds userspace has not yet copied
    /// into FDS: its closes of fds the kernel does not know are sent, so none is missed.
    pub const INHERITING: u8 = 2;
}

/// Counters in the STATS per-CPU array.
pub mod stat {
    /// Records the ring buffer had no room for.
    pub const LOST: u32 = 0;
    pub const QUESTIONS: u32 = 1;
    /// Map inserts the kernel refused (a full FDS or TRACED map): fds or processes that may be
    /// followed no more.
    pub const INSERT_FAILED: u32 = 2;
    /// Opens of an NVIDIA path whose file is not NVIDIA's device (its major differs): not followed.
    pub const IMPOSTORS: u32 = 3;
    /// Opens, closes, dups and ioctls in threads with a file table of their own (unshare
    /// CLONE_FILES), and close_range(CLOSE_RANGE_UNSHARE) on a shared one: their fd numbers are
    /// not their process's, so they are not followed.
    pub const OWN_FILE_TABLE: u32 = 4;
    /// Followed calls kept for their exit in the LRU map of calls in flight: their thread's slot
    /// was held by another thread, or the kernel lacks BPF's atomics (then every one).
    pub const CALLS_IN_MAP: u32 = 5;
    pub const COUNT: u32 = 6;
}

/// `Config` array index 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Config {
    /// Trace every process, not only those in TRACED.
    pub trace_all: u32,
    /// Offset of `group_dead` in sched_process_exit records (recent kernels; 6.1 has none); 0 when the kernel's
    /// records have none, and the thread group leader's exit stands for the process's.
    pub group_dead_at: u32,
    /// Also trace every process under the cgroup v2 directory in CGROUPS[0] (`watch --cgroup`).
    pub cgroup: u32,
    /// The majors of NVIDIA's device numbers on this host (/proc/devices): an open of an NVIDIA
    /// path is followed only when its file has the right one. 0: no driver here (the fake GPU),
    /// known by path alone.
    pub nvidia_major: u32,
    pub uvm_major: u32,
    /// Non-zero from the load until userspace has scanned the processes it met running: a child
    /// forked meanwhile is marked inheriting whatever its parent's FD_PIDS slot says, since the
    /// scan may not have set it yet.
    pub attaching: u32,
}

/// Where, in the running kernel, `current->files->fdt->fd[n]` is (from its BTF). All zero when
/// unknown: the kernel side then reports no `struct file` and userspace falls back to kcmp(2).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOffsets {
    pub task_files: u32,
    pub files_fdt: u32,
    pub fdtable_fd: u32,
    pub fdtable_max_fds: u32,
    /// `task_struct.exit_code` (a wait status), read at the process's exit; 0 when unknown.
    pub task_exit_code: u32,
    /// `file.f_inode` and `inode.i_rdev`: the device number behind a file; 0 when unknown.
    pub file_inode: u32,
    pub inode_rdev: u32,
    /// `task_struct.group_leader`: a thread's table is its process's when it is the leader's;
    /// 0 when unknown (every thread is taken to share it).
    pub task_group_leader: u32,
    /// `files_struct.count` plus one (it is the struct's first member): how many tasks share a
    /// file table; 0 when unknown.
    pub files_count_plus_one: u32,
    /// `task_struct.mm`, `mm_struct.arg_start` and `arg_end`: where an exec's argv lies in its
    /// new memory; 0 when unknown (userspace reads /proc/PID/cmdline instead).
    pub task_mm: u32,
    pub mm_arg_start: u32,
    pub mm_arg_end: u32,
    /// `fdtable.close_on_exec`: the bitmap of a table's close-on-exec fds; 0 when unknown.
    pub fdtable_close_on_exec: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RecordHeader {
    pub kind: u32,
    pub tgid: u32,
    pub tid: u32,
    pub _pad: u32,
    /// CLOCK_MONOTONIC (bpf_ktime_get_ns).
    pub ts_ns: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IoctlRecord {
    pub header: RecordHeader,
    pub fd: i32,
    /// The request as the process passed it.
    pub cmd: u32,
    /// ioctl()'s return value.
    pub ret: i64,
    /// The command the params belong to: `cmd`, or the XFER wrapper's inner escape re-encoded
    /// as `_IOWR('F', nr, size)` so one decoder serves both.
    pub escape_cmd: u32,
    pub params_len: u32,
    pub class_len: u32,
    /// The `struct file *` behind the fd, for a QUESTION only (0 when unknown): names the open
    /// file description while the fd may already be gone when userspace looks.
    pub file: u64,
    /// For an export or import of an object, the `struct file *` behind the fd its params name
    /// (0 otherwise): a fd received over a socket is known by it though no ioctl comes on it.
    pub named_file: u64,
    pub device: u8,
    pub flags: u8,
    pub _pad: [u8; 2],
    /// For RM escapes the struct as the driver left it; for UVM the head window then the tail window.
    pub params: [u8; PARAMS_MAX],
    /// For RM_ALLOC the class params behind `pAllocParms`, sized by class.
    pub class_params: [u8; CLASS_PARAMS_MAX],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct OpenRecord {
    pub header: RecordHeader,
    pub fd: i32,
    pub flags: i32,
    /// The new `struct file *` (0 when unknown).
    pub file: u64,
    pub device: u8,
    pub _pad: [u8; 7],
}

/// BIND (`a` = fd, `b` = port), LISTEN and ACCEPT and CONN_CLOSE (`a` = fd), OOM_VICTIM (`a` = the
/// victim's pid; the record's own pid is whoever triggered the kill),
/// CLOSE (`a` = fd, `b` = 1 when the kernel did not know the fd), DUP (`a` = old fd, `b` = new fd, `c` = O_CLOEXEC or 0), CLOSE_RANGE (`a`..=`b`,
/// `c` = flags), FORK (`a` = child pid), EXIT (`a` = exit code), SET_CLOEXEC (`a` = fd, `b` = 0/1).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FdRecord {
    pub header: RecordHeader,
    pub a: i64,
    pub b: i64,
    pub c: i64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ExecRecord {
    pub header: RecordHeader,
    pub filename: [u8; 64],
    /// The argv the new program was given, NUL-separated: the first `args_len` bytes of it
    /// (`args_len` 0: unknown), all of it when `args_whole` is 1.
    pub args_len: u32,
    pub args_whole: u32,
    pub args: [u8; EXEC_ARGS],
}

/// Bytes of an exec's argv its record carries (a power of two: the kernel side masks lengths
/// with it less one).
pub const EXEC_ARGS: usize = 1024;

/// A read on a followed connection, from its enter to its exit (the READS map, by pid_tgid).
/// Userspace writes one for a thread met already blocked in such a read when it attaches.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reading {
    pub buf: u64,
    pub fd: i32,
    pub _pad: u32,
}

/// Key of the FDS map: one open file descriptor of one process.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FdKey {
    pub tgid: u32,
    pub fd: u32,
}

/// For a UVM command (the bare number is the map key): which bytes of its params struct to copy.
/// UVM commands carry no size, and the offsets move between driver versions, so userspace writes
/// them for the running driver before attaching. A command absent from the map is not traced.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UvmWindow {
    pub head_len: u32,
    pub tail_offset: u32,
    pub tail_len: u32,
    pub _pad: u32,
}

pub const IOC_NRBITS: u32 = 8;
pub const IOC_TYPEBITS: u32 = 8;
pub const IOC_SIZEBITS: u32 = 14;
pub const IOC_NRSHIFT: u32 = 0;
pub const IOC_TYPESHIFT: u32 = IOC_NRSHIFT + IOC_NRBITS;
pub const IOC_SIZESHIFT: u32 = IOC_TYPESHIFT + IOC_TYPEBITS;
pub const IOC_DIRSHIFT: u32 = IOC_SIZESHIFT + IOC_SIZEBITS;
pub const IOC_READ_WRITE: u32 = 3;
/// The RM ioctl type byte, 'F'.
pub const NV_IOCTL_MAGIC: u32 = b'F' as u32;

#[inline(always)]
pub const fn ioc_nr(cmd: u32) -> u32 {
    (cmd >> IOC_NRSHIFT) & ((1 << IOC_NRBITS) - 1)
}
#[inline(always)]
pub const fn ioc_type(cmd: u32) -> u32 {
    (cmd >> IOC_TYPESHIFT) & ((1 << IOC_TYPEBITS) - 1)
}
#[inline(always)]
pub const fn ioc_size(cmd: u32) -> u32 {
    (cmd >> IOC_SIZESHIFT) & ((1 << IOC_SIZEBITS) - 1)
}
#[inline(always)]
pub const fn ioc_dir(cmd: u32) -> u32 {
    cmd >> IOC_DIRSHIFT
}
/// `_IOWR('F', nr, size)`, the form of every RM escape.
#[inline(always)]
pub const fn rm_cmd(nr: u32, size: u32) -> u32 {
    (IOC_READ_WRITE << IOC_DIRSHIFT) | (size << IOC_SIZESHIFT) | (NV_IOCTL_MAGIC << IOC_TYPESHIFT) | nr
}

/// The RM escapes gputrace follows (nr), all memory-relevant.
pub mod escape {
    pub const RM_ALLOC_MEMORY: u32 = 0x27;
    pub const RM_FREE: u32 = 0x29;
    /// Followed only for the controls in [`super::control`]; the kernel side drops the rest.
    pub const RM_CONTROL: u32 = 0x2a;
    pub const RM_ALLOC: u32 = 0x2b;
    pub const RM_DUP_OBJECT: u32 = 0x34;
    /// NVOS57: an object shared beyond its creating process (RM_DUP_OBJECT from elsewhere is
    /// refused otherwise: the default share policy is the same process's, sharing.c).
    pub const RM_SHARE: u32 = 0x35;
    pub const RM_VID_HEAP_CONTROL: u32 = 0x4a;
    pub const REGISTER_FD: u32 = 0xc9;
    pub const IOCTL_XFER_CMD: u32 = 0xd3;
    /// The RM escapes whose params gputrace decodes (XFER only wraps one of them).
    pub const FOLLOWED: [u32; 8] =
        [RM_ALLOC_MEMORY, RM_FREE, RM_CONTROL, RM_ALLOC, RM_DUP_OBJECT, RM_SHARE, RM_VID_HEAP_CONTROL, REGISTER_FD];
}

/// The RM controls (NVOS54's cmd) that move memory's lifetime: an object exported to a file
/// descriptor is held by that file until its last close; an import is one more handle to it
/// (`rmobjexportimport.c`, `os.c`). Every other control is dropped in the kernel.
pub mod control {
    /// NVOS54: hClient@0 hObject@4 cmd@8 params@16 paramsSize@24 status@28.
    pub const OBJECT: usize = 4;
    pub const CMD: usize = 8;
    pub const PARAMS: usize = 16;
    pub const STATUS: usize = 28;
    /// NV0000_CTRL_CMD_OS_UNIX_EXPORT_OBJECT_TO_FD: type@0 hDevice@4 hParent@8 hObject@12 fd@16 flags@20.
    pub const EXPORT_OBJECT_TO_FD: u32 = 0x3d05;
    pub const EXPORT_OBJECT_AT: usize = 12;
    pub const EXPORT_FD_AT: usize = 16;
    /// NV0000_CTRL_CMD_OS_UNIX_IMPORT_OBJECT_FROM_FD: fd@0 type@4 hDevice@8 hParent@12 hObject@16 (written back).
    pub const IMPORT_OBJECT_FROM_FD: u32 = 0x3d06;
    pub const IMPORT_FD_AT: usize = 0;
    pub const IMPORT_PARENT_AT: usize = 12;
    pub const IMPORT_OBJECT_AT: usize = 16;
    /// NV0000_CTRL_CMD_OS_UNIX_EXPORT_OBJECTS_TO_FD, the batched form current libcuda uses
    /// (2128 bytes): fd@0 hDevice@4 maxObjects@8 metadata[64]@10 objects[512]@76 numObjects@2124
    /// index@2126. The kernel side copies fd and hDevice, numObjects and index, and the first
    /// [`OBJECTS_FOLLOWED`] objects, packed as [`PACKED_HEAD`], [`PACKED_COUNT`], [`PACKED_OBJECTS`].
    pub const EXPORT_OBJECTS_TO_FD: u32 = 0x3d0b;
    pub const EXPORT_OBJECTS_AT: u32 = 76;
    pub const EXPORT_COUNT_AT: u32 = 2124;
    /// NV0000_CTRL_CMD_OS_UNIX_IMPORT_OBJECTS_FROM_FD (652 bytes): fd@0 hParent@4 objects[128]@8
    /// objectTypes[128]@520 (written back; 0 where nothing was imported) numObjects@648 index@650.
    /// Packed like an export, then the first objectTypes at [`PACKED_TYPES`].
    pub const IMPORT_OBJECTS_FROM_FD: u32 = 0x3d0c;
    pub const IMPORT_OBJECTS_AT: u32 = 8;
    pub const IMPORT_TYPES_AT: u32 = 520;
    pub const IMPORT_COUNT_AT: u32 = 648;
    /// Handles of a batch that are followed (libcuda exports one per file); the rest are counted.
    pub const OBJECTS_FOLLOWED: usize = 16;
    pub const PACKED_HEAD: usize = 0;
    pub const PACKED_COUNT: usize = 8;
    pub const PACKED_OBJECTS: usize = 12;
    pub const PACKED_TYPES: usize = PACKED_OBJECTS + 4 * OBJECTS_FOLLOWED;

    /// NV00F8_CTRL_CMD_ATTACH_MEM on a flexible fabric object (2064 bytes): memInfos[64] of 32
    /// bytes {hMemory@0, offset@8, mapOffset@16, mapLength@24}, numMemInfos@2048 flags@2052
    /// numAttached@2056 (written back, valid on failure too). The kernel side copies the first
    /// [`FABRIC_FOLLOWED`] memInfos' hMemory and offset (16 bytes each), then 12 bytes from 2048.
    pub const FABRIC_ATTACH_MEM: u32 = 0xf80103;
    /// NV00F8_CTRL_CMD_DETACH_MEM (528 bytes): offsets[64]@0, numOffsets@512 flags@516
    /// numDetached@520. Copied: the first [`FABRIC_FOLLOWED`] offsets, then 12 bytes from 512.
    pub const FABRIC_DETACH_MEM: u32 = 0xf80104;
    pub const FABRIC_INFO_SIZE: u32 = 32;
    pub const FABRIC_COUNTS_AT: u32 = 2048;
    pub const FABRIC_DETACH_COUNTS_AT: u32 = 512;
    /// Attachments of one control that are followed (CUDA attaches one at a time); the rest are
    /// counted as not followed.
    pub const FABRIC_FOLLOWED: usize = 7;
    /// Where the copied counts sit: after 7 attachments of 16 bytes or 7 offsets of 8.
    pub const PACKED_ATTACH_COUNTS: usize = 16 * FABRIC_FOLLOWED;
    pub const PACKED_DETACH_COUNTS: usize = 8 * FABRIC_FOLLOWED;
    /// NV00FD_CTRL_CMD_ATTACH_MEM on a multicast object (40 bytes): hSubdevice@0 hMemory@4
    /// offset@8 mapOffset@16 mapLength@24 flags@32. DETACH_MEM (24 bytes): hSubdevice@0
    /// offset@8 flags@16. Copied whole.
    pub const MULTICAST_ATTACH_MEM: u32 = 0xfd0102;
    pub const MULTICAST_DETACH_MEM: u32 = 0xfd0105;
}

/// The size of what the kernel side copies of a followed control's params (from behind NVOS54's
/// params pointer): the whole struct, or for a batch the packed parts (see [`control`]).
#[inline(always)]
pub const fn control_params_size(cmd: u32) -> Option<u32> {
    match cmd {
        control::EXPORT_OBJECT_TO_FD => Some(24),
        control::IMPORT_OBJECT_FROM_FD => Some(20),
        control::EXPORT_OBJECTS_TO_FD => Some(control::PACKED_TYPES as u32),
        control::IMPORT_OBJECTS_FROM_FD => Some((control::PACKED_TYPES + control::OBJECTS_FOLLOWED) as u32),
        control::FABRIC_ATTACH_MEM => Some(control::PACKED_ATTACH_COUNTS as u32 + 12),
        control::FABRIC_DETACH_MEM => Some(control::PACKED_DETACH_COUNTS as u32 + 12),
        control::MULTICAST_ATTACH_MEM => Some(40),
        control::MULTICAST_DETACH_MEM => Some(24),
        _ => None,
    }
}

/// The params size of each followed RM escape: the one table both the kernel's filter
/// ([`rm_escape_traced`]) and the decoder (which needs at least this many bytes) read. RM_ALLOC
/// has three: NVOS21 (32), and NVOS64 at 40 before 535 and 48 from 535 on.
#[inline(always)]
pub const fn rm_params_size(nr: u32) -> Option<u32> {
    match nr {
        escape::RM_ALLOC_MEMORY => Some(56),
        escape::RM_FREE => Some(16),
        escape::RM_CONTROL => Some(32),
        escape::RM_ALLOC => Some(32),
        escape::RM_DUP_OBJECT => Some(28),
        escape::RM_SHARE => Some(24),
        escape::RM_VID_HEAP_CONTROL => Some(184),
        escape::REGISTER_FD => Some(4),
        _ => None,
    }
}

/// Whether an RM escape number with this params size is one gputrace follows: the size of
/// [`rm_params_size`], or for RM_ALLOC any of its three.
#[inline(always)]
pub const fn rm_escape_traced(nr: u32, size: u32) -> bool {
    if nr == escape::RM_ALLOC {
        return size == 32 || size == 40 || size == 48;
    }
    match rm_params_size(nr) {
        Some(s) => s == size,
        None => false,
    }
}

#[cfg(test)]
#[test]
fn every_followed_escape_is_traced_at_its_size() {
    for nr in escape::FOLLOWED {
        let size = rm_params_size(nr).expect("a size");
        assert!(rm_escape_traced(nr, size), "{nr:#x}");
        assert!(!rm_escape_traced(nr, size + 1), "{nr:#x}");
    }
    assert!(rm_escape_traced(escape::RM_ALLOC, 40) && rm_escape_traced(escape::RM_ALLOC, 48));
}

/// An RM command word worth following: `_IOWR('F', nr, size)` of a traced escape, or the XFER wrapper.
#[inline(always)]
pub const fn rm_command_traced(cmd: u32) -> bool {
    if ioc_type(cmd) != NV_IOCTL_MAGIC || ioc_dir(cmd) != IOC_READ_WRITE {
        return false;
    }
    let nr = ioc_nr(cmd);
    let size = ioc_size(cmd);
    (nr == escape::IOCTL_XFER_CMD && size == 16) || rm_escape_traced(nr, size)
}

/// The UVM commands gputrace follows: CREATE_EXTERNAL_RANGE, MAP_EXTERNAL_ALLOCATION, FREE and
/// ALLOC_SEMAPHORE_POOL. Arithmetic, so an unknown fd's ioctl is judged without a map lookup.
pub mod uvm {
    pub const MAP_EXTERNAL_ALLOCATION: u32 = 33;
    pub const FREE: u32 = 34;
    pub const UNMAP_EXTERNAL: u32 = 66;
    pub const ALLOC_SEMAPHORE_POOL: u32 = 68;
    pub const CREATE_EXTERNAL_RANGE: u32 = 73;
}

#[inline(always)]
pub const fn uvm_command_traced(cmd: u32) -> bool {
    matches!(cmd, uvm::MAP_EXTERNAL_ALLOCATION | uvm::FREE | uvm::UNMAP_EXTERNAL | uvm::ALLOC_SEMAPHORE_POOL | uvm::CREATE_EXTERNAL_RANGE)
}

/// nv_ioctl_xfer_t: `cmd@0 size@4 ptr@8`, the escape it wraps and where that escape's params lie.
pub mod xfer {
    pub const SIZE: usize = 16;
    pub const CMD: usize = 0;
    pub const PARAMS_SIZE: usize = 4;
    pub const PARAMS: usize = 8;
}

/// NVOS21 (RM_ALLOC of 32 bytes) and NVOS64 (40 or 48) share `hClass@12 pAllocParms@16`.
pub mod alloc {
    pub const CLASS: usize = 12;
    pub const PARAMS: usize = 16;
}

/// The native-endian u32 at `at` of copied params. Offsets are the constants above, so in the
/// kernel the bounds check folds away.
#[inline(always)]
pub fn u32_at<const N: usize>(bytes: &[u8; N], at: usize) -> u32 {
    u32::from_ne_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// The native-endian u64 at `at` of copied params (a user pointer).
#[inline(always)]
pub fn u64_at<const N: usize>(bytes: &[u8; N], at: usize) -> u64 {
    let b = |i: usize| bytes[at + i];
    u64::from_ne_bytes([b(0), b(1), b(2), b(3), b(4), b(5), b(6), b(7)])
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    unsafe impl aya::Pod for FdKey {}
    unsafe impl aya::Pod for Reading {}
    unsafe impl aya::Pod for UvmWindow {}
    unsafe impl aya::Pod for Config {}
    unsafe impl aya::Pod for KernelOffsets {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_words_match_the_verified_table() {
        assert_eq!(rm_cmd(escape::RM_ALLOC, 48), 0xc030462b);
        assert_eq!(rm_cmd(escape::RM_ALLOC, 32), 0xc020462b);
        assert_eq!(rm_cmd(escape::RM_VID_HEAP_CONTROL, 184), 0xc0b8464a);
        assert_eq!(rm_cmd(escape::RM_ALLOC_MEMORY, 56), 0xc0384627);
        assert_eq!(rm_cmd(escape::RM_FREE, 16), 0xc0104629);
        assert_eq!(rm_cmd(escape::RM_DUP_OBJECT, 28), 0xc01c4634);
        assert_eq!(rm_cmd(escape::IOCTL_XFER_CMD, 16), 0xc01046d3);
    }

    #[test]
    fn only_traced_escapes_look_like_nvidia() {
        assert!(rm_command_traced(0xc030462b));
        assert!(rm_command_traced(0xc01046d3));
        // RM_CONTROL looks like NVIDIA (its controls are told apart in the kernel by NVOS54's cmd);
        // a wrong size is rejected by the driver itself.
        assert!(rm_command_traced(0xc020462a));
        assert!(!rm_command_traced(rm_cmd(escape::RM_CONTROL, 24)));
        assert!(!rm_command_traced(rm_cmd(escape::RM_FREE, 24)));
        // TCGETS
        assert!(!rm_command_traced(0x5401));
    }
}

//! Workloads that allocate through the fake GPU as CUDA programs do, each writing its own ground
//! truth (`--truth FILE`, JSON lines: ts, pid, op, path, bytes, handle).
//!
//! - `paths`: every allocation path the decoder handles, explicit frees (one through the XFER
//!   wrapper), a dup, and memory left for the driver to free when the process exits;
//! - `fork-holder --hold-ms N`: allocates, forks a child that keeps the device files, and exits;
//!   the child exits N ms later, and only then is the memory freed;
//! - `storm --count N`: a child does N ioctls on inherited and dup'ed non-NVIDIA fds, a third of
//!   them with NVIDIA-looking commands;
//! - `oom --bytes B`: one allocation larger than the card;
//! - `pass-fd`: sends its device files over a unix socket (SCM_RIGHTS) to a process it starts,
//!   which allocates on them; the sender exits first, the receiver keeps everything alive;
//! - `hold --ms N [--host-mib M]`: allocates 2 GiB (and writes M MiB of host memory), waits N ms
//!   (attach a recorder then), allocates 1 GiB, frees the first, and exits holding the second;
//! - `vmm --ms N`: as VMM allocators do (PyTorch expandable segments, NCCL, vLLM's cumem), maps
//!   memory into UVM, releases its handle while it is mapped (cuMemRelease), waits N ms, then
//!   unmaps it (cuMemUnmap): only then does the driver free it; the address range it reserved
//!   goes after (cuMemAddressFree).
//! - `repoint`: a followed /dev/nvidia-uvm fd closed by io_uring and its number reused for
//!   another file, with a UVM command on each (see [`repoint`]);
//! - `fabric --ms N [--multicast]`: memory attached to a flexible fabric object (or a multicast
//!   one, at its GPU) (ATTACH_MEM), its handle released while attached, detached N ms later:
//!   before 570 the driver frees it only then;
//! - `ipc --ms N`: CUDA IPC through a file descriptor (cuMemExportToShareableHandle): exports
//!   3 GiB to a fresh nvidiactl file, sends it over a unix socket to a process it starts, which
//!   imports it; the exporter frees and exits; the importer frees its handle after N ms, and
//!   only its close of the export file, 100 ms later, frees the memory. With `--close-first`
//!   the importer closes the export file at once, as applications do, and its handle's free is
//!   what frees the memory. With `--batched` both sides use the batched controls current libcuda
//!   issues (EXPORT_OBJECTS_TO_FD, IMPORT_OBJECTS_FROM_FD) instead of the single ones. With
//!   `--in-flight` the exporter closes the export file as soon as it is sent, as NCCL's proxy
//!   does: in flight over the socket, no process holds it until the importer receives it.
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::process::ExitCode;

use fakegpu::abi::{esc, rm_cmd, uvm};
use fakegpu::cuda::{Buffer, Gpu, Path};
use fakegpu::parse_bytes;
use fakegpu::truth::monotonic_ns;
use serde_json::json;

struct Truth(Option<File>);

impl Truth {
    fn note(&mut self, op: &str, path: &str, bytes: u64, handle: u32, status: u32) {
        if let Some(f) = &mut self.0 {
            let line = json!({"ts": monotonic_ns(), "pid": std::process::id(), "op": op, "path": path, "bytes": bytes, "handle": handle, "status": status});
            let _ = writeln!(f, "{line}");
        }
    }

    fn alloc(&mut self, gpu: &mut Gpu, path: Path, bytes: u64) -> Option<Buffer> {
        let name = format!("{path:?}");
        match gpu.alloc(path, bytes) {
            Ok(b) => {
                self.note("alloc", &name, bytes, b.handle, 0);
                Some(b)
            }
            Err(status) => {
                self.note("alloc", &name, bytes, 0, status);
                None
            }
        }
    }
}

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn paths(truth: &mut Truth) -> Result<(), String> {
    let mut gpu = Gpu::open(0)?;
    let weights = truth.alloc(&mut gpu, Path::RmAlloc, 2 * GIB).ok_or("RmAlloc failed")?;
    let scratch = truth.alloc(&mut gpu, Path::RmAllocNvos21, 64 * MIB).ok_or("RmAllocNvos21 failed")?;
    let kv = truth.alloc(&mut gpu, Path::VidHeap, GIB).ok_or("VidHeap failed")?;
    let pinned = truth.alloc(&mut gpu, Path::HostPinned, 256 * MIB).ok_or("HostPinned failed")?;
    let pool = gpu.semaphore_pool(2 * MIB).map_err(|s| format!("semaphore pool: {s:#x}"))?;
    truth.note("alloc", "SemaphorePool", 2 * MIB, 0, 0);
    let alias = gpu.dup(&kv).map_err(|s| format!("dup: {s:#x}"))?;
    truth.note("dup", "Dup", kv.bytes, alias, 0);

    gpu.free(&scratch).map_err(|s| format!("free: {s:#x}"))?;
    truth.note("free", "RmFree", scratch.bytes, scratch.handle, 0);
    gpu.free_handle(pinned.handle, true).map_err(|s| format!("xfer free: {s:#x}"))?;
    truth.note("free", "XferRmFree", pinned.bytes, pinned.handle, 0);
    // The original handle goes; the dup keeps the memory until the client is freed at exit.
    gpu.free_handle(kv.handle, false).map_err(|s| format!("free: {s:#x}"))?;
    truth.note("free_handle", "RmFree", 0, kv.handle, 0);
    gpu.free_range(pool).map_err(|s| format!("uvm free: {s:#x}"))?;
    truth.note("free", "UvmFree", 2 * MIB, 0, 0);
    // weights and the dup'ed kv are left for the driver to free when the files are released.
    let _ = weights;
    Ok(())
}

fn vmm(truth: &mut Truth, ms: u64) -> Result<(), String> {
    let mut gpu = Gpu::open(0)?;
    let segment = truth.alloc(&mut gpu, Path::RmAlloc, 4 * GIB).ok_or("RmAlloc failed")?;
    gpu.free_handle(segment.handle, false).map_err(|s| format!("free: {s:#x}"))?;
    truth.note("release_mapped", "RmFree", segment.bytes, segment.handle, 0);
    std::thread::sleep(std::time::Duration::from_millis(ms));
    let va = segment.va.ok_or("no range")?;
    gpu.unmap(va, segment.bytes).map_err(|s| format!("uvm unmap: {s:#x}"))?;
    truth.note("free", "UvmUnmap", segment.bytes, segment.handle, 0);
    std::thread::sleep(std::time::Duration::from_millis(50));
    gpu.free_range(va).map_err(|s| format!("uvm free: {s:#x}"))?;
    truth.note("free_range", "UvmFree", segment.bytes, 0, 0);
    Ok(())
}

/// Memory attached to a flexible fabric object (multi-node NVLink through IMEX), its handle
/// released while attached, detached `ms` later, then the fabric object freed.
fn fabric(truth: &mut Truth, ms: u64, multicast: bool) -> Result<(), String> {
    let mut gpu = Gpu::open(0)?;
    let memory = truth.alloc(&mut gpu, Path::VidHeap, 2 * GIB).ok_or("VidHeap failed")?;
    let fabric = if multicast { gpu.alloc_class(fakegpu::abi::class::MULTICAST_FABRIC, 2 * GIB) } else { gpu.flexible_fabric(2 * GIB) };
    let fabric = fabric.map_err(|s| format!("fabric object: {s:#x}"))?;
    let attached = if multicast { gpu.attach_multicast(fabric, &memory, 0) } else { gpu.attach(fabric, &memory, 0) };
    attached.map_err(|s| format!("attach: {s:#x}"))?;
    truth.note("attach", "FabricAttach", memory.bytes, memory.handle, 0);
    gpu.free_handle(memory.handle, false).map_err(|s| format!("free: {s:#x}"))?;
    truth.note("release_attached", "RmFree", memory.bytes, memory.handle, 0);
    std::thread::sleep(std::time::Duration::from_millis(ms));
    let detached = if multicast { gpu.detach_multicast(fabric, 0) } else { gpu.detach(fabric, 0) };
    detached.map_err(|s| format!("detach: {s:#x}"))?;
    truth.note("detach", "FabricDetach", memory.bytes, memory.handle, 0);
    std::thread::sleep(std::time::Duration::from_millis(50));
    gpu.free_handle(fabric, false).map_err(|s| format!("free fabric: {s:#x}"))?;
    truth.note("free_fabric", "RmFree", 0, fabric, 0);
    Ok(())
}

/// What is not memory and what is memory of another kind, as RM counts them: LOCAL_PHYSICAL
/// (0xc2) and RM_ALLOC_MEMORY of LOCAL_USER and LOCAL_PRIVILEGED (a mapping of the whole card, a
/// 4 GiB window) are objects; EGM (0x42) is host memory, a multicast fabric object (0xfd)
/// address space, VID_HEAP_CONTROL with USE_EGM EGM where the driver has it.
fn classes(truth: &mut Truth) -> Result<(), String> {
    use fakegpu::abi::class;
    let gpu = Gpu::open(0)?;
    let objects = [
        ("local_physical", gpu.alloc_class(class::LOCAL_PHYSICAL, 0)),
        ("alloc_memory_local_user", gpu.alloc_memory(class::LOCAL_USER, 80 * GIB)),
        ("alloc_memory_local_privileged", gpu.alloc_memory(class::LOCAL_PRIVILEGED, 4 * GIB)),
    ];
    for (what, made) in objects {
        let handle = made.map_err(|s| format!("{what}: status {s:#x}"))?;
        truth.note(what, "object", 0, handle, 0);
    }
    let memory = [
        ("egm", GIB, gpu.alloc_class(class::EXTENDED_USER, GIB)),
        ("multicast", 2 * GIB, gpu.alloc_class(class::MULTICAST_FABRIC, 2 * GIB)),
        ("vid_heap_egm", 512 * MIB, gpu.vid_heap_egm(512 * MIB)),
    ];
    for (what, bytes, made) in memory {
        let handle = made.map_err(|s| format!("{what}: status {s:#x}"))?;
        truth.note(what, "memory", bytes, handle, 0);
    }
    Ok(())
}

fn fork_holder(truth: &mut Truth, hold_ms: u64) -> Result<(), String> {
    let mut gpu = Gpu::open(0)?;
    truth.alloc(&mut gpu, Path::RmAlloc, 4 * GIB).ok_or("alloc failed")?;
    // SAFETY: fork in a single-threaded program; the child only sleeps and exits.
    match unsafe { libc::fork() } {
        0 => {
            std::thread::sleep(std::time::Duration::from_millis(hold_ms));
            // SAFETY: leave without running the parent's destructors twice.
            unsafe { libc::_exit(0) };
        }
        -1 => Err("fork failed".into()),
        child => {
            truth.note("forked", "", 0, child as u32, 0);
            // The parent exits at once; the child still holds the files.
            Ok(())
        }
    }
}

fn storm(count: u64) -> Result<(), String> {
    let null = File::open("/dev/null").map_err(|e| e.to_string())?;
    let (mut a, mut b) = (0, 0);
    let mut pair = [0; 2];
    // SAFETY: socketpair fills two fds.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, pair.as_mut_ptr()) } == 0 {
        (a, b) = (pair[0], pair[1]);
    }
    // SAFETY: fork; the child runs the ioctl loop on inherited and dup'ed fds, then exits.
    match unsafe { libc::fork() } {
        0 => {
            let dup_null = unsafe { libc::dup(null.as_raw_fd()) };
            let dup_sock = unsafe { libc::dup(a) };
            let fds = [null.as_raw_fd(), a, b, dup_null, dup_sock];
            let commands = [0x5401u32, rm_cmd(esc::RM_ALLOC, 48), uvm::MAP_EXTERNAL_ALLOCATION, 0x541b, rm_cmd(esc::RM_FREE, 16), 0x5413];
            let mut buf = [0u8; 64];
            for i in 0..count {
                let fd = fds[(i % fds.len() as u64) as usize];
                let cmd = commands[(i % commands.len() as u64) as usize];
                unsafe { libc::ioctl(fd, cmd as _, buf.as_mut_ptr()) };
            }
            unsafe { libc::_exit(0) };
        }
        -1 => Err("fork failed".into()),
        child => {
            let mut status = 0;
            unsafe { libc::waitpid(child, &mut status, 0) };
            Ok(())
        }
    }
}

/// Closes a followed /dev/nvidia-uvm fd through io_uring (no close syscall for a tracepoint to
/// see), opens another file under the same number and issues a UVM command on each: a tracer
/// that checked the file only at its open would take the second for NVIDIA's.
fn repoint() -> Result<(), String> {
    let uvm = File::options().read(true).write(true).open("/dev/nvidia-uvm").map_err(|e| format!("/dev/nvidia-uvm: {e}"))?;
    let fd = std::os::fd::IntoRawFd::into_raw_fd(uvm);
    uvm_free(fd);
    let mut ring = ring()?;
    let closed = io_uring_once(&mut ring, io_uring::opcode::Close::new(io_uring::types::Fd(fd)).build())?;
    if closed != 0 {
        return Err(format!("io_uring's close of fd {fd} gave {closed}"));
    }
    let other = File::open("/proc/version").map_err(|e| format!("/proc/version: {e}"))?;
    if other.as_raw_fd() != fd {
        return Err(format!("the new file got fd {}, not {fd}", other.as_raw_fd()));
    }
    uvm_free(fd);
    Ok(())
}

/// A UVM command on `fd`: the device answers or refuses, nothing else is touched.
fn uvm_free(fd: i32) {
    let mut params = [0u8; 24];
    // SAFETY: a UVM_FREE-sized buffer.
    unsafe { libc::ioctl(fd, uvm::FREE as _, params.as_mut_ptr()) };
}

/// A ring for [`io_uring_once`], made before the fds a test reuses: its own fd takes a number.
fn ring() -> Result<io_uring::IoUring, String> {
    io_uring::IoUring::new(2).map_err(|e| format!("io_uring: {e}"))
}

/// One io_uring operation, waited for; its result (a fd, 0, or -errno).
fn io_uring_once(ring: &mut io_uring::IoUring, entry: io_uring::squeue::Entry) -> Result<i32, String> {
    // SAFETY: the caller's entry names only buffers that outlive this call.
    unsafe { ring.submission().push(&entry) }.map_err(|e| format!("io_uring: {e}"))?;
    ring.submit_and_wait(1).map_err(|e| format!("io_uring: {e}"))?;
    let result = ring.completion().next().map(|c| c.result());
    result.ok_or_else(|| "io_uring: no completion".into())
}

/// A thread with a file table of its own (unshare(CLONE_FILES)) closes its copy of the UVM fd
/// and opens /proc/version under the same number, then sends a UVM command on it; another thread
/// closes it with close_range(CLOSE_RANGE_UNSHARE), which closes in a copy of its own table;
/// the process's own fd stays open, and a UVM command goes on it before and after.
fn own_table() -> Result<(), String> {
    let uvm = File::options().read(true).write(true).open("/dev/nvidia-uvm").map_err(|e| format!("/dev/nvidia-uvm: {e}"))?;
    let fd = uvm.as_raw_fd();
    uvm_free(fd);
    let thread = std::thread::spawn(move || -> Result<(), String> {
        // SAFETY: unshare and close touch only this thread's fd table.
        if unsafe { libc::unshare(libc::CLONE_FILES) } != 0 {
            return Err(format!("unshare(CLONE_FILES): {}", std::io::Error::last_os_error()));
        }
        unsafe { libc::close(fd) };
        let other = File::open("/proc/version").map_err(|e| format!("/proc/version: {e}"))?;
        if other.as_raw_fd() != fd {
            return Err(format!("the thread's new file got fd {}, not {fd}", other.as_raw_fd()));
        }
        uvm_free(fd);
        Ok(())
    });
    thread.join().map_err(|_| "the thread panicked")??;
    let unsharing = std::thread::spawn(move || {
        // SAFETY: closes fd in a copy of this thread's table; nothing else is touched.
        unsafe { libc::syscall(libc::SYS_close_range, fd as libc::c_uint, fd as libc::c_uint, libc::CLOSE_RANGE_UNSHARE) }
    });
    let closed = unsharing.join().map_err(|_| "the close_range thread panicked")?;
    if closed != 0 {
        return Err(format!("close_range(CLOSE_RANGE_UNSHARE) gave {closed}: {}", std::io::Error::last_os_error()));
    }
    uvm_free(fd);
    // Held to the end: the process's exit closes it.
    std::mem::forget(uvm);
    Ok(())
}

/// An RM_FREE on `fd`: the device answers or refuses, nothing else is touched.
fn rm_free(fd: i32) {
    let mut params = [0u8; 16];
    // SAFETY: an NVOS00-sized buffer.
    unsafe { libc::ioctl(fd, rm_cmd(esc::RM_FREE, 16) as _, params.as_mut_ptr()) };
}

/// A fd answered not NVIDIA (/proc/version, asked about at its first RM command) closed and
/// reopened as /dev/nvidia0 under the same number, both by io_uring (no tracepoint sees
/// either), then an RM command on it.
fn reopen() -> Result<(), String> {
    let mut ring = ring()?;
    let fd = std::os::fd::IntoRawFd::into_raw_fd(File::open("/proc/version").map_err(|e| format!("/proc/version: {e}"))?);
    rm_free(fd);
    // The tracer's answer (not NVIDIA) lands before the number is reused.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let closed = io_uring_once(&mut ring, io_uring::opcode::Close::new(io_uring::types::Fd(fd)).build())?;
    if closed != 0 {
        return Err(format!("io_uring's close of fd {fd} gave {closed}"));
    }
    let path = c"/dev/nvidia0";
    let open = io_uring::opcode::OpenAt::new(io_uring::types::Fd(libc::AT_FDCWD), path.as_ptr()).flags(libc::O_RDWR).build();
    let reopened = io_uring_once(&mut ring, open)?;
    if reopened != fd {
        return Err(format!("io_uring's open of /dev/nvidia0 gave {reopened}, not {fd}"));
    }
    rm_free(fd);
    // Held while the tracer asks /proc about it, as a program holds the files it uses.
    std::thread::sleep(std::time::Duration::from_millis(300));
    Ok(())
}

/// A GPU's device opened for reading only and close-on-exec (std's default), which NVIDIA's
/// libraries never do, and a dup of it made before any command: an RM command on the dup, closed
/// at once (before the tracer could read anything of it in /proc), then one on the first fd.
/// Then the device opened again for reading and writing without close-on-exec, as NVIDIA's
/// libraries open it, a command on that, and its close-on-exec flag set by ioctl(FIOCLEX).
fn by_number() -> Result<(), String> {
    let gpu = File::open("/dev/nvidia0").map_err(|e| format!("/dev/nvidia0: {e}"))?;
    // SAFETY: dup(2) of a fd this function holds, open(2) of a C string, and close(2) of what
    // they returned.
    let dup = unsafe { libc::dup(gpu.as_raw_fd()) };
    if dup < 0 {
        return Err(format!("dup: {}", std::io::Error::last_os_error()));
    }
    rm_free(dup);
    unsafe { libc::close(dup) };
    // Built at run time, as libraries build device paths: a literal in a page of the binary not
    // yet touched cannot be read by the kernel side at the open's entry, which may not fault it
    // in, and the open would then be found only at its first command.
    let path = std::ffi::CString::new("/dev/nvidia0").map_err(|e| e.to_string())?;
    let read_write = unsafe { libc::open(path.as_ptr(), libc::O_RDWR) };
    if read_write < 0 {
        return Err(format!("/dev/nvidia0 for reading and writing: {}", std::io::Error::last_os_error()));
    }
    rm_free(gpu.as_raw_fd());
    rm_free(read_write);
    // Close-on-exec set by ioctl, as fcntl(F_SETFD) sets it.
    unsafe { libc::ioctl(read_write, libc::FIOCLEX) };
    unsafe { libc::close(read_write) };
    Ok(())
}

/// A GPU's device opened for reading and writing from a path in a page not faulted in yet (a
/// syscall tracepoint cannot read it; the open faults it in), a dup of it, the dup closed, then
/// an RM command on the first fd. Then, the same way, a memfd opened again through
/// /proc/self/fd: not NVIDIA's.
fn unread_path() -> Result<(), String> {
    let gpu = open_from_untouched_page("/dev/nvidia0")?;
    // SAFETY: dup(2) and close(2) of the fd just opened.
    let dup = unsafe { libc::dup(gpu) };
    if dup < 0 {
        return Err(format!("dup: {}", std::io::Error::last_os_error()));
    }
    unsafe { libc::close(dup) };
    rm_free(gpu);
    // SAFETY: memfd_create(2) of a C string; the fd is closed at exit.
    let memfd = unsafe { libc::memfd_create(c"other".as_ptr(), 0) };
    if memfd < 0 {
        return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
    }
    open_from_untouched_page(&format!("/proc/self/fd/{memfd}"))?;
    Ok(())
}

/// A GPU's device opened by openat2(2), for reading and writing and close-on-exec, its
/// `struct open_how` in a page not faulted in yet (its flags cannot be read at the entry), a dup
/// of it, the dup closed, then an RM command on the first fd. Then a regular file at
/// `dev/nvidia0` of a directory of its own, opened by openat2 with RESOLVE_IN_ROOT as
/// "/dev/nvidia0" and sent a command, and the GPU's device opened again with O_PATH (no command
/// can be sent on that fd): neither is NVIDIA's device. Run where /dev is a tmpfs of the test's
/// own (the directory is made there, not in a /tmp other users share).
fn openat2() -> Result<(), String> {
    let open = |dir: i32, path: &str, flags: i32, resolve: u64, untouched: bool| -> Result<i32, String> {
        let path_c = std::ffi::CString::new(path).map_err(|e| e.to_string())?;
        // SAFETY: an open_how is plain integers.
        let mut how: libc::open_how = unsafe { std::mem::zeroed() };
        how.flags = flags as u64;
        how.resolve = resolve;
        // SAFETY: an open_how's bytes, read as such.
        let bytes = unsafe { std::slice::from_raw_parts((&how as *const libc::open_how).cast::<u8>(), size_of::<libc::open_how>()) };
        let how_at = if untouched { untouched_copy(bytes, "the open_how")? } else { bytes.as_ptr() };
        // SAFETY: openat2(2) of a C string and an open_how of the size given, alive for the call.
        let fd = unsafe { libc::syscall(libc::SYS_openat2, dir, path_c.as_ptr(), how_at, size_of::<libc::open_how>()) } as i32;
        if fd < 0 {
            return Err(format!("openat2 of {path}: {}", std::io::Error::last_os_error()));
        }
        Ok(fd)
    };
    let gpu = open(libc::AT_FDCWD, "/dev/nvidia0", libc::O_RDWR | libc::O_CLOEXEC, 0, true)?;
    // SAFETY: dup(2) and close(2) of the fd just opened.
    let dup = unsafe { libc::dup(gpu) };
    if dup < 0 {
        return Err(format!("dup: {}", std::io::Error::last_os_error()));
    }
    unsafe { libc::close(dup) };
    rm_free(gpu);
    let root = std::path::Path::new("/dev/gputrace-openat2");
    let made = std::fs::create_dir(root).and_then(|()| std::fs::create_dir(root.join("dev")));
    made.and_then(|()| File::create_new(root.join("dev/nvidia0"))).map_err(|e| format!("{}: {e}", root.display()))?;
    let dir = File::open(root).map_err(|e| format!("{}: {e}", root.display()))?;
    rm_free(open(dir.as_raw_fd(), "/dev/nvidia0", libc::O_RDWR, libc::RESOLVE_IN_ROOT, false)?);
    // SAFETY: open(2) of a C string.
    if unsafe { libc::open(c"/dev/nvidia0".as_ptr(), libc::O_PATH | libc::O_RDWR) } < 0 {
        return Err(format!("/dev/nvidia0 with O_PATH: {}", std::io::Error::last_os_error()));
    }
    // Held while the tracer asks /proc about them (by path alone, the GPU's device is found so).
    std::thread::sleep(std::time::Duration::from_millis(300));
    Ok(())
}

/// Opens `path` for reading and writing, passing the open a copy of it in a page not faulted in
/// yet ([`untouched_copy`]): the open's own copy faults it in.
fn open_from_untouched_page(path: &str) -> Result<i32, String> {
    let bytes = std::ffi::CString::new(path).map_err(|e| e.to_string())?;
    let at = untouched_copy(bytes.as_bytes_with_nul(), path)?;
    // SAFETY: open(2) of a string in a mapping left to the process's exit, which holds its
    // terminating NUL.
    let opened = unsafe { libc::open(at.cast(), libc::O_RDWR) };
    if opened < 0 {
        return Err(format!("{path} for reading and writing: {}", std::io::Error::last_os_error()));
    }
    Ok(opened)
}

/// A copy of `bytes` (`what`) in a shared mapping of a memfd that nothing has read yet: its page
/// is not present until something faults it in, which a syscall tracepoint cannot. A mapping of
/// its own, so that no earlier fault mapped it around another page. Left to the process's exit.
fn untouched_copy(bytes: &[u8], what: &str) -> Result<*const u8, String> {
    // SAFETY: memfd_create(2) of a C string, write(2) of a buffer the caller holds, mmap(2) of
    // that fd.
    unsafe {
        let fd = libc::memfd_create(c"untouched".as_ptr(), 0);
        if fd < 0 || libc::write(fd, bytes.as_ptr().cast(), bytes.len()) != bytes.len() as isize {
            return Err(format!("the memfd for {what}: {}", std::io::Error::last_os_error()));
        }
        let page = libc::mmap(std::ptr::null_mut(), bytes.len(), libc::PROT_READ, libc::MAP_SHARED, fd, 0);
        if page == libc::MAP_FAILED {
            return Err(format!("mmap of the memfd for {what}: {}", std::io::Error::last_os_error()));
        }
        if page_present(page as u64)? {
            return Err(format!("the page holding {what} is present before the open: the test would not test anything"));
        }
        Ok(page.cast())
    }
}

/// Whether the page at `addr` is mapped in (bit 63 of its /proc/self/pagemap entry), read
/// without touching it.
fn page_present(addr: u64) -> Result<bool, String> {
    use std::os::unix::fs::FileExt;
    // SAFETY: sysconf(3) has no preconditions.
    let page_size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    let mut entry = [0u8; 8];
    File::open("/proc/self/pagemap")
        .and_then(|f| f.read_exact_at(&mut entry, addr / page_size * 8))
        .map_err(|e| format!("/proc/self/pagemap: {e}"))?;
    Ok(u64::from_le_bytes(entry) >> 63 == 1)
}

/// A fd the tracer answered not NVIDIA (/proc/version, asked about at its first UVM command),
/// closed, its number taken by a GPU's device opened for reading only; on that, a command
/// followed on UVM's device only (not on a GPU's), an XFER wrapping an escape not followed
/// (NV_ESC_CARD_INFO), then an RM command, which is to be recorded.
fn unfollowed_first() -> Result<(), String> {
    let fd = std::os::fd::IntoRawFd::into_raw_fd(File::open("/proc/version").map_err(|e| format!("/proc/version: {e}"))?);
    uvm_free(fd);
    // The tracer's answer (not NVIDIA) lands before the number is reused.
    std::thread::sleep(std::time::Duration::from_millis(300));
    // SAFETY: close(2) of the fd taken above.
    unsafe { libc::close(fd) };
    let gpu = File::open("/dev/nvidia0").map_err(|e| format!("/dev/nvidia0: {e}"))?;
    if gpu.as_raw_fd() != fd {
        return Err(format!("/dev/nvidia0 got fd {}, not {fd}", gpu.as_raw_fd()));
    }
    uvm_free(fd);
    let mut info = [0u8; 16];
    let mut xfer = [0u8; 16];
    xfer[..4].copy_from_slice(&0xc8u32.to_le_bytes());
    xfer[4..8].copy_from_slice(&16u32.to_le_bytes());
    xfer[8..].copy_from_slice(&(info.as_mut_ptr() as u64).to_le_bytes());
    // SAFETY: an XFER-sized buffer naming a 16-byte one, both alive for the call.
    unsafe { libc::ioctl(fd, rm_cmd(esc::XFER, 16) as _, xfer.as_mut_ptr()) };
    rm_free(fd);
    Ok(())
}

/// /dev/nvidiactl and /dev/nvidia-uvm opened for reading and writing, as NVIDIA's libraries
/// open them, and a command on each: in the test's mount namespace they are other devices.
fn impostor() -> Result<(), String> {
    let open = |path: &str| File::options().read(true).write(true).open(path).map_err(|e| format!("{path}: {e}"));
    let (ctl, uvm) = (open("/dev/nvidiactl")?, open("/dev/nvidia-uvm")?);
    rm_free(ctl.as_raw_fd());
    uvm_free(uvm.as_raw_fd());
    // Held while the tracer asks /proc about them, as a program holds the files it uses.
    std::thread::sleep(std::time::Duration::from_millis(300));
    Ok(())
}

/// Two threads whose thread numbers share a slot of the kernel side's calls in flight
/// (tracer_common::CALL_SLOTS), each inside an RM_FREE at the same time: the first frees the
/// fake driver's slow handle (answered after 500 ms), the second, 100 ms into it, a buffer of
/// its own. Both calls are to be recorded, each with its own params.
fn collide(truth: &mut Truth) -> Result<(), String> {
    use std::sync::mpsc::channel;
    let mut gpu = Gpu::open(0)?;
    let buffer = truth.alloc(&mut gpu, Path::RmAlloc, GIB).ok_or("RmAlloc failed")?;
    // SAFETY: gettid has no preconditions.
    let tid = || unsafe { libc::gettid() } as u32;
    let slot = |tid: u32| tid % tracer_common::CALL_SLOTS;
    std::thread::scope(|scope| {
        let gpu = &gpu;
        let (first_tid, first_go) = (channel(), channel::<()>());
        let first = scope.spawn(move || {
            first_tid.0.send(tid()).ok();
            first_go.1.recv().ok();
            gpu.free_handle(fakegpu::driver::SLOW_FREE_HANDLE, false)
        });
        let first_tid = first_tid.1.recv().map_err(|e| e.to_string())?;
        let first_slot = slot(first_tid);
        // Threads come and go until one gets a number of the first one's slot (the kernel hands
        // them out in turn, so within CALL_SLOTS of them where pid_max is larger).
        let (second_go_tx, second_go_rx) = channel::<()>();
        let mut second_go = Some(second_go_rx);
        let mut second = None;
        for _ in 0..4 * tracer_common::CALL_SLOTS {
            let (mine_tx, mine_rx) = channel();
            let go = second_go.take().expect("kept until a thread takes it");
            let buffer = &buffer;
            let thread = scope.spawn(move || {
                let mine = slot(tid()) == first_slot;
                mine_tx.send(mine).ok();
                if !mine {
                    return (go, None);
                }
                let _ = go.recv();
                (go, Some(gpu.free(buffer)))
            });
            if mine_rx.recv().map_err(|e| e.to_string())? {
                second = Some(thread);
                break;
            }
            let (go, _) = thread.join().map_err(|_| "a thread panicked")?;
            second_go = Some(go);
        }
        let second = second.ok_or("no thread number shares the first one's slot (is pid_max above CALL_SLOTS?)")?;
        first_go.0.send(()).ok();
        // The second goes once the first is inside its free (blocked in the ioctl, its call
        // taken into the slot at the syscall's entry), however long a busy host took to get it
        // there.
        in_ioctl(first_tid)?;
        second_go_tx.send(()).ok();
        let (_, freed) = second.join().map_err(|_| "the second thread panicked")?;
        freed.expect("the sharing thread frees").map_err(|s| format!("the buffer's free failed: {s:?}"))?;
        first.join().map_err(|_| "the first thread panicked")?.map_err(|s| format!("the slow free failed: {s:?}"))
    })
}

/// Waits until thread `tid` of this process is blocked in an ioctl (its /proc syscall file names
/// the call), 10 s at most.
fn in_ioctl(tid: u32) -> Result<(), String> {
    let path = format!("/proc/self/task/{tid}/syscall");
    let ioctl = libc::SYS_ioctl.to_string();
    for _ in 0..10_000 {
        let now = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
        if now.split_whitespace().next() == Some(ioctl.as_str()) {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    Err(format!("thread {tid} was not in an ioctl within 10 s"))
}

fn oom(truth: &mut Truth, bytes: u64) -> Result<(), String> {
    let mut gpu = Gpu::open(0)?;
    truth.alloc(&mut gpu, Path::RmAlloc, GIB).ok_or("first alloc failed")?;
    match truth.alloc(&mut gpu, Path::RmAlloc, bytes) {
        Some(_) => Err("the oversized allocation unexpectedly fit".into()),
        None => Err("CUDA out of memory".into()),
    }
}

fn hold(truth: &mut Truth, ms: u64, host_mib: usize) -> Result<(), String> {
    let mut gpu = Gpu::open(0)?;
    let first = truth.alloc(&mut gpu, Path::RmAlloc, 2 * GIB).ok_or("alloc failed")?;
    // Host memory, every page written: what the OOM killer counts.
    let host = vec![1u8; host_mib << 20];
    truth.note("host", "", host.len() as u64, 0, 0);
    std::thread::sleep(std::time::Duration::from_millis(ms));
    truth.alloc(&mut gpu, Path::VidHeap, GIB).ok_or("alloc failed")?;
    gpu.free(&first).map_err(|s| format!("free: {s:#x}"))?;
    truth.note("free", "RmFree", first.bytes, first.handle, 0);
    std::thread::sleep(std::time::Duration::from_millis(200));
    drop(host);
    Ok(())
}

/// A message of one buffer with room for `fds` file descriptors of ancillary data. The iovec and
/// control buffer must outlive the returned header.
fn message(iov: &mut libc::iovec, control: &mut Vec<u8>, fds: usize) -> libc::msghdr {
    // SAFETY: CMSG_SPACE is arithmetic; the header points at buffers the caller keeps alive.
    let space = unsafe { libc::CMSG_SPACE((fds * 4) as u32) } as usize;
    control.resize(space, 0);
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space;
    msg
}

/// SCM_RIGHTS: the fds go as ancillary data, `payload` as the message.
fn send_fds(socket: i32, fds: &[i32], payload: &[u8]) -> Result<(), String> {
    let mut control = Vec::new();
    let mut iov = libc::iovec { iov_base: payload.as_ptr() as *mut libc::c_void, iov_len: payload.len() };
    let msg = message(&mut iov, &mut control, fds.len());
    // SAFETY: the CMSG macros walk the control buffer `message` sized.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN((fds.len() * 4) as u32) as usize;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg) as *mut i32, fds.len());
        if libc::sendmsg(socket, &msg, 0) < 0 {
            return Err(format!("sendmsg: {}", std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

fn receive_fds(socket: i32, count: usize, payload: &mut [u8]) -> Result<Vec<i32>, String> {
    let mut control = Vec::new();
    let mut iov = libc::iovec { iov_base: payload.as_mut_ptr().cast(), iov_len: payload.len() };
    let mut msg = message(&mut iov, &mut control, count);
    // SAFETY: as in send_fds; MSG_CMSG_CLOEXEC keeps them out of anything we exec.
    unsafe {
        if libc::recvmsg(socket, &mut msg, libc::MSG_CMSG_CLOEXEC) < 0 {
            return Err(format!("recvmsg: {}", std::io::Error::last_os_error()));
        }
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null() || (*cmsg).cmsg_type != libc::SCM_RIGHTS {
            return Err("no fds arrived".into());
        }
        let mut fds = vec![0i32; count];
        std::ptr::copy_nonoverlapping(libc::CMSG_DATA(cmsg) as *const i32, fds.as_mut_ptr(), count);
        Ok(fds)
    }
}

fn pass_fd(truth: &mut Truth) -> Result<(), String> {
    let mut gpu = Gpu::open(0)?;
    truth.alloc(&mut gpu, Path::RmAlloc, 2 * GIB).ok_or("alloc failed")?;
    let (socket, mut receiver) = start_peer(&["receive"])?;
    let mut payload = [0u8; 12];
    payload[0..4].copy_from_slice(&gpu.client.to_le_bytes());
    payload[4..8].copy_from_slice(&gpu.device.to_le_bytes());
    payload[8..12].copy_from_slice(&gpu.version_major().to_le_bytes());
    send_fds(socket, &[gpu.ctl.as_raw_fd(), gpu.gpu_file.as_raw_fd(), gpu.uvm.as_raw_fd()], &payload)?;
    let mut ack = [0u8; 1];
    // SAFETY: read one byte from our end.
    unsafe { libc::read(socket, ack.as_mut_ptr().cast(), 1) };
    truth.note("sent", "", 0, receiver.id(), 0);
    // Exit without waiting: the receiver holds the files now.
    let _ = receiver.try_wait();
    Ok(())
}

/// A socketpair and this program started as `args` with the other end as `--socket N` (and its
/// own truth file beside ours); returns our end and the child.
fn start_peer(args: &[&str]) -> Result<(i32, std::process::Child), String> {
    let mut pair = [0; 2];
    // SAFETY: socketpair fills two fds; ours is close-on-exec, the peer's end is inherited.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0, pair.as_mut_ptr()) } != 0 {
        return Err("socketpair failed".into());
    }
    unsafe { libc::fcntl(pair[1], libc::F_SETFD, 0) };
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    args.extend(["--socket".into(), pair[1].to_string()]);
    if let Some(path) = std::env::args().skip_while(|a| a != "--truth").nth(1) {
        args.extend(["--truth".into(), format!("{path}.receiver")]);
    }
    let child = std::process::Command::new(me).args(&args).spawn().map_err(|e| e.to_string())?;
    unsafe { libc::close(pair[1]) };
    Ok((pair[0], child))
}

fn ipc(truth: &mut Truth, ms: u64, (close_first, batched, in_flight): (bool, bool, bool)) -> Result<(), String> {
    let mut gpu = Gpu::open(0)?;
    let buffer = truth.alloc(&mut gpu, Path::RmAlloc, 3 * GIB).ok_or("alloc failed")?;
    let share = if batched { gpu.export_batched(&buffer) } else { gpu.export(&buffer) };
    let share = share.map_err(|s| format!("export: {s:#x}"))?;
    truth.note("exported", "RmControl", buffer.bytes, buffer.handle, 0);
    let ms = ms.to_string();
    let mut peer = vec!["import", "--ms", &ms];
    peer.extend(close_first.then_some("--close-first"));
    peer.extend(batched.then_some("--batched"));
    let (socket, importer) = start_peer(&peer)?;
    send_fds(socket, &[share.as_raw_fd()], &[0u8; 12])?;
    // In flight over the socket, held by no process until the importer receives it.
    let share = (!in_flight).then_some(share);
    let mut ack = [0u8; 1];
    // SAFETY: read one byte from our end: the importer has its handle.
    unsafe { libc::read(socket, ack.as_mut_ptr().cast(), 1) };
    drop(share);
    gpu.free(&buffer).map_err(|s| format!("free: {s:#x}"))?;
    truth.note("release_exported", "RmFree", buffer.bytes, buffer.handle, 0);
    truth.note("sent", "", 0, importer.id(), 0);
    Ok(())
}

fn import(truth: &mut Truth, socket: i32, ms: u64, close_first: bool, batched: bool) -> Result<(), String> {
    use std::os::fd::FromRawFd;
    let gpu = Gpu::open(0)?;
    let fds = receive_fds(socket, 1, &mut [0u8; 12])?;
    // SAFETY: the fd just arrived and is ours alone.
    let share = unsafe { File::from_raw_fd(fds[0]) };
    // Settled first (the recorder has read its fork and copied its fds): what follows is then
    // judged by the kernel's word alone.
    std::thread::sleep(std::time::Duration::from_millis(250));
    let handle = if batched { gpu.import_batched(&share) } else { gpu.import(&share) };
    let handle = handle.map_err(|s| format!("import: {s:#x}"))?;
    // Closed within microseconds of the import, long before a recorder reads its record.
    let share = match close_first {
        true => {
            drop(share);
            None
        }
        false => Some(share),
    };
    truth.note("imported", "RmControl", 0, handle, 0);
    if share.is_none() {
        truth.note("close_share", "", 0, 0, 0);
    }
    unsafe { libc::write(socket, b"!".as_ptr().cast(), 1) };
    std::thread::sleep(std::time::Duration::from_millis(ms));
    gpu.free_handle(handle, false).map_err(|s| format!("free: {s:#x}"))?;
    truth.note("free_import", "RmFree", 0, handle, 0);
    std::thread::sleep(std::time::Duration::from_millis(100));
    if let Some(share) = share {
        drop(share);
        truth.note("close_share", "", 0, 0, 0);
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    Ok(())
}

fn receive(truth: &mut Truth, socket: i32) -> Result<(), String> {
    use std::os::fd::FromRawFd;
    let mut payload = [0u8; 12];
    let fds = receive_fds(socket, 3, &mut payload)?;
    let word = |i: usize| u32::from_le_bytes(payload[i..i + 4].try_into().unwrap());
    let version = format!("{}.0.0", word(8));
    // SAFETY: the fds just arrived and are ours alone.
    let (ctl, gpu0, uvm) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1]), File::from_raw_fd(fds[2])) };
    let mut gpu = Gpu::adopt(&version, ctl, gpu0, uvm, word(0), word(4));
    truth.alloc(&mut gpu, Path::RmAlloc, GIB).ok_or("alloc on received fds failed")?;
    unsafe { libc::write(socket, b"!".as_ptr().cast(), 1) };
    std::thread::sleep(std::time::Duration::from_millis(700));
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let close_first = args.iter().any(|a| a == "--close-first");
    let batched = args.iter().any(|a| a == "--batched");
    let mut truth = Truth(value("--truth").map(|p| File::create(p).expect("creating the truth file")));
    let result = match args.first().map(String::as_str) {
        Some("paths") => paths(&mut truth),
        Some("fork-holder") => fork_holder(&mut truth, value("--hold-ms").and_then(|v| v.parse().ok()).unwrap_or(500)),
        Some("storm") => storm(value("--count").and_then(|v| v.parse().ok()).unwrap_or(1_000_000)),
        Some("pass-fd") => pass_fd(&mut truth),
        Some("receive") => receive(&mut truth, value("--socket").and_then(|v| v.parse().ok()).unwrap_or(-1)),
        Some("hold") => hold(
            &mut truth,
            value("--ms").and_then(|v| v.parse().ok()).unwrap_or(1000),
            value("--host-mib").and_then(|v| v.parse().ok()).unwrap_or(0),
        ),
        Some("ipc") => ipc(
            &mut truth,
            value("--ms").and_then(|v| v.parse().ok()).unwrap_or(300),
            (close_first, batched, args.iter().any(|a| a == "--in-flight")),
        ),
        Some("import") => import(
            &mut truth,
            value("--socket").and_then(|v| v.parse().ok()).unwrap_or(-1),
            value("--ms").and_then(|v| v.parse().ok()).unwrap_or(300),
            close_first,
            batched,
        ),
        Some("fabric") => {
            fabric(&mut truth, value("--ms").and_then(|v| v.parse().ok()).unwrap_or(300), args.iter().any(|a| a == "--multicast"))
        }
        Some("vmm") => vmm(&mut truth, value("--ms").and_then(|v| v.parse().ok()).unwrap_or(300)),
        Some("repoint") => repoint(),
        Some("classes") => classes(&mut truth),
        Some("own-table") => own_table(),
        Some("reopen") => reopen(),
        Some("by-number") => by_number(),
        Some("impostor") => impostor(),
        Some("unread-path") => unread_path(),
        Some("openat2") => openat2(),
        Some("unfollowed-first") => unfollowed_first(),
        Some("collide") => collide(&mut truth),
        Some("oom") => oom(&mut truth, value("--bytes").and_then(|v| parse_bytes(&v)).unwrap_or(1 << 40)),
        _ => Err(
            "usage: fake-workload paths|fork-holder|storm|oom|hold|vmm|fabric|pass-fd|ipc|repoint|own-table|reopen|by-number|unread-path|openat2|impostor|unfollowed-first|collide|classes [--close-first] [--batched] [--in-flight] [--multicast] [--truth FILE] [--hold-ms N] [--count N] [--bytes B] [--ms N]"
                .into(),
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fake-workload: {e}");
            ExitCode::from(1)
        }
    }
}

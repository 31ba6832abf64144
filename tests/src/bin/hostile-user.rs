//! What a hostile local user runs against a root daemon, for the tests of tests/tests/hostile.rs.
//!
//! `hostile-user freeze DIR`, run as an unprivileged user inside `unshare -Urm` (a user and mount
//! namespace of their own): a process whose /proc/PID/cmdline can never be read. It mounts a FUSE
//! filesystem of its own at DIR whose reads are never answered, and forks; the child maps a file
//! of it, reads that mapping through /proc/self/mem (the kernel faults it in holding the child's
//! memory-map lock, and waits for the read forever), and queues an mmap behind that lock: every
//! later reader of its command line (which takes the same lock) blocks in the kernel. The child
//! also holds a file at /dev/nvidiactl (a tmpfs of its own over /dev), so it is a GPU holder to
//! /proc scans. The parent serves the filesystem and prints `frozen PID` once the child is set.
//! A line on standard input makes the frozen child start a process sharing its memory (clone
//! with CLONE_VM: no lock needed), as a fork of it would appear to a tracer. Killing the parent
//! closes the filesystem, which lets every blocked read go.
//!
//! `hostile-user flood PORT SECONDS`: twelve threads open connections to 127.0.0.1:PORT as fast
//! as they can for SECONDS, each keeping its last ten open and sending nothing.
//!
//! `hostile-user idle-unix SOCKET N SECONDS`: opens N connections to the Unix socket that send
//! nothing, prints `connected N` and holds them for SECONDS.
//!
//! `hostile-user crowd PORT N`: opens N connections to 127.0.0.1:PORT that send nothing, then
//! one more that asks for /metrics, prints the first line of its answer (or why there is none)
//! and exits.
//!
//! `hostile-user listens SECONDS`: calls listen(2) on a TCP socket of its own in a loop for
//! SECONDS (each call a record from the kernel side of a watch of the whole host).
//!
//! `hostile-user hold ADDR`: listens on ADDR (before a root daemon that wants it), until killed.
//! With HOSTILE_HOLD=ADDR in its environment it does so whatever its arguments: a copy of
//! someone else's command line (`exec -a sleep hostile-user 600`) that listens.
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::Duration;

use fakegpu::fuse::{Caller, Files, IoctlReply, Reads, Session};

/// A filesystem of one large file whose reads are answered as `reads` says.
struct Hostile {
    reads: Reads,
}

impl Files for Hostile {
    fn names(&self) -> &[(&'static str, u64)] {
        &[("page", 2)]
    }
    fn open(&mut self, _: Caller, _: u64) -> u64 {
        1
    }
    fn ioctl(&mut self, _: Caller, _: u64, _: u32, _: u64, _: &[u8], _: u32) -> IoctlReply {
        IoctlReply { result: -libc::ENOTTY, out: Vec::new() }
    }
    fn release(&mut self, _: Caller, _: u64) {}
    fn reads(&self) -> Reads {
        self.reads
    }
}

const STACK: usize = 64 << 10;

/// The CLONE_VM child: never returns, touches nothing it has not touched before.
extern "C" fn share_and_wait(arg: *mut libc::c_void) -> libc::c_int {
    if arg.is_null() {
        // The rehearsal before freezing: this code's page and the syscall wrapper faulted in.
        return 0;
    }
    loop {
        // SAFETY: pause(2) through the raw wrapper.
        unsafe { libc::syscall(libc::SYS_pause) };
    }
}

fn clone_vm(stack: &mut [u8], arg: *mut libc::c_void) -> i32 {
    // SAFETY: clone(3) with a stack this process owns and keeps; the child shares the memory and
    // runs only `share_and_wait`.
    unsafe { libc::clone(share_and_wait, stack.as_mut_ptr().add(stack.len()).cast(), libc::CLONE_VM | libc::SIGCHLD, arg) }
}

fn fail(what: &str) -> ! {
    eprintln!("hostile-user: {what}: {}", std::io::Error::last_os_error());
    std::process::exit(2)
}

/// With `stretches`, the lock is held in stretches of that long instead of for good (each read
/// answered after it, a new page faulted at once), and the child starts a process sharing its
/// memory a hundred times a second: no single read of its command line is ever late, each is
/// slow.
fn freeze(dir: &Path, stretches: Option<Duration>) -> ! {
    let session = Session::mount(dir).unwrap_or_else(|e| {
        eprintln!("hostile-user: {e:#}");
        std::process::exit(2)
    });
    let c = |s: &str| std::ffi::CString::new(s).unwrap();
    // A /dev of its own, with a file at NVIDIA's control device's path.
    // SAFETY: mount(2) with valid C strings, in this process's own mount namespace.
    if unsafe { libc::mount(c("tmpfs").as_ptr(), c("/dev").as_ptr(), c("tmpfs").as_ptr(), 0, std::ptr::null()) } != 0 {
        fail("mounting a tmpfs over /dev");
    }
    std::fs::write("/dev/nvidiactl", b"").unwrap_or_else(|_| fail("creating /dev/nvidiactl"));
    // SAFETY: fork(2) while single-threaded.
    let child = unsafe { libc::fork() };
    if child < 0 {
        fail("fork");
    }
    if child > 0 {
        let mut session = session;
        std::thread::spawn(move || {
            // Until the child's mmap is queued: then its lock is held for good.
            std::thread::sleep(Duration::from_millis(1500));
            println!("frozen {child}");
            let _ = std::io::stdout().flush();
        });
        let reads = stretches.map_or(Reads::Never, Reads::After);
        let _ = session.serve(&mut Hostile { reads });
        std::process::exit(0);
    }
    // The child: no handle on the filesystem's connection, so the parent's death ends it.
    drop(session);
    let holder = std::fs::File::open("/dev/nvidiactl").unwrap_or_else(|_| fail("opening /dev/nvidiactl"));
    std::mem::forget(holder);
    let page = std::fs::File::open(dir.join("page")).unwrap_or_else(|_| fail("opening the FUSE file"));
    // SAFETY: a shared read-only mapping of an open file; never touched directly.
    let at = unsafe { libc::mmap(std::ptr::null_mut(), MAPPED, libc::PROT_READ, libc::MAP_SHARED, page.as_raw_fd(), 0) };
    if at == libc::MAP_FAILED {
        fail("mapping the FUSE file");
    }
    let mut stack = vec![1u8; STACK];
    // Rehearsed before the freeze, so the clone after it needs no page it has not touched.
    let rehearsal = clone_vm(&mut stack, std::ptr::null_mut());
    if rehearsal < 0 {
        fail("clone");
    }
    // SAFETY: waitpid(2) on the child just made.
    unsafe { libc::waitpid(rehearsal, std::ptr::null_mut(), 0) };
    let address = at as u64;
    if stretches.is_some() {
        in_stretches(address, &mut stack);
    }
    std::thread::spawn(move || {
        let mem = std::fs::File::open("/proc/self/mem").unwrap_or_else(|_| fail("opening /proc/self/mem"));
        let mut byte = [0u8; 1];
        // Faults the FUSE page in holding this process's memory-map lock: never returns.
        std::os::unix::fs::FileExt::read_at(&mem, &mut byte, address).ok();
    });
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(500));
        // A writer queued behind the held lock: every reader after it waits too.
        // SAFETY: an anonymous mapping, never used.
        unsafe { libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
    });
    // Raw reads into a buffer on a stack already touched: nothing here may fault a page in.
    let mut line = [0u8; 64];
    loop {
        // SAFETY: read(2) into a buffer this thread owns.
        let n = unsafe { libc::read(0, line.as_mut_ptr().cast(), line.len()) };
        if n <= 0 {
            loop {
                std::thread::park();
            }
        }
        let marker = line.as_mut_ptr().cast();
        clone_vm(&mut stack, marker);
    }
}

/// How much of the FUSE file is mapped, and how far apart the pages faulted are (each beyond
/// any readahead of the one before).
const MAPPED: usize = 8 << 30;
const STRIDE: u64 = 2 << 20;

fn in_stretches(address: u64, stack: &mut [u8]) -> ! {
    // No readahead: every page is a read of its own, answered only after its stretch.
    // SAFETY: advice on a mapping this process owns.
    unsafe { libc::madvise(address as *mut libc::c_void, MAPPED, libc::MADV_RANDOM) };
    std::thread::spawn(move || {
        let mem = std::fs::File::open("/proc/self/mem").unwrap_or_else(|_| fail("opening /proc/self/mem"));
        let mut byte = [0u8; 1];
        // A fresh page each time: each read waits `stretch` for the filesystem, holding the lock.
        for page in (0..MAPPED as u64 / STRIDE).cycle() {
            std::os::unix::fs::FileExt::read_at(&mem, &mut byte, address + page * STRIDE).ok();
        }
    });
    std::thread::spawn(|| loop {
        // Writers queued behind each stretch: readers after them wait for the whole stretch.
        // SAFETY: an anonymous mapping, unmapped at once.
        unsafe {
            let m = libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
            libc::munmap(m, 4096);
        }
    });
    loop {
        // A process sharing this memory, gone at once: a fork event whose command is slow to read.
        clone_vm(stack, std::ptr::null_mut());
        // SAFETY: reaping this process's own children without waiting; a plain sleep.
        unsafe { while libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG | libc::__WALL) > 0 {} }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn flood(port: u16, seconds: u64) {
    let until = std::time::Instant::now() + Duration::from_secs(seconds);
    let threads: Vec<_> = (0..12)
        .map(|_| {
            std::thread::spawn(move || {
                let mut open = std::collections::VecDeque::new();
                while std::time::Instant::now() < until {
                    if let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                        open.push_back(s);
                        if open.len() > 10 {
                            open.pop_front();
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
}

fn crowd(port: u16, n: usize) {
    use std::io::Read;
    let idle: Vec<_> = (0..n).filter_map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).ok()).collect();
    std::thread::sleep(Duration::from_millis(100));
    let asked = std::net::TcpStream::connect(("127.0.0.1", port)).and_then(|mut s| {
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")?;
        let mut answer = Vec::new();
        s.read_to_end(&mut answer)?;
        Ok(answer)
    });
    match asked {
        Ok(answer) => println!("answer: {}", String::from_utf8_lossy(&answer).lines().next().unwrap_or("(nothing)")),
        Err(e) => println!("error: {e}"),
    }
    drop(idle);
}

fn idle_unix(socket: &str, n: usize, seconds: u64) {
    let idle: Vec<_> = (0..n).filter_map(|_| std::os::unix::net::UnixStream::connect(socket).ok()).collect();
    println!("connected {}", idle.len());
    std::thread::sleep(Duration::from_secs(seconds));
    drop(idle);
}

fn listens(seconds: u64) {
    let until = std::time::Instant::now() + Duration::from_secs(seconds);
    let Ok(socket) = std::net::TcpListener::bind("127.0.0.1:0") else { std::process::exit(2) };
    while std::time::Instant::now() < until {
        for _ in 0..1000 {
            // SAFETY: listen(2) on the socket this process holds.
            unsafe { libc::listen(socket.as_raw_fd(), 1) };
        }
    }
}

fn hold(addr: &str) -> ! {
    let listener = std::net::TcpListener::bind(addr).unwrap_or_else(|e| {
        eprintln!("hostile-user: cannot listen on {addr}: {e}");
        std::process::exit(2)
    });
    println!("holding {}", listener.local_addr().map(|a| a.to_string()).unwrap_or_default());
    let _ = std::io::stdout().flush();
    loop {
        std::thread::park();
    }
}

fn main() {
    if let Ok(addr) = std::env::var("HOSTILE_HOLD") {
        hold(&addr);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [what, dir] if what == "freeze" => freeze(Path::new(dir), None),
        [what, dir, flag, ms] if what == "freeze" && flag == "--stretches" => {
            freeze(Path::new(dir), Some(Duration::from_millis(ms.parse().unwrap_or(30))))
        }
        [what, addr] if what == "hold" => hold(addr),
        [what, port, seconds] if what == "flood" => flood(port.parse().unwrap_or(0), seconds.parse().unwrap_or(10)),
        [what, port, n] if what == "crowd" => crowd(port.parse().unwrap_or(0), n.parse().unwrap_or(4)),
        [what, seconds] if what == "listens" => listens(seconds.parse().unwrap_or(10)),
        [what, socket, n, seconds] if what == "idle-unix" => idle_unix(socket, n.parse().unwrap_or(4), seconds.parse().unwrap_or(3)),
        _ => {
            eprintln!("usage: hostile-user freeze DIR [--stretches MS]   (as an unprivileged user, inside `unshare -Urm`)");
            eprintln!("       hostile-user hold ADDR");
            std::process::exit(2)
        }
    }
}

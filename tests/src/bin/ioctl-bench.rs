//! Times a syscall in a tight loop, for the overhead benchmark (`cargo xtask bench`):
//! `ioctl-bench CASE COUNT` prints nanoseconds per call.
//! - read-zero, write-null: a 1-byte read of /dev/zero, write to /dev/null (not a socket: the
//!   cost of gputrace's read/write programs to everything that is not a followed connection);
//! - open-close: open and close /dev/null (what every process pays gputrace's openat and close
//!   programs: not an NVIDIA path, not a followed fd);
//! - null-plain: TCGETS on /dev/null, the commonest non-NVIDIA ioctl;
//! - null-nvidia-looking: an RM_ALLOC command word on /dev/null (asked about once, then one lookup);
//! - fake-gpu-free: RM_FREE of a handle that does not exist on the fake GPU's nvidiactl (a traced
//!   escape: the full record path), inside `fakegpu run`;
//! - file-nvidiactl: RM_FREE on a regular file named /dev/nvidiactl (on a tmpfs over /dev in a
//!   mount namespace of its own; root): followed and recorded as the real device's would be,
//!   with no driver behind it (the file answers ENOTTY), so the cost measured is gputrace's alone.
//! - file-nvidiactl-control: an RM_CONTROL gputrace does not follow (the commonest escape) on the
//!   same file: what a process holding NVIDIA's files pays for each call not recorded.
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::time::Instant;

use fakegpu::abi::{esc, rm_cmd};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let count: u64 = args.get(1).and_then(|c| c.parse().ok()).unwrap_or(1_000_000);
    if let Some(case @ ("read-zero" | "write-null")) = args.first().map(String::as_str) {
        let path = if case == "read-zero" { "/dev/zero" } else { "/dev/null" };
        let file = OpenOptions::new().read(true).write(true).open(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let mut byte = [0u8; 1];
        let call = |b: &mut [u8; 1]| unsafe {
            if case == "read-zero" {
                libc::read(file.as_raw_fd(), b.as_mut_ptr().cast(), 1)
            } else {
                libc::write(file.as_raw_fd(), b.as_ptr().cast(), 1)
            }
        };
        for _ in 0..1000 {
            call(&mut byte);
        }
        let start = Instant::now();
        for _ in 0..count {
            call(&mut byte);
        }
        println!("{:.1}", start.elapsed().as_nanos() as f64 / count as f64);
        return;
    }
    // Opens for reading only (most of a host's), or for reading and writing (as NVIDIA's
    // libraries open its devices, whose paths the kernel side reads).
    if let Some(case @ ("open-close" | "open-close-rw")) = args.first().map(String::as_str) {
        let path = std::ffi::CString::new("/dev/null").unwrap();
        let access = if case == "open-close" { libc::O_RDONLY } else { libc::O_RDWR };
        // SAFETY: open(2) of a C string that outlives it, and close(2) of what it returned.
        let call = || unsafe { libc::close(libc::open(path.as_ptr(), access | libc::O_CLOEXEC)) };
        for _ in 0..1000 {
            call();
        }
        let start = Instant::now();
        for _ in 0..count {
            call();
        }
        println!("{:.1}", start.elapsed().as_nanos() as f64 / count as f64);
        return;
    }
    let (path, cmd) = match args.first().map(String::as_str) {
        Some("null-plain") => ("/dev/null", 0x5401u32),
        Some("null-nvidia-looking") => ("/dev/null", rm_cmd(esc::RM_ALLOC, 48)),
        Some("fake-gpu-free") => ("/dev/nvidiactl", rm_cmd(esc::RM_FREE, 16)),
        Some("file-nvidiactl") => {
            file_nvidiactl();
            ("/dev/nvidiactl", rm_cmd(esc::RM_FREE, 16))
        }
        // NVOS54's cmd (at 8) is 0xdeadbeef below: no control gputrace follows.
        Some("file-nvidiactl-control") => {
            file_nvidiactl();
            ("/dev/nvidiactl", rm_cmd(esc::RM_CONTROL, 32))
        }
        _ => {
            eprintln!(
                "usage: ioctl-bench null-plain|null-nvidia-looking|fake-gpu-free|file-nvidiactl|file-nvidiactl-control|read-zero|write-null|open-close|open-close-rw [COUNT]"
            );
            std::process::exit(2);
        }
    };
    let file = OpenOptions::new().read(true).write(true).open(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut buf = [0u8; 64];
    buf[0..4].copy_from_slice(&0xc1d0_0001u32.to_le_bytes());
    buf[8..12].copy_from_slice(&0xdead_beefu32.to_le_bytes());
    // Warm up (and let the first question about the fd be asked and answered).
    for _ in 0..1000 {
        unsafe { libc::ioctl(file.as_raw_fd(), cmd as _, buf.as_mut_ptr()) };
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    let start = Instant::now();
    for _ in 0..count {
        unsafe { libc::ioctl(file.as_raw_fd(), cmd as _, buf.as_mut_ptr()) };
    }
    println!("{:.1}", start.elapsed().as_nanos() as f64 / count as f64);
}

/// A regular file at /dev/nvidiactl, seen by this process alone: a private mount namespace with a
/// tmpfs over /dev.
fn file_nvidiactl() {
    let c = |s: &str| std::ffi::CString::new(s).unwrap();
    // SAFETY: plain syscalls on C strings that outlive them.
    unsafe {
        assert_eq!(libc::unshare(libc::CLONE_NEWNS), 0, "unshare(CLONE_NEWNS) needs root");
        assert_eq!(libc::mount(std::ptr::null(), c("/").as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()), 0);
        assert_eq!(libc::mount(c("tmpfs").as_ptr(), c("/dev").as_ptr(), c("tmpfs").as_ptr(), 0, std::ptr::null()), 0);
    }
    std::fs::write("/dev/nvidiactl", b"").expect("creating /dev/nvidiactl on the tmpfs");
}

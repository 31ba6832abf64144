//! Times ioctl() in a tight loop, for the overhead benchmark (`cargo xtask bench`):
//! `ioctl-bench null-plain|null-nvidia-looking|fake-gpu-free COUNT` prints nanoseconds per call.
//! - null-plain: TCGETS on /dev/null, the commonest non-NVIDIA ioctl;
//! - null-nvidia-looking: an RM_ALLOC command word on /dev/null (asked about once, then one lookup);
//! - fake-gpu-free: RM_FREE of a handle that does not exist on the fake GPU's nvidiactl (a traced
//!   escape: the full record path), inside `fakegpu run`.
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::time::Instant;

use fakegpu::abi::{esc, rm_cmd};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let count: u64 = args.get(1).and_then(|c| c.parse().ok()).unwrap_or(1_000_000);
    let (path, cmd) = match args.first().map(String::as_str) {
        Some("null-plain") => ("/dev/null", 0x5401u32),
        Some("null-nvidia-looking") => ("/dev/null", rm_cmd(esc::RM_ALLOC, 48)),
        Some("fake-gpu-free") => ("/dev/nvidiactl", rm_cmd(esc::RM_FREE, 16)),
        _ => {
            eprintln!("usage: ioctl-bench null-plain|null-nvidia-looking|fake-gpu-free [COUNT]");
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

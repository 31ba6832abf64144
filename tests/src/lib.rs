//! Test equipment for gputrace: a fake NVIDIA GPU (a FUSE driver that speaks the real ioctl ABI),
//! the launcher that puts it at /dev/nvidia* in a private mount namespace, and a stand-in for
//! libcuda that the fake workloads allocate through. Never part of the gputrace binary.
pub mod abi;
pub mod cuda;
pub mod driver;
pub mod fuse;
pub mod launcher;
pub mod scenario;
pub mod serve;
pub mod truth;

/// Parses "80GiB", "512MiB", "4096" into bytes.
pub fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().ok()?;
    let shift = match unit.trim() {
        "" | "B" => 0,
        "KiB" | "K" => 10,
        "MiB" | "M" => 20,
        "GiB" | "G" => 30,
        "TiB" | "T" => 40,
        _ => return None,
    };
    n.checked_mul(1 << shift)
}

//! Builds the eBPF object (tracer-ebpf) with aya-build, after checking what that needs, so a
//! missing piece is one sentence that names the fix instead of a wall of cargo output.
use std::{path::Path, process::Command};

use anyhow::{anyhow, bail, Context as _};

fn main() {
    // A sentence, not an error with a backtrace: what is missing and the command that fixes it.
    if let Err(e) = build() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn build() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=PATH");
    let linker_ok = Command::new("bpf-linker").arg("--version").output().map(|o| o.status.success()).unwrap_or(false);
    if !linker_ok {
        bail!("bpf-linker is missing or does not load: run `cargo xtask setup` (it builds bpf-linker against this toolchain's LLVM)");
    }
    let sysroot =
        Command::new("rustup").args(["run", "stable", "rustc", "--print", "sysroot"]).output().context("running rustc --print sysroot")?;
    let sysroot = String::from_utf8_lossy(&sysroot.stdout).trim().to_string();
    if !Path::new(&sysroot).join("lib/rustlib/src/rust/library/core").exists() {
        bail!("the rust-src component is missing from {sysroot}: run `cargo xtask setup`");
    }
    // The eBPF crate needs -Z build-std=core; this lets stable do it for this inner build only.
    // SAFETY: build scripts are single-threaded.
    unsafe { std::env::set_var("RUSTC_BOOTSTRAP", "1") };
    // The kernel side is built from tracer-common too (record layouts, which commands to
    // follow): a change there must rebuild it, not only one in tracer-ebpf.
    println!("cargo:rerun-if-changed={}", Path::new(env!("CARGO_MANIFEST_DIR")).join("../tracer-common").display());
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tracer-ebpf");
    let root = root.to_str().ok_or_else(|| anyhow!("non-UTF-8 path {}", root.display()))?;
    aya_build::build_ebpf(
        [aya_build::Package { name: "tracer-ebpf", root_dir: root, ..Default::default() }],
        aya_build::Toolchain::Custom("stable"),
    )
}

//! Setup and build helpers: `cargo xtask setup | build | test | demo [SCENARIO [vllm|llama]] | bench | dist`.
//! Each command installs and builds what it needs, so a fresh machine needs nothing else.
//! Few dependencies, so it builds in seconds.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

mod dist;
mod suite;
mod vm;

type Result<T> = std::result::Result<T, String>;

const BPF_LINKER_VERSION: &str = "0.13.0";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn run(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    let status = cmd.status().map_err(|e| format!("cannot run {shown}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{shown} failed ({status})"))
    }
}

fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn is_root() -> bool {
    output(Command::new("id").arg("-u")).as_deref() == Some("0")
}

fn sysroot() -> Result<String> {
    output(Command::new("rustup").args(["run", "stable", "rustc", "--print", "sysroot"]))
        .ok_or_else(|| "rustup with a stable toolchain is needed: install it from your distribution or rustup.rs".into())
}

/// bpf-linker is usable when it runs and links the libLLVM of the toolchain's own sysroot
/// (cargo install does not notice a changed rustc, so a stale one can linger).
fn bpf_linker_ok(sysroot: &str) -> bool {
    let Some(path) = output(Command::new("sh").args(["-c", "command -v bpf-linker"])) else { return false };
    let runs = output(Command::new(&path).arg("--version")).is_some();
    let links = output(Command::new("ldd").arg(&path))
        .is_some_and(|ldd| ldd.lines().any(|l| l.contains("libLLVM") && l.contains(sysroot) && !l.contains("not found")));
    runs && links
}

/// rust-src, clippy and rustfmt for stable, and bpf-linker built against the toolchain's LLVM.
/// Changes nothing of rustup's own settings. Idempotent: a second
/// run only checks.
fn setup() -> Result<()> {
    let started = Instant::now();
    let sysroot = sysroot()?;
    if !Path::new(&sysroot).join("lib/rustlib/src/rust/library/core").exists() {
        eprintln!("xtask: installing rust-src for the stable toolchain");
        run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "stable"]))?;
    }
    // `xtask test` checks the format and lints; both come as rustup components.
    for (tool, component) in [("cargo-clippy", "clippy"), ("rustfmt", "rustfmt")] {
        if output(Command::new("rustup").args(["which", tool])).is_none() {
            eprintln!("xtask: installing {component} for the stable toolchain");
            run(Command::new("rustup").args(["component", "add", component, "--toolchain", "stable"]))?;
        }
    }
    if !bpf_linker_ok(&sysroot) {
        let version = output(Command::new("rustup").args(["run", "stable", "rustc", "-vV"])).unwrap_or_default();
        let llvm_major = version
            .lines()
            .find_map(|l| l.strip_prefix("LLVM version: "))
            .and_then(|v| v.split('.').next())
            .ok_or("cannot read the LLVM version of rustc")?
            .to_string();
        let llvm_lib = std::fs::read_dir(Path::new(&sysroot).join("lib"))
            .map_err(|e| format!("reading {sysroot}/lib: {e}"))?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .find(|name| name.starts_with("libLLVM") && name.ends_with(".so"))
            .ok_or_else(|| format!("no libLLVM*.so in {sysroot}/lib: this toolchain cannot build bpf-linker"))?;
        let llvm_lib = llvm_lib.trim_start_matches("lib").trim_end_matches(".so").to_string();
        eprintln!("xtask: building bpf-linker {BPF_LINKER_VERSION} against the toolchain's LLVM {llvm_major} (about a minute)");
        run(Command::new("cargo")
            .args(["+stable", "install", "bpf-linker", "--version", BPF_LINKER_VERSION, "--locked", "--force", "--no-default-features"])
            .args(["--features", &format!("llvm-{llvm_major},no-llvm-linking")])
            // The rpath makes it find libLLVM without LD_LIBRARY_PATH.
            .env("RUSTFLAGS", format!("-L {sysroot}/lib -l dylib={llvm_lib} -C link-arg=-Wl,-rpath,{sysroot}/lib")))?;
        if !bpf_linker_ok(&sysroot) {
            return Err("bpf-linker was built but still does not load: check `ldd $(command -v bpf-linker)`".into());
        }
    }
    eprintln!("xtask: setup ok ({:.1} s)", started.elapsed().as_secs_f64());
    Ok(())
}

/// Debian packages, each only when it is not installed yet.
fn install_packages(packages: &[&str]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| output(Command::new("dpkg-query").args(["-W", "-f=${Status}", p])).is_none_or(|s| !s.contains("ok installed")))
        .collect();
    if !missing.is_empty() {
        eprintln!("xtask: installing {} (Debian packages)", missing.join(" "));
        run(Command::new("apt-get").args(["install", "-y", "-qq"]).args(&missing).env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
    Ok(())
}

fn build() -> Result<()> {
    setup()?;
    run(Command::new("cargo").current_dir(root()).args(["build", "--quiet", "--release"]))
}

fn bin(name: &str) -> PathBuf {
    root().join("target/release").join(name)
}

/// The Debian packages the root-only tests use, installed when their command is missing.
fn install_test_tools() -> Result<()> {
    let tools: [(&str, &[&str], &str); 2] = [
        ("chromium", &["chromium", "chromium-driver"], "the HTML report's test renders it in headless Chromium"),
        ("prometheus", &["prometheus"], "a real Prometheus scrapes gputrace watch, and promtool checks its metrics"),
    ];
    let mut updated = false;
    for (command, packages, why) in tools {
        if output(Command::new("sh").args(["-c", &format!("command -v {command}")])).is_some() {
            continue;
        }
        eprintln!("xtask: installing {} (Debian): {why}", packages.join(", "));
        if !updated {
            run(Command::new("apt-get").args(["update", "-qq"]))?;
            updated = true;
        }
        run(Command::new("apt-get").args(["install", "-y", "-qq"]).args(packages).env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
    if output(Command::new("python3").args(["-c", "import kubernetes_validate"])).is_none() {
        eprintln!("xtask: installing kubernetes-validate (PyPI): the DaemonSet is checked against Kubernetes' schemas, offline");
        run(Command::new("python3").args(["-m", "pip", "install", "-q", "kubernetes-validate"]))?;
    }
    Ok(())
}

/// Every scenario, for both server families, on the fake GPU under `gputrace record`: one line
/// each. `cargo xtask demo NAME [vllm|llama]` shows one in full.
fn demo(only: Option<&str>, server_choice: Option<&str>) -> Result<()> {
    if !is_root() {
        return Err(
            "the demo loads eBPF programs and mounts a fake GPU in a private namespace: run it as root (`sudo cargo xtask demo`)".into()
        );
    }
    build()?;
    let listing = output(Command::new(bin("fakegpu")).arg("scenarios")).ok_or("fakegpu scenarios failed")?;
    let scenarios: Vec<(String, String, String)> = listing
        .lines()
        .filter_map(|l| {
            let mut parts = l.splitn(3, '\t');
            Some((parts.next()?.to_string(), parts.next()?.to_string(), parts.next()?.to_string()))
        })
        .collect();
    if let Some(name) = only {
        if !scenarios.iter().any(|(n, _, _)| n == name) {
            let mut names: Vec<&str> = scenarios.iter().map(|(n, _, _)| n.as_str()).collect();
            names.dedup();
            return Err(format!("no scenario {name:?}: choose one of {}", names.join(", ")));
        }
    }
    let root_dir = std::env::temp_dir().join(format!("gputrace-demo-{}", std::process::id()));
    for (name, server, what) in &scenarios {
        if only.is_some_and(|o| o != name) || server_choice.is_some_and(|s| s != server) {
            continue;
        }
        let dir = root_dir.join(format!("{server}-{name}"));
        let status = Command::new(bin("fakegpu"))
            .args(["scenario", name, "--server", server, "--dir"])
            .arg(&dir)
            .stderr(Stdio::null())
            .status()
            .map_err(|e| e.to_string())?;
        if only.is_some() {
            println!("== {server} {name}: {what}");
            let _ = Command::new(bin("gputrace")).arg("report").arg(dir.join("run.trace")).status();
            println!("(trace, logs and ground truth in {})\n", dir.display());
            continue;
        }
        let seen = if status.success() { verdict(&dir) } else { format!("the scenario did not run ({status}); see {}", dir.display()) };
        println!("{server:<6} {name:<22} {what}\n{:<29} gputrace: {seen}\n", "");
    }
    if only.is_none() {
        println!("\nTraces, logs and ground truth are in {}; `cargo xtask demo NAME [vllm|llama]` shows one in full.", root_dir.display());
    }
    Ok(())
}

fn read_json(path: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(path).ok()?;
    serde_json::from_str(text.lines().next()?).ok().or_else(|| serde_json::from_str(&text).ok())
}

/// One line from `record --json`: gputrace's verdict and the fix it gives.
fn verdict(dir: &Path) -> String {
    let Some(report) = read_json(&dir.join("record.json")) else {
        return "gputrace printed no report".into();
    };
    let d = &report["diagnosis"];
    let category = d["category"].as_str().unwrap_or("?");
    if category == "none" {
        let lost = report["loss"]["lost_records"].as_u64().unwrap_or(0);
        return format!("none: nothing failed, no suspect context, {lost} events lost");
    }
    format!("{category} ({}): {}", d["symptom"].as_str().unwrap_or("?"), d["fix"]["text"].as_str().unwrap_or(""))
}

/// Median of three runs of `cmd`, whose stdout is one number (ns per ioctl).
fn median_ns(mut make: impl FnMut() -> Command) -> Result<f64> {
    let mut runs = Vec::new();
    for _ in 0..3 {
        let out = make().output().map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out.stdout);
        let ns: f64 = text
            .lines()
            .last()
            .and_then(|l| l.trim().parse().ok())
            .ok_or_else(|| format!("no figure from the benchmark: {text} {}", String::from_utf8_lossy(&out.stderr)))?;
        runs.push(ns);
    }
    runs.sort_by(|a, b| a.total_cmp(b));
    Ok(runs[1])
}

/// Starts a tracer in the background and waits until it says it is attached.
fn start_tracer(cmd: &mut Command, ready: &str, stdout: bool) -> Result<std::process::Child> {
    use std::io::Read;
    let mut child =
        if stdout { cmd.stdout(Stdio::piped()).stderr(Stdio::null()) } else { cmd.stderr(Stdio::piped()).stdout(Stdio::null()) }
            .spawn()
            .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    let mut pipe: Box<dyn Read + Send> =
        if stdout { Box::new(child.stdout.take().unwrap()) } else { Box::new(child.stderr.take().unwrap()) };
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    while !String::from_utf8_lossy(&seen).contains(ready) {
        if pipe.read(&mut byte).map_err(|e| e.to_string())? == 0 {
            return Err(format!("{cmd:?} exited before it was ready: {}", String::from_utf8_lossy(&seen)));
        }
        seen.push(byte[0]);
    }
    // Keep draining so the tracer never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut pipe, &mut std::io::sink()));
    Ok(child)
}

fn stop(mut child: std::process::Child) {
    // SAFETY: signal our own child.
    unsafe { libc_kill(child.id() as i32, 2) };
    let _ = child.wait();
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// Each program's run time and run count, by name, from `bpftool prog show` (the kernel counts
/// them while kernel.bpf_stats_enabled is 1).
fn bpf_stats() -> Result<std::collections::BTreeMap<String, (u64, u64)>> {
    let text = output(Command::new("bpftool").args(["prog", "show", "--json"])).ok_or("bpftool prog show failed")?;
    let progs: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("bpftool's JSON: {e}"))?;
    let mut stats = std::collections::BTreeMap::new();
    for p in progs.as_array().into_iter().flatten() {
        let (Some(name), Some(ns), Some(count)) = (p["name"].as_str(), p["run_time_ns"].as_u64(), p["run_cnt"].as_u64()) else {
            continue;
        };
        let entry = stats.entry(name.to_string()).or_insert((0, 0));
        entry.0 += ns;
        entry.1 += count;
    }
    Ok(stats)
}

/// The kernel's own figure for each of gputrace's programs: ns per run while each case runs
/// under `record --all` (kernel.bpf_stats_enabled for the duration).
fn bpf_program_costs(pinned: &dyn Fn(&str) -> Command) -> Result<()> {
    if output(Command::new("sh").args(["-c", "command -v bpftool"])).is_none() {
        eprintln!("xtask: installing bpftool (Debian package), for the kernel's per-program statistics");
        run(Command::new("apt-get").args(["install", "-y", "-qq", "bpftool"]).env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
    const STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";
    let before = std::fs::read_to_string(STATS).unwrap_or_else(|_| "0".into());
    std::fs::write(STATS, "1").map_err(|e| format!("cannot enable BPF statistics ({STATS}): {e}"))?;
    let trace = std::env::temp_dir().join("gputrace-bench-stats.trace");
    let recorder = start_tracer(Command::new(bin("gputrace")).args(["record", "--all", "-o"]).arg(&trace), "gputrace: tracing", false)?;
    let mut rows = Vec::new();
    for case in [
        "null-plain",
        "null-nvidia-looking",
        "file-nvidiactl",
        "file-nvidiactl-control",
        "read-zero",
        "write-null",
        "open-close",
        "open-close-rw",
    ] {
        let start = bpf_stats()?;
        run(pinned(case).stdout(Stdio::null()))?;
        let end = bpf_stats()?;
        for (name, (ns, count)) in end {
            let (ns0, count0) = start.get(&name).copied().unwrap_or((0, 0));
            let runs = count.saturating_sub(count0);
            // Programs of this case's syscall: each ran once per call (a million), not by chance.
            if runs >= 900_000 {
                rows.push((case, name, ns.saturating_sub(ns0) as f64 / runs as f64, runs));
            }
        }
    }
    stop(recorder);
    let _ = std::fs::remove_file(&trace);
    let _ = std::fs::write(STATS, before.trim());
    println!("\nThe kernel's statistics for each of gputrace's programs that ran once per call (record --all):");
    println!("{:<22} {:<18} {:>12} {:>10}", "case", "program", "ns per run", "runs");
    for (case, name, ns, runs) in rows {
        println!("{case:<22} {name:<18} {ns:>12.0} {runs:>10}");
    }
    Ok(())
}

/// NVIDIA escapes as fast as one process issues them (RM_FREE on a plain file named
/// /dev/nvidiactl: no driver behind it), recorded to a trace under `record --all`: the rate, how
/// many reached the trace and how many the kernel counted lost.
fn sustained(pinned: &dyn Fn(&str) -> Command) -> Result<()> {
    let trace = std::env::temp_dir().join("gputrace-bench-sustained.trace");
    let recorder = start_tracer(Command::new(bin("gputrace")).args(["record", "--all", "-o"]).arg(&trace), "gputrace: tracing", false)?;
    let out = pinned("file-nvidiactl").output().map_err(|e| e.to_string())?;
    // Time for the last records to be read and written.
    std::thread::sleep(std::time::Duration::from_secs(2));
    stop(recorder);
    let ns: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().map_err(|_| "no figure from file-nvidiactl".to_string())?;
    let text = std::fs::read_to_string(&trace).map_err(|e| format!("reading {}: {e}", trace.display()))?;
    let recorded = text.lines().filter(|l| l.contains("\"ev\":\"free\"")).count();
    let report = output(Command::new(bin("gputrace")).args(["report", "--json"]).arg(&trace)).unwrap_or_default();
    let lost = serde_json::from_str::<serde_json::Value>(&report).ok().and_then(|r| r["loss"]["lost_records"].as_u64()).unwrap_or(0);
    let _ = std::fs::remove_file(&trace);
    println!("\nSustained: RM_FREE on a plain /dev/nvidiactl, one process pinned to CPU 1, under record --all:");
    println!(
        "{:.0} escapes/s issued ({ns:.0} ns each), {recorded} of the 1,000,000 timed (+1,000 warm-up) in the trace, {lost} counted lost",
        1e9 / ns
    );
    Ok(())
}

/// The same allocation tracing done the ways other tools do it, per event, on this machine:
/// gputrace (syscall tracepoints, each escape decoded and written to a trace), a bpftrace script
/// decoding the same escapes (printing each), and a uprobe + uretprobe pair on an allocation
/// function of a user library, as uprobe-based GPU tracers hook cudaMalloc (a small library the
/// benchmark builds, its calls printed the same way).
fn peers(pinned: &dyn Fn(&str) -> Command) -> Result<()> {
    let dir = root().join("target/bench-peers");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("alloc.c"), PEER_LIBRARY).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("main.c"), PEER_PROGRAM).map_err(|e| e.to_string())?;
    let library = dir.join("libfakealloc.so");
    run(Command::new("cc").args(["-O2", "-shared", "-fPIC", "-o"]).arg(&library).arg(dir.join("alloc.c")))?;
    let program = dir.join("alloc-bench");
    run(Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&program)
        .arg(dir.join("main.c"))
        .arg(format!("-L{}", dir.display()))
        .args(["-lfakealloc", &format!("-Wl,-rpath,{}", dir.display())]))?;
    let allocs = || {
        let mut c = Command::new("taskset");
        c.args(["-c", "1"]).arg(&program).arg("1000000");
        c
    };
    let escapes = || pinned("file-nvidiactl");
    let bpftrace = |script: String| start_tracer(Command::new("bpftrace").args(["-e", &script]), "Attaching", true);

    let escape_bare = median_ns(escapes)?;
    let trace = std::env::temp_dir().join("gputrace-bench-peers.trace");
    let recorder = start_tracer(Command::new(bin("gputrace")).args(["record", "--all", "-o"]).arg(&trace), "gputrace: tracing", false)?;
    let escape_gputrace = median_ns(escapes)?;
    stop(recorder);
    let _ = std::fs::remove_file(&trace);
    let decoder = bpftrace(format!(
        "tracepoint:syscalls:sys_enter_ioctl /args->cmd == {:#x}/ {{ @arg[tid] = args->arg; }} \
         tracepoint:syscalls:sys_exit_ioctl /@arg[tid]/ {{ $p = @arg[tid]; printf(\"%d %d %x %x %x\\n\", pid, args->ret, \
         *(uint32 *)uptr($p), *(uint32 *)uptr($p + 8), *(uint32 *)uptr($p + 12)); delete(@arg[tid]); }}",
        0xc0104629u32
    ))?;
    let escape_bpftrace = median_ns(escapes)?;
    stop(decoder);

    let alloc_bare = median_ns(allocs)?;
    let lib = library.display();
    let probes = bpftrace(format!(
        "uprobe:{lib}:fake_alloc {{ @size[tid] = arg0; }} \
         uretprobe:{lib}:fake_alloc /@size[tid]/ {{ printf(\"%d %d %p\\n\", pid, @size[tid], retval); delete(@size[tid]); }}"
    ))?;
    let alloc_uprobes = median_ns(allocs)?;
    stop(probes);

    println!("\nThe same tracing done other ways, ns added per traced event (median of 3 runs of 1,000,000, pinned to CPU 1):");
    println!("{:<70} {:>10} {:>10} {:>10}", "way", "untraced", "traced", "added");
    for (way, bare, traced) in [
        ("gputrace record --all (escape decoded, written to a trace)", escape_bare, escape_gputrace),
        ("bpftrace decoding the same escapes (each printed)", escape_bare, escape_bpftrace),
        ("uprobe + uretprobe on a library's allocation function (each printed)", alloc_bare, alloc_uprobes),
    ] {
        println!("{way:<70} {bare:>10.0} {traced:>10.0} {:>10.0}", traced - bare);
    }
    Ok(())
}

/// The allocation function the uprobe comparison hooks, in a shared library as libcudart's is.
const PEER_LIBRARY: &str = "#include <stddef.h>\n\
static char pool[64];\n\
__attribute__((noinline)) void *fake_alloc(size_t bytes) { __asm__ volatile(\"\" ::: \"memory\"); return bytes ? pool : NULL; }\n";

/// Calls it COUNT times and prints ns per call.
const PEER_PROGRAM: &str = "#include <stdio.h>\n#include <stdlib.h>\n#include <time.h>\n\
void *fake_alloc(size_t);\n\
int main(int argc, char **argv) {\n\
  long n = argc > 1 ? atol(argv[1]) : 1000000;\n\
  for (int i = 0; i < 1000; i++) fake_alloc(64);\n\
  struct timespec a, b; clock_gettime(CLOCK_MONOTONIC, &a);\n\
  for (long i = 0; i < n; i++) fake_alloc(64 + (i & 7));\n\
  clock_gettime(CLOCK_MONOTONIC, &b);\n\
  printf(\"%.1f\\n\", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);\n\
  return 0;\n}\n";

/// What tracing costs an ioctl: per call, with nothing attached, with empty programs on the same
/// tracepoints (what any syscall tracer costs), and with gputrace tracing every process.
fn bench() -> Result<()> {
    if !is_root() {
        return Err("the benchmark attaches eBPF programs: run it as root (`sudo cargo xtask bench`)".into());
    }
    build()?;
    if output(Command::new("sh").args(["-c", "command -v bpftrace"])).is_none() {
        eprintln!("xtask: installing bpftrace (Debian package), for the empty-programs baseline");
        run(Command::new("apt-get").args(["install", "-y", "-qq", "bpftrace"]).env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
    const COUNT: &str = "1000000";
    let pinned = |case: &str| {
        let mut c = Command::new("taskset");
        c.args(["-c", "1"]).arg(bin("ioctl-bench")).args([case, COUNT]);
        c
    };
    // Each case against empty programs on the tracepoints gputrace hooks for that syscall.
    let cases = [("null-plain", "ioctl"), ("null-nvidia-looking", "ioctl"), ("read-zero", "read"), ("write-null", "write")];
    let mut table = Vec::new();
    for (case, syscall) in cases {
        let bare = median_ns(|| pinned(case))?;
        let empty_programs = format!("tracepoint:syscalls:sys_enter_{syscall} {{}} tracepoint:syscalls:sys_exit_{syscall} {{}}");
        let probes = start_tracer(Command::new("bpftrace").args(["-e", &empty_programs]), "Attaching", true)?;
        let empty = median_ns(|| pinned(case))?;
        stop(probes);
        let trace = std::env::temp_dir().join("gputrace-bench.trace");
        let recorder = start_tracer(Command::new(bin("gputrace")).args(["record", "--all", "-o"]).arg(&trace), "gputrace: tracing", false)?;
        let traced = median_ns(|| pinned(case))?;
        stop(recorder);
        let _ = std::fs::remove_file(&trace);
        table.push((case, bare, empty, traced));
    }
    bpf_program_costs(&pinned)?;
    println!("\nns per call (median of 3 runs of {COUNT}, pinned to CPU 1); empty probes are on the same syscall's tracepoints:");
    println!("{:<22} {:>10} {:>14} {:>16} {:>22}", "case", "untraced", "empty probes", "gputrace --all", "gputrace/empty probes");
    for (case, bare, empty, traced) in &table {
        println!("{case:<22} {bare:>10.1} {empty:>14.1} {traced:>16.1} {:>22.2}", traced / empty);
    }

    sustained(&pinned)?;
    peers(&pinned)?;

    // A traced escape on the fake GPU: the whole path, kernel record to trace file.
    let fake = |traced: bool| {
        let mut c = Command::new(bin("fakegpu"));
        c.args(["run", "--"]);
        if traced {
            c.arg(bin("gputrace")).args(["record", "-o", "/dev/null", "--"]);
        }
        c.arg(bin("ioctl-bench")).args(["fake-gpu-free", "100000"]);
        c
    };
    let untraced = median_ns(|| fake(false))?;
    let recorded = median_ns(|| fake(true))?;
    println!("\nRM_FREE on the fake GPU's nvidiactl (a traced escape, each call a record in the trace), ns per call:");
    println!(
        "untraced {untraced:.0}, recorded {recorded:.0}, ratio {:.2} (the FUSE round trip of the fake driver dominates)",
        recorded / untraced
    );

    println!("\nReport and exports of a trace of a million events, against merely reading it:");
    run(Command::new("cargo").current_dir(root()).args(["bench", "--quiet", "-p", "tracer", "--bench", "export"]))?;
    println!("\n`gputrace watch`'s flight recorder against keeping the whole trace in the model:");
    run(Command::new("cargo").current_dir(root()).args(["bench", "--quiet", "-p", "tracer", "--bench", "flight"]))
}

/// The fuzz targets (tests/fuzz), each run this long by `cargo xtask test`.
const FUZZ_TARGETS: [&str; 3] = ["decode", "trace", "model"];
const FUZZ_SECONDS_IN_TEST: u64 = 20;

/// Builds the fuzz targets with libFuzzer's coverage instrumentation (stable rustc: the
/// sanitizer-coverage pass, no sanitizer runtime) and runs each for `seconds`. Corpora grow in
/// target/fuzz/corpus; a crash leaves its input in target/fuzz/artifacts and fails the run, to be
/// saved in tests/fuzz/regressions/TARGET and fixed.
fn fuzz(seconds: u64) -> Result<()> {
    let host = output(Command::new("rustc").arg("-vV"))
        .and_then(|v| v.lines().find_map(|l| l.strip_prefix("host: ").map(String::from)))
        .ok_or("cannot read rustc's host triple")?;
    let flags = [
        "--cfg fuzzing",
        "-Cpasses=sancov-module",
        "-Cllvm-args=-sanitizer-coverage-level=4",
        "-Cllvm-args=-sanitizer-coverage-inline-8bit-counters",
        "-Cllvm-args=-sanitizer-coverage-pc-table",
        "-Cllvm-args=-sanitizer-coverage-trace-compares",
        "-Cdebug-assertions",
        "-Coverflow-checks",
    ]
    .join(" ");
    // Target-specific flags with --target: build scripts, proc macros and the eBPF object stay
    // uninstrumented.
    let var = format!("CARGO_TARGET_{}_RUSTFLAGS", host.to_uppercase().replace('-', "_"));
    eprintln!("xtask: building the fuzz targets with coverage for {host}");
    run(Command::new("cargo")
        .current_dir(root())
        .args(["build", "--quiet", "--release", "-p", "gputrace-fuzz", "--features", "libfuzzer", "--bins", "--target", &host])
        .env(var, flags))?;
    let work = root().join("target/fuzz");
    println!("\n{:<8} {:>12} {:>10} {:>8} {:>8}", "target", "executions", "per s", "corpus", "crashes");
    let mut failed = Vec::new();
    for target in FUZZ_TARGETS {
        let corpus = work.join("corpus").join(target);
        let artifacts = work.join("artifacts").join(target);
        std::fs::create_dir_all(&corpus).map_err(|e| e.to_string())?;
        std::fs::create_dir_all(&artifacts).map_err(|e| e.to_string())?;
        // Git keeps no empty folder: a target without saved regressions has none in a clean clone,
        // and libFuzzer exits on a seed folder that is missing.
        let regressions = root().join("tests/fuzz/regressions").join(target);
        let artifacts_before = count_entries(&artifacts);
        let out = Command::new(root().join("target").join(&host).join("release").join(format!("fuzz-{target}")))
            .arg(format!("-max_total_time={seconds}"))
            .arg(format!("-artifact_prefix={}/", artifacts.display()))
            .args(["-rss_limit_mb=2048", "-max_len=65536", "-print_final_stats=1"])
            .arg(&corpus)
            .args(regressions.is_dir().then_some(&regressions))
            .output()
            .map_err(|e| format!("cannot run the {target} fuzz target: {e}"))?;
        let log = String::from_utf8_lossy(&out.stderr);
        let stat = |name: &str| log.lines().find_map(|l| l.strip_prefix(name)?.trim().parse::<u64>().ok()).unwrap_or(0);
        let runs = stat("stat::number_of_executed_units:");
        let entries = count_entries(&corpus);
        // A crash is an input libFuzzer saved; any other failure is the harness's, said as such.
        let crashes = count_entries(&artifacts).saturating_sub(artifacts_before);
        println!("{target:<8} {runs:>12} {:>10} {entries:>8} {crashes:>8}", runs / seconds.max(1));
        if !out.status.success() {
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
            failed.push(if crashes > 0 {
                format!("{target} found {crashes} crashing input(s), saved in {}", artifacts.display())
            } else {
                format!("{target} stopped without a crash ({}); its log is above", out.status)
            });
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("fuzzing failed: {}; copy each crashing input into tests/fuzz/regressions/TARGET and fix it", failed.join("; ")))
    }
}

fn count_entries(dir: &Path) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("setup") => setup(),
        Some("build") => build(),
        Some("test") => match args.get(1).map(String::as_str) {
            None => suite::test(false),
            Some("--quick") => suite::test(true),
            Some(other) => Err(format!("usage: cargo xtask test [--quick]: {other:?} is not an option")),
        },
        // Not for people: what `xtask test` runs beside the end-to-end tests.
        Some("beside-the-tests") => suite::beside_the_tests(),
        Some("demo") => demo(args.get(1).map(String::as_str), args.get(2).map(String::as_str)),
        Some("bench") => bench(),
        Some("fuzz") => match args.get(1).map(|s| s.parse::<u64>()) {
            None => fuzz(60),
            Some(Ok(seconds)) => fuzz(seconds),
            Some(Err(_)) => Err("usage: cargo xtask fuzz [SECONDS per target]".into()),
        },
        Some("dist") => dist::dist(args.get(1).map(String::as_str)).map(|_| ()),
        Some("vm") => vm::vm(args.get(1).map_or("arm64", String::as_str)),
        _ => Err("usage: cargo xtask setup | build | test [--quick] | demo [SCENARIO [vllm|llama]] | bench | fuzz [SECONDS] | vm [arm64|x86] | dist [amd64|arm64]".into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e}");
            ExitCode::FAILURE
        }
    }
}

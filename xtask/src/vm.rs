//! `cargo xtask vm arm64|x86`: gputrace on the kernels people run, not only this machine's. Boots
//! Debian 12's own kernel (6.1: arm64, the DGX Spark and Grace hosts' architecture, under QEMU's
//! emulation; or amd64) with a busybox initramfs holding statically linked gputrace and fake-GPU
//! binaries, records a fake-GPU scenario there under `gputrace record`, and checks the report that
//! comes back over the console. Everything comes from Debian's packages and rustup.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{output, root, run, Result};

/// One guest: how to build for it, what to boot, and how.
struct Guest {
    name: &'static str,
    rust_target: &'static str,
    linker: &'static str,
    debian_arch: &'static str,
    kernel_package: &'static str,
    qemu: &'static str,
    qemu_args: &'static [&'static str],
    console: &'static str,
    /// Packages the host needs: QEMU and the cross linker.
    host_packages: &'static [&'static str],
    /// The Debian release whose kernel boots: None for the host's own apt sources (bookworm, 6.1),
    /// else one read through a sources list of its own, the host's left as they are.
    suite: Option<&'static str>,
    /// Whether its kernel refuses the ioctl programs that keep calls in flight in per-thread
    /// slots (they need BPF's atomics: 5.12, 5.18 on arm64), so that gputrace loads the pair that
    /// keeps them in an LRU map.
    calls_in_map: bool,
}

/// Debian 12's amd64 6.1.
const X86: Guest = Guest {
    name: "x86",
    rust_target: "x86_64-unknown-linux-gnu",
    linker: "cc",
    debian_arch: "amd64",
    kernel_package: "linux-image-amd64",
    qemu: "qemu-system-x86_64",
    qemu_args: &["-M", "q35", "-cpu", "max"],
    console: "ttyS0",
    host_packages: &["qemu-system-x86", "cpio"],
    suite: None,
    calls_in_map: false,
};

const GUESTS: [Guest; 3] = [
    Guest {
        name: "arm64",
        rust_target: "aarch64-unknown-linux-gnu",
        linker: "aarch64-linux-gnu-gcc",
        debian_arch: "arm64",
        kernel_package: "linux-image-arm64",
        qemu: "qemu-system-aarch64",
        qemu_args: &["-M", "virt", "-cpu", "cortex-a57"],
        console: "ttyAMA0",
        host_packages: &["qemu-system-arm", "gcc-aarch64-linux-gnu", "cpio"],
        suite: None,
        calls_in_map: false,
    },
    X86,
    // Debian 11's 5.10: the oldest kernel the programs are held to (BPF ring buffer 5.8,
    // close_range 5.9), as long-term distributions still run it.
    Guest { name: "x86-5.10", suite: Some("bullseye"), calls_in_map: true, ..X86 },
];

/// The scenario recorded in the guest, and the verdict it must get. Without NVML in the guest
/// (static binaries cannot load it), a long request is still told by the requests in flight.
const SCENARIO: (&str, &str) = ("long-request", "llama");
const EXPECTED: &str = "long-request";
const BINARIES: [&str; 4] = ["gputrace", "fakegpu", "fake-server", "fake-load"];

fn sh(script: &str) -> Result<()> {
    run(Command::new("sh").args(["-ec", script]))
}

/// Host tools, the Rust target, the guest kernel and busybox: each only when missing.
fn install(guest: &Guest, cache: &Path) -> Result<()> {
    crate::install_packages(guest.host_packages)?;
    let installed = output(Command::new("rustup").args(["target", "list", "--installed"])).unwrap_or_default();
    if !installed.lines().any(|t| t == guest.rust_target) {
        run(Command::new("rustup").args(["target", "add", guest.rust_target]))?;
    }
    if cache.join("vmlinuz").exists() && cache.join("busybox").exists() && cache.join("fuse.ko").exists() {
        return Ok(());
    }
    std::fs::create_dir_all(cache).map_err(|e| e.to_string())?;
    let arch = guest.debian_arch;
    let foreign = output(Command::new("dpkg").arg("--print-foreign-architectures")).unwrap_or_default();
    let native = output(Command::new("dpkg").arg("--print-architecture")).unwrap_or_default();
    if arch != native && !foreign.lines().any(|a| a == arch) {
        run(Command::new("dpkg").args(["--add-architecture", arch]))?;
        run(Command::new("apt-get").args(["update", "-qq"]))?;
    }
    // Another release's packages through a sources list and package lists of its own.
    let apt_options: Vec<String> = match guest.suite {
        None => Vec::new(),
        Some(suite) => {
            let lists = cache.join("lists");
            std::fs::create_dir_all(lists.join("partial")).map_err(|e| e.to_string())?;
            let sources = cache.join("sources.list");
            std::fs::write(&sources, format!("deb [arch={arch}] http://deb.debian.org/debian {suite} main\n"))
                .map_err(|e| e.to_string())?;
            let options = vec![
                format!("-oDir::Etc::SourceList={}", sources.display()),
                "-oDir::Etc::SourceParts=/nonexistent".to_string(),
                format!("-oDir::State::Lists={}", lists.display()),
            ];
            run(Command::new("apt-get").args(&options).args(["update", "-qq"]))?;
            options
        }
    };
    // The metapackage names the real image in its Depends.
    let depends = output(Command::new("apt-cache").args(&apt_options).args(["depends", &format!("{}:{arch}", guest.kernel_package)]))
        .unwrap_or_default();
    let image = depends
        .lines()
        .find_map(|l| l.trim().strip_prefix("Depends: ").filter(|p| p.starts_with("linux-image-")))
        .map(|p| p.split(':').next().unwrap_or(p).to_string())
        .ok_or_else(|| format!("cannot find the kernel image that {} depends on (apt-get update?)", guest.kernel_package))?;
    eprintln!("xtask: fetching {image}:{arch} and busybox-static:{arch}");
    let script = format!(
        "cd {dir}; rm -rf x; apt-get {options} download -qq {image}:{arch} busybox-static:{arch}; for d in *.deb; do dpkg-deb -x $d x; done; \
         cp x/boot/vmlinuz-* vmlinuz; cp x/bin/busybox busybox; \
         f=$(find x/lib/modules -name 'fuse.ko*' | head -1); case $f in *.xz) xz -dc $f > fuse.ko;; *.zst) zstd -qdc $f > fuse.ko;; *) cp $f fuse.ko;; esac; \
         rm -rf x *.deb",
        dir = cache.display(),
        options = apt_options.join(" ")
    );
    sh(&script)
}

/// Statically linked binaries for the guest (their own target directory, so the fuzz build's and
/// the host's stay as they are).
fn build(guest: &Guest) -> Result<PathBuf> {
    let target_dir = root().join("target/vm");
    let triple = guest.rust_target.to_uppercase().replace('-', "_");
    eprintln!("xtask: building static {} binaries for {}", BINARIES.join(", "), guest.rust_target);
    run(Command::new("cargo")
        .current_dir(root())
        .args(["build", "--quiet", "--release", "--target", guest.rust_target, "-p", "tracer", "--bin", "gputrace", "-p", "tests"])
        .args(["--bin", "fakegpu", "--bin", "fake-server", "--bin", "fake-load"])
        .env("CARGO_TARGET_DIR", &target_dir)
        .env(format!("CARGO_TARGET_{triple}_LINKER"), guest.linker)
        .env(format!("CARGO_TARGET_{triple}_RUSTFLAGS"), "-C target-feature=+crt-static"))?;
    Ok(target_dir.join(guest.rust_target).join("release"))
}

/// The guest's /init: mount what gputrace needs, load fuse, load the programs with their log
/// and device-number checks live, run the scenario, print the report between markers, power off.
fn init_script() -> String {
    let (name, server) = SCENARIO;
    format!(
        "#!/bin/busybox sh\n/bin/busybox --install -s /bin\nexport PATH=/bin\n\
         mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev; mkdir -p /dev/pts /dev/shm; mount -t devpts pts /dev/pts; mount -t tmpfs shm /dev/shm\n\
         mount -t tracefs tracefs /sys/kernel/tracing; mount -t tmpfs tmp /tmp; mount -t tmpfs run /run\n\
         ip link set lo up; insmod /fuse.ko\n\
         echo \"=== kernel: $(uname -m) $(uname -r)\"\n\
         GPUTRACE_DEVICE_MAJORS=195,1 gputrace record --kernel-log -o /tmp/kernel-log.trace -- true > /tmp/kernel-log.txt 2>&1; echo \"=== kernel-log exit: $?\"; tail -3 /tmp/kernel-log.txt\n\
         if grep -q 'refused the ioctl programs' /tmp/kernel-log.txt; then echo '=== calls in flight: map'; else echo '=== calls in flight: slots'; fi\n\
         fakegpu scenario {name} --server {server} --dir /tmp/run > /tmp/scenario.log 2>&1; echo \"=== scenario exit: $?\"\n\
         tail -5 /tmp/scenario.log\n\
         echo '=== report'; gputrace report --json /tmp/run/run.trace; echo '=== end'\n\
         poweroff -f\n"
    )
}

fn initramfs(cache: &Path, binaries: &Path, work: &Path) -> Result<PathBuf> {
    let tree = work.join("initramfs");
    let _ = std::fs::remove_dir_all(&tree);
    for dir in ["bin", "proc", "sys", "dev", "tmp", "run"] {
        std::fs::create_dir_all(tree.join(dir)).map_err(|e| e.to_string())?;
    }
    let copy = |from: &Path, to: &Path| std::fs::copy(from, to).map(drop).map_err(|e| format!("copying {}: {e}", from.display()));
    copy(&cache.join("busybox"), &tree.join("bin/busybox"))?;
    copy(&cache.join("fuse.ko"), &tree.join("fuse.ko"))?;
    for b in BINARIES {
        copy(&binaries.join(b), &tree.join("bin").join(b))?;
    }
    std::fs::write(tree.join("init"), init_script()).map_err(|e| e.to_string())?;
    sh(&format!("chmod 755 {t}/init {t}/bin/*; cd {t}; find . | cpio -o -H newc --quiet | gzip -1 > ../initrd.gz", t = tree.display()))?;
    Ok(work.join("initrd.gz"))
}

/// Boots the guest and returns its console output.
fn boot(guest: &Guest, cache: &Path, initrd: &Path, limit: Duration) -> Result<String> {
    let started = Instant::now();
    let mut child = Command::new(guest.qemu)
        .args(guest.qemu_args)
        .args(["-smp", "2", "-m", "1536", "-nographic", "-no-reboot", "-kernel"])
        .arg(cache.join("vmlinuz"))
        .arg("-initrd")
        .arg(initrd)
        .args(["-append", &format!("console={} rdinit=/init quiet panic=1", guest.console)])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", guest.qemu))?;
    let mut stdout = child.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut text = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stdout, &mut text);
        String::from_utf8_lossy(&text).into_owned()
    });
    loop {
        if child.try_wait().map_err(|e| e.to_string())?.is_some() {
            break;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("the {} guest did not finish within {} s", guest.name, limit.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let console = reader.join().unwrap_or_default();
    eprintln!("xtask: the {} guest ran for {:.0} s", guest.name, started.elapsed().as_secs_f64());
    Ok(console)
}

/// The verdict and figures from the guest's report, checked.
fn check(guest: &Guest, console: &str) -> Result<String> {
    // The firmware may leave terminal escapes on the same line (SeaBIOS does).
    let kernel = console.lines().find_map(|l| l.split("=== kernel: ").nth(1)).unwrap_or("?").trim().to_string();
    let between = console.split("=== report").nth(1).and_then(|rest| rest.split("=== end").next());
    let report: serde_json::Value = between
        .and_then(|json| serde_json::from_str(json.trim()).ok())
        .ok_or_else(|| format!("the {} guest printed no report; its console:\n{console}", guest.name))?;
    let category = report["diagnosis"]["category"].as_str().unwrap_or("?");
    let lost = report["loss"]["lost_records"].as_u64().unwrap_or(u64::MAX);
    let events = report["events"].as_u64().unwrap_or(0);
    // The programs with their log calls live (the verifier prunes them when the level is 0).
    if !console.contains("=== kernel-log exit: 0") {
        return Err(format!("on {kernel}: gputrace record --kernel-log failed to load or run; console:\n{console}"));
    }
    let in_map = console.contains("=== calls in flight: map");
    if in_map != guest.calls_in_map || !(in_map || console.contains("=== calls in flight: slots")) {
        let expected = if guest.calls_in_map { "an LRU map (no BPF atomics)" } else { "per-thread slots" };
        return Err(format!("on {kernel}: calls in flight were to wait in {expected}, and did not; console:\n{console}"));
    }
    if category != EXPECTED || lost != 0 {
        return Err(format!("on {kernel}: verdict {category}, {lost} records lost (expected {EXPECTED}, none lost); console:\n{console}"));
    }
    let calls = if in_map { "an LRU map" } else { "per-thread slots" };
    Ok(format!(
        "{} ({kernel}): {} {} recorded {events} events, nothing lost, verdict {category}; calls in flight in {calls}",
        guest.name, SCENARIO.1, SCENARIO.0
    ))
}

pub fn vm(which: &str) -> Result<()> {
    let guest = GUESTS.iter().find(|g| g.name == which).ok_or_else(|| format!("no guest {which:?}: give arm64, x86 or x86-5.10"))?;
    let cache = root().join("target/vm/cache").join(guest.name);
    install(guest, &cache)?;
    let binaries = build(guest)?;
    let work = root().join("target/vm/run").join(guest.name);
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    let initrd = initramfs(&cache, &binaries, &work)?;
    let console = boot(guest, &cache, &initrd, Duration::from_secs(600))?;
    std::fs::write(work.join("console.log"), &console).map_err(|e| e.to_string())?;
    println!("{}", check(guest, &console)?);
    Ok(())
}

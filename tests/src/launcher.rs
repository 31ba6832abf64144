//! `fakegpu run`: a private mount namespace whose /dev has the fake driver's files at
//! /dev/nvidiactl, /dev/nvidia0 (one /dev/nvidiaN per GPU) and /dev/nvidia-uvm, and /proc/driver/nvidia/version as a real
//! host has it; the command runs inside, and everything is torn down after it, even on failure.
//! The host's /dev is never touched: /dev is devtmpfs, shared with the host even in a private
//! namespace, so a tmpfs is put over it first.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::driver::{Config, Driver};
use crate::fuse::{Files, Session};

const FUSE_DIR: &str = "/dev/.fakegpu";
/// The fake NVML's state file and library directory, in the namespace's private /dev.
const NVML_STATE: &str = "/dev/fakegpu-state.json";
const NVML_LIB_DIR: &str = "/dev/.fakegpu-lib";
const DEVICE_NODES: [&str; 8] = ["null", "zero", "full", "random", "urandom", "tty", "fuse", "ptmx"];
const DEVICE_DIRS: [&str; 2] = ["pts", "shm"];

fn c(s: &str) -> CString {
    CString::new(s).expect("no NUL in paths")
}

fn mount(source: &str, target: &str, fstype: Option<&str>, flags: libc::c_ulong, data: Option<&str>) -> Result<()> {
    let fstype = fstype.map(c);
    let data = data.map(c);
    // SAFETY: mount(2) with valid C strings or nulls.
    let rc = unsafe {
        libc::mount(
            c(source).as_ptr(),
            c(target).as_ptr(),
            fstype.as_ref().map_or(std::ptr::null(), |f| f.as_ptr()),
            flags,
            data.as_ref().map_or(std::ptr::null(), |d| d.as_ptr().cast()),
        )
    };
    if rc != 0 {
        bail!("mount {source} on {target}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// The device files of a driver with `gpus` GPUs, as named in /dev.
fn device_files(gpus: usize) -> Vec<String> {
    ["nvidiactl".to_string(), "nvidia-uvm".to_string()].into_iter().chain((0..gpus).map(|n| format!("nvidia{n}"))).collect()
}

/// Builds the namespace's /dev on a staging tmpfs, then moves it over /dev.
fn private_dev(files: &[String]) -> Result<()> {
    // SAFETY: unshare of the mount namespace for this (single-threaded) process.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        bail!("unshare(CLONE_NEWNS): {} (the fake GPU needs root)", std::io::Error::last_os_error());
    }
    mount("none", "/", None, libc::MS_REC | libc::MS_PRIVATE, None)?;
    let stage = PathBuf::from(format!("/tmp/fakegpu-dev-{}", std::process::id()));
    std::fs::create_dir_all(&stage)?;
    let stage_str = stage.to_str().unwrap().to_string();
    let result = (|| -> Result<()> {
        mount("tmpfs", &stage_str, Some("tmpfs"), libc::MS_NOSUID, Some("mode=755"))?;
        for node in DEVICE_NODES {
            let target = stage.join(node);
            std::fs::write(&target, b"")?;
            mount(&format!("/dev/{node}"), target.to_str().unwrap(), None, libc::MS_BIND, None)?;
        }
        for dir in DEVICE_DIRS {
            let target = stage.join(dir);
            std::fs::create_dir(&target)?;
            mount(&format!("/dev/{dir}"), target.to_str().unwrap(), None, libc::MS_BIND | libc::MS_REC, None)?;
        }
        for (link, to) in
            [("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")]
        {
            std::os::unix::fs::symlink(to, stage.join(link))?;
        }
        std::fs::create_dir(stage.join(".fakegpu"))?;
        for name in files {
            std::fs::write(stage.join(name), b"")?;
        }
        mount(&stage_str, "/dev", None, libc::MS_MOVE, None)
    })();
    let _ = std::fs::remove_dir(&stage);
    result
}

fn driver_version_file(version: &str) -> Result<()> {
    mount("tmpfs", "/proc/driver", Some("tmpfs"), libc::MS_NOSUID, Some("mode=755"))?;
    std::fs::create_dir("/proc/driver/nvidia")?;
    std::fs::write(
        "/proc/driver/nvidia/version",
        format!("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  (fakegpu)\nGCC version:  gcc version 12.2.0\n"),
    )?;
    Ok(())
}

/// Every process below `root`, deepest last.
fn descendants(root: u32) -> Vec<u32> {
    let mut parents = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            if let Some(ppid) = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok()) {
                parents.push((pid, ppid));
            }
        }
    }
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        out.extend(parents.iter().filter(|(_, pp)| *pp == p).map(|(pid, _)| *pid));
        i += 1;
    }
    out.remove(0);
    out
}

/// Puts the fake NVML (built beside this binary) where the command's dynamic loader looks for
/// libnvidia-ml.so.1. None, with a warning, when it was not built.
fn fake_nvml_dir() -> Option<String> {
    let built = std::env::current_exe().ok()?.parent()?.join("libnvidia_ml.so");
    if !built.exists() {
        eprintln!("fakegpu: warning: {} is not built (cargo build --release): NVML will be unavailable", built.display());
        return None;
    }
    std::fs::create_dir_all(NVML_LIB_DIR).ok()?;
    std::os::unix::fs::symlink(&built, Path::new(NVML_LIB_DIR).join("libnvidia-ml.so.1")).ok()?;
    Some(NVML_LIB_DIR.to_string())
}

pub struct Run {
    pub config: Config,
    pub driver_log: Option<PathBuf>,
    pub command: Vec<String>,
}

/// Sets everything up, runs the command, tears down; returns the command's exit status.
pub fn run(run: Run) -> Result<i32> {
    if run.command.is_empty() {
        bail!("no command: `fakegpu run [options] -- CMD ARGS...`");
    }
    let files = device_files(run.config.gpus.len());
    private_dev(&files).context("building the namespace's /dev")?;
    std::fs::create_dir_all(FUSE_DIR)?;
    let session = Session::mount(Path::new(FUSE_DIR))?;
    let mut driver = Driver::new(&run.config, run.driver_log.as_deref()).context("opening the driver log")?;
    driver.publish_state(Path::new(NVML_STATE)).context("writing the fake NVML's state")?;
    let library_path = fake_nvml_dir();
    let open_files = driver.open_files_counter();
    let serving = Arc::new(AtomicBool::new(true));
    let serving_flag = serving.clone();
    let mut server_session = session.try_clone()?;
    let server = std::thread::spawn(move || {
        let result = server_session.serve(&mut driver as &mut dyn Files);
        serving_flag.store(false, Ordering::SeqCst);
        result
    });
    for name in &files {
        mount(&format!("{FUSE_DIR}/{name}"), &format!("/dev/{name}"), None, libc::MS_BIND, None)?;
    }
    driver_version_file(&run.config.version)?;

    // Orphans (an engine whose API server was killed, a forked helper) are reparented to us, not
    // to the host's init, so teardown finds and ends them.
    // SAFETY: prctl on ourselves.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let mut command = Command::new(&run.command[0]);
    command.args(&run.command[1..]).env("FAKEGPU_STATE", NVML_STATE);
    if let Some(dir) = library_path {
        let inherited = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        command.env("LD_LIBRARY_PATH", if inherited.is_empty() { dir } else { format!("{dir}:{inherited}") });
    }
    let status = command
        .spawn()
        .with_context(|| format!("cannot run `{}`", run.command[0]))
        .and_then(|mut child| child.wait().context("waiting for the command"));

    // Leave nothing behind: whatever the command left running goes, then its files are released.
    for _ in 0..3 {
        for pid in descendants(std::process::id()) {
            // SAFETY: kill(2) of a process below us.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
        // SAFETY: reap whatever exited.
        while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
        std::thread::sleep(Duration::from_millis(20));
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    while open_files.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    for target in files.iter().map(|f| format!("/dev/{f}")).chain([FUSE_DIR.to_string()]) {
        // SAFETY: umount2 of a path in our private namespace.
        unsafe { libc::umount2(c(&target).as_ptr(), libc::MNT_DETACH) };
    }
    drop(session);
    // Unmounting ends the server's read loop; if it does not, the namespace goes with us anyway.
    let deadline = Instant::now() + Duration::from_secs(1);
    while serving.load(Ordering::SeqCst) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    if !serving.load(Ordering::SeqCst) {
        if let Ok(Err(e)) = server.join() {
            eprintln!("fakegpu: the driver stopped: {e:#}");
        }
    }
    let status = status?;
    Ok(status.code().unwrap_or_else(|| 128 + std::os::unix::process::ExitStatusExt::signal(&status).unwrap_or(0)))
}

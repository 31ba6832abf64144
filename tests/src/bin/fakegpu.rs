//! `fakegpu run [--driver-version V] [--video GiB[,GiB...]] [--system GiB] [--unified] [--log FILE] -- CMD ARGS...`
//! Runs CMD with fake NVIDIA GPUs at /dev/nvidia* (one per `--video` size), in a private mount
//! namespace (root only).
//! `fakegpu scenario NAME --server vllm|llama --dir DIR`: runs a named scenario under gputrace.
//! `fakegpu launch FILE`: a launcher, as a Python script that starts `vllm serve ...` is: runs the
//! command FILE holds (an argument a line), which its own command line does not show, and stays
//! its parent; SIGTERM is passed on to it.
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use fakegpu::driver::Config;
use fakegpu::launcher::{run, Run};
use fakegpu::{parse_bytes, scenario};

fn usage() -> ExitCode {
    eprintln!("usage: fakegpu run [--driver-version 580.95.05] [--video 80GiB[,80GiB...]] [--system 256GiB] [--unified] [--log FILE] -- CMD ARGS...");
    eprintln!("       fakegpu scenario NAME --server vllm|llama --dir DIR [--nvml discrete|unified|none] [--gputrace PATH]");
    eprintln!("       fakegpu scenarios    (lists them)");
    eprintln!("       fakegpu doctor SETUP --nvml discrete|unified|none --dir DIR [--gputrace PATH]");
    eprintln!("       fakegpu launch FILE    (runs the command FILE holds, an argument a line)");
    ExitCode::from(2)
}

fn exit(result: anyhow::Result<i32>) -> ExitCode {
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("fakegpu: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// `fakegpu scenario NAME --server vllm|llama --dir DIR [--gputrace PATH]`: the scenario's card,
/// then the scenario inside the namespace.
fn scenario(args: &[String]) -> ExitCode {
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let (Some(name), Some(dir)) = (args.first().cloned(), value("--dir")) else { return usage() };
    let server = value("--server").unwrap_or_else(|| "vllm".into());
    let nvml = value("--nvml").unwrap_or_else(|| "discrete".into());
    let here = std::env::current_exe().ok().and_then(|p| p.parent().map(PathBuf::from)).unwrap_or_default();
    let gputrace = value("--gputrace").map(PathBuf::from).unwrap_or_else(|| here.join("gputrace"));
    if !(scenario::NAMES.contains(&name.as_str()) || name == scenario::PROBE)
        || !scenario::SERVERS.contains(&server.as_str())
        || !scenario::NVML_MODES.contains(&nvml.as_str())
    {
        eprintln!(
            "fakegpu: no scenario {name:?} for {server:?} with NVML {nvml:?}: scenarios are {}; servers vllm, llama; NVML {}",
            scenario::NAMES.join(", "),
            scenario::NVML_MODES.join(", ")
        );
        return ExitCode::from(2);
    }
    let dir = PathBuf::from(dir);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("fakegpu: cannot create {}: {e}", dir.display());
        return ExitCode::from(2);
    }
    let (gpus, unified) = scenario::card(&name, &server);
    let config = Config { version: "580.95.05".into(), gpus, system_capacity: 256 << 30, unified: unified || nvml == "unified" };
    let me = std::env::current_exe().expect("own path").display().to_string();
    let command = vec![me, "inside-scenario".into(), name, server, nvml, dir.display().to_string(), gputrace.display().to_string()];
    exit(run(Run { config, driver_log: Some(dir.join("driver.jsonl")), command }))
}

/// `fakegpu doctor SETUP --nvml MODE --dir DIR [--gputrace PATH]`: `gputrace doctor` on a host
/// set up as SETUP, with NVML answering as MODE.
fn doctor(args: &[String]) -> ExitCode {
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let (Some(setup), Some(dir)) = (args.first().cloned(), value("--dir")) else { return usage() };
    let nvml = value("--nvml").unwrap_or_else(|| "discrete".into());
    if !scenario::DOCTOR_SETUPS.contains(&setup.as_str()) || !scenario::NVML_MODES.contains(&nvml.as_str()) {
        eprintln!("fakegpu: setups are {}; NVML modes {}", scenario::DOCTOR_SETUPS.join(", "), scenario::NVML_MODES.join(", "));
        return ExitCode::from(2);
    }
    let here = std::env::current_exe().ok().and_then(|p| p.parent().map(PathBuf::from)).unwrap_or_default();
    let gputrace = value("--gputrace").map(PathBuf::from).unwrap_or_else(|| here.join("gputrace"));
    let dir = PathBuf::from(dir);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("fakegpu: cannot create {}: {e}", dir.display());
        return ExitCode::from(2);
    }
    let config = Config { version: "580.95.05".into(), gpus: vec![80 << 30], system_capacity: 256 << 30, unified: nvml == "unified" };
    let me = std::env::current_exe().expect("own path").display().to_string();
    let command = vec![me, "inside-doctor".into(), setup, nvml, dir.display().to_string(), gputrace.display().to_string()];
    exit(run(Run { config, driver_log: Some(dir.join("driver.jsonl")), command }))
}

static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_sigterm(_: libc::c_int) {
    STOP.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// `fakegpu launch FILE`: the command in FILE, waited for; its exit status is the launcher's.
fn launch(file: &Path) -> anyhow::Result<i32> {
    use anyhow::Context;
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let argv: Vec<&str> = text.lines().collect();
    let (program, args) = argv.split_first().context("no command to launch")?;
    // SAFETY: installs a handler that only stores to an atomic.
    unsafe { libc::signal(libc::SIGTERM, on_sigterm as *const () as libc::sighandler_t) };
    let mut child = std::process::Command::new(program).args(args).spawn().with_context(|| format!("starting {program}"))?;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status.code().unwrap_or(1));
        }
        if STOP.swap(false, std::sync::atomic::Ordering::Relaxed) {
            // SAFETY: kill(2) of our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("scenario") => return scenario(&args[1..]),
        Some("scenarios") => {
            for server in scenario::SERVERS {
                for name in scenario::NAMES {
                    println!("{name}\t{server}\t{}", scenario::describe(name, server));
                }
            }
            return ExitCode::SUCCESS;
        }
        Some("doctor") => return doctor(&args[1..]),
        Some("launch") if args.len() == 2 => return exit(launch(Path::new(&args[1]))),
        Some("inside-doctor") if args.len() == 5 => {
            return exit(scenario::doctor_inside(&args[1], &args[2], Path::new(&args[3]), Path::new(&args[4])).map(|()| 0));
        }
        Some("inside-scenario") if args.len() == 6 => {
            return exit(scenario::inside(&args[1], &args[2], &args[3], Path::new(&args[4]), Path::new(&args[5])).map(|()| 0));
        }
        Some("run") => {}
        _ => return usage(),
    }
    let mut config = Config { version: "580.95.05".into(), gpus: vec![80 << 30], system_capacity: 256 << 30, unified: false };
    let mut log = None;
    let mut i = 1;
    while i < args.len() && args[i] != "--" {
        if args[i] == "--unified" {
            config.unified = true;
            i += 1;
            continue;
        }
        let value = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--driver-version" => config.version = value,
            // One GPU per size: `--video 80GiB,80GiB,48GiB`.
            "--video" => match value.split(',').map(parse_bytes).collect::<Option<Vec<u64>>>() {
                Some(gpus) if !gpus.is_empty() => config.gpus = gpus,
                _ => return usage(),
            },
            "--system" => match parse_bytes(&value) {
                Some(b) => config.system_capacity = b,
                None => return usage(),
            },
            "--log" => log = Some(PathBuf::from(value)),
            _ => return usage(),
        }
        i += 2;
    }
    let command = args.get(i + 1..).map(<[String]>::to_vec).unwrap_or_default();
    exit(run(Run { config, driver_log: log, command }))
}

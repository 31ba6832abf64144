//! `fakegpu run [--driver-version V] [--video GiB] [--system GiB] [--unified] [--log FILE] -- CMD ARGS...`
//! Runs CMD with a fake NVIDIA GPU at /dev/nvidia*, in a private mount namespace (root only).
use std::path::PathBuf;
use std::process::ExitCode;

use fakegpu::driver::Config;
use fakegpu::launcher::{run, Run};
use fakegpu::parse_bytes;

fn usage() -> ExitCode {
    eprintln!("usage: fakegpu run [--driver-version 580.95.05] [--video 80GiB] [--system 256GiB] [--unified] [--log FILE] -- CMD ARGS...");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) != Some("run") {
        return usage();
    }
    let mut config = Config { version: "580.95.05".into(), video_capacity: 80 << 30, system_capacity: 256 << 30, unified: false };
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
            "--video" => match parse_bytes(&value) {
                Some(b) => config.video_capacity = b,
                None => return usage(),
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
    match run(Run { config, driver_log: log, command }) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("fakegpu: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

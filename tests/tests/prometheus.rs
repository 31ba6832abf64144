//! A real Prometheus (Debian's package, loopback only) scrapes `gputrace watch` while a fake-GPU
//! scenario runs: an earlier vLLM was killed and its engine, orphaned, holds the GPU; the next
//! one fails to load. Prometheus's HTTP API is then asked for the failure counter, the diagnosis
//! by category and the live video memory, each checked against the fake driver's own log.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{as_root, gputrace_bin};
use fakegpu::truth::{read_lines, DriverLine, DriverOp};
use serde_json::Value;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn get(addr: SocketAddr, target: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    write!(s, "GET {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").ok()?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).ok()?;
    Some(answer.split_once("\r\n\r\n")?.1.to_string())
}

/// The value of a PromQL query with one result, from Prometheus's HTTP API.
fn query(prometheus: SocketAddr, promql: &str) -> Option<f64> {
    let encoded: String = promql
        .bytes()
        .map(|b| if b.is_ascii_alphanumeric() || b"_-.".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect();
    let body = get(prometheus, &format!("/api/v1/query?query={encoded}"))?;
    let answer: Value = serde_json::from_str(body.trim_start_matches(|c: char| c != '{')).ok()?;
    answer["data"]["result"][0]["value"][1].as_str()?.parse().ok()
}

fn start_prometheus(dir: &Path, port: u16, target: SocketAddr) -> Child {
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!("global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\nscrape_configs:\n  - job_name: gputrace\n    static_configs:\n      - targets: ['{target}']\n"),
    )
    .unwrap();
    let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("prometheus (Debian's package; `cargo xtask test` installs it)")
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn prometheus_sees_the_failure_the_verdict_and_the_memory_held() {
    let _root = as_root();
    let dir = std::env::temp_dir().join(format!("gputrace-prometheus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let prometheus_addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let watch_addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut prometheus = start_prometheus(&dir, prometheus_addr.port(), watch_addr);
    let started = Instant::now();
    while get(prometheus_addr, "/-/ready").is_none_or(|b| !b.contains("Ready")) {
        assert!(started.elapsed() < Duration::from_secs(30), "prometheus did not start: {}", dir.join("prometheus.log").display());
        std::thread::sleep(Duration::from_millis(200));
    }

    let run = dir.join("run");
    let out = Command::new(env!("CARGO_BIN_EXE_fakegpu"))
        .args(["scenario", "held-by-other-process", "--server", "vllm", "--nvml", "discrete", "--dir"])
        .arg(&run)
        .arg("--gputrace")
        .arg(gputrace_bin())
        .env("GPUTRACE_WATCH_DUMPS", run.join("dumps"))
        .env("GPUTRACE_WATCH_LISTEN", watch_addr.to_string())
        // Several scrapes of the state after the failure, the orphaned engine still holding.
        .env("GPUTRACE_WATCH_LINGER_MS", "4000")
        .output()
        .unwrap();
    let logs = std::fs::read_to_string(run.join("watch.log")).unwrap_or_default();
    assert!(out.status.success(), "{}\n{logs}", String::from_utf8_lossy(&out.stderr));

    // The fake driver's account up to when the watch stopped: failed allocations, and video
    // memory allocated and not yet gone back.
    let stopped: u64 = std::fs::read_to_string(run.join("watch-stopped.txt")).unwrap().trim().parse().unwrap();
    let (mut failed, mut live) = (0u64, 0i128);
    let lines: Vec<DriverLine> = read_lines(&run.join("driver.jsonl")).unwrap();
    for line in lines.iter().filter(|l| l.ts <= stopped) {
        match &line.op {
            DriverOp::Alloc { status, .. } if *status != 0 => failed += 1,
            DriverOp::Alloc { kind, bytes, .. } if kind == "video" => live += i128::from(*bytes),
            DriverOp::Free { kind, bytes, .. } if kind == "video" => live -= i128::from(*bytes),
            _ => {}
        }
    }
    assert!(live > 0, "the scenario: the orphan holds memory");

    let ask = |promql: &str| query(prometheus_addr, promql).unwrap_or_else(|| panic!("Prometheus has no value for {promql}"));
    assert_eq!(ask("max_over_time(gputrace_allocation_failures_total[5m])"), failed as f64);
    assert_eq!(ask("max_over_time(gputrace_diagnoses_total{category=\"held-by-other-process\"}[5m])"), 1.0);
    assert_eq!(
        ask("sum(last_over_time(gputrace_live_bytes{memory=\"video\"}[5m]))"),
        live as f64,
        "live video memory as Prometheus last saw it"
    );
    assert!(ask("max_over_time(process_resident_memory_bytes[5m])") > 0.0);

    // The exposition as served passes Prometheus's own linter.
    let metrics = std::fs::read_to_string(run.join("metrics.txt")).unwrap();
    let body = metrics.split_once('\n').unwrap().1;
    let mut lint = Command::new("promtool").args(["check", "metrics"]).stdin(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    lint.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
    let lint = lint.wait_with_output().unwrap();
    assert!(lint.status.success(), "promtool: {}", String::from_utf8_lossy(&lint.stderr));

    let _ = prometheus.kill();
    let _ = prometheus.wait();
    std::fs::remove_dir_all(&dir).ok();
}

//! A load generator for the fake servers: waits until the server is ready (vLLM-like: until it
//! accepts connections; llama-like: until /health answers 200), then sends streaming completion
//! requests: one after another, then a concurrent wave. Each request's outcome goes to stdout
//! and the ground truth as a JSON line: status, time to headers, time to first data, tokens.
//!
//! `fake-load --port P --server vllm|llama [--sequential 1024,2048,15x1500] [--concurrent 16x2048]
//!            [--max-tokens 8] [--ready-timeout-s 30] [--truth FILE] [--send-after PATH]`
//! `--sequential` takes prompt sizes one after another, `NxT` for N prompts of T tokens.
//! With `--send-after`, the concurrent wave's connections are made at once (the server accepts
//! them), `{"connected": N}` is printed, and every request is sent only once PATH exists: the
//! wave's as a proxy's pooled connections, opened before a tracer attached.
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use fakegpu::serve::{Completion, Truth};
use serde_json::json;

fn ready(port: u16, server: &str, timeout: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            if server != "llama" {
                return true;
            }
            let _ = s.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n");
            let mut reply = String::new();
            let _ = s.read_to_string(&mut reply);
            if reply.starts_with("HTTP/1.1 200") {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// One streamed request; returns (status line, ms to headers, ms to first data, data events).
fn request(port: u16, c: Completion) -> (String, Option<f64>, Option<f64>, u64) {
    match TcpStream::connect(("127.0.0.1", port)) {
        Ok(s) => request_on(s, c),
        Err(_) => ("connection refused".into(), None, None, 0),
    }
}

/// Waits (60 s at most) until `path` exists.
fn wait_for_file(path: &std::path::Path) {
    let start = Instant::now();
    while !path.exists() && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One streamed request on a connection already made.
fn request_on(mut s: TcpStream, c: Completion) -> (String, Option<f64>, Option<f64>, u64) {
    let start = Instant::now();
    let body = c.body();
    let _ = write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let (mut headers_at, mut data_at) = (None, None);
    let mut status = String::new();
    loop {
        let n = match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        seen.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&seen);
        if headers_at.is_none() && text.contains("\r\n\r\n") {
            headers_at = Some(start.elapsed().as_secs_f64() * 1e3);
            status = text.lines().next().unwrap_or("").to_string();
        }
        if data_at.is_none() && text.contains("data: {") {
            data_at = Some(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    let text = String::from_utf8_lossy(&seen);
    let events = text.matches("data: {").count() as u64;
    let complete = text.contains("data: [DONE]");
    if status.is_empty() {
        status = "no response".into();
    } else if status.contains("200") && !complete {
        status = "cut off".into();
    }
    (status, headers_at, data_at, events)
}

/// One item of `--sequential`: T tokens, or N prompts of T tokens (`NxT`); nothing for what
/// does not parse.
fn prompts(item: &str) -> Vec<u64> {
    match item.split_once('x') {
        Some((n, t)) => match (n.parse::<usize>(), t.parse::<u64>()) {
            (Ok(n), Ok(t)) => vec![t; n],
            _ => Vec::new(),
        },
        None => item.parse().ok().into_iter().collect(),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let port: u16 = value("--port").and_then(|v| v.parse().ok()).unwrap_or(8000);
    let server = value("--server").unwrap_or_else(|| "vllm".into());
    let max_tokens: u64 = value("--max-tokens").and_then(|v| v.parse().ok()).unwrap_or(8);
    let timeout = Duration::from_secs(value("--ready-timeout-s").and_then(|v| v.parse().ok()).unwrap_or(30));
    let truth = Truth::open(value("--truth").as_deref(), "load");
    if !ready(port, &server, timeout) {
        eprintln!("fake-load: the server on port {port} never became ready");
        truth.note("never_ready", json!({}));
        return ExitCode::from(1);
    }
    truth.note("ready", json!({}));
    let report = |id: usize, c: Completion, (status, headers, data, events): (String, Option<f64>, Option<f64>, u64)| {
        let line = json!({"request": id, "port": port, "prompt_tokens": c.prompt_tokens, "status": status, "headers_ms": headers, "first_data_ms": data, "events": events});
        println!("{line}");
        truth.note("response", line);
    };
    let wave = value("--concurrent").and_then(|v| {
        let (n, t) = v.split_once('x')?;
        Some((n.parse::<usize>().ok()?, t.parse::<u64>().ok()?))
    });
    let send_after = value("--send-after").map(std::path::PathBuf::from);
    // The wave connected first, all of it, when the requests are to go later.
    let mut early: Vec<Option<TcpStream>> = (0..wave.map_or(0, |w| w.0)).map(|_| None).collect();
    if let Some(go) = &send_after {
        for slot in early.iter_mut() {
            *slot = TcpStream::connect(("127.0.0.1", port)).ok();
        }
        println!("{}", json!({"connected": early.iter().flatten().count()}));
        let _ = std::io::stdout().flush();
        wait_for_file(go);
    }
    let mut id = 0;
    for tokens in value("--sequential").unwrap_or_default().split(',').flat_map(prompts) {
        id += 1;
        let c = Completion { prompt_tokens: tokens, max_tokens };
        truth.note("request", json!({"request": id, "port": port, "prompt_tokens": tokens, "in_flight": 1}));
        report(id, c, request(port, c));
    }
    if let Some((n, tokens)) = wave {
        let c = Completion { prompt_tokens: tokens, max_tokens };
        let handles: Vec<_> = early
            .into_iter()
            .enumerate()
            .map(|(i, stream)| {
                truth.note("request", json!({"request": id + i + 1, "port": port, "prompt_tokens": tokens, "in_flight": n}));
                let go = send_after.clone();
                std::thread::spawn(move || match (stream, go) {
                    (Some(s), Some(go)) => {
                        wait_for_file(&go);
                        request_on(s, c)
                    }
                    (None, Some(_)) => ("connection refused".into(), None, None, 0),
                    _ => request(port, c),
                })
            })
            .collect();
        for (i, h) in handles.into_iter().enumerate() {
            report(id + i + 1, c, h.join().unwrap());
        }
    }
    ExitCode::SUCCESS
}

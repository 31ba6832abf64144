//! What the fake inference servers share: a tiny HTTP/1.1, the request format, the ground truth
//! they write, and the figures of the model they pretend to serve.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::truth::monotonic_ns;

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// A completion request: how long the prompt is and how many tokens to stream back.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct Completion {
    pub prompt_tokens: u64,
    pub max_tokens: u64,
}

impl Completion {
    /// The request body as a client sends it: the prompt's text (about 4 bytes a token) with it.
    pub fn body(&self) -> String {
        let prompt = "lorem ipsum dolor sit amet ".repeat((self.prompt_tokens * 4 / 27 + 1) as usize);
        serde_json::json!({"prompt": prompt, "prompt_tokens": self.prompt_tokens, "max_tokens": self.max_tokens, "stream": true})
            .to_string()
    }
}

pub struct HttpRequest {
    pub method: String,
    pub path: String,
    pub body: Vec<u8>,
}

/// Reads one request (headers, then Content-Length bytes of body).
pub fn read_request(stream: &mut TcpStream) -> Option<HttpRequest> {
    let mut reader = BufReader::new(stream.try_clone().ok()?);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next()?.to_string(), parts.next()?.to_string());
    let mut length = 0usize;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).ok()? == 0 || header == "\r\n" {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().ok()?;
            }
        }
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).ok()?;
    Some(HttpRequest { method, path, body })
}

/// A whole response in one write, as servers build the header block before sending it.
pub fn respond(stream: &mut TcpStream, status: &str, body: &str) {
    let response =
        format!("HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    let _ = stream.write_all(response.as_bytes());
}

/// Headers of a streamed (server-sent events) response: no body bytes yet.
pub fn stream_headers(stream: &mut TcpStream) -> bool {
    stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n").is_ok()
}

/// One SSE event carrying data: the bytes that end prefill as the client sees it.
pub fn stream_token(stream: &mut TcpStream, index: u64) -> bool {
    let event = format!("data: {{\"choices\":[{{\"index\":0,\"text\":\" tok{index}\"}}]}}\n\n");
    stream.write_all(event.as_bytes()).is_ok()
}

pub fn stream_done(stream: &mut TcpStream) {
    let _ = stream.write_all(b"data: [DONE]\n\n");
}

/// The workload's own account, JSON lines appended by every process of the server (one write
/// per line, O_APPEND, so processes never interleave within a line).
pub struct Truth {
    file: Option<Mutex<File>>,
    server: &'static str,
}

impl Truth {
    pub fn open(path: Option<&str>, server: &'static str) -> Truth {
        let file = path.and_then(|p| OpenOptions::new().create(true).append(true).open(p).ok()).map(Mutex::new);
        Truth { file, server }
    }

    pub fn note(&self, event: &str, fields: serde_json::Value) {
        let Some(file) = &self.file else { return };
        let mut line = serde_json::json!({
            "ts": monotonic_ns(),
            "pid": std::process::id(),
            // SAFETY: gettid has no preconditions.
            "tid": unsafe { libc::gettid() },
            "server": self.server,
            "event": event,
        });
        if let (Some(map), serde_json::Value::Object(extra)) = (line.as_object_mut(), fields) {
            map.extend(extra);
        }
        let mut text = line.to_string();
        text.push('\n');
        let _ = file.lock().unwrap().write_all(text.as_bytes());
    }
}

/// The model a fake server pretends to serve and how its memory scales.
#[derive(Clone, Copy, Debug)]
pub struct ModelSpec {
    pub weights: u64,
    pub layers: u64,
    /// KV cache bytes per token of context (Llama-3-8B: 128 KiB).
    pub kv_per_token: u64,
    /// Activation bytes per prompt token in a prefill batch.
    pub activation_per_token: u64,
}

/// Free device memory as cudaMemGetInfo would report it; the fake NVML's state stands in.
pub fn free_device_memory(gpu: usize) -> Option<(u64, u64)> {
    let path = std::env::var("FAKEGPU_STATE").unwrap_or_else(|_| "/dev/fakegpu-state.json".into());
    let state: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    let device = &state["devices"][gpu];
    let total = device["total"].as_u64()?;
    Some((total - device["used"].as_u64()?, total))
}

pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / GIB as f64)
}

//! A stand-in LiteLLM proxy for the scenarios, named `litellm` and given `--config FILE` as
//! gputrace finds a real one: it listens on `--port` (127.0.0.1) and forwards each connection to
//! the port of its config's first deployment's `api_base`, at most that deployment's
//! `max_parallel_requests` at once; the others wait for a place, as LiteLLM queues them. A
//! connection is one request (the fake load's are), so a place is held until the server is done
//! with it.
//!
//! `litellm --config FILE --port P`
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::ExitCode;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The places: how many connections may be forwarded at once, and how many are.
struct Places {
    taken: Mutex<u64>,
    freed: Condvar,
    limit: u64,
}

impl Places {
    fn take(&self) {
        let mut taken = self.taken.lock().unwrap();
        while *taken >= self.limit {
            taken = self.freed.wait(taken).unwrap();
        }
        *taken += 1;
    }

    fn give_back(&self) {
        *self.taken.lock().unwrap() -= 1;
        self.freed.notify_one();
    }
}

/// The first value of `key:` in the config, as written.
fn first<'c>(config: &'c str, key: &str) -> Option<&'c str> {
    config.lines().find_map(|l| l.trim().strip_prefix(key)?.strip_prefix(':')).map(str::trim)
}

/// The server, until it listens (it may still be loading when the first request comes).
fn connect(port: u16) -> Option<TcpStream> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// One client's connection, forwarded once it has a place: its bytes to the server and the
/// server's back, until the server is done.
fn forward(client: TcpStream, server_port: u16, places: &Places) {
    places.take();
    if let Some(server) = connect(server_port) {
        let (mut from_client, mut to_server) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let upstream = std::thread::spawn(move || {
            let _ = std::io::copy(&mut from_client, &mut to_server);
            let _ = to_server.shutdown(Shutdown::Write);
        });
        let (mut from_server, mut to_client) = (server, client);
        let mut buf = [0u8; 16 * 1024];
        while let Ok(n) = from_server.read(&mut buf) {
            if n == 0 || to_client.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to_client.shutdown(Shutdown::Both);
        let _ = from_server.shutdown(Shutdown::Both);
        let _ = upstream.join();
    }
    places.give_back();
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let (Some(config), Some(port)) = (value("--config"), value("--port").and_then(|p| p.parse::<u16>().ok())) else {
        eprintln!("usage: litellm --config FILE --port P");
        return ExitCode::FAILURE;
    };
    let Ok(text) = std::fs::read_to_string(&config) else {
        eprintln!("litellm: cannot read {config}");
        return ExitCode::FAILURE;
    };
    // http://localhost:8123/v1 -> 8123
    let server_port = first(&text, "api_base").and_then(|url| url.rsplit(':').next()?.split('/').next()?.parse::<u16>().ok());
    let Some(server_port) = server_port else {
        eprintln!("litellm: no api_base with a port in {config}");
        return ExitCode::FAILURE;
    };
    let limit = first(&text, "max_parallel_requests").and_then(|n| n.parse().ok()).unwrap_or(u64::MAX);
    let listener = match TcpListener::bind(("127.0.0.1", port)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("litellm: cannot listen on {port}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let places = Arc::new(Places { taken: Mutex::new(0), freed: Condvar::new(), limit });
    for client in listener.incoming().flatten() {
        let places = Arc::clone(&places);
        std::thread::spawn(move || forward(client, server_port, &places));
    }
    ExitCode::SUCCESS
}

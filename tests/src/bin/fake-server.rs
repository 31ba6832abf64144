//! Inference servers that use the fake GPU the way the real ones use a GPU
//! (vLLM binds early and listens after load; llama-server listens first and answers 503 while
//! loading), with real sockets on 127.0.0.1.
//!
//! `fake-server --server vllm --port P [--model-gib 16] [--util 0.9] [--max-num-seqs 256]
//!             [--max-model-len L] [--truth FILE]`
//!   An API server process that binds the port at once but listens only after the engine
//!   process (a child, which holds the GPU) has loaded: weights as one allocation per large
//!   parameter, a profiling burst then frees, the KV cache as one identical block per layer,
//!   graph capture. Streaming responses send headers at once and data at time-to-first-token.
//!   Decode allocates nothing; a prefill batch larger than any before allocates activations.
//!   A batch holds at most `--max-num-seqs` requests (the rest wait); a prompt longer than
//!   `--max-model-len` tokens is refused with a 400.
//!   An engine that runs out of memory dies, and the API server with it. An engine that finds
//!   too little free memory at start refuses without allocating. With `--tensor-parallel-size N`
//!   the engine is rank 0 on GPU 0 and starts a worker per further rank, each on its own GPU,
//!   each loading 1/N of the weights and its own KV cache; a rank that fails takes the engine down.
//! `fake-server --server llama --port P [--model-gib 14] [--ctx|-c 16384] [--parallel|-np 4] [--helper]`
//!   Listens first and answers 503 while loading; one weights buffer, one KV buffer sized by
//!   the context, compute buffers (device and pinned host), a VMM-style scratch pool that grows
//!   on big prompts and never shrinks; headers at time-to-first-token. At most `--parallel`
//!   requests are served at once (the rest wait for a slot); a prompt past the context is
//!   refused with a 400. Out of memory at load
//!   exits 1; at run time it aborts. `--helper` forks a child that keeps the device files.
//!   `--tensor-split 1,1` splits the weights evenly over that many GPUs, from one process.
//!   `--touch-host-mib N` reads N MiB of "model file" into host memory per weights GiB while
//!   loading (the host RAM spike that gets servers OOM-killed on unified-memory machines).
//! Either family: `--keep-mib-per-request N` keeps N MiB of video memory per request served,
//! allocated at the end of its prefill and never freed (a prompt cache with no bound, a leak):
//! noted `kept` in the ground truth. Out of memory there fails the server as any other
//! allocation in prefill does.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::FromRawFd;
use std::process::{ChildStdin, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fakegpu::cuda::{Buffer, Gpu, Path};
use fakegpu::serve::{
    free_device_memory, gib, read_request, respond, stream_done, stream_headers, stream_token, Completion, ModelSpec, Truth, GIB, MIB,
};
use serde_json::json;

struct Args {
    server: String,
    role: String,
    port: u16,
    model_gib: u64,
    util: f64,
    /// llama: the context (`--ctx`, `-c`), and the slots served at once (`--parallel`, `-np`);
    /// a request waits for a free slot.
    ctx: u64,
    parallel: u64,
    /// llama: the longest prompt one slot takes: as llama-server, `ctx / parallel` when
    /// `--parallel` is given, unless the KV cache is unified (`--kv-unified`); with `--parallel`
    /// left to its default (auto, unified), all of `ctx`.
    slot_ctx: u64,
    /// vLLM: the most requests batched at once, and the longest prompt admitted (longer ones
    /// are refused with a 400, as vLLM does).
    max_num_seqs: u64,
    max_model_len: Option<u64>,
    helper: bool,
    touch_host_mib: u64,
    /// Video memory kept per request served, never freed.
    keep_per_request: u64,
    /// GPUs the model is sharded over: vLLM's tensor-parallel ranks, llama's --tensor-split.
    shards: u32,
    /// A vLLM worker's rank (and GPU).
    rank: u32,
    truth: Option<String>,
    raw: Vec<String>,
}

fn parse_args() -> Args {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    // The last of a flag given twice (under any of its names) wins, as with the real servers'
    // parsers.
    let value_of = |names: &[&str]| raw.iter().rposition(|a| names.contains(&a.as_str())).and_then(|i| raw.get(i + 1)).cloned();
    let value = |flag: &str| value_of(&[flag]);
    let server = value("--server").unwrap_or_else(|| "vllm".into());
    let default_model = if server == "llama" { 14 } else { 16 };
    let ctx = value_of(&["--ctx", "-c"]).and_then(|v| v.parse().ok()).unwrap_or(16384);
    let given_parallel = value_of(&["--parallel", "-np"]).and_then(|v| v.parse::<u64>().ok());
    // The last of --kv-unified and --no-kv-unified.
    let unified = raw.iter().rev().find_map(|a| match a.as_str() {
        "--kv-unified" | "-kvu" => Some(true),
        "--no-kv-unified" | "-no-kvu" => Some(false),
        _ => None,
    });
    Args {
        role: value("--role").unwrap_or_else(|| "api".into()),
        port: value("--port").and_then(|v| v.parse().ok()).unwrap_or(8000),
        model_gib: value("--model-gib").and_then(|v| v.parse().ok()).unwrap_or(default_model),
        util: value("--util").and_then(|v| v.parse().ok()).unwrap_or(0.9),
        ctx,
        parallel: given_parallel.unwrap_or(4),
        slot_ctx: match given_parallel {
            Some(n) if unified != Some(true) => ctx / n.max(1),
            _ => ctx,
        },
        max_num_seqs: value("--max-num-seqs").and_then(|v| v.parse().ok()).unwrap_or(256),
        max_model_len: value("--max-model-len").and_then(|v| v.parse().ok()),
        helper: raw.iter().any(|a| a == "--helper"),
        touch_host_mib: value("--touch-host-mib").and_then(|v| v.parse().ok()).unwrap_or(0),
        keep_per_request: value("--keep-mib-per-request").and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) * MIB,
        shards: value("--tensor-parallel-size")
            .and_then(|v| v.parse().ok())
            .or_else(|| value("--tensor-split").map(|v| v.split(',').count() as u32))
            .unwrap_or(1)
            .max(1),
        rank: value("--rank").and_then(|v| v.parse().ok()).unwrap_or(0),
        truth: value("--truth"),
        server,
        raw,
    }
}

fn spec(args: &Args) -> ModelSpec {
    ModelSpec {
        weights: args.model_gib * GIB,
        layers: 32,
        kv_per_token: 128 << 10,
        activation_per_token: if args.server == "llama" { 512 << 10 } else { 256 << 10 },
    }
}

/// The server's last note before it dies. It comes a moment after the failure, as a real server's
/// does (its traceback or backtrace is printed first): a thread whose read returned just before the
/// failure has noted it by then, so the ground truth holds every request the kernel saw read.
fn fatal(truth: &Truth, in_flight: usize) {
    std::thread::sleep(Duration::from_millis(50));
    truth.note("fatal", json!({"in_flight": in_flight}));
}

/// Allocates and records it in the ground truth with the phase and the requests in flight.
fn alloc(gpu: &mut Gpu, truth: &Truth, path: Path, bytes: u64, phase: &str, in_flight: usize) -> Option<Buffer> {
    match gpu.alloc(path, bytes) {
        Ok(b) => {
            truth.note(
                "alloc",
                json!({"bytes": bytes, "path": format!("{path:?}"), "phase": phase, "in_flight": in_flight, "handle": b.handle}),
            );
            Some(b)
        }
        Err(status) => {
            truth.note(
                "alloc_failed",
                json!({"bytes": bytes, "path": format!("{path:?}"), "phase": phase, "in_flight": in_flight, "status": status}),
            );
            None
        }
    }
}

/// Reading the model file on a unified-memory machine: host memory, really touched.
fn touch_host(mib: u64, keep: &mut Vec<Vec<u8>>) {
    if mib > 0 {
        keep.push(vec![1u8; (mib * MIB) as usize]);
    }
}

// ---- vLLM-like ---------------------------------------------------------------------------------

static ENGINE: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_sigterm(_: libc::c_int) {
    // SAFETY: kill, waitpid and _exit are async-signal-safe.
    unsafe {
        let engine = ENGINE.load(Ordering::SeqCst);
        if engine > 0 {
            libc::kill(engine, libc::SIGTERM);
            // A graceful shutdown waits for the engine (vLLM's does): its GPU memory is freed
            // before the server is gone.
            libc::waitpid(engine, std::ptr::null_mut(), 0);
        }
        libc::_exit(0);
    }
}

/// The API server: binds early, starts the engine, listens once the engine is ready.
fn vllm_api(args: &Args, truth: &Arc<Truth>) -> ExitCode {
    // SAFETY: plain socket calls; the fd becomes a TcpListener once listening.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    let one: libc::c_int = 1;
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    addr.sin_family = libc::AF_INET as u16;
    addr.sin_port = args.port.to_be();
    addr.sin_addr.s_addr = u32::from_be_bytes([127, 0, 0, 1]).to_be();
    unsafe {
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, &one as *const _ as *const libc::c_void, 4);
        if libc::bind(fd, &addr as *const _ as *const libc::sockaddr, std::mem::size_of::<libc::sockaddr_in>() as u32) != 0 {
            eprintln!("fake-server: cannot bind 127.0.0.1:{}: {}", args.port, std::io::Error::last_os_error());
            return ExitCode::from(1);
        }
    }
    truth.note("bind", json!({"port": args.port}));

    let me = std::env::current_exe().expect("own path");
    let mut engine_args: Vec<String> = args.raw.clone();
    engine_args.extend(["--role".into(), "engine".into()]);
    // Not waited for on every path, on purpose: a server that dies leaves its engine orphaned,
    // holding the GPU, as vLLM's does (the held-by-other-process scenario).
    #[allow(clippy::zombie_processes)]
    let mut engine = Command::new(me).args(&engine_args).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("starting the engine");
    // A clean shutdown (SIGTERM) stops the engine too; SIGKILL cannot, and leaves it orphaned.
    ENGINE.store(engine.id() as i32, Ordering::SeqCst);
    // SAFETY: installs a handler that only calls async-signal-safe functions.
    unsafe { libc::signal(libc::SIGTERM, on_sigterm as *const () as libc::sighandler_t) };
    let to_engine = Arc::new(Mutex::new(engine.stdin.take().unwrap()));
    let mut from_engine = BufReader::new(engine.stdout.take().unwrap());
    let mut line = String::new();
    if from_engine.read_line(&mut line).unwrap_or(0) == 0 || line.trim() != "READY" {
        let status = engine.wait().ok().and_then(|s| s.code()).unwrap_or(1);
        eprintln!("fake-server: the engine failed to start (exit {status}); the API server exits");
        truth.note("exit", json!({"reason": "engine failed to start"}));
        return ExitCode::from(1);
    }
    // SAFETY: listen on our bound socket, then hand it to std.
    unsafe { libc::listen(fd, 128) };
    let listener = unsafe { TcpListener::from_raw_fd(fd) };
    truth.note("listen", json!({"port": args.port}));

    // Engine output is routed to the request that owns each line.
    let routes: Arc<Mutex<HashMap<u64, Sender<String>>>> = Arc::new(Mutex::new(HashMap::new()));
    let dead = Arc::new(Mutex::new(false));
    {
        let (routes, dead) = (routes.clone(), dead.clone());
        std::thread::spawn(move || {
            for line in from_engine.lines() {
                let Ok(line) = line else { break };
                let id: u64 = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
                if let Some(route) = routes.lock().unwrap().get(&id) {
                    let _ = route.send(line.clone());
                }
            }
            // EOF: the engine died. In-flight streams are cut; the server goes down (vLLM's
            // watchdog takes up to 5 s; this one is quicker).
            *dead.lock().unwrap() = true;
            for (_, route) in routes.lock().unwrap().drain() {
                let _ = route.send("DEAD".into());
            }
        });
    }
    let next_id = Arc::new(Mutex::new(0u64));
    listener.set_nonblocking(true).unwrap();
    loop {
        if *dead.lock().unwrap() {
            std::thread::sleep(Duration::from_millis(200));
            truth.note("exit", json!({"reason": "EngineDeadError"}));
            eprintln!("fake-server: EngineDeadError: the engine died; shutting down");
            return ExitCode::from(1);
        }
        let Ok((stream, _)) = listener.accept() else {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        };
        stream.set_nonblocking(false).unwrap();
        let api = Api { to_engine: to_engine.clone(), routes: routes.clone(), next_id: next_id.clone(), truth: truth.clone() };
        let max_model_len = args.max_model_len;
        std::thread::spawn(move || api.serve(stream, max_model_len));
    }
}

/// What the API server's connections share: the engine's input, where its output goes, the
/// requests' numbers and the ground truth.
struct Api {
    to_engine: Arc<Mutex<ChildStdin>>,
    routes: Arc<Mutex<HashMap<u64, Sender<String>>>>,
    next_id: Arc<Mutex<u64>>,
    truth: Arc<Truth>,
}

impl Api {
    /// One connection: its request sent to the engine, the engine's tokens streamed back.
    fn serve(self, mut stream: TcpStream, max_model_len: Option<u64>) {
        let Some(request) = read_request(&mut stream) else { return };
        self.truth.note("read", json!({"path": request.path}));
        let Ok(c) = serde_json::from_slice::<Completion>(&request.body) else {
            return respond(&mut stream, "400 Bad Request", r#"{"error":"bad request"}"#);
        };
        if max_model_len.is_some_and(|l| c.prompt_tokens > l) {
            return respond(&mut stream, "400 Bad Request", r#"{"error":"This model's maximum context length is exceeded"}"#);
        }
        let id = {
            let mut n = self.next_id.lock().unwrap();
            *n += 1;
            *n
        };
        let (tx, rx) = channel();
        self.routes.lock().unwrap().insert(id, tx);
        // Starlette sends status and headers before the body: at once.
        stream_headers(&mut stream);
        let _ = writeln!(self.to_engine.lock().unwrap(), "REQ {id} {} {}", c.prompt_tokens, c.max_tokens);
        for msg in rx {
            let mut words = msg.split_whitespace();
            match words.next() {
                Some("TOKEN") => {
                    let index = words.nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
                    stream_token(&mut stream, index);
                }
                Some("DONE") => {
                    stream_done(&mut stream);
                    break;
                }
                _ => break,
            }
        }
        self.routes.lock().unwrap().remove(&id);
    }
}

struct Waiting {
    id: u64,
    completion: Completion,
}

/// One rank's load on its own GPU: the free-memory check, its share of the weights, the profiling
/// burst, its KV cache, graph capture. The GPU, or the exit status of a rank that failed.
fn vllm_load(args: &Args, truth: &Truth) -> Result<Gpu, ExitCode> {
    let model = spec(args);
    let mut gpu = Gpu::open(args.rank).map_err(|e| {
        eprintln!("fake-server rank {}: {e}", args.rank);
        ExitCode::from(1)
    })?;
    truth.note("phase", json!({"phase": "load", "rank": args.rank}));
    let (free, total) = free_device_memory(args.rank as usize).unwrap_or((80 * GIB, 80 * GIB));
    let requested = (total as f64 * args.util) as u64;
    if free < requested {
        eprintln!(
            "ValueError: Free memory on device ({}/{}) on startup is less than desired GPU memory utilization ({}, {}). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
            gib(free), gib(total), args.util, gib(requested)
        );
        truth.note("refused", json!({"free": free, "requested": requested}));
        return Err(ExitCode::from(1));
    }
    let mut host = Vec::new();
    let oom = |bytes: u64| {
        eprintln!("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {} on GPU {}.", gib(bytes), args.rank);
        ExitCode::from(1)
    };
    // Weights: about one cudaMalloc per large parameter; each rank holds its shard.
    let param = 512 * MIB;
    let shard = model.weights / u64::from(args.shards);
    for _ in 0..shard.div_ceil(param) {
        touch_host(args.touch_host_mib / 2, &mut host);
        if alloc(&mut gpu, truth, Path::RmAlloc, param, "load", 0).is_none() {
            return Err(oom(param));
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    // profile_run: a burst up to the activation peak, then a burst of frees (empty_cache).
    let burst: Vec<Buffer> = (0..8).filter_map(|_| alloc(&mut gpu, truth, Path::RmAlloc, 256 * MIB, "load", 0)).collect();
    if burst.len() < 8 {
        return Err(oom(256 * MIB));
    }
    for b in &burst {
        let _ = gpu.free(b);
        truth.note("free", json!({"bytes": b.bytes, "phase": "load", "handle": b.handle}));
    }
    // KV cache: the rest of the budget, one identical block per layer.
    let peak = 8 * 256 * MIB;
    let kv_total = requested.saturating_sub(shard + peak);
    let block = (kv_total / model.layers) & !(2 * MIB - 1);
    for _ in 0..model.layers {
        if alloc(&mut gpu, truth, Path::RmAlloc, block, "load", 0).is_none() {
            eprintln!("ValueError: No available memory for the cache blocks.");
            return Err(ExitCode::from(1));
        }
    }
    // CUDA graph capture, largest first, above the budget.
    for i in 0..20u64 {
        if alloc(&mut gpu, truth, Path::RmAlloc, (96 - 3 * i) * MIB, "load", 0).is_none() {
            return Err(oom((96 - 3 * i) * MIB));
        }
    }
    Ok(gpu)
}

/// A tensor-parallel worker: loads its rank, says READY, and holds its GPU until its engine goes
/// (its stdin closes).
fn vllm_worker(args: &Args, truth: &Truth) -> ExitCode {
    // Held until the engine goes: dropping it would close the device files and free the rank.
    let _gpu = match vllm_load(args, truth) {
        Ok(gpu) => gpu,
        Err(code) => return code,
    };
    println!("READY");
    let _ = std::io::stdout().flush();
    let _ = std::io::stdin().lock().lines().count();
    ExitCode::SUCCESS
}

/// The engine: rank 0, with a worker per further rank; loads, then runs prefill batches and
/// decode steps. A rank that fails to load takes every rank down, as vLLM's executor does.
fn vllm_engine(args: &Args, truth: &Truth) -> ExitCode {
    let model = spec(args);
    let me = std::env::current_exe().expect("own path");
    let mut workers = Vec::new();
    for rank in 1..args.shards {
        // The engine's own arguments, its role replaced.
        let mut worker_args: Vec<String> = Vec::new();
        let mut raw = args.raw.iter();
        while let Some(a) = raw.next() {
            if a == "--role" {
                raw.next();
            } else {
                worker_args.push(a.clone());
            }
        }
        worker_args.extend(["--role".into(), "worker".into(), "--rank".into(), rank.to_string()]);
        match Command::new(&me).args(&worker_args).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn() {
            Ok(w) => workers.push(w),
            Err(e) => {
                eprintln!("fake-server engine: cannot start worker {rank}: {e}");
                return ExitCode::from(1);
            }
        }
    }
    let stop = |workers: &mut Vec<std::process::Child>, code: ExitCode| {
        for w in workers.iter_mut() {
            let _ = w.kill();
            let _ = w.wait();
        }
        code
    };
    let mut gpu = match vllm_load(args, truth) {
        Ok(g) => g,
        Err(code) => return stop(&mut workers, code),
    };
    for (i, w) in workers.iter_mut().enumerate() {
        let mut line = String::new();
        if BufReader::new(w.stdout.take().unwrap()).read_line(&mut line).unwrap_or(0) == 0 || line.trim() != "READY" {
            eprintln!("RuntimeError: worker {} failed to load; shutting down every rank", i + 1);
            return stop(&mut workers, ExitCode::from(1));
        }
    }
    truth.note("phase", json!({"phase": "idle"}));
    println!("READY");
    let _ = std::io::stdout().flush();

    let (tx, rx) = channel::<Waiting>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            let w: Vec<u64> = line.split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
            if w.len() == 3 {
                let _ = tx.send(Waiting { id: w[0], completion: Completion { prompt_tokens: w[1], max_tokens: w[2] } });
            }
        }
        // Like a real EngineCore blocked on its socket, it does not notice its API server is
        // gone: it stays, holding the GPU, until it is killed.
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    });
    serve_batches(&mut gpu, truth, &model, rx, (args.max_num_seqs.max(1) as usize, args.keep_per_request))
}

/// Prefill the waiting requests as one batch, then decode them together; activations grow to the
/// largest batch seen and are reused after. `(max_num_seqs, keep)`: the most in a batch, and what
/// each request leaves behind.
fn serve_batches(gpu: &mut Gpu, truth: &Truth, model: &ModelSpec, rx: Receiver<Waiting>, (max_num_seqs, keep): (usize, u64)) -> ExitCode {
    let mut workspace = 0u64;
    let mut kept: Vec<Buffer> = Vec::new();
    let mut out = std::io::stdout();
    // Requests past --max-num-seqs wait for a later batch.
    let mut queued: std::collections::VecDeque<Waiting> = std::collections::VecDeque::new();
    loop {
        if queued.is_empty() {
            let Ok(first) = rx.recv() else { break };
            queued.push_back(first);
        }
        std::thread::sleep(Duration::from_millis(30));
        queued.extend(rx.try_iter());
        let batch: Vec<Waiting> = queued.drain(..queued.len().min(max_num_seqs)).collect();
        let in_flight = batch.len();
        let tokens: u64 = batch.iter().map(|w| w.completion.prompt_tokens).sum();
        for w in &batch {
            let bytes = w.completion.prompt_tokens * model.activation_per_token;
            truth.note(
                "prefill",
                json!({"request": w.id, "prompt_tokens": w.completion.prompt_tokens, "bytes": bytes, "in_flight": in_flight}),
            );
        }
        let needed = tokens * model.activation_per_token;
        if needed > workspace {
            let grow = (needed - workspace).next_multiple_of(2 * MIB);
            if alloc(gpu, truth, Path::RmAlloc, grow, "prefill", in_flight).is_none() {
                eprintln!("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {}. EngineCore died.", gib(grow));
                fatal(truth, in_flight);
                return ExitCode::from(1);
            }
            workspace += grow;
        }
        for w in batch.iter().filter(|_| keep > 0) {
            match alloc(gpu, truth, Path::RmAlloc, keep, "prefill", in_flight) {
                Some(b) => {
                    truth.note("kept", json!({"request": w.id, "bytes": keep, "handle": b.handle}));
                    kept.push(b);
                }
                None => {
                    eprintln!("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {}. EngineCore died.", gib(keep));
                    fatal(truth, in_flight);
                    return ExitCode::from(1);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20 + tokens / 200));
        let steps = batch.iter().map(|w| w.completion.max_tokens).max().unwrap_or(0);
        truth.note("phase", json!({"phase": "decode", "in_flight": in_flight}));
        for step in 0..steps {
            for w in batch.iter().filter(|w| step < w.completion.max_tokens) {
                let _ = writeln!(out, "TOKEN {} {step}", w.id);
            }
            let _ = out.flush();
            std::thread::sleep(Duration::from_millis(10));
        }
        for w in &batch {
            let _ = writeln!(out, "DONE {}", w.id);
            truth.note("done", json!({"request": w.id}));
        }
        let _ = out.flush();
        truth.note("phase", json!({"phase": "idle"}));
    }
    ExitCode::SUCCESS
}

// ---- llama-server-like -------------------------------------------------------------------------

struct Pool {
    capacity: u64,
    in_use: u64,
    chunks: Vec<Buffer>,
}

fn llama(args: &Args, truth: Arc<Truth>) -> ExitCode {
    let model = spec(args);
    let listener = match TcpListener::bind(("127.0.0.1", args.port)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("fake-server: cannot listen on 127.0.0.1:{}: {e}", args.port);
            return ExitCode::from(1);
        }
    };
    truth.note("listen", json!({"port": args.port}));
    // SAFETY: installs a handler that only calls async-signal-safe functions: a graceful stop.
    unsafe { libc::signal(libc::SIGTERM, on_sigterm as *const () as libc::sighandler_t) };
    let server = Arc::new(Llama {
        ready: Mutex::new(false),
        gpu: Mutex::new(None),
        pool: Mutex::new(Pool { capacity: 0, in_use: 0, chunks: Vec::new() }),
        in_flight: Mutex::new(0),
        slots: (Mutex::new(args.parallel.max(1)), std::sync::Condvar::new()),
        ctx: args.slot_ctx,
        activation_per_token: model.activation_per_token,
        keep: (args.keep_per_request, Mutex::new(Vec::new())),
        truth: truth.clone(),
    });
    {
        let server = server.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let server = server.clone();
                std::thread::spawn(move || server.serve(stream));
            }
        });
    }
    // One context per GPU the weights are split over; the KV cache and buffers on GPU 0.
    let mut contexts = Vec::new();
    for gpu in 0..args.shards {
        match Gpu::open(gpu) {
            Ok(g) => contexts.push(g),
            Err(e) => {
                eprintln!("fake-server: {e}");
                return ExitCode::from(1);
            }
        }
    }
    truth.note("phase", json!({"phase": "load"}));
    let mut host = Vec::new();
    for _ in 0..args.model_gib {
        touch_host(args.touch_host_mib, &mut host);
    }
    let load_fail = |what: &str, bytes: u64, device: usize| {
        eprintln!(
            "ggml_backend_cuda_buffer_type_alloc_buffer: allocating {} on device {device}: cudaMalloc failed: out of memory",
            gib(bytes)
        );
        eprintln!("llama_model_load: error loading model: {what}\nmain: exiting due to model loading error");
        ExitCode::from(1)
    };
    let share = model.weights / u64::from(args.shards);
    for (device, g) in contexts.iter_mut().enumerate() {
        if alloc(g, &truth, Path::VidHeap, share, "load", 0).is_none() {
            return load_fail(&format!("unable to allocate CUDA{device} buffer"), share, device);
        }
    }
    let mut g = contexts.remove(0);
    let kv_bytes = args.ctx * model.kv_per_token;
    let Some(kv) = alloc(&mut g, &truth, Path::VidHeap, kv_bytes, "load", 0) else {
        return load_fail("failed to allocate buffer for kv cache", kv_bytes, 0);
    };
    if alloc(&mut g, &truth, Path::VidHeap, 512 * MIB, "load", 0).is_none() {
        return load_fail("failed to allocate compute pp buffers", 512 * MIB, 0);
    }
    let _ = alloc(&mut g, &truth, Path::HostPinned, 128 * MIB, "load", 0);
    if g.semaphore_pool(2 * MIB).is_ok() {
        truth.note("alloc", json!({"bytes": 2 * MIB, "path": "SemaphorePool", "phase": "load", "in_flight": 0}));
    }
    let _ = g.dup(&kv);
    // The VMM pool reserves address space up front and grows into it.
    let _ = alloc(&mut g, &truth, Path::VirtualReserve, 32 * GIB, "load", 0);
    drop(host);
    if args.helper {
        fork_helper(std::iter::once(&g).chain(&contexts));
    }
    *server.gpu.lock().unwrap() = Some(g);
    *server.ready.lock().unwrap() = true;
    truth.note("phase", json!({"phase": "idle"}));
    eprintln!("main: model loaded");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// A forked child that keeps the device files of `contexts` and nothing else (a connection open
/// at the fork would otherwise stay open in it, and its client wait forever for the end of the
/// response), and sleeps: memory held by a process that allocated none of it.
fn fork_helper<'g>(contexts: impl Iterator<Item = &'g Gpu>) {
    let mut keep = [-1; 16];
    for (slot, fd) in keep.iter_mut().zip(contexts.flat_map(|c| [&c.ctl, &c.gpu_file, &c.uvm])) {
        *slot = std::os::fd::AsRawFd::as_raw_fd(fd);
    }
    // SAFETY: fork; the child only closes fds and sleeps (no allocation after the fork).
    if unsafe { libc::fork() } == 0 {
        for fd in 3..4096 {
            if !keep.contains(&fd) {
                // SAFETY: closing an fd of our own; unused ones fail harmlessly.
                unsafe { libc::close(fd) };
            }
        }
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

/// What the llama-server-like server's connections share.
struct Llama {
    /// Loaded: until then every request is answered 503, as llama-server does.
    ready: Mutex<bool>,
    gpu: Mutex<Option<Gpu>>,
    pool: Mutex<Pool>,
    in_flight: Mutex<usize>,
    /// Free slots: a request waits for one.
    slots: (Mutex<u64>, std::sync::Condvar),
    /// A slot's context, in tokens.
    ctx: u64,
    activation_per_token: u64,
    /// What each request leaves behind, and what was left.
    keep: (u64, Mutex<Vec<Buffer>>),
    truth: Arc<Truth>,
}

impl Llama {
    /// One connection: 503 while loading, the health check, or a completion in a free slot.
    fn serve(&self, mut stream: TcpStream) {
        let Some(request) = read_request(&mut stream) else { return };
        self.truth.note("read", json!({"path": request.path}));
        if !*self.ready.lock().unwrap() {
            return respond(&mut stream, "503 Service Unavailable", r#"{"error":{"code":503,"message":"Loading model"}}"#);
        }
        if request.path == "/health" {
            return respond(&mut stream, "200 OK", r#"{"status":"ok"}"#);
        }
        let Ok(c) = serde_json::from_slice::<Completion>(&request.body) else {
            return respond(&mut stream, "400 Bad Request", r#"{"error":"bad request"}"#);
        };
        if c.prompt_tokens > self.ctx {
            return respond(&mut stream, "400 Bad Request", r#"{"error":"the request exceeds the available context size"}"#);
        }
        let (free, freed) = &self.slots;
        let mut n = freed.wait_while(free.lock().unwrap(), |n| *n == 0).unwrap();
        *n -= 1;
        drop(n);
        self.complete(&mut stream, c);
        *free.lock().unwrap() += 1;
        freed.notify_one();
    }
}

impl Llama {
    /// Prefill grows the scratch pool as needed (and keeps what each request leaves behind), then
    /// the headers and the first data go out together (time-to-first-token), then decode, which
    /// allocates nothing.
    fn complete(&self, stream: &mut TcpStream, c: Completion) {
        let (truth, in_flight) = (&self.truth, &self.in_flight);
        let n = {
            let mut n = in_flight.lock().unwrap();
            *n += 1;
            *n
        };
        let needed = c.prompt_tokens * self.activation_per_token;
        truth.note("prefill", json!({"prompt_tokens": c.prompt_tokens, "bytes": needed, "in_flight": n}));
        {
            let mut p = self.pool.lock().unwrap();
            p.in_use += needed;
            while p.in_use > p.capacity {
                let chunk = (p.in_use - p.capacity).next_multiple_of(64 * MIB);
                match self.alloc(chunk) {
                    Some(b) => {
                        p.capacity += chunk;
                        p.chunks.push(b);
                    }
                    None => self.abort(),
                }
            }
        }
        std::thread::sleep(Duration::from_millis(40 + c.prompt_tokens / 200));
        let (keep, kept) = &self.keep;
        if *keep > 0 {
            let Some(b) = self.alloc(*keep) else { self.abort() };
            truth.note("kept", json!({"prompt_tokens": c.prompt_tokens, "bytes": keep, "handle": b.handle}));
            kept.lock().unwrap().push(b);
        }
        self.pool.lock().unwrap().in_use -= needed;
        stream_headers(stream);
        for i in 0..c.max_tokens {
            if !stream_token(stream, i) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        stream_done(stream);
        *in_flight.lock().unwrap() -= 1;
        truth.note("done", json!({"prompt_tokens": c.prompt_tokens}));
    }

    /// Video memory in prefill, as ggml's pool and cache allocate it.
    fn alloc(&self, bytes: u64) -> Option<Buffer> {
        let now = *self.in_flight.lock().unwrap();
        let mut g = self.gpu.lock().unwrap();
        alloc(g.as_mut().unwrap(), &self.truth, Path::RmAllocNvos21, bytes, "prefill", now)
    }

    /// Out of memory at run time: llama-server aborts.
    fn abort(&self) -> ! {
        eprintln!("CUDA error: out of memory\n  current device: 0, in function alloc at ggml-cuda.cu:509\n  cuMemCreate(&handle, reserve_size, &prop, 0)");
        fatal(&self.truth, *self.in_flight.lock().unwrap());
        std::process::abort();
    }
}

fn main() -> ExitCode {
    let args = parse_args();
    let server = if args.server == "llama" { "llama" } else { "vllm" };
    let truth = Arc::new(Truth::open(args.truth.as_deref(), server));
    match (server, args.role.as_str()) {
        ("llama", _) => llama(&args, truth),
        (_, "engine") => vllm_engine(&args, &truth),
        (_, "worker") => vllm_worker(&args, &truth),
        _ => vllm_api(&args, &truth),
    }
}

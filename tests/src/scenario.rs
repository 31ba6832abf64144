//! The named scenarios, the same in the demo and the tests: each one a way "CUDA out of memory"
//! happens to an inference server (or does not), run under `gputrace record` on the fake GPU.
//! `fakegpu scenario NAME --server vllm|llama --dir DIR` picks the card, builds the namespace
//! and runs [`inside`] there; DIR gets the trace (`run.trace`), gputrace's JSON summary
//! (`record.json`), the driver's log (`driver.jsonl`) and the workload's (`workload.jsonl`).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use crate::serve::GIB;

pub const NAMES: [&str; 8] = [
    "clean",
    "held-by-other-process",
    "does-not-fit-at-load",
    "long-request",
    "concurrent-load",
    "kept-by-service",
    "host-oom",
    "tensor-parallel",
];
pub const SERVERS: [&str; 2] = ["vllm", "llama"];
/// Not one of the named ways to fail: a clean run with the load GPUTRACE_LOAD gives (and the
/// server's flags GPUTRACE_SERVER_ARGS gives, as in every scenario), to try a prediction.
pub const PROBE: &str = "probe";

/// The GPUs each scenario runs on: (each one's device memory, unified). The tensor-parallel
/// scenario's node has a smaller last card.
pub fn card(name: &str, server: &str) -> (Vec<u64>, bool) {
    // GPUTRACE_VIDEO_GIB: another size of card, to try a what-if of one.
    let given = std::env::var("GPUTRACE_VIDEO_GIB").ok().and_then(|v| v.parse::<u64>().ok());
    let video = given.map(|g| g * GIB).unwrap_or(if server == "llama" { 24 * GIB } else { 80 * GIB });
    let gpus = match name {
        "tensor-parallel" => vec![video, video, video, video / 5 * 3],
        _ if tensor_parallel_pair() => vec![video, video],
        _ => vec![video],
    };
    (gpus, name == "host-oom")
}

/// GPUTRACE_TP=2: the serving scenarios run the model over a tensor-parallel pair of GPUs
/// (vLLM's two ranks, llama's `--tensor-split 1,1`).
fn tensor_parallel_pair() -> bool {
    std::env::var("GPUTRACE_TP").is_ok_and(|v| v == "2")
}

/// One line: what the scenario does.
pub fn describe(name: &str, server: &str) -> &'static str {
    match (name, server) {
        ("clean", _) => "loads, serves short, long-ish and concurrent requests, shuts down",
        ("held-by-other-process", "vllm") => {
            "an orphaned engine (its API server was SIGKILLed) holds the GPU; the next server refuses at start"
        }
        ("held-by-other-process", _) => "a forked child of a killed server keeps the device files; the next server's allocation fails",
        ("does-not-fit-at-load", _) => "the weights do not fit on the card",
        ("long-request", _) => "short prompts are served, one long prompt fails mid-prefill",
        ("concurrent-load", _) => "each request alone fits, a burst of them at once does not",
        ("kept-by-service", _) => {
            "identical prompts one at a time; the server keeps a cache entry per request, never evicted, until an ordinary one fails"
        }
        ("host-oom", _) => "a unified-memory server in a memory-limited cgroup is killed by the kernel's OOM killer while loading",
        ("tensor-parallel", "vllm") => {
            "four tensor-parallel ranks, one per GPU; the rank on the smaller fourth card runs out loading its shard"
        }
        ("tensor-parallel", _) => "the weights split over four GPUs from one process; the smaller fourth card runs out",
        _ => "?",
    }
}

/// kept-by-service: what each request keeps (MiB), per family; the prompt (tokens) every request
/// sends; the requests before the load (before a recording attaches late) and in it.
pub const KEPT_MIB_VLLM: u64 = 416;
pub const KEPT_MIB_LLAMA: u64 = 336;
pub const KEPT_PROMPT: u64 = 1500;
pub const KEPT_WARMUP: u64 = 6;
pub const KEPT_REQUESTS: u64 = 30;

struct Tools {
    gputrace: PathBuf,
    server: PathBuf,
    load: PathBuf,
    dir: PathBuf,
    /// How NVML answers the recorder: "none" takes the fake NVML away from it.
    nvml: String,
    /// The watch started after the server warmed up (GPUTRACE_ATTACH=late with
    /// GPUTRACE_WATCH_DUMPS), to stop when the scenario is over.
    late_watch: std::cell::RefCell<Option<Child>>,
    /// The LiteLLM stand-in in front of the server: (the server's port, the proxy's). The load
    /// for that server goes through it.
    proxied: std::cell::Cell<Option<(u16, u16)>>,
}

impl Tools {
    /// gputrace as given; the fake servers and load generator beside this binary.
    fn new(dir: &Path, gputrace: &Path, nvml: &str) -> Result<Tools> {
        let here = std::env::current_exe()?.parent().ok_or_else(|| anyhow!("no directory"))?.to_path_buf();
        Ok(Tools {
            gputrace: gputrace.to_path_buf(),
            server: here.join("fake-server"),
            load: here.join("fake-load"),
            dir: dir.to_path_buf(),
            nvml: nvml.to_string(),
            late_watch: std::cell::RefCell::new(None),
            proxied: std::cell::Cell::new(None),
        })
    }

    /// The fake server, with GPUTRACE_SERVER_ARGS's flags last. Started as people start servers:
    /// with GPUTRACE_SCRIPT set, by a shell script (`bash run.sh`) that stays its parent; with
    /// GPUTRACE_WRAP (`timeout 600 nice`, `env X=1`), under those wrappers; with
    /// GPUTRACE_LAUNCHER set, by a launcher whose own command line does not show the server's
    /// (`fakegpu launch FILE`, as a Python script that starts `vllm serve ...`).
    fn server_cmd(&self, server: &str, port: u16, extra: &[&str]) -> Command {
        let mut argv: Vec<String> = vec![self.server.display().to_string()];
        argv.extend(["--server", server, "--port", &port.to_string(), "--truth"].map(String::from));
        argv.push(self.dir.join("workload.jsonl").display().to_string());
        argv.extend(extra.iter().map(|a| a.to_string()));
        // The setting a fix names, tried: after the scenario's own flags, so it wins.
        argv.extend(std::env::var("GPUTRACE_SERVER_ARGS").unwrap_or_default().split_whitespace().map(String::from));
        let wrap: Vec<String> = std::env::var("GPUTRACE_WRAP").unwrap_or_default().split_whitespace().map(String::from).collect();
        let mut c = if std::env::var_os("GPUTRACE_SCRIPT").is_some() {
            let script = self.dir.join("run.sh");
            let _ = std::fs::write(&script, "#!/bin/sh\n# not exec'd: the shell stays the server's parent\n\"$@\"\n");
            let mut c = Command::new("bash");
            c.arg(script).args(&argv);
            c
        } else if std::env::var_os("GPUTRACE_LAUNCHER").is_some() {
            let file = self.dir.join("server-command");
            let _ = std::fs::write(&file, argv.join("\n"));
            let mut c = Command::new(std::env::current_exe().unwrap_or_else(|_| "fakegpu".into()));
            c.arg("launch").arg(file);
            c
        } else {
            let (program, args) = match wrap.split_first() {
                Some((first, rest)) => (first.clone(), rest.iter().chain(&argv).cloned().collect()),
                None => (argv[0].clone(), argv[1..].to_vec()),
            };
            let mut c = Command::new(program);
            c.args(args);
            c
        };
        c.stdout(Stdio::null()).stderr(log(&self.dir, "server.log"));
        c
    }

    /// `gputrace record --json -o DIR/run.trace -- COMMAND`, summary to DIR/record.json; with
    /// GPUTRACE_ATTACH=all, every process on the host traced too (`--all`), those already
    /// running met as a watch meets them.
    fn record(&self, command: &Command) -> Result<Child> {
        self.record_as(command, "run.trace", "record.json")
    }

    /// `record`, into DIR/`trace` with the summary in DIR/`summary`.
    fn record_as(&self, command: &Command, trace: &str, summary: &str) -> Result<Child> {
        let mut c = Command::new(&self.gputrace);
        c.args(["record", "--json", "-o"]).arg(self.dir.join(trace));
        if std::env::var("GPUTRACE_ATTACH").is_ok_and(|v| v == "all") {
            c.arg("--all");
        }
        c.arg("--").arg(command.get_program()).args(command.get_args());
        c.stdout(std::fs::File::create(self.dir.join(summary))?).stderr(log(&self.dir, "server.log"));
        if self.nvml == "none" {
            c.env_remove("LD_LIBRARY_PATH");
        }
        c.spawn().context("starting gputrace record")
    }

    /// The fix of the recording's verdict followed (GPUTRACE_FOLLOW_FIX): the holder it names
    /// stopped as it says (`kill PID`), then the server started again under a recording into
    /// after-fix.trace (after-fix.json), served and stopped.
    fn follow_fix(&self, server: &str, port: u16) -> Result<()> {
        let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(self.dir.join("record.json"))?)?;
        let pid = summary["diagnosis"]["fix"]["fields"]["kill"]
            .as_u64()
            .filter(|&p| p > 1)
            .ok_or_else(|| anyhow!("the fix names no pid to stop"))?;
        signal(pid as u32, libc::SIGTERM);
        let start = Instant::now();
        // Gone, or a zombie: its files are closed, its memory freed.
        let state =
            || std::fs::read_to_string(format!("/proc/{pid}/stat")).ok().and_then(|s| s.rsplit(')').next().map(|r| r.trim().to_string()));
        while state().is_some_and(|s| !s.starts_with('Z')) {
            if start.elapsed() > Duration::from_secs(10) {
                bail!("pid {pid} did not stop on SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // The kernel sends FUSE's RELEASE of its closed files on its own time, and the fake driver
        // frees their memory only then: the new recording's first NVML reading must not find it
        // still held, as no real driver would (its release runs in the close).
        while self.files_open() > 0 {
            if start.elapsed() > Duration::from_secs(10) {
                bail!("the fake driver still has {} files open 10 s after pid {pid} was stopped", self.files_open());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let rec = self.record_as(&self.server_cmd(server, port, &[]), "after-fix.trace", "after-fix.json")?;
        self.load(server, port, &["--sequential", "512"])?;
        for pid in children(rec.id()) {
            signal(pid, libc::SIGTERM);
        }
        wait_for(rec, Duration::from_secs(60))
    }

    /// Files the fake driver has seen opened and not yet released, by its log.
    fn files_open(&self) -> usize {
        let lines: Vec<crate::truth::DriverLine> = crate::truth::read_lines(&self.dir.join("driver.jsonl")).unwrap_or_default();
        let mut open = std::collections::HashSet::new();
        for line in lines {
            match line.op {
                crate::truth::DriverOp::Open { handle, .. } => open.insert(handle),
                crate::truth::DriverOp::Release { handle, .. } => open.remove(&handle),
                _ => false,
            };
        }
        open.len()
    }

    /// `gputrace record --json -o DIR/run.trace --pid PID`, attached to a server already running:
    /// returns once it says it is tracing.
    fn record_pid(&self, pid: u32) -> Result<Child> {
        let log_path = self.dir.join("record.log");
        let mut c = Command::new(&self.gputrace);
        c.args(["record", "--json", "-o"]).arg(self.dir.join("run.trace")).args(["--pid", &pid.to_string()]);
        c.stdout(std::fs::File::create(self.dir.join("record.json"))?).stderr(log(&self.dir, "record.log"));
        if self.nvml == "none" {
            c.env_remove("LD_LIBRARY_PATH");
        }
        let child = c.spawn().context("starting gputrace record --pid")?;
        started(child, &log_path, "gputrace: tracing", "gputrace record --pid")
    }

    /// The server started under the recording, warmed up with `warmup`, then loaded with `then`;
    /// or (GPUTRACE_ATTACH=late) started untraced and warmed up, `then`'s connections made (the
    /// server accepts them), a recording attached to it or (with GPUTRACE_WATCH_DUMPS) a watch
    /// started, and only then `then`'s requests sent on them: requests on connections older
    /// than the tracer, as a proxy's pooled ones. Returns once the server is gone: a server that
    /// failed ends by itself; one that survived its load (a fix tried) is stopped with SIGTERM.
    fn serve(&self, server: &str, port: u16, extra: &[&str], warmup: &[&str], then: &[&str]) -> Result<()> {
        let (mut waited, server_pid) = self.serve_loaded(server, port, extra, warmup, then)?;
        let start = Instant::now();
        while waited.try_wait()?.is_none() {
            if start.elapsed() > Duration::from_secs(2) {
                let pids = server_pid.map_or_else(|| children(waited.id()), |p| vec![p]);
                for pid in pids {
                    signal(pid, libc::SIGTERM);
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        wait_for(waited, Duration::from_secs(60))
    }

    /// `serve` up to the end of its load: what to wait for, and the server's pid where it is not
    /// that one's child.
    fn serve_loaded(&self, server: &str, port: u16, extra: &[&str], warmup: &[&str], then: &[&str]) -> Result<(Child, Option<u32>)> {
        if std::env::var("GPUTRACE_ATTACH").is_ok_and(|v| v == "late") {
            let running = self.server_cmd(server, port, extra).spawn().context("starting the server")?;
            self.load(server, port, warmup)?;
            let go = self.dir.join("send");
            let mut pending = Command::new(&self.load)
                .args(["--server", server, "--port", &self.load_port(port).to_string(), "--ready-timeout-s", "20", "--truth"])
                .arg(self.dir.join("workload.jsonl"))
                .args(then)
                .arg("--send-after")
                .arg(&go)
                .stdout(log(&self.dir, "load.log"))
                .stderr(log(&self.dir, "load.log"))
                .spawn()?;
            let start = Instant::now();
            while !std::fs::read_to_string(self.dir.join("load.log")).unwrap_or_default().contains("{\"connected\"") {
                if pending.try_wait()?.is_some() || start.elapsed() > Duration::from_secs(30) {
                    bail!("the load generator did not connect; see {}", self.dir.join("load.log").display());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let server_pid = running.id();
            let waited = if self.watch_late()? { running } else { self.record_pid(server_pid)? };
            std::fs::write(&go, "")?;
            if !pending.wait()?.success() {
                bail!("the load generator failed; see {}", self.dir.join("load.log").display());
            }
            return Ok((waited, Some(server_pid)));
        }
        let recording = self.record(&self.server_cmd(server, port, extra))?;
        self.load(server, port, warmup)?;
        // What a watch beside it serves between the warm-up and the load: the warning before it.
        if std::env::var_os("GPUTRACE_WATCH_DUMPS").is_some() {
            std::thread::sleep(Duration::from_millis(500));
            std::fs::write(self.dir.join("metrics-before.txt"), http_get("/metrics")?)?;
        }
        self.load(server, port, then)?;
        Ok((recording, None))
    }

    /// With GPUTRACE_ATTACH=late and GPUTRACE_WATCH_DUMPS, starts the watch now (what ran before
    /// is met running), stopped when the scenario is over; says whether it did.
    fn watch_late(&self) -> Result<bool> {
        let late = std::env::var("GPUTRACE_ATTACH").is_ok_and(|v| v == "late");
        match std::env::var_os("GPUTRACE_WATCH_DUMPS").filter(|_| late) {
            Some(dumps) => {
                *self.late_watch.borrow_mut() = Some(watch(self, Path::new(&dumps))?);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Where the load for the server on `port` is sent: the LiteLLM stand-in in front of it, if
    /// one is.
    fn load_port(&self, port: u16) -> u16 {
        self.proxied.get().filter(|(server, _)| *server == port).map_or(port, |(_, proxy)| proxy)
    }

    fn load(&self, server: &str, port: u16, args: &[&str]) -> Result<()> {
        let status = Command::new(&self.load)
            .args(["--server", server, "--port", &self.load_port(port).to_string(), "--ready-timeout-s", "20", "--truth"])
            .arg(self.dir.join("workload.jsonl"))
            .args(args)
            .stdout(log(&self.dir, "load.log"))
            .stderr(log(&self.dir, "load.log"))
            .status()?;
        if !status.success() {
            bail!("the load generator failed ({status}); see {}", self.dir.join("load.log").display());
        }
        Ok(())
    }
}

fn log(dir: &Path, name: &str) -> Stdio {
    std::fs::OpenOptions::new().create(true).append(true).open(dir.join(name)).map(Stdio::from).unwrap_or(Stdio::null())
}

fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) of a process this scenario started.
    unsafe { libc::kill(pid as i32, sig) };
}

fn wait_for(mut child: Child, limit: Duration) -> Result<()> {
    wait_for_exit(&mut child, limit).context("the recording did not end")
}

/// A memory cgroup (v1 or v2) limited to `bytes`, for the host-oom scenario.
fn memory_cgroup(bytes: u64) -> Result<PathBuf> {
    let name = format!("gputrace-scenario-{}", std::process::id());
    for (root, limit) in [("/sys/fs/cgroup/memory", "memory.limit_in_bytes"), ("/sys/fs/cgroup", "memory.max")] {
        let dir = Path::new(root).join(&name);
        if std::fs::create_dir(&dir).is_ok() {
            if std::fs::write(dir.join(limit), bytes.to_string()).is_ok() {
                let _ = std::fs::write(dir.join("memory.swappiness"), "0");
                return Ok(dir);
            }
            let _ = std::fs::remove_dir(&dir);
        }
    }
    bail!("no memory cgroup could be made (cgroup v1 memory controller or v2 memory.max)")
}

/// `gputrace watch` beside the recording, dumps to `dumps` with a 200 ms window: started (and
/// tracing) before the scenario, stopped after it.
fn watch(t: &Tools, dumps: &Path) -> Result<Child> {
    let log_path = t.dir.join("watch.log");
    let mut c = Command::new(&t.gputrace);
    c.args(["watch", "--window", "200ms", "--aftermath", "1s", "--min-interval", "1h", "--listen", &watch_address().to_string()]);
    c.arg("--dump-dir").arg(dumps);
    let child = c.stdout(Stdio::null()).stderr(log(&t.dir, "watch.log")).spawn().context("starting gputrace watch")?;
    started(child, &log_path, "gputrace: tracing every process", "gputrace watch")
}

/// Waits (30 s at most) until `child`'s log says `line`: the tracer is attached.
fn started(mut child: Child, log_path: &Path, line: &str, what: &str) -> Result<Child> {
    let start = Instant::now();
    while !std::fs::read_to_string(log_path).unwrap_or_default().contains(line) {
        if child.try_wait()?.is_some() || start.elapsed() > Duration::from_secs(30) {
            bail!("{what} did not start; see {}", log_path.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(child)
}

/// Runs one scenario inside the fake GPU's namespace, NVML answering the recorder as `nvml` says.
/// With GPUTRACE_WATCH_DUMPS set, `gputrace watch` runs beside the recording.
pub fn inside(name: &str, server: &str, nvml: &str, dir: &Path, gputrace: &Path) -> Result<()> {
    let t = Tools::new(dir, gputrace, nvml)?;
    let late = std::env::var("GPUTRACE_ATTACH").is_ok_and(|v| v == "late");
    let watching = match std::env::var_os("GPUTRACE_WATCH_DUMPS").filter(|_| !late) {
        Some(dumps) => Some(watch(&t, Path::new(&dumps))?),
        None => None,
    };
    let result = scenario_inside(&t, name, server);
    if let Some(mut w) = watching.or_else(|| t.late_watch.borrow_mut().take()) {
        // After the aftermath of a failure, what the watch serves, then a dump asked for (that
        // SIGTERM, right after, must finish).
        std::thread::sleep(Duration::from_millis(1500));
        for (path, file) in [("/metrics", "metrics.txt"), ("/healthz", "healthz.txt"), ("/report", "report.json")] {
            std::fs::write(t.dir.join(file), http_get(path)?)?;
        }
        let asked = Command::new(&t.gputrace).arg("dump").stderr(log(&t.dir, "watch.log")).status()?;
        if !asked.success() {
            bail!("gputrace dump failed ({asked})");
        }
        std::thread::sleep(Duration::from_millis(100));
        // Time for a scraper to see the state after the scenario (GPUTRACE_WATCH_LINGER_MS).
        let linger = std::env::var("GPUTRACE_WATCH_LINGER_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
        std::thread::sleep(Duration::from_millis(linger));
        std::fs::write(t.dir.join("watch-stopped.txt"), crate::truth::monotonic_ns().to_string())?;
        signal(w.id(), libc::SIGTERM);
        wait_for_exit(&mut w, Duration::from_secs(30)).context("gputrace watch did not stop on SIGTERM")?;
    }
    result
}

/// Where the watch listens: GPUTRACE_WATCH_LISTEN, or a port of this run's own.
fn watch_address() -> std::net::SocketAddr {
    let own = std::net::SocketAddr::from(([127, 0, 0, 1], 9500 + (std::process::id() % 400) as u16));
    std::env::var("GPUTRACE_WATCH_LISTEN").ok().and_then(|a| a.parse().ok()).unwrap_or(own)
}

/// GET of a path from the watch: the status line and the body.
fn http_get(path: &str) -> Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(watch_address()).context("connecting to gputrace watch")?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n")?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    Ok(format!("{}\n{body}", head.lines().next().unwrap_or("")))
}

fn wait_for_exit(child: &mut Child, limit: Duration) -> Result<()> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if child.try_wait()?.is_some() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    bail!("still running after {limit:?}")
}

/// A LiteLLM proxy in front of the server for as long as the scenario runs (GPUTRACE_LITELLM=N
/// or N,M,...: each deployment's `max_parallel_requests`, the first named `local`, the others
/// `local-2`...; GPUTRACE_LITELLM_WORKERS=W: its `--num_workers`): the stand-in `litellm`
/// beside this binary, with a config that sends each to the server's port, on a port of its
/// own that the load is sent to; it lets the first deployment's limit through at once.
struct LiteLlm(Child);

impl LiteLlm {
    /// The proxy, and the port it listens on.
    fn start(dir: &Path, port: u16) -> Result<Option<(LiteLlm, u16)>> {
        let Ok(limits) = std::env::var("GPUTRACE_LITELLM") else { return Ok(None) };
        let config = dir.join("litellm.yaml");
        let mut yaml = String::from("model_list:\n");
        for (i, limit) in limits.split(',').enumerate() {
            let name = if i == 0 { "local".to_string() } else { format!("local-{}", i + 1) };
            yaml += &format!(
                "  - model_name: {name}\n    litellm_params:\n      model: hosted_vllm/fake\n      api_base: http://localhost:{port}/v1\n      max_parallel_requests: {limit}\n"
            );
        }
        std::fs::write(&config, yaml)?;
        let here = std::env::current_exe()?.parent().ok_or_else(|| anyhow!("no directory"))?.to_path_buf();
        let listen = port + 1000;
        let mut proxy = Command::new(here.join("litellm"));
        proxy.arg("--config").arg(&config).args(["--port", &listen.to_string()]).process_group(0).stdout(Stdio::null());
        proxy.stderr(log(dir, "litellm.log"));
        if let Ok(workers) = std::env::var("GPUTRACE_LITELLM_WORKERS") {
            proxy.args(["--num_workers", &workers]);
        }
        let child = proxy.spawn().context("starting the LiteLLM stand-in")?;
        std::fs::write(dir.join("litellm.pid"), child.id().to_string())?;
        Ok(Some((LiteLlm(child), listen)))
    }
}

impl Drop for LiteLlm {
    fn drop(&mut self) {
        // SAFETY: killpg(2) of the process group this scenario started.
        unsafe { libc::killpg(self.0.id() as i32, libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

fn scenario_inside(t: &Tools, name: &str, server: &str) -> Result<()> {
    let llama = server == "llama";
    let port = 8000 + (std::process::id() % 1000) as u16;
    let _proxy = LiteLlm::start(&t.dir, port)?.map(|(proxy, listen)| {
        t.proxied.set(Some((port, listen)));
        proxy
    });
    let limit = Duration::from_secs(60);
    match name {
        "clean" | PROBE => {
            // A probe is a clean run with the load given (GPUTRACE_LOAD): a prediction tried.
            let given = std::env::var("GPUTRACE_LOAD").ok().filter(|_| name == PROBE);
            let load = given.unwrap_or_else(|| "--sequential 1024,2048 --concurrent 2x1024".into());
            let rec = t.record(&t.server_cmd(server, port, &[]))?;
            t.load(server, port, &load.split_whitespace().collect::<Vec<_>>())?;
            for pid in children(rec.id()) {
                signal(pid, libc::SIGTERM);
            }
            wait_for(rec, limit)
        }
        "does-not-fit-at-load" => {
            let model = if llama { "30" } else { "96" };
            wait_for(t.record(&t.server_cmd(server, port, &["--model-gib", model]))?, limit)
        }
        "tensor-parallel" => {
            // A shard of 3/4 of a big card: it fits three of them, not the fourth (3/5 of one).
            let (model, split) = if llama { ("60", ["--tensor-split", "1,1,1,1"]) } else { ("200", ["--tensor-parallel-size", "4"]) };
            wait_for(t.record(&t.server_cmd(server, port, &["--model-gib", model, split[0], split[1]]))?, limit)
        }
        "long-request" => {
            // Short prompts served (before a recording attached late), then a long one.
            let pair: &[&str] = match (tensor_parallel_pair(), llama) {
                (false, _) => &[],
                (true, false) => &["--tensor-parallel-size", "2"],
                (true, true) => &["--tensor-split", "1,1"],
            };
            // The long one as a wave of one: sent, when attached late, on a connection made before.
            let long = if llama { "1x16000" } else { "1x40000" };
            t.serve(server, port, pair, &["--sequential", "1024,2048"], &["--concurrent", long])
        }
        "concurrent-load" => {
            let (one, wave) = if llama { ("3000", "8x3000") } else { ("2048", "24x2048") };
            // Each with its concurrency limit above what memory takes (vLLM's default); llama's
            // slots on one unified cache, each able to take the whole context.
            let cap: &[&str] = if llama { &["--parallel", "8", "--kv-unified"] } else { &["--max-num-seqs", "256"] };
            t.serve(server, port, cap, &["--sequential", one], &["--concurrent", wave])
        }
        "kept-by-service" => {
            // Each request leaves an entry (about a twentieth of the room after load) that is
            // never freed; the 21st of the same size no longer fits.
            let keep = if llama { KEPT_MIB_LLAMA } else { KEPT_MIB_VLLM };
            let load = format!("{KEPT_REQUESTS}x{KEPT_PROMPT}");
            let warmup = format!("{KEPT_WARMUP}x{KEPT_PROMPT}");
            // Two tokens of decode each: what is kept is made in prefill, and the run stays short.
            let (warmup, load) = (["--sequential", &warmup, "--max-tokens", "2"], ["--sequential", &load, "--max-tokens", "2"]);
            t.serve(server, port, &["--keep-mib-per-request", &keep.to_string()], &warmup, &load)
        }
        "held-by-other-process" => {
            // The earlier server, not recorded: it is what the recorder finds already there.
            let old_port = port + 1;
            let mut old = t.server_cmd(server, old_port, if llama { &["--helper"] } else { &[] }).spawn()?;
            t.load(server, old_port, &["--sequential", "512"])?;
            // SIGKILL: vLLM's engine is orphaned; llama's forked helper keeps the files.
            old.kill()?;
            old.wait()?;
            std::thread::sleep(Duration::from_millis(100));
            // A watch started late meets the orphan running (a recording with `--all` does so anyway).
            t.watch_late()?;
            wait_for(t.record(&t.server_cmd(server, port, &[]))?, limit)?;
            if std::env::var_os("GPUTRACE_FOLLOW_FIX").is_some() {
                t.follow_fix(server, port)?;
            }
            Ok(())
        }
        "host-oom" => {
            let cgroup = memory_cgroup(256 << 20)?;
            let mut inner = t.server_cmd(server, port, &["--touch-host-mib", "64"]);
            // Join the cgroup before exec, so the whole server is confined to it.
            let procs = cgroup.join("cgroup.procs");
            let mut wrapped = Command::new("sh");
            wrapped
                .arg("-c")
                .arg(format!("echo $$ > {} && exec \"$0\" \"$@\"", procs.display()))
                .arg(inner.get_program())
                .args(inner.get_args());
            inner.stdout(Stdio::null());
            let result = wait_for(t.record(&wrapped)?, limit);
            for pid in std::fs::read_to_string(&procs).unwrap_or_default().split_whitespace().filter_map(|p| p.parse().ok()) {
                signal(pid, libc::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(100));
            let _ = std::fs::remove_dir(&cgroup);
            result
        }
        other => bail!("no scenario {other:?}: choose one of {}", NAMES.join(", ")),
    }
}

/// The hosts `gputrace doctor` is tried on: what holds the GPU when it is asked.
pub const DOCTOR_SETUPS: [&str; 3] = ["clean", "orphaned-engine", "forked-child"];
/// How NVML answers there: a discrete GPU, unified memory (no device totals), or no NVML at all.
pub const NVML_MODES: [&str; 3] = ["discrete", "unified", "none"];

/// Sets up `setup` inside the fake GPU's namespace, beside a benign holder (a root-owned copy
/// of sleep named nvidia-persistenced), then runs `gputrace doctor --json`. DIR gets doctor.json, its exit
/// status in doctor.rc, and the pids that matter in pids.json.
pub fn doctor_inside(setup: &str, nvml: &str, dir: &Path, gputrace: &Path) -> Result<()> {
    let t = Tools::new(dir, gputrace, nvml)?;
    let port = 8000 + (std::process::id() % 1000) as u16;
    // A daemon is known by its program, not its argv[0]: a root-owned program of that name, in a
    // directory only root writes.
    let daemons = dir.join("sbin");
    std::fs::create_dir_all(&daemons)?;
    std::fs::set_permissions(&daemons, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    std::fs::copy("/usr/bin/sleep", daemons.join("nvidia-persistenced")).context("copying sleep as nvidia-persistenced")?;
    let benign = Command::new("bash")
        .args(["-c", "exec 3<>/dev/nvidiactl; exec \"$0\" 600"])
        .arg(daemons.join("nvidia-persistenced"))
        .stdout(Stdio::null())
        .spawn()
        .context("starting the benign holder")?;
    let server = if setup == "forked-child" { "llama" } else { "vllm" };
    // Its own process group, as a shell starts a job: what "orphaned" is judged by.
    let mut started = t.server_cmd(server, port, if server == "llama" { &["--helper"] } else { &[] });
    started.process_group(0);
    let mut root = started.spawn().context("starting the server")?;
    t.load(server, port, &["--sequential", "512"])?;
    let child = children(root.id()).first().copied().ok_or_else(|| anyhow!("the server started no child"))?;
    if setup != "clean" {
        // SIGKILL: vLLM's engine is orphaned; llama's forked helper keeps the files.
        root.kill()?;
        root.wait()?;
        std::thread::sleep(Duration::from_millis(100));
    }
    let pids = serde_json::json!({"server": root.id(), "child": child, "benign": benign.id()});
    std::fs::write(dir.join("pids.json"), pids.to_string())?;
    let mut doctor = Command::new(&t.gputrace);
    doctor.args(["doctor", "--json"]).stdout(std::fs::File::create(dir.join("doctor.json"))?).stderr(log(dir, "doctor.log"));
    if t.nvml == "none" {
        doctor.env_remove("LD_LIBRARY_PATH");
    }
    let status = doctor.status().context("running gputrace doctor")?;
    std::fs::write(dir.join("doctor.rc"), status.code().unwrap_or(-1).to_string())?;
    // And as a person reads it.
    let mut text = Command::new(&t.gputrace);
    text.arg("doctor").stdout(std::fs::File::create(dir.join("doctor.txt"))?).stderr(log(dir, "doctor.log"));
    if t.nvml == "none" {
        text.env_remove("LD_LIBRARY_PATH");
    }
    text.status().context("running gputrace doctor")?;
    Ok(())
}

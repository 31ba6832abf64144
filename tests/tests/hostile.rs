//! Safe to leave running, round two: what a hostile local user did to `watch`, `doctor` and
//! `gputrace dump`, each done again as that user would (symbolic links raced in a loop, a
//! process whose /proc reads never return, connection floods), and checked to be gone. Root
//! only: the users are nobody (65534) and uids no one has, taken with setpriv.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{as_root, gputrace_bin, start};

/// setpriv's flags for running as nobody (uid and gid 65534, no groups).
const NOBODY: [&str; 3] = ["--reuid=65534", "--regid=65534", "--clear-groups"];

/// `program` to be run as nobody.
fn as_nobody(program: &str) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args(NOBODY).args(["--", program]);
    cmd
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gputrace-hostile-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, PermissionsExt::from_mode(0o755)).unwrap();
    dir
}

fn c_path(path: &Path) -> std::ffi::CString {
    std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A child killed when the test ends, however it ends, unless taken back.
struct Guard(Option<Child>);

impl Guard {
    fn take(mut self) -> Child {
        self.0.take().expect("still held")
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A watch of every process that serves on `listen` (127.0.0.1 or 0.0.0.0 and a free port),
/// its dumps in a scratch directory; killed when the test ends.
fn serving_watch(name: &str, host: &str) -> (Guard, u16, PathBuf) {
    let dumps = scratch(name).join("dumps");
    let port = free_port();
    let watch = start(&["watch", "--dump-dir", dumps.to_str().unwrap(), "--listen", &format!("{host}:{port}")], false);
    (Guard(Some(watch)), port, dumps)
}

/// `bash -c SCRIPT` inside the fake GPU's namespace, with D (the scratch directory), G
/// (gputrace), H (hostile-user), W (fake-workload) and PORT (a free port) in its environment.
/// In a process group of its own, led by the launcher for as long as the script runs: doctor
/// calls a holder whose group leader is gone orphaned, and the harness's group (a test run
/// started in the background of a shell that has exited) is not the question.
fn on_fake_gpu(script: &str, dir: &Path, port: u16) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fakegpu"))
        .process_group(0)
        .args(["run", "--", "bash", "-c", script])
        .env("D", dir)
        .env("G", gputrace_bin())
        .env("H", env!("CARGO_BIN_EXE_hostile-user"))
        .env("W", env!("CARGO_BIN_EXE_fake-workload"))
        .env("PORT", port.to_string())
        .output()
        .unwrap()
}

/// gputrace as root, under a simulated `sudo` by nobody when `sudo` is set.
fn gputrace(args: &[&str], sudo: bool) -> Output {
    let mut cmd = Command::new(gputrace_bin());
    cmd.args(args);
    if sudo {
        cmd.env("SUDO_UID", "65534").env("SUDO_GID", "65534").env("SUDO_USER", "nobody");
    }
    cmd.output().unwrap()
}

/// No process has this pid: a watch given it stops right after preparing its dump directory.
const NO_SUCH_PID: &str = "4194999";

/// Item 1. Under sudo, a dump directory missing in the user's own directory used to be created
/// by root and then chowned by path: the user, racing a symbolic link in for it, got a root
/// directory of their choosing chowned to them. Two hundred tries against a racer that swaps
/// the new directory for a link as fast as it can: the root directory stays root's.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_link_raced_in_for_a_new_dump_directory_never_gets_root_a_chown() {
    let _root = as_root();
    let base = scratch("dumpdir-race");
    let home = base.join("home");
    std::fs::create_dir(&home).unwrap();
    std::os::unix::fs::chown(&home, Some(65534), Some(65534)).unwrap();
    std::fs::set_permissions(&home, PermissionsExt::from_mode(0o700)).unwrap();
    let precious = base.join("precious");
    std::fs::create_dir(&precious).unwrap();
    let (dumps, link) = (home.join("dumps"), home.join("link"));
    // The racer swaps whatever appears at `dumps` with a link to the root directory, in one
    // system call (renameat2's exchange), as fast as it can: a thread of this test with nobody's
    // filesystem identity.
    let racing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let racer = {
        let (racing, done) = (racing.clone(), done.clone());
        let (a, b) = (c_path(&dumps), c_path(&link));
        std::thread::spawn(move || {
            // SAFETY: raw credential syscalls affect this thread only.
            unsafe {
                libc::syscall(libc::SYS_setfsgid, 65534);
                libc::syscall(libc::SYS_setfsuid, 65534);
            }
            let mut swaps = 0u64;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                if racing.load(std::sync::atomic::Ordering::Acquire) {
                    // SAFETY: renameat2(2) with NUL-terminated paths.
                    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE) };
                    swaps += u64::from(rc == 0);
                }
            }
            swaps
        })
    };
    let (mut made, mut refused) = (0, 0);
    for _ in 0..200 {
        racing.store(false, std::sync::atomic::Ordering::Release);
        std::thread::sleep(Duration::from_millis(1));
        for p in [&dumps, &link] {
            let _ = std::fs::remove_file(p).or_else(|_| std::fs::remove_dir_all(p));
        }
        std::os::unix::fs::symlink(&precious, &link).unwrap();
        racing.store(true, std::sync::atomic::Ordering::Release);
        let out = gputrace(&["watch", "--dump-dir", dumps.to_str().unwrap(), "--listen", "off", "--pid", NO_SUCH_PID], true);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        let said = stderr(&out);
        // Past the directory, the watch stops at the pid; or the racer won and it said why.
        if said.contains(&format!("no process has pid {NO_SUCH_PID}")) {
            made += 1;
        } else {
            assert!(said.contains("gputrace: error: "), "{said}");
            refused += 1;
        }
        let meta = std::fs::symlink_metadata(&precious).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (0, 0), "root's directory was given away: {said}");
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let swaps = racer.join().unwrap();
    eprintln!("of 200 starts against a racer that swapped {swaps} times, {made} used the directory made as the user and {refused} were refused with a reason");
    std::fs::remove_dir_all(&base).ok();
}

/// Item 2. A dump directory below a directory another user may write is refused (they could
/// rename it away and put a link to a root directory in its place), so is a path through a
/// symbolic link; and a watch writes its dumps relative to the directory it opened: the
/// directory renamed and replaced by a link while it runs, the dump still lands in it.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn dumps_go_only_where_nobody_else_can_swap_them() {
    let _root = as_root();
    let base = scratch("dumpdir-parents");
    let theirs = base.join("mx");
    std::fs::create_dir(&theirs).unwrap();
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    let out = gputrace(&["watch", "--dump-dir", theirs.join("dumps").to_str().unwrap(), "--listen", "off", "--pid", NO_SUCH_PID], false);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("can be changed by someone other than root"), "{}", stderr(&out));
    assert!(!theirs.join("dumps").exists(), "nothing was created there");

    // A shared directory that is not sticky is as bad; a link on the way is refused.
    let shared = base.join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, PermissionsExt::from_mode(0o777)).unwrap();
    let out = gputrace(&["watch", "--dump-dir", shared.join("dumps").to_str().unwrap(), "--listen", "off", "--pid", NO_SUCH_PID], false);
    assert!(stderr(&out).contains("can be changed by someone other than root"), "{}", stderr(&out));
    let safe = base.join("safe");
    std::fs::create_dir(&safe).unwrap();
    let link = base.join("link");
    std::os::unix::fs::symlink(&safe, &link).unwrap();
    let out = gputrace(&["watch", "--dump-dir", link.join("dumps").to_str().unwrap(), "--listen", "off", "--pid", NO_SUCH_PID], false);
    assert!(stderr(&out).contains("is a symbolic link"), "{}", stderr(&out));

    // A watch of a sleeping process, its directory renamed and replaced by a link once it runs.
    let dumps = safe.join("dumps");
    let mut sleeper = Command::new("sleep").arg("600").spawn().unwrap();
    let watch = start(
        &["watch", "--dump-dir", dumps.to_str().unwrap(), "--listen", "off", "--aftermath", "0s", "--pid", &sleeper.id().to_string()],
        false,
    );
    let elsewhere = base.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let moved = safe.join("moved");
    std::fs::rename(&dumps, &moved).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &dumps).unwrap();
    // SAFETY: kill(2) on the watch this test started.
    unsafe { libc::kill(watch.id() as i32, libc::SIGUSR1) };
    let deadline = Instant::now() + Duration::from_secs(30);
    let written =
        |dir: &Path| std::fs::read_dir(dir).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".report.txt")).count();
    while written(&moved) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(written(&moved), 1, "the dump is in the directory the watch opened");
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0, "nothing went through the link");
    // SAFETY: kill(2) on the watch this test started.
    unsafe { libc::kill(watch.id() as i32, libc::SIGTERM) };
    let out = watch.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    std::fs::remove_dir_all(&base).ok();
}

/// Under sudo, a watch writes its dumps as the user: created, renamed into place and rotated in
/// the user's own directory, though the watch, once tracing, keeps no right of root's to it.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn under_sudo_dumps_are_written_renamed_and_rotated_as_the_user() {
    let _root = as_root();
    let base = scratch("sudo-dumps");
    let home = base.join("home");
    std::fs::create_dir(&home).unwrap();
    std::os::unix::fs::chown(&home, Some(65534), Some(65534)).unwrap();
    std::fs::set_permissions(&home, PermissionsExt::from_mode(0o700)).unwrap();
    let dumps = home.join("dumps");
    let mut sleeper = Guard(Some(Command::new("sleep").arg("600").spawn().unwrap()));
    let pid = sleeper.0.as_ref().unwrap().id().to_string();
    let args = ["watch", "--dump-dir", dumps.to_str().unwrap(), "--listen", "off", "--aftermath", "0s", "--budget", "1", "--pid", &pid];
    let watch = Guard(Some(start(&args, true)));
    let watch_pid = watch.0.as_ref().unwrap().id() as i32;
    let listed = || -> Vec<String> {
        let mut names: Vec<String> =
            std::fs::read_dir(&dumps).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    };
    for asked in 1..=2 {
        // SAFETY: kill(2) on the watch this test started.
        unsafe { libc::kill(watch_pid, libc::SIGUSR1) };
        let until = Instant::now() + Duration::from_secs(20);
        while !listed().iter().any(|n| n.contains(&format!("-{asked}-manual.report.txt"))) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(100));
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    let names = listed();
    // The budget (1 byte) keeps only the newest: the first dump was removed, as the user.
    assert_eq!(names.len(), 2, "the newest dump and its report, nothing partial left: {names:?}");
    assert!(names.iter().all(|n| n.contains("-2-manual.")), "{names:?}");
    for name in &names {
        let meta = std::fs::metadata(dumps.join(name)).unwrap();
        assert_eq!((meta.uid(), meta.mode() & 0o777), (65534, 0o600), "{name}");
    }
    drop(watch);
    let _ = sleeper.0.as_mut().map(Child::kill);
    std::fs::remove_dir_all(&base).ok();
}

/// A process nobody froze: every read of its command line blocks in the kernel (see
/// `hostile-user freeze`). Killing its group ends the filesystem and lets every blocked read go.
struct Frozen {
    group: Child,
    pid: u32,
    dir: PathBuf,
}

impl Frozen {
    /// As nobody, in a user and mount namespace of their own. This VM's /dev/fuse is root's
    /// alone (hosts usually give it to everyone, 0666): the same device, open to all, is
    /// bind-mounted over it in a mount namespace of the test's, the host's left as it is.
    fn start(name: &str) -> Frozen {
        let frozen = Frozen::run(name, &[]);
        let pid = frozen.pid;
        assert!(read_within(&format!("/proc/{pid}/cmdline"), Duration::from_secs(1)).is_none(), "its command line is frozen");
        frozen
    }

    /// As [`Frozen::start`], its memory-map lock held `ms` at a time (see `hostile-user freeze
    /// --stretches`): every read of its command line slow, none late, and a process sharing its
    /// memory started a hundred times a second.
    fn in_stretches(name: &str, ms: u32) -> Frozen {
        Frozen::run(name, &["--stretches", &ms.to_string()])
    }

    fn run(name: &str, extra: &[&str]) -> Frozen {
        use std::io::BufRead;
        let dir = scratch(name);
        let mnt = dir.join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        std::fs::set_permissions(&mnt, PermissionsExt::from_mode(0o777)).unwrap();
        let devs = dir.join("devs");
        std::fs::create_dir(&devs).unwrap();
        let script = r#"mount -t tmpfs none "$D/devs" && mknod "$D/devs/fuse" c 10 229 && chmod 666 "$D/devs/fuse" \
            && mount --bind "$D/devs/fuse" /dev/fuse \
            && exec setpriv --reuid=65534 --regid=65534 --clear-groups -- unshare -Urm "$H" freeze "$D/mnt" "$@""#;
        let mut group = Command::new("unshare")
            .args(["-m", "--propagation", "private", "sh", "-c", script, "sh"])
            .args(extra)
            .env("D", &dir)
            .env("H", env!("CARGO_BIN_EXE_hostile-user"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(group.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let pid = line.trim().strip_prefix("frozen ").and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("the freezer said {line:?}"));
        Frozen { group, pid, dir }
    }

    /// A process sharing the frozen one's memory appears, as a fork of it does to a tracer.
    fn fork(&mut self) {
        use std::io::Write;
        writeln!(self.group.stdin.as_mut().unwrap(), "fork").unwrap();
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        // SAFETY: kill(2) of the process group this test started.
        unsafe { libc::kill(-(self.group.id() as i32), libc::SIGKILL) };
        let _ = self.group.wait();
        std::thread::sleep(Duration::from_millis(200));
        // SAFETY: the frozen child, let go once its filesystem is gone.
        unsafe { libc::kill(self.pid as i32, libc::SIGKILL) };
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// A file read on a thread of its own, waited for `limit` at most.
fn read_within(path: &str, limit: Duration) -> Option<Vec<u8>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let path = path.to_string();
    std::thread::spawn(move || tx.send(std::fs::read(path).ok()));
    rx.recv_timeout(limit).ok().flatten()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// GET `target`: the status line and how long it took, None past `limit`.
fn get(port: u16, target: &str, limit: Duration) -> Option<(String, Duration)> {
    use std::io::{Read, Write};
    let began = Instant::now();
    let mut s = std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), limit).ok()?;
    s.set_read_timeout(Some(limit)).ok()?;
    write!(s, "GET {target} HTTP/1.1\r\nHost: localhost\r\n\r\n").ok()?;
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).ok()?;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer.lines().next()?.to_string();
    Some((status, began.elapsed()))
}

/// Runs `cmd`, killed past `limit`; its output and how long it took, or None.
fn run_within(cmd: &mut Command, limit: Duration) -> Option<(Output, Duration)> {
    let began = Instant::now();
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    match rx.recv_timeout(limit) {
        Ok(out) => Some((out.unwrap(), began.elapsed())),
        Err(_) => {
            // SAFETY: kill(2) of the child this test started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            None
        }
    }
}

/// Item 3. A process that holds its own memory-map lock makes every read of its command line
/// block in the kernel. It froze a running watch (a fork of it: /healthz and /metrics stopped
/// answering, SIGTERM was not acted on), a watch starting up never served, and `doctor` and
/// `gputrace dump` hung. Now each of them finishes, the frozen command shown as unreadable.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_process_whose_command_line_cannot_be_read_freezes_nothing() {
    let _root = as_root();
    let (running, port, dumps) = serving_watch("freeze-dumps", "127.0.0.1");
    let mut frozen = Frozen::start("freeze");
    frozen.fork();
    std::thread::sleep(Duration::from_secs(1));
    let limit = Duration::from_secs(10);
    let health = get(port, "/healthz", limit);
    let metrics = get(port, "/metrics", limit);
    eprintln!("running watch after a fork of the frozen process: /healthz {health:?}, /metrics {metrics:?}");
    assert!(health.as_ref().is_some_and(|(s, t)| s.contains("200") && *t < Duration::from_secs(2)), "{health:?}");
    assert!(metrics.as_ref().is_some_and(|(s, t)| s.contains("200") && *t < Duration::from_secs(2)), "{metrics:?}");

    // A second watch, started with the frozen process already there.
    let began = Instant::now();
    let (second, second_port, second_dumps) = serving_watch("freeze-dumps-second", "127.0.0.1");
    let health = get(second_port, "/healthz", limit);
    let startup = began.elapsed();
    eprintln!("a watch started beside the frozen process served /healthz {startup:?} after it was started");
    assert!(health.is_some_and(|(s, _)| s.contains("200")) && startup < Duration::from_secs(8), "{startup:?}");

    let doctor = run_within(Command::new(gputrace_bin()).args(["doctor", "--json"]), limit);
    let (out, took) = doctor.expect("doctor finishes");
    eprintln!("doctor took {took:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| panic!("{}", stderr(&out)));
    let holder = report["holders"].as_array().unwrap().iter().find(|h| h["pid"] == frozen.pid).expect("the frozen holder is listed");
    assert_eq!(holder["command"][0], "unknown (unreadable)", "{holder}");
    assert!(took < Duration::from_secs(5), "{took:?}");

    let dump = run_within(Command::new(gputrace_bin()).arg("dump"), limit);
    let (out, took) = dump.expect("gputrace dump finishes");
    eprintln!("gputrace dump took {took:?}: {}", stderr(&out));
    assert!(out.status.success() && took < Duration::from_secs(5), "{}", stderr(&out));

    for watch in [running, second] {
        let watch = watch.take();
        let began = Instant::now();
        // SAFETY: kill(2) on a watch this test started.
        unsafe { libc::kill(watch.id() as i32, libc::SIGTERM) };
        let pid = watch.id();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(watch.wait_with_output()));
        let out = rx.recv_timeout(limit).unwrap_or_else(|_| {
            // SAFETY: kill(2) on a watch this test started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("the watch did not stop on SIGTERM")
        });
        eprintln!("SIGTERM to the end of a watch: {:?}", began.elapsed());
        assert!(out.unwrap().status.success());
    }
    drop(frozen);
    for d in [dumps, second_dumps] {
        std::fs::remove_dir_all(d.parent().unwrap()).ok();
    }
}

/// Item 3, in stretches (as the review of the first fix did it): a process whose memory-map
/// lock is held 30 ms at a time, starting a process that shares its memory a hundred times a
/// second. No read of its command line is late, but each is slow, and each fork asks for one:
/// the per-user budget of waiting keeps the watch answering, and stopping on SIGTERM at once.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_process_slow_to_read_at_every_fork_cannot_stall_the_watch() {
    let _root = as_root();
    let (watch, port, dumps) = serving_watch("stretches", "127.0.0.1");
    let frozen = Frozen::in_stretches("stretches-freeze", 30);
    let began = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut answered = 0;
    while began.elapsed() < Duration::from_secs(10) {
        if let Some((status, took)) = get(port, "/healthz", Duration::from_secs(20)) {
            answered += u32::from(status.contains("200"));
            slowest = slowest.max(took);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let watch = watch.take();
    let stopping = Instant::now();
    // SAFETY: kill(2) on the watch this test started.
    unsafe { libc::kill(watch.id() as i32, libc::SIGTERM) };
    let out = watch.wait_with_output().unwrap();
    let stopped = stopping.elapsed();
    drop(frozen);
    eprintln!("under a 10 s attack: {answered} /healthz answered, the slowest in {slowest:?}; SIGTERM to exit {stopped:?}");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(slowest < Duration::from_secs(1) && answered >= 20, "{answered} answered, the slowest {slowest:?}");
    assert!(stopped < Duration::from_secs(5), "{stopped:?}");
    std::fs::remove_dir_all(dumps.parent().unwrap()).ok();
}

/// Opens a TCP connection (the port refusing is retried until `limit`): for a watch that
/// serves a moment after it says it is tracing.
fn connect(port: u16, limit: Duration) -> std::net::TcpStream {
    let until = Instant::now() + limit;
    loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => return s,
            Err(e) if Instant::now() < until => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("nothing serves port {port}: {e}"),
        }
    }
}

/// Clients that open a connection, send one byte of a request head every half second and
/// never finish it, each reopening as soon as it is closed, until dropped.
struct Slowloris {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Slowloris {
    fn start(port: u16, clients: usize) -> Slowloris {
        use std::io::Write;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..clients)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else { continue };
                        while !stop.load(std::sync::atomic::Ordering::Relaxed) && s.write_all(b"G").is_ok() {
                            std::thread::sleep(Duration::from_millis(500));
                        }
                    }
                })
            })
            .collect();
        Slowloris { stop, threads }
    }
}

impl Drop for Slowloris {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Item 4. Sixteen connections that each trickle one byte kept Prometheus from scraping (0 of
/// 30). With 16 and with 64 such connections looping, at least 29 of 30 scrapes succeed.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn slow_senders_never_keep_a_scraper_out() {
    let _root = as_root();
    let (watch, port, dumps) = serving_watch("slowloris", "127.0.0.1");
    drop(connect(port, Duration::from_secs(5)));
    for clients in [16, 64] {
        let flood = Slowloris::start(port, clients);
        std::thread::sleep(Duration::from_secs(2));
        let mut served = 0;
        let mut slowest = Duration::ZERO;
        for _ in 0..30 {
            if let Some((status, took)) = get(port, "/metrics", Duration::from_secs(5)) {
                served += u32::from(status.contains("200"));
                slowest = slowest.max(took);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        drop(flood);
        eprintln!("{clients} slow senders: {served} of 30 scrapes served, the slowest in {slowest:?}");
        assert!(served >= 29, "{clients} slow senders: {served} of 30 scrapes served");
    }
    // Connections opened as fast as twelve threads can, by nobody: the places they take are
    // theirs to lose, never a scraper's.
    let flood =
        Guard(Some(as_nobody(env!("CARGO_BIN_EXE_hostile-user")).arg("flood").args([port.to_string(), "12".into()]).spawn().unwrap()));
    std::thread::sleep(Duration::from_secs(1));
    let (mut served, mut slowest) = (0, Duration::ZERO);
    for _ in 0..30 {
        if let Some((status, took)) = get(port, "/metrics", Duration::from_secs(5)) {
            served += u32::from(status.contains("200"));
            slowest = slowest.max(took);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(flood);
    eprintln!("a connection flood: {served} of 30 scrapes served, the slowest in {slowest:?}");
    assert!(served >= 29, "a connection flood: {served} of 30 scrapes served");
    drop(watch);
    std::fs::remove_dir_all(dumps.parent().unwrap()).ok();
}

/// A backlog of connections taken in one go (the watch stopped a moment, or busy) made way for
/// itself: each one taken evicted the one before, down to a scraper whose whole request had
/// come before anything was taken, because it was not read yet. Now each connection taken reads
/// what it was sent before the next one is taken. Five rounds, each with the places held by
/// connections that send nothing, then the watch stopped while a scraper and a hundred others
/// connect behind them: every scrape is answered.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_backlog_taken_at_once_never_evicts_a_request_already_sent() {
    use std::io::{Read, Write};
    let _root = as_root();
    let (watch, port, dumps) = serving_watch("backlog", "127.0.0.1");
    let pid = watch.0.as_ref().unwrap().id() as i32;
    drop(connect(port, Duration::from_secs(5)));
    let mut answers = Vec::new();
    for _ in 0..5 {
        let idle: Vec<_> = (0..16).map(|_| connect(port, Duration::from_secs(1))).collect();
        std::thread::sleep(Duration::from_millis(200));
        // SAFETY: kill(2) on the watch this test started (SIGCONT below, before any wait on it).
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        let mut scraper = connect(port, Duration::from_secs(1));
        write!(scraper, "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
        let behind: Vec<_> = (0..100).map(|_| connect(port, Duration::from_secs(1))).collect();
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        scraper.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut answer = Vec::new();
        let status = match scraper.read_to_end(&mut answer) {
            Ok(_) => String::from_utf8_lossy(&answer).lines().next().unwrap_or("(nothing)").to_string(),
            Err(e) => e.to_string(),
        };
        answers.push(status);
        drop((idle, behind));
    }
    eprintln!("a scraper behind a backlog, five times: {answers:?}");
    assert!(answers.iter().all(|a| a.contains("200")), "{answers:?}");
    drop(watch);
    std::fs::remove_dir_all(dumps.parent().unwrap()).ok();
}

/// A user (not root) who holds 4 of the 16 places once they are all taken is answered 503, and
/// the answer arrives (it used to be a reset: the refusal was written before the connection's
/// readiness was known, so never sent). Root's scraper still gets in, in place of one of root's
/// connections that sent nothing.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_user_holding_their_share_of_places_is_told_so() {
    let _root = as_root();
    let (watch, port, dumps) = serving_watch("share", "127.0.0.1");
    drop(connect(port, Duration::from_secs(5)));
    let idle: Vec<_> = (0..12).map(|_| connect(port, Duration::from_secs(1))).collect();
    let crowd = as_nobody(env!("CARGO_BIN_EXE_hostile-user")).arg("crowd").args([port.to_string(), "4".into()]).output().unwrap();
    let said = String::from_utf8_lossy(&crowd.stdout).into_owned();
    let scrape = get(port, "/metrics", Duration::from_secs(5));
    drop(idle);
    eprintln!("the fifth connection of a user holding four: {said:?}; root's scrape then: {scrape:?}");
    assert!(said.starts_with("answer: HTTP/1.1 503"), "{said}{}", stderr(&crowd));
    assert!(scrape.is_some_and(|(status, _)| status.contains("200")));
    drop(watch);
    std::fs::remove_dir_all(dumps.parent().unwrap()).ok();
}

/// A network namespace of the test's own, joined to this one by a veth pair (10.231.0.1 here,
/// 10.231.0.2 there): a client on another host, as the watch sees it. Deleted when dropped.
struct Elsewhere(String);

impl Elsewhere {
    fn new() -> Elsewhere {
        let name = format!("gputrace-elsewhere-{}", std::process::id());
        let script = format!(
            "ip link del gte0 2>/dev/null; ip netns add {name} && ip link add gte0 type veth peer name gte1 netns {name} \
             && ip addr add 10.231.0.1/30 dev gte0 && ip link set gte0 up \
             && ip -n {name} addr add 10.231.0.2/30 dev gte1 && ip -n {name} link set gte1 up"
        );
        let made = Command::new("bash").args(["-c", &script]).output().unwrap();
        let elsewhere = Elsewhere(name);
        assert!(made.status.success(), "cannot make a network namespace: {}", stderr(&made));
        elsewhere
    }
}

impl Drop for Elsewhere {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// The kernel, asked who holds the other end of a connection this network namespace holds no
/// socket for (a client on another host, or in a container of its own), answers for a listener
/// on the client's port instead. A client elsewhere that connected from the port the watch
/// listens on (0.0.0.0, as the DaemonSet does) was taken for root, whose listener that is, and
/// handed /report. Now it is answered 403, as it is from any other port.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_client_elsewhere_is_never_taken_for_a_listener_here() {
    let _root = as_root();
    let (watch, port, dumps) = serving_watch("elsewhere", "0.0.0.0");
    drop(connect(port, Duration::from_secs(5)));
    let elsewhere = Elsewhere::new();
    let ask = |from_port: &str| {
        let out = Command::new("ip")
            .args(["netns", "exec", &elsewhere.0, "setpriv", NOBODY[0], NOBODY[1], NOBODY[2], "--"])
            .args(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5"])
            .args(if from_port.is_empty() { vec![] } else { vec!["--local-port", from_port] })
            .arg(format!("http://10.231.0.1:{port}/report"))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let (from_any, from_watchs) = (ask(""), ask(&port.to_string()));
    eprintln!("/report asked from another network namespace: {from_any} from any port, {from_watchs} from the watch's own");
    assert_eq!(from_any, "403");
    assert_eq!(from_watchs, "403");
    drop(watch);
    std::fs::remove_dir_all(dumps.parent().unwrap()).ok();
}

/// Any user can make the kernel side's records faster than the event loop reads them: two
/// processes calling listen(2) in a loop (each call a record, and a question about its fd) kept
/// a watch's event loop reading the ring buffer for seconds at a time, /healthz unanswered for
/// 5 s. The loop now reads for 50 ms at most before it looks at anything else: every /healthz
/// during the flood is answered within a second.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_flood_of_records_never_keeps_a_watch_from_answering() {
    let _root = as_root();
    let (watch, port, dumps) = serving_watch("records", "127.0.0.1");
    drop(connect(port, Duration::from_secs(5)));
    let floods: Vec<Guard> =
        (0..2).map(|_| Guard(Some(as_nobody(env!("CARGO_BIN_EXE_hostile-user")).args(["listens", "10"]).spawn().unwrap()))).collect();
    std::thread::sleep(Duration::from_secs(1));
    let answers: Vec<Option<Duration>> = (0..8)
        .map(|_| {
            let answer = get(port, "/healthz", Duration::from_secs(5)).filter(|(status, _)| status.contains("200")).map(|(_, took)| took);
            std::thread::sleep(Duration::from_millis(500));
            answer
        })
        .collect();
    drop(floods);
    eprintln!("/healthz under a flood of listen(2) calls: {answers:?}");
    assert!(answers.iter().all(|a| a.is_some_and(|took| took < Duration::from_secs(1))), "{answers:?}");
    drop(watch);
    std::fs::remove_dir_all(dumps.parent().unwrap()).ok();
}

/// A kernel setting changed for one test, set back when dropped (after a failed assertion too).
struct Sysctl {
    path: &'static str,
    was: String,
}

impl Sysctl {
    fn set(path: &'static str, value: &str) -> Sysctl {
        let was = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        std::fs::write(path, value).unwrap_or_else(|e| panic!("{path}: {e}"));
        Sysctl { path, was }
    }
}

impl Drop for Sysctl {
    fn drop(&mut self) {
        let _ = std::fs::write(self.path, self.was.trim());
    }
}

/// Items 5 and 14. A flood of TIME_WAIT sockets (past the 16 MiB /proc/net/tcp used to be read
/// to) and 16 clients asking /report in a loop: root is never refused, and answered quickly,
/// /healthz with it. The watch listens on 0.0.0.0, where the peer's uid used to be looked up by
/// the listener's unspecified address: root is answered, nobody is refused; HEAD has no body.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn who_asks_for_the_report_is_known_whatever_the_hosts_socket_table_holds() {
    use std::io::{Read, Write};
    let _root = as_root();
    let (watch, port, dumps) = serving_watch("timewait", "0.0.0.0");
    drop(connect(port, Duration::from_secs(5)));

    // TIME_WAIT sockets: connections this side closes first, to eight listeners (a port range
    // holds 28,000 for each), until the kernel's table is past 16 MiB. The kernel's allowance of
    // them is raised for the test: a machine's default (131,072 here, by its memory) gives a table
    // of about 16 MiB, a hair either side of the mark from one run to the next.
    let _allowance = Sysctl::set("/proc/sys/net/ipv4/tcp_max_tw_buckets", "262144");
    let listeners: Vec<std::net::TcpListener> = (0..8).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let began = Instant::now();
    let table = || std::fs::read("/proc/net/tcp").map(|t| t.len()).unwrap_or(0);
    let mut made = 0u32;
    for l in &listeners {
        let to = l.local_addr().unwrap();
        for _ in 0..24_000 {
            let Ok(client) = std::net::TcpStream::connect(to) else { break };
            let (accepted, _) = l.accept().unwrap();
            drop(client);
            drop(accepted);
            made += 1;
        }
        if table() > 17 << 20 {
            break;
        }
    }
    let bytes = table();
    eprintln!("{made} connections closed in {:?}: /proc/net/tcp is {:.1} MiB", began.elapsed(), bytes as f64 / (1 << 20) as f64);
    assert!(bytes > 16 << 20, "the flood is past what /proc/net/tcp was read to");

    let askers = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let loops: Vec<_> = (0..16)
        .map(|_| {
            let askers = askers.clone();
            std::thread::spawn(move || {
                while !askers.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = get(port, "/report", Duration::from_secs(5));
                }
            })
        })
        .collect();
    // With the kernel's TIME_WAIT table full, a connection now and then fails before any HTTP
    // (the kernel's doing, not gputrace's): asked again, up to 90 tries for 30 answers.
    let (mut answers, mut tries, mut slowest, mut healthz_slowest) = (Vec::new(), 0, Duration::ZERO, Duration::ZERO);
    while answers.len() < 30 && tries < 90 {
        tries += 1;
        if let Some((status, took)) = get(port, "/report", Duration::from_secs(5)) {
            answers.push(status);
            slowest = slowest.max(took);
        }
        if let Some((_, took)) = get(port, "/healthz", Duration::from_secs(5)) {
            healthz_slowest = healthz_slowest.max(took);
        }
    }
    askers.store(true, std::sync::atomic::Ordering::Relaxed);
    for l in loops {
        let _ = l.join();
    }
    let answered = answers.iter().filter(|s| s.contains("200")).count();
    eprintln!(
        "root's /report: {answered} of {} answers 200 ({tries} tries), the slowest in {slowest:?}; /healthz at worst {healthz_slowest:?}",
        answers.len()
    );
    assert_eq!((answers.len(), answered), (30, 30), "root is answered, never refused: {answers:?}");
    assert!(slowest < Duration::from_secs(1) && healthz_slowest < Duration::from_secs(1), "{slowest:?} {healthz_slowest:?}");

    // Nobody is refused (curl as uid 65534); HEAD answers the head alone.
    let nobody = as_nobody("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
        .arg(format!("http://127.0.0.1:{port}/report"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&nobody.stdout), "403");
    let mut s = connect(port, Duration::from_secs(1));
    write!(s, "HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200") && answer.contains("Content-Length: 3\r\n") && answer.ends_with("\r\n\r\n"), "{answer:?}");
    drop(watch);
    std::fs::remove_dir_all(dumps.parent().unwrap()).ok();
}

/// Item 6. Whoever bound the port first stopped the watch: no tracing, no dumps. Now the watch
/// traces and dumps without it, and serves once the port is free. The units ship a port below
/// 1024, which no ordinary user can take.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_port_taken_first_never_stops_the_watch() {
    use std::io::BufRead;
    let _root = as_root();
    let dumps = scratch("port-taken").join("dumps");
    let port = free_port();
    let mut holder = Guard(Some(
        as_nobody(env!("CARGO_BIN_EXE_hostile-user")).arg("hold").arg(format!("127.0.0.1:{port}")).stdout(Stdio::piped()).spawn().unwrap(),
    ));
    let mut line = String::new();
    std::io::BufReader::new(holder.0.as_mut().unwrap().stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert!(line.starts_with("holding"), "{line}");
    let mut sleeper = Guard(Some(Command::new("sleep").arg("600").spawn().unwrap()));
    let sleeper_pid = sleeper.0.as_ref().unwrap().id().to_string();
    let watch = Guard(Some(start(
        &[
            "watch",
            "--dump-dir",
            dumps.to_str().unwrap(),
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--aftermath",
            "0s",
            "--pid",
            &sleeper_pid,
        ],
        false,
    )));
    // SAFETY: kill(2) on the watch this test started.
    unsafe { libc::kill(watch.0.as_ref().unwrap().id() as i32, libc::SIGUSR1) };
    let until = Instant::now() + Duration::from_secs(30);
    let reports = || {
        std::fs::read_dir(&dumps)
            .map(|d| d.flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".report.txt")).count())
            .unwrap_or(0)
    };
    while reports() == 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(reports(), 1, "a dump is written while someone else holds the port");
    drop(holder);
    let began = Instant::now();
    let mut served = None;
    while served.is_none() && began.elapsed() < Duration::from_secs(20) {
        served = get(port, "/healthz", Duration::from_secs(1)).filter(|(s, _)| s.contains("200"));
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("served {:?} after the port was given up", began.elapsed());
    assert!(served.is_some(), "the watch took the port once it was free");
    // The shipped units' port is one nobody may bind.
    let low = as_nobody(env!("CARGO_BIN_EXE_hostile-user")).args(["hold", "127.0.0.1:931"]).output().unwrap();
    assert!(String::from_utf8_lossy(&low.stderr).contains("Permission denied"), "{}", stderr(&low));
    drop(watch);
    let _ = sleeper.0.as_mut().map(Child::kill);
    std::fs::remove_dir_all(dumps.parent().unwrap()).ok();
}

/// Items 9, 11 and 12, on the fake GPU's device files with no NVML: what other users' processes
/// can make `doctor` say. Root runs a job (`sleep 600`) holding the GPU; nobody starts a copy of
/// its command line that listens (so root's used to look like "a second copy" to kill), a
/// stopped holder calling itself nvidia-persistenced (`exec -a`: it used to be benign), and one
/// whose argument holds newlines and a forged `RECOMMENDED:` line.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn other_users_processes_cannot_steer_doctor() {
    let _root = as_root();
    let dir = scratch("doctor");
    let port = free_port();
    let script = r#"
        exec 3<>/dev/nvidiactl
        nobody() { exec setpriv --reuid=65534 --regid=65534 --clear-groups -- "$@"; }
        (exec -a sleep sleep 600) & echo "root $!" >> "$D/pids"
        (HOSTILE_HOLD="127.0.0.1:$PORT" nobody bash -c 'exec -a sleep "$H" 600' > /dev/null) & echo "copy $!" >> "$D/pids"
        (nobody bash -c 'exec -a nvidia-persistenced sleep 600') & hidden=$!; echo "hidden $hidden" >> "$D/pids"
        (nobody bash -c 'exec -a "$(printf "x\n\nRECOMMENDED: kill 1  (init)")" sleep 600') & echo "forger $!" >> "$D/pids"
        exec 3>&-
        sleep 1; kill -STOP $hidden
        "$G" doctor --json > "$D/doctor.json"; "$G" doctor > "$D/doctor.txt"
        kill -CONT $hidden; kill -KILL $(jobs -p); exit 0
    "#;
    let out = on_fake_gpu(script, &dir, port);
    assert!(out.status.success(), "{}", stderr(&out));
    let pids: std::collections::HashMap<String, u64> = std::fs::read_to_string(dir.join("pids"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once(' ').map(|(k, v)| (k.to_string(), v.parse().unwrap())))
        .collect();
    let doctor: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("doctor.json")).unwrap()).unwrap();
    let text = std::fs::read_to_string(dir.join("doctor.txt")).unwrap();
    let of = |who: &str| {
        doctor["holders"]
            .as_array()
            .unwrap()
            .iter()
            .find(|h| h["pid"] == pids[who])
            .unwrap_or_else(|| panic!("{who} among {doctor:#}"))
            .clone()
    };
    assert_eq!(of("copy")["listening"][0], port, "nobody's copy listens");
    assert_ne!(of("root")["verdict"], "stale", "root's job is no copy of another user's process: {:#}", of("root"));
    assert_eq!(of("hidden")["verdict"], "stale", "a name is not a daemon: {:#}", of("hidden"));
    assert!(of("hidden")["exe"]["path"].as_str().unwrap().ends_with("/sleep"), "{:#}", of("hidden"));
    assert!(!text.lines().any(|l| l.starts_with("RECOMMENDED: kill 1 ")), "{text}");
    assert!(text.contains("x\\n\\nRECOMMENDED: kill 1"), "the newline shown as an escape: {text}");
    assert_eq!(doctor["recommendation"]["kill"], pids["hidden"], "{doctor:#}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Items 7 and 8, on the fake GPU. One user's failed allocation 5 s before root's used to spend
/// the only dump of the interval: now each party has its own (two dumps). `gputrace dump` asks
/// the watch through its socket: a process nobody dressed up as a watch (`exec -a gputrace ...
/// watch`) is never signalled (it used to die of SIGUSR1; with a pid recycled, an innocent
/// process did), and nobody's own `gputrace dump` is refused.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn one_user_cannot_spend_or_steer_anothers_dumps() {
    let _root = as_root();
    let dir = scratch("dumps-parties");
    let script = r#"
        "$G" watch --dump-dir "$D/dumps" --listen off --aftermath 1s --min-interval 60s 2> "$D/watch.log" & watch=$!
        for _ in $(seq 100); do grep -q "gputrace: tracing" "$D/watch.log" && break; sleep 0.1; done
        grep -q "gputrace: tracing" "$D/watch.log" || exit 1
        (HOSTILE_HOLD=127.0.0.1:0 exec -a gputrace setpriv --reuid=65534 --regid=65534 --clear-groups -- "$H" watch > /dev/null) & spoof=$!
        setpriv --reuid=65534 --regid=65534 --clear-groups -- "$W" oom --truth /dev/null
        sleep 5
        "$W" oom --truth /dev/null
        sleep 3
        setpriv --reuid=65534 --regid=65534 --clear-groups -- "$G" dump > "$D/nobody-dump.txt" 2>&1; echo "$?" > "$D/nobody-dump.rc"
        "$G" dump > "$D/dump.txt" 2>&1; echo "$?" > "$D/dump.rc"
        sleep 3
        if kill -0 $spoof 2>/dev/null; then echo alive > "$D/spoof"; else echo dead > "$D/spoof"; fi
        kill $spoof; kill -TERM $watch; wait $watch
    "#;
    let out = on_fake_gpu(script, &dir, free_port());
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    assert!(out.status.success(), "{}\n{}", stderr(&out), read("watch.log"));
    let dumps: Vec<String> = std::fs::read_dir(dir.join("dumps"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".trace"))
        .collect();
    let failed = dumps.iter().filter(|n| n.contains("-failed-allocation")).count();
    assert_eq!(failed, 2, "nobody's failure and root's, 5 s apart, each dumped: {dumps:?}\n{}", read("watch.log"));
    assert_eq!(read("spoof").trim(), "alive", "the process dressed as a watch was not signalled");
    assert_eq!(read("nobody-dump.rc").trim(), "2", "{}", read("nobody-dump.txt"));
    assert!(read("nobody-dump.txt").contains("uid 65534 may not ask for a dump"), "{}", read("nobody-dump.txt"));
    assert_eq!(read("dump.rc").trim(), "0", "{}", read("dump.txt"));
    assert_eq!(dumps.iter().filter(|n| n.contains("-manual")).count(), 1, "root's ask is dumped once: {dumps:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// From the second review: dumps over the budget went oldest first, so a user whose processes
/// failed in a loop removed the dump of another user's failure, the evidence of it, within the
/// hour. Root's server fails once; then nobody's fails seven times (each run a service of its
/// own, a second apart); the budget holds about three dumps. Root's dump stays, and what goes
/// is nobody's. Root's is named as root's (`-uid0`): its process, forked by a shell that ran
/// before the watch, used to have no known user (the shell's place, read while attaching, was
/// kept but never recorded, so its children's was no news).
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn one_users_failures_never_rotate_out_the_dump_of_anothers() {
    let _root = as_root();
    let dir = scratch("dumps-shares");
    let script = r#"
        "$G" watch --dump-dir "$D/dumps" --listen off --aftermath 200ms --min-interval 1s --budget 120KiB 2> "$D/watch.log" & watch=$!
        for _ in $(seq 100); do grep -q "gputrace: tracing" "$D/watch.log" && break; sleep 0.1; done
        grep -q "gputrace: tracing" "$D/watch.log" || exit 1
        "$W" oom --truth /dev/null
        sleep 1.2
        for _ in $(seq 7); do
            setpriv --reuid=65534 --regid=65534 --clear-groups -- "$W" oom --truth /dev/null
            sleep 1.2
        done
        kill -TERM $watch; wait $watch
    "#;
    let out = on_fake_gpu(script, &dir, 0);
    let log = std::fs::read_to_string(dir.join("watch.log")).unwrap_or_default();
    assert!(out.status.success(), "{}\n{log}", stderr(&out));
    let dumps: Vec<(String, u64)> = std::fs::read_dir(dir.join("dumps"))
        .unwrap()
        .flatten()
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.metadata().unwrap().len()))
        .filter(|(n, _)| n.ends_with(".trace"))
        .collect();
    let of = |uid: &str| dumps.iter().filter(|(n, _)| n.ends_with(&format!("-failed-allocation-uid{uid}.trace"))).count();
    assert_eq!(of("0"), 1, "root's failure is still there: {dumps:?}\n{log}");
    let removed: Vec<&str> = log.lines().filter(|l| l.contains("gputrace: removed")).collect();
    assert!(!removed.is_empty() && of("65534") < 7, "the budget was passed: {dumps:?}\n{log}");
    assert!(removed.iter().all(|l| l.contains("-uid65534.trace")), "only nobody's went: {removed:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// From the third review: the capabilities were dropped on the event loop's thread only. The
/// threads that read /proc (started while attaching, where a process held the GPU, and kept for
/// the whole run) kept every capability, and no_new_privs was not theirs: code run on one of them
/// was root with all its rights. Every thread of a recording with a holder met at start.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn no_thread_of_a_recording_keeps_what_it_dropped() {
    let _root = as_root();
    let dir = scratch("threads-caps");
    let script = r#"
        "$W" hold --ms 6000 --truth /dev/null & held=$!
        sleep 1
        "$G" record --all -o "$D/run.trace" 2> "$D/record.log" & g=$!
        for _ in $(seq 100); do grep -q "gputrace: tracing" "$D/record.log" && break; sleep 0.1; done
        sleep 1
        for t in /proc/$g/task/*; do echo "$(cat $t/comm) $(grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs):' $t/status | tr -s '\t\n' '  ')"; done > "$D/threads.txt"
        kill -INT $g; wait $g; kill $held; wait $held
        true
    "#;
    let out = on_fake_gpu(script, &dir, 0);
    let threads = std::fs::read_to_string(dir.join("threads.txt")).unwrap_or_default();
    assert!(out.status.success(), "{}\n{}", stderr(&out), std::fs::read_to_string(dir.join("record.log")).unwrap_or_default());
    const DROPPED: u64 = 1 << 7 | 1 << 16; // CAP_SETUID, CAP_SYS_MODULE
    let field = |line: &str, name: &str| {
        let at = line.find(name).unwrap_or_else(|| panic!("{name} in {line}")) + name.len();
        line[at..].split_whitespace().next().unwrap().to_string()
    };
    assert!(threads.lines().count() >= 2, "{threads}");
    for line in threads.lines() {
        for set in ["CapEff:", "CapPrm:", "CapBnd:"] {
            let caps = u64::from_str_radix(&field(line, set), 16).unwrap();
            assert_eq!(caps & DROPPED, 0, "{set} of {line}\n{threads}");
        }
        assert_eq!(field(line, "NoNewPrivs:"), "1", "{line}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Item 13. /metrics, which every local user may read, once showed `-pGLUEDSECRET`,
/// `--api-key -dashSECRET` and `--token SPACESECRET` (a flag and its value as one argument) in
/// its labels. A process holding fake GPU memory with those arguments, scraped under a watch.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn metrics_labels_show_no_value_however_it_is_passed() {
    let _root = as_root();
    let dir = scratch("redact");
    let port = free_port();
    let script = r#"
        "$G" watch --dump-dir "$D/dumps" --listen "127.0.0.1:$PORT" 2> "$D/watch.log" & watch=$!
        for _ in $(seq 100); do grep -q "gputrace: serving" "$D/watch.log" && break; sleep 0.1; done
        (exec -a server "$W" hold --ms 4000 --truth /dev/null -pGLUEDSECRET --api-key -dashSECRET "--token SPACESECRET") & held=$!
        sleep 2
        curl -s "http://127.0.0.1:$PORT/metrics" > "$D/metrics.txt"
        wait $held; kill -TERM $watch; wait $watch
    "#;
    let out = on_fake_gpu(script, &dir, port);
    let metrics = std::fs::read_to_string(dir.join("metrics.txt")).unwrap_or_default();
    assert!(out.status.success(), "{}", stderr(&out));
    let labels: Vec<&str> = metrics.lines().filter(|l| l.starts_with("gputrace_process_live_bytes{")).collect();
    assert!(labels.iter().any(|l| l.contains("command=\"server ")), "the held memory is served: {metrics}");
    for secret in ["GLUED", "dash", "SPACE"] {
        assert!(!metrics.contains(secret), "{secret} in {labels:?}");
    }
    assert!(labels.iter().any(|l| l.contains("-p… --api-key … --token …")), "flag names kept: {labels:?}");
    std::fs::remove_dir_all(&dir).ok();
}

//! `cargo xtask test [--quick]`: every check of the project in one command.
//!
//! The whole run: the build, the package, the format, the test binaries built once; then the
//! end-to-end tests (which mostly wait on the fake GPU, its servers and the kernel) while, beside
//! them and niced, so that they take only the CPU the tests leave idle, clippy, fuzzing and the
//! QEMU guests; the suites that watch the whole host once those are done ([`ALONE_SUITES`]); at
//! its end every count and how long each step took. The tests run one at a time
//! (they share the kernel's tracepoints), each test binary straight, not under `cargo test`,
//! whose lock on the build directory would keep the builds beside them waiting.
//!
//! `--quick`, the loop between two edits: the format, clippy, every unit test and the quick
//! end-to-end suites ([`QUICK_SUITES`]).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::{bin, build, dist, fuzz, install_test_tools, is_root, root, run, vm, Result, FUZZ_SECONDS_IN_TEST};

/// The end-to-end suites `--quick` runs: those of under a minute that cover the report's
/// verdicts on every scenario recorded, headroom and the limits behind a proxy, the CLI and closed
/// pipes. The rest (the QEMU guests, fuzzing, the package, recording's every driver path, whatif's re-runs,
/// the hostile users, attaching, the watch, Prometheus, Chromium) run in the whole `xtask test`.
const QUICK_SUITES: [&str; 5] = ["cli", "scenarios", "headroom", "pipes", "partial"];

/// The end-to-end suites that run once the run beside the tests is done: those that watch the
/// whole host (`watch`, `record --all`) and bound what it costs them (a dump budget of a few
/// dumps, a watch's memory, a scraper's wait), whose window a build's processes fill, and
/// `record`, whose two threads in one slot of calls in flight are told apart only while both are
/// in their calls at once, which a busy CPU spreads apart. (Beside a build, hostile's dumps
/// outgrew their budget and every dump but the newest went, root's with them; beside two niced
/// busy loops, record's two calls were both kept in the map in 2 runs of 10, a cause not found.)
const ALONE_SUITES: [&str; 6] = ["hostile", "watch", "watch_memory", "prometheus", "dist", "record"];

/// The guests: Debian 12's arm64 and amd64 6.1 and Debian 11's amd64 5.10.
const GUESTS: [&str; 3] = ["arm64", "x86", "x86-5.10"];

/// What the run beside the tests says last: how many guests passed and failed.
const GUESTS_SAID: &str = "xtask: guests passed, failed: ";

/// How long each step of a test run took, said at its end.
struct Steps(Vec<(&'static str, Instant)>);

impl Steps {
    fn start() -> Steps {
        Steps(vec![("", Instant::now())])
    }

    fn done(&mut self, step: &'static str) {
        self.0.push((step, Instant::now()));
    }

    fn said(&self) -> String {
        let each = self.0.windows(2).map(|w| format!("{} {:.0} s", w[1].0, w[1].1.duration_since(w[0].1).as_secs_f64()));
        let total = self.0.last().map_or(0.0, |(_, at)| at.duration_since(self.0[0].1).as_secs_f64());
        format!("{} (in all {:.1} min)", each.collect::<Vec<_>>().join(", "), total / 60.0)
    }
}

/// Passed, failed and skipped tests, totalled over every test binary (cargo's own last line is
/// only the last binary's, often a doc-test run of none).
#[derive(Default)]
struct Counts {
    passed: u64,
    failed: u64,
    ignored: u64,
}

impl Counts {
    /// Adds a `test result:` line's counts.
    fn add(&mut self, line: &str) {
        let Some(rest) = line.strip_prefix("test result: ") else { return };
        let count = |what: &str| {
            rest.split(';').find_map(|part| part.trim().strip_suffix(what)?.trim().rsplit(' ').next()?.parse::<u64>().ok()).unwrap_or(0)
        };
        self.passed += count("passed");
        self.failed += count("failed");
        self.ignored += count("ignored");
    }
}

/// A test binary cargo built: its target's name and kind, its package's directory (where cargo
/// runs it), its path.
struct TestBinary {
    name: String,
    kind: String,
    dir: PathBuf,
    path: PathBuf,
}

/// Builds every test binary of the default members (`cargo test --no-run`) and lists them.
fn build_tests() -> Result<Vec<TestBinary>> {
    let out = Command::new("cargo")
        .current_dir(root())
        .args(["test", "--release", "--no-run", "--message-format=json-render-diagnostics"])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo test --no-run: {e}"))?;
    if !out.status.success() {
        return Err(format!("building the tests failed ({})", out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let artifacts = text.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok());
    let mut found: Vec<TestBinary> = artifacts
        .filter(|a| a["reason"] == "compiler-artifact" && a["profile"]["test"] == true)
        .filter_map(|a| {
            Some(TestBinary {
                name: a["target"]["name"].as_str()?.to_string(),
                kind: a["target"]["kind"][0].as_str()?.to_string(),
                dir: PathBuf::from(a["manifest_path"].as_str()?).parent()?.to_path_buf(),
                path: PathBuf::from(a["executable"].as_str()?),
            })
        })
        .collect();
    // As cargo runs them: package by package, by kind, by name.
    found.sort_by(|a, b| (&a.dir, &a.kind, &a.name).cmp(&(&b.dir, &b.kind, &b.name)));
    Ok(found)
}

/// Runs the test binaries one after another, their output shown as it comes. Root runs the
/// root-only tests too (ignored otherwise, so a skip always shows).
fn run_tests(binaries: &[TestBinary], as_root: bool, package: Option<&PathBuf>, counts: &mut Counts) -> Result<bool> {
    let mut all_passed = true;
    for b in binaries {
        println!("     Running {} ({})", b.name, b.path.display());
        let mut child = Command::new(&b.path)
            .current_dir(&b.dir)
            .env("CARGO_MANIFEST_DIR", &b.dir)
            .env("GPUTRACE_BIN", bin("gputrace"))
            .envs(package.map(|deb| ("GPUTRACE_DEB", deb)))
            .arg("--test-threads=1")
            .args(as_root.then_some("--include-ignored"))
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", b.path.display()))?;
        for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
            let line = line.map_err(|e| e.to_string())?;
            println!("{line}");
            counts.add(&line);
        }
        all_passed &= child.wait().map_err(|e| e.to_string())?.success();
    }
    Ok(all_passed)
}

/// The whole run, or with `quick` the loop between two edits (see the module's doc).
pub fn test(quick: bool) -> Result<()> {
    let mut steps = Steps::start();
    build()?;
    steps.done("build");
    let as_root = is_root();
    if !as_root {
        eprintln!("xtask: not root: the end-to-end tests are skipped, and counted so (run `sudo cargo xtask test` for them)");
    } else if !quick {
        install_test_tools()?;
    }
    // The package the install test puts on a copy of this machine's root.
    let package = if as_root && !quick { Some(dist::dist(None)?) } else { None };
    // The team's habits, enforced: formatted as rustfmt.toml says (and clippy-clean, below).
    run(Command::new("cargo").current_dir(root()).args(["fmt", "--all", "--check"])).map_err(|e| format!("{e}: run `cargo fmt --all`"))?;
    let mut binaries = build_tests()?;
    steps.done("build, package, format, test binaries");
    let beside = if quick {
        clippy()?;
        steps.done("clippy");
        // Every unit test (the libraries', the binaries', the layers'), and of the end-to-end
        // suites the quick ones.
        binaries.retain(|b| b.kind != "test" || b.name == "layers" || QUICK_SUITES.contains(&b.name.as_str()));
        None
    } else {
        Some(start_beside_the_tests()?)
    };
    let (alone, beside_them): (Vec<TestBinary>, Vec<TestBinary>) =
        binaries.into_iter().partition(|b| b.kind == "test" && ALONE_SUITES.contains(&b.name.as_str()));
    let mut counts = Counts::default();
    let mut tests_passed = run_tests(&beside_them, as_root, package.as_ref(), &mut counts)?;
    steps.done("tests");
    let beside_passed = match beside {
        Some(beside) => {
            let (passed, guests) = wait_beside_the_tests(beside)?;
            steps.done("waiting for clippy, fuzzing and the guests");
            counts.passed += guests.0;
            counts.failed += guests.1;
            if !as_root {
                counts.ignored += GUESTS.len() as u64;
            }
            passed
        }
        None => true,
    };
    tests_passed &= run_tests(&alone, as_root, package.as_ref(), &mut counts)?;
    steps.done("the suites run alone");
    // Doc tests, if any are ever written: cargo runs them itself.
    let doc = Command::new("cargo").current_dir(root()).args(["test", "--release", "--doc"]).stdout(Stdio::piped()).output();
    let doc = doc.map_err(|e| format!("cannot run cargo test --doc: {e}"))?;
    String::from_utf8_lossy(&doc.stdout).lines().for_each(|l| counts.add(l));
    let Counts { passed, failed, ignored } = counts;
    println!("tests: {passed} passed, {failed} failed, {ignored} skipped");
    println!("xtask: {}", steps.said());
    if !tests_passed || !doc.status.success() {
        Err("a test failed (see above)".into())
    } else if !beside_passed {
        Err("clippy, fuzzing or a guest kernel's run failed (see above)".into())
    } else {
        Ok(())
    }
}

fn clippy() -> Result<()> {
    run(Command::new("cargo").current_dir(root()).args(["clippy", "--quiet", "--release", "--all-targets", "--", "-D", "warnings"]))
}

/// Where the run beside the tests writes what it says.
fn beside_log() -> PathBuf {
    root().join("target/xtask-beside-the-tests.log")
}

/// Starts `xtask beside-the-tests`, niced, its output into [`beside_log`].
fn start_beside_the_tests() -> Result<std::process::Child> {
    let log = std::fs::File::create(beside_log()).map_err(|e| format!("cannot write {}: {e}", beside_log().display()))?;
    let err = log.try_clone().map_err(|e| e.to_string())?;
    // Not current_exe(): building the tests has just linked xtask's binary anew.
    let me = bin("xtask");
    eprintln!("xtask: clippy, fuzzing and the guests run beside the tests, niced (their output: {})", beside_log().display());
    Command::new("nice")
        .args(["-n", "19"])
        .arg(me)
        .arg("beside-the-tests")
        .stdout(log)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("cannot start the run beside the tests: {e}"))
}

/// Waits for it, shows what it said; whether it passed, and the guests passed and failed.
fn wait_beside_the_tests(mut beside: std::process::Child) -> Result<(bool, (u64, u64))> {
    let status = beside.wait().map_err(|e| e.to_string())?;
    let said = std::fs::read_to_string(beside_log()).unwrap_or_default();
    print!("\n--- beside the tests: clippy, fuzzing, the guests ---\n{said}");
    let guests = said.lines().rev().find_map(|l| l.strip_prefix(GUESTS_SAID)).and_then(|counts| {
        let (passed, failed) = counts.split_once(',')?;
        Some((passed.trim().parse().ok()?, failed.trim().parse().ok()?))
    });
    Ok((status.success(), guests.unwrap_or((0, 0))))
}

/// `xtask beside-the-tests`: clippy, a bounded run of every fuzz target (a crash fails it), and
/// as root gputrace on the kernels users run under QEMU (the guests' packages are installed
/// with apt); each guest counts as one test in the totals. Every part runs, whatever the one
/// before did.
pub fn beside_the_tests() -> Result<()> {
    let mut steps = Steps::start();
    let clippy = clippy();
    steps.done("clippy");
    let fuzzed = fuzz(FUZZ_SECONDS_IN_TEST);
    steps.done("fuzzing");
    let mut guests = (0u64, 0u64);
    if is_root() {
        for guest in GUESTS {
            match vm::vm(guest) {
                Ok(()) => guests.0 += 1,
                Err(e) => {
                    eprintln!("xtask: the {guest} guest failed: {e}");
                    guests.1 += 1;
                }
            }
        }
        steps.done("guests");
    }
    eprintln!("xtask: {}", steps.said());
    eprintln!("{GUESTS_SAID}{}, {}", guests.0, guests.1);
    clippy?;
    fuzzed?;
    if guests.1 > 0 {
        return Err("a guest kernel's run failed (see above)".into());
    }
    Ok(())
}

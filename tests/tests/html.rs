//! The HTML report of a failure scenario, rendered in headless Chromium (Debian's `chromium`,
//! installed by `cargo xtask test`): it shows the verdict and a chart with the failure marker, and
//! the page logs no console error. Root (the scenario runs on the fake GPU).

mod common;

use std::path::Path;
use std::process::Command;

use common::{as_root, gputrace_bin};

fn chromium(dir: &Path, args: &[&str], page: &Path) -> std::process::Output {
    let profile = dir.join("chromium-profile");
    Command::new("chromium")
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("running chromium")
}

/// Runs a scenario, exports its HTML report; the page's directory and path. None (said) where
/// there is no chromium outside CI.
fn page_of(scenario: &str) -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    if Command::new("chromium").arg("--version").output().is_err() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "chromium is missing: `cargo xtask test` installs it");
        eprintln!("skipping: no chromium (apt-get install chromium chromium-driver)");
        return None;
    }
    let dir = std::env::temp_dir().join(format!("gputrace-html-{scenario}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let run = Command::new(env!("CARGO_BIN_EXE_fakegpu"))
        .args(["scenario", scenario, "--server", "vllm", "--dir"])
        .arg(&dir)
        .arg("--gputrace")
        .arg(gputrace_bin())
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let page = dir.join("report.html");
    let export =
        Command::new(gputrace_bin()).args(["export", "--format", "html", "-o"]).arg(&page).arg(dir.join("run.trace")).output().unwrap();
    assert!(export.status.success(), "{}", String::from_utf8_lossy(&export.stderr));
    Some((dir, page))
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn the_html_report_of_a_failure_renders_with_its_verdict_and_marker() {
    let _root = as_root();
    let Some((dir, page)) = page_of("long-request") else { return };
    let html = std::fs::read_to_string(&page).unwrap();
    // Self-contained: nothing fetched (the SVG namespace URI is a name, not a fetch).
    let fetched = html.replace("http://www.w3.org/2000/svg", "");
    for outside in ["http://", "https://", "<link", " src="] {
        assert!(!fetched.contains(outside), "self-contained: found {outside}");
    }

    // The DOM after the page's script ran: the verdict, and a chart drawn with its failure marker.
    let dom = chromium(&dir, &["--dump-dom", "--window-size=1200,900"], &page);
    let dom = String::from_utf8_lossy(&dom.stdout);
    assert!(dom.contains("long-request") && dom.contains("--max-model-len"), "the verdict and its fix");
    assert!(dom.contains("<path") && dom.contains("class=\"failure\""), "a chart with the failure marker");
    assert!(dom.contains("capacity 80.0 GiB"));
    // Under the chart, the service's phases as bands and its requests in flight; the marker
    // says the verdict.
    assert!(dom.contains("class=\"band\"") && dom.contains("class=\"in-flight\""), "phase bands and the in-flight lane");
    for phase in ["load", "prefill", "decode", "idle"] {
        assert!(dom.contains(&format!("<title>{phase}</title>")), "a band of {phase}");
    }
    assert!(dom.contains("): long-request</text>"), "the failure marker with its verdict");

    let shot = dir.join("report.png");
    let logged =
        chromium(&dir, &["--enable-logging=stderr", "--v=0", "--window-size=1200,900", &format!("--screenshot={}", shot.display())], &page);
    let log = String::from_utf8_lossy(&logged.stderr);
    let console: Vec<&str> = log.lines().filter(|l| l.contains(":CONSOLE")).collect();
    assert!(console.is_empty(), "console messages: {console:?}");
    assert!(std::fs::metadata(&shot).map(|m| m.len() > 10_000).unwrap_or(false), "a screenshot was taken");
    if let Ok(keep) = std::env::var("GPUTRACE_KEEP_SCREENSHOT") {
        std::fs::copy(&shot, keep).unwrap();
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// With several GPUs the page has a chart per GPU and opens on the one the verdict is about, with
/// that GPU's capacity; a GPU table lists them all.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn the_html_report_of_a_tensor_parallel_failure_opens_on_the_failing_gpu() {
    let _root = as_root();
    let Some((dir, page)) = page_of("tensor-parallel") else { return };
    let dom = chromium(&dir, &["--dump-dom", "--window-size=1200,900"], &page);
    let dom = String::from_utf8_lossy(&dom.stdout);
    for gpu in ["all GPUs", "GPU 0", "GPU 3"] {
        assert!(dom.contains(&format!(">{gpu}</button>")), "a button for {gpu}");
    }
    assert!(dom.contains("class=\"on\">GPU 3</button>"), "GPU 3 shown first");
    assert!(dom.contains("GPU 3 capacity 48.0 GiB"), "the failing GPU's own capacity line");
    assert!(dom.contains("class=\"failure\""), "its failure marker");
    assert!(dom.contains("<h2>GPUs</h2>"));
    std::fs::remove_dir_all(&dir).ok();
}

/// On unified memory (the host-oom scenario) the host's available memory is drawn over the chart:
/// it is the GPU's too; the OOM kill's marker says host-oom.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn the_html_report_on_unified_memory_shows_the_hosts_available_memory() {
    let _root = as_root();
    let Some((dir, page)) = page_of("host-oom") else { return };
    let dom = chromium(&dir, &["--dump-dom", "--window-size=1200,900"], &page);
    let dom = String::from_utf8_lossy(&dom.stdout);
    assert!(dom.contains("class=\"host\"") && dom.contains("host memory available"), "the host's available memory");
    assert!(dom.contains(": host-oom</text>"), "the OOM kill's marker with its verdict");
    std::fs::remove_dir_all(&dir).ok();
}

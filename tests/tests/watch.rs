//! `gputrace watch` on the fake GPU, beside `gputrace record` of the same run: the dump a failure
//! triggers, with a window far shorter than the run, gives the report the whole recording gives.

mod common;

use std::path::Path;
use std::process::Command;

use common::{as_root, gputrace_bin};
use gputrace::event::Event;
use gputrace::trace::Reader;
use serde_json::Value;

fn report(trace: &Path) -> Value {
    let out = Command::new(gputrace_bin()).args(["report", "--json"]).arg(trace).output().unwrap();
    assert!(out.status.success(), "report {}: {}", trace.display(), String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The label pairs of a sample's selector as the exposition format writes them (`\"`, `\\` and
/// `\n` escaped).
fn labels_of(selector: &str) -> Vec<(String, String)> {
    let inside = selector.split_once('{').map_or("", |(_, rest)| rest.trim_end_matches('}'));
    let mut labels = Vec::new();
    let mut chars = inside.chars().peekable();
    while chars.peek().is_some() {
        let name: String = chars.by_ref().take_while(|&c| c != '=').collect();
        assert_eq!(chars.next(), Some('"'), "{selector}");
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => value.push(match chars.next() {
                    Some('n') => '\n',
                    Some(other) => other,
                    None => break,
                }),
                '"' => break,
                c => value.push(c),
            }
        }
        labels.push((name.trim_start_matches(',').to_string(), value));
        if chars.peek() == Some(&',') {
            chars.next();
        }
    }
    labels
}

/// `promtool test rules` on the deploy/ rules with one served sample held for ten minutes, as
/// scraped from node1: GPUServerLimitAboveHeadroom is quiet at 4 minutes and fires at 5 with the
/// series' labels and its text.
fn limit_alert_fires_on(sample: &str, dir: &Path) {
    let labels = labels_of(sample.rsplit_once(' ').unwrap().0);
    let label = |name: &str| labels.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()).unwrap_or_else(|| panic!("{name} in {sample}"));
    let value = sample.rsplit_once(' ').unwrap().1;
    let summary = format!("`{}` on node1: {} is {value} past what memory fits ({})", label("service"), label("limit"), label("bounds"));
    let description = "In requests at once for concurrency, in prompt tokens for context and batch-tokens: a burst that large or a prompt that long fails with CUDA out of memory. /report's headroom gives the value to set.";
    alert_fires_on(sample, dir, "GPUServerLimitAboveHeadroom", ("4m", "5m"), &summary, description);
}

/// `promtool test rules` on the deploy/ rules with one served sample held for ten minutes, as
/// scraped from node1: `alert` is quiet at `quiet` and fires at `fires` with the series' labels
/// and the text given.
fn alert_fires_on(sample: &str, dir: &Path, alert: &str, (quiet, fires): (&str, &str), summary: &str, description: &str) {
    let (selector, value) = sample.rsplit_once(' ').unwrap();
    let mut labels = labels_of(selector);
    labels.extend([("instance", "node1"), ("job", "gputrace"), ("severity", "warning")].map(|(n, v)| (n.to_string(), v.to_string())));
    let json = |v: &str| serde_json::to_string(v).unwrap();
    let exp_labels: Vec<String> = labels.iter().map(|(n, v)| format!("{n}: {}", json(v))).collect();
    let series = format!("{},instance=\"node1\",job=\"gputrace\"}}", selector.strip_suffix('}').unwrap()).replace('\'', "''");
    let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/prometheus/gputrace-rules.yaml");
    let test = format!(
        "rule_files: [{}]\nevaluation_interval: 30s\ntests:\n  - interval: 30s\n    input_series:\n      - series: '{series}'\n        values: '{value}x20'\n    alert_rule_test:\n      - eval_time: {quiet}\n        alertname: {alert}\n        exp_alerts: []\n      - eval_time: {fires}\n        alertname: {alert}\n        exp_alerts:\n          - exp_labels: {{{}}}\n            exp_annotations: {{summary: {}, description: {}}}\n",
        json(&rules.to_string_lossy()),
        exp_labels.join(", "),
        json(summary),
        json(description)
    );
    let path = dir.join(format!("{alert}.test.yaml"));
    std::fs::write(&path, &test).unwrap();
    let out = Command::new("promtool")
        .args(["test", "rules"])
        .arg(&path)
        .output()
        .expect("promtool (Debian's prometheus, which `sudo cargo xtask test` installs)");
    assert!(out.status.success(), "{test}\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

/// The check above on a sample written by hand, with a command line that needs escaping.
#[test]
#[ignore = "needs promtool, which `sudo cargo xtask test` installs (Debian's prometheus)"]
fn a_served_limit_sample_fires_the_alert() {
    let dir = std::env::temp_dir().join(format!("gputrace-limit-alert-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let served =
        r#"gputrace_limit_exceeds_headroom{service="vllm serve \"m\" --port 8000",limit="--max-num-seqs 256",bounds="concurrency"} 239"#;
    assert_eq!(labels_of(served.rsplit_once(' ').unwrap().0)[0], ("service".to_string(), "vllm serve \"m\" --port 8000".to_string()));
    limit_alert_fires_on(served, &dir);
    std::fs::remove_dir_all(&dir).ok();
}

/// The dump's report is beside it, its verdict block reads as the recording's, and against its
/// snapshot.
fn block_reads_as_the_recordings(whole: &Value, window: &Value, dump: &Path, name: &str) {
    assert_eq!(window["block"]["headline"], whole["block"]["headline"], "{name}");
    let dump_text = std::fs::read_to_string(dump.with_extension("report.txt")).unwrap_or_else(|e| panic!("its report is beside it: {e}"));
    common::matches_snapshot(&dump_text, &format!("watch-vllm-{name}-dump"), name);
}

fn watched(name: &str) {
    let _root = as_root();
    let dir = std::env::temp_dir().join(format!("gputrace-watch-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dumps = dir.join("dumps");
    let out = Command::new(env!("CARGO_BIN_EXE_fakegpu"))
        .args(["scenario", name, "--server", "vllm", "--nvml", "discrete", "--dir"])
        .arg(&dir)
        .arg("--gputrace")
        .arg(gputrace_bin())
        .env("GPUTRACE_WATCH_DUMPS", &dumps)
        .output()
        .unwrap();
    let log = std::fs::read_to_string(dir.join("watch.log")).unwrap_or_default();
    assert!(out.status.success(), "{name}: {}\n{log}", String::from_utf8_lossy(&out.stderr));
    let traces: Vec<_> =
        std::fs::read_dir(&dumps).unwrap().flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "trace")).collect();
    let named = |what: &str| traces.iter().filter(|t| t.file_name().unwrap().to_string_lossy().contains(what)).collect::<Vec<_>>();
    // One for the failure (the server's exit joined it or came too soon), one asked for by
    // `gputrace dump` and finished by SIGTERM.
    assert_eq!(traces.len(), 2, "{traces:?}\n{log}");
    let (failed, asked) = (named("-failed-allocation-uid0."), named("-manual."));
    assert_eq!((failed.len(), asked.len()), (1, 1), "{traces:?}");
    let dump = failed[0];
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(dump).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    assert!(log.contains("gputrace: dump ") && log.contains("OOM ") && log.contains("  --> GPU "), "one line says where and what: {log}");

    let (whole, window) = (report(&dir.join("run.trace")), report(dump));
    // The window (200 ms) is a fraction of the run: the load before it is in the dump only
    // through its snapshot (and, for what a server kept, the watch's history in its header).
    let span = |r: &Value| r["duration_ns"].as_f64().unwrap_or(0.0) / 1e9;
    assert!(span(&whole) > 0.4, "the run is longer than the window: {} s", span(&whole));
    let (w, d) = (&whole["diagnosis"], &window["diagnosis"]);
    assert_ne!(w["category"], "none");
    block_reads_as_the_recordings(&whole, &window, dump, name);
    for field in ["category", "symptom", "gpu", "fix"] {
        assert_eq!(d[field], w[field], "{name}: the dump's {field} is the recording's\nwhole: {w:#}\ndump: {d:#}");
    }
    // The same evidence, but the times of what was kept: those are since each trace's start.
    let timeless = |e: &Value| {
        let mut fields = e["fields"].clone();
        if let Some(kept) = fields.get_mut("kept").and_then(Value::as_object_mut) {
            for at in ["ready_ts", "now_ts", "began_ts"] {
                kept.remove(at);
            }
            kept["allocations"]["first"] = Value::Null;
        }
        fields
    };
    assert_eq!(
        timeless(&d["evidence"]),
        timeless(&w["evidence"]),
        "{name}: the dump's evidence is the recording's\nwhole: {w:#}\ndump: {d:#}"
    );
    if name != "kept-by-service" {
        assert_eq!(d["evidence"], w["evidence"], "{name}");
    }
    // The watch sees `gputrace record` as the server's parent; a wrapper, it names no service.
    assert_eq!(d["service"], w["service"], "{name}");
    // The asked-for dump holds the whole window's state too: the same failure's aftermath.
    assert_eq!(report(asked[0])["loss"]["damaged_lines"], 0);

    // What the watch served while it ran.
    let served = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
    assert!(served("healthz.txt").starts_with("HTTP/1.1 200"), "{}", served("healthz.txt"));
    let metrics = served("metrics.txt");
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {metrics}"))
    };
    assert_eq!(value("gputrace_allocation_failures_total"), 1.0, "the one refusal");
    assert_eq!(value("gputrace_dumps_total"), 1.0, "the failure's dump was written before the scrape");
    assert!(
        metrics.contains("gputrace_diagnoses_total{category=\"")
            && metrics.contains(&format!("category=\"{}\"", w["category"].as_str().unwrap()))
    );
    assert!(value("gputrace_allocations_total") > 10.0 && value("process_resident_memory_bytes") > 0.0);
    // Everything had exited by the scrape: no live series, and no argument value anywhere (the
    // labels of live processes are held to that in watch.rs's own tests).
    assert!(metrics.contains("# TYPE gputrace_live_bytes gauge") && !metrics.contains("--truth /tmp"), "{metrics}");
    // /report is for root and the user who started the watch: this test is root.
    assert!(served("report.json").starts_with("HTTP/1.1 200"));
    // Before the burst, after the warm-up: the warning that the server's own limit lets in more
    // requests than memory takes, with the headroom it is computed from.
    if name == "concurrent-load" {
        let before = served("metrics-before.txt");
        let sample = |prefix: &str| -> f64 {
            let line = before.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix} before the burst:\n{before}"));
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        let more = sample("gputrace_headroom_requests{");
        assert!(more >= 1.0, "the warm-up's request fits again: {more}");
        let over = sample("gputrace_limit_exceeds_headroom{");
        assert!(before.contains("limit=\"--max-num-seqs 256\"") && over > 200.0, "256 allowed, 17 fit: {over}\n{before}");
        // Prometheus, given that series as scraped before the burst, fires the limit's alert
        // once it has held for its `for`.
        let served = before.lines().find(|l| l.starts_with("gputrace_limit_exceeds_headroom{")).unwrap();
        limit_alert_fires_on(served, &dir);
        let warned: Vec<&str> = log.lines().filter(|l| l.starts_with("gputrace: warning: ")).collect();
        assert!(
            warned.len() == 1
                && warned[0].contains("`--max-num-seqs 256` lets 256 run at once; memory fits 17 of the largest served: cap at 17"),
            "said once in the log: {log}"
        );
        let at = |what: &str| log.find(what).unwrap_or(usize::MAX);
        assert!(at("gputrace: warning: ") < at("-failed-allocation-uid0.trace"), "said before the burst failed: {log}");
    }
    if name == "kept-by-service" {
        kept_forecast_before_the_failure(&served("metrics-before.txt"), &log, &dir);
    } else {
        // No false alarm: a server that gives back what its requests used has no forecast.
        let before = served("metrics-before.txt");
        assert!(before.contains("gputrace_kept_bytes_per_request{") && !before.contains("gputrace_requests_until_full{"), "{before}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// After the warm-up's six requests, each keeping an entry: what one keeps, and the requests
/// until full within one of what the server then served before it failed; the alert fires on
/// that series; the log said it before the failure's dump.
fn kept_forecast_before_the_failure(before: &str, log: &str, dir: &Path) {
    let line =
        |prefix: &str| before.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix} after the warm-up:\n{before}"));
    let value = |prefix: &str| -> f64 { line(prefix).rsplit(' ').next().unwrap().parse().unwrap() };
    let each = fakegpu::scenario::KEPT_MIB_VLLM as f64 * 1048576.0;
    let kept = value("gputrace_kept_bytes_per_request{");
    assert!((kept - each).abs() <= each / 10.0, "{kept} a request, the fake keeps {each}");
    let workload: Vec<Value> = fakegpu::truth::read_lines(&dir.join("workload.jsonl")).unwrap();
    let served = workload.iter().filter(|w| w["event"] == "response" && w["status"] == "HTTP/1.1 200 OK").count() as f64;
    let truth = served - fakegpu::scenario::KEPT_WARMUP as f64;
    let until = value("gputrace_requests_until_full{");
    assert!((until - truth).abs() <= 1.0, "{until} requests until full after the warm-up; {truth} were served before one failed");
    assert!(value("gputrace_seconds_until_full{") > 0.0);
    let sample = line("gputrace_requests_until_full{");
    let labels = labels_of(sample.rsplit_once(' ').unwrap().0);
    let label = |name: &str| labels.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()).unwrap();
    let summary = format!("`{}` on node1 GPU {} keeps GPU memory request after request and runs out soon", label("service"), label("gpu"));
    let description = "At the rate it keeps memory (gputrace_kept_bytes_per_request), fewer than 100 more requests of the largest size it served fit, or under an hour at its recent request rate; then an ordinary request fails with CUDA out of memory. A cache with no bound or a leak in the server: bound it or fix it (a restart only buys time). /report's headroom has the figures.";
    alert_fires_on(sample, dir, "GPUMemoryKeptRunsOut", ("90s", "2m30s"), &summary, description);
    let warned = log
        .lines()
        .position(|l| l.starts_with("gputrace: warning: `") && l.contains(" keeps ") && l.contains(" a request and gives none back"));
    let dumped = log.lines().position(|l| l.contains("-failed-allocation-uid0.trace"));
    assert!(warned.is_some() && warned < dumped, "said in the log before the failure: {log}");
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_dump_of_a_long_request_reports_what_the_recording_does() {
    watched("long-request");
}

/// A server that keeps memory per request, under a watch with a 200 ms window over seconds of
/// requests: the dump names kept-by-service with the growth since it was ready, as the recording
/// does; before it failed, the forecast and its alert.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_dump_of_memory_a_server_keeps_reports_what_the_recording_does() {
    watched("kept-by-service");
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_dump_of_a_concurrent_load_reports_what_the_recording_does() {
    watched("concurrent-load");
}

/// `watch --pid` follows that process alone: its refusal is dumped, another process's on the same
/// GPU is not, and the watch ends, its dump written, when the process is gone.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_watch_of_one_pid_dumps_its_failure_only() {
    let _root = as_root();
    let dir = std::env::temp_dir().join(format!("gputrace-watch-pid-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dumps = dir.join("dumps");
    // Both workloads wait a second (the watch attaches meanwhile), then ask for more than the card.
    let script = r#"W="$1"; G="$2"; D="$3"
        sh -c 'sleep 1; exec "$0" oom --bytes 100GiB' "$W" & watched=$!
        sh -c 'sleep 1; exec "$0" oom --bytes 200GiB' "$W" &
        "$G" watch --pid $watched --dump-dir "$D" --listen off --aftermath 200ms --min-interval 1s 2> "$D.log"
        status=$?; wait; exit $status"#;
    let out = Command::new(env!("CARGO_BIN_EXE_fakegpu"))
        .args(["run", "--video", "80GiB", "--", "sh", "-c", script, "sh", env!("CARGO_BIN_EXE_fake-workload")])
        .arg(gputrace_bin())
        .arg(&dumps)
        .output()
        .unwrap();
    let log = std::fs::read_to_string(dumps.with_extension("log")).unwrap_or_default();
    assert!(out.status.success(), "the watch ends cleanly with its process: {}\n{log}", String::from_utf8_lossy(&out.stderr));
    assert!(log.contains("gputrace: watching pid ") && log.contains("and its children"), "{log}");
    let traces: Vec<_> =
        std::fs::read_dir(&dumps).unwrap().flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "trace")).collect();
    assert_eq!(traces.len(), 1, "one dump, for the watched process's failure: {traces:?}\n{log}");
    assert!(traces[0].to_string_lossy().contains("-failed-allocation-uid0."), "{traces:?}");
    let dumped = report(&traces[0]);
    let refused: u64 = dumped["processes"].as_array().unwrap().iter().map(|p| p["failed_allocations"].as_u64().unwrap_or(0)).sum();
    assert_eq!(refused, 1, "only the watched process's refusal is in it: {dumped:#}");
    let text = Command::new(gputrace_bin()).arg("report").arg(&traces[0]).output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("100.0 GiB") && !text.contains("200.0 GiB"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Where this machine's cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified
/// on hybrid hosts).
fn cgroup2_root() -> std::path::PathBuf {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let line = mounts.lines().find(|l| l.split(" - ").nth(1).is_some_and(|fs| fs.starts_with("cgroup2 "))).expect("a cgroup2 mount");
    line.split_whitespace().nth(4).unwrap().into()
}

/// Under `watch --cgroup`, the OOM killer's victim is judged by its own cgroup, not by that of
/// the process whose allocation woke the killer: a process that joined the watched cgroup is
/// killed for an outsider's allocation (both under one memory limit), and its kill is dumped.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_watched_cgroups_process_killed_for_an_outsiders_allocation_is_dumped() {
    let _root = as_root();
    let dir = std::env::temp_dir().join(format!("gputrace-watch-oom-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dumps = dir.join("dumps");
    // One memory limit over both processes; only the victim is in the watched cgroup (v2). On a
    // hybrid host the limit is v1's memory controller, elsewhere a v2 parent of two siblings.
    let name = format!("gputrace-test-oom-{}", std::process::id());
    let v1 = std::path::Path::new("/sys/fs/cgroup/memory").join(&name);
    let (watched, limits, victim_joins, outsider_joins) = if std::fs::create_dir(&v1).is_ok() {
        std::fs::write(v1.join("memory.limit_in_bytes"), (256u64 << 20).to_string()).unwrap();
        let _ = std::fs::write(v1.join("memory.swappiness"), "0");
        let watched = cgroup2_root().join(&name);
        std::fs::create_dir_all(&watched).unwrap();
        (watched.clone(), vec![watched.clone(), v1.clone()], vec![watched, v1.clone()], vec![v1])
    } else {
        let limit = cgroup2_root().join(&name);
        for leaf in ["watched", "other"] {
            std::fs::create_dir_all(limit.join(leaf)).unwrap();
        }
        std::fs::write(limit.join("memory.max"), (256u64 << 20).to_string()).expect("memory.max (the memory controller on cgroup v2)");
        let _ = std::fs::write(limit.join("memory.swap.max"), "0");
        let (w, o) = (limit.join("watched"), limit.join("other"));
        (w.clone(), vec![w.clone(), o.clone(), limit], vec![w], vec![o])
    };
    let procs =
        |dirs: &[std::path::PathBuf]| dirs.iter().map(|d| d.join("cgroup.procs").display().to_string()).collect::<Vec<_>>().join(" ");
    let script = r#"W="$1"; G="$2"; D="$3"; CG="$4"; VJ="$5"; OJ="$6"
        "$G" watch --cgroup "$CG" --dump-dir "$D" --listen off --aftermath 200ms --min-interval 1s 2> "$D.log" & g=$!
        until grep -q 'gputrace: tracing' "$D.log" 2>/dev/null; do kill -0 $g 2>/dev/null || exit 1; sleep 0.05; done
        sh -c 'for f in $1; do echo $$ > $f; done; echo 1000 > /proc/self/oom_score_adj; exec "$0" hold --host-mib 160 --ms 20000' "$W" "$VJ" & victim=$!
        sleep 1
        sh -c 'for f in $1; do echo $$ > $f; done; exec "$0" hold --host-mib 160 --ms 100' "$W" "$OJ" || true
        wait $victim; echo "victim $victim exited $?" > "$D.victim"
        sleep 1; kill -TERM $g; wait $g"#;
    let out = Command::new(env!("CARGO_BIN_EXE_fakegpu"))
        .args(["run", "--video", "80GiB", "--", "sh", "-c", script, "sh", env!("CARGO_BIN_EXE_fake-workload")])
        .arg(gputrace_bin())
        .arg(&dumps)
        .arg(&watched)
        .arg(procs(&victim_joins))
        .arg(procs(&outsider_joins))
        .output()
        .unwrap();
    for dir in limits {
        let _ = std::fs::remove_dir(dir);
    }
    let log = std::fs::read_to_string(dumps.with_extension("log")).unwrap_or_default();
    assert!(out.status.success(), "the watch stops cleanly on SIGTERM: {}\n{log}", String::from_utf8_lossy(&out.stderr));
    let victim = std::fs::read_to_string(dumps.with_extension("victim")).unwrap_or_default();
    let victim = victim.trim().strip_prefix("victim ").unwrap_or_else(|| panic!("no victim's line: {log}"));
    assert!(victim.ends_with("exited 137"), "the OOM killer chose the watched process (SIGKILL): {log}");
    let traces: Vec<_> =
        std::fs::read_dir(&dumps).unwrap().flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "trace")).collect();
    assert_eq!(traces.len(), 1, "one dump, for the kill: {traces:?}\n{log}");
    let (_, records, _) = Reader::read_all(&traces[0]).unwrap();
    let pid: u32 = victim.split_whitespace().next().unwrap().parse().unwrap();
    assert!(records.iter().any(|r| r.pid == pid && matches!(r.event, Event::OomKill)), "the victim's kill is recorded: {log}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `watch --cgroup` follows the processes of one cgroup, including one that joins it after the
/// watch began (as `docker exec` does): its refusal is dumped, an outsider's is not.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_watch_of_one_cgroup_dumps_its_processes_failures_only() {
    let _root = as_root();
    let dir = std::env::temp_dir().join(format!("gputrace-watch-cgroup-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dumps = dir.join("dumps");
    let cgroup = cgroup2_root().join(format!("gputrace-test-{}", std::process::id()));
    std::fs::create_dir_all(&cgroup).unwrap();
    let script = r#"W="$1"; G="$2"; D="$3"; CG="$4"
        "$G" watch --cgroup "$CG" --dump-dir "$D" --listen off --aftermath 200ms --min-interval 1s 2> "$D.log" & g=$!
        until grep -q 'gputrace: tracing' "$D.log" 2>/dev/null; do kill -0 $g 2>/dev/null || exit 1; sleep 0.05; done
        sh -c 'echo $$ > "$1/cgroup.procs"; exec "$0" oom --bytes 100GiB' "$W" "$CG" & inside=$!
        "$W" oom --bytes 200GiB
        wait $inside
        sleep 1; kill -TERM $g; wait $g"#;
    let out = Command::new(env!("CARGO_BIN_EXE_fakegpu"))
        .args(["run", "--video", "80GiB", "--", "sh", "-c", script, "sh", env!("CARGO_BIN_EXE_fake-workload")])
        .arg(gputrace_bin())
        .arg(&dumps)
        .arg(&cgroup)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir(&cgroup);
    let log = std::fs::read_to_string(dumps.with_extension("log")).unwrap_or_default();
    assert!(out.status.success(), "the watch stops cleanly on SIGTERM: {}\n{log}", String::from_utf8_lossy(&out.stderr));
    assert!(log.contains("gputrace: watching the processes of cgroup "), "{log}");
    let traces: Vec<_> =
        std::fs::read_dir(&dumps).unwrap().flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "trace")).collect();
    assert_eq!(traces.len(), 1, "one dump, for the cgroup's process: {traces:?}\n{log}");
    let text = Command::new(gputrace_bin()).arg("report").arg(&traces[0]).output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("100.0 GiB") && !text.contains("200.0 GiB"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

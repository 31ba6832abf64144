//! What `deploy/` ships is checked by the tools that will read it.

use std::process::Command;

/// Each capability `gputrace watch` keeps once attached, by the name systemd gives it.
const KEPT: [(u32, &str); 7] = [
    (2, "CAP_DAC_READ_SEARCH"),
    (5, "CAP_KILL"),
    (10, "CAP_NET_BIND_SERVICE"),
    (19, "CAP_SYS_PTRACE"),
    (21, "CAP_SYS_ADMIN"),
    (38, "CAP_PERFMON"),
    (39, "CAP_BPF"),
];

fn unit() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/gputrace-watch.service")).unwrap()
}

/// `systemd-analyze verify` accepts the unit (with ExecStart pointing at a program that exists
/// here: it checks that too).
#[test]
fn the_systemd_unit_verifies() {
    let dir = std::env::temp_dir().join(format!("gputrace-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gputrace-watch.service");
    std::fs::write(&path, unit().replace("/usr/bin/gputrace", std::env::current_exe().unwrap().to_str().unwrap())).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("systemd-analyze (Debian's systemd package) checks the unit: install it");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stderr.trim().is_empty(), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The unit's bounding set holds every capability gputrace keeps (it could not keep what the unit
/// withholds), and nothing that changes identity or ownership.
#[test]
fn the_unit_grants_what_gputrace_keeps_and_no_more() {
    let unit = unit();
    let set: Vec<&str> =
        unit.lines().find_map(|l| l.strip_prefix("CapabilityBoundingSet=")).expect("a bounding set").split_whitespace().collect();
    // On kernels with CAP_BPF (highest capability 40) and before it (37); the unit listens on
    // port 931, below 1024, so no ordinary user can take it first.
    assert!(unit.contains("--listen 127.0.0.1:931"));
    let needs = gputrace::privileges::Needs { bind_low_port: true, ..Default::default() };
    let kept = gputrace::privileges::kept(40, needs) | gputrace::privileges::kept(37, needs);
    for (cap, name) in KEPT {
        assert!(kept & 1 << cap != 0, "{name} is kept by gputrace");
        assert!(set.contains(&name), "the unit withholds {name}, which gputrace uses");
    }
    for name in ["CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_NET_ADMIN", "CAP_SYS_MODULE"] {
        assert!(!set.contains(&name), "the unit grants {name}");
    }
    assert!(unit.contains("NoNewPrivileges=yes") && unit.contains("ProtectSystem=strict"));
}

fn deploy(path: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(path)
}

/// The metric names gputrace serves: the families of an exposition of a small live state.
fn served_metrics() -> Vec<String> {
    use gputrace::event::{Alloc, Device, Event, Record, Seen};
    let alloc = Alloc::video(1, 1, 2, 1 << 30);
    let events = [
        Event::Process { ppid: 1, seen: Seen::Running, command: vec!["vllm".into()] },
        Event::Open { fd: 3, file: 1, device: Device::Ctl, cloexec: false },
        Event::Object { fd: 3, client: 1, parent: 1, object: 1, class: 0x41, status: 0, gpu: Some(0) },
        Event::Alloc(alloc),
    ];
    let model = gputrace::model::Model::from_records(&events.map(|event| Record::new(1, 7, 7, event)));
    let header = gputrace::trace::Header::default();
    let report = gputrace::report::Report::new(&header, &model, String::new(), 4, Default::default(), u64::MAX);
    let counters = gputrace::flight::Counters::default();
    let diagnoses = [("none".to_string(), 1)].into_iter().collect();
    let figures =
        gputrace::metrics::Figures { report: &report, model: &model, counters: &counters, window_bytes: 0, diagnoses: &diagnoses, now: 2 };
    let text = gputrace::metrics::exposition(&figures);
    text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).map(|l| l.split_whitespace().next().unwrap().to_string()).collect()
}

/// The metric names a PromQL expression uses (every identifier that names one of ours, or `up`).
fn metrics_in(expr: &str) -> Vec<String> {
    let words = expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'));
    words.filter(|w| w.starts_with("gputrace_") || w.starts_with("process_")).map(str::to_string).collect()
}

/// Every query of the Grafana dashboard and every alert rule names metrics gputrace serves.
#[test]
fn the_dashboard_and_the_alerts_use_only_metrics_that_exist() {
    let served = served_metrics();
    assert!(served.len() > 15, "{served:?}");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(deploy("grafana/gputrace-dashboard.json")).unwrap()).unwrap();
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter().map(|t| t["expr"].as_str().unwrap().to_string()))
        .collect();
    let rules = std::fs::read_to_string(deploy("prometheus/gputrace-rules.yaml")).unwrap();
    let rule_exprs = rules.lines().filter_map(|l| l.trim().strip_prefix("expr:")).map(str::to_string);
    let mut used = 0;
    for expr in exprs.into_iter().chain(rule_exprs) {
        for metric in metrics_in(&expr) {
            assert!(served.contains(&metric), "`{expr}` uses {metric}, which gputrace does not serve ({served:?})");
            used += 1;
        }
    }
    assert!(used > 15, "the dashboard and rules query our metrics ({used})");
}

/// `promtool check rules` accepts the alert rules, and their unit tests pass: the warnings before
/// an OOM fire on gputrace's series once held for their `for`, not before, with their text.
#[test]
#[ignore = "needs promtool, which `sudo cargo xtask test` installs (Debian's prometheus)"]
fn promtool_accepts_the_alert_rules() {
    for (what, file) in [("check", "prometheus/gputrace-rules.yaml"), ("test", "prometheus/gputrace-rules.test.yaml")] {
        let out = Command::new("promtool").args([what, "rules"]).arg(deploy(file)).output().expect("promtool");
        assert!(out.status.success(), "{what}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
}

/// The DaemonSet and its namespace validate, strictly, against Kubernetes' own schemas, offline.
#[test]
#[ignore = "needs kubernetes-validate, which `sudo cargo xtask test` installs (PyPI)"]
fn the_kubernetes_manifests_validate() {
    let out = Command::new("python3")
        .args(["-m", "kubernetes_validate", "--strict"])
        .arg(deploy("kubernetes/daemonset.yaml"))
        .output()
        .expect("python3 with kubernetes-validate");
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && said.matches("passed").count() == 2, "{said}");
}

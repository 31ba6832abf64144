//! Headroom predicted from a clean run, then tried on the fake GPU (root; in CI): the
//! concurrency the report says fits does fit and two past it fails (the measured breaking point
//! within one request of the predicted one), and the largest request it says fits alone is
//! within 10% of the size that breaks the server. Both server families.

mod common;

use common::{as_root, scenario, summary};
use fakegpu::serve::Completion;
use serde_json::Value;

/// The warm-up every run starts with (prompt tokens, one after another): the prediction is made
/// after it, each try made after it.
const WARMUP: &str = "1024,2048";

/// A clean run of `server` with `flags`, loaded with `load`: the report.
fn probe(server: &str, flags: &str, load: &str) -> Value {
    summary(&scenario("probe", server, &[("GPUTRACE_SERVER_ARGS", flags), ("GPUTRACE_LOAD", load)]))
}

fn verdict(report: &Value) -> &str {
    report["diagnosis"]["category"].as_str().unwrap_or_default()
}

/// Prompt tokens of the largest request of the fake load generator that receives no more than
/// `bytes` (its request line, headers and body, as the server reads them).
fn tokens_within(bytes: u64) -> u64 {
    let received = |tokens: u64| {
        let body = Completion { prompt_tokens: tokens, max_tokens: 8 }.body().len();
        let head =
            format!("POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {body}\r\n\r\n");
        (head.len() + body) as u64
    };
    let (mut low, mut high) = (1u64, bytes);
    while low < high {
        let mid = (low + high).div_ceil(2);
        if received(mid) <= bytes {
            low = mid;
        } else {
            high = mid - 1;
        }
    }
    low
}

fn predictions_hold(server: &str, limit: &str) {
    let _root = as_root();
    // llama's context admits the largest tries (the fake refuses a prompt past it with a 400).
    let flags = if server == "llama" { format!("--ctx 24000 {limit} --kv-unified") } else { limit.to_string() };
    let base = probe(server, &flags, &format!("--sequential {WARMUP}"));
    assert_eq!(verdict(&base), "none", "{server}: the warm-up alone fails nothing: {:#}", base["diagnosis"]);
    let h = &base["headroom"][0];
    assert!(h["measured_alone"].as_bool().unwrap(), "{server}: {h:#}");
    // The server exited at the end: the figures while it served, at the tightest moment.
    assert!(h["now"].is_null(), "{server}: no 'now' for a server that has gone: {h:#}");
    let at = &h["tightest"];
    let (fits, largest) = (at["fit_at_once"].as_u64().unwrap(), at["largest_fitting_request_bytes"].as_u64().unwrap());
    assert!(fits >= 3, "{server}: {h:#}");
    // Its own limit lets in more than fits: said, with the cap to set.
    let exceeded = &h["limits_exceeded"][0];
    let (setting, value) = limit.split_once(' ').unwrap();
    assert_eq!(exceeded["setting"], setting, "{server}: {h:#}");
    assert_eq!(exceeded["value"].as_u64().unwrap(), value.parse::<u64>().unwrap());
    assert_eq!(exceeded["fits"].as_u64().unwrap(), fits);
    // llama's 64 slots share one unified cache: one request may take all of --ctx, which is
    // more than fits alone; the value to set is what fits, less 3%.
    let context = h["limits_exceeded"].as_array().unwrap().iter().find(|l| l["bounds"] == "context");
    if server == "llama" {
        let context = context.unwrap_or_else(|| panic!("{h:#}"));
        let (tokens, cap) = (context["fits"].as_u64().unwrap(), context["cap"].as_u64().unwrap());
        assert_eq!(
            (context["setting"].as_str(), context["value"].as_u64(), context["slots"].as_u64()),
            (Some("--ctx"), Some(24000), Some(1))
        );
        assert!(tokens < 24000 && cap == (tokens as f64 * 0.97) as u64, "{context:#}");
        assert!((tokens * 4).abs_diff(largest) <= largest / 50, "{tokens} tokens fit, {largest} bytes alone: {context:#}");
    } else {
        assert!(context.is_none(), "no context limit given: {h:#}");
    }

    // The largest request seen was the warm-up's 2048-token one: that many at once fit; two
    // more break the server.
    let wave = |n: u64| probe(server, &flags, &format!("--sequential {WARMUP} --concurrent {n}x2048"));
    let at_cap = wave(fits);
    assert_eq!(verdict(&at_cap), "none", "{server}: {fits} at once were predicted to fit: {:#}", at_cap["diagnosis"]);
    let past = wave(fits + 2);
    assert_eq!(verdict(&past), "concurrent-load", "{server}: {} at once were predicted not to fit: {:#}", fits + 2, past["diagnosis"]);

    // The largest request alone: 10% under it fits, 10% over it breaks the server.
    let alone = |bytes: f64| probe(server, &flags, &format!("--sequential {WARMUP},{}", tokens_within(bytes as u64)));
    let under = alone(largest as f64 * 0.9);
    assert_eq!(verdict(&under), "none", "{server}: 90% of {largest} bytes was predicted to fit: {:#}", under["diagnosis"]);
    let over = alone(largest as f64 * 1.1);
    assert_eq!(verdict(&over), "long-request", "{server}: 110% of {largest} bytes was predicted not to fit: {:#}", over["diagnosis"]);
    eprintln!("{server}: predicted {fits} at once and {largest} bytes alone; {fits} and 90% fit, {} and 110% fail", fits + 2);
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn vllm_headroom_predicts_its_breaking_points() {
    predictions_hold("vllm", "--max-num-seqs 256");
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn llama_headroom_predicts_its_breaking_points() {
    predictions_hold("llama", "--parallel 64");
}

/// A LiteLLM proxy in front of the server, its deployment's `max_parallel_requests` past what
/// fits: the headroom names it with the value to set (the server sets no limit of its own), and
/// a concurrent-load failure's fix names the deployment and its config.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_litellm_proxy_in_front_is_checked_and_named() {
    let _root = as_root();
    let dir = scenario("probe", "vllm", &[("GPUTRACE_LOAD", &format!("--sequential {WARMUP}")), ("GPUTRACE_LITELLM", "256")]);
    let (base, proxy) = (summary(&dir), std::fs::read_to_string(dir.join("litellm.pid")).unwrap());
    let config = dir.join("litellm.yaml").display().to_string();
    let h = &base["headroom"][0];
    let fits = h["tightest"]["fit_at_once"].as_u64().unwrap();
    let [limit] = h["limits_exceeded"].as_array().unwrap().as_slice() else { panic!("one limit past what fits: {h:#}") };
    assert_eq!((limit["setting"].as_str(), limit["value"].as_u64()), (Some("LiteLLM max_parallel_requests"), Some(256)), "{h:#}");
    assert_eq!((limit["fits"].as_u64(), limit["cap"].as_u64()), (Some(fits), Some(fits)), "{h:#}");
    assert_eq!(limit["proxies"][0]["pid"].as_u64().unwrap().to_string(), proxy.trim(), "{h:#}");
    assert_eq!(limit["proxies"][0]["config"].as_str(), Some(config.as_str()), "{h:#}");

    // Two deployments to the server, each within what fits, in each of a proxy's 2 workers: 4
    // counts together past it, one limit with each one's share to set.
    let each = fits / 2;
    let env = [
        ("GPUTRACE_LOAD", format!("--sequential {WARMUP}")),
        ("GPUTRACE_LITELLM", format!("{each},{each}")),
        ("GPUTRACE_LITELLM_WORKERS", "2".into()),
    ];
    let dir = scenario("probe", "vllm", &env.iter().map(|(k, v)| (*k, v.as_str())).collect::<Vec<_>>());
    let h = &summary(&dir)["headroom"][0];
    let fits = h["tightest"]["fit_at_once"].as_u64().unwrap();
    let [limit] = h["limits_exceeded"].as_array().unwrap().as_slice() else { panic!("one limit for both: {h:#}") };
    assert_eq!((limit["value"].as_u64(), limit["proxies"].as_array().map(Vec::len)), (Some(4 * each), Some(2)), "{h:#}");
    let out = std::process::Command::new(common::gputrace_bin()).arg("report").arg(dir.join("run.trace")).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(each <= fits && 4 * each > fits, "the scenario's premise: {each} of {fits}");
    let share = (fits / 4).max(1);
    eprintln!("vllm: two deployments of {each} in 2 workers each, against {fits} that fit: set {share} in each");
    eprintln!("{}", text.lines().find(|l| l.contains("LiteLLM")).unwrap_or_default());
    assert!(text.contains(&format!("set `max_parallel_requests: {share}` in each (each worker keeps its own count)")), "{text}");

    let dir = scenario("concurrent-load", "vllm", &[("GPUTRACE_LITELLM", "64")]);
    let failed = summary(&dir);
    assert_eq!(verdict(&failed), "concurrent-load", "{:#}", failed["diagnosis"]);
    let fix = &failed["diagnosis"]["fix"];
    let cap = fix["fields"]["max_concurrency"].as_u64().unwrap();
    let front = &fix["fields"]["litellm_deployments"][0];
    assert_eq!((front["model"].as_str(), front["max_parallel_requests"].as_u64()), (Some("local"), Some(64)), "{fix:#}");
    let text = fix["text"].as_str().unwrap();
    assert!(
        text.contains(&format!("`max_parallel_requests: {cap}` for LiteLLM (pid ")) && text.contains("deployment `local` (now 64"),
        "{text}"
    );
    eprintln!("vllm: LiteLLM's 256 named against {fits} that fit; the concurrent-load fix: {text}");
}

/// Started under wrappers (`timeout 600 nice fake-server ...`, `env X=1 fake-server ...`), a
/// server is named by its own command line, not the wrapper's, and its own limit is checked.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_server_under_wrappers_is_named_by_its_own_command_line() {
    let _root = as_root();
    for wrap in ["timeout 600 nice", "env X=1"] {
        let env = [("GPUTRACE_WRAP", wrap), ("GPUTRACE_SERVER_ARGS", "--max-num-seqs 256"), ("GPUTRACE_LOAD", "--sequential 1024")];
        let report = summary(&scenario("probe", "vllm", &env));
        let h = &report["headroom"][0];
        let name = h["service"].as_str().unwrap_or_default();
        assert!(name.starts_with("fake-server --server vllm") && name.contains("--max-num-seqs 256"), "{wrap}: named {name:?}");
        assert_eq!(h["limits_exceeded"][0]["setting"], "--max-num-seqs", "{wrap}: {h:#}");
    }
}

/// Started by a launcher that stays its parent and whose own command line carries none of the
/// server's flags (a Python script that starts `vllm serve --max-num-seqs 256`): the limit is
/// read from the server that listens and allocates, and flagged past what fits.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn a_launchers_server_has_its_own_limits_checked() {
    let _root = as_root();
    let env = [("GPUTRACE_LAUNCHER", "1"), ("GPUTRACE_SERVER_ARGS", "--max-num-seqs 256"), ("GPUTRACE_LOAD", "--sequential 1024")];
    let report = summary(&scenario("probe", "vllm", &env));
    let h = &report["headroom"][0];
    assert!(h["service"].as_str().unwrap_or_default().contains("launch"), "the service is the launcher's: {h:#}");
    let limit = &h["limits_exceeded"][0];
    assert_eq!((limit["setting"].as_str(), limit["value"].as_u64()), (Some("--max-num-seqs"), Some(256)), "{h:#}");
    assert!(limit["fits"].as_u64().unwrap() < 256, "{h:#}");
}

/// SECURITY.md's share: one user's 40 LiteLLM proxies (uid 60001, started first: the lowest pids)
/// do not hide root's from a whole-host recording (`--all`). Before the shares, the scan stopped
/// at 32 in pid order and root's server lost its limit check; now root's is read, and its
/// `max_parallel_requests` past what fits is named with its pid.
#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn one_users_proxies_do_not_hide_roots() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let _root = as_root();
    let scratch = std::env::temp_dir().join(format!("gputrace-proxy-share-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    std::fs::set_permissions(&scratch, std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = scratch.join("crowd.yaml");
    let yaml = "model_list:\n  - model_name: crowd\n    litellm_params:\n      model: hosted_vllm/x\n      api_base: http://localhost:9/v1\n      max_parallel_requests: 1\n";
    std::fs::write(&config, yaml).unwrap();
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644)).unwrap();
    let crowd: Vec<std::process::Child> = (0..40u16)
        .map(|i| {
            std::process::Command::new(env!("CARGO_BIN_EXE_litellm"))
                .arg("--config")
                .arg(&config)
                .args(["--port", &(21_000 + i).to_string()])
                .uid(60001)
                .gid(60001)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let env = [("GPUTRACE_LOAD", format!("--sequential {WARMUP}")), ("GPUTRACE_LITELLM", "256".into()), ("GPUTRACE_ATTACH", "all".into())];
    let dir = scenario("probe", "vllm", &env.iter().map(|(k, v)| (*k, v.as_str())).collect::<Vec<_>>());
    let running = crowd.iter().filter(|c| std::path::Path::new(&format!("/proc/{}", c.id())).exists()).count();
    for mut c in crowd {
        let _ = c.kill();
        let _ = c.wait();
    }
    std::fs::remove_dir_all(&scratch).ok();
    assert_eq!(running, 40, "the crowd ran through the recording");
    let (base, proxy) = (summary(&dir), std::fs::read_to_string(dir.join("litellm.pid")).unwrap());
    let h = &base["headroom"][0];
    let limit = h["limits_exceeded"].as_array().into_iter().flatten().find(|l| l["setting"] == "LiteLLM max_parallel_requests");
    let limit = limit.unwrap_or_else(|| panic!("root's proxy read and its limit checked: {h:#}"));
    assert_eq!(limit["value"].as_u64(), Some(256), "{h:#}");
    assert_eq!(limit["proxies"][0]["pid"].as_u64().unwrap().to_string(), proxy.trim(), "{h:#}");
    assert_eq!(limit["proxies"][0]["uid"].as_u64(), Some(0), "{h:#}");
}

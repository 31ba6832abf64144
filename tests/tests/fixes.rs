//! The fix closes the loop (root; in CI): for each failing scenario of both server families, on
//! the fake GPU, the setting the verdict's fix names is tried: with it the server no longer
//! fails; one step past it, it does.

mod common;

use std::path::PathBuf;

use common::{as_root, scenario, summary};
use serde_json::Value;

/// Runs a scenario (or the probe) with `env`: the recording's report, and the directory (for a
/// second recording's).
fn run(name: &str, server: &str, env: &[(&str, String)]) -> (Value, PathBuf) {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let dir = scenario(name, server, &env);
    (summary(&dir), dir)
}

fn verdict(report: &Value) -> &str {
    report["diagnosis"]["category"].as_str().unwrap_or_default()
}

fn fix(report: &Value) -> &Value {
    &report["diagnosis"]["fix"]["fields"]
}

fn with_flags(flags: String) -> (&'static str, String) {
    ("GPUTRACE_SERVER_ARGS", flags)
}

/// The cap the fix names (`--max-num-seqs 17`, `-np 5`): the burst at that cap is served; at
/// one more, it fails again.
fn concurrency_cap_closes_the_loop(server: &str) {
    let _root = as_root();
    let (failed, _) = run("concurrent-load", server, &[]);
    assert_eq!(verdict(&failed), "concurrent-load");
    let (cap, flag) = (fix(&failed)["max_concurrency"].as_u64().unwrap(), fix(&failed)["flag"].as_str().unwrap().to_string());
    let setting = flag.split(' ').next().unwrap();
    assert_eq!(flag, format!("{setting} {cap}"), "{server}: one setting to set: {flag}");
    let (capped, _) = run("concurrent-load", server, &[with_flags(flag.clone())]);
    assert_eq!(verdict(&capped), "none", "{server}: with {flag} the burst is served: {:#}", capped["diagnosis"]);
    let (past, _) = run("concurrent-load", server, &[with_flags(format!("{setting} {}", cap + 1))]);
    assert_eq!(verdict(&past), "concurrent-load", "{server}: with {setting} {} it fails: {:#}", cap + 1, past["diagnosis"]);
    eprintln!("{server}: {flag} serves the burst, {setting} {} fails", cap + 1);
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn vllm_concurrency_cap_closes_the_loop() {
    concurrency_cap_closes_the_loop("vllm");
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn llama_concurrency_cap_closes_the_loop() {
    concurrency_cap_closes_the_loop("llama");
}

/// A LiteLLM proxy in front of the server (the stand-in, which lets its deployment's
/// `max_parallel_requests` through at once and queues the rest, as LiteLLM does), its limit
/// past what fits: the value the concurrent-load fix names for it serves the burst through it;
/// one more fails it again.
fn litellm_cap_closes_the_loop(server: &str) {
    let _root = as_root();
    let through = |limit: u64| [("GPUTRACE_LITELLM", limit.to_string())];
    let (failed, _) = run("concurrent-load", server, &through(64));
    assert_eq!(verdict(&failed), "concurrent-load", "{server}: {:#}", failed["diagnosis"]);
    assert_eq!(fix(&failed)["litellm_deployments"][0]["max_parallel_requests"].as_u64(), Some(64), "{:#}", fix(&failed));
    let cap = fix(&failed)["litellm_max_parallel_requests"].as_u64().unwrap();
    let (capped, _) = run("concurrent-load", server, &through(cap));
    assert_eq!(verdict(&capped), "none", "{server}: max_parallel_requests {cap} serves the burst: {:#}", capped["diagnosis"]);
    let (past, _) = run("concurrent-load", server, &through(cap + 1));
    assert_eq!(verdict(&past), "concurrent-load", "{server}: max_parallel_requests {} fails: {:#}", cap + 1, past["diagnosis"]);
    eprintln!("{server}: LiteLLM's max_parallel_requests {cap} serves the burst, {} fails", cap + 1);
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn vllm_litellm_cap_closes_the_loop() {
    litellm_cap_closes_the_loop("vllm");
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn llama_litellm_cap_closes_the_loop() {
    litellm_cap_closes_the_loop("llama");
}

/// The context the fix names (`--max-model-len N`, `-c N`): the long prompt is refused cleanly;
/// a prompt of that length is served; with the context 10% past it, a prompt that long fails.
fn context_closes_the_loop(server: &str) {
    let _root = as_root();
    let (failed, _) = run("long-request", server, &[]);
    assert_eq!(verdict(&failed), "long-request");
    let (tokens, setting) = (fix(&failed)["context_tokens"].as_u64().unwrap(), fix(&failed)["flag"].as_str().unwrap().to_string());
    let (refused, dir) = run("long-request", server, &[with_flags(format!("{setting} {tokens}"))]);
    assert_eq!(verdict(&refused), "none", "{server}: {setting} {tokens}: {:#}", refused["diagnosis"]);
    let load = std::fs::read_to_string(dir.join("load.log")).unwrap();
    assert!(load.contains("400 Bad Request"), "{server}: the long prompt refused: {load}");
    let at_limit = |tokens: u64| {
        let env = [with_flags(format!("{setting} {tokens}")), ("GPUTRACE_LOAD", format!("--sequential 1024,2048,{tokens}"))];
        run("probe", server, &env).0
    };
    let longest = at_limit(tokens);
    assert_eq!(verdict(&longest), "none", "{server}: a prompt of {tokens} tokens is served: {:#}", longest["diagnosis"]);
    let past = tokens + tokens / 10;
    let too_long = at_limit(past);
    assert_eq!(verdict(&too_long), "long-request", "{server}: {setting} {past} lets a prompt fail: {:#}", too_long["diagnosis"]);
    eprintln!("{server}: {setting} {tokens} refuses the long prompt and serves one that long; {setting} {past} fails");
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn vllm_context_closes_the_loop() {
    context_closes_the_loop("vllm");
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn llama_context_closes_the_loop() {
    context_closes_the_loop("llama");
}

/// The model that does not fit, quantized to 8-bit as the fix says (half its size, no less than
/// the fix's estimate): it loads and serves. At FP16, one step past, it is the failure itself.
fn quantizing_closes_the_loop(server: &str) {
    let _root = as_root();
    let (failed, _) = run("does-not-fit-at-load", server, &[]);
    assert_eq!(verdict(&failed), "does-not-fit-at-load");
    let fp16_gib: u64 = if server == "llama" { 30 } else { 96 };
    let at_8bit = fix(&failed)["bytes_8bit"].as_u64().unwrap();
    assert!(at_8bit <= (fp16_gib / 2) << 30, "{server}: the fix's 8-bit figure is at most half the model: {at_8bit}");
    let env = [with_flags(format!("--model-gib {}", fp16_gib / 2)), ("GPUTRACE_LOAD", "--sequential 1024,2048".to_string())];
    let (quantized, _) = run("probe", server, &env);
    assert_eq!(verdict(&quantized), "none", "{server}: at 8-bit it loads and serves: {:#}", quantized["diagnosis"]);
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn vllm_quantizing_closes_the_loop() {
    quantizing_closes_the_loop("vllm");
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn llama_quantizing_closes_the_loop() {
    quantizing_closes_the_loop("llama");
}

/// The holder the fix names stopped as it says: the server starts and serves. Left running, it
/// is the failure itself.
fn stopping_the_holder_closes_the_loop(server: &str) {
    let _root = as_root();
    let (failed, dir) = run("held-by-other-process", server, &[("GPUTRACE_FOLLOW_FIX", "1".into())]);
    assert_eq!(verdict(&failed), "held-by-other-process");
    let after: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("after-fix.json")).unwrap()).unwrap();
    assert_eq!(verdict(&after), "none", "{server}: pid {} stopped, the server serves: {:#}", fix(&failed)["kill"], after["diagnosis"]);
    assert!(after["headroom"][0]["tightest"]["fit_at_once"].as_u64().unwrap() > 0, "{server}: and served: {:#}", after["headroom"]);
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn vllm_stopping_the_holder_closes_the_loop() {
    stopping_the_holder_closes_the_loop("vllm");
}

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn llama_stopping_the_holder_closes_the_loop() {
    stopping_the_holder_closes_the_loop("llama");
}

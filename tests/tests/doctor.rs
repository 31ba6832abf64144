//! `gputrace doctor` on the fake GPU (root): with NVML on a discrete GPU, on unified memory, and
//! with no NVML at all, it finds the stale holder where there is one (an orphaned engine, a forked
//! child keeping a dead server's memory), recommends killing exactly it, names the benign holder
//! as benign, and flags nothing on a clean host.

mod common;

use std::process::Command;

use serde_json::Value;

use common::{as_root, gputrace_bin};

struct Seen {
    doctor: Value,
    rc: i32,
    pids: Value,
}

fn doctor(setup: &str, nvml: &str) -> Seen {
    let dir = std::env::temp_dir().join(format!("gputrace-doctor-{setup}-{nvml}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_fakegpu"))
        .args(["doctor", setup, "--nvml", nvml, "--dir"])
        .arg(&dir)
        .arg("--gputrace")
        .arg(gputrace_bin())
        .output()
        .unwrap();
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
    assert!(
        out.status.success(),
        "{setup} {nvml}: {}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        read("server.log"),
        read("doctor.log")
    );
    let parse = |f: &str| serde_json::from_str(&read(f)).unwrap_or_else(|e| panic!("{setup} {nvml}: {f}: {e}: {}", read("doctor.log")));
    let seen = Seen { doctor: parse("doctor.json"), rc: read("doctor.rc").trim().parse().unwrap(), pids: parse("pids.json") };
    std::fs::remove_dir_all(&dir).ok();
    seen
}

fn holder<'a>(d: &'a Value, pid: &Value) -> &'a Value {
    d["holders"].as_array().unwrap().iter().find(|h| h["pid"] == *pid).unwrap_or_else(|| panic!("pid {pid} among the holders: {d:#}"))
}

fn check(setup: &str, nvml: &str) {
    let _root = as_root();
    let Seen { doctor: d, rc, pids } = doctor(setup, nvml);
    let what = format!("{setup} with NVML {nvml}");
    let benign = holder(&d, &pids["benign"]);
    assert_eq!(benign["verdict"], "benign", "{what}: nvidia-persistenced is benign: {benign:#}");
    let recommended = &d["recommendation"];
    match nvml {
        "none" => assert!(d["nvml"].as_str().unwrap().starts_with("NVML unavailable"), "{what}: says NVML is missing"),
        "unified" => {
            assert_eq!(d["unified_memory"], true, "{what}");
            assert_eq!(d["gpus"][0]["source"], "host", "{what}: capacity and free from the host's memory");
        }
        _ => assert_eq!(d["gpus"][0]["capacity_bytes"].as_u64(), Some(80 << 30), "{what}"),
    }
    let holds_memory = |h: &Value| match nvml {
        "none" => h["bytes"].is_null(),
        _ => h["bytes"].as_u64().is_some_and(|b| b > 10 << 30),
    };
    match setup {
        "clean" => {
            assert_eq!(rc, 0, "{what}: nothing stale");
            assert!(recommended.is_null(), "{what}: {recommended:#}");
            let engine = holder(&d, &pids["child"]);
            assert_eq!(engine["verdict"], "active", "{what}: {engine:#}");
        }
        _ => {
            assert_eq!(rc, 1, "{what}: something stale");
            let stale = &pids["child"];
            assert_eq!(&recommended["kill"], stale, "{what}: kill exactly the stale holder: {d:#}");
            let h = holder(&d, stale);
            assert_eq!(h["verdict"], "stale", "{what}");
            assert!(holds_memory(h), "{what}: its memory, or unknown without NVML: {h:#}");
            let reasons = h["reasons"].to_string();
            assert!(reasons.contains(&format!("pid {}, is gone", pids["server"])), "{what}: orphaned from the killed server: {reasons}");
            if setup == "forked-child" && nvml != "none" {
                assert_eq!(h["kept_for"][0]["pid"], pids["server"], "{what}: NVML counts the dead server's memory, the child keeps it");
            }
            let stale_count = d["holders"].as_array().unwrap().iter().filter(|h| h["verdict"] == "stale").count();
            assert_eq!(stale_count, 1, "{what}: only it: {d:#}");
        }
    }
}

macro_rules! doctor_tests {
    ($($test:ident: $setup:literal, $nvml:literal;)*) => {
        $(#[test] #[ignore = "needs root: `sudo cargo xtask test` runs it"] fn $test() { check($setup, $nvml) })*

        /// Every setup the fake GPU knows, in every NVML mode.
        #[test]
        fn every_setup_and_mode_is_tested() {
            let tested = [$(($setup, $nvml)),*];
            for setup in fakegpu::scenario::DOCTOR_SETUPS {
                for nvml in fakegpu::scenario::NVML_MODES {
                    assert!(tested.contains(&(setup, nvml)), "{setup} with NVML {nvml} has no test");
                }
            }
        }
    };
}

doctor_tests! {
    clean_discrete: "clean", "discrete";
    clean_unified: "clean", "unified";
    clean_without_nvml: "clean", "none";
    orphaned_engine_discrete: "orphaned-engine", "discrete";
    orphaned_engine_unified: "orphaned-engine", "unified";
    orphaned_engine_without_nvml: "orphaned-engine", "none";
    forked_child_discrete: "forked-child", "discrete";
    forked_child_unified: "forked-child", "unified";
    forked_child_without_nvml: "forked-child", "none";
}

//! The real-driver check (tests/device) runs once, on a lent GPU machine, and must be right the
//! first time: its verdicts are held to synthetic traces here, failing cases included.

use std::process::Command;

#[test]
fn the_device_scripts_verdicts_hold_on_synthetic_runs() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/device/verdicts.py");
    let out = Command::new("python3")
        .args([script, "--self-test"])
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 runs the device script's self-test: install python3");
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("checks passed"), "{text}");
}

//! What `deploy/` ships is checked by the tools that will read it.

use std::process::Command;

/// Each capability `gputrace watch` keeps once attached, by the name systemd gives it.
const KEPT: [(u32, &str); 6] =
    [(2, "CAP_DAC_READ_SEARCH"), (5, "CAP_KILL"), (19, "CAP_SYS_PTRACE"), (21, "CAP_SYS_ADMIN"), (38, "CAP_PERFMON"), (39, "CAP_BPF")];

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
    // On kernels with CAP_BPF (highest capability 40) and before it (37).
    let kept = gputrace::privileges::kept(40, false) | gputrace::privileges::kept(37, false);
    for (cap, name) in KEPT {
        assert!(kept & 1 << cap != 0, "{name} is kept by gputrace");
        assert!(set.contains(&name), "the unit withholds {name}, which gputrace uses");
    }
    for name in ["CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_NET_ADMIN", "CAP_SYS_MODULE"] {
        assert!(!set.contains(&name), "the unit grants {name}");
    }
    assert!(unit.contains("NoNewPrivileges=yes") && unit.contains("ProtectSystem=strict"));
}

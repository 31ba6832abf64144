//! The Debian package `cargo xtask dist` builds, installed with `dpkg -i` on a copy of this
//! machine's root (an overlay in a private mount namespace, so the host is left as it was): the
//! binary with its eBPF object, `--help`, the man pages, the completions and the systemd unit work
//! from where the package put them, and removal and purge leave what Debian's rules say.

mod common;

use std::path::PathBuf;
use std::process::Command;

/// The package `cargo xtask test` built for this test (it runs `cargo xtask dist` first, as root).
fn package() -> PathBuf {
    let path = std::env::var("GPUTRACE_DEB")
        .map(PathBuf::from)
        .expect("GPUTRACE_DEB names the package to install: `cargo xtask test` builds it with `cargo xtask dist` and sets it");
    assert!(path.is_file(), "{} is not there: run `cargo xtask dist`", path.display());
    path
}

/// What runs in the copy of the root, with markers the test checks. `set -e`: any failing step
/// ends it with the step's status. The service's command line is taken from the installed unit.
const INSIDE: &str = r#"
set -e
dpkg -i /check/gputrace.deb
echo "== status: $(dpkg-query -W -f='${Status} ${Version}' gputrace)"
dpkg --verify gputrace && [ -s /var/lib/dpkg/info/gputrace.md5sums ] && echo "== verifies against its md5sums"
echo "== version: $(/usr/bin/gputrace --version)"
echo "== help:"; /usr/bin/gputrace --help
echo "== dir modes: $(stat -c %a /usr/share/doc/gputrace/examples/kubernetes /usr/share/bash-completion/completions | sort -u | tr '\n' ' ')"
echo "== man:"; MANWIDTH=200 man -P cat gputrace-watch 2>&1
echo "== man top:"; MANWIDTH=200 man -P cat gputrace 2>&1
echo "== completion: $(bash -c '. /usr/share/bash-completion/completions/gputrace; COMP_WORDS=(gputrace wat); COMP_CWORD=1; _gputrace gputrace wat gputrace; echo "${COMPREPLY[*]}"')"
echo "== option completion: $(bash -c '. /usr/share/bash-completion/completions/gputrace; COMP_WORDS=(gputrace watch --dump); COMP_CWORD=2; _gputrace gputrace --dump watch; echo "${COMPREPLY[*]}"')"
echo "== bash script: $(sha256sum < /usr/share/bash-completion/completions/gputrace)"
for f in /usr/share/zsh/vendor-completions/_gputrace /usr/share/fish/vendor_completions.d/gputrace.fish; do
    grep -q -- dump-dir "$f" && echo "== completes --dump-dir: $f"
done
systemd-analyze verify /usr/lib/systemd/system/gputrace-watch.service && echo "== unit verifies"
# The unit's own command line, as systemd would run it (StateDirectory= made first).
exec_start=$(sed -n 's/^ExecStart=//p' /usr/lib/systemd/system/gputrace-watch.service)
install -d -m 0700 /var/lib/gputrace
$exec_start 2>/check/watch.log &
watch=$!
healthy=
for i in $(seq 1 100); do
    if healthy=$(curl -sf http://127.0.0.1:931/healthz); then break; fi
    sleep 0.1
done
echo "== healthz: $healthy"
curl -sf http://127.0.0.1:931/metrics | grep -m1 '^gputrace_' | sed 's/^/== metric: /'
kill -TERM $watch; wait $watch || echo "== watch exited $?"
echo "== dump dir: $(stat -c '%a %U' /var/lib/gputrace/dumps)"
dpkg -r gputrace
[ ! -e /usr/bin/gputrace ] && [ ! -e /usr/share/man/man1/gputrace.1.gz ] && echo "== removed"
[ -d /var/lib/gputrace/dumps ] && echo "== dumps kept on remove"
# What `systemctl enable gputrace-watch` leaves: purge takes it away.
mkdir -p /etc/systemd/system/multi-user.target.wants
ln -s /usr/lib/systemd/system/gputrace-watch.service /etc/systemd/system/multi-user.target.wants/
dpkg -P gputrace
[ ! -e /var/lib/gputrace ] && [ ! -L /etc/systemd/system/multi-user.target.wants/gputrace-watch.service ] && echo "== purged"
"#;

#[test]
#[ignore = "needs root: `sudo cargo xtask test` runs it"]
fn the_package_installs_and_works_from_where_it_put_things() {
    let _serial = common::as_root();
    let deb = package();
    let work = std::env::temp_dir().join(format!("gputrace-dist-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    // The copy: an overlay whose lower layer is / (submounts are bound in after), its upper a
    // tmpfs, so dpkg's database and every file it writes vanish with the namespace.
    let outside = format!(
        r#"set -e
w={work}
mount -t tmpfs tmpfs $w
mkdir -p $w/upper/check $w/work $w/root
cp {deb} $w/upper/check/gputrace.deb
cat > $w/upper/check/inside.sh
mount -t overlay overlay -o lowerdir=/,upperdir=$w/upper,workdir=$w/work $w/root
for m in proc sys dev; do mount --rbind /$m $w/root/$m; done
mount -t tmpfs tmpfs $w/root/tmp
mount -t tmpfs tmpfs $w/root/run
status=0
chroot $w/root sh /check/inside.sh || status=$?
echo "== watch log:"; cat $w/upper/check/watch.log 2>/dev/null || true
exit $status"#,
        work = work.display(),
        deb = deb.display()
    );
    let mut child = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &outside])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("unshare (util-linux)");
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), INSIDE.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let _ = std::fs::remove_dir_all(&work);
    let text = String::from_utf8_lossy(&out.stdout);
    let all = format!("{text}\n-- stderr --\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the install check failed ({}):\n{all}", out.status);
    let line = |marker: &str| text.lines().find_map(|l| l.strip_prefix(&format!("== {marker}:"))).map(str::trim).unwrap_or_default();

    assert_eq!(line("status"), format!("install ok installed {}", env!("CARGO_PKG_VERSION")), "{all}");
    assert_eq!(line("version"), format!("gputrace {}", env!("CARGO_PKG_VERSION")), "{all}");
    assert_eq!(line("dir modes"), "755", "the package's directories are 0755 whatever the builder's umask:\n{all}");
    let help = text.split("== help:").nth(1).unwrap_or_default();
    for command in ["doctor", "record", "watch", "report", "export"] {
        assert!(help.lines().any(|l| l.trim_start().starts_with(command)), "--help lists {command}:\n{all}");
    }
    let man = text.split("== man:").nth(1).and_then(|m| m.split("== man top:").next()).unwrap_or_default();
    assert!(man.contains("gputrace-watch") && man.contains("--dump-dir") && man.contains("--min-interval"), "the watch man page:\n{all}");
    let man_top = text.split("== man top:").nth(1).and_then(|m| m.split("== completion").next()).unwrap_or_default();
    assert!(man_top.contains("gputrace-record(1)") || man_top.contains("record"), "the top man page names the commands:\n{all}");
    assert_eq!(line("completion"), "watch", "bash completes a command from the installed script:\n{all}");
    assert!(line("option completion").split_whitespace().any(|w| w == "--dump-dir"), "bash completes watch's options:\n{all}");
    // The installed script is what this build's definitions generate: the package is not stale.
    let generated = Command::new(common::gputrace_bin()).args(["generate", "completions", "bash"]).output().unwrap().stdout;
    let mut hasher = Command::new("sha256sum").stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn().unwrap();
    std::io::Write::write_all(&mut hasher.stdin.take().unwrap(), &generated).unwrap();
    let expected = String::from_utf8(hasher.wait_with_output().unwrap().stdout).unwrap();
    assert_eq!(line("bash script"), expected.trim(), "{all}");
    assert_eq!(text.matches("== completes --dump-dir:").count(), 2, "zsh and fish scripts name watch's options:\n{all}");
    assert!(text.contains("== unit verifies"), "{all}");
    assert!(text.contains("== verifies against its md5sums"), "dpkg --verify can check every file:\n{all}");
    // The installed binary loaded its embedded eBPF programs and served its endpoint.
    assert!(line("healthz").starts_with("ok"), "the unit's command line serves /healthz:\n{all}");
    assert!(line("metric").starts_with("gputrace_"), "{all}");
    assert!(!text.contains("== watch exited"), "watch stops cleanly on SIGTERM:\n{all}");
    assert_eq!(line("dump dir"), "700 root", "{all}");
    assert!(text.contains("== removed") && text.contains("== dumps kept on remove") && text.contains("== purged"), "{all}");
}

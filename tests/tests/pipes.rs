//! A reader that leaves before gputrace writes (`gputrace report T | head`, `doctor | grep -q`)
//! ends it quietly, as it ends `cat`: no panic, no message, killed by SIGPIPE. Needs no root.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};

use common::gputrace_bin;
use gputrace::trace::Header;

/// `gputrace ARGS` writing into a pipe whose reader is already gone.
fn into_a_closed_pipe(args: &[&str]) -> (std::process::ExitStatus, String) {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(gputrace_bin()).args(args).stdout(writer).stderr(Stdio::piped()).output().unwrap();
    (out.status, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_closed_pipe_ends_every_command_that_writes_to_it_quietly() {
    let trace = std::env::temp_dir().join(format!("gputrace-pipes-{}.trace", std::process::id()));
    std::fs::write(&trace, serde_json::to_string(&Header::default()).unwrap() + "\n").unwrap();
    let t = trace.to_str().unwrap();
    let commands: [&[&str]; 8] = [
        &["report", t],
        &["report", "--json", t],
        &["export", "--format", "csv", t],
        &["export", "--format", "perfetto", t],
        &["export", "--format", "html", t],
        &["doctor"],
        &["doctor", "--json"],
        &["generate", "completions", "bash"],
    ];
    for args in commands {
        let (status, err) = into_a_closed_pipe(args);
        assert_eq!(status.signal(), Some(libc::SIGPIPE), "gputrace {args:?}: {status}\n{err}");
        assert!(err.is_empty(), "gputrace {args:?} says nothing: {err}");
    }
    std::fs::remove_file(&trace).ok();
}

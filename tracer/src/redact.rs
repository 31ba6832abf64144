//! `--redact`, and the labels of `/metrics` that every local user may read: command lines
//! without secrets. Command lines and HTTP request lines carry API keys, passwords and
//! `?access_token=` query strings. Redacted, a command keeps its program and flag names (what a
//! person needs to recognise it) and the numbers given to the sizing flags the fixes quote
//! (`--max-model-len 8192`, `-c 4096`: a number there is no secret); everything else is `…`:
//! - a value, even one that starts with `-` (`--api-key -abc`: after a flag whose name says it
//!   holds a secret, the next word is a value whatever it looks like);
//! - text glued to a short flag (`-pSECRET` keeps `-p`; llama.cpp's own multi-letter flags,
//!   `-ngl`, `-np`, stay whole);
//! - anything with a space in it (`"--token SECRET"` passed as one argument keeps `--token`).
//!
//! A request line keeps its method and path, not its query.

use crate::event::{Event, Record};
use crate::trace::Header;

pub const HIDDEN: &str = "…";

/// Flags whose values the diagnosis reads and quotes back in its fixes: sizes, never secrets.
const SIZING_FLAGS: [&str; 9] =
    ["--gpu-memory-utilization", "--max-model-len", "--max-num-seqs", "-c", "--ctx-size", "--ctx", "-np", "--parallel", "-ngl"];

/// Single-dash flags of more than one letter that servers define (llama.cpp's): whole words,
/// not a letter with a value glued to it.
const LONG_SHORT_FLAGS: [&str; 24] = [
    "-np", "-ngl", "-ngld", "-fa", "-ub", "-ctk", "-ctv", "-sm", "-mg", "-ts", "-cb", "-nkvo", "-dt", "-tb", "-ns", "-hf", "-hff", "-md",
    "-mu", "-lv", "-sp", "-nr", "-nocb", "-dev",
];

/// Words in a flag's name that say its value is a secret.
const SECRET_WORDS: [&str; 8] = ["key", "token", "secret", "passw", "auth", "credential", "cookie", "bearer"];

fn is_number(word: &str) -> bool {
    !word.is_empty() && word.parse::<f64>().is_ok()
}

/// `--name` or `-x`: a dash or two, then letters, digits, `-` and `_` only.
fn is_flag_name(word: &str) -> bool {
    let name = word.strip_prefix("--").or_else(|| word.strip_prefix('-')).unwrap_or("");
    !name.is_empty() && !name.starts_with('-') && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// A flag as it may be shown: whole (a long flag, one letter, a known multi-letter one), or its
/// dash and first letter when the rest may be a glued value.
fn shown_flag(word: &str) -> String {
    if word.starts_with("--") || word.len() == 2 || LONG_SHORT_FLAGS.contains(&word) {
        word.to_string()
    } else {
        format!("{}{HIDDEN}", &word[..2])
    }
}

fn holds_secret(flag: &str) -> bool {
    let lower = flag.to_ascii_lowercase();
    SECRET_WORDS.iter().any(|w| lower.contains(w))
}

/// A command line with the values hidden.
pub fn command(argv: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(argv.len());
    // The flag before this word: its value is hidden whatever it looks like when the flag holds
    // a secret, and shown when it is a number given to a sizing flag.
    let mut after: Option<&str> = None;
    for (i, arg) in argv.iter().enumerate() {
        let previous = after.take();
        let word = if i == 0 {
            // A program may rewrite its own title (setproctitle) into one argument: its first
            // word is the program, the rest values.
            arg.split_whitespace().next().unwrap_or_default().to_string()
        } else if previous.is_some_and(holds_secret) {
            HIDDEN.to_string()
        } else if let Some((first, _)) = arg.split_once(char::is_whitespace) {
            // One argument with a space: a flag and its value passed together, or a script.
            if is_flag_name(first) {
                format!("{} {HIDDEN}", shown_flag(first))
            } else {
                HIDDEN.to_string()
            }
        } else if let Some((flag, value)) = arg.split_once('=').filter(|(f, _)| is_flag_name(f)) {
            let value = if SIZING_FLAGS.contains(&flag) && is_number(value) { value } else { HIDDEN };
            format!("{}={value}", shown_flag(flag))
        } else if is_flag_name(arg) && !is_number(arg) {
            let shown = shown_flag(arg);
            // A flag shown whole may take the next word as its value; a glued one took its own.
            if shown == *arg {
                after = Some(arg.as_str());
            }
            shown
        } else if previous.is_some_and(|f| SIZING_FLAGS.contains(&f)) && is_number(arg) {
            arg.clone()
        } else {
            HIDDEN.to_string()
        };
        out.push(word);
    }
    out
}

/// "POST /v1/completions?key=abc HTTP/1.1" -> "POST /v1/completions?… HTTP/1.1".
pub fn request_line(line: &str) -> String {
    line.split(' ')
        .map(|word| match word.split_once('?') {
            Some((path, _)) => format!("{path}?{HIDDEN}"),
            None => word.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Hides the secrets a record may carry, in place.
pub fn record(r: &mut Record) {
    match &mut r.event {
        Event::Process { command: c, .. } | Event::Exec { command: c } => *c = command(c),
        // The port stays: it is what ties a deployment to the server listening on it.
        Event::Proxy { command: c, config, deployments, .. } => {
            *c = command(c);
            *config = HIDDEN.to_string();
            for d in deployments {
                d.model = HIDDEN.to_string();
                d.host = HIDDEN.to_string();
            }
        }
        Event::Received { request: Some(line), .. } => *line = request_line(line),
        Event::Sample(sample) => {
            for p in &mut sample.processes {
                p.command = command(&p.command);
            }
        }
        _ => {}
    }
}

/// Hides the secrets of the header: gputrace's own command line and every other process's.
pub fn header(h: &mut Header) {
    h.command = command(&h.command);
    for p in &mut h.prior_use {
        p.command = command(&p.command);
    }
    for holder in &mut h.holders_at_start {
        holder.command = command(&holder.command);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split(' ').map(String::from).collect()
    }

    #[test]
    fn values_go_flags_and_sizes_stay() {
        let argv = words("/usr/bin/python3 -m vllm.entrypoints.openai.api_server --api-key sk-secret --model /models/llama --max-model-len 8192 --gpu-memory-utilization=0.85 --hf-token=hf_abc");
        assert_eq!(
            command(&argv).join(" "),
            "/usr/bin/python3 -m … --api-key … --model … --max-model-len 8192 --gpu-memory-utilization=0.85 --hf-token=…"
        );
        let llama = words("llama-server -c 4096 -np 4 --api-key 12345");
        assert_eq!(
            command(&llama).join(" "),
            "llama-server -c 4096 -np 4 --api-key …",
            "a number after a flag that is not for sizing is hidden"
        );
    }

    /// What /metrics once showed every local user: a value glued to a short flag, a value that
    /// starts with a dash, a flag and its value passed as one argument.
    #[test]
    fn glued_dash_led_and_spaced_values_go_too() {
        let argv: Vec<String> =
            ["server", "-pGLUEDSECRET", "--api-key", "-dashSECRET", "--token SPACESECRET", "--hf-token", "--x", "-ngl", "99", "-c", "8192"]
                .map(String::from)
                .to_vec();
        let shown = command(&argv).join(" ");
        assert_eq!(shown, "server -p… --api-key … --token … --hf-token … -ngl 99 -c 8192");
        for secret in ["GLUED", "dash", "SPACE", "--x"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        let odd: Vec<String> = ["p", "-=x", "--a=b=c", "-n=5", "--max-num-seqs=16", "--weird$flag", "-"].map(String::from).to_vec();
        assert_eq!(command(&odd).join(" "), "p … --a=… -n=… --max-num-seqs=16 … …");
    }

    #[test]
    fn request_lines_lose_their_query() {
        assert_eq!(request_line("GET /v1/models?access_token=abc&x=1 HTTP/1.1"), "GET /v1/models?… HTTP/1.1");
        assert_eq!(request_line("POST /v1/completions HTTP/1.1"), "POST /v1/completions HTTP/1.1");
    }
}

//! `--redact`: traces, reports and exports without secrets. Command lines and HTTP request lines
//! carry API keys, passwords and `?access_token=` query strings. Redacted, a command keeps its
//! program and flag names (what a person needs to recognise it) and the values of the sizing
//! flags the fixes quote (`--max-model-len 8192`, `-c 4096`); every other value becomes `…`. A
//! request line keeps its method and path, not its query.

use crate::event::{Event, Record};
use crate::trace::Header;

pub const HIDDEN: &str = "…";

/// Flags whose values the diagnosis reads and quotes back in its fixes: sizes, never secrets.
const SIZING_FLAGS: [&str; 9] =
    ["--gpu-memory-utilization", "--max-model-len", "--max-num-seqs", "-c", "--ctx-size", "--ctx", "-np", "--parallel", "-ngl"];

fn is_number(word: &str) -> bool {
    !word.is_empty() && word.parse::<f64>().is_ok()
}

/// A command line with the values hidden.
pub fn command(argv: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(argv.len());
    let mut keep_next = false;
    for (i, arg) in argv.iter().enumerate() {
        let word = if i == 0 {
            arg.clone()
        } else if let Some((flag, value)) = arg.split_once('=').filter(|(f, _)| f.starts_with('-')) {
            let value = if SIZING_FLAGS.contains(&flag) && is_number(value) { value } else { HIDDEN };
            format!("{flag}={value}")
        } else if (arg.starts_with('-') && !is_number(arg)) || (keep_next && is_number(arg)) {
            arg.clone()
        } else {
            HIDDEN.to_string()
        };
        keep_next = i > 0 && SIZING_FLAGS.contains(&arg.as_str());
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

    #[test]
    fn request_lines_lose_their_query() {
        assert_eq!(request_line("GET /v1/models?access_token=abc&x=1 HTTP/1.1"), "GET /v1/models?… HTTP/1.1");
        assert_eq!(request_line("POST /v1/completions HTTP/1.1"), "POST /v1/completions HTTP/1.1");
    }
}

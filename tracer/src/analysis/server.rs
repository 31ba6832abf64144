//! Inference servers by family: what each calls the settings a fix changes, and their defaults.
//! Adding an engine is one variant here; the diagnosis only asks.

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ServerFamily {
    Vllm,
    LlamaCpp,
    Sglang,
    Tgi,
    Ollama,
    Unknown,
}

/// How a family takes a setting: a command-line flag, or an environment variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting {
    Flag(&'static str),
    Env(&'static str),
}

impl Setting {
    /// As a person types it with `value`: `--max-num-seqs 8`, `OLLAMA_NUM_PARALLEL=8`.
    pub fn with(self, value: impl std::fmt::Display) -> String {
        match self {
            Setting::Flag(f) => format!("{f} {value}"),
            Setting::Env(e) => format!("{e}={value}"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Setting::Flag(n) | Setting::Env(n) => n,
        }
    }
}

impl ServerFamily {
    pub const ALL: [ServerFamily; 5] =
        [ServerFamily::Vllm, ServerFamily::LlamaCpp, ServerFamily::Sglang, ServerFamily::Tgi, ServerFamily::Ollama];

    /// The family of the process that runs a command line. Words, not substrings, for llama.cpp:
    /// a vLLM serving `meta-llama/...` is still vLLM.
    pub fn of(command: &[String]) -> ServerFamily {
        let words: Vec<&str> = command.iter().map(|a| a.rsplit('/').next().unwrap_or(a)).collect();
        let any = |f: &dyn Fn(&str) -> bool| words.iter().any(|w| f(w));
        if any(&|w| w.contains("vllm")) {
            ServerFamily::Vllm
        } else if any(&|w| w.contains("sglang")) {
            ServerFamily::Sglang
        } else if any(&|w| w.starts_with("text-generation-")) {
            ServerFamily::Tgi
        } else if any(&|w| w == "ollama") {
            ServerFamily::Ollama
        } else if any(&|w| w == "llama" || w.starts_with("llama-server") || w.starts_with("llama.cpp")) {
            ServerFamily::LlamaCpp
        } else {
            ServerFamily::Unknown
        }
    }

    /// The setting that caps one request's context, and the names its current value may be
    /// given under.
    pub fn context(self) -> Option<(Setting, &'static [&'static str])> {
        Some(match self {
            ServerFamily::Vllm => (Setting::Flag("--max-model-len"), &["--max-model-len"]),
            ServerFamily::LlamaCpp => (Setting::Flag("-c"), &["-c", "--ctx-size", "--ctx"]),
            ServerFamily::Sglang => (Setting::Flag("--context-length"), &["--context-length"]),
            ServerFamily::Tgi => (Setting::Flag("--max-total-tokens"), &["--max-total-tokens"]),
            ServerFamily::Ollama => (Setting::Env("OLLAMA_CONTEXT_LENGTH"), &[]),
            ServerFamily::Unknown => return None,
        })
    }

    /// How many parts one request's context is of the context setting: llama-server splits `-c`
    /// over its slots when `-np` is given (each slot gets `-c / -np`), unless the KV cache is
    /// unified (`-kvu`, the last of it and `-no-kvu` counting); with `-np` left to its default
    /// (auto), the server turns the unified cache on and one request may take all of it
    /// (llama.cpp 16736, 17997). 1 for every other family; `changed` slots where a what-if sets
    /// `-np`.
    pub fn context_slots(self, command: &[String], changed: Option<u64>) -> u64 {
        if self != ServerFamily::LlamaCpp {
            return 1;
        }
        let given = flag(command, &["-np", "--parallel"]).and_then(|v| v.parse::<i64>().ok()).filter(|&n| n > 0);
        let unified = command.iter().rev().find_map(|a| match a.as_str() {
            "-kvu" | "--kv-unified" => Some(true),
            "-no-kvu" | "--no-kv-unified" => Some(false),
            _ => None,
        });
        match changed.or(given.map(|n| n as u64)) {
            Some(n) if unified != Some(true) => n.max(1),
            _ => 1,
        }
    }

    /// The setting that caps requests served at once, and the names its current value may be
    /// given under.
    pub fn concurrency(self) -> Option<(Setting, &'static [&'static str])> {
        Some(match self {
            ServerFamily::Vllm => (Setting::Flag("--max-num-seqs"), &["--max-num-seqs"]),
            ServerFamily::LlamaCpp => (Setting::Flag("-np"), &["-np", "--parallel"]),
            ServerFamily::Sglang => (Setting::Flag("--max-running-requests"), &["--max-running-requests"]),
            ServerFamily::Tgi => (Setting::Flag("--max-concurrent-requests"), &["--max-concurrent-requests"]),
            ServerFamily::Ollama => (Setting::Env("OLLAMA_NUM_PARALLEL"), &[]),
            ServerFamily::Unknown => return None,
        })
    }

    /// The names of the setting that caps the tokens of one batch, every request's together
    /// (what the engine sizes its activations for).
    pub fn batch_tokens(self) -> Option<&'static [&'static str]> {
        match self {
            ServerFamily::Vllm => Some(&["--max-num-batched-tokens"]),
            ServerFamily::Tgi => Some(&["--max-batch-total-tokens"]),
            ServerFamily::Sglang => Some(&["--max-prefill-tokens"]),
            ServerFamily::LlamaCpp | ServerFamily::Ollama | ServerFamily::Unknown => None,
        }
    }

    /// The setting that shards a model over several GPUs (tensor parallelism), and the names its
    /// current value may be given under.
    pub fn sharding(self) -> Option<(Setting, &'static [&'static str])> {
        Some(match self {
            ServerFamily::Vllm => (Setting::Flag("--tensor-parallel-size"), &["--tensor-parallel-size", "-tp"]),
            ServerFamily::LlamaCpp => (Setting::Flag("--tensor-split"), &["--tensor-split", "-ts"]),
            ServerFamily::Sglang => (Setting::Flag("--tp-size"), &["--tp-size", "--tensor-parallel-size"]),
            ServerFamily::Tgi => (Setting::Flag("--num-shard"), &["--num-shard"]),
            ServerFamily::Ollama | ServerFamily::Unknown => return None,
        })
    }

    /// Engines that reserve a fraction of the GPU at start (weights and KV cache together):
    /// the flag and its default.
    pub fn reserve(self) -> Option<(&'static str, f64)> {
        match self {
            ServerFamily::Vllm => Some(("--gpu-memory-utilization", 0.9)),
            ServerFamily::Sglang => Some(("--mem-fraction-static", 0.88)),
            _ => None,
        }
    }
}

/// The value of `--flag V` or `--flag=V` on a command line, under any of `names`: the last
/// given, as the servers' parsers take it.
pub fn flag(command: &[String], names: &[&str]) -> Option<String> {
    flag_named(command, names).map(|(_, value)| value)
}

/// [`flag`], with the name it was given under.
pub fn flag_named<'n>(command: &[String], names: &[&'n str]) -> Option<(&'n str, String)> {
    command.iter().enumerate().rev().find_map(|(i, a)| {
        names.iter().find_map(|&n| {
            let value = if a == n { command.get(i + 1).cloned() } else { a.strip_prefix(&format!("{n}=")).map(String::from) };
            value.map(|v| (n, v))
        })
    })
}

/// A setting on the command line that bounds what a server keeps, and its value: a flag that
/// names a cache and a size or limit (`--prompt-cache-size`, `--cache-ram`, `--max-cache-entries`),
/// or the LoRA adapters held at once (`--max-loras`). The first given.
pub fn cache_bound(command: &[String]) -> Option<(String, String)> {
    const LIMITS: [&str; 9] = ["size", "max", "ram", "limit", "capacity", "entries", "bytes", "mb", "gb"];
    command.iter().enumerate().find_map(|(i, a)| {
        let (name, value) = match a.split_once('=') {
            Some((name, value)) => (name, Some(value.to_string())),
            None => (a.as_str(), command.get(i + 1).filter(|v| !v.starts_with('-')).cloned()),
        };
        let words = name.strip_prefix("--")?.to_ascii_lowercase();
        let bounds_cache = words.contains("cache") && words.split(['-', '_']).any(|w| LIMITS.contains(&w));
        if bounds_cache || words == "max-loras" {
            Some((name.to_string(), value?))
        } else {
            None
        }
    })
}

/// A count as a server's parser takes it: digits, or vLLM's human-readable forms (`32k` is
/// 32,000 and `25.6k` 25,600, lowercase decimal; `32K` is 32,768, uppercase binary, whole
/// numbers only). None for anything else, `auto` included, and past u64.
pub fn count(value: &str) -> Option<u64> {
    let value = value.trim();
    let (number, suffix) = value.split_at(value.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(value.len()));
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') || number.matches('.').count() > 1 {
        return None;
    }
    let decimal = |power: i32| {
        let n = number.parse::<f64>().ok()? * 1000f64.powi(power);
        (n < u64::MAX as f64).then_some(n as u64)
    };
    // Whole numbers only (a point fails to parse), as vLLM takes them.
    let binary = |shift: u32| number.parse::<u64>().ok()?.checked_mul(1 << shift);
    match suffix {
        "" => binary(0),
        "k" => decimal(1),
        "m" => decimal(2),
        "g" => decimal(3),
        "t" => decimal(4),
        "K" => binary(10),
        "M" => binary(20),
        "G" => binary(30),
        "T" => binary(40),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split(' ').map(String::from).collect()
    }

    #[test]
    fn a_cache_bound_is_a_flag_that_names_a_cache_and_a_size_with_its_value() {
        let bound = |s: &str| cache_bound(&argv(s));
        assert_eq!(bound("server --prompt-cache-size 4096 -c 8192"), Some(("--prompt-cache-size".into(), "4096".into())));
        assert_eq!(bound("llama-server --cache-ram=8192"), Some(("--cache-ram".into(), "8192".into())));
        assert_eq!(bound("vllm serve m --max-loras 4"), Some(("--max-loras".into(), "4".into())));
        // A cache switched on, a KV cache's type, a size that is no cache's: none bounds it.
        assert_eq!(bound("vllm serve m --enable-prefix-caching --max-model-len 8192"), None);
        assert_eq!(bound("llama-server --cache-type-k q8_0 --ctx-size 8192"), None);
        assert_eq!(bound("server --cache-size --port 8000"), None);
    }

    #[test]
    fn a_setting_given_twice_is_its_last_under_any_of_its_names() {
        let command = argv("llama-server -m m.gguf -np 5 --parallel 64 -c 4096");
        assert_eq!(flag_named(&command, &["-np", "--parallel"]), Some(("--parallel", "64".to_string())));
        assert_eq!(flag_named(&argv("x --ctx-size=8192 -c 4096"), &["-c", "--ctx-size"]), Some(("-c", "4096".to_string())));
        assert_eq!(flag(&argv("x -c"), &["-c"]), None, "a flag with no value");
    }

    /// vLLM's `--max-model-len 32k` is 32,000 tokens, `32K` 32,768; odd values are no count.
    #[test]
    fn counts_are_read_as_the_servers_read_them() {
        assert_eq!(count("131072"), Some(131_072));
        assert_eq!(count("32k"), Some(32_000));
        assert_eq!(count("25.6k"), Some(25_600));
        assert_eq!(count("32K"), Some(32_768));
        assert_eq!(count("1m"), Some(1_000_000));
        assert_eq!(count("2G"), Some(2 << 30));
        for odd in ["", "k", "auto", "-1", "1.5K", "1.2.3k", ".5k", "5.k", "32x", "+5", "18446744073709551615K", "99999999999999999999t"] {
            assert_eq!(count(odd), None, "{odd:?}");
        }
    }

    #[test]
    fn families_by_their_command_lines() {
        assert_eq!(
            ServerFamily::of(&argv("python3 -m vllm.entrypoints.openai.api_server --model meta-llama/Llama-3-8B")),
            ServerFamily::Vllm
        );
        assert_eq!(ServerFamily::of(&argv("/opt/llama.cpp/build/bin/llama-server -m m.gguf -c 4096")), ServerFamily::LlamaCpp);
        assert_eq!(ServerFamily::of(&argv("fake-server --server llama --port 1")), ServerFamily::LlamaCpp);
        assert_eq!(ServerFamily::of(&argv("python -m sglang.launch_server --model-path x")), ServerFamily::Sglang);
        assert_eq!(ServerFamily::of(&argv("text-generation-launcher --model-id x")), ServerFamily::Tgi);
        assert_eq!(ServerFamily::of(&argv("/usr/local/bin/ollama serve")), ServerFamily::Ollama);
        assert_eq!(ServerFamily::of(&argv("python serve.py")), ServerFamily::Unknown);
    }

    /// A flag given twice: the last wins, as with the servers' own parsers.
    #[test]
    fn the_last_of_a_flag_given_twice_is_its_value() {
        let c = argv("vllm serve m --max-num-seqs 256 --max-num-seqs=8");
        assert_eq!(flag(&c, &["--max-num-seqs"]).as_deref(), Some("8"));
        assert_eq!(flag(&argv("llama-server --parallel 8 -np 5"), &["-np", "--parallel"]).as_deref(), Some("5"));
    }

    /// llama-server's context is its slots' together when `-np` is given and the cache is not
    /// unified; one request's otherwise.
    #[test]
    fn llama_server_splits_its_context_over_the_slots_it_is_given() {
        let slots = |line: &str, changed| ServerFamily::of(&argv(line)).context_slots(&argv(line), changed);
        assert_eq!(slots("llama-server -c 32768 -np 4", None), 4);
        assert_eq!(slots("llama-server -c 32768 --parallel=8", None), 8);
        assert_eq!(slots("llama-server -c 32768 -np 4 -kvu", None), 1, "a unified cache");
        assert_eq!(slots("llama-server -c 32768", None), 1, "auto: four slots on one unified cache");
        assert_eq!(slots("llama-server -c 32768 --no-kv-unified", None), 1, "auto turns the unified cache on");
        assert_eq!(slots("llama-server -c 32768 -np 4 -kvu -no-kvu", None), 4, "the last of -kvu and -no-kvu");
        assert_eq!(slots("llama-server -c 32768 -np 4 -no-kvu --kv-unified", None), 1);
        assert_eq!(slots("llama-server -c 32768 -np -1", None), 1, "-1 is auto");
        assert_eq!(slots("llama-server -c 32768", Some(6)), 6, "-np given by a what-if splits it");
        assert_eq!(slots("llama-server -c 32768 -np 4 --kv-unified", Some(6)), 1);
        assert_eq!(slots("vllm serve m --max-num-seqs 8", None), 1);
    }

    #[test]
    fn every_known_family_names_its_settings() {
        for family in ServerFamily::ALL {
            assert!(family.context().is_some() && family.concurrency().is_some(), "{family:?}");
        }
        assert_eq!(ServerFamily::LlamaCpp.concurrency().unwrap().0.with(4), "-np 4");
        assert_eq!(ServerFamily::Ollama.concurrency().unwrap().0.with(4), "OLLAMA_NUM_PARALLEL=4");
        assert_eq!(flag(&argv("x --gpu-memory-utilization=0.8"), &["--gpu-memory-utilization"]).as_deref(), Some("0.8"));
        assert_eq!(flag(&argv("x -c 4096"), &["-c", "--ctx-size"]).as_deref(), Some("4096"));
    }
}

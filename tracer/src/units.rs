//! Sizes as people read them. Every output formats through here, so a figure reads the same in
//! the report, the exports and the recorder's status line.

/// Binary units, as people read memory sizes.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// A moment (ns since the epoch) in local time, to the second.
pub fn local_time(wall_ns: u64) -> libc::tm {
    let secs = (wall_ns / 1_000_000_000) as libc::time_t;
    // SAFETY: localtime_r fills a tm from a time_t.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    unsafe { libc::localtime_r(&secs, &mut tm) };
    tm
}

/// A moment as servers' logs write it, in local time to the hundredth of a second, with the
/// offset from UTC: "2026-12-07 10:15:32.41 +0000".
pub fn wall_clock(wall_ns: u64) -> String {
    let tm = local_time(wall_ns);
    let offset = tm.tm_gmtoff / 60;
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}.{:02} {}{:02}{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec,
        wall_ns % 1_000_000_000 / 10_000_000,
        if offset < 0 { '-' } else { '+' },
        offset.abs() / 60,
        offset.abs() % 60
    )
}

/// Unicode's invisible format characters that reorder or hide text: bidirectional overrides,
/// embeddings and isolates (U+202E shows `evil.exe` as `exe.live`), marks, and zero-width ones.
fn is_format(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{feff}')
}

/// Text that came from processes (command lines, request lines, GPU names), made safe for a
/// terminal: control characters (an escape sequence could clear the screen, retitle the window,
/// hide text or forge a line) are shown as `cat -v` shows them, `^[`, and C1 controls and the
/// invisible format characters (bidi overrides, zero-width) as `\u{9b}`, `\u{202e}`. Newlines
/// and tabs stay.
pub fn for_terminal(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\n' | '\t' => out.push(c),
            '\x7f' => out.push_str("^?"),
            c if (c as u32) < 0x20 => {
                out.push('^');
                out.push(char::from(c as u8 + 0x40));
            }
            c if (0x80..0xa0).contains(&(c as u32)) || is_format(c) => out.push_str(&c.escape_unicode().to_string()),
            c => out.push(c),
        }
    }
    out
}

/// Text a process controls (an argument, a request line) made one line: newlines, tabs and
/// every other control character written as escapes (`\n`, `\t`, `\x1b`), so nothing it holds
/// can start a line of its own in a report (a forged `RECOMMENDED: kill 1`) or drive a terminal.
pub fn one_line(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if (0x80..0xa0).contains(&(c as u32)) || matches!(c, '\u{2028}' | '\u{2029}') || is_format(c) => {
                out.push_str(&c.escape_unicode().to_string())
            }
            c => out.push(c),
        }
    }
    out
}

/// A size as people write it: `80GiB`, `512MiB`, `80G`, `1.5TiB`, or plain bytes. For clap.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number.parse().map_err(|_| format!("{text:?} is not a size (write it as 80GiB, 512MiB or bytes)"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("{other:?} is not a unit: use B, KiB, MiB, GiB or TiB")),
    };
    let bytes = value * scale as f64;
    if !(bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64) {
        return Err(format!("{text:?} is out of range"));
    }
    Ok(bytes as u64)
}

/// A duration as people write it: `90s`, `10m`, `2h`, `500ms`, `1d`. For clap.
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number.parse().map_err(|_| format!("{text:?} is not a duration (write it as 90s, 10m or 2h)"))?;
    let seconds = match unit.trim() {
        "ms" => 0.001,
        "s" | "" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        other => return Err(format!("{other:?} is not a unit of time: use ms, s, m, h or d")),
    };
    std::time::Duration::try_from_secs_f64(value * seconds).map_err(|_| format!("{text:?} is out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_never_reach_the_terminal() {
        assert_eq!(for_terminal("a\x1b]0;owned\x07\x1b[2J b\n\tc\x7f\u{9b}31m"), "a^[]0;owned^G^[[2J b\n\tc^?\\u{9b}31m");
        assert_eq!(for_terminal("plain text, ünïcode"), "plain text, ünïcode");
        // A bidi override would show `kill 1234` as `4321 llik`; zero-width ones hide text.
        assert_eq!(
            for_terminal("kill \u{202e}4321\u{202c} a\u{200b}b\u{2066}c\u{feff}"),
            "kill \\u{202e}4321\\u{202c} a\\u{200b}b\\u{2066}c\\u{feff}"
        );
    }

    #[test]
    fn what_a_process_controls_stays_on_one_line() {
        assert_eq!(one_line("600\n\nRECOMMENDED: kill 1"), "600\\n\\nRECOMMENDED: kill 1");
        assert_eq!(one_line("a\tb\r\x1b[2J\x7f\u{9b}\u{2028}"), "a\\tb\\r\\x1b[2J\\x7f\\u{9b}\\u{2028}");
        assert_eq!(one_line("plain, ünïcode -c 4096"), "plain, ünïcode -c 4096");
    }

    #[test]
    fn sizes_as_people_write_them() {
        assert_eq!(parse_bytes("80GiB"), Ok(80 << 30));
        assert_eq!(parse_bytes("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5T"), Ok(3 << 39));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("lots").is_err() && parse_bytes("5 parsecs").is_err() && parse_bytes("1e400").is_err());
    }

    #[test]
    fn durations_as_people_write_them() {
        use std::time::Duration;
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert!(parse_duration("soon").is_err() && parse_duration("5 fortnights").is_err() && parse_duration("1e300d").is_err());
    }

    #[test]
    fn sizes_in_binary_units() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(20 << 20), "20.0 MiB");
        assert_eq!(bytes(80 << 30), "80.0 GiB");
    }
}

//! What the running kernel's tracepoints look like, from their `format` files in tracefs. The
//! eBPF programs read tracepoint records at fixed offsets; before loading them, gputrace checks
//! each offset against the kernel's own description, so a kernel that lays a record out
//! differently is refused with a sentence instead of traced wrongly. Fields that only recent
//! kernels have (`sched_process_exit`'s `group_dead`, 6.8 on) are looked up, not assumed.

use std::path::Path;

/// One field of a tracepoint record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    pub offset: u32,
    pub size: u32,
}

/// The fields of a `format` file: `field:TYPE NAME;\toffset:N;\tsize:N;...`.
pub fn fields(format: &str) -> Vec<(String, Field)> {
    format
        .lines()
        .filter_map(|line| {
            let mut parts = line.trim().split(';').map(str::trim);
            let declaration = parts.next()?.strip_prefix("field:")?;
            let name = declaration.rsplit([' ', '*']).next()?.split('[').next()?.to_string();
            let mut number = |key: &str| parts.next()?.strip_prefix(key)?.parse::<u32>().ok();
            Some((name, Field { offset: number("offset:")?, size: number("size:")? }))
        })
        .collect()
}

/// A field's place, by name.
pub fn field(format: &str, name: &str) -> Option<Field> {
    fields(format).into_iter().find(|(n, _)| n == name).map(|(_, f)| f)
}

/// The first argument of every `sys_enter_*` record, and the return value of every `sys_exit_*`
/// one, follow the common header and the syscall number: the programs read them from here on.
pub const SYSCALL_ARGS_AT: u32 = 16;

/// What a program reads from a record, and where it reads it.
pub struct Expect {
    pub field: &'static str,
    pub offset: u32,
}

/// The fields each non-syscall hook reads, at the offsets the programs use.
pub fn expected(category: &str, name: &str) -> &'static [Expect] {
    match (category, name) {
        ("task", "task_newtask") => &[Expect { field: "pid", offset: 8 }, Expect { field: "clone_flags", offset: 32 }],
        ("sched", "sched_process_exec") => &[Expect { field: "filename", offset: 8 }],
        ("oom", "mark_victim") => &[Expect { field: "pid", offset: 8 }],
        _ => &[],
    }
}

/// Checks a tracepoint's layout against what its program reads; the problem in words if it
/// differs.
pub fn check(category: &str, name: &str, format: &str) -> Result<(), String> {
    let mismatch = |what: &str, found: Option<Field>, want: u32| match found {
        Some(f) if f.offset == want => Ok(()),
        Some(f) => Err(format!("{category}:{name} has {what} at offset {}, where gputrace reads it at {want}", f.offset)),
        None => Err(format!("{category}:{name} has no field {what}, which gputrace reads")),
    };
    if category == "syscalls" {
        // The first field after the syscall number, whatever its name (fd, filename, ret...).
        let first = fields(format).into_iter().find(|(n, _)| !n.starts_with("common_") && n != "__syscall_nr").map(|(_, f)| f);
        return match first {
            None => Ok(()), // a syscall without arguments (none is hooked today)
            found => mismatch("its first argument", found, SYSCALL_ARGS_AT),
        };
    }
    expected(category, name).iter().try_for_each(|e| mismatch(e.field, field(format, e.field), e.offset))
}

/// The format file of a tracepoint, None when the kernel has no such tracepoint.
pub fn format(tracefs: &Path, category: &str, name: &str) -> Option<String> {
    std::fs::read_to_string(tracefs.join("events").join(category).join(name).join("format")).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXIT_6_18: &str = "name: sched_process_exit\nID: 369\nformat:\n\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;\n\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;\n\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;\n\n\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n\tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;\n\tfield:int prio;\toffset:28;\tsize:4;\tsigned:1;\n\tfield:bool group_dead;\toffset:32;\tsize:1;\tsigned:0;\n\nprint fmt: \"comm=%s\"\n";
    /// Debian 12's 6.1: no group_dead.
    const EXIT_6_1: &str = "name: sched_process_exit\nID: 300\nformat:\n\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;\n\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;\n\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;\n\n\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n\tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;\n\tfield:int prio;\toffset:28;\tsize:4;\tsigned:1;\n\nprint fmt: \"comm=%s\"\n";
    const IOCTL: &str = "name: sys_enter_ioctl\nID: 1\nformat:\n\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;\n\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;\n\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;\n\tfield:int __syscall_nr;\toffset:8;\tsize:4;\tsigned:1;\n\tfield:unsigned int fd;\toffset:16;\tsize:8;\tsigned:0;\n\tfield:unsigned int cmd;\toffset:24;\tsize:8;\tsigned:0;\n\tfield:unsigned long arg;\toffset:32;\tsize:8;\tsigned:0;\n";

    #[test]
    fn fields_by_name() {
        assert_eq!(field(EXIT_6_18, "group_dead"), Some(Field { offset: 32, size: 1 }));
        assert_eq!(field(EXIT_6_1, "group_dead"), None, "older kernels have none");
        assert_eq!(field(EXIT_6_1, "comm"), Some(Field { offset: 8, size: 16 }));
        assert_eq!(field(IOCTL, "arg"), Some(Field { offset: 32, size: 8 }));
    }

    #[test]
    fn a_layout_that_moved_is_refused_in_words() {
        assert_eq!(check("syscalls", "sys_enter_ioctl", IOCTL), Ok(()));
        let moved = IOCTL.replace("offset:16;", "offset:24;");
        let e = check("syscalls", "sys_enter_ioctl", &moved).unwrap_err();
        assert!(e.contains("its first argument at offset 24, where gputrace reads it at 16"), "{e}");
        let newtask =
            "format:\n\tfield:pid_t pid;\toffset:8;\tsize:4;\tsigned:1;\n\tfield:u64 clone_flags;\toffset:40;\tsize:8;\tsigned:0;\n";
        let e = check("task", "task_newtask", newtask).unwrap_err();
        assert!(e.contains("clone_flags at offset 40"), "{e}");
    }

    /// Every tracepoint this kernel has, as gputrace hooks them, checks out (the test machine's
    /// own tracefs, readable by root).
    #[test]
    #[ignore = "needs root: `sudo cargo xtask test` runs it"]
    fn this_kernels_hooks_check_out() {
        let tracefs = Path::new(crate::probe::TRACEFS);
        assert!(tracefs.join("events").exists(), "tracefs is not mounted at {}", tracefs.display());
        let mut checked = 0;
        for hook in crate::probe::HOOKS {
            if let Some(format) = format(tracefs, hook.category, hook.name) {
                assert_eq!(check(hook.category, hook.name, &format), Ok(()), "{}:{}", hook.category, hook.name);
                checked += 1;
            }
        }
        assert!(checked >= 30, "only {checked} hooks found in tracefs");
    }
}

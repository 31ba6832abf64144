//! Just enough of a BTF reader to find a few struct member offsets in the running kernel
//! (/sys/kernel/btf/vmlinux), so the kernel side can read `current->files->fdt->fd[n]`: the
//! `struct file *` that names an open file description, on any kernel, without CO-RE.

use std::collections::HashMap;

use tracer_common::KernelOffsets;

const BTF_MAGIC: u16 = 0xeb9f;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;

/// Bytes that follow a type's 12-byte header, by kind (see the kernel's Documentation/bpf/btf.rst).
fn extra_bytes(kind: u32, vlen: usize) -> Option<usize> {
    Some(match kind {
        1 => 4,             // INT
        2 | 7..=12 => 0,    // PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC
        3 => 12,            // ARRAY
        4 | 5 => 12 * vlen, // STRUCT, UNION
        6 => 8 * vlen,      // ENUM
        13 => 8 * vlen,     // FUNC_PROTO
        14 => 4,            // VAR
        15 => 12 * vlen,    // DATASEC
        16 => 0,            // FLOAT
        17 => 4,            // DECL_TAG
        18 => 0,            // TYPE_TAG
        19 => 12 * vlen,    // ENUM64
        _ => return None,
    })
}

/// Member byte offsets of the named structs: struct name -> member name -> offset. Members of
/// anonymous structs and unions inside them count as their own (`mm_struct` keeps all of its
/// fields in one).
pub fn struct_members(data: &[u8], wanted: &[&str]) -> Result<HashMap<String, HashMap<String, u32>>, String> {
    let u16_at = |at: usize| data.get(at..at + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |at: usize| data.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()));
    if u16_at(0) != Some(BTF_MAGIC) {
        return Err("not little-endian BTF".into());
    }
    let header_len = u32_at(4).ok_or("short header")? as usize;
    let (type_off, type_len, str_off) =
        (u32_at(8).ok_or("short header")? as usize, u32_at(12).ok_or("short header")? as usize, u32_at(16).ok_or("short header")? as usize);
    let types = header_len + type_off;
    let strings = header_len + str_off;
    let name = |off: u32| -> &str {
        let start = strings + off as usize;
        let end = data[start.min(data.len())..].iter().position(|&b| b == 0).map_or(data.len(), |n| start + n);
        std::str::from_utf8(data.get(start..end).unwrap_or_default()).unwrap_or("")
    };
    // Every type by its id (ids count from 1): a struct or union's members as (name, type, byte
    // offset); None for other kinds.
    let mut all: Vec<Option<Vec<(u32, u32, u32)>>> = vec![None];
    let mut named = Vec::new();
    let mut at = types;
    while at + 12 <= types + type_len {
        let (name_off, info) = (u32_at(at).unwrap(), u32_at(at + 4).unwrap());
        let (kind, vlen, kind_flag) = ((info >> 24) & 0x1f, (info & 0xffff) as usize, info >> 31 == 1);
        let extra = extra_bytes(kind, vlen).ok_or_else(|| format!("unknown BTF kind {kind}"))?;
        let mut members = None;
        if kind == KIND_STRUCT || kind == KIND_UNION {
            let struct_name = name(name_off);
            if wanted.contains(&struct_name) {
                named.push((struct_name, all.len()));
            }
            let mut list = Vec::with_capacity(vlen);
            for m in 0..vlen {
                let base = at + 12 + 12 * m;
                let (member_name, member_type, offset) =
                    (u32_at(base).ok_or("short member")?, u32_at(base + 4).ok_or("short member")?, u32_at(base + 8).ok_or("short member")?);
                let bits = if kind_flag { offset & 0xff_ffff } else { offset };
                list.push((member_name, member_type, bits / 8));
            }
            members = Some(list);
        }
        all.push(members);
        at += 12 + extra;
    }
    let mut found = HashMap::new();
    for (struct_name, id) in named {
        if found.contains_key(struct_name) {
            continue;
        }
        let mut members = HashMap::new();
        // (type, offset of its start, depth): anonymous members nest a few levels at most.
        let mut stack = vec![(id, 0u32, 0u8)];
        let mut opened = std::collections::HashSet::new();
        while let Some((id, base, depth)) = stack.pop() {
            if !opened.insert(id) {
                continue;
            }
            for &(member_name, member_type, offset) in all.get(id).and_then(Option::as_ref).into_iter().flatten() {
                match name(member_name) {
                    "" if depth < 8 => stack.push((member_type as usize, base.saturating_add(offset), depth + 1)),
                    "" => {}
                    member => {
                        members.entry(member.to_string()).or_insert(base.saturating_add(offset));
                    }
                }
            }
        }
        found.insert(struct_name.to_string(), members);
    }
    Ok(found)
}

/// The offsets of `task_struct.files`, `files_struct.fdt`, `fdtable.fd`, `fdtable.max_fds`, and
/// optionally `task_struct.exit_code` (without it exits carry no status), `file.f_inode` and
/// `inode.i_rdev` (without them opens are judged by path alone) and `task_struct.group_leader`
/// (without it a thread with a file table of its own is not told apart), `task_struct.mm` and
/// `mm_struct.arg_start`/`arg_end` (without them an exec's command is read from /proc), and
/// `fdtable.close_on_exec` (without it a fd the kernel finds NVIDIA's by number is taken to
/// survive an exec).
pub fn kernel_offsets(data: &[u8]) -> Result<KernelOffsets, String> {
    let found = struct_members(data, &["task_struct", "files_struct", "fdtable", "file", "inode", "mm_struct"])?;
    let get = |s: &str, m: &str| {
        found.get(s).and_then(|members| members.get(m)).copied().ok_or_else(|| format!("the kernel's BTF has no {s}.{m}"))
    };
    Ok(KernelOffsets {
        task_files: get("task_struct", "files")?,
        files_fdt: get("files_struct", "fdt")?,
        fdtable_fd: get("fdtable", "fd")?,
        fdtable_max_fds: get("fdtable", "max_fds")?,
        task_exit_code: get("task_struct", "exit_code").unwrap_or(0),
        file_inode: get("file", "f_inode").unwrap_or(0),
        inode_rdev: get("inode", "i_rdev").unwrap_or(0),
        task_group_leader: get("task_struct", "group_leader").unwrap_or(0),
        files_count_plus_one: get("files_struct", "count").map_or(0, |at| at + 1),
        task_mm: get("task_struct", "mm").unwrap_or(0),
        mm_arg_start: get("mm_struct", "arg_start").unwrap_or(0),
        mm_arg_end: get("mm_struct", "arg_end").unwrap_or(0),
        fdtable_close_on_exec: get("fdtable", "close_on_exec").unwrap_or(0),
    })
}

pub fn running_kernel_offsets() -> Result<KernelOffsets, String> {
    let data = std::fs::read("/sys/kernel/btf/vmlinux").map_err(|e| format!("reading /sys/kernel/btf/vmlinux: {e}"))?;
    kernel_offsets(&data)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BTF blob with one struct, built by hand: header, types, strings.
    fn blob(kind_flag: bool) -> Vec<u8> {
        let strings = b"\0fdtable\0max_fds\0fd\0";
        let mut types = Vec::new();
        let info = (KIND_STRUCT << 24) | 2 | if kind_flag { 1 << 31 } else { 0 };
        for v in [1u32, info, 64] {
            types.extend_from_slice(&v.to_le_bytes());
        }
        // max_fds at byte 0, fd at byte 8 (bit offsets; with kind_flag the top byte is a bitfield size)
        for (name, offset) in [(9u32, 0u32), (17, 64 | if kind_flag { 1 << 24 } else { 0 })] {
            for v in [name, 0, offset] {
                types.extend_from_slice(&v.to_le_bytes());
            }
        }
        with_header(&types, strings)
    }

    /// A BTF blob of these types and strings: its header, then them.
    fn with_header(types: &[u8], strings: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&BTF_MAGIC.to_le_bytes());
        out.extend_from_slice(&[1, 0]);
        for v in [24u32, 0, types.len() as u32, types.len() as u32, strings.len() as u32] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(types);
        out.extend_from_slice(strings);
        out
    }

    #[test]
    fn reads_member_offsets_with_and_without_kind_flag() {
        for kind_flag in [false, true] {
            let found = struct_members(&blob(kind_flag), &["fdtable"]).unwrap();
            assert_eq!(found["fdtable"]["max_fds"], 0);
            assert_eq!(found["fdtable"]["fd"], 8);
        }
        assert!(kernel_offsets(&blob(false)).unwrap_err().contains("task_struct.files"));
        assert!(struct_members(b"nope", &[]).is_err());
    }

    /// A struct whose fields sit in an anonymous struct inside it, as `mm_struct`'s do.
    #[test]
    fn reads_members_of_anonymous_structs_inside() {
        let strings = b"\0mm_struct\0arg_start\0arg_end\0cpu_bitmap\0";
        let mut types = Vec::new();
        let mut push = |words: &[u32]| words.iter().for_each(|v| types.extend_from_slice(&v.to_le_bytes()));
        // [1] an anonymous struct: arg_start at byte 8, arg_end at 16.
        push(&[0, (KIND_STRUCT << 24) | 2, 24, 11, 0, 64, 21, 0, 128]);
        // [2] mm_struct: cpu_bitmap at 0, the anonymous struct [1] at byte 32.
        push(&[1, (KIND_STRUCT << 24) | 2, 64, 29, 0, 0, 0, 1, 256]);
        let out = with_header(&types, strings);
        let found = struct_members(&out, &["mm_struct"]).unwrap();
        assert_eq!(found["mm_struct"]["cpu_bitmap"], 0);
        assert_eq!(found["mm_struct"]["arg_start"], 40);
        assert_eq!(found["mm_struct"]["arg_end"], 48);
        // A member naming a type out of range, or itself, is no panic and no endless walk.
        let mut looped = out.clone();
        let at = 24 + 36 + 12 + 12 + 4; // [2]'s second member's type
        looped[at..at + 4].copy_from_slice(&2u32.to_le_bytes());
        assert_eq!(struct_members(&looped, &["mm_struct"]).unwrap()["mm_struct"]["cpu_bitmap"], 0);
        looped[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
        assert!(!struct_members(&looped, &["mm_struct"]).unwrap()["mm_struct"].contains_key("arg_start"));
    }

    /// On a kernel with BTF (this one has it), the offsets are found and plausible.
    #[test]
    fn finds_the_running_kernels_offsets() {
        let Ok(data) = std::fs::read("/sys/kernel/btf/vmlinux") else {
            eprintln!("skipped: no /sys/kernel/btf/vmlinux on this kernel");
            return;
        };
        let o = kernel_offsets(&data).unwrap();
        assert!(o.task_files > 0 && o.task_files < 16384, "{o:?}");
        assert!(o.files_fdt < 256 && o.fdtable_fd < 64 && o.fdtable_max_fds < 64, "{o:?}");
        assert_ne!(o.fdtable_fd, o.fdtable_max_fds);
        assert!(o.fdtable_close_on_exec > 0 && o.fdtable_close_on_exec < 64 && o.fdtable_close_on_exec != o.fdtable_fd, "{o:?}");
        assert!(o.task_exit_code > 0 && o.task_exit_code < 16384 && o.task_exit_code != o.task_files, "{o:?}");
        assert!(o.file_inode > 0 && o.file_inode < 256 && o.inode_rdev > 0 && o.inode_rdev < 1024, "{o:?}");
        assert!(o.task_group_leader > 0 && o.task_group_leader < 16384 && o.task_group_leader != o.task_files, "{o:?}");
        assert!(o.task_mm > 0 && o.task_mm < 16384 && o.task_mm != o.task_files, "{o:?}");
        // Inside mm_struct's anonymous struct: found only by looking into it.
        assert!(o.mm_arg_start > 0 && o.mm_arg_end == o.mm_arg_start + 8 && o.mm_arg_end < 4096, "{o:?}");
        assert!(o.files_count_plus_one > 0 && o.files_count_plus_one < 64 && o.files_count_plus_one != o.files_fdt + 1, "{o:?}");
    }
}

//! docs/architecture.md lists userspace's modules in layers: each imports only modules above its
//! own row. The modules inside a folder (`analysis/`, `report/`, ...) have a table of their own,
//! in layers too: a file names only files of its folder above its row. A folder's own file
//! (`analysis/mod.rs`, `report.rs`) is its face: its files use it, and it uses them. This holds
//! the code to those tables, so a cycle or an import up the layers fails here rather than in a
//! newcomer's reading.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn architecture() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/architecture.md")).expect("docs/architecture.md")
}

/// The first cells of the table at `heading` (its header row, or a heading above it), in its
/// order, without backquotes or `.rs`.
fn rows_after(doc: &str, heading: &str) -> Vec<String> {
    let after = doc.split(heading).nth(1).unwrap_or_else(|| panic!("docs/architecture.md has no {heading:?}"));
    let table = after.lines().skip(1).skip_while(|line| !line.starts_with('|')).take_while(|line| line.starts_with('|'));
    let first_cell = |line: &str| line.split('|').nth(1).unwrap_or("").trim().to_string();
    // Less the header row and the line under it.
    let rows = table.filter(|line| !line.starts_with("|---") && !["file", "module"].contains(&first_cell(line).as_str()));
    rows.map(|line| first_cell(line).trim_matches('`').trim_end_matches(".rs").to_string()).collect()
}

/// The modules of the userspace table, in its order (`main.rs` is the binary, not a module).
fn table_order(doc: &str) -> Vec<String> {
    rows_after(doc, "| module | what it does |").into_iter().filter(|name| name != "main").collect()
}

/// Each folder's table ("### Inside `analysis/`"): its files in their order.
fn folder_tables(doc: &str) -> BTreeMap<String, Vec<String>> {
    doc.match_indices("### Inside `")
        .map(|(at, _)| {
            let rest = &doc[at + "### Inside `".len()..];
            let folder = rest.split('/').next().unwrap_or("").to_string();
            let heading = format!("### Inside `{folder}/`");
            (folder, rows_after(doc, &heading))
        })
        .collect()
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file outside its tests, without comments (doc links name modules freely).
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let text = text.split("#[cfg(test)]\nmod tests {").next().unwrap_or("");
    text.lines().map(|line| line.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// The names a piece of code gives right after `prefix`: `crate::a::x` and each top name of
/// `crate::{a::x, b}` for the prefix `crate::`.
fn named_after(code: &str, prefix: &str) -> BTreeSet<String> {
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut out = BTreeSet::new();
    for (at, _) in code.match_indices(prefix) {
        // `super::` is not the end of a longer word (`a_super::`).
        if code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[at + prefix.len()..];
        let Some(group) = rest.strip_prefix('{') else {
            out.insert(ident(rest));
            continue;
        };
        let mut depth = 1;
        let mut start = true;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 1 => break,
                '}' => depth -= 1,
                ',' if depth == 1 => start = true,
                c if start && !c.is_whitespace() => {
                    out.insert(ident(&group[i..]));
                    start = false;
                }
                _ => {}
            }
        }
    }
    out.remove("");
    out
}

fn is_test(relative: &Path) -> bool {
    relative.file_name().is_some_and(|n| n == "tests.rs") || relative.components().any(|c| c.as_os_str() == "tests")
}

/// What breaks the layers in `src`, as the tables of `doc` give them.
fn wrong_imports(src: &Path, doc: &str) -> Vec<String> {
    let order = table_order(doc);
    let folders = folder_tables(doc);
    let row = |table: &[String], name: &str| table.iter().position(|m| m == name);
    let mut files = Vec::new();
    sources(src, &mut files);
    assert!(files.len() > 20, "tracer/src's files: {files:?}");
    let mut wrong = Vec::new();
    for file in files {
        let relative = file.strip_prefix(src).unwrap();
        let parts: Vec<String> =
            relative.components().map(|c| c.as_os_str().to_string_lossy().trim_end_matches(".rs").to_string()).collect();
        let module = parts[0].clone();
        if module == "lib" || module == "main" || is_test(relative) {
            continue;
        }
        let shown = relative.display();
        let code = code(&file);
        let Some(own) = row(&order, &module) else {
            wrong.push(format!("{shown}: module `{module}` has no row in docs/architecture.md"));
            continue;
        };
        for named in named_after(&code, "crate::") {
            match row(&order, &named) {
                Some(theirs) if theirs < own => {}
                Some(_) if named == module => {}
                Some(_) => wrong.push(format!("{shown}: `{module}` imports `{named}`, which is not above it")),
                None => wrong.push(format!("{shown}: `{module}` imports `{named}`, which has no row")),
            }
        }
        // A file inside a folder: the siblings it names, through `super::` or the crate's path.
        let [_, inner, ..] = parts.as_slice() else { continue };
        if inner == "mod" {
            continue;
        }
        let Some(table) = folders.get(&module) else {
            wrong.push(format!("{shown}: folder `{module}/` has no \"### Inside `{module}/`\" table in docs/architecture.md"));
            continue;
        };
        let Some(mine) = row(table, inner) else {
            wrong.push(format!("{shown}: `{inner}` has no row in the table of `{module}/`"));
            continue;
        };
        let up = if parts.len() > 2 { "super::super::" } else { "super::" };
        let siblings = named_after(&code, up).into_iter().chain(named_after(&code, &format!("crate::{module}::")));
        for named in siblings.filter(|n| folders[&module].contains(n)) {
            match row(table, &named) {
                Some(theirs) if theirs < mine || named == *inner => {}
                _ => wrong.push(format!("{shown}: `{module}/{inner}` imports `{module}/{named}`, which is not above it")),
            }
        }
    }
    for (folder, table) in &folders {
        for name in table {
            let (flat, nested) = (src.join(folder).join(format!("{name}.rs")), src.join(folder).join(name));
            if !flat.exists() && !nested.is_dir() {
                wrong.push(format!("docs/architecture.md: `{folder}/{name}` has a row but no file"));
            }
        }
    }
    wrong
}

#[test]
fn every_module_imports_only_modules_above_it_in_the_architecture_table() {
    let src = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src"));
    let wrong = wrong_imports(src, &architecture());
    assert!(wrong.is_empty(), "the layers of docs/architecture.md do not hold:\n{}", wrong.join("\n"));
}

/// Two rows of a folder's table swapped: the one that imports the other is now above it.
#[test]
fn swapping_two_rows_of_a_folder_fails() {
    let src = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src"));
    let doc = architecture();
    let (accounts, cost) = ("| `accounts.rs` |", "| `cost.rs` |");
    assert!(doc.contains(accounts) && doc.contains(cost), "the analysis table names both");
    let swapped = doc.replace(accounts, "\u{0}").replace(cost, accounts).replace('\u{0}', cost);
    let wrong = wrong_imports(src, &swapped);
    assert!(wrong.iter().any(|w| w.contains("`analysis/accounts` imports `analysis/cost`, which is not above it")), "{wrong:?}");
}

#[test]
fn imports_are_read_from_plain_paths_and_groups() {
    let named = named_after("use crate::a::B;\nuse crate::{b::{C, D}, c, d::e::F};\nlet x = crate::e::f();", "crate::");
    assert_eq!(named.into_iter().collect::<Vec<_>>(), ["a", "b", "c", "d", "e"]);
    let named = named_after("use super::{sweep, Phase};\nuse super::cost::Cost;\nfn a_super::x", "super::");
    assert_eq!(named.into_iter().collect::<Vec<_>>(), ["Phase", "cost", "sweep"]);
}

//! docs/architecture.md lists userspace's modules in layers: each imports only modules above its
//! own row. This holds the code to that table, so a cycle or an import up the layers fails here
//! rather than in a newcomer's reading.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The modules of the userspace table, in its order (`main.rs` is the binary, not a module).
fn table_order() -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/architecture.md")).expect("docs/architecture.md");
    let table = doc.split("| module | what it does |").nth(1).expect("the userspace table");
    table
        .lines()
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .map(|line| line.split('|').nth(1).unwrap_or("").trim().trim_matches('`').to_string())
        .filter(|name| name != "main.rs")
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

/// The modules a piece of code names through `crate::`: `crate::a::x` and each top name of
/// `crate::{a::x, b}`.
fn named_modules(code: &str) -> BTreeSet<String> {
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut out = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
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

#[test]
fn every_module_imports_only_modules_above_it_in_the_architecture_table() {
    let order = table_order();
    let row = |name: &str| order.iter().position(|m| m == name);
    let src = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src"));
    let mut files = Vec::new();
    sources(src, &mut files);
    assert!(files.len() > 20, "tracer/src's files: {files:?}");
    let mut wrong = Vec::new();
    for file in files {
        let relative = file.strip_prefix(src).unwrap();
        let module = relative.components().next().unwrap().as_os_str().to_string_lossy().trim_end_matches(".rs").to_string();
        let in_tests = relative.file_name().is_some_and(|n| n == "tests.rs") || relative.components().any(|c| c.as_os_str() == "tests");
        if module == "lib" || module == "main" || in_tests {
            continue;
        }
        let Some(own) = row(&module) else {
            wrong.push(format!("{}: module `{module}` has no row in docs/architecture.md", relative.display()));
            continue;
        };
        for named in named_modules(&code(&file)) {
            match row(&named) {
                Some(theirs) if theirs < own => {}
                Some(_) if named == module => {}
                Some(_) => wrong.push(format!("{}: `{module}` imports `{named}`, which is not above it", relative.display())),
                None => wrong.push(format!("{}: `{module}` imports `{named}`, which has no row", relative.display())),
            }
        }
    }
    assert!(wrong.is_empty(), "the layers of docs/architecture.md do not hold:\n{}", wrong.join("\n"));
}

#[test]
fn imports_are_read_from_plain_paths_and_groups() {
    let named = named_modules("use crate::a::B;\nuse crate::{b::{C, D}, c, d::e::F};\nlet x = crate::e::f();");
    assert_eq!(named.into_iter().collect::<Vec<_>>(), ["a", "b", "c", "d", "e"]);
}

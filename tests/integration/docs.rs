//! SECURITY.md names the test behind every claim (`module::test` for the tests in this
//! directory, `module::tests::test` for a library module's unit tests): each name must
//! lead to a function that exists, so a renamed or deleted test cannot leave a claim
//! that nothing backs.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `` `a::b` `` and `` `a::b::c` `` span of lowercase words in `text`. A span that is
/// not such a path may still close on a backtick that opens one, so each backtick is
/// tried as an opening.
fn named_paths(text: &str) -> Vec<String> {
    let is_path = |s: &str| {
        s.contains("::")
            && s.split("::").all(|w| {
                !w.is_empty()
                    && w.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            })
    };
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find('`') {
        rest = &rest[open + 1..];
        let Some(close) = rest.find('`') else { break };
        if is_path(&rest[..close]) {
            found.push(rest[..close].to_owned());
            rest = &rest[close + 1..];
        }
    }
    found
}

/// The source files that can hold library module `module`: `src/**/<module>.rs` and
/// `src/**/<module>/**/*.rs` (its submodules, at any depth).
fn library_files(dir: &Path, module: &str, out: &mut Vec<PathBuf>) {
    fn every_rs(dir: &Path, out: &mut Vec<PathBuf>) {
        for f in std::fs::read_dir(dir).unwrap().flatten() {
            if f.path().is_dir() {
                every_rs(&f.path(), out);
            } else if f.path().extension().is_some_and(|e| e == "rs") {
                out.push(f.path());
            }
        }
    }
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if name == module {
                every_rs(&path, out);
            }
            library_files(&path, module, out);
        } else if name == format!("{module}.rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_test_security_md_names_exists() {
    every_test_named_exists("SECURITY.md", 21);
}

/// docs/install.md's table of engines and versions names the test behind every cell.
#[test]
fn every_test_the_engine_table_names_exists() {
    every_test_named_exists("docs/install.md", 8);
}

/// The document at `path` names at least `least` tests, and every one exists.
fn every_test_named_exists(path: &str, least: usize) {
    let text = std::fs::read_to_string(root().join(path)).unwrap();
    let names = named_paths(&text);
    assert!(
        names.len() >= least,
        "{path} names only {} tests",
        names.len()
    );
    let missing = missing_tests(&names);
    assert!(
        missing.is_empty(),
        "{path} names tests that do not exist: {missing:?}"
    );
}

/// The names (`module::test`, `module::tests::test`, `module::tests`) that lead to no
/// function (or test module): `module` is a file of the integration or the load tier, or
/// a library module.
fn missing_tests(names: &[String]) -> Vec<String> {
    let root = root();
    let mut missing = Vec::new();
    for name in names {
        let parts: Vec<&str> = name.split("::").collect();
        let (module, item) = (parts[0], parts[parts.len() - 1]);
        let integration = root.join("tests/integration").join(format!("{module}.rs"));
        let load = root.join("tests/load").join(format!("{module}.rs"));
        let mut files = Vec::new();
        if integration.is_file() && parts.len() == 2 {
            files.push(integration);
        } else if load.is_file() && parts.len() == 2 {
            files.push(load);
        } else {
            library_files(&root.join("src"), module, &mut files);
        }
        let wanted = if item == "tests" {
            "mod tests".to_owned()
        } else {
            format!("fn {item}(")
        };
        let found = files.iter().any(|f| {
            std::fs::read_to_string(f)
                .unwrap_or_default()
                .contains(&wanted)
        });
        if !found {
            missing.push(name.clone());
        }
    }
    missing
}

// ---------------------------------------------------------------------------------------
// References: every one a reader meets leads somewhere inside the repository.

/// Where a reader meets references: the source trees and the docs (the top-level `*.md`
/// and `docs/`).
const SCANNED: [&str; 6] = ["src", "tests", "testkit", "scripts", "sim", "docs"];

/// What the scan leaves out, each for a reason: the raw records of past runs, kept as
/// they were written, and this file, which spells out the patterns it forbids.
const NOT_SCANNED: [&str; 3] = [
    "docs/gpu-runs",
    "docs/bench-runs",
    "tests/integration/docs.rs",
];

/// Directories that tools create beside the sources (Python's byte code, Cargo's output):
/// nobody reads them, and they are not in the repository.
const BUILD_OUTPUT: [&str; 2] = ["__pycache__", "target"];

/// One text file of the scan, with its path relative to the repository root.
struct Scanned {
    rel: String,
    text: String,
}

fn scanned_files() -> Vec<Scanned> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<Scanned>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().flatten().collect();
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let path = entry.path();
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let name = entry.file_name();
            if NOT_SCANNED.contains(&rel.as_str()) || BUILD_OUTPUT.iter().any(|b| name == *b) {
                continue;
            }
            if path.is_dir() {
                walk(root, &path, out);
            } else {
                let text = std::fs::read_to_string(&path).unwrap_or_else(|_| {
                    panic!("{rel} is not UTF-8 text: name it in NOT_SCANNED, with why")
                });
                out.push(Scanned { rel, text });
            }
        }
    }
    let root = root();
    let mut out = Vec::new();
    let mut top: Vec<_> = std::fs::read_dir(&root).unwrap().flatten().collect();
    top.sort_by_key(|e| e.file_name());
    for entry in top {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") && entry.path().is_file() {
            let text = std::fs::read_to_string(entry.path()).unwrap();
            out.push(Scanned { rel: name, text });
        }
    }
    for dir in SCANNED {
        walk(&root, &root.join(dir), &mut out);
    }
    out
}

/// The top-level entries a repository path starts with.
const REPOSITORY_DIRS: [&str; 12] = [
    "src/",
    "tests/",
    "testkit/",
    "scripts/",
    "sim/",
    "docs/",
    "config/",
    "deploy/",
    "hooks/",
    "packaging/",
    "fuzz/",
    ".github/",
];

fn is_path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-')
}

/// `token` as a repository path to check, if it reads as one: it starts with a top-level
/// directory and is made of path characters only (no `<placeholder>`, `*`, `{a,b}`),
/// or it is a top-level `NAME.md`. A `:line` or `#anchor` suffix is dropped.
fn repository_path(token: &str) -> Option<&str> {
    let token = token.split('#').next()?;
    let token = match token.rsplit_once(':') {
        Some((path, line)) if line.bytes().all(|b| b.is_ascii_digit()) => path,
        _ => token,
    };
    if token.is_empty() || !token.chars().all(is_path_char) || token.contains("..") {
        return None;
    }
    let top_md = !token.contains('/')
        && token.len() > ".md".len()
        && token.ends_with(".md")
        && token[..token.len() - 3]
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b == b'_');
    (top_md || REPOSITORY_DIRS.iter().any(|d| token.starts_with(d))).then_some(token)
}

/// Where `path` (as written in the file at `rel`) can lead: the repository root, the
/// file's own directory, or the workspace member the file belongs to (`sim/`, `fuzz/`).
fn resolves(rel: &str, path: &str) -> bool {
    let root = root();
    let file = root.join(rel);
    let mut bases = vec![root.clone(), file.parent().unwrap().to_path_buf()];
    for member in ["sim", "fuzz"] {
        if rel.starts_with(&format!("{member}/")) {
            bases.push(root.join(member));
        }
    }
    bases.iter().any(|b| b.join(path).exists())
}

/// A GitHub-style anchor for a Markdown heading: lowercase, spaces to `-`, everything but
/// letters, digits, `-` and `_` dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The headings of a Markdown text (outside code fences), as written, backticks dropped.
fn headings(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            let heading = line.trim_start_matches('#');
            if heading.starts_with(' ') {
                out.push(heading.trim().replace('`', ""));
            }
        }
    }
    out
}

/// The anchors of a Markdown text, duplicates numbered as GitHub numbers them.
fn anchors(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for h in headings(text) {
        let base = anchor(&h);
        let n = out
            .iter()
            .filter(|a| **a == base || a.starts_with(&format!("{base}-")))
            .count();
        out.push(if n == 0 { base } else { format!("{base}-{n}") });
    }
    out
}

/// The text with every line's comment or quote markers (`//!`, `///`, `//`, `#`, `*`, `>`)
/// and indentation removed, the lines joined by one space, and where each line starts in
/// it: a citation broken across comment lines reads as one.
fn flattened(text: &str) -> (String, Vec<usize>) {
    let mut flat = String::new();
    let mut starts = Vec::new();
    for line in text.lines() {
        starts.push(flat.len());
        let body = line
            .trim_start()
            .trim_start_matches(['/', '!', '#', '*', '>']);
        flat.push_str(body.trim());
        flat.push(' ');
    }
    (flat, starts)
}

/// The 1-based line of byte `at` of a flattened text.
fn line_of(starts: &[usize], at: usize) -> usize {
    starts.partition_point(|&s| s <= at)
}

/// Citations of files beside the repository, or of the tracker, in a flattened text: each
/// as (byte offset, what was found).
fn forbidden_citations(flat: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let lower = flat.to_lowercase();
    for needle in [
        "DESIGN §",
        "DESIGN.md",
        "-facts.md",
        "-facts §",
        "shared/reference",
    ] {
        for (at, _) in flat.match_indices(needle) {
            found.push((at, needle.to_owned()));
        }
    }
    // "issue 15", "Issue #6", "issues 8 and 14": history, which belongs in commits.
    for (at, _) in lower.match_indices("issue") {
        let before = lower[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '-') {
            continue;
        }
        let rest = lower[at + "issue".len()..].trim_start_matches('s');
        let rest = rest.trim_start().trim_start_matches('#');
        if rest.starts_with(|c: char| c.is_ascii_digit()) {
            let end = (at + 20).min(flat.len());
            let end = (end..=flat.len())
                .find(|&e| flat.is_char_boundary(e))
                .unwrap();
            found.push((at, flat[at..end].to_owned()));
        }
    }
    found.sort();
    found
}

/// Backticked spans of one line, paired in order.
fn backticked(line: &str) -> Vec<&str> {
    line.split('`').skip(1).step_by(2).collect()
}

/// What each file references that is not there: relative Markdown links (and their
/// `#anchor`s into Markdown files), backticked repository paths, bare Markdown file
/// mentions that read as repository paths, and `docs/x.md, "Heading"`
/// citations (the path from the root or the file's directory) whose heading does not
/// exist; a cited heading may be the start of the real one.
fn broken_references(file: &Scanned) -> Vec<String> {
    let root = root();
    let mut broken = Vec::new();
    let mut fenced = false;
    let is_md = file.rel.ends_with(".md");
    for (n, line) in file.text.lines().enumerate() {
        let at = format!("{}:{}", file.rel, n + 1);
        if is_md && line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if fenced {
            continue;
        }
        for span in backticked(line) {
            let token = span.split_whitespace().next().unwrap_or("");
            if let Some(path) = repository_path(token) {
                if !resolves(&file.rel, path) {
                    broken.push(format!("{at}: `{span}` does not exist"));
                }
            }
        }
        // Markdown links: in Markdown, and in Rust's doc comments (rustdoc is Markdown).
        let markdown = is_md || (file.rel.ends_with(".rs") && line.trim_start().starts_with("//"));
        let mut rest = if markdown { line } else { "" };
        while let Some(open) = rest.find("](") {
            rest = &rest[open + 2..];
            let Some(close) = rest.find(')') else { break };
            let target = rest[..close].split_whitespace().next().unwrap_or("");
            rest = &rest[close..];
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, fragment) = match target.split_once('#') {
                Some((p, f)) => (p, Some(f)),
                None => (target, None),
            };
            let dir = root.join(&file.rel).parent().unwrap().to_path_buf();
            let resolved = if path.is_empty() {
                root.join(&file.rel)
            } else {
                dir.join(path)
            };
            if !resolved.exists() {
                broken.push(format!("{at}: link {target} leads to nothing"));
                continue;
            }
            if let Some(fragment) =
                fragment.filter(|_| resolved.extension().is_some_and(|e| e == "md"))
            {
                let text = std::fs::read_to_string(&resolved).unwrap();
                if !anchors(&text).iter().any(|a| a == fragment) {
                    broken.push(format!("{at}: link {target}: no such heading"));
                }
            }
        }
    }
    // A bare mention, `(STYLE.md)` or `see docs/state.md`, names a file that exists (a
    // backticked one or a link target was checked above).
    // `docs/design.md, "Identity"`: the named heading (or one starting with it) exists.
    let (flat, starts) = flattened(&file.text);
    for (at, _) in flat.match_indices(".md") {
        let start = flat[..at]
            .rfind(|c: char| !is_path_char(c))
            .map_or(0, |i| i + 1);
        let path = &flat[start..at + 3];
        let quoted_before = flat[..start].ends_with('`') || flat[..start].ends_with("](");
        if !quoted_before && repository_path(path).is_some_and(|p| !resolves(&file.rel, p)) {
            let line = line_of(&starts, at);
            broken.push(format!("{}:{line}: {path} does not exist", file.rel));
            continue;
        }
        let after = flat[at + 3..].trim_start_matches('`');
        let Some(quoted) = after
            .strip_prefix(',')
            .and_then(|a| a.trim_start().strip_prefix('"'))
        else {
            continue;
        };
        let Some(end) = quoted.find('"') else {
            continue;
        };
        let heading = &quoted[..end];
        let line = line_of(&starts, at);
        let dir = root.join(&file.rel).parent().unwrap().to_path_buf();
        let Some(text) = [root.join(path), dir.join(path)]
            .iter()
            .find_map(|p| std::fs::read_to_string(p).ok())
        else {
            // A file of another project (`PROTOCOL.md` of ttrpc) is not ours to check.
            if repository_path(path).is_some() {
                broken.push(format!("{}:{line}: {path} does not exist", file.rel));
            }
            continue;
        };
        if !headings(&text).iter().any(|h| h.starts_with(heading)) {
            broken.push(format!(
                "{}:{line}: {path} has no heading \"{heading}\"",
                file.rel
            ));
        }
    }
    broken
}

/// Every reference a reader meets resolves inside the repository: links, backticked
/// paths, bare mentions of a `NAME.md` or a repository path ending in `.md` (in code
/// comments too) and heading citations lead to files and headings that exist, and nothing cites
/// the design notes or research files kept beside the repository, or an issue number.
#[test]
fn every_reference_resolves_inside_the_repository() {
    let files = scanned_files();
    assert!(
        files.iter().any(|f| f.rel == "src/lib.rs") && files.len() > 100,
        "the scan found only {} files",
        files.len()
    );
    let mut problems = Vec::new();
    for file in &files {
        problems.extend(broken_references(file));
        let (flat, starts) = flattened(&file.text);
        for (at, what) in forbidden_citations(&flat) {
            let n = line_of(&starts, at);
            problems.push(format!(
                "{}:{n}: cites {what:?}, which leads outside the repository: state the fact in docs/ and cite that",
                file.rel
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The rows of the markdown table under the line `header` in `text` (after its `|---|`
/// line, up to the first line that is not a row).
fn table_rows(text: &str, header: &str) -> Vec<String> {
    let mut lines = text.lines().skip_while(|l| *l != header);
    assert_eq!(lines.next(), Some(header), "no table headed {header:?}");
    lines
        .skip(1)
        .take_while(|l| l.starts_with('|'))
        .map(str::to_owned)
        .collect()
}

/// The request-key tables of docs/requests.md and the README are the rows of
/// `request::keys`: every key, its names, values and (in docs/requests.md) what it does,
/// its client variable, whether it is part of the daemon identity and what hook-only mode
/// does with it. On a difference the wanted table is printed, to paste.
#[test]
fn the_key_tables_are_the_request_key_rows() {
    use gpushare::request::KEYS;
    let full_header = "| annotation | env var | value | what it does | client variable | daemon identity | hook-only mode |";
    let full: Vec<String> = KEYS
        .iter()
        .map(|k| {
            let client = k
                .client_env
                .map_or_else(|| "—".to_owned(), |c| format!("`{}`", c.var));
            let identity = match (k.identity, k.number().is_some()) {
                (false, _) => "no",
                (true, false) => "yes",
                (true, true) => "under `limits = \"enforced\"`",
            };
            format!(
                "| `{}` | `{}` | {} | {} | {client} | {identity} | {} |",
                k.annotation,
                k.env,
                k.values,
                k.doc,
                k.hook_only.doc()
            )
        })
        .collect();
    let short_header = "| annotation | env var | value |";
    let short: Vec<String> = KEYS
        .iter()
        .map(|k| format!("| `{}` | `{}` | {} |", k.annotation, k.env, k.values))
        .collect();
    for (file, header, want) in [
        ("docs/requests.md", full_header, &full),
        ("README.md", short_header, &short),
    ] {
        let text = std::fs::read_to_string(root().join(file)).unwrap();
        assert_eq!(
            &table_rows(&text, header),
            want,
            "{file}'s key table differs from src/request/keys.rs; it should read:\n{header}\n|{}\n{}",
            "---|".repeat(header.matches(" | ").count() + 1),
            want.join("\n")
        );
    }
}

// ---------------------------------------------------------------------------------------
// The module maps: ARCHITECTURE.md's and the one in src/lib.rs's doc name every module.

/// The top-level modules `src/lib.rs` declares (`mod x;`, `pub mod x;`, `pub(crate) mod x;`).
fn declared_modules(lib: &str) -> Vec<String> {
    let mut out: Vec<String> = lib
        .lines()
        .filter_map(|l| {
            let l = l
                .strip_prefix("pub(crate) ")
                .or_else(|| l.strip_prefix("pub "))
                .unwrap_or(l);
            l.strip_prefix("mod ")?.strip_suffix(';').map(str::to_owned)
        })
        .collect();
    out.sort();
    out
}

/// The modules ARCHITECTURE.md's module map names: the first column of its `text` block
/// (a line that starts with a name; an indented line continues the description).
fn architecture_map(text: &str) -> Vec<String> {
    let mut lines = text.lines().skip_while(|l| *l != "## Module map");
    assert!(
        lines.next().is_some(),
        "ARCHITECTURE.md has no \"## Module map\""
    );
    let mut lines = lines.skip_while(|l| *l != "```text").skip(1);
    let mut out = Vec::new();
    for line in lines.by_ref().take_while(|l| *l != "```") {
        if line.starts_with(' ') || line.is_empty() {
            continue;
        }
        let names = line.split("  ").next().unwrap_or("");
        out.extend(
            names
                .split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(str::to_owned),
        );
    }
    out.sort();
    out
}

/// ARCHITECTURE.md's module map, the one map, names exactly the modules src/lib.rs
/// declares: a new module cannot be left off the map, nor a removed one stay on it.
#[test]
fn the_module_maps_name_every_module() {
    let lib = std::fs::read_to_string(root().join("src/lib.rs")).unwrap();
    let declared = declared_modules(&lib);
    assert!(
        declared.len() > 20 && declared.iter().any(|m| m == "driver"),
        "src/lib.rs declares only {declared:?}"
    );
    let arch = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let mut problems = Vec::new();
    for (map, named) in [("ARCHITECTURE.md's module map", architecture_map(&arch))] {
        for m in declared.iter().filter(|m| !named.contains(m)) {
            problems.push(format!("{map} lacks `{m}`, which src/lib.rs declares"));
        }
        for m in named.iter().filter(|m| !declared.contains(m)) {
            problems.push(format!(
                "{map} names `{m}`, which src/lib.rs does not declare"
            ));
        }
        let mut unique = named.clone();
        unique.dedup();
        if unique.len() != named.len() {
            problems.push(format!("{map} names a module twice: {named:?}"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// ARCHITECTURE.md's module map as layers, top first: each line's modules (a line whose
/// names end in `,` goes on with the next).
fn architecture_layers(text: &str) -> Vec<Vec<String>> {
    let mut lines = text.lines().skip_while(|l| *l != "## Module map");
    lines.next();
    let mut layers: Vec<Vec<String>> = Vec::new();
    let mut open = false;
    for line in lines
        .skip_while(|l| *l != "```text")
        .skip(1)
        .take_while(|l| *l != "```")
    {
        if line.starts_with(' ') || line.is_empty() {
            continue;
        }
        let names = line.split("  ").next().unwrap_or("").trim();
        let these = names
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_owned);
        match layers.last_mut() {
            Some(last) if open => last.extend(these),
            _ => layers.push(these.collect()),
        }
        open = names.ends_with(',');
    }
    layers
}

/// `text` without its `#[cfg(test)]` modules: the unit tests at the bottom, and any other
/// test module (its braces matched; test code here has no unbalanced brace in a literal).
fn without_test_modules(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]\nmod ") {
        out.push_str(&rest[..at]);
        let module = &rest[at..];
        let Some(open) = module.find('{') else {
            return out;
        };
        let mut depth = 0usize;
        let mut end = module.len();
        for (i, c) in module[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &module[end..];
    }
    out.push_str(rest);
    out
}

/// The top-level modules `text` (one source file, its unit tests and comments left out)
/// names through `crate::` paths, `crate::{a, b::c}` included.
fn crate_uses(text: &str) -> Vec<String> {
    let code = without_test_modules(text)
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let word = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect()
    };
    let mut out = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(word(&item));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
            out.push(word(&item));
        } else {
            out.push(word(rest));
        }
    }
    out.retain(|w| !w.is_empty());
    out
}

/// The source files of top-level library module `module` (`src/<module>.rs` and
/// `src/<module>/**`), each with the top-level modules its code uses (`crate_uses`), and its
/// path under `src`.
fn module_uses(src: &Path, module: &str) -> Vec<(String, Vec<String>)> {
    let mut files = Vec::new();
    library_files(src, module, &mut files);
    files
        .iter()
        .filter_map(|file| {
            let rel = file.strip_prefix(src).unwrap();
            // `library_files` also finds a deeper `<module>.rs` of another module.
            let top = rel.components().next()?.as_os_str().to_string_lossy();
            (top.trim_end_matches(".rs") == module).then(|| {
                let text = std::fs::read_to_string(file).unwrap();
                (rel.display().to_string(), crate_uses(&text))
            })
        })
        .collect()
}

/// ARCHITECTURE.md's claim "a module uses only the modules listed below its own line",
/// checked against every `crate::` path outside unit tests and comments: no module reaches
/// up the map or beside it (a module on its own line), and so no circle runs through it.
#[test]
fn no_module_uses_one_listed_above_it() {
    let arch = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let layers = architecture_layers(&arch);
    let rank = |m: &str| layers.iter().position(|l| l.iter().any(|n| n == m));
    let src = root().join("src");
    let mut problems = Vec::new();
    let mut uses = 0;
    for layer in &layers {
        for module in layer {
            for (rel, used_all) in module_uses(&src, module) {
                for used in used_all {
                    let (Some(at), Some(own)) = (rank(&used), rank(module)) else {
                        continue;
                    };
                    uses += 1;
                    if at <= own && used != *module {
                        problems.push(format!(
                            "src/{rel}: uses crate::{used}, which ARCHITECTURE.md's module map lists above or beside `{module}`"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        layers.len() > 10 && uses > 100,
        "read {} layers and {uses} uses: the map or the sources were not found",
        layers.len()
    );
    problems.sort();
    problems.dedup();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The entry paths (ARCHITECTURE.md, "Adding an entry path"): how a container reaches
/// gpushare. What two of them need lives in `served` or below, never in one of them.
const ENTRY_PATHS: [&str; 4] = ["runtime", "hookonly", "nri", "cdi"];

/// No entry path uses another (every `crate::` path outside unit tests and comments).
#[test]
fn no_entry_path_uses_another() {
    let src = root().join("src");
    let mut problems = Vec::new();
    let mut read = 0;
    for path in ENTRY_PATHS {
        for (rel, used_all) in module_uses(&src, path) {
            read += 1;
            for used in used_all {
                if used != path && ENTRY_PATHS.contains(&used.as_str()) {
                    problems.push(format!(
                        "src/{rel}: the entry path `{path}` uses the entry path `{used}`; give what both need a home in `served` or below"
                    ));
                }
            }
        }
    }
    assert!(
        read >= ENTRY_PATHS.len(),
        "read only {read} files of the entry paths"
    );
    problems.sort();
    problems.dedup();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

// ---------------------------------------------------------------------------------------
// The configuration keys: docs/configuration.md and config/runtime.toml name exactly the
// keys the config parser accepts.

/// A key no config struct has: the parser's error for it lists the fields it accepts.
const UNKNOWN_KEY: &str = "zz-not-a-key";

/// The fields the table `[section]` accepts, from the parser's unknown-field error (serde
/// names them: "expected `a`", "expected `a` or `b`", "expected one of `a`, `b`, …");
/// `None` when `section` is not a table of fields.
fn accepted_fields(section: &str) -> Option<Vec<String>> {
    let text = if section.is_empty() {
        format!("{UNKNOWN_KEY} = 1\n")
    } else {
        format!("[{section}]\n{UNKNOWN_KEY} = 1\n")
    };
    let err = gpushare::config::parse(&text, None).err()?.to_string();
    if !err.contains(&format!("unknown field `{UNKNOWN_KEY}`")) {
        return None;
    }
    let expected = &err[err.rfind("expected")?..];
    Some(
        backticked(expected)
            .into_iter()
            .map(str::to_owned)
            .collect(),
    )
}

/// Every key the config parser accepts, dotted from the top (`state-dir`, `mps.shm-size`,
/// `cdi.profiles.<name>.pinned-memory-limit`): found by probing each table for its
/// fields, and each field for being a table itself (or a table of named tables, whose
/// entries are written `<name>`).
fn accepted_keys() -> Vec<String> {
    fn walk(section: &str, out: &mut Vec<String>) {
        let fields = accepted_fields(section)
            .unwrap_or_else(|| panic!("[{section}] lists no fields when given an unknown key"));
        for field in fields {
            let key = if section.is_empty() {
                field
            } else {
                format!("{section}.{field}")
            };
            if accepted_fields(&key).is_some() {
                walk(&key, out);
            } else if accepted_fields(&format!("{key}.x")).is_some() {
                out.push(format!("{key}.<name>"));
                let mut named = Vec::new();
                walk(&format!("{key}.x"), &mut named);
                let prefix = format!("{key}.x.");
                out.extend(
                    named
                        .iter()
                        .map(|k| format!("{key}.<name>.{}", k.strip_prefix(&prefix).unwrap())),
                );
            } else {
                out.push(key);
            }
        }
    }
    let mut out = Vec::new();
    walk("", &mut out);
    out.sort();
    out
}

/// The keys of docs/configuration.md's key tables: the first cell of each row under
/// "Top-level keys" and under each table's heading (`` ## `[mps]` ``), with the table's
/// prefix.
fn documented_keys(text: &str) -> Vec<String> {
    let mut prefix: Option<String> = None;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') {
            prefix = match line {
                "## Top-level keys" => Some(String::new()),
                _ => line
                    .strip_prefix("## `[")
                    .and_then(|rest| rest.strip_suffix("]`"))
                    .map(|table| format!("{table}.")),
            };
        } else if let (Some(prefix), Some(row)) = (&prefix, line.strip_prefix("| `")) {
            if let Some((key, _)) = row.split_once('`') {
                out.push(format!("{prefix}{key}"));
            }
        }
    }
    out.sort();
    out
}

/// The keys config/runtime.toml sets or shows commented out (`# key = …`), under its
/// `[table]` headers; an entry of a table of named tables (`[cdi.profiles.small]`) is
/// written `<name>`.
fn runtime_toml_keys(text: &str) -> Vec<String> {
    let mut section = String::new();
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.strip_prefix("# ").unwrap_or(line);
        if let Some(header) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = match header.strip_prefix("cdi.profiles.") {
                Some(_) => {
                    out.push("cdi.profiles.<name>".to_owned());
                    "cdi.profiles.<name>.".to_owned()
                }
                None => format!("{header}."),
            };
        } else if let Some((key, _)) = line.split_once(" = ") {
            if !key.is_empty() && key.bytes().all(|b| b.is_ascii_lowercase() || b == b'-') {
                out.push(format!("{section}{key}"));
            }
        }
    }
    out.sort();
    out
}

/// docs/configuration.md's key tables and config/runtime.toml name exactly the keys the
/// config parser accepts, each once: a key added to the config structs without its row
/// (or its line in the shipped file), or a row left behind by a removed key, fails.
#[test]
fn the_config_key_tables_are_the_accepted_keys() {
    let accepted = accepted_keys();
    assert!(
        accepted.len() > 30 && accepted.iter().any(|k| k == "mps.shm-size"),
        "the probe found only {accepted:?}"
    );
    let docs = std::fs::read_to_string(root().join("docs/configuration.md")).unwrap();
    let toml = std::fs::read_to_string(root().join("config/runtime.toml")).unwrap();
    let mut problems = Vec::new();
    for (place, named) in [
        ("docs/configuration.md", documented_keys(&docs)),
        ("config/runtime.toml", runtime_toml_keys(&toml)),
    ] {
        for k in accepted.iter().filter(|k| !named.contains(k)) {
            problems.push(format!("{place} lacks `{k}`, which the config accepts"));
        }
        for k in named.iter().filter(|k| !accepted.contains(k)) {
            problems.push(format!("{place} names `{k}`, which the config refuses"));
        }
        let mut unique = named.clone();
        unique.dedup();
        if unique.len() != named.len() {
            problems.push(format!("{place} names a key twice"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// docs/install.md's "What goes where" table names every systemd unit the Debian package
/// ships (its `assets` in Cargo.toml) and every file of deploy/ (shipped whole).
#[test]
fn the_package_table_names_every_unit_and_deploy_file() {
    let root = root();
    let text = std::fs::read_to_string(root.join("docs/install.md")).unwrap();
    let table = table_rows(&text, "| what | Debian package | scripts/install |").join("\n");
    let cargo = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let mut shipped: Vec<String> = cargo
        .lines()
        .filter_map(|l| l.split("\"usr/lib/systemd/system/").nth(1))
        .filter_map(|rest| rest.split('"').next())
        .map(str::to_owned)
        .collect();
    assert!(
        shipped.len() >= 3,
        "no systemd unit among the package's assets"
    );
    assert!(cargo.contains("[\"deploy/*\", \"usr/share/gpushare/deploy/\""));
    for entry in std::fs::read_dir(root.join("deploy")).unwrap().flatten() {
        shipped.push(entry.file_name().to_string_lossy().into_owned());
    }
    let missing: Vec<&String> = shipped
        .iter()
        .filter(|name| !table.contains(&format!("`{name}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/install.md's \"What goes where\" does not name {missing:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Commands: every one the operator's docs show is run by a test, or says why it cannot be.

/// The docs whose commands an operator types.
const COMMAND_DOCS: [&str; 3] = ["README.md", "docs/install.md", "docs/kubernetes.md"];

/// Where each documented command is run: tests/fixtures/doc-commands.txt.
const COMMAND_REGISTRY: &str = "tests/fixtures/doc-commands.txt";

/// The commands of `text`'s shell blocks (```sh, ```bash, ```console, indented or not), in
/// order, each once. A backslash continuation is joined into its line, a heredoc's body
/// belongs to the line that opens it (and is not a command), a trailing ` # …` comment is
/// dropped; a whole-line comment is skipped unless it offers another command (`# or: …`).
/// In a ```console block only `$ ` lines are commands (the rest is output).
fn doc_commands(text: &str) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    let mut block: Option<&str> = None;
    let mut heredoc: Option<String> = None;
    let mut pending = String::new();
    for raw in text.lines() {
        let line = raw.trim();
        if let Some(fence) = line.strip_prefix("```") {
            block = match block {
                Some(_) => None,
                None => Some(fence.trim()),
            };
            pending.clear();
            heredoc = None;
            continue;
        }
        let Some(lang) = block else { continue };
        if !matches!(lang, "sh" | "bash" | "shell" | "console") {
            continue;
        }
        if let Some(end) = &heredoc {
            if line == end {
                heredoc = None;
            }
            continue;
        }
        let mut line = line;
        if lang == "console" {
            match line.strip_prefix("$ ") {
                Some(rest) => line = rest,
                None if !pending.is_empty() => {}
                None => continue,
            }
        }
        if line.is_empty() {
            continue;
        }
        if let Some(comment) = line.strip_prefix('#') {
            match comment.trim().strip_prefix("or:") {
                Some(alternative) => line = alternative.trim(),
                None => continue,
            }
        }
        let line = strip_comment(line);
        if let Some(start) = line.strip_suffix('\\') {
            pending.push_str(start.trim_end());
            pending.push(' ');
            continue;
        }
        pending.push_str(line);
        let command = pending.split_whitespace().collect::<Vec<_>>().join(" ");
        pending.clear();
        if let Some(at) = command.find("<<") {
            let word = command[at + 2..].trim_start_matches('-');
            let word = word.split_whitespace().next().unwrap_or("");
            heredoc = Some(word.trim_matches(|c| c == '\'' || c == '"').to_owned());
        }
        if !found.contains(&command) {
            found.push(command);
        }
    }
    found
}

/// `line` without a trailing ` # …` comment (a `#` outside quotes, after a blank).
fn strip_comment(line: &str) -> &str {
    let (mut single, mut double) = (false, false);
    let mut prev = ' ';
    for (at, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && prev.is_whitespace() => return line[..at].trim_end(),
            _ => {}
        }
        prev = c;
    }
    line.trim_end()
}

/// One registry entry: a doc, a command exactly as the doc shows it (see `doc_commands`),
/// and what runs it: `test: module::name` or `script: scripts/…` (either may add a note),
/// `not here: why` (it needs what a test machine lacks) or `plain: why` (a shell or
/// engine command whose behaviour is not gpushare's) or `untested: why` (it could run
/// here and no test runs it yet).
struct Registered {
    doc: String,
    command: String,
    runner: String,
    line: usize,
}

/// The registry's entries: `<doc>: <command>` lines, each followed by an indented runner
/// line; `#` lines are comments.
fn command_registry(text: &str) -> Result<Vec<Registered>, String> {
    let mut entries: Vec<Registered> = Vec::new();
    let mut open: Option<(String, String, usize)> = None;
    for (n, raw) in text.lines().enumerate() {
        let n = n + 1;
        if raw.trim().is_empty() || raw.trim_start().starts_with('#') {
            continue;
        }
        if raw.starts_with(char::is_whitespace) {
            let Some((doc, command, line)) = open.take() else {
                return Err(format!("line {n}: a runner with no command above it"));
            };
            entries.push(Registered {
                doc,
                command,
                runner: raw.trim().to_owned(),
                line,
            });
            continue;
        }
        if let Some((_, command, line)) = &open {
            return Err(format!("line {line}: `{command}` has no runner line"));
        }
        let Some((doc, command)) = raw.split_once(": ") else {
            return Err(format!("line {n}: not `<doc>: <command>`"));
        };
        let command = command.split_whitespace().collect::<Vec<_>>().join(" ");
        open = Some((doc.to_owned(), command, n));
    }
    if let Some((_, command, line)) = open {
        return Err(format!("line {line}: `{command}` has no runner line"));
    }
    Ok(entries)
}

/// What is wrong between the docs' commands (`(doc, command)`) and the registry: a
/// command it does not list, an entry no doc shows, a runner that is no test, script or
/// reason.
fn command_problems(commands: &[(String, String)], registry: &[Registered]) -> Vec<String> {
    let mut problems = Vec::new();
    for (doc, command) in commands {
        if !registry
            .iter()
            .any(|r| &r.doc == doc && &r.command == command)
        {
            problems.push(format!(
                "{doc} shows `{command}`, which {COMMAND_REGISTRY} does not list: name the test that runs it, or why it cannot run here"
            ));
        }
    }
    for (i, r) in registry.iter().enumerate() {
        let where_ = format!("{COMMAND_REGISTRY}:{}", r.line);
        if registry[..i]
            .iter()
            .any(|o| o.doc == r.doc && o.command == r.command)
        {
            problems.push(format!(
                "{where_}: {} `{}` is listed twice",
                r.doc, r.command
            ));
        }
        if !commands
            .iter()
            .any(|(doc, command)| doc == &r.doc && command == &r.command)
        {
            problems.push(format!(
                "{where_}: {} shows no command `{}`",
                r.doc, r.command
            ));
        }
        if let Some(test) = r.runner.strip_prefix("test: ") {
            let test = test.split_whitespace().next().unwrap_or("");
            if !test.contains("::") || !missing_tests(&[test.to_owned()]).is_empty() {
                problems.push(format!("{where_}: no test {test}"));
            }
        } else if let Some(script) = r.runner.strip_prefix("script: ") {
            let script = script.split_whitespace().next().unwrap_or("");
            if !script.starts_with("scripts/") || !root().join(script).is_file() {
                problems.push(format!("{where_}: no script {script}"));
            }
        } else if let Some((kind, why)) = r.runner.split_once(": ") {
            if !matches!(kind, "not here" | "plain" | "untested") {
                problems.push(format!("{where_}: unknown runner kind `{kind}`"));
            } else if why.trim().is_empty() {
                problems.push(format!("{where_}: `{kind}:` without a reason"));
            }
        } else {
            problems.push(format!(
                "{where_}: runner `{}` is none of `test: module::name`, `script: scripts/…`, `not here: why`, `plain: why`, `untested: why`",
                r.runner
            ));
        }
    }
    problems
}

/// Every command README.md, docs/install.md and docs/kubernetes.md show is in the
/// registry with the test (or script of the test command) that runs it, or the reason it
/// cannot run on a test machine; a new command, a removed one or a renamed test fails.
#[test]
fn every_documented_command_is_run_by_a_test_or_says_why_not() {
    let root = root();
    let mut commands = Vec::new();
    for doc in COMMAND_DOCS {
        let text = std::fs::read_to_string(root.join(doc)).unwrap();
        for command in doc_commands(&text) {
            commands.push((doc.to_owned(), command));
        }
    }
    assert!(
        commands.len() > 50,
        "only {} commands found",
        commands.len()
    );
    let registry = std::fs::read_to_string(root.join(COMMAND_REGISTRY)).unwrap();
    let registry =
        command_registry(&registry).unwrap_or_else(|e| panic!("{COMMAND_REGISTRY}: {e}"));
    let problems = command_problems(&commands, &registry);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The parser and the check on a planted doc: a new command, a stale entry and a test
/// that does not exist are each named.
#[test]
fn the_command_check_names_a_new_command_a_stale_entry_and_a_missing_test() {
    let doc = "text\n```sh\ngpushare doctor   # exit 0\n# a comment\n# or: gpushare gc\n\
               ctr run --rm \\\n    img job1 true\ncat > f <<EOF\nnot = \"a command\"\nEOF\n```\n\
               ```console\n$ gpushare status\nno-daemons output\n```\n```toml\nx = 1\n```\n";
    let found = doc_commands(doc);
    assert_eq!(
        found,
        [
            "gpushare doctor",
            "gpushare gc",
            "ctr run --rm img job1 true",
            "cat > f <<EOF",
            "gpushare status"
        ]
    );
    let commands: Vec<(String, String)> = found
        .into_iter()
        .chain(["planted --command".to_owned()])
        .map(|c| ("d.md".to_owned(), c))
        .collect();
    let registry = command_registry(
        "# a comment\nd.md: gpushare doctor\n  test: operator::status_shows_daemons_health_and_containers_in_three_formats\n\
         d.md: gpushare gc\n  test: operator::no_such_test\nd.md: ctr run --rm img job1 true\n  not here: why\n\
         d.md: cat > f <<EOF\n  script: scripts/test\nd.md: gpushare status\n  guess\nd.md: gone\n  not here: x\nd.md: gone\n  plain: y\n",
    )
    .unwrap();
    let problems = command_problems(&commands, &registry).join("\n");
    for wanted in [
        "d.md shows `planted --command`",
        "d.md shows no command `gone`",
        "no test operator::no_such_test",
        "runner `guess`",
        "d.md `gone` is listed twice",
    ] {
        assert!(problems.contains(wanted), "{wanted} not in:\n{problems}");
    }
    assert_eq!(problems.lines().count(), 6, "{problems}");
    assert!(command_registry("d.md: x\nd.md: y\n  not here: z\n").is_err());
}

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
/// `src/**/<module>/*.rs`.
fn library_files(dir: &Path, module: &str, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if name == module {
                for f in std::fs::read_dir(&path).unwrap().flatten() {
                    if f.path().extension().is_some_and(|e| e == "rs") {
                        out.push(f.path());
                    }
                }
            }
            library_files(&path, module, out);
        } else if name == format!("{module}.rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_test_security_md_names_exists() {
    let text = std::fs::read_to_string(root().join("SECURITY.md")).unwrap();
    let names = named_paths(&text);
    assert!(
        names.len() > 20,
        "SECURITY.md names only {} tests",
        names.len()
    );
    let missing = missing_tests(&names);
    assert!(
        missing.is_empty(),
        "SECURITY.md names tests that do not exist: {missing:?}"
    );
}

/// docs/install.md's table of engines and versions names the test behind every cell.
#[test]
fn every_test_the_engine_table_names_exists() {
    let text = std::fs::read_to_string(root().join("docs/install.md")).unwrap();
    let names = named_paths(&text);
    assert!(
        names.len() >= 8,
        "docs/install.md names only {} tests",
        names.len()
    );
    let missing = missing_tests(&names);
    assert!(
        missing.is_empty(),
        "docs/install.md names tests that do not exist: {missing:?}"
    );
}

/// The names (`module::test`, `module::tests::test`, `module::tests`) that lead to no
/// function (or test module).
fn missing_tests(names: &[String]) -> Vec<String> {
    let root = root();
    let mut missing = Vec::new();
    for name in names {
        let parts: Vec<&str> = name.split("::").collect();
        let (module, item) = (parts[0], parts[parts.len() - 1]);
        let integration = root.join("tests/integration").join(format!("{module}.rs"));
        let mut files = Vec::new();
        if integration.is_file() && parts.len() == 2 {
            files.push(integration);
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

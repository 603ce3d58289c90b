//! Values and lists in error messages: a user's value quoted and escaped on one line, a list
//! of what exists cut after a few items.
//!
//! Invariants: nothing here returns text with a newline or a control character from its
//! input; a quoted value is at most 64 characters of the input.

use std::fmt;

/// Longest value shown in an error message before it is cut with `…`.
const QUOTE_MAX_CHARS: usize = 64;

/// Longest list of existing devices shown in an error message before `and N more`.
const LIST_MAX_ITEMS: usize = 8;

/// Quotes a user-supplied value for a one-line message: in double quotes, with NUL, newlines,
/// other control characters, `"` and `\` escaped as in Rust (`\0`, `\n`, `\u{1b}`), and cut
/// with `…` after 64 characters.
pub(crate) fn quote(raw: &str) -> String {
    let mut out = String::from("\"");
    let mut chars = raw.chars();
    for c in chars.by_ref().take(QUOTE_MAX_CHARS) {
        if c == '"' {
            out.push_str("\\\"");
        } else {
            crate::util::escape_char(c, &mut out);
        }
    }
    if chars.next().is_some() {
        out.push('…');
    }
    out.push('"');
    out
}

pub(super) fn gpu_list(existing: &[u32]) -> String {
    if existing.is_empty() {
        "this node has no GPUs".to_owned()
    } else {
        format!("this node has GPUs {}", join_capped(existing))
    }
}

pub(super) fn uuid_list(what: &str, existing: &[String]) -> String {
    if existing.is_empty() {
        format!("this node has no {what}")
    } else {
        format!("this node has {what} {}", join_capped(existing))
    }
}

pub(super) fn minor_list(existing: &[u32], unknown: usize) -> String {
    match (existing.is_empty(), unknown) {
        (true, 0) => "this node has no GPUs".to_owned(),
        (true, _) => "this node's inventory gives no minor numbers (an inventory file needs \"minor\" on each GPU)".to_owned(),
        (false, 0) => format!("this node's GPUs have minor numbers {}", join_capped(existing)),
        (false, n) => format!(
            "this node's GPUs have minor numbers {}, and {n} give none (an inventory file needs \"minor\" on each GPU)",
            join_capped(existing)
        ),
    }
}

pub(super) fn cap_list(existing: &[u32], unknown: usize) -> String {
    const NEEDS: &str =
        "an inventory file needs \"gi_caps_minor\" and \"ci_caps_minor\" on each MIG device";
    match (existing.is_empty(), unknown) {
        (true, 0) => "this node has no MIG devices".to_owned(),
        (true, _) => {
            format!("this node's inventory gives no cap minors for its MIG devices ({NEEDS})")
        }
        (false, 0) => format!(
            "this node's MIG devices have cap minors {}",
            join_capped(existing)
        ),
        (false, n) => format!(
            "this node's MIG devices have cap minors {}, and {n} give none ({NEEDS})",
            join_capped(existing)
        ),
    }
}

pub(super) fn parent_node(minor: Option<u32>) -> String {
    match minor {
        Some(minor) => format!("/dev/nvidia{minor}"),
        None => "(the inventory gives that GPU no minor number)".to_owned(),
    }
}

pub(super) fn mig_list(gpu: u32, existing: &[u32]) -> String {
    if existing.is_empty() {
        format!("GPU {gpu} has no MIG devices (MIG is not enabled or no instance is created)")
    } else {
        format!("GPU {gpu} has MIG devices {}", join_capped(existing))
    }
}

fn join_capped<T: fmt::Display>(items: &[T]) -> String {
    let mut out = items
        .iter()
        .take(LIST_MAX_ITEMS)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > LIST_MAX_ITEMS {
        out.push_str(&format!(" and {} more", items.len() - LIST_MAX_ITEMS));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quote_escapes_and_truncates() {
        let cases: &[(&str, &str)] = &[
            ("0", "\"0\""),
            ("a\0b", "\"a\\0b\""),
            ("a\nb", "\"a\\nb\""),
            ("\u{1b}[31m", "\"\\u{1b}[31m\""),
            ("say \"hi\"", "\"say \\\"hi\\\"\""),
        ];
        for (raw, want) in cases {
            assert_eq!(&quote(raw), want);
        }
        let long = "x".repeat(65);
        assert_eq!(quote(&long), format!("\"{}…\"", "x".repeat(64)));
        assert_eq!(quote(&"x".repeat(64)), format!("\"{}\"", "x".repeat(64)));
    }
}

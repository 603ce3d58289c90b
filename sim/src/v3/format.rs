//! The v3 list output: CSV or a table, with or without the header row.
//!
//! Invariants: CSV prints every cell in full, quoting (RFC 4180) a cell that holds a comma,
//! a quote or a line break, so a list of devices stays one cell; the table pads columns to
//! their widest cell and truncates a PID column's cells longer than 6 characters to their
//! first 3 and `...`, as measured on r615 by NVIDIA's KAI GPU-fractioning agent (a 7-digit
//! PID printed `316...`); only CSV is safe to parse.

use super::grammar::Format;

/// A list: column names (CSV spelling, lowercase), rows, and which column holds PIDs.
pub struct Listing<'a> {
    pub columns: &'a [&'a str],
    pub rows: Vec<Vec<String>>,
    pub pid_column: Option<usize>,
}

pub fn render(list: &Listing<'_>, format: Format) -> String {
    if format.csv {
        csv(list, format.header)
    } else {
        table(list, format.header)
    }
}

fn csv_cell(cell: &str) -> String {
    if cell.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", cell.replace('"', "\"\""))
    } else {
        cell.to_string()
    }
}

fn csv(list: &Listing<'_>, header: bool) -> String {
    let mut out = String::new();
    if header {
        out.push_str(&list.columns.join(","));
        out.push('\n');
    }
    for row in &list.rows {
        let cells: Vec<String> = row.iter().map(|c| csv_cell(c)).collect();
        out.push_str(&cells.join(","));
        out.push('\n');
    }
    out
}

/// A PID as the table shows it: 6 characters at most.
pub fn table_pid(pid: &str) -> String {
    if pid.chars().count() > 6 {
        format!("{}...", pid.chars().take(3).collect::<String>())
    } else {
        pid.to_string()
    }
}

fn table(list: &Listing<'_>, header: bool) -> String {
    let mut rows: Vec<Vec<String>> = Vec::new();
    if header {
        rows.push(list.columns.iter().map(|c| c.to_uppercase()).collect());
    }
    for row in &list.rows {
        rows.push(
            row.iter()
                .enumerate()
                .map(|(i, c)| {
                    if Some(i) == list.pid_column {
                        table_pid(c)
                    } else {
                        c.clone()
                    }
                })
                .collect(),
        );
    }
    let widths: Vec<usize> = (0..list.columns.len())
        .map(|i| {
            rows.iter()
                .filter_map(|r| r.get(i))
                .map(|c| c.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let pad = widths[i].saturating_sub(cell.chars().count()) + 2;
                line.push_str(cell);
                line.push_str(&" ".repeat(pad));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing() -> Listing<'static> {
        Listing {
            columns: &["pid", "server", "cmd"],
            rows: vec![
                vec!["3161234".into(), "s".into(), "python train.py".into()],
                vec!["42".into(), "s".into(), "a,b".into()],
            ],
            pid_column: Some(0),
        }
    }

    #[test]
    fn the_table_truncates_a_long_pid_and_csv_does_not() {
        assert_eq!(table_pid("3161234"), "316...");
        assert_eq!(table_pid("316123"), "316123");
        let table = render(&listing(), Format::default());
        assert_eq!(
            table,
            "PID     SERVER  CMD\n316...  s       python train.py\n42      s       a,b\n"
        );
        let csv = render(
            &listing(),
            Format {
                csv: true,
                header: true,
            },
        );
        assert_eq!(
            csv,
            "pid,server,cmd\n3161234,s,python train.py\n42,s,\"a,b\"\n"
        );
        let bare = render(
            &listing(),
            Format {
                csv: true,
                header: false,
            },
        );
        assert_eq!(bare.lines().next(), Some("3161234,s,python train.py"));
    }
}

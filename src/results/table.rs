//! A small table of runs and its four renderings: aligned text for a terminal, and CSV,
//! JSON and Markdown for scripts and reports. Numbers stay numbers in CSV and JSON; the text
//! renderings round metrics for reading (never config values, which must show how two runs
//! differ).

use clap::ValueEnum;

#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    Empty,
    Text(String),
    Int(i64),
    Float(f64),
    /// A value from a run's config: in JSON its native type (number, bool, string, array), in
    /// the other formats its plain text (a string without TOML's quotes, a number as TOML
    /// writes it, which reads back as the same number).
    Setting(toml::Value),
}

#[derive(Debug, Clone, Default)]
pub struct Table {
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Cell>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Aligned columns for a terminal.
    Table,
    /// RFC 4180 CSV with a header row; full precision.
    Csv,
    /// An array of objects, one per row, keys in column order; full precision.
    Json,
    /// A GitHub-flavoured Markdown table.
    Markdown,
}

impl Table {
    pub fn render(&self, format: Format) -> String {
        match format {
            Format::Table => self.aligned(),
            Format::Csv => self.csv(),
            Format::Json => self.json(),
            Format::Markdown => self.markdown(),
        }
    }

    fn aligned(&self) -> String {
        let cells: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| r.iter().map(|c| one_line(&readable(c))).collect())
            .collect();
        let widths: Vec<usize> = (0..self.columns.len())
            .map(|i| {
                cells
                    .iter()
                    .map(|r| r[i].chars().count())
                    .chain([self.columns[i].chars().count()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let numeric: Vec<bool> = (0..self.columns.len())
            .map(|i| {
                self.rows
                    .iter()
                    .all(|r| matches!(r[i], Cell::Int(_) | Cell::Float(_) | Cell::Empty))
            })
            .collect();
        let line = |fields: &[String]| {
            let padded: Vec<String> = fields
                .iter()
                .enumerate()
                .map(|(i, f)| {
                    let w = widths[i];
                    if numeric[i] {
                        format!("{f:>w$}")
                    } else {
                        format!("{f:<w$}")
                    }
                })
                .collect();
            padded.join("  ").trim_end().to_string() + "\n"
        };
        let mut out = line(&self.columns);
        for r in &cells {
            out += &line(r);
        }
        out
    }

    fn csv(&self) -> String {
        let mut w = csv::Writer::from_writer(Vec::new());
        // Writing to memory cannot fail.
        let _ = w.write_record(&self.columns);
        for r in &self.rows {
            let _ = w.write_record(r.iter().map(exact));
        }
        String::from_utf8(w.into_inner().unwrap_or_default()).unwrap_or_default()
    }

    /// Written by hand rather than through a `serde_json::Map`, which (without serde_json's
    /// preserve_order feature) sorts its keys: each object's keys are in column order, as
    /// `--help` says, so `run` comes first.
    fn json(&self) -> String {
        if self.rows.is_empty() {
            return "[]\n".into();
        }
        let key = |c: &String| serde_json::Value::from(c.as_str()).to_string();
        let objects: Vec<String> = self
            .rows
            .iter()
            .map(|r| {
                let fields: Vec<String> = self
                    .columns
                    .iter()
                    .zip(r)
                    .map(|(c, cell)| format!("    {}: {}", key(c), json_value(cell)))
                    .collect();
                format!("  {{\n{}\n  }}", fields.join(",\n"))
            })
            .collect();
        format!("[\n{}\n]\n", objects.join(",\n"))
    }

    fn markdown(&self) -> String {
        let row = |fields: Vec<String>| format!("| {} |\n", fields.join(" | "));
        let mut out = row(self.columns.iter().map(|c| markdown_text(c)).collect());
        out += &format!("|{}\n", " --- |".repeat(self.columns.len()));
        for r in &self.rows {
            out += &row(r.iter().map(|c| markdown_text(&readable(c))).collect());
        }
        out
    }
}

/// A value on one line: a newline (or another control character) in a value, say a layer
/// name, would start a new row of a table; it is shown escaped, as `\n`.
fn one_line(text: &str) -> String {
    if !text.chars().any(char::is_control) {
        return text.to_string();
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// One line, with the characters that Markdown would read as a cell boundary (`|`), code
/// (`` ` ``) or emphasis (`*`) escaped, and the backslash that escapes them.
fn markdown_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in one_line(text).chars() {
        if matches!(c, '\\' | '|' | '`' | '*') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// For people: four significant digits, or scientific notation for very small or large.
fn readable(cell: &Cell) -> String {
    match cell {
        Cell::Float(f) if *f == 0.0 || !f.is_finite() => f.to_string(),
        Cell::Float(f) if (1e-3..1e5).contains(&f.abs()) => {
            let decimals = (3 - f.abs().log10().floor() as i32).max(0) as usize;
            format!("{f:.decimals$}")
        }
        Cell::Float(f) => format!("{f:.3e}"),
        other => exact(other),
    }
}

/// For programs: the shortest text that reads back as the same number.
fn exact(cell: &Cell) -> String {
    match cell {
        Cell::Empty => String::new(),
        Cell::Text(s) => s.clone(),
        Cell::Int(i) => i.to_string(),
        Cell::Float(f) => f.to_string(),
        Cell::Setting(v) => plain(v),
    }
}

/// A config value as a person or a CSV reader expects it: `sgd`, not TOML's `"sgd"`; a float
/// as Rust's `{:?}` writes it (exact, and `1e30` rather than TOML's 31 digits). Arrays (betas,
/// input_shape) stay TOML's inline text, `[0.9, 0.999]`.
pub fn plain(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => s.clone(),
        toml::Value::Float(f) => format!("{f:?}"),
        other => other.to_string(),
    }
}

fn json_value(cell: &Cell) -> serde_json::Value {
    match cell {
        Cell::Empty => serde_json::Value::Null,
        Cell::Text(s) => s.clone().into(),
        Cell::Int(i) => (*i).into(),
        // NaN and infinities have no JSON number: null, as serde_json writes them.
        Cell::Float(f) => {
            serde_json::Number::from_f64(*f).map_or(serde_json::Value::Null, Into::into)
        }
        // toml's values serialise as their JSON counterparts (a datetime as its text).
        Cell::Setting(v) => serde_json::to_value(v).unwrap_or(serde_json::Value::Null),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_rounded_for_people_only() {
        assert_eq!(readable(&Cell::Float(0.97222222)), "0.9722");
        assert_eq!(readable(&Cell::Float(12.3456)), "12.35");
        assert_eq!(readable(&Cell::Float(1e-4)), "1.000e-4");
        assert_eq!(exact(&Cell::Float(0.97222222)), "0.97222222");
    }

    #[test]
    fn every_format_has_every_column() {
        let t = Table {
            columns: vec!["run".into(), "val_loss".into()],
            rows: vec![
                vec![Cell::Text("a|b".into()), Cell::Float(0.5)],
                vec![Cell::Text("c".into()), Cell::Empty],
            ],
        };
        assert_eq!(t.render(Format::Csv), "run,val_loss\na|b,0.5\nc,\n");
        assert_eq!(
            t.render(Format::Markdown),
            "| run | val_loss |\n| --- | --- |\n| a\\|b | 0.5000 |\n| c |  |\n"
        );
        assert_eq!(t.render(Format::Table), "run  val_loss\na|b    0.5000\nc\n");
        let json: serde_json::Value = serde_json::from_str(&t.render(Format::Json)).unwrap();
        assert_eq!(json[1]["val_loss"], serde_json::Value::Null);
    }

    #[test]
    fn json_keys_are_in_column_order() {
        let t = Table {
            columns: vec!["run".into(), "status".into(), "best_val_loss".into()],
            rows: vec![vec![
                Cell::Text("a".into()),
                Cell::Text("completed".into()),
                Cell::Float(0.25),
            ]],
        };
        let json = t.render(Format::Json);
        let at = |key: &str| json.find(&format!("\"{key}\"")).unwrap();
        assert!(
            at("run") < at("status") && at("status") < at("best_val_loss"),
            "{json}"
        );
        let parsed: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(parsed[0]["best_val_loss"], 0.25);
        assert_eq!(Table::default().render(Format::Json), "[]\n");
    }

    #[test]
    fn config_values_are_native_in_json_and_plain_text_elsewhere() {
        let value = |text: &str| {
            let table: toml::Table = toml::from_str(&format!("v = {text}")).unwrap();
            Cell::Setting(table["v"].clone())
        };
        let t = Table {
            columns: ["lr", "type", "nesterov", "out", "betas"]
                .map(String::from)
                .to_vec(),
            rows: vec![vec![
                value("1e-2"),
                value("\"sgd\""),
                value("true"),
                value("16"),
                value("[0.9, 0.99]"),
            ]],
        };
        // Exact, and short: 1e30, not TOML's 31 digits.
        assert_eq!(exact(&value("1e30")), "1e30");
        assert_eq!(
            t.render(Format::Csv),
            "lr,type,nesterov,out,betas\n0.01,sgd,true,16,\"[0.9, 0.99]\"\n"
        );
        let json: serde_json::Value = serde_json::from_str(&t.render(Format::Json)).unwrap();
        assert_eq!(
            json[0],
            serde_json::json!({"lr": 0.01, "type": "sgd", "nesterov": true, "out": 16,
                               "betas": [0.9, 0.99]})
        );
        assert!(t
            .render(Format::Table)
            .ends_with("\n0.01  sgd   true      16   [0.9, 0.99]\n"));
    }

    #[test]
    fn a_newline_in_a_value_does_not_start_a_row() {
        let t = Table {
            columns: vec!["run".into(), "name".into()],
            rows: vec![vec![Cell::Text("a".into()), Cell::Text("h\nx*`|".into())]],
        };
        assert_eq!(t.render(Format::Table), "run  name\na    h\\nx*`|\n");
        assert_eq!(
            t.render(Format::Markdown),
            "| run | name |\n| --- | --- |\n| a | h\\\\nx\\*\\`\\| |\n"
        );
        // CSV keeps it, quoted: it reads back as the value.
        let csv = t.render(Format::Csv);
        let mut reader = csv::Reader::from_reader(csv.as_bytes());
        assert_eq!(&reader.records().next().unwrap().unwrap()[1], "h\nx*`|");
    }
}

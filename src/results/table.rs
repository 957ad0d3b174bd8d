//! A small table of runs and its four renderings: aligned text for a terminal, and CSV,
//! JSON and Markdown for scripts and reports. Numbers stay numbers in CSV and JSON; the text
//! renderings round them for reading.

use clap::ValueEnum;

#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    Empty,
    Text(String),
    Int(i64),
    Float(f64),
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
            .map(|r| r.iter().map(readable).collect())
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

    fn json(&self) -> String {
        let rows: Vec<serde_json::Value> = self
            .rows
            .iter()
            .map(|r| {
                let object: serde_json::Map<String, serde_json::Value> = self
                    .columns
                    .iter()
                    .zip(r)
                    .map(|(c, cell)| (c.clone(), json_value(cell)))
                    .collect();
                serde_json::Value::Object(object)
            })
            .collect();
        serde_json::to_string_pretty(&rows).unwrap_or_default() + "\n"
    }

    fn markdown(&self) -> String {
        let escape = |s: String| s.replace('|', "\\|");
        let mut out = format!("| {} |\n", self.columns.join(" | "));
        out += &format!("|{}\n", " --- |".repeat(self.columns.len()));
        for r in &self.rows {
            let fields: Vec<String> = r.iter().map(|c| escape(readable(c))).collect();
            out += &format!("| {} |\n", fields.join(" | "));
        }
        out
    }
}

/// For people: four significant digits, or scientific notation for very small or large.
fn readable(cell: &Cell) -> String {
    match cell {
        Cell::Empty => String::new(),
        Cell::Text(s) => s.clone(),
        Cell::Int(i) => i.to_string(),
        Cell::Float(f) if *f == 0.0 || !f.is_finite() => f.to_string(),
        Cell::Float(f) if (1e-3..1e5).contains(&f.abs()) => {
            let decimals = (3 - f.abs().log10().floor() as i32).max(0) as usize;
            format!("{f:.decimals$}")
        }
        Cell::Float(f) => format!("{f:.3e}"),
    }
}

/// For programs: the shortest text that reads back as the same number.
fn exact(cell: &Cell) -> String {
    match cell {
        Cell::Empty => String::new(),
        Cell::Text(s) => s.clone(),
        Cell::Int(i) => i.to_string(),
        Cell::Float(f) => f.to_string(),
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
}

//! The bench's result: rows of (scenario, dataplane, figure, value, unit, ratio), printed
//! as one table and written as JSON. A figure that could not be measured is a row with an
//! error, never a made-up number.
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub scenario: String,
    pub dataplane: String,
    pub figure: String,
    /// A number, or a word such as "success" for outcomes.
    pub value: serde_json::Value,
    pub unit: String,
    /// value / the reference's value for the same figure in the same run.
    pub ratio: Option<f64>,
    /// What the ratio compares against: "none" (no enforcement) or a dataplane.
    pub reference: Option<String>,
    pub error: Option<String>,
}

impl Row {
    pub fn number(scenario: &str, dataplane: &str, figure: &str, value: f64, unit: &str) -> Self {
        Row {
            scenario: scenario.into(),
            dataplane: dataplane.into(),
            figure: figure.into(),
            value: serde_json::json!(round(value)),
            unit: unit.into(),
            ratio: None,
            reference: None,
            error: None,
        }
    }

    pub fn text(scenario: &str, dataplane: &str, figure: &str, value: &str) -> Self {
        Row {
            value: serde_json::json!(value),
            ..Row::number(scenario, dataplane, figure, 0.0, "")
        }
    }

    pub fn failed(scenario: &str, dataplane: &str, figure: &str, error: String) -> Self {
        Row {
            value: serde_json::Value::Null,
            error: Some(error),
            ..Row::number(scenario, dataplane, figure, 0.0, "")
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        self.value.as_f64()
    }
}

/// Errors may quote a log: the table shows them on one line, shortened (the JSON keeps
/// them whole).
fn one_line(text: &str) -> String {
    const MAX: usize = 300;
    let joined = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match joined.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}...", &joined[..cut]),
        None => joined,
    }
}

/// Four significant digits are more than the noise allows.
fn round(v: f64) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let scale = 10f64.powi(3 - v.abs().log10().floor() as i32);
    (v * scale).round() / scale
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub command: String,
    pub quick: bool,
    pub profile: String,
    pub kernel: String,
    pub started_unix: u64,
    pub seconds: f64,
    /// How to read the figures (printed under the table).
    pub notes: Vec<String>,
    /// The peers measured and their versions (`--peers`), by name as the rows give it.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub versions: std::collections::BTreeMap<String, String>,
    pub rows: Vec<Row>,
}

impl Report {
    /// Sets each row's ratio to its value over the value of the same scenario and figure
    /// on the reference dataplane.
    pub fn add_ratios(&mut self, scenario: &str, reference: &str) {
        let refs: Vec<(String, f64)> = self
            .rows
            .iter()
            .filter(|r| r.scenario == scenario && r.dataplane == reference)
            .filter_map(|r| Some((r.figure.clone(), r.as_f64()?)))
            .collect();
        for row in self.rows.iter_mut().filter(|r| r.scenario == scenario) {
            let base = refs.iter().find(|(f, _)| *f == row.figure).map(|(_, v)| *v);
            if let (Some(v), Some(b)) = (row.as_f64(), base) {
                if b != 0.0 {
                    row.ratio = Some((v / b * 100.0).round() / 100.0);
                    row.reference = Some(reference.to_string());
                }
            }
        }
    }

    pub fn failures(&self) -> Vec<&Row> {
        self.rows.iter().filter(|r| r.error.is_some()).collect()
    }

    pub fn table(&self) -> String {
        let header = ["scenario", "dataplane", "figure", "value", "unit", "ratio"];
        let cells: Vec<[String; 6]> = self
            .rows
            .iter()
            .map(|r| {
                let value = match (&r.error, &r.value) {
                    (Some(e), _) => format!("ERROR: {}", one_line(e)),
                    (None, serde_json::Value::String(s)) => s.clone(),
                    (None, v) => match v.as_f64() {
                        Some(x) if x.fract() == 0.0 && x.abs() < 1e15 => format!("{x:.0}"),
                        _ => v.to_string(),
                    },
                };
                let ratio = match (&r.ratio, &r.reference) {
                    (Some(x), Some(reference)) => format!("{x:.2} (vs {reference})"),
                    _ => String::new(),
                };
                [
                    r.scenario.clone(),
                    r.dataplane.clone(),
                    r.figure.clone(),
                    value,
                    r.unit.clone(),
                    ratio,
                ]
            })
            .collect();
        // The value column holds errors, which may be long: it is not padded.
        let mut widths = header.map(str::len);
        for row in &cells {
            for (w, c) in widths.iter_mut().zip(row) {
                if !c.starts_with("ERROR") {
                    *w = (*w).max(c.chars().count());
                }
            }
        }
        let mut out = String::new();
        let mut line = |cols: [&str; 6]| {
            let mut l = String::new();
            for (i, c) in cols.iter().enumerate() {
                if i == 3 && c.starts_with("ERROR") {
                    let _ = write!(l, "{c}  ");
                    continue;
                }
                let _ = write!(l, "{c:<w$}  ", w = widths[i]);
            }
            out.push_str(l.trim_end());
            out.push('\n');
        };
        line(header);
        for row in &cells {
            line([&row[0], &row[1], &row[2], &row[3], &row[4], &row[5]]);
        }
        for note in &self.notes {
            out.push_str(&format!("note: {note}\n"));
        }
        out
    }

    pub fn write_json(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(rows: Vec<Row>) -> Report {
        Report {
            command: "test".into(),
            quick: true,
            profile: "debug".into(),
            kernel: String::new(),
            started_unix: 0,
            seconds: 0.0,
            notes: Vec::new(),
            versions: Default::default(),
            rows,
        }
    }

    #[test]
    fn ratios_compare_the_same_figure_of_the_same_scenario() {
        let mut r = report(vec![
            Row::number("s", "none", "rtt", 20.0, "µs"),
            Row::number("s", "ebpf", "rtt", 21.0, "µs"),
            Row::number("s", "ebpf", "other", 5.0, "µs"),
            Row::number("t", "ebpf", "rtt", 40.0, "µs"),
        ]);
        r.add_ratios("s", "none");
        let ratios: Vec<Option<f64>> = r.rows.iter().map(|r| r.ratio).collect();
        assert_eq!(ratios, [Some(1.0), Some(1.05), None, None]);
    }

    #[test]
    fn errors_show_on_one_line_and_count_as_failures() {
        let r = report(vec![Row::failed(
            "s",
            "ebpf",
            "all figures",
            "not available:\nline two".into(),
        )]);
        assert_eq!(r.failures().len(), 1);
        let table = r.table();
        assert_eq!(table.lines().count(), 2);
        assert!(table.contains("ERROR: not available: line two"));
    }

    #[test]
    fn values_keep_four_significant_digits() {
        assert_eq!(round(123.456), 123.5);
        assert_eq!(round(0.0012345), 0.001235);
        assert_eq!(round(98765.0), 98770.0);
    }
}

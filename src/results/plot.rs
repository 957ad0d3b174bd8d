//! `trainer plot`: learning curves of one or several runs overlaid, one panel per metric,
//! one colour per run; training rows as a thin line, validation as a thick line with
//! markers, test dashed. PNG or SVG by the output's extension.
//!
//! Text is drawn with a font embedded in the binary (DejaVu Sans, through plotters' ab_glyph
//! feature), so plotting needs no system font libraries.

use super::table::plain;
use super::{differing_keys, flat_config, labels, RunRecord, Status};
use crate::error::Result;
use crate::{job_err, runtime_err};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;
use std::sync::Once;

static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";

/// What to put on the x axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum XAxis {
    /// Optimizer steps.
    Step,
    /// Epochs; training rows fall between epochs by their step.
    Epoch,
}

/// One panel: a metric column (`loss`), optionally of one split only (`val_accuracy`).
struct Panel {
    column: String,
    split: Option<String>,
}

/// One line on a panel.
struct Curve {
    run: usize,
    split: String,
    points: Vec<(f64, f64)>,
}

const PANEL_HEIGHT: u32 = 420;
const WIDTH: u32 = 1100;

/// Plots `metrics` (default: loss, and accuracy when a run has it) of `runs` into `out`.
pub fn plot(runs: &[RunRecord], metrics: &[String], x: XAxis, out: &Path) -> Result<()> {
    if runs.is_empty() {
        return Err(job_err!("no runs to plot"));
    }
    let panels = choose_panels(runs, metrics)?;
    register_font()?;
    let legend = Legend::new(&run_names(runs), runs)?;
    let size = (
        WIDTH + legend.width,
        (PANEL_HEIGHT * panels.len() as u32).max(legend.height),
    );
    let extension = out
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    // plotters would only say so after drawing, in its Debug form.
    let dir = out.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir.filter(|d| !d.is_dir()) {
        return Err(job_err!(
            "-o {}: the directory {} does not exist",
            out.display(),
            dir.display()
        ));
    }
    let draw_err = |e: String| runtime_err!("cannot draw {}: {e}", out.display());
    match extension.as_deref() {
        Some("png") => {
            let root = BitMapBackend::new(out, size).into_drawing_area();
            draw(&root, runs, &panels, &legend, x).map_err(draw_err)?;
            root.present().map_err(|e| draw_err(e.to_string()))
        }
        Some("svg") => {
            let root = SVGBackend::new(out, size).into_drawing_area();
            draw(&root, runs, &panels, &legend, x).map_err(draw_err)?;
            root.present().map_err(|e| draw_err(e.to_string()))
        }
        _ => Err(job_err!(
            "-o {}: unknown image format; allowed: a file name ending in .png or .svg",
            out.display()
        )),
    }
}

fn register_font() -> Result<()> {
    static REGISTER: Once = Once::new();
    let mut ok = true;
    REGISTER.call_once(|| {
        ok = plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok();
    });
    if ok {
        Ok(())
    } else {
        Err(runtime_err!("the embedded font could not be loaded"))
    }
}

fn choose_panels(runs: &[RunRecord], metrics: &[String]) -> Result<Vec<Panel>> {
    let available: Vec<String> = {
        let mut v: Vec<String> = runs.iter().flat_map(|r| r.metric_names()).collect();
        v.sort();
        v.dedup();
        v
    };
    let has = |name: &str| {
        available
            .iter()
            .any(|a| a == name || a.ends_with(&format!("_{name}")))
    };
    if let Some(i) = metrics.iter().position(|m| m.trim().is_empty()) {
        return Err(job_err!(
            "--metric {:?}: metric {} of the list is empty; give names separated by commas, \
             e.g. --metric loss,val_accuracy",
            metrics.join(","),
            i + 1
        ));
    }
    if available.is_empty() {
        return Err(no_rows(runs));
    }
    let wanted: Vec<String> = if metrics.is_empty() {
        ["loss", "accuracy"]
            .into_iter()
            .filter(|m| has(m))
            .map(String::from)
            .collect()
    } else {
        metrics.to_vec()
    };
    let mut panels = Vec::new();
    for m in wanted {
        if !has(&m) {
            let columns: Vec<&str> = available
                .iter()
                .filter_map(|a| a.split_once('_').map(|(_, c)| c))
                .collect();
            let mut columns = columns;
            columns.sort();
            columns.dedup();
            return Err(job_err!(
                "--metric {m}: no run has it; allowed: {} (a column for every split), or one split's: {}",
                columns.join(", "),
                available.join(", ")
            ));
        }
        let panel = match available
            .iter()
            .find(|a| **a == m)
            .and_then(|a| a.split_once('_'))
        {
            Some((split, column)) => Panel {
                column: column.into(),
                split: Some(split.into()),
            },
            None => Panel {
                column: m,
                split: None,
            },
        };
        panels.push(panel);
    }
    if panels.is_empty() {
        return Err(no_rows(runs));
    }
    Ok(panels)
}

/// Nothing to plot: "yet" only when a run may still write rows.
fn no_rows(runs: &[RunRecord]) -> crate::error::Error {
    // A metrics.csv that is gone or emptied lost its rows; the run did not end early.
    let lost: Vec<String> = runs
        .iter()
        .filter(|r| !matches!(r.status, Status::Running | Status::Unfinished))
        .map(|r| r.dir.join("metrics.csv"))
        .filter_map(|path| match std::fs::metadata(&path) {
            Err(_) => Some(format!("{} is missing", path.display())),
            Ok(m) if m.len() == 0 => Some(format!("{} is empty", path.display())),
            Ok(_) => None,
        })
        .collect();
    if !lost.is_empty() {
        return job_err!("the runs have no metrics rows: {}", lost.join(", "));
    }
    let still = runs
        .iter()
        .any(|r| matches!(r.status, Status::Running | Status::Unfinished));
    if still {
        job_err!("the runs have no metrics rows yet")
    } else {
        job_err!(
            "the runs have no metrics rows: they ended before their first logged step (`trainer \
             ls` shows how each ended, its summary.json why)"
        )
    }
}

/// Legend names: the keys that differ between the runs and their values (`lr=0.001
/// batch_size=64`), else the run directories. Every key is named in full enough to tell it
/// from the others (`job.name` and `layers[1].name`, not two `name`s), nothing is cut off,
/// and two runs whose values are all the same (a job run twice) are told apart by their
/// directories.
fn run_names(runs: &[RunRecord]) -> Vec<String> {
    let keys = differing_keys(runs);
    let paths = labels(runs);
    if keys.is_empty() || runs.len() == 1 {
        return paths;
    }
    let short = short_keys(&keys);
    let names: Vec<String> = runs
        .iter()
        .map(|run| {
            let flat = flat_config(&run.config);
            let parts: Vec<String> = keys
                .iter()
                .zip(&short)
                .map(|(k, short)| format!("{short}={}", flat.get(k).map_or("-".into(), plain)))
                .collect();
            parts.join(" ")
        })
        .collect();
    names
        .iter()
        .zip(&paths)
        .map(|(name, path)| {
            if names.iter().filter(|n| *n == name).count() > 1 {
                format!("{name} ({path})")
            } else {
                name.clone()
            }
        })
        .collect()
}

/// Each dotted key by its shortest ending that is no other key's ending: `lr` for
/// `optimizer.lr`, but `job.name` and `layers[1].name` for `job.name` and
/// `model.layers[1].name`.
fn short_keys(keys: &[String]) -> Vec<String> {
    keys.iter()
        .map(|key| {
            let parts: Vec<&str> = key.split('.').collect();
            (1..parts.len())
                .map(|n| parts[parts.len() - n..].join("."))
                .find(|ending| {
                    let dotted = format!(".{ending}");
                    keys.iter()
                        .filter(|other| *other != key)
                        .all(|other| other != ending && !other.ends_with(&dotted))
                })
                .unwrap_or_else(|| key.clone())
        })
        .collect()
}

/// The figure's legend: each run's colour and name (wrapped, not cut), then how each split
/// is drawn. Sized to its text, so that it never runs past the image.
struct Legend {
    /// Per run, in the runs' order (the colours' order): its name in lines.
    runs: Vec<Vec<String>>,
    /// The splits that have rows, train first.
    splits: Vec<String>,
    width: u32,
    height: u32,
}

const LEGEND_FONT: u32 = 17;
const LEGEND_LINE: u32 = 22;
/// Characters on a legend line before a name wraps at a space.
const LEGEND_WRAP: usize = 44;
/// Left of the text: the line sample.
const SAMPLE: u32 = 44;
const LEGEND_TOP: u32 = 48;

impl Legend {
    fn new(names: &[String], runs: &[RunRecord]) -> Result<Legend> {
        let runs_lines: Vec<Vec<String>> = names.iter().map(|n| wrap(n, LEGEND_WRAP)).collect();
        let mut splits: Vec<String> = Vec::new();
        for p in runs.iter().flat_map(|r| &r.points) {
            if !splits.contains(&p.split) {
                splits.push(p.split.clone());
            }
        }
        let rank = |split: &String| ["train", "val", "test"].iter().position(|s| s == split);
        splits.sort_by_key(|s| (rank(s).unwrap_or(3), s.clone()));
        let font: FontDesc = (FAMILY, LEGEND_FONT).into_font();
        let mut text_width = 0;
        for line in runs_lines.iter().flatten().chain(&splits) {
            let (w, _) = font
                .box_size(line)
                .map_err(|e| runtime_err!("cannot measure the legend's text: {e}"))?;
            text_width = text_width.max(w);
        }
        let lines = runs_lines.iter().map(Vec::len).sum::<usize>() + splits.len();
        let gaps = runs_lines.len() + splits.len() + 2;
        Ok(Legend {
            width: SAMPLE + text_width + 24,
            height: LEGEND_TOP + LEGEND_LINE * lines as u32 + 6 * gaps as u32 + 24,
            runs: runs_lines,
            splits,
        })
    }

    fn draw<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
    ) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
        enum Sample {
            Run(RGBColor),
            Split(String),
        }
        let entries = self
            .runs
            .iter()
            .enumerate()
            .map(|(run, lines)| (lines.clone(), Sample::Run(COLOURS[run % COLOURS.len()])))
            .chain(
                self.splits
                    .iter()
                    .map(|split| (vec![split.clone()], Sample::Split(split.clone()))),
            );
        let font = (FAMILY, LEGEND_FONT).into_font().color(&BLACK);
        let grey = BLACK.mix(0.6);
        let mut y = LEGEND_TOP as i32;
        for (i, (lines, sample)) in entries.enumerate() {
            if i == self.runs.len() {
                y += 12; // the runs, then the key to the splits
            }
            let at = y + LEGEND_LINE as i32 / 2;
            let line = |from: i32, to: i32, style: ShapeStyle| {
                PathElement::new(vec![(from, at), (to, at)], style)
            };
            match sample {
                Sample::Run(colour) => area.draw(&line(8, 36, colour.stroke_width(3)))?,
                Sample::Split(split) if split == "train" => {
                    area.draw(&line(8, 36, grey.stroke_width(1)))?
                }
                Sample::Split(split) if split == "test" => {
                    area.draw(&line(8, 18, grey.stroke_width(3)))?;
                    area.draw(&line(26, 36, grey.stroke_width(3)))?;
                }
                // Other evaluation splits: thick, with a marker on each evaluation.
                Sample::Split(_) => {
                    area.draw(&line(8, 36, grey.stroke_width(3)))?;
                    area.draw(&Circle::new((22, at), 3, grey.filled()))?;
                }
            }
            for text in lines {
                area.draw(&Text::new(text, (SAMPLE as i32, y), font.clone()))?;
                y += LEGEND_LINE as i32;
            }
            y += 6;
        }
        Ok(())
    }
}

/// `text` in lines of at most `width` characters, broken at spaces (a longer word has a line
/// of its own).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for word in text.split(' ') {
        match lines.last_mut() {
            Some(line) if line.chars().count() + 1 + word.chars().count() <= width => {
                line.push(' ');
                line.push_str(word);
            }
            _ => lines.push(word.to_string()),
        }
    }
    lines
}

fn curves(runs: &[RunRecord], panel: &Panel, x: XAxis) -> Vec<Curve> {
    let mut out: Vec<Curve> = Vec::new();
    for (i, run) in runs.iter().enumerate() {
        let steps_per_epoch = steps_per_epoch(run);
        for p in &run.points {
            if panel.split.as_ref().is_some_and(|s| *s != p.split) {
                continue;
            }
            let Some(&y) = p.values.get(&panel.column) else {
                continue;
            };
            let xv = match x {
                XAxis::Step => p.step as f64,
                XAxis::Epoch => p.step as f64 / steps_per_epoch,
            };
            match out.iter_mut().find(|c| c.run == i && c.split == p.split) {
                Some(c) => c.points.push((xv, y)),
                None => out.push(Curve {
                    run: i,
                    split: p.split.clone(),
                    points: vec![(xv, y)],
                }),
            }
        }
    }
    // Per run: train, then val, then test (the legend's order).
    let rank = |split: &str| ["train", "val", "test"].iter().position(|&s| s == split);
    out.sort_by_key(|c| (c.run, rank(&c.split)));
    out
}

/// From the first evaluation (at the end of epoch 1), else from the last row.
fn steps_per_epoch(run: &RunRecord) -> f64 {
    let first_eval = run
        .points
        .iter()
        .find(|p| p.split != "train" && p.epoch == 1);
    let estimate = match (first_eval, run.points.last()) {
        (Some(p), _) => p.step as f64,
        (None, Some(last)) => last.step as f64 / last.epoch.max(1) as f64,
        (None, None) => 1.0,
    };
    estimate.max(1.0)
}

const COLOURS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[RunRecord],
    panels: &[Panel],
    legend: &Legend,
    x: XAxis,
) -> std::result::Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let (charts, legend_area) = root.split_horizontally(WIDTH);
    legend.draw(&legend_area).map_err(e)?;
    let x_name = match x {
        XAxis::Step => "step",
        XAxis::Epoch => "epoch",
    };
    for (area, panel) in charts.split_evenly((panels.len(), 1)).iter().zip(panels) {
        let curves = curves(runs, panel, x);
        let all = curves.iter().flat_map(|c| c.points.iter());
        let (x_max, y_min, y_max) = all.fold(
            (0f64, f64::INFINITY, f64::NEG_INFINITY),
            |(xm, lo, hi), &(x, y)| {
                if y.is_finite() {
                    (xm.max(x), lo.min(y), hi.max(y))
                } else {
                    (xm.max(x), lo, hi)
                }
            },
        );
        let (y_lo, y_hi) = padded(y_min, y_max);
        let title = match &panel.split {
            Some(s) => format!("{s}_{}", panel.column),
            None => panel.column.clone(),
        };
        let mut chart = ChartBuilder::on(area)
            .caption(&title, (FAMILY, 28))
            .margin(14)
            .x_label_area_size(48)
            .y_label_area_size(88)
            .build_cartesian_2d(0f64..x_max.max(1.0), y_lo..y_hi)
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc(x_name)
            .y_desc(&title)
            .x_label_formatter(&|v| {
                // Steps and whole epochs without a decimal point.
                if v.fract() == 0.0 {
                    format!("{v:.0}")
                } else {
                    format!("{v:.1}")
                }
            })
            .label_style((FAMILY, 17))
            .axis_desc_style((FAMILY, 19))
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(e)?;
        for c in &curves {
            let colour = COLOURS[c.run % COLOURS.len()];
            let points = c.points.iter().copied().filter(|(_, y)| y.is_finite());
            let (style, marker) = match c.split.as_str() {
                "train" => (colour.mix(0.55).stroke_width(1), 0),
                _ => (colour.stroke_width(3), 3),
            };
            if c.split == "test" {
                chart
                    .draw_series(DashedLineSeries::new(points, 8, 5, style))
                    .map_err(e)?;
            } else {
                chart
                    .draw_series(LineSeries::new(points, style).point_size(marker))
                    .map_err(e)?;
            }
        }
    }
    Ok(())
}

fn padded(lo: f64, hi: f64) -> (f64, f64) {
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    let span = if hi > lo {
        hi - lo
    } else {
        lo.abs().max(1.0) * 0.1
    };
    (lo - 0.05 * span, hi + 0.05 * span)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legend_keys_are_as_long_as_it_takes_to_tell_them_apart() {
        let keys = ["job.name", "model.layers[1].name", "optimizer.lr"].map(String::from);
        assert_eq!(short_keys(&keys), ["job.name", "layers[1].name", "lr"]);
        let nested = ["a.b.c", "x.b.c", "y"].map(String::from);
        assert_eq!(short_keys(&nested), ["a.b.c", "x.b.c", "y"]);
    }

    #[test]
    fn long_names_wrap_at_spaces_and_lose_nothing() {
        assert_eq!(wrap("ab cd ef", 5), ["ab cd", "ef"]);
        assert_eq!(wrap("abcdefgh ij", 5), ["abcdefgh", "ij"]);
        assert_eq!(wrap("ab", 5), ["ab"]);
    }
}

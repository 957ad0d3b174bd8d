//! `trainer plot`: learning curves of one or several runs overlaid, one panel per metric,
//! one colour per run; training rows as a thin line, validation as a thick line with
//! markers, test dashed. PNG or SVG by the output's extension.
//!
//! Text is drawn with a font embedded in the binary (DejaVu Sans, through plotters' ab_glyph
//! feature), so plotting needs no system font libraries.

use super::{differing_keys, labels, RunRecord};
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
    let names = run_names(runs);
    let height = PANEL_HEIGHT * panels.len() as u32;
    register_font()?;
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
            let root = BitMapBackend::new(out, (WIDTH, height)).into_drawing_area();
            draw(&root, runs, &panels, &names, x).map_err(draw_err)?;
            root.present().map_err(|e| draw_err(e.to_string()))
        }
        Some("svg") => {
            let root = SVGBackend::new(out, (WIDTH, height)).into_drawing_area();
            draw(&root, runs, &panels, &names, x).map_err(draw_err)?;
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
        return Err(job_err!("the runs have no metrics rows yet"));
    }
    Ok(panels)
}

/// Legend names: the keys that differ between the runs (`lr=0.001 batch_size=64`), else the
/// run directories.
fn run_names(runs: &[RunRecord]) -> Vec<String> {
    let keys = differing_keys(runs);
    if keys.is_empty() || runs.len() == 1 {
        return labels(runs);
    }
    runs.iter()
        .map(|run| {
            let flat = super::flat_config(&run.config);
            let parts: Vec<String> = keys
                .iter()
                .map(|k| {
                    let short = k.rsplit('.').next().unwrap_or(k);
                    format!("{short}={}", flat.get(k).map_or("-", |v| v.as_str()))
                })
                .collect();
            let name = parts.join(" ");
            if name.chars().count() > 48 {
                name.chars().take(47).collect::<String>() + "…"
            } else {
                name
            }
        })
        .collect()
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
    names: &[String],
    x: XAxis,
) -> std::result::Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let x_name = match x {
        XAxis::Step => "step",
        XAxis::Epoch => "epoch",
    };
    for (area, panel) in root.split_evenly((panels.len(), 1)).iter().zip(panels) {
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
            let label = format!("{} {}", names[c.run], c.split);
            let points = c.points.iter().copied().filter(|(_, y)| y.is_finite());
            let (style, marker) = match c.split.as_str() {
                "train" => (colour.mix(0.55).stroke_width(1), 0),
                _ => (colour.stroke_width(3), 3),
            };
            let drawn = if c.split == "test" {
                chart
                    .draw_series(DashedLineSeries::new(points, 8, 5, style))
                    .map_err(e)?
            } else {
                chart
                    .draw_series(LineSeries::new(points, style).point_size(marker))
                    .map_err(e)?
            };
            drawn
                .label(label)
                .legend(move |(lx, ly)| PathElement::new(vec![(lx, ly), (lx + 24, ly)], style));
        }
        chart
            .configure_series_labels()
            .position(legend_position(&panel.column))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .label_font((FAMILY, 17))
            .draw()
            .map_err(e)?;
    }
    Ok(())
}

/// Losses fall and accuracies rise: put the legend where the curves usually are not.
fn legend_position(column: &str) -> SeriesLabelPosition {
    if column == "accuracy" {
        SeriesLabelPosition::LowerRight
    } else {
        SeriesLabelPosition::UpperRight
    }
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

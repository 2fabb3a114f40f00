//! An SVG of compute and bubble time against hit rate, one line per policy, with each policy's
//! crossover starred and the analytic bound dashed — the shape of Tutti's Fig. 13 (§4.2.5).
//!
//! Written by hand (plain SVG text) to keep the crate free of plotting dependencies. Two panels:
//! the whole sweep, and a zoom on the hit rates around the bound where the curves separate.

use std::fmt::Write as _;

use crate::sim::SimResult;
use crate::sweep::PolicySummary;

const PANEL_WIDTH: f64 = 560.0;
const PANEL_HEIGHT: f64 = 380.0;
const MARGIN_LEFT: f64 = 70.0;
const MARGIN_TOP: f64 = 50.0;
const MARGIN_BOTTOM: f64 = 50.0;
const GAP: f64 = 90.0;
const COLORS: [&str; 4] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"];
const COMPUTE_COLOR: &str = "#d62728";

/// Renders the figure. `results` holds every policy's hit-rate sweep (one input length).
pub fn render_svg(title: &str, results: &[SimResult], summaries: &[PolicySummary], analytic_bound_hit_rate: Option<f64>) -> String {
    let width = (MARGIN_LEFT + 2.0 * PANEL_WIDTH + GAP + 40.0).max(MARGIN_LEFT + 100.0 + 290.0 * summaries.len() as f64);
    let height = MARGIN_TOP + PANEL_HEIGHT + MARGIN_BOTTOM + 30.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(svg, r#"<text x="{:.0}" y="22" font-size="15" text-anchor="middle">{}</text>"#, width / 2.0, escape(title));
    // Zoom on the bound: a few times the distance from the bound to 100%, within 2..10 points.
    let zoom_from = analytic_bound_hit_rate
        .or_else(|| summaries.iter().filter_map(|s| s.crossover_hit_rate).reduce(f64::min))
        .map_or(0.8, |b| (b - (3.0 * (1.0 - b)).clamp(0.02, 0.1)).clamp(0.0, 0.98));
    panel(&mut svg, MARGIN_LEFT, (0.0, 1.0), results, summaries, analytic_bound_hit_rate);
    panel(&mut svg, MARGIN_LEFT + PANEL_WIDTH + GAP, (zoom_from, 1.0), results, summaries, analytic_bound_hit_rate);
    // Legend under the panels.
    let legend_y = MARGIN_TOP + PANEL_HEIGHT + 42.0;
    let mut x = MARGIN_LEFT;
    let _ = writeln!(
        svg,
        r#"<line x1="{x:.1}" y1="{legend_y:.1}" x2="{:.1}" y2="{legend_y:.1}" stroke="{COMPUTE_COLOR}" stroke-width="2.5"/><text x="{:.1}" y="{:.1}">compute</text>"#,
        x + 24.0,
        x + 30.0,
        legend_y + 4.0
    );
    x += 100.0;
    for (index, summary) in summaries.iter().enumerate() {
        let color = COLORS[index % COLORS.len()];
        let _ = writeln!(
            svg,
            r#"<line x1="{x:.1}" y1="{legend_y:.1}" x2="{:.1}" y2="{legend_y:.1}" stroke="{color}" stroke-width="2" stroke-dasharray="6,3"/><text x="{:.1}" y="{:.1}">bubble: {} (★ crossover)</text>"#,
            x + 24.0,
            x + 30.0,
            legend_y + 4.0,
            escape(summary.policy)
        );
        x += 290.0;
    }
    let _ = writeln!(
        svg,
        r##"<text x="{:.1}" y="{:.1}" fill="#555">dashed grey: analytic bound (per-layer read = per-layer compute). Model output, not a measurement.</text>"##,
        MARGIN_LEFT,
        legend_y + 24.0
    );
    svg.push_str("</svg>\n");
    svg
}

fn panel(svg: &mut String, left: f64, (x_from, x_to): (f64, f64), results: &[SimResult], summaries: &[PolicySummary], bound: Option<f64>) {
    let visible: Vec<&SimResult> = results.iter().filter(|r| r.hit_rate >= x_from - 1e-9 && r.hit_rate <= x_to + 1e-9).collect();
    let y_max_ms = visible.iter().map(|r| r.compute_us.max(r.bubble_us) / 1e3).fold(0.0, f64::max).max(1e-3) * 1.05;
    let top = MARGIN_TOP;
    let bottom = MARGIN_TOP + PANEL_HEIGHT;
    let x_of = |h: f64| left + (h - x_from) / (x_to - x_from).max(1e-9) * PANEL_WIDTH;
    let y_of = |ms: f64| bottom - ms / y_max_ms * PANEL_HEIGHT;

    // Axes, ticks and labels.
    let _ = writeln!(
        svg,
        r#"<rect x="{left:.1}" y="{top:.1}" width="{PANEL_WIDTH:.1}" height="{PANEL_HEIGHT:.1}" fill="none" stroke="black"/>"#
    );
    for tick in 0..=5 {
        let h = x_from + (x_to - x_from) * f64::from(tick) / 5.0;
        let x = x_of(h);
        let _ = writeln!(
            svg,
            r#"<line x1="{x:.1}" y1="{bottom:.1}" x2="{x:.1}" y2="{:.1}" stroke="black"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{:.1}%</text>"#,
            bottom + 5.0,
            bottom + 18.0,
            h * 100.0
        );
        let ms = y_max_ms * f64::from(tick) / 5.0;
        let y = y_of(ms);
        let _ = writeln!(
            svg,
            r##"<line x1="{left:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#eee"/><text x="{:.1}" y="{:.1}" text-anchor="end">{ms:.0}</text>"##,
            left + PANEL_WIDTH,
            left - 6.0,
            y + 4.0
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">cache hit rate</text><text transform="translate({:.1},{:.1}) rotate(-90)" text-anchor="middle">time (ms)</text>"#,
        left + PANEL_WIDTH / 2.0,
        bottom + 36.0,
        left - 50.0,
        top + PANEL_HEIGHT / 2.0
    );

    // Compute time is the same for every policy: draw it from the first policy's points.
    if let Some(first) = summaries.first() {
        let points: Vec<(f64, f64)> =
            visible.iter().filter(|r| r.policy == first.policy).map(|r| (x_of(r.hit_rate), y_of(r.compute_us / 1e3))).collect();
        polyline(svg, &points, COMPUTE_COLOR, 2.5, None);
    }
    for (index, summary) in summaries.iter().enumerate() {
        let color = COLORS[index % COLORS.len()];
        let mine: Vec<&&SimResult> = visible.iter().filter(|r| r.policy == summary.policy).collect();
        let points: Vec<(f64, f64)> = mine.iter().map(|r| (x_of(r.hit_rate), y_of(r.bubble_us / 1e3))).collect();
        polyline(svg, &points, color, 2.0, Some("6,3"));
        if let Some(h) = summary.crossover_hit_rate.filter(|h| *h >= x_from && *h <= x_to) {
            // Star on the bubble curve, at the nearest sweep point's height.
            let y = mine
                .iter()
                .min_by(|a, b| (a.hit_rate - h).abs().total_cmp(&(b.hit_rate - h).abs()))
                .map_or(bottom, |r| y_of(r.bubble_us / 1e3));
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" font-size="18" fill="{color}" text-anchor="middle">★</text><text x="{:.1}" y="{:.1}" fill="{color}" font-size="10">{:.1}%</text>"#,
                x_of(h),
                y + 6.0,
                x_of(h) + 8.0,
                y - 8.0 - 12.0 * index as f64,
                h * 100.0
            );
        }
    }
    if let Some(h) = bound.filter(|h| *h >= x_from && *h <= x_to) {
        let x = x_of(h);
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{top:.1}" x2="{x:.1}" y2="{bottom:.1}" stroke="#888" stroke-dasharray="3,3"/><text x="{:.1}" y="{:.1}" fill="#555" text-anchor="end">bound {:.1}%</text>"##,
            x - 4.0,
            top + 14.0,
            h * 100.0
        );
    }
}

fn polyline(svg: &mut String, points: &[(f64, f64)], color: &str, width: f64, dash: Option<&str>) {
    if points.is_empty() {
        return;
    }
    let mut coords = String::with_capacity(points.len() * 14);
    for (x, y) in points {
        let _ = write!(coords, "{x:.1},{y:.1} ");
    }
    let dash = dash.map(|d| format!(r#" stroke-dasharray="{d}""#)).unwrap_or_default();
    let _ = writeln!(svg, r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="{width}"{dash}/>"#, coords.trim_end());
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

//! The chart BENCHMARKS.md shows: throughput by concurrency, one line per cell, as SVG
//! (plotters' SVG backend: text is left to the viewer's fonts, nothing to install).

use plotters::prelude::*;

use crate::Series;

/// Writes `series` to `path` as an SVG line chart: one point per concurrency measured,
/// throughput on a log axis (the peer's in-memory replays are ten times the rest).
pub fn write(path: &str, series: &Series) -> Result<(), Box<dyn std::error::Error>> {
    let rates = || {
        series
            .iter()
            .flat_map(|(_, points)| points.iter().map(|&(_, rps)| rps))
    };
    let top = rates().fold(1.0_f64, f64::max) * 1.5;
    let bottom = rates().fold(top, f64::min).max(1.0) / 1.5;
    // The concurrencies measured, evenly spaced: x is their index.
    let levels: Vec<usize> = series
        .first()
        .map(|(_, points)| points.iter().map(|&(c, _)| c).collect())
        .unwrap_or_default();
    let root = SVGBackend::new(path, (760, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Throughput by concurrency (req/s, log scale, one run)",
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(
            -0.2_f64..(levels.len().max(2) - 1) as f64 + 0.2,
            (bottom..top).log_scale(),
        )?;
    chart
        .configure_mesh()
        .x_desc("concurrent clients")
        .y_desc("requests per second")
        .x_labels(levels.len().max(2))
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 {
                levels
                    .get(i as usize)
                    .map_or_else(String::new, usize::to_string)
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()?;
    let colors = [
        BLACK,
        RGBColor(130, 130, 130),
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(255, 127, 14),
    ];
    for ((name, points), color) in series.iter().zip(colors.iter().cycle()) {
        let points: Vec<(f64, f64)> = points
            .iter()
            .enumerate()
            .map(|(i, &(_, rps))| (i as f64, rps))
            .collect();
        let color = *color;
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
        chart.draw_series(
            points
                .into_iter()
                .map(|p| Circle::new(p, 3, color.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

//! The chart BENCHMARKS.md shows: throughput by concurrency, one line per cell, as SVG
//! (plotters' SVG backend: text is left to the viewer's fonts, nothing to install).

use plotters::prelude::*;

use crate::Series;

/// Writes `series` to `path` as an SVG line chart, concurrency on a log axis.
pub fn write(path: &str, series: &Series) -> Result<(), Box<dyn std::error::Error>> {
    let top = series
        .iter()
        .flat_map(|(_, points)| points.iter().map(|&(_, rps)| rps))
        .fold(0.0_f64, f64::max)
        * 1.15;
    let root = SVGBackend::new(path, (760, 440)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Throughput by concurrency (req/s, one run)",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((1.0_f64..64.0_f64).log_scale(), 0.0..top.max(1.0))?;
    chart
        .configure_mesh()
        .x_desc("concurrent clients")
        .y_desc("requests per second")
        .x_labels(3)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()?;
    let colors = [BLACK, RGBColor(120, 120, 120), BLUE, GREEN, RED, MAGENTA];
    for ((name, points), color) in series.iter().zip(colors.iter().cycle()) {
        let points: Vec<(f64, f64)> = points.iter().map(|&(c, rps)| (c as f64, rps)).collect();
        let color = *color;
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
        chart.draw_series(points.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

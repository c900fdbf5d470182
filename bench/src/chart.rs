//! The chart BENCHMARKS.md shows: throughput by concurrency, one line per cell, as SVG
//! (plotters' SVG backend: text is left to the viewer's fonts, nothing to install).

use plotters::prelude::*;

use crate::Series;

/// Writes `series` to `path` as an SVG line chart: one point per concurrency measured,
/// throughput on a log axis (the peer's in-memory replays are ten times the rest).
pub(crate) fn write(path: &str, series: &Series) -> Result<(), Box<dyn std::error::Error>> {
    let rates = || {
        series
            .iter()
            .flat_map(|(_, points)| points.iter().map(|&(_, rps)| rps))
    };
    let top = rates().fold(1.0_f64, f64::max) * 1.5;
    // From the power of ten below the slowest cell, so that its decade is labelled.
    let bottom = 10_f64.powf(rates().fold(top, f64::min).max(1.0).log10().floor());
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
        .y_labels(40)
        // Only 1, 2 and 5 times a power of ten: a log axis's other lines stay unlabelled.
        .y_label_formatter(&|y| {
            let text = format!("{y:.0}");
            let round = text.chars().skip(1).all(|c| c == '0');
            if round && matches!(text.chars().next(), Some('1' | '2' | '5')) {
                text
            } else {
                String::new()
            }
        })
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
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        // Each point's figure beside it: the chart is read for its numbers too.
        chart.draw_series(points.into_iter().map(|(x, y)| {
            Text::new(
                format!("{y:.0}"),
                (x + 0.03, y),
                ("sans-serif", 11).into_font().color(&color),
            )
        }))?;
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

#[cfg(test)]
mod tests {
    /// The chart of a run is written and names every series.
    #[test]
    fn writes_every_series() {
        let series: crate::Series = vec![
            ("bare", vec![(1, 2710.0), (16, 8689.0), (64, 7814.0)]),
            (
                "peer replay",
                vec![(1, 14427.0), (16, 72789.0), (64, 58787.0)],
            ),
        ];
        let path = std::env::temp_dir().join(format!("idem-chart-{}.svg", std::process::id()));
        super::write(path.to_str().unwrap(), &series).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(svg.contains("bare") && svg.contains("peer replay"));
    }
}

//! The outbox's lag over the last hour: samples the console takes, and the small SVG
//! chart the overview draws from them.

use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use maud::{html, Markup};

use super::Shared;

/// How far back the chart looks.
const WINDOW: Duration = Duration::from_secs(3_600);

/// At most this many samples are kept.
const MOST: usize = 2_000;

/// Samples the lag, and the counters of this process's relays where the console has
/// them, every `every`, until the console is dropped.
pub(crate) async fn sample(console: Weak<Shared>, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(console) = console.upgrade() else {
            return;
        };
        if let Some(relays) = &console.relays {
            relays.sample();
        }
        match console.store.operate().outbox_lag().await {
            Ok(lag) => record(&console, lag),
            Err(error) => {
                tracing::debug!(target: "idem::console", %error, "idem console: sampling the outbox lag failed")
            }
        }
    }
}

/// Keeps `lag` as the sample of now, and drops samples older than the window.
pub(crate) fn record(console: &Arc<Shared>, lag: Option<Duration>) {
    let now = SystemTime::now();
    let mut samples = console
        .lag
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    samples.push_back((now, lag.map_or(0.0, |l| l.as_secs_f64())));
    // The live pages sample at each refresh: however many watch, the chart keeps a
    // bounded number of points.
    while samples.len() > MOST
        || samples
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at).unwrap_or_default() > WINDOW)
    {
        samples.pop_front();
    }
}

/// The chart of `samples` (oldest first) over the hour before `now`: a polyline on a
/// 600 × 120 canvas, the highest lag on the top line.
pub(crate) fn chart(samples: &[(SystemTime, f64)], now: SystemTime, every: Duration) -> Markup {
    const W: f64 = 600.0;
    const H: f64 = 120.0;
    let top = samples.iter().map(|(_, l)| *l).fold(1.0_f64, f64::max);
    let points: Vec<String> = samples
        .iter()
        .map(|(at, lag)| {
            let ago = now.duration_since(*at).unwrap_or_default().as_secs_f64();
            let x = W * (1.0 - ago / WINDOW.as_secs_f64()).clamp(0.0, 1.0);
            let y = H - H * (lag / top);
            format!("{x:.1},{y:.1}")
        })
        .collect();
    let label = super::pages::seconds(top);
    html! {
        svg class="chart" viewBox="0 -14 600 150" width="600" height="150" role="img"
            aria-label=(format!("outbox lag over the last hour, at most {label}")) {
            line x1="0" y1="120" x2="600" y2="120" stroke="#999" {}
            line x1="0" y1="0" x2="600" y2="0" stroke="#ddd" {}
            text x="2" y="-3" font-size="11" { (label) }
            text x="2" y="134" font-size="11" { "an hour ago" }
            text x="598" y="134" font-size="11" text-anchor="end" { "now" }
            @if points.len() == 1 {
                @let (x, y) = points[0].split_once(',').unwrap_or(("600", "120"));
                circle cx=(x) cy=(y) r="3" fill="#1f6feb" {}
            } @else {
                polyline points=(points.join(" ")) fill="none" stroke="#1f6feb" stroke-width="2" {}
            }
        }
        p.muted {
            "The age of the oldest pending event, sampled by this process's console every "
            (super::pages::seconds(every.as_secs_f64())) " and at each view of this page: "
            "it starts empty when the process starts, and another instance draws its own."
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_places_samples_by_age_and_scales_to_the_highest() {
        let now = SystemTime::now();
        let samples = [
            (now - Duration::from_secs(3_600), 0.0),
            (now - Duration::from_secs(1_800), 4.0),
            (now, 2.0),
        ];
        let svg = chart(&samples, now, Duration::from_secs(30)).into_string();
        assert!(
            svg.contains("points=\"0.0,120.0 300.0,0.0 600.0,60.0\""),
            "{svg}"
        );
        assert!(svg.contains(">4 s<"), "{svg}");
    }
}

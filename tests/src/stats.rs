//! Figures from many requests.

use std::collections::BTreeMap;
use std::time::Duration;

/// The p50 and p99 of some latencies, in milliseconds; zeros for none.
pub fn percentiles(latencies: &mut [Duration]) -> (f64, f64) {
    latencies.sort_unstable();
    let at = |q: f64| {
        latencies
            .get(((latencies.len() as f64 - 1.0) * q).round() as usize)
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    (at(0.50), at(0.99))
}

/// How many times each status occurs.
pub fn tally(statuses: impl IntoIterator<Item = u16>) -> BTreeMap<u16, usize> {
    let mut counts = BTreeMap::new();
    for status in statuses {
        *counts.entry(status).or_insert(0) += 1;
    }
    counts
}

//! Load for the benchmarks: clients sending requests back to back, and the CPU time the
//! server's PostgreSQL and this process spend on them.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use idem_tests::{percentiles, tally};

/// The numbers of one scenario at one concurrency.
pub(crate) struct Stats {
    pub requests: usize,
    pub elapsed: Duration,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub statuses: BTreeMap<u16, usize>,
    /// CPU time per request, in microseconds: PostgreSQL's backends, and this process
    /// (server and load generator).
    pub cpu_us: (f64, f64),
}

/// CPU time so far, in clock ticks: (all `postgres` processes, this process).
pub(crate) fn cpu_ticks() -> (u64, u64) {
    fn ticks(stat: &str) -> Option<(String, u64)> {
        let (head, rest) = stat.rsplit_once(") ")?;
        let comm = head.split_once(" (")?.1.to_owned();
        let fields: Vec<&str> = rest.split_whitespace().collect();
        Some((
            comm,
            fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?,
        ))
    }
    let mut postgres = 0;
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            if let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) {
                if let Some((comm, t)) = ticks(&stat) {
                    if comm == "postgres" {
                        postgres += t;
                    }
                }
            }
        }
    }
    let own = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| ticks(&s))
        .map_or(0, |(_, t)| t);
    (postgres, own)
}

impl Stats {
    pub(crate) fn throughput(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }
}

/// Drives `concurrency` clients that each send `request(n)` back to back for `seconds`.
pub(crate) async fn drive<F, Fut>(concurrency: usize, seconds: f64, request: F) -> Stats
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = u16> + Send,
{
    let counter = Arc::new(AtomicU64::new(0));
    // A short warm-up, not measured: connections, caches, statement preparation.
    let warm_until = Instant::now() + Duration::from_millis(500);
    let deadline = warm_until + Duration::from_secs_f64(seconds);
    let workers = (0..concurrency).map(|_| {
        let request = request.clone();
        let counter = Arc::clone(&counter);
        tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut statuses = Vec::new();
            loop {
                let started = Instant::now();
                if started >= deadline {
                    break;
                }
                let status = request(counter.fetch_add(1, Ordering::Relaxed)).await;
                if started >= warm_until {
                    latencies.push(started.elapsed());
                    statuses.push(status);
                }
            }
            (latencies, statuses)
        })
    });
    tokio::time::sleep_until(warm_until.into()).await;
    let cpu_before = cpu_ticks();
    let mut latencies = Vec::new();
    let mut statuses = Vec::new();
    for worker in join_all(workers).await {
        let (l, s) = worker.expect("worker");
        latencies.extend(l);
        statuses.extend(s);
    }
    let cpu_after = cpu_ticks();
    // Linux counts CPU time in ticks of 10 ms.
    let per_request = |before: u64, after: u64| {
        (after - before) as f64 * 10_000.0 / latencies.len().max(1) as f64
    };
    let cpu_us = (
        per_request(cpu_before.0, cpu_after.0),
        per_request(cpu_before.1, cpu_after.1),
    );
    let requests = latencies.len();
    let (p50_ms, p99_ms) = percentiles(&mut latencies);
    Stats {
        requests,
        elapsed: Duration::from_secs_f64(seconds),
        p50_ms,
        p99_ms,
        statuses: tally(statuses),
        cpu_us,
    }
}

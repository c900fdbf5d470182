//! Runs the charges service: `cargo run -p charges`.
//!
//! Environment: `BIND_ADDR` (default `127.0.0.1:3000`), `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`, a local trust-auth PostgreSQL),
//! `PROCESSOR_DELAY_MS` (default 0), `RUST_LOG` (default `info`).

use std::time::Duration;

use charges::Config;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();

    let bind = std::env::var("BIND_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let database_url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
    let delay_ms: u64 = match std::env::var("PROCESSOR_DELAY_MS") {
        Ok(v) => v.parse().map_err(|_| {
            format!("PROCESSOR_DELAY_MS must be a whole number of milliseconds, not {v:?}")
        })?,
        Err(_) => 0,
    };

    let pool = charges::connect(&database_url).await?;
    charges::migrate(&pool).await?;
    // Expired idempotency records are ignored already; deleting them keeps the table small.
    let _sweeper =
        idem_runtime::Idempotency::new(pool.clone()).spawn_sweeper(Duration::from_secs(60), 1_000);
    let app = charges::app(
        pool,
        Config {
            processor_delay: Duration::from_millis(delay_ms),
        },
    );
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    tracing::info!(addr = %listener.local_addr()?, "charges service listening");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

//! Runs the charges service: `cargo run -p charges`.
//!
//! Environment: `BIND_ADDR` (default `127.0.0.1:3000`), `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`, a local trust-auth PostgreSQL),
//! `PROCESSOR_DELAY_MS` (default 0), `WEBHOOK_SECRET` (the HMAC key of webhook
//! signatures; `WEBHOOK_SECRET_PREVIOUS` is also accepted while rotating), `RUST_LOG`
//! (default `info`).

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
    let mut webhook_secrets = Vec::new();
    match std::env::var_os("WEBHOOK_SECRET") {
        Some(secret) => webhook_secrets.push(secret.into_encoded_bytes()),
        None => {
            tracing::warn!("WEBHOOK_SECRET is not set: no webhook delivery will verify");
            webhook_secrets.push(unguessable_secret()?);
        }
    }
    if let Some(previous) = std::env::var_os("WEBHOOK_SECRET_PREVIOUS") {
        webhook_secrets.push(previous.into_encoded_bytes());
    }
    let app = charges::app(
        pool,
        Config {
            processor_delay: Duration::from_millis(delay_ms),
            webhook_secrets,
            webhook_delay: Duration::ZERO,
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

/// 32 random bytes, so that an unconfigured service accepts no webhook at all.
fn unguessable_secret() -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut secret = vec![0; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut secret)?;
    Ok(secret)
}

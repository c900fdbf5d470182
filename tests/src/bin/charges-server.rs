//! The charges example's binary, built beside the tests so that the reliability
//! harness can run it as real OS processes (`CARGO_BIN_EXE_charges-server`).

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    charges::main_from_env().await
}

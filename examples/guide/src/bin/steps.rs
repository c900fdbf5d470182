use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{Problem, StepError, Store, Tx, idempotent};
use serde::{Deserialize, Serialize};
use serde_json::json;

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
    currency: String,
    customer: String,
}

/// What the step records: the processor's answer, as much of it as the handler needs.
#[derive(Deserialize, Serialize)]
struct ProcessorCharge {
    id: String,
}

#[derive(Serialize)]
struct Charge {
    id: i64,
    amount: i64,
    processor_id: String,
}

/// Where charges are made.
#[derive(Clone)]
struct Processor {
    client: reqwest::Client,
    url: String,
}

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
    processor: Processor,
}

#[idempotent(scope = "processed_charges", ttl = "24h", fields = [amount, currency, customer])]
async fn create_charge(
    State(processor): State<Processor>,
    mut tx: Tx,
    Json(req): Json<NewCharge>,
) -> Result<(StatusCode, Json<Charge>), Problem> {
    let body = json!({ "amount": req.amount, "currency": req.currency, "customer": req.customer });
    // Once per request: a retry after a failure below gets the recorded charge back,
    // and the processor is not called again.
    let charged: ProcessorCharge = tx
        .step("processor", |key| async move {
            processor
                .client
                .post(format!("{}/v1/charges", processor.url))
                .header("Idempotency-Key", key) // the same on every retry of this request
                .json(&body)
                .send()
                .await?
                .error_for_status()?
                .json()
                .await
        })
        .await
        .map_err(step_failed)?;
    let id = sqlx::query_scalar(
        "INSERT INTO processed_charges (processor_id, amount) VALUES ($1, $2) RETURNING id",
    )
    .bind(&charged.id)
    .bind(req.amount)
    .fetch_one(&mut tx)
    .await
    .map_err(|_| {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "urn:example:db",
            "Database error",
        )
    })?;
    let charge = Charge {
        id,
        amount: req.amount,
        processor_id: charged.id,
    };
    Ok((StatusCode::CREATED, Json(charge)))
}

/// idem's answer to a step that failed (504 past the step timeout, 422 for a key reused
/// with another payload, 503 ...), or a 502 when the processor's call itself failed:
/// nothing was recorded, everything rolls back, and a retry calls again with the same key.
fn step_failed(error: StepError<reqwest::Error>) -> Problem {
    error.into_problem().unwrap_or_else(|call| {
        Problem::new(
            StatusCode::BAD_GATEWAY,
            "urn:example:processor",
            "Processor failed",
        )
        .with_detail(call.to_string())
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let processor_url = std::env::var("PROCESSOR_URL").map_err(|_| "set PROCESSOR_URL")?;
    let pool = sqlx::PgPool::connect(&url).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS processed_charges
           (id bigserial PRIMARY KEY, processor_id text NOT NULL, amount bigint)",
    )
    .execute(&pool)
    .await?;
    let store = Store::new(pool);
    store.migrate().await?; // idem's tables: the records, the outbox and the steps
    store.verify().await?;
    let processor = Processor {
        client: reqwest::Client::new(),
        url: processor_url.trim_end_matches('/').to_owned(),
    };
    let app = Router::new()
        .route("/charges", post(create_charge))
        .with_state(AppState { store, processor });
    let addr = std::env::var("BIND_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    axum::serve(tokio::net::TcpListener::bind(addr).await?, app).await?;
    Ok(())
}

use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::{Problem, Store, Tx, idempotent};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
    currency: String,
    customer: String,
    description: Option<String>, // not in `fields`: a retry may change it and still replay
}

#[derive(Serialize)]
struct Charge {
    id: i64,
    amount: i64,
}

#[idempotent(scope = "charges", ttl = "24h", fields = [amount, currency, customer])]
async fn create_charge(
    mut tx: Tx, // the request's transaction, owned by idem
    Json(req): Json<NewCharge>,
) -> Result<(StatusCode, Json<Charge>), Problem> {
    if req.amount <= 0 {
        // An `Err` rolls back and stores nothing: a corrected retry with the same key runs.
        return Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "urn:example:amount",
            "Invalid amount",
        ));
    }
    let id = sqlx::query_scalar("INSERT INTO charges (amount) VALUES ($1) RETURNING id")
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
    Ok((
        StatusCode::CREATED,
        Json(Charge {
            id,
            amount: req.amount,
        }),
    ))
}

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let pool = sqlx::PgPool::connect(&url).await?;
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS charges (id bigserial PRIMARY KEY, amount bigint)")
        .execute(&pool)
        .await?;
    let store = Store::new(pool);
    store.migrate().await?; // idem's table
    store.verify().await?; // names a wrong table, or a pooler or Citus the store is not set for
    let app = Router::new()
        .route("/charges", post(create_charge))
        .with_state(AppState { store });
    let addr = std::env::var("BIND_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    axum::serve(tokio::net::TcpListener::bind(addr).await?, app).await?;
    Ok(())
}

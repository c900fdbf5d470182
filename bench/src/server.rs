//! The benchmarked service: the same charge insert behind four handlers.

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::{FromRef, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem::{idempotent, Store, StoreBuilder, Tx};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

#[derive(Clone, FromRef)]
struct AppState {
    idempotency: Store,
    pool: PgPool,
    named: Named,
}

/// Whether the handlers' own statements are prepared under a name (sqlx's
/// `persistent`): not behind a transaction pooler.
#[derive(Clone, Copy)]
struct Named(bool);

#[derive(Deserialize, Serialize)]
pub struct NewCharge {
    amount: i64,
    currency: String,
    customer: String,
    /// A stand-in for a payment processor call inside the transaction.
    #[serde(default)]
    delay_ms: u64,
}

#[derive(Serialize, sqlx::FromRow)]
struct Charge {
    id: i64,
    amount: i64,
    currency: String,
    customer: String,
    created_at: String,
}

pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::Error> {
    Store::new(pool.clone()).migrate().await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS charges (
             id bigserial PRIMARY KEY, amount bigint NOT NULL, currency text NOT NULL,
             customer text NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE IF NOT EXISTS naive_keys (
             key text PRIMARY KEY, status smallint NOT NULL, body bytea NOT NULL);",
    )
    .execute(pool)
    .await?;
    Ok(())
}

pub async fn serve(pool: PgPool) -> std::io::Result<SocketAddr> {
    serve_with(pool, |store| store).await
}

/// The service with a store configured by `configure` (a production mode).
pub async fn serve_with(
    pool: PgPool,
    configure: impl FnOnce(StoreBuilder) -> StoreBuilder,
) -> std::io::Result<SocketAddr> {
    let idempotency = configure(Store::builder(pool.clone()))
        .build()
        .map_err(std::io::Error::other)?;
    let named = Named(idempotency.pooler() == idem::Pooler::Session);
    let state = AppState {
        idempotency,
        pool,
        named,
    };
    let app = Router::new()
        .route("/bare", post(bare))
        .route("/idem", post(idem))
        .route("/hold", post(hold))
        .route("/naive", post(naive))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// The one write every handler does.
async fn insert(
    conn: &mut PgConnection,
    req: &NewCharge,
    Named(named): Named,
) -> Result<Charge, sqlx::Error> {
    let charge = sqlx::query_as(
        "INSERT INTO charges (amount, currency, customer) VALUES ($1, $2, $3) \
         RETURNING id, amount, currency, customer, created_at::text",
    )
    .bind(req.amount)
    .bind(&req.currency)
    .bind(&req.customer)
    .persistent(named)
    .fetch_one(conn)
    .await?;
    if req.delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(req.delay_ms)).await;
    }
    Ok(charge)
}

fn failed(e: sqlx::Error) -> (StatusCode, String) {
    (StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

/// (a) The floor: the write in its own transaction, nothing else.
async fn bare(
    State(pool): State<PgPool>,
    State(named): State<Named>,
    Json(req): Json<NewCharge>,
) -> Result<(StatusCode, Json<Charge>), (StatusCode, String)> {
    let mut tx = pool.begin().await.map_err(failed)?;
    let charge = insert(&mut tx, &req, named).await.map_err(failed)?;
    tx.commit().await.map_err(failed)?;
    Ok((StatusCode::CREATED, Json(charge)))
}

/// (b)-(c) The same write, idempotent.
#[idempotent(scope = "charges", fields = [amount, currency, customer])]
async fn idem(
    State(named): State<Named>,
    mut tx: Tx,
    Json(req): Json<NewCharge>,
) -> Result<(StatusCode, Json<Charge>), (StatusCode, String)> {
    let charge = insert(&mut tx, &req, named).await.map_err(failed)?;
    Ok((StatusCode::CREATED, Json(charge)))
}

/// (d) A request that holds its key for a long time, so that its duplicates get 409.
#[idempotent(scope = "held", fields = [amount])]
async fn hold(mut tx: Tx, Json(req): Json<NewCharge>) -> Result<StatusCode, (StatusCode, String)> {
    insert(&mut tx, &req, Named(true)).await.map_err(failed)?;
    tokio::time::sleep(Duration::from_secs(600)).await;
    Ok(StatusCode::CREATED)
}

/// (e) The common non-atomic pattern: check the key, run the write, save the key, in
/// three separate transactions. Two copies that both pass the check both write.
async fn naive(
    State(pool): State<PgPool>,
    headers: HeaderMap,
    Json(req): Json<NewCharge>,
) -> Response {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let stored: Result<Option<(i16, Vec<u8>)>, _> =
        sqlx::query_as("SELECT status, body FROM naive_keys WHERE key = $1")
            .bind(key)
            .fetch_optional(&pool)
            .await;
    match stored {
        Ok(Some((status, body))) => {
            let status = StatusCode::from_u16(status as u16).unwrap_or(StatusCode::OK);
            return (status, [("content-type", "application/json")], body).into_response();
        }
        Ok(None) => {}
        Err(e) => return failed(e).into_response(),
    }
    let charge = async {
        let mut tx = pool.begin().await?;
        let charge = insert(&mut tx, &req, Named(true)).await?;
        tx.commit().await?;
        Ok::<_, sqlx::Error>(charge)
    }
    .await;
    let charge = match charge {
        Ok(charge) => charge,
        Err(e) => return failed(e).into_response(),
    };
    let body = serde_json::to_vec(&charge).unwrap_or_default();
    let saved = sqlx::query(
        "INSERT INTO naive_keys (key, status, body) VALUES ($1, 201, $2) ON CONFLICT DO NOTHING",
    )
    .bind(key)
    .bind(&body)
    .execute(&pool)
    .await;
    if let Err(e) = saved {
        return failed(e).into_response();
    }
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        body,
    )
        .into_response()
}

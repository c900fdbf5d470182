//! The benchmarked service: the same charge insert behind five handlers, and the peer
//! (`axum-idempotent` on Redis) serving the bare one.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRef, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem::layer::{IdempotencyLayer, Locked};
use idem::{idempotent, Store, StoreBuilder, Tx};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
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
pub(crate) struct NewCharge {
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

pub(crate) async fn migrate(pool: &PgPool) -> Result<(), sqlx::Error> {
    Store::new(pool.clone()).migrate().await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS charges (
             id bigserial PRIMARY KEY, amount bigint NOT NULL, currency text NOT NULL,
             customer text NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE IF NOT EXISTS naive_keys (
             key text PRIMARY KEY, status smallint NOT NULL, body bytea NOT NULL);
         -- The floor's key rows: idem's own table shape (columns, primary key, the
         -- expires_at index), written once per request.
         CREATE TABLE IF NOT EXISTS floor_keys (LIKE idempotency_keys INCLUDING ALL);",
    )
    .execute(pool)
    .await?;
    Ok(())
}

pub(crate) async fn serve(pool: PgPool) -> std::io::Result<SocketAddr> {
    serve_with(pool, |store| store).await
}

/// The service with a store configured by `configure` (a production mode).
pub(crate) async fn serve_with(
    pool: PgPool,
    configure: impl FnOnce(StoreBuilder) -> StoreBuilder,
) -> std::io::Result<SocketAddr> {
    let idempotency = configure(Store::builder(pool.clone()))
        .build()
        .map_err(std::io::Error::other)?;
    let named = Named(idempotency.pooler() == idem::Pooler::Session);
    let charges = IdempotencyLayer::new(idempotency.clone(), "layered").fields([
        "/amount",
        "/currency",
        "/customer",
    ]);
    let state = AppState {
        idempotency,
        pool,
        named,
    };
    let app = Router::new()
        .route("/bare", post(bare))
        .route("/idem", post(idem))
        .route("/layer", post(layered).layer(charges))
        .route("/hold", post(hold))
        .route("/wait", post(wait))
        .route("/naive", post(naive))
        .route("/floor", post(floor))
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

/// (f) The floor of any correct design: the bare handler plus one complete key row,
/// written once, in the same transaction. The row has idem's columns and sizes: a
/// SHA-256 fingerprint, the target and three field hashes, the status, the one
/// allow-listed header and the response body, the 24 h expiry.
async fn floor(
    State(pool): State<PgPool>,
    State(named): State<Named>,
    headers: HeaderMap,
    Json(req): Json<NewCharge>,
) -> Result<(StatusCode, [(&'static str, &'static str); 1], Vec<u8>), (StatusCode, String)> {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .ok_or((StatusCode::BAD_REQUEST, "no key".to_owned()))?;
    let fingerprint = Sha256::new()
        .chain_update(req.amount.to_be_bytes())
        .chain_update(&req.currency)
        .chain_update(&req.customer)
        .finalize();
    let field_hashes = fingerprint.repeat(4);
    let mut tx = pool.begin().await.map_err(failed)?;
    let charge = insert(&mut tx, &req, named).await.map_err(failed)?;
    let body = serde_json::to_vec(&charge)
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    sqlx::query(
        "INSERT INTO floor_keys \
           (scope, principal, key, fingerprint, field_hashes, status, headers, body, expires_at) \
         VALUES ('charges', '', $1, $2, $3, 201, $4, $5, now() + interval '24 hours')",
    )
    .bind(key)
    .bind(&fingerprint[..])
    .bind(&field_hashes)
    .bind(&b"content-type: application/json\n"[..])
    .bind(&body)
    .persistent(named.0)
    .execute(&mut *tx)
    .await
    .map_err(failed)?;
    tx.commit().await.map_err(failed)?;
    Ok((
        StatusCode::CREATED,
        [("content-type", "application/json")],
        body,
    ))
}

/// The peer, `axum-idempotent` 0.2: the bare handler behind its layer, keyed by the
/// `Idempotency-Key` header alone, responses kept 24 h (idem's TTL here) in a `ruts`
/// session in `store`. Its cache is per session: a client must send the session cookie
/// the first stored response set, or nothing is ever replayed.
pub(crate) async fn serve_peer<T: ruts::store::SessionStore>(
    pool: PgPool,
    store: Arc<T>,
) -> std::io::Result<SocketAddr> {
    use axum_idempotent::{IdempotentLayer, IdempotentOptions};
    use ruts::{CookieOptions, SessionLayer};

    let options = IdempotentOptions::default()
        .use_idempotency_key_header(Some("idempotency-key"))
        .expire_after(24 * 60 * 60);
    let state = AppState {
        idempotency: Store::new(pool.clone()),
        pool,
        named: Named(true),
    };
    let app = Router::new()
        .route("/bare", post(bare))
        .with_state(state)
        .layer(IdempotentLayer::<T>::new(options))
        .layer(
            SessionLayer::new(store).with_cookie_options(
                CookieOptions::build()
                    .name("session")
                    .max_age(24 * 60 * 60)
                    .path("/"),
            ),
        )
        .layer(tower_cookies::CookieManagerLayer::new());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
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

/// (c') idem's layer around the same handler, written without the attribute: the same
/// fields, as JSON pointers.
async fn layered(
    State(named): State<Named>,
    mut locked: Locked,
    Json(req): Json<NewCharge>,
) -> Result<(StatusCode, Json<Charge>), (StatusCode, String)> {
    let mut tx = locked.tx();
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

/// The same write as (b), for duplicates that wait for the request in flight and
/// replay it (`concurrency = wait(..)`).
#[idempotent(scope = "waited", fields = [amount, currency, customer], concurrency = wait("10s"))]
async fn wait(
    State(named): State<Named>,
    mut tx: Tx,
    Json(req): Json<NewCharge>,
) -> Result<(StatusCode, Json<Charge>), (StatusCode, String)> {
    let charge = insert(&mut tx, &req, named).await.map_err(failed)?;
    Ok((StatusCode::CREATED, Json(charge)))
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

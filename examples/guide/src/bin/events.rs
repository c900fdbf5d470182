use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::{self, stream};
use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::outbox::nats::{JetStreamConsumer, JetStreamPublisher};
use idem::outbox::{EmitError, Event, Received};
use idem::{Problem, Store, Tx, idempotent};
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize)]
struct NewCharge {
    amount: i64,
    currency: String,
    customer: String,
}

#[derive(Deserialize, Serialize)]
struct Charge {
    id: i64,
    amount: i64,
}

#[idempotent(scope = "charges", ttl = "24h", fields = [amount, currency, customer])]
async fn create_charge(
    mut tx: Tx,
    Json(req): Json<NewCharge>,
) -> Result<(StatusCode, Json<Charge>), Problem> {
    let id = sqlx::query_scalar("INSERT INTO charges (amount) VALUES ($1) RETURNING id")
        .bind(req.amount)
        .fetch_one(&mut *tx)
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
    };
    // One row in the outbox table, in this transaction: committed with the charge, the
    // key and the stored response, or not at all. A replay emits nothing.
    tx.emit(Event::new("charges.created", &charge).ordering_key(id.to_string()))
        .await
        .map_err(event_not_recorded)?;
    Ok((StatusCode::CREATED, Json(charge)))
}

/// `Problem` has no `From<EmitError>`: an event not recorded is the request's `Err`,
/// so the charge rolls back with it.
fn event_not_recorded(_: EmitError) -> Problem {
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "urn:example:events",
        "Event not recorded",
    )
}

#[derive(Clone, FromRef)]
struct AppState {
    store: Store,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let pool = sqlx::PgPool::connect(&url).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS charges (id bigserial PRIMARY KEY, amount bigint);
         CREATE TABLE IF NOT EXISTS ledger (charge_id bigint PRIMARY KEY, amount bigint)",
    )
    .execute(&pool)
    .await?;
    let store = Store::new(pool);
    store.migrate().await?; // idem's tables: the records, the outbox and the steps

    let nats_url = std::env::var("NATS_URL").map_err(|_| "set NATS_URL")?;
    let js = jetstream::new(async_nats::connect(nats_url).await?);
    // The events' stream captures every subject the service emits on. The relay sends
    // each event's id as `Nats-Msg-Id`: a copy published again after a relay's crash,
    // inside the duplicate window, is dropped.
    let events = js
        .get_or_create_stream(stream::Config {
            name: "charges".into(),
            subjects: vec!["charges.>".into()],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await?;
    // Dead letters on a subject outside `charges.>`, in a stream of their own: the
    // consumer waits for it to store each one, and no consumer of the events reads them.
    js.get_or_create_stream(stream::Config {
        name: "charges-dead".into(),
        subjects: vec!["dead.charges.>".into()],
        ..Default::default()
    })
    .await?;
    // A durable pull consumer with explicit acks: acknowledged after the work commits.
    let ledger = events
        .get_or_create_consumer(
            "ledger",
            pull::Config {
                durable_name: Some("ledger".into()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30), // longer than the work takes
                max_deliver: 10,                   // then a dead letter
                ..Default::default()
            },
        )
        .await?;

    // The relay publishes what committed, in every instance of the service.
    let relay = store.relay(JetStreamPublisher::new(js.clone())).spawn()?;
    // The consumer books each event once: `run_once` keyed by the event's id.
    let books = store.clone();
    let consumer = tokio::spawn(async move {
        JetStreamConsumer::new(js, ledger)
            .dead_letter_subject("dead.charges.ledger")
            .run(async |event: Received<Charge>| {
                let charge = event.payload();
                event
                    .once(&books, "ledger")
                    .run(async |mut tx| {
                        sqlx::query("INSERT INTO ledger (charge_id, amount) VALUES ($1, $2)")
                            .bind(charge.id)
                            .bind(charge.amount)
                            .execute(&mut *tx)
                            .await?;
                        Ok::<_, sqlx::Error>(())
                    })
                    .await
            })
            .await
    });

    let app = Router::new()
        .route("/charges", post(create_charge))
        .with_state(AppState { store });
    let addr = std::env::var("BIND_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    axum::serve(tokio::net::TcpListener::bind(addr).await?, app).await?;
    relay.stopped().await; // ends its round in flight
    consumer.abort();
    Ok(())
}

//! The service's handlers keep exactly-once under every fault idem's test kit makes:
//! each request sent once, twice and four times at once, its process killed after the
//! processor's call, after its record, before and after COMMIT (then the completer or the
//! client finishing it), and the database cut away.

use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use charges::{Config, Processor};
use idem::testing::{Effect, Kit, StandIn};
use sqlx::PgPool;

/// The service as the binary builds it, calling `processor`, on the store the kit gives.
fn kit(pool: PgPool, processor: &StandIn) -> Kit {
    let url = processor.url();
    let config = move || Config {
        processor: Some(Processor::new(&url, Duration::from_secs(5)).expect("a processor")),
        ..Config::default()
    };
    let settings = config();
    Kit::new(pool, move |store| charges::router(store, config()))
        .store(move |builder| charges::configure(builder, &settings))
        .outside(processor)
}

#[sqlx::test(migrations = false)]
async fn a_charge_is_made_once(pool: PgPool) {
    charges::migrate(&pool).await.unwrap();
    let processor = StandIn::honouring_keys("processor").await.unwrap();
    let report = kit(pool, &processor)
        .request(|| {
            Request::post("/charges")
                .header("authorization", "Bearer acct_kit")
                .header("content-type", "application/json")
                .body(Body::from(
                    r#"{"amount": 1250, "currency": "eur", "customer": "cus_1"}"#,
                ))
                .unwrap()
        })
        .effect(Effect::rows("charges"))
        .run()
        .await;
    report.assert_exactly_once();
}

#[sqlx::test(migrations = false)]
async fn a_refund_is_made_once(pool: PgPool) {
    charges::migrate(&pool).await.unwrap();
    let charge: String = sqlx::query_scalar(
        "INSERT INTO charges (account, amount, currency, customer) \
         VALUES ('acct_kit', 1000000, 'eur', 'cus_1') RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let processor = StandIn::honouring_keys("processor").await.unwrap();
    let report = kit(pool, &processor)
        .request(move || {
            Request::post(format!("/charges/{charge}/refunds"))
                .header("authorization", "Bearer acct_kit")
                .header("content-type", "application/json")
                .body(Body::from(r#"{"amount": 100}"#))
                .unwrap()
        })
        .effect(Effect::sum("refunds", "amount"))
        .run()
        .await;
    report.assert_exactly_once();
}

//! A tonic service's methods hold the attribute's contract against a real tonic client
//! over a socket, in the store's three modes (the default, the portable mode, behind
//! PgBouncer): written with `#[idem::grpc]` and `#[idempotent]`, and written by hand
//! under `IdempotencyLayer`. A replay returns the stored message and metadata with
//! `idempotent-replayed: true`; duplicates in flight get `ABORTED` with `RetryInfo`;
//! another payload under a key `FAILED_PRECONDITION`; no key `INVALID_ARGUMENT`; an
//! `Err` rolls back and stays retryable; the database away `UNAVAILABLE`.

use std::time::Duration;

use axum::extract::FromRef;
use idem::layer::{IdempotencyLayer, Transaction};
use idem::testing::Gate;
use idem::{idempotent, Store, Tx};
use idem_tests::{gated_store, with_test_db, Pgbouncer, TestDb};
use prost::Message;
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Response, Status};
use tonic_types::StatusExt;

/// tonic-build's code for `proto/charges.proto`.
#[allow(unreachable_pub, missing_docs)]
mod pb {
    tonic::include_proto!("idem.charges.v1");
}

use pb::charges_client::ChargesClient;
use pb::charges_server::{Charges, ChargesServer};
use pb::{Charge, CreateChargeRequest, Customer};

/// The service with `#[idempotent]` methods: idem's store is one of its fields.
#[derive(Clone, FromRef)]
struct ChargeService {
    store: Store,
}

/// What both services' methods do: a charge row, then, as the request asks, a wait or
/// a failure (an `Err`, which rolls the row back).
async fn charge(
    tx: &mut Tx<'_>,
    request: Request<CreateChargeRequest>,
) -> Result<Response<Charge>, Status> {
    let new = request.into_inner();
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO charges (amount, currency, customer) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(new.amount)
    .bind(&new.currency)
    .bind(new.customer.map(|c| c.id))
    // Unnamed, as a statement behind a transaction pooler must be.
    .persistent(false)
    .fetch_one(&mut **tx)
    .await
    .map_err(|e| Status::internal(e.to_string()))?;
    if new.sleep_ms > 0 {
        tokio::time::sleep(Duration::from_millis(new.sleep_ms.into())).await;
    }
    if new.fail {
        return Err(Status::unavailable("the processor did not answer"));
    }
    let mut reply = Response::new(Charge {
        id,
        amount: new.amount,
        currency: new.currency,
    });
    reply
        .metadata_mut()
        .insert("charge-id", id.to_string().parse().expect("ascii"));
    Ok(reply)
}

#[idem::grpc]
#[tonic::async_trait]
impl Charges for ChargeService {
    #[idempotent(scope = "charges", ttl = "24h", fields = [amount, currency, customer.id], key = request_id)]
    async fn create_charge(
        &self,
        request: Request<CreateChargeRequest>,
        mut tx: Tx,
    ) -> Result<Response<Charge>, Status> {
        charge(&mut tx, request).await
    }

    // Without `fields`: the whole message.
    #[idempotent(scope = "captures")]
    async fn capture(
        &self,
        request: Request<CreateChargeRequest>,
        mut tx: Tx,
    ) -> Result<Response<Charge>, Status> {
        charge(&mut tx, request).await
    }
}

/// The same service by hand, under `IdempotencyLayer`: its methods take the request's
/// transaction from the request's extensions.
#[derive(Clone)]
struct LayeredService;

impl LayeredService {
    async fn run(&self, request: Request<CreateChargeRequest>) -> Result<Response<Charge>, Status> {
        let transaction = request
            .extensions()
            .get::<Transaction>()
            .cloned()
            .ok_or_else(|| Status::internal("no IdempotencyLayer"))?;
        let mut locked = transaction
            .lock()
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        charge(&mut locked.tx(), request).await
    }
}

#[tonic::async_trait]
impl Charges for LayeredService {
    async fn create_charge(
        &self,
        request: Request<CreateChargeRequest>,
    ) -> Result<Response<Charge>, Status> {
        self.run(request).await
    }

    async fn capture(
        &self,
        request: Request<CreateChargeRequest>,
    ) -> Result<Response<Charge>, Status> {
        self.run(request).await
    }
}

/// Which service a test serves.
#[derive(Clone, Copy, Debug)]
enum Written {
    /// `#[idem::grpc]`, `#[idempotent]` methods.
    Attribute,
    /// `IdempotencyLayer` around the generated server.
    Layer,
}

/// The charges table, and `store` migrated.
async fn prepare(db: &TestDb, store: &Store) {
    store.migrate().await.expect("migrate");
    sqlx::raw_sql(
        "CREATE TABLE charges (id bigserial PRIMARY KEY, amount bigint NOT NULL, currency text NOT NULL, customer text)",
    )
    .execute(&db.pool(1).await)
    .await
    .expect("charges table");
}

/// Serves `written` on a loopback port, and a client of it.
async fn serve(store: &Store, written: Written) -> ChargesClient<Channel> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let address = listener.local_addr().expect("its address");
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let store = store.clone();
    tokio::spawn(async move {
        let served = match written {
            Written::Attribute => {
                Server::builder()
                    .add_service(ChargesServer::new(ChargeService { store }))
                    .serve_with_incoming(incoming)
                    .await
            }
            Written::Layer => {
                Server::builder()
                    .layer(IdempotencyLayer::new(store, "layered"))
                    .add_service(ChargesServer::new(LayeredService))
                    .serve_with_incoming(incoming)
                    .await
            }
        };
        served.expect("the gRPC server");
    });
    let channel = Channel::from_shared(format!("http://{address}"))
        .expect("a URI")
        .connect()
        .await
        .expect("connected");
    ChargesClient::new(channel)
}

fn new_charge(amount: i64) -> CreateChargeRequest {
    CreateChargeRequest {
        amount,
        currency: "EUR".into(),
        customer: Some(Customer {
            id: "cus_1".into(),
            name: "Ada".into(),
        }),
        ..CreateChargeRequest::default()
    }
}

/// How a client sends its key to a method.
#[derive(Clone, Copy, Debug)]
enum Keyed {
    /// `create_charge`, AIP-155's `request_id`.
    ByField,
    /// `capture`, the `idempotency-key` metadata.
    ByMetadata,
}

/// Calls the method that reads its key as `keyed` says, with `key` (none: `None`).
async fn call(
    client: &ChargesClient<Channel>,
    keyed: Keyed,
    key: Option<&str>,
    mut message: CreateChargeRequest,
) -> Result<Response<Charge>, Status> {
    let mut client = client.clone();
    match keyed {
        Keyed::ByField => {
            message.request_id = key.unwrap_or_default().to_owned();
            client.create_charge(Request::new(message)).await
        }
        Keyed::ByMetadata => {
            let mut request = Request::new(message);
            if let Some(key) = key {
                request
                    .metadata_mut()
                    .insert("idempotency-key", key.parse().expect("ascii"));
            }
            client.capture(request).await
        }
    }
}

async fn charges(db: &TestDb) -> i64 {
    idem_tests::count(&db.pool(1).await, "charges").await
}

/// The reason in a status's `ErrorInfo`.
fn reason(status: &Status) -> String {
    status
        .get_error_details()
        .error_info()
        .map(|info| info.reason.clone())
        .unwrap_or_default()
}

/// The contract through `client`, for the method `keyed` names.
async fn holds_the_contract(db: &TestDb, client: &ChargesClient<Channel>, keyed: Keyed) {
    let before = charges(db).await;
    let fresh = call(client, keyed, Some("k-1"), new_charge(100))
        .await
        .expect("a charge");
    assert!(fresh.metadata().get("idempotent-replayed").is_none());
    let again = call(client, keyed, Some("k-1"), new_charge(100))
        .await
        .expect("its replay");
    assert_eq!(
        again.metadata().get("idempotent-replayed").unwrap(),
        "true",
        "{:?}",
        again.metadata()
    );
    assert_eq!(
        again.metadata().get("charge-id"),
        fresh.metadata().get("charge-id"),
        "the method's metadata is replayed"
    );
    assert_eq!(
        again.get_ref().encode_to_vec(),
        fresh.get_ref().encode_to_vec(),
        "the message is replayed byte for byte"
    );
    assert_eq!(charges(db).await, before + 1);

    // Another payload under the key.
    let reused = call(client, keyed, Some("k-1"), new_charge(200))
        .await
        .expect_err("another payload");
    assert_eq!(reused.code(), Code::FailedPrecondition, "{reused:?}");
    assert_eq!(reason(&reused), "KEY_REUSED");

    // An `Err` rolls back and stays retryable.
    let failing = CreateChargeRequest {
        fail: true,
        ..new_charge(300)
    };
    let failed = call(client, keyed, Some("k-2"), failing)
        .await
        .expect_err("the method's error");
    assert_eq!(failed.code(), Code::Unavailable);
    assert_eq!(failed.message(), "the processor did not answer");
    assert_eq!(charges(db).await, before + 1);
    call(client, keyed, Some("k-2"), new_charge(300))
        .await
        .expect("the retry runs");
    assert_eq!(charges(db).await, before + 2);

    // Duplicates while the first is in flight: ABORTED with RetryInfo, and one effect.
    let slow = CreateChargeRequest {
        sleep_ms: 700,
        ..new_charge(400)
    };
    let later = |ms| {
        let slow = slow.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            call(client, keyed, Some("k-3"), slow).await
        }
    };
    let (first, second, third) = tokio::join!(
        call(client, keyed, Some("k-3"), slow.clone()),
        later(250),
        later(300),
    );
    first.expect("the first runs");
    for duplicate in [second, third] {
        let status = duplicate.expect_err("a duplicate in flight");
        assert_eq!(status.code(), Code::Aborted, "{status:?}");
        assert_eq!(reason(&status), "KEY_IN_USE");
        let retry = status.get_error_details();
        assert!(retry.retry_info().is_some(), "{status:?}");
        assert!(status.metadata().get("grpc-retry-pushback-ms").is_some());
    }
    assert_eq!(charges(db).await, before + 3);

    // No key.
    let missing = call(client, keyed, None, new_charge(500))
        .await
        .expect_err("no key");
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");
    assert_eq!(reason(&missing), "MISSING_KEY");
    assert_eq!(charges(db).await, before + 3);
}

/// What only the attribute reads: fields, not bytes. A field it does not name may
/// change on a retry, a nested one it names may not; without `fields`, the whole
/// message is the payload.
async fn fingerprints_named_fields(client: &ChargesClient<Channel>) {
    call(client, Keyed::ByField, Some("f-1"), new_charge(100))
        .await
        .expect("a charge");
    let renoted = CreateChargeRequest {
        note: "a retry".into(),
        ..new_charge(100)
    };
    let replay = call(client, Keyed::ByField, Some("f-1"), renoted.clone())
        .await
        .expect("a replay");
    assert_eq!(
        replay.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    let other_customer = CreateChargeRequest {
        customer: Some(Customer {
            id: "cus_2".into(),
            name: "Ada".into(),
        }),
        ..new_charge(100)
    };
    let reused = call(client, Keyed::ByField, Some("f-1"), other_customer)
        .await
        .expect_err("another customer");
    assert_eq!(reused.code(), Code::FailedPrecondition);
    let no_customer = CreateChargeRequest {
        customer: None,
        ..new_charge(100)
    };
    let reused = call(client, Keyed::ByField, Some("f-1"), no_customer)
        .await
        .expect_err("no customer");
    assert_eq!(reused.code(), Code::FailedPrecondition);

    // `capture` names no fields: its whole message, the note too.
    call(client, Keyed::ByMetadata, Some("f-1"), new_charge(100))
        .await
        .expect("a capture");
    let replay = call(client, Keyed::ByMetadata, Some("f-1"), new_charge(100))
        .await
        .expect("a replay");
    assert_eq!(
        replay.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    let reused = call(client, Keyed::ByMetadata, Some("f-1"), renoted)
        .await
        .expect_err("another note");
    assert_eq!(reused.code(), Code::FailedPrecondition);
}

/// The contract in one mode, for both ways of writing the service.
async fn serves_the_contract(db: &TestDb, store: Store) {
    prepare(db, &store).await;
    let attribute = serve(&store, Written::Attribute).await;
    holds_the_contract(db, &attribute, Keyed::ByField).await;
    holds_the_contract(db, &attribute, Keyed::ByMetadata).await;
    fingerprints_named_fields(&attribute).await;
    let layered = serve(&store, Written::Layer).await;
    holds_the_contract(db, &layered, Keyed::ByMetadata).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tonic_service_holds_the_contract_in_the_default_mode() {
    with_test_db(async |db| {
        let store = Store::builder(db.pool(8).await).build().unwrap();
        serves_the_contract(db, store).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tonic_service_holds_the_contract_in_the_portable_mode() {
    with_test_db(async |db| {
        let store = Store::builder(db.pool(8).await).portable(true).build();
        serves_the_contract(db, store.unwrap()).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tonic_service_holds_the_contract_behind_a_transaction_pooler() {
    with_test_db(async |db| {
        let pgbouncer = Pgbouncer::start(db);
        serves_the_contract(db, pgbouncer.store(8).await).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_database_away_a_tonic_method_answers_unavailable_and_runs_nothing() {
    with_test_db(async |db| {
        prepare(db, &Store::builder(db.pool(2).await).build().unwrap()).await;
        let mut gate = Gate::start(&db.options).await;
        let store = gated_store(gate.options(db.options.clone()));
        for written in [Written::Attribute, Written::Layer] {
            let client = serve(&store, written).await;
            gate.shut().await;
            let key = format!("{written:?}");
            let away = call(&client, Keyed::ByMetadata, Some(&key), new_charge(100))
                .await
                .expect_err("the database is away");
            assert_eq!(away.code(), Code::Unavailable, "{written:?}: {away:?}");
            assert_eq!(reason(&away), "UNAVAILABLE");
            assert!(away.get_error_details().retry_info().is_some());
            gate.open().await;
            assert_eq!(charges(db).await, 0);
            call(&client, Keyed::ByMetadata, Some(&key), new_charge(100))
                .await
                .expect("after the outage, the call runs");
            sqlx::raw_sql("DELETE FROM charges")
                .execute(&db.pool(1).await)
                .await
                .unwrap();
        }
    })
    .await;
}

/// A reply over the store's cap on stored responses cannot be replayed, so it is not
/// committed: the method's writes roll back, and the client gets `INTERNAL` with the
/// reason, both ways of writing the service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_over_the_stored_cap_rolls_back() {
    with_test_db(async |db| {
        let store = Store::builder(db.pool(4).await)
            .max_response_bytes(8)
            .build()
            .unwrap();
        prepare(db, &store).await;
        for written in [Written::Attribute, Written::Layer] {
            let client = serve(&store, written).await;
            let refused = call(&client, Keyed::ByMetadata, Some("k-1"), new_charge(100))
                .await
                .expect_err("over the cap");
            assert_eq!(refused.code(), Code::Internal, "{written:?}: {refused:?}");
            assert_eq!(reason(&refused), "RESPONSE_TOO_LARGE", "{written:?}");
            assert_eq!(charges(db).await, 0, "{written:?}");
        }
    })
    .await;
}

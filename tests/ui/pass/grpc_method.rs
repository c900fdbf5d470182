use idem::{idempotent, Store, Tx};
use tonic::{Request, Response, Status};

#[derive(Clone, PartialEq, prost::Message)]
pub struct NewCharge {
    #[prost(int64, tag = "1")]
    pub amount: i64,
    #[prost(string, tag = "2")]
    pub request_id: String,
}

/// A tonic server trait, as tonic-build writes one.
#[tonic::async_trait]
pub trait Charges: Send + Sync + 'static {
    async fn create(&self, request: Request<NewCharge>) -> Result<Response<NewCharge>, Status>;
}

#[derive(Clone, axum::extract::FromRef)]
struct ChargeService {
    store: Store,
}

#[idem::grpc]
#[tonic::async_trait]
impl Charges for ChargeService {
    #[idempotent(scope = "charges", ttl = "7d", fields = [amount], key = request_id, concurrency = wait("5s"))]
    async fn create(&self, request: Request<NewCharge>, mut tx: Tx) -> Result<Response<NewCharge>, Status> {
        let new = request.into_inner();
        sqlx::query("SELECT $1")
            .bind(new.amount)
            .execute(&mut *tx)
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        if new.amount < 0 {
            return Err(Status::invalid_argument("a negative amount"));
        }
        Ok(Response::new(new))
    }
}

fn main() {}

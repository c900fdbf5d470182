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

#[derive(Clone)]
struct ChargeService {
    pool: sqlx::PgPool,
}

#[idem::grpc]
#[tonic::async_trait]
impl Charges for ChargeService {
    #[idempotent(scope = "charges", fields = [amount], key = request_id)]
    async fn create(&self, request: Request<NewCharge>, _tx: Tx) -> Result<Response<NewCharge>, Status> {
        let _ = &self.pool;
        Ok(Response::new(request.into_inner()))
    }
}

fn main() {}

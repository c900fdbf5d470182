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
    #[idempotent(scope = "charges", key = request_id, completable = true)]
    async fn create(&self, request: Request<NewCharge>, _tx: Tx) -> Result<Response<NewCharge>, Status> {
        Ok(Response::new(request.into_inner()))
    }
}

fn main() {}

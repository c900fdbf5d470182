use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::Json;
use idem::{idempotent, Tx};
use idem::extract::Principal;

struct Tenant(String);

impl<S: Send + Sync> FromRequestParts<S> for Tenant {
    type Rejection = ();

    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, ()> {
        Ok(Tenant(String::new()))
    }
}

impl Principal for Tenant {
    fn principal_id(&self) -> String {
        self.0.clone()
    }
}

#[idempotent(scope = "events", principal = Tenant, spread = key)]
async fn receive(_tx: Tx, Json(v): Json<serde_json::Value>) -> Json<serde_json::Value> {
    Json(v)
}

fn main() {}

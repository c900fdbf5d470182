//! A body extractor of the user's own that is no `FingerprintBody`: left out of the
//! fingerprint, a reused key with another payload would replay the first answer. Whether
//! a parameter reads the body depends on the router's state, so the error is on the
//! route.
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idem::{idempotent, Store, Tx};

struct Csv(Vec<String>);

impl<S: Send + Sync> FromRequest<S> for Csv {
    type Rejection = StatusCode;

    async fn from_request(req: Request, state: &S) -> Result<Self, StatusCode> {
        let text = String::from_request(req, state).await.map_err(|_| StatusCode::BAD_REQUEST)?;
        Ok(Self(text.split(',').map(str::to_owned).collect()))
    }
}

#[idempotent(scope = "imports")]
async fn import(_tx: Tx, Csv(rows): Csv) -> String {
    rows.len().to_string()
}

fn app(store: Store) -> Router {
    Router::new().route("/imports", post(import)).with_state(store)
}

fn main() {
    let _ = app;
}

//! The `#[idempotent]` attribute of idem. Use it through the `idem-runtime` crate, which
//! re-exports it and documents it: `use idem_runtime::idempotent;`.

mod attr;
mod expand;
mod valid;

use proc_macro::TokenStream;

/// Makes an axum handler idempotent on PostgreSQL. See `idem_runtime` for the guide.
///
/// ```ignore
/// #[idempotent(scope = "charges", ttl = "24h", fields = [amount, currency, customer])]
/// async fn create_charge(tx: Tx, Json(req): Json<NewCharge>) -> Result<Json<Charge>, ApiError> { ... }
/// ```
///
/// Options: `scope` (required), `ttl` (default `"24h"`), `fields` (default: the whole
/// body) and `principal` (an extractor type implementing `idem_runtime::Principal`;
/// default: the store's resolver). Set `IDEM_MACROS_DEBUG=1` while building to print
/// the expansion.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}

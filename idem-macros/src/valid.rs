//! Checks on the handler's signature: what the wrapper can and cannot be built around.

use syn::spanned::Spanned;
use syn::{FnArg, ItemFn, PatType, Type};

use crate::attr::Errors;

/// The handler's parameters, with the position of its `Tx`, if any.
pub struct Handler<'a> {
    pub params: Vec<&'a PatType>,
    pub tx: Option<usize>,
}

/// Whether a parameter's type is idem's `Tx` (`Tx`, `Tx<'_>`, `idem_runtime::Tx`).
fn is_tx(ty: &Type) -> bool {
    match ty {
        Type::Path(p) if p.qself.is_none() => {
            p.path.segments.last().is_some_and(|s| s.ident == "Tx")
        }
        Type::Group(g) => is_tx(&g.elem),
        Type::Paren(p) => is_tx(&p.elem),
        _ => false,
    }
}

pub fn handler<'a>(func: &'a ItemFn, errors: &mut Errors) -> Handler<'a> {
    let sig = &func.sig;
    if sig.asyncness.is_none() {
        errors.at(
            sig.fn_token.span(),
            "`#[idempotent]` handlers must be `async fn`: the handler runs inside the request's transaction",
        );
    }
    if let Some(constness) = &sig.constness {
        errors.at(
            constness.span(),
            "`#[idempotent]` cannot be used on a `const fn`",
        );
    }
    if let Some(abi) = &sig.abi {
        errors.at(
            abi.span(),
            "`#[idempotent]` handlers cannot have an `extern` ABI",
        );
    }
    if let Some(variadic) = &sig.variadic {
        errors.at(
            variadic.span(),
            "`#[idempotent]` handlers cannot be variadic",
        );
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        errors.at(
            sig.generics.span(),
            "`#[idempotent]` handlers cannot be generic: axum needs one concrete handler per route",
        );
    }
    let mut handler = Handler {
        params: Vec::new(),
        tx: None,
    };
    for input in &sig.inputs {
        match input {
            FnArg::Receiver(receiver) => errors.at(
                receiver.span(),
                "`#[idempotent]` handlers cannot take `self`: write a free function and pass state with `State`",
            ),
            FnArg::Typed(param) => {
                if is_tx(&param.ty) {
                    if handler.tx.is_some() {
                        errors.at(
                            param.ty.span(),
                            "a handler takes at most one `Tx`: there is one transaction per request",
                        );
                    } else {
                        handler.tx = Some(handler.params.len());
                    }
                }
                handler.params.push(param);
            }
        }
    }
    handler
}

//! Checks on the handler: what the wrapper can and cannot be built around, what the
//! body must not do with the request's transaction, and which options it can serve.

use syn::spanned::Spanned;
use syn::visit::{self, Visit};
use syn::{Expr, FnArg, Ident, ItemFn, Pat, PatType, Type};

use crate::attr::{Args, KeySource, Spread};
use crate::errors::Errors;

/// The handler's parameters, with the position of its `Tx`, if any.
pub(crate) struct Handler<'a> {
    pub params: Vec<&'a PatType>,
    pub tx: Option<usize>,
}

impl Handler<'_> {
    /// The parameters the wrapper extracts (all but `Tx`), with their positions.
    pub(crate) fn extracted(&self) -> impl Iterator<Item = (usize, &PatType)> {
        self.params
            .iter()
            .enumerate()
            .filter(|(i, _)| Some(*i) != self.tx)
            .map(|(i, p)| (i, *p))
    }
}

/// Whether a parameter's type is idem's `Tx` (`Tx`, `Tx<'_>`, `idem::Tx`).
pub(crate) fn is_tx(ty: &Type) -> bool {
    match ty {
        Type::Path(p) if p.qself.is_none() => {
            p.path.segments.last().is_some_and(|s| s.ident == "Tx")
        }
        Type::Group(g) => is_tx(&g.elem),
        Type::Paren(p) => is_tx(&p.elem),
        _ => false,
    }
}

pub(crate) fn handler<'a>(func: &'a ItemFn, errors: &Errors) -> Handler<'a> {
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
        let span = match sig.generics.params.first() {
            Some(param) => param.span(),
            None => sig.generics.where_clause.span(),
        };
        errors.at(
            span,
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
                receiver.self_token.span(),
                "`#[idempotent]` handlers cannot take `self`: write a free function and pass state with `State`; on a tonic service's method, put `#[idem::grpc]` on its `impl` block, above `#[tonic::async_trait]`",
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
    // A body extractor before others is found by the type system too
    // (`__private::before_the_body`), but the wrapper axum cannot route then adds its
    // own errors; a well-known one is reported here, alone.
    let extracted: Vec<&PatType> = handler.extracted().map(|(_, p)| p).collect();
    if let Some((_, before_last)) = extracted.split_last() {
        for param in before_last {
            if let Some(body) = known_body(&param.ty) {
                errors.at(
                    param.ty.span(),
                    format!(
                        "the request body must be the handler's last parameter: axum reads the body once, \
                         after every other extractor; move this `{body}` parameter to the end"
                    ),
                );
            }
        }
    }
    if let Some(tx) = handler.tx.map(|i| handler.params[i]) {
        if let Pat::Ident(binding) = &*tx.pat {
            let mut check = TxMisuse {
                tx: &binding.ident,
                errors,
                spawned: false,
            };
            check.visit_block(&func.block);
        }
    }
    handler
}

/// The name of a well-known extractor that reads the request body (axum's, and idem's
/// `Signed`), also inside `Option` or `Result`.
fn known_body(ty: &Type) -> Option<&Ident> {
    const BODIES: [&str; 9] = [
        "Json",
        "Form",
        "RawForm",
        "Bytes",
        "String",
        "Body",
        "Request",
        "Multipart",
        "Signed",
    ];
    match ty {
        Type::Path(p) if p.qself.is_none() => {
            let last = p.path.segments.last()?;
            if BODIES.iter().any(|body| last.ident == body) {
                return Some(&last.ident);
            }
            let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
                return None;
            };
            match args.args.first()? {
                syn::GenericArgument::Type(inner)
                    if last.ident == "Option" || last.ident == "Result" =>
                {
                    known_body(inner)
                }
                _ => None,
            }
        }
        Type::Group(g) => known_body(&g.elem),
        Type::Paren(p) => known_body(&p.elem),
        _ => None,
    }
}

/// Checks the options against the handler: those that read the body need a parameter
/// to read it from. Whether that parameter is a body is the type system's to say
/// (`__private::body_of`), on the parameter's type.
pub(crate) fn args(args: &Args, handler: &Handler<'_>, errors: &Errors) {
    if handler.extracted().next().is_some() {
        return;
    }
    if let Some((keyword, _)) = &args.fields {
        errors.at(
            keyword.span,
            "`fields` needs a body to read them from: add a `Json<T>` parameter as the handler's last parameter",
        );
    }
    if let Some((_, KeySource::Field(path))) = &args.key {
        errors.at(
            path.members[0].span(),
            "`key = field` needs a body to read it from: add a `Json<T>` parameter as the handler's last parameter",
        );
    }
    if let Some((_, KeySource::Digest(digest))) = &args.key {
        errors.at(
            digest.span,
            "`key = digest(body)` needs a body to hash: add a `Json<T>` parameter as the handler's last parameter",
        );
    }
    if let Some((_, Spread::Tenant(path))) = &args.spread {
        errors.at(
            path.span(),
            "`spread = function` needs a body to find the tenant in: add a `Json<T>` parameter as the handler's last parameter, or use `spread = key`",
        );
    }
}

/// Finds what the type system reports only obscurely: ending idem's transaction by
/// hand, and moving `Tx` into a spawned task.
struct TxMisuse<'a> {
    tx: &'a Ident,
    errors: &'a Errors,
    spawned: bool,
}

impl TxMisuse<'_> {
    fn is_tx(&self, expr: &Expr) -> bool {
        matches!(expr, Expr::Path(p) if p.qself.is_none() && p.path.is_ident(self.tx))
    }
}

impl<'ast> Visit<'ast> for TxMisuse<'_> {
    fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
        if (call.method == "commit" || call.method == "rollback") && self.is_tx(&call.receiver) {
            let tx = self.tx;
            let method = &call.method;
            self.errors.at(
                call.method.span(),
                format!(
                    "`{tx}.{method}()`: idem ends the request's transaction itself, together with the key and the stored response; \
                     return `Ok(..)` to commit or `Err(..)` to roll back"
                ),
            );
        }
        visit::visit_expr_method_call(self, call);
    }

    fn visit_expr_call(&mut self, call: &'ast syn::ExprCall) {
        let spawns = matches!(&*call.func, Expr::Path(p) if p.path.segments.last().is_some_and(|s| {
            matches!(s.ident.to_string().as_str(), "spawn" | "spawn_blocking" | "spawn_local")
        }));
        if spawns && !self.spawned {
            self.spawned = true;
            visit::visit_expr_call(self, call);
            self.spawned = false;
        } else {
            visit::visit_expr_call(self, call);
        }
    }

    fn visit_expr_path(&mut self, path: &'ast syn::ExprPath) {
        if self.spawned && path.qself.is_none() && path.path.is_ident(self.tx) {
            let tx = self.tx;
            self.errors.at(
                path.span(),
                format!(
                    "`{tx}` cannot be moved into a spawned task: the task may outlive the request, and its writes would \
                     escape the transaction that commits with the key; do the write in the handler itself"
                ),
            );
            // Once per spawned task is enough.
            self.spawned = false;
        }
        visit::visit_expr_path(self, path);
    }

    // A nested item is another function: its names are not the handler's.
    fn visit_item(&mut self, _: &'ast syn::Item) {}
}

/// After `tx.commit()` or `tx.rollback()` was refused, the fallback's body calls
/// `::idem::__private::ended_by_idem(&tx)` in their place: a future with the output of
/// sqlx's `Transaction::commit`, so that `.await?`, `.await.ok()` and the like type-check
/// and the refusal is the build's only error (not also rustc's "no method `commit`",
/// with its suggestion to import a trait of sqlx's internals).
pub(crate) fn defuse_tx_endings(func: &mut syn::ItemFn) {
    let tx = func.sig.inputs.iter().find_map(|input| match input {
        syn::FnArg::Typed(param) if is_tx(&param.ty) => match &*param.pat {
            Pat::Ident(binding) => Some(binding.ident.clone()),
            _ => None,
        },
        _ => None,
    });
    if let Some(tx) = tx {
        syn::visit_mut::VisitMut::visit_block_mut(&mut Defuse { tx: &tx }, &mut func.block);
    }
}

struct Defuse<'a> {
    tx: &'a Ident,
}

impl syn::visit_mut::VisitMut for Defuse<'_> {
    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        if let Expr::MethodCall(call) = expr {
            let on_tx = matches!(&*call.receiver, Expr::Path(p) if p.qself.is_none() && p.path.is_ident(self.tx));
            if on_tx
                && (call.method == "commit" || call.method == "rollback")
                && call.args.is_empty()
            {
                let receiver = &call.receiver;
                *expr = syn::parse_quote_spanned!(call.method.span()=>
                    ::idem::__private::ended_by_idem(&#receiver)
                );
                return;
            }
        }
        syn::visit_mut::visit_expr_mut(self, expr);
    }

    // A nested item is another function: its names are not the handler's.
    fn visit_item_mut(&mut self, _: &mut syn::Item) {}
}

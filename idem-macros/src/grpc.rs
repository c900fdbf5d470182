//! `#[idem::grpc]`: the `#[idempotent]` methods of a tonic service's `impl` block.
//!
//! tonic's server traits are `#[async_trait]` traits, and `#[tonic::async_trait]` on the
//! `impl` block rewrites every method into one that returns a boxed future before an
//! attribute on a method expands. So this attribute goes on the block, above tonic's,
//! and rewrites each method marked `#[idempotent(..)]` while it is still an `async fn`:
//! the method reads its key and principal from the request's metadata, fingerprints the
//! message's named fields, claims, runs its body with the `Tx` it asked for, and stores
//! its reply (`idem::__private::grpc`, on the web adapter's guard and claim).

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, ImplItem, ImplItemFn, ItemImpl, ReturnType};

use crate::attr::{self, Args, FieldPath, KeySource};
use crate::errors::Errors;
use crate::expand::{self, joined_span};
use crate::valid;

pub(crate) fn grpc(args: TokenStream, item: TokenStream) -> TokenStream {
    let errors = Errors::new();
    if !args.is_empty() {
        errors.at(
            args.span(),
            "`#[idem::grpc]` takes no arguments: they go on each method's `#[idempotent(..)]`",
        );
    }
    let mut block: ItemImpl = match syn::parse2(item.clone()) {
        Ok(block) => block,
        Err(e) => {
            errors.at(
                e.span(),
                format!("`#[idem::grpc]` goes on the `impl` block of a tonic service, above `#[tonic::async_trait]`: {e}"),
            );
            let error = errors.check().err().map(|e| e.to_compile_error());
            return quote!(#item #error);
        }
    };
    let procedure_of = block
        .trait_
        .as_ref()
        .and_then(|(_, path, _)| path.segments.last())
        .map(|segment| segment.ident.to_string());
    if procedure_of.is_none() {
        errors.at(
            block.self_ty.span(),
            "`#[idem::grpc]` goes on the `impl` of a tonic service's trait (`impl Charges for ChargeService`)",
        );
    }
    let service = procedure_of.unwrap_or_default();
    for item in &mut block.items {
        let ImplItem::Fn(method) = item else { continue };
        let Some(at) = method.attrs.iter().position(is_idempotent) else {
            continue;
        };
        let attribute = method.attrs.remove(at);
        if let Some(tokens) = rewrite(&service, method, &attribute, &errors) {
            *method = tokens;
        }
    }
    let error = errors.check().err().map(|e| e.to_compile_error());
    quote!(#block #error)
}

fn is_idempotent(attr: &syn::Attribute) -> bool {
    attr.path()
        .segments
        .last()
        .is_some_and(|segment| segment.ident == "idempotent")
}

/// The method, rewritten; `None` (and errors) when it cannot be.
fn rewrite(
    service: &str,
    method: &ImplItemFn,
    attribute: &syn::Attribute,
    errors: &Errors,
) -> Option<ImplItemFn> {
    let args_tokens = match &attribute.meta {
        syn::Meta::List(list) => list.tokens.clone(),
        _ => TokenStream::new(),
    };
    let args = attr::parse(args_tokens, errors);
    let sig = &method.sig;
    let (request, tx, output) = signature(sig, errors)?;
    let args = args?;
    refuse_http_only(&args, errors);

    let (_, scope) = &args.scope;
    let required = args.required();
    let ttl = expand::ttl(&args);
    let (conflict_wait, statement_timeout, isolation) = expand::timing(&args);
    let procedure = format!("{service}/{}", sig.ident);
    let key = key(&args, errors)?;
    let fields = fields(&args);
    let request_pat = &request.pat;
    let request_ty = &request.ty;
    let bind_tx = tx.map(|tx| {
        let (pat, ty) = (&tx.pat, with_elided_lifetime(&tx.ty));
        quote!(let #pat: #ty = __idem_claim.tx();)
    });
    let name = &sig.ident;
    let block = &method.block;
    let attrs = &method.attrs;
    let vis = &method.vis;
    let asyncness = &sig.asyncness;
    let receiver = sig.inputs.first();
    let request_arg = format_ident!("__idem_request", span = request.pat.span());

    // The attribute is taken off the method, so its import would be unused: named here.
    let attribute_path = attribute.path();
    let tokens = quote! {
        #(#attrs)*
        #vis #asyncness fn #name(#receiver, #request_arg: #request_ty) -> #output {
            #[allow(unused_imports)]
            use #attribute_path as _;
            #[allow(unused_imports)]
            use ::idem::__private::{NotSerializeLevel as _, SerializeLevel as _};
            static __IDEM_SPEC: ::idem::__private::Spec = ::idem::__private::Spec {
                scope: #scope,
                ttl: #ttl,
                required: #required,
                conflict_wait: #conflict_wait,
                isolation: ::idem::__private::Isolation::#isolation,
                statement_timeout: #statement_timeout,
            };
            let mut __idem_request = #request_arg;
            let (__idem_guard, mut __idem_fields) = match ::idem::__private::grpc::read(
                self, &__IDEM_SPEC, #procedure, &mut __idem_request,
            ).await {
                ::core::result::Result::Ok(read) => read,
                ::core::result::Result::Err(status) => return ::core::result::Result::Err(status),
            };
            let __idem_key = {
                #[allow(unused_variables)]
                let __idem_message = __idem_request.get_ref();
                #key
            };
            {
                #[allow(unused_variables)]
                let __idem_message = __idem_request.get_ref();
                #fields
            }
            let mut __idem_claim = match ::idem::__private::grpc::claim(
                __idem_guard, &__IDEM_SPEC, __idem_key, __idem_fields,
            ).await {
                ::core::result::Result::Ok(claim) => claim,
                ::core::result::Result::Err(answer) => return answer,
            };
            let __idem_span = __idem_claim.span();
            let __idem_out = {
                #bind_tx
                let #request_pat = __idem_request;
                ::idem::__private::in_span(
                    ::idem::__private::grpc::typed::<#output, _>(async move #block),
                    __idem_span,
                    ::core::stringify!(#name),
                )
                .await
            };
            ::idem::__private::grpc::finish(__idem_claim, __idem_out).await
        }
    };
    match syn::parse2(tokens) {
        Ok(method) => Some(method),
        Err(e) => {
            errors.push(e);
            None
        }
    }
}

/// The method's request, its `tx: Tx` if it takes one, and its return type: what tonic's
/// trait has, and a transaction after.
fn signature<'a>(
    sig: &'a syn::Signature,
    errors: &Errors,
) -> Option<(&'a syn::PatType, Option<&'a syn::PatType>, &'a syn::Type)> {
    if sig.asyncness.is_none() {
        errors.at(
            sig.fn_token.span(),
            "an `#[idempotent]` method must be an `async fn` here: put `#[idem::grpc]` above `#[tonic::async_trait]`, which rewrites the methods first",
        );
        return None;
    }
    let mut inputs = sig.inputs.iter();
    if !matches!(inputs.next(), Some(FnArg::Receiver(_))) {
        errors.at(
            sig.ident.span(),
            "an `#[idempotent]` method takes `&self` and the request, as tonic's trait says",
        );
        return None;
    }
    let Some(FnArg::Typed(request)) = inputs.next() else {
        errors.at(
            sig.ident.span(),
            "an `#[idempotent]` method takes the request (`tonic::Request<..>`) after `&self`",
        );
        return None;
    };
    let tx = match inputs.next() {
        None => None,
        Some(FnArg::Typed(tx)) if valid::is_tx(&tx.ty) => Some(tx),
        Some(other) => {
            errors.at(
                other.span(),
                "after the request, an `#[idempotent]` method takes only its transaction, `tx: Tx`",
            );
            return None;
        }
    };
    if let Some(extra) = inputs.next() {
        errors.at(
            extra.span(),
            "after the request, an `#[idempotent]` method takes only its transaction, `tx: Tx`",
        );
        return None;
    }
    let ReturnType::Type(_, output) = &sig.output else {
        errors.at(
            sig.ident.span(),
            "an `#[idempotent]` method returns `Result<tonic::Response<..>, tonic::Status>`, as tonic's trait says",
        );
        return None;
    };
    Some((request, tx, output))
}

/// The key's expression: `key = field` from the message, `key = header(..)` from its
/// metadata, none for the `idempotency-key` metadata the guard reads.
fn key(args: &Args, errors: &Errors) -> Option<TokenStream> {
    let key = match args.key.as_ref().map(|(_, source)| source) {
        None => quote!(::core::option::Option::None),
        Some(KeySource::Field(path)) => {
            let value = value_of(path);
            quote_spanned!(joined_span(path)=> ::core::option::Option::Some(::idem::__private::grpc::key_of(&#value)))
        }
        Some(KeySource::Header(name)) => quote! {
            ::core::option::Option::Some(::idem::__private::key_from_header(
                &__idem_request.metadata().clone().into_headers(), #name, false,
            ))
        },
        Some(KeySource::Digest(digest)) => {
            errors.at(
                digest.span,
                "`key = digest(body)` is not for a gRPC method: a message has no canonical encoding idem hashes; name a field (`key = request_id`) or a metadata key (`key = header(\"..\")`)",
            );
            return None;
        }
    };
    Some(key)
}

/// The fingerprint's additions: each named field of the message, or the whole message.
fn fields(args: &Args) -> TokenStream {
    // Without `fields`, the whole message, as a handler's whole body.
    let whole = args
        .fields
        .is_none()
        .then(|| quote!(::idem::__private::grpc::whole(&mut __idem_fields, __idem_message);));
    let adds = args
        .fields
        .iter()
        .flat_map(|(_, fields)| fields)
        .map(|path| {
            let name = path.name();
            let value = value_of(path);
            quote_spanned! {joined_span(path)=>
                __idem_fields.field(
                    #name,
                    &#value,
                    (&::idem::__private::probe(&#value)).__idem_serialize(),
                );
            }
        });
    quote!(#(#adds)* #whole)
}

/// The options that mean something only for an axum handler.
fn refuse_http_only(args: &Args, errors: &Errors) {
    if let Some((kw, _)) = &args.principal {
        errors.at(
            kw.span,
            "`principal = ..` names an axum extractor, which a gRPC method has none of: the store's principal resolver reads the request's metadata",
        );
    }
    if let Some((kw, _)) = &args.spread {
        errors.at(
            kw.span,
            "`spread = ..` is not for a gRPC method yet: its keys are kept under the store's principal resolver's principal",
        );
    }
    if let Some((kw, _)) = &args.completable {
        errors.at(
            kw.span,
            "`completable = ..` is not for a gRPC method: the completer re-sends a stored HTTP request through an axum router, and a tonic method is no route of one (the book's gRPC chapter says more)",
        );
    }
}

/// `Tx` as `Tx<'_>`: a type in a `let` may not hide its lifetime
/// (`elided_lifetimes_in_paths`), and the user's token keeps its import used.
fn with_elided_lifetime(ty: &syn::Type) -> syn::Type {
    let mut ty = ty.clone();
    if let syn::Type::Path(path) = &mut ty {
        if let Some(last) = path.path.segments.last_mut() {
            if last.arguments.is_none() {
                last.arguments = syn::PathArguments::AngleBracketed(syn::parse_quote!(<'_>));
            }
        }
    }
    ty
}

/// A field of the message, possibly nested: `__idem_message.amount`, or, through the
/// messages prost wraps in `Option`, `__idem_message.customer.as_ref().map(|m| &m.id)`:
/// `None` when a message on the way is absent.
fn value_of(path: &FieldPath) -> TokenStream {
    let (last, through) = path
        .members
        .split_last()
        .expect("a field path has a member");
    let Some((first, rest)) = through.split_first() else {
        return quote!(__idem_message.#last);
    };
    let mut value = quote!(__idem_message.#first.as_ref());
    for member in rest {
        value = quote!(#value.and_then(|__idem_m| __idem_m.#member.as_ref()));
    }
    quote!(#value.map(|__idem_m| &__idem_m.#last))
}

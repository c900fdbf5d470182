//! The generated wrapper: an axum handler that extracts the key, fingerprints the
//! request, claims the key and calls the user's function, kept as an inner `async fn`
//! under the handler's own name (so `return` and `?` behave, and errors name the
//! handler), with a `Tx` borrowed from the claim.

use proc_macro2::{Literal, Span, TokenStream};
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::{Attribute, Ident, ItemFn, Type};

use crate::attr::{self, Args, FieldPath, KeySource};
use crate::errors::Errors;
use crate::openapi;
use crate::valid::{self, Handler};

pub(crate) fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let func: ItemFn = match syn::parse2(item.clone()) {
        Ok(func) => func,
        Err(e) => {
            let e = syn::Error::new(
                e.span(),
                format!("`#[idempotent]` goes on an `async fn` handler: {e}"),
            );
            return fallback(item, e);
        }
    };
    let errors = Errors::new();
    let args = attr::parse(args, &errors);
    let handler = valid::handler(&func, &errors);
    if let Some(args) = &args {
        valid::args(args, &handler, &errors);
    }
    let tokens = match (errors.check(), args) {
        (Ok(()), Some(args)) => wrapper(&func, &args, &handler),
        (Err(e), _) => fallback_fn(func.clone(), e),
        (Ok(()), None) => fallback_fn(
            func.clone(),
            syn::Error::new(Span::call_site(), "invalid `#[idempotent]` arguments"),
        ),
    };
    if std::env::var_os("IDEM_MACROS_DEBUG").is_some() {
        eprintln!("#[idempotent] expansion of `{}`:\n{tokens}", func.sig.ident);
    }
    tokens
}

/// On error the user's function is still emitted, so IDEs keep completing and no
/// cascade of "cannot find function" errors follows the real one.
fn fallback(item: TokenStream, error: syn::Error) -> TokenStream {
    let error = error.to_compile_error();
    quote!(#item #error)
}

/// The fallback for a function, so that the only errors are the real ones: a handler of
/// the same name that takes nothing, which a route (`post(create_charge)`) accepts where
/// the function as written (its `Tx` is no extractor) would add a second, misleading
/// error there; inside it, the function as written (with `Tx` lifetimes made explicit
/// and a refused `tx.commit()` replaced), so its body is still checked. Docs, `cfg` and
/// the handler's attributes go on the outer function, as on the wrapper.
fn fallback_fn(mut func: ItemFn, error: syn::Error) -> TokenStream {
    elide_tx_lifetimes(&mut func.sig);
    valid::defuse_tx_endings(&mut func);
    // A method (refused) is no handler, and its `self` means nothing in a nested item.
    if func.sig.receiver().is_some() {
        return fallback(quote!(#func), error);
    }
    let (outer, inner): (Vec<Attribute>, Vec<Attribute>) = std::mem::take(&mut func.attrs)
        .into_iter()
        .partition(|attr| is_wrapper_attr(attr) || is_handler_attr(attr));
    func.attrs = inner;
    let vis = std::mem::replace(&mut func.vis, syn::Visibility::Inherited);
    let name = &func.sig.ident;
    let handler = quote! {
        #(#outer)*
        #vis async fn #name() -> ::idem::__private::Response {
            #[allow(dead_code)]
            #func
            ::core::unreachable!("`#[idempotent]` did not expand")
        }
    };
    fallback(handler, error)
}

/// Docs and `cfg` describe the handler, so they go on the wrapper; every other
/// attribute (lints, tracing ...) is about the body, which is the inner function.
fn is_wrapper_attr(attr: &Attribute) -> bool {
    attr.path().is_ident("doc") || attr.path().is_ident("cfg")
}

/// Gives every `Tx` parameter written without a lifetime its elided one: `tx: Tx` reads
/// best, but an `async fn` may not hide a lifetime (E0726).
fn elide_tx_lifetimes(sig: &mut syn::Signature) {
    for input in &mut sig.inputs {
        let syn::FnArg::Typed(param) = input else {
            continue;
        };
        if !valid::is_tx(&param.ty) {
            continue;
        }
        if let Type::Path(path) = &mut *param.ty {
            if let Some(last) = path.path.segments.last_mut() {
                if last.arguments.is_none() {
                    let span = last.ident.span();
                    last.arguments =
                        syn::PathArguments::AngleBracketed(syn::parse_quote_spanned!(span=> <'_>));
                }
            }
        }
    }
}

/// Attributes that describe the axum handler, not the body: `#[utoipa::path]` (the
/// operation, which idem completes) and `#[axum::debug_handler]` (which checks the
/// handler axum sees). They go on the wrapper.
fn is_handler_attr(attr: &Attribute) -> bool {
    openapi::is_utoipa_path(attr) || openapi::is_debug_handler(attr)
}

/// The wrapper's attributes: docs, `cfg`, the completed `#[utoipa::path]`, and
/// `#[axum::debug_handler]`, given the state the wrapper is written for when it names
/// none (see [`router_state`]).
fn wrapper_attrs(func: &ItemFn, args: &Args, state: Option<&Type>) -> Vec<TokenStream> {
    func.attrs
        .iter()
        .filter_map(|attr| {
            if is_wrapper_attr(attr) {
                Some(quote!(#attr))
            } else if openapi::is_utoipa_path(attr) {
                Some(match openapi::document(attr, args) {
                    Ok(attr) => quote!(#attr),
                    Err(e) => e.to_compile_error(),
                })
            } else if openapi::is_debug_handler(attr) {
                match (&attr.meta, state) {
                    (syn::Meta::Path(path), Some(state)) => Some(quote!(#[#path(state = #state)])),
                    _ => Some(quote!(#attr)),
                }
            } else {
                None
            }
        })
        .collect()
}

/// The router's state the wrapper is written for. Without `#[axum::debug_handler]`,
/// its own type parameter: `Guard<S>` extracts for the state `S` only, so axum's
/// `Handler` impl makes it the router's state, and the wrapper's `where S: HoldsStore`
/// is checked on the route, `post(handler)`, with idem's message naming `FromRef` and
/// the state (a bound inside axum's `Handler` impls, which are `do_not_recommend`,
/// would be reported as the `Handler` bound). `#[axum::debug_handler]` does not check a
/// generic function, so under it the wrapper is written for the state it checks with:
/// the one it names, the `T` of the handler's `State<T>`, or axum's default, `()`.
fn router_state(func: &ItemFn, handler: &Handler<'_>) -> Option<Type> {
    let attr = func
        .attrs
        .iter()
        .find(|attr| openapi::is_debug_handler(attr))?;
    let named = match &attr.meta {
        syn::Meta::List(_) => attr.parse_args_with(named_state).ok(),
        _ => None,
    };
    Some(
        named
            .or_else(|| {
                handler
                    .extracted()
                    .find_map(|(_, param)| state_type(&param.ty))
                    .cloned()
            })
            .unwrap_or_else(|| syn::parse_quote!(())),
    )
}

/// `state = T`, the arguments of `#[axum::debug_handler(state = T)]`.
fn named_state(input: syn::parse::ParseStream<'_>) -> syn::Result<Type> {
    let key: Ident = input.parse()?;
    if key != "state" {
        return Err(syn::Error::new(key.span(), "expected `state`"));
    }
    input.parse::<syn::Token![=]>()?;
    input.parse()
}

/// `T` of a `State<T>` parameter.
fn state_type(ty: &Type) -> Option<&Type> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last()?;
    if last.ident != "State" {
        return None;
    }
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    match args.args.first()? {
        syn::GenericArgument::Type(ty) => Some(ty),
        _ => None,
    }
}

fn wrapper(func: &ItemFn, args: &Args, handler: &Handler<'_>) -> TokenStream {
    let name = &func.sig.ident;
    let vis = &func.vis;
    let state = router_state(func, handler);
    let wrapper_attrs = wrapper_attrs(func, args, state.as_ref());
    let inner_attrs = func
        .attrs
        .iter()
        .filter(|a| !a.path().is_ident("doc") && !is_handler_attr(a));
    let mut inner_sig = func.sig.clone();
    elide_tx_lifetimes(&mut inner_sig);
    let block = &func.block;
    let (_, scope) = &args.scope;
    let required = args.required();
    let ttl = ttl(args);

    let extracted: Vec<(Ident, &Type)> = handler
        .extracted()
        .map(|(i, param)| (format_ident!("__idem_arg{}", i), &*param.ty))
        .collect();
    let whole_last = whole_last(args, &extracted);
    let last_via = whole_last.filter(|_| state.is_none());
    let (unwrap, not_bodies, call_args) = arguments(handler, &extracted, last_via);

    let signed = signed(&extracted);
    let key_source = args.key.as_ref().map(|(_, source)| source);
    let (key_param, key) = key(key_source, &extracted, &signed);
    // Where a key without a principal is kept; nothing at all without the option, so
    // that such endpoints expand as before.
    let spread = spread(args, &extracted);
    // A signed body's key must be signed too: not a header the scheme does not sign.
    let header_key = header_key(key_source, &extracted);
    let without_tx = without_tx(func, handler);
    let utoipa_order = utoipa_order(func);
    let (conflict_wait, statement_timeout, isolation) = timing(args);

    // A principal type the handler also takes as a parameter is extracted once: its
    // value serves both (an extractor may be costly, or not idempotent itself).
    let (principal_param, principal) = principal(args, &extracted);

    // The wrapper takes two parameters: a tuple of idem's extractors and the handler's
    // own but the last (axum extracts a tuple's elements in order), then the last. So it
    // never has too many arguments, and needs no `#[allow(clippy::too_many_arguments)]`,
    // which the user's function inside it would inherit.
    let (last_param, before_last) = last_param(&extracted, last_via.is_some());
    let (generics, state_bound, state, body_check) = state_tokens(state.as_ref(), whole_last);
    // `completable = true`: the request's head, and a slot the body is read into, to
    // store with its first step (`idem::complete`); extracted before the body.
    let (completable_param, completable) = completable(args, key_source);
    let (parts, part_types) = parts(
        &state,
        before_last,
        [completable_param, key_param, principal_param],
    );

    // The body's binding, respanned onto its type so that a bound it fails is reported
    // once, there.
    let last = extracted
        .last()
        .map(|(arg, ty)| (Ident::new(&arg.to_string(), ty.span()), *ty));
    let add_fields = add_fields(args, last.as_ref());

    let (call, outcome) = call(func, &call_args);

    quote! {
        #(#wrapper_attrs)*
        #vis async fn #name #generics(
            (#(#parts,)*): (#(#part_types,)*),
            #last_param
        ) -> ::idem::__private::Response
        #state_bound
        {
            #(#inner_attrs)*
            #inner_sig #block

            #[allow(unused_imports)]
            use ::idem::__private::{
                BodyLevel as _, KnownBodyLevel as _, NotAResponseLevel as _, NotSerializeLevel as _,
                OtherHeadLevel as _, OtherLevel as _, PartsLevel as _, ReadsBodyLevel as _,
                ResponseLevel as _, ResultLevel as _, SerializeLevel as _, SignedLevel as _,
                UnserializableBodyLevel as _, UnsignedLevel as _,
            };
            static __IDEM_SPEC: ::idem::__private::Spec = ::idem::__private::Spec {
                scope: #scope,
                ttl: #ttl,
                required: #required,
                conflict_wait: #conflict_wait,
                isolation: ::idem::__private::Isolation::#isolation,
                statement_timeout: #statement_timeout,
            };
            #(#not_bodies)*
            #body_check
            #utoipa_order
            #header_key
            #without_tx
            #(#unwrap)*
            let __idem_principal = #principal;
            let __idem_key = #key;
            #spread
            let __idem_guard = __idem_guard.signed(#signed);
            #completable
            #[allow(unused_mut)]
            let mut __idem_fields = __idem_guard.fingerprint(&__IDEM_SPEC);
            #add_fields
            #[allow(unused_mut)]
            let mut __idem_claim = match __idem_guard.claim(&__IDEM_SPEC, __idem_principal, __idem_key, __idem_fields).await {
                ::core::result::Result::Ok(claim) => claim,
                ::core::result::Result::Err(answer) => return answer,
            };
            let __idem_span = __idem_claim.span();
            let __idem_out = #call;
            let __idem_outcome = #outcome;
            __idem_claim.finish(__idem_outcome).await
        }
    }
}

/// The handler's call, in its span, and its outcome read from what it returned (a
/// `Result` or a response), spanned on its return type.
fn call(func: &ItemFn, call_args: &[TokenStream]) -> (TokenStream, TokenStream) {
    let name = &func.sig.ident;
    let output_span = match &func.sig.output {
        syn::ReturnType::Type(_, ty) => ty.span(),
        syn::ReturnType::Default => name.span(),
    };
    let outcome = quote_spanned! {output_span=>
        {
            let __idem_tag = (&&::idem::__private::probe(&__idem_out)).__idem_output();
            ::idem::__private::outcome(__idem_out, __idem_tag)
        }
    };
    let call = quote_spanned! {name.span()=>
        ::idem::__private::in_span(
            ::idem::__private::assert_send(#name(#(#call_args),*)),
            __idem_span,
            ::core::stringify!(#name),
        )
        .await
    };
    (call, outcome)
}

/// The wrapper's first parameter, a tuple of idem's extractors (its guard, then those
/// the options add) and the handler's own but the last, as names and types.
fn parts(
    state: &TokenStream,
    before_last: &[(Ident, &Type)],
    added: [Option<(TokenStream, TokenStream)>; 3],
) -> (Vec<TokenStream>, Vec<TokenStream>) {
    let guard = (
        quote!(__idem_guard),
        quote!(::idem::__private::Guard<#state>),
    );
    let own = before_last.iter().map(|(arg, ty)| {
        (
            quote!(#arg),
            quote_spanned!(ty.span()=> ::idem::__private::Extract<#ty>),
        )
    });
    std::iter::once(Some(guard))
        .chain(added)
        .flatten()
        .chain(own)
        .unzip()
}

/// Without `fields`, the last parameter's whole value identifies the request: if it
/// reads the body under the router's state, idem must know how to fingerprint it
/// (`idem::__private::ExtractsLast`). The state is known where the handler is routed: the
/// generic wrapper takes the parameter as `LastExtract<T, __IdemVia>`, whose two impls
/// (head or body) let rustc infer `__IdemVia` with axum's own choice, and bounds
/// `__IdemState: ExtractsLast<T, __IdemVia>`; a wrapper written for one state checks it
/// inside.
fn whole_last<'e, 't>(
    args: &Args,
    extracted: &'e [(Ident, &'t Type)],
) -> Option<(&'e Ident, &'t Type)> {
    match (&args.fields, extracted.last()) {
        (None, Some((arg, ty))) => Some((arg, *ty)),
        _ => None,
    }
}

/// The endpoint's `ttl`, as a `Duration`, spanned on its literal.
pub(crate) fn ttl(args: &Args) -> TokenStream {
    let span = args
        .ttl
        .as_ref()
        .map_or_else(Span::call_site, |(_, ttl)| ttl.lit.span());
    let secs = u64_at(args.ttl_secs(), span);
    quote!(::core::time::Duration::from_secs(#secs))
}

/// The handler's arguments: each taken out of idem's extractor, the check that none but
/// the last reads the body (axum reads it after every other extractor), and the call's
/// argument list, `Tx` from the claim.
fn arguments(
    handler: &Handler<'_>,
    extracted: &[(Ident, &Type)],
    last_via: Option<(&Ident, &Type)>,
) -> (Vec<TokenStream>, Vec<TokenStream>, Vec<TokenStream>) {
    let unwrap = extracted
        .iter()
        .map(|(arg, _)| match last_via {
            Some((last, _)) if last == arg => {
                quote!(let ::idem::__private::LastExtract(#arg, _) = #arg;)
            }
            _ => quote!(let ::idem::__private::Extract(#arg) = #arg;),
        })
        .collect();
    // The body, if any, is last: axum reads it after every other extractor.
    let not_bodies = extracted
        .iter()
        .rev()
        .skip(1)
        .map(|(_, ty)| {
            quote_spanned! {ty.span()=>
                ::idem::__private::before_the_body(
                    (&&&::idem::__private::Probe::<#ty>::new()).__idem_head()
                );
            }
        })
        .collect();
    let call_args = (0..handler.params.len())
        .map(|i| {
            if handler.tx == Some(i) {
                quote!(__idem_claim.tx())
            } else {
                let arg = format_ident!("__idem_arg{}", i);
                quote!(#arg)
            }
        })
        .collect();
    (unwrap, not_bodies, call_args)
}

/// Whether the body is signed, from its type: a signed body vouches for the request, so
/// its identity is not taken from the store's principal resolver, and a key from a header
/// its signature covers is read as the sender's plain text.
fn signed(extracted: &[(Ident, &Type)]) -> TokenStream {
    match extracted.last() {
        Some((_, ty)) => quote_spanned! {ty.span()=>
            ::idem::__private::signed((&&::idem::__private::Probe::<#ty>::new()).__idem_signed())
        },
        None => quote!(false),
    }
}

/// A handler without `Tx` is warned about (a deprecated item's use, the one warning a
/// proc macro can raise on stable), on its name; the handler's own `allow`s, such as
/// `#[allow(deprecated)]`, go on the statement so that they silence it.
fn without_tx(func: &ItemFn, handler: &Handler<'_>) -> TokenStream {
    let name = &func.sig.ident;
    if handler.tx.is_none() {
        let allows = func.attrs.iter().filter(|a| a.path().is_ident("allow"));
        let call = quote_spanned!(name.span()=> ::idem::__private::handler_without_tx());
        quote! {
            #(#allows)*
            let () = #call;
        }
    } else {
        quote!()
    }
}

/// The wrapper's last parameter (the handler's last extractor, read with axum's own
/// choice of head or body where the state is generic), and the handler's others.
fn last_param<'e, 't>(
    extracted: &'e [(Ident, &'t Type)],
    via: bool,
) -> (Option<TokenStream>, &'e [(Ident, &'t Type)]) {
    match extracted.split_last() {
        Some(((arg, ty), before)) => (
            Some(if via {
                quote_spanned!(ty.span()=> #arg: ::idem::__private::LastExtract<#ty, __IdemVia>)
            } else {
                quote_spanned!(ty.span()=> #arg: ::idem::__private::Extract<#ty>)
            }),
            before,
        ),
        None => (None, &[][..]),
    }
}

/// The request's key: where it is read (`key = ..`), and the parameter that reads it, if
/// it takes one of its own (a header map).
fn key(
    key_source: Option<&KeySource>,
    extracted: &[(Ident, &Type)],
    signed: &TokenStream,
) -> (Option<(TokenStream, TokenStream)>, TokenStream) {
    match (key_source, &last_for_key(extracted)) {
        (Some(KeySource::Header(name)), _) => (
            Some((
                quote!(__idem_headers),
                quote!(::idem::__private::Extract<::idem::__private::HeaderMap>),
            )),
            quote!(::core::option::Option::Some(::idem::__private::key_from_header(&__idem_headers.0, #name, #signed))),
        ),
        (Some(KeySource::Field(path)), Some((arg, ty))) => {
            let members = &path.members;
            let span = joined_span(path);
            let body = quote_spanned!(ty.span()=> ::idem::__private::body_of(&#arg));
            let key =
                quote_spanned!(span=> ::idem::__private::key_of(&__idem_key_body #(.#members)*));
            (
                None,
                quote!({
                    let __idem_key_body = #body;
                    ::core::option::Option::Some(#key)
                }),
            )
        }
        (Some(KeySource::Digest(digest)), Some((arg, ty))) => {
            let body = quote_spanned!(ty.span()=> ::idem::__private::body_of(&#arg));
            let key = quote_spanned!(digest.span=> ::idem::__private::key_of_digest(#body));
            (None, quote!(::core::option::Option::Some(#key)))
        }
        _ => (None, quote!(::core::option::Option::None)),
    }
}

/// Where a key without a principal is kept (`spread = ..`); nothing at all without the
/// option, so that such endpoints expand as before.
fn spread(args: &Args, extracted: &[(Ident, &Type)]) -> TokenStream {
    match (&args.spread, last_for_key(extracted)) {
        (Some((_, attr::Spread::Key(key))), _) => quote_spanned! {key.span=>
            let __idem_guard = __idem_guard.spread(::idem::__private::Spread::Key);
        },
        (Some((_, attr::Spread::Tenant(path))), Some((arg, ty))) => {
            let body = quote_spanned!(ty.span()=> ::idem::__private::body_of(&#arg));
            let tenant = quote_spanned!(path.span()=> ::idem::__private::tenant_of(#path(#body)));
            quote!(let __idem_guard = __idem_guard.spread(#tenant);)
        }
        _ => quote!(),
    }
}

/// A signed body's key must be signed too: not a header the scheme does not sign.
fn header_key(key_source: Option<&KeySource>, extracted: &[(Ident, &Type)]) -> TokenStream {
    match (key_source, extracted.last()) {
        (Some(KeySource::Header(name)), Some((_, ty))) => quote_spanned! {name.span()=>
            ::idem::__private::header_key::<{ ::idem::__private::header_hash(#name) }, _>(
                (&&::idem::__private::Probe::<#ty>::new()).__idem_signed()
            );
        },
        // Without `key = ..`, the `Idempotency-Key` header, which no scheme signs.
        (None, Some((_, ty))) => quote_spanned! {ty.span()=>
            ::idem::__private::default_key(
                (&&::idem::__private::Probe::<#ty>::new()).__idem_signed()
            );
        },
        _ => quote!(),
    }
}

/// The endpoint's waits and isolation, as the `Spec` takes them: how long a duplicate
/// waits (`concurrency = wait`), the statement timeout, the isolation level's name.
pub(crate) fn timing(args: &Args) -> (TokenStream, TokenStream, TokenStream) {
    let conflict_wait = match args.wait() {
        Some(wait) => {
            let millis = u64_at(wait.millis, wait.lit.span());
            quote!(::core::option::Option::Some(::core::time::Duration::from_millis(#millis)))
        }
        None => quote!(::core::option::Option::None),
    };
    let statement_timeout = match &args.statement_timeout {
        Some((_, timeout)) => {
            let millis = u64_at(timeout.millis, timeout.lit.span());
            quote!(::core::option::Option::Some(::core::time::Duration::from_millis(#millis)))
        }
        None => quote!(::core::option::Option::None),
    };
    let isolation = match args.isolation.as_ref().map(|(_, level)| *level) {
        None | Some(attr::Isolation::ReadCommitted) => quote!(ReadCommitted),
        Some(attr::Isolation::RepeatableRead) => quote!(RepeatableRead),
        Some(attr::Isolation::Serializable) => quote!(Serializable),
    };
    (conflict_wait, statement_timeout, isolation)
}

/// The principal (`principal = ..`): a type the handler also takes as a parameter is
/// extracted once, its value serving both (an extractor may be costly, or not idempotent
/// itself); another one gets a parameter of its own.
fn principal(
    args: &Args,
    extracted: &[(Ident, &Type)],
) -> (Option<(TokenStream, TokenStream)>, TokenStream) {
    let same_type = |ty: &Type, path: &Type| {
        ty.to_token_stream().to_string() == path.to_token_stream().to_string()
    };
    match &args.principal {
        Some((_, path)) if extracted.iter().any(|(_, ty)| same_type(ty, path)) => {
            let arg = extracted
                .iter()
                .find(|(_, ty)| same_type(ty, path))
                .map(|(arg, _)| arg);
            (
                None,
                quote_spanned!(path.span()=> ::idem::__private::principal_of(&#arg)),
            )
        }
        Some((_, path)) => (
            Some((
                quote_spanned!(path.span()=> __idem_principal),
                quote_spanned!(path.span()=> ::idem::__private::Extract<#path>),
            )),
            quote_spanned!(path.span()=> ::idem::__private::principal_of(&__idem_principal.0)),
        ),
        None => (None, quote!(::core::option::Option::None)),
    }
}

/// The wrapper's generics, their bounds, its state type, and the check of the last
/// parameter's body for a wrapper written for one state.
fn state_tokens(
    state: Option<&Type>,
    whole_last: Option<(&Ident, &Type)>,
) -> (TokenStream, TokenStream, TokenStream, Option<TokenStream>) {
    match (state, whole_last) {
        (Some(state), last) => (
            quote!(),
            quote!(),
            quote!(#state),
            last.map(|(_, ty)| {
                quote_spanned! {ty.span()=>
                    ::idem::__private::extracts_last::<#ty, _, _>(&__idem_guard);
                }
            }),
        ),
        (None, Some((_, ty))) => {
            let bound = quote_spanned! {ty.span()=>
                __IdemState: ::idem::__private::ExtractsLast<#ty, __IdemVia>
            };
            (
                quote!(<__IdemState, __IdemVia>),
                quote!(where __IdemState: ::idem::__private::HoldsStore, #bound),
                quote!(__IdemState),
                None,
            )
        }
        (None, None) => (
            quote!(<__IdemState>),
            quote!(where __IdemState: ::idem::__private::HoldsStore),
            quote!(__IdemState),
            None,
        ),
    }
}

/// `completable = true`: the request's head, and a slot the body is read into, to store
/// with its first step (`idem::complete`); extracted before the body.
fn completable(
    args: &Args,
    key_source: Option<&KeySource>,
) -> (Option<(TokenStream, TokenStream)>, TokenStream) {
    if args.completable() {
        let key_header = match key_source {
            Some(KeySource::Header(name)) => quote!(::core::option::Option::Some(#name)),
            _ => quote!(::core::option::Option::None),
        };
        (
            Some((
                quote!(__idem_completable),
                quote!(::idem::__private::Completable),
            )),
            quote!(let __idem_guard = __idem_guard.completable(__idem_completable, #key_header);),
        )
    } else {
        (None, quote!())
    }
}

/// What the fingerprint reads of the body: the named fields (`fields = [..]`), or the
/// whole last parameter.
fn add_fields(args: &Args, last: Option<&(Ident, &Type)>) -> TokenStream {
    match (&args.fields, last) {
        (Some((_, fields)), Some((arg, ty))) => {
            let body = quote_spanned!(ty.span()=> ::idem::__private::body_of(&#arg));
            let adds = fields.iter().map(add_field);
            quote!({
                let __idem_body = #body;
                #(#adds)*
            })
        }
        (None, Some((arg, ty))) => quote_spanned! {ty.span()=>
            ::idem::__private::whole_body(
                &mut __idem_fields,
                &#arg,
                (&&&::idem::__private::Probe::<#ty>::new()).__idem_param(),
            );
        },
        _ => quote!(),
    }
}

/// Without a `#[utoipa::path]` below `#[idempotent]`, a check that none was written
/// above it either: that one has already expanded, without idem's key header and problem
/// responses, and left a `__path_<handler>` struct in the module. The inner block's glob
/// import of the module shadows the outer block's `__path_<handler>` with that struct,
/// if there is one, and `utoipa_path_below` holds for the outer block's alias only
/// (`idem::__private::NoUtoipaPathAbove` says more). Call-site spans: the names resolve
/// where the handler is written, and the error lands on `#[idempotent(...)]`.
fn utoipa_order(func: &ItemFn) -> TokenStream {
    if func.attrs.iter().any(openapi::is_utoipa_path) {
        return quote!();
    }
    let path = format_ident!("__path_{}", func.sig.ident, span = Span::call_site());
    quote! {
        {
            #[allow(non_camel_case_types, dead_code)]
            type #path = ::idem::__private::NoUtoipaPathAbove;
            {
                #[allow(unused_imports, clippy::wildcard_imports)]
                use self::*;
                ::idem::__private::utoipa_path_below::<#path>();
            }
        }
    }
}

/// `value` as a literal on the user's token (`ttl = "24h"`), which it was read from.
fn u64_at(value: u64, span: Span) -> Literal {
    let mut literal = Literal::u64_suffixed(value);
    literal.set_span(span);
    literal
}

/// The body's binding, respanned onto its type, for `key = field`.
fn last_for_key(extracted: &[(Ident, &Type)]) -> Option<(Ident, Type)> {
    extracted
        .last()
        .map(|(arg, ty)| (Ident::new(&arg.to_string(), ty.span()), (*ty).clone()))
}

/// The span of a field path as written: `customer.id`.
pub(crate) fn joined_span(path: &FieldPath) -> Span {
    path.members
        .iter()
        .map(Ident::span)
        .reduce(|a, b| a.join(b).unwrap_or(a))
        .unwrap_or_else(Span::call_site)
}

/// `__idem_fields.field("customer.id", &__idem_body.customer.id)`, spanned on the
/// user's field tokens: a typo is rustc's own error there, with its suggestions, and a
/// field that is not `Serialize` is reported there too.
fn add_field(path: &FieldPath) -> TokenStream {
    let name = path.name();
    let members = &path.members;
    let span = joined_span(path);
    quote_spanned! {span=>
        __idem_fields.field(
            #name,
            &__idem_body #(.#members)*,
            (&::idem::__private::probe(&__idem_body #(.#members)*)).__idem_serialize(),
        );
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use proptest::prelude::*;

    use super::*;

    /// Fragments that make up attribute arguments and handlers, good and bad.
    fn fragment() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            "scope",
            "ttl",
            "fields",
            "key",
            "principal",
            "required",
            "concurrency",
            "=",
            ",",
            "\"charges\"",
            "\"24h\"",
            "\"0s\"",
            "\"\"",
            "[",
            "]",
            "(",
            ")",
            "amount",
            ".",
            "id",
            "header",
            "wait",
            "\"30s\"",
            "reject",
            "true",
            "false",
            "Tenant",
            "<",
            ">",
            "::",
            "1",
            "-",
            "async",
            "fn",
            "f",
            "tx",
            ":",
            "Tx",
            "Json",
            "{",
            "}",
            "self",
            "&",
            "'_",
            "#",
            "!",
            "?",
            ";",
            "mut",
            "impl",
            "where",
        ])
    }

    /// The endpoint's durations reach the runtime as `Duration`s.
    #[test]
    fn spec_carries_durations() {
        let handler = quote!(
            async fn f(Json(b): Json<B>) -> String {
                String::new()
            }
        );
        let spec = |args| {
            let expanded = idempotent(args, handler.clone()).to_string();
            let start = expanded.find("Spec {").expect("a Spec");
            expanded[start..start + expanded[start..].find('}').unwrap()].to_string()
        };
        let custom = spec(quote!(scope = "s", ttl = "7d", concurrency = wait("250ms")));
        assert!(
            custom.contains("ttl : :: core :: time :: Duration :: from_secs (604800u64)"),
            "{custom}"
        );
        assert!(
            custom.contains(
                "conflict_wait : :: core :: option :: Option :: Some (:: core :: time :: Duration :: from_millis (250u64))"
            ),
            "{custom}"
        );
        let default = spec(quote!(scope = "s"));
        assert!(default.contains("from_secs (86400u64)"), "{default}");
        assert!(
            default.contains("conflict_wait : :: core :: option :: Option :: None"),
            "{default}"
        );
    }

    /// Lints are allowed on generated statements only (STYLE.md habit 8): neither the
    /// wrapper, whose body holds the user's function, nor that function carries an
    /// `allow` of the macro's, whatever the number of parameters.
    #[test]
    fn no_lint_is_allowed_on_the_users_function() {
        let expanded = idempotent(
            quote!(scope = "s", key = header("Id"), principal = P),
            quote!(
                /// Docs.
                #[deny(clippy::pedantic)]
                async fn f(a: A, b: B, c: C, d: D, e: E, g: G, tx: Tx, Json(h): Json<H>) {}
            ),
        );
        let wrapper: ItemFn = syn::parse2(expanded).expect("a function");
        assert!(!wrapper.attrs.iter().any(|a| a.path().is_ident("allow")));
        assert_eq!(wrapper.sig.inputs.len(), 2, "the parts and the body");
        let inner = wrapper.block.stmts.iter().find_map(|stmt| match stmt {
            syn::Stmt::Item(syn::Item::Fn(inner)) => Some(inner),
            _ => None,
        });
        let attrs = &inner.expect("the user's function").attrs;
        assert_eq!(attrs.len(), 1, "only the user's own");
        assert!(attrs[0].path().is_ident("deny"));
    }

    /// The wrapper is generic over the router's state, so that a state without idem's
    /// store is reported with `HoldsStore`'s message on the route; under
    /// `#[axum::debug_handler]`, which checks no generic function, it is written for the
    /// state the check names, the `T` of `State<T>`, or axum's default `()`.
    #[test]
    fn wrapper_names_the_state_only_under_debug_handler() {
        let with_state = quote!(
            async fn f(State(s): State<App>, tx: Tx, Json(b): Json<B>) {}
        );
        let without = quote!(
            async fn f(tx: Tx, Json(b): Json<B>) {}
        );
        let wrapper = |attr: TokenStream, func: &TokenStream| -> ItemFn {
            syn::parse2(idempotent(quote!(scope = "s"), quote!(#attr #func))).expect("a function")
        };

        let generic = wrapper(quote!(), &with_state);
        // The state, and how the body is extracted under it (`ExtractsLast`).
        assert_eq!(generic.sig.generics.params.len(), 2);
        let bound = generic
            .sig
            .generics
            .where_clause
            .to_token_stream()
            .to_string();
        assert!(bound.contains("HoldsStore"), "{bound}");
        assert!(
            bound.contains(
                "__IdemState : :: idem :: __private :: ExtractsLast < Json < B > , __IdemVia >"
            ),
            "{bound}"
        );

        for (attr, func, state) in [
            (quote!(#[axum::debug_handler]), &with_state, "App"),
            (
                quote!(#[axum::debug_handler(state = Outer)]),
                &with_state,
                "Outer",
            ),
            (quote!(#[axum::debug_handler]), &without, "()"),
        ] {
            let named = wrapper(attr, func);
            assert!(named.sig.generics.params.is_empty());
            assert!(named.sig.generics.where_clause.is_none());
            let inputs = named.sig.inputs.to_token_stream().to_string();
            assert!(inputs.contains(&format!("Guard < {state} >")), "{inputs}");
            let body = named.block.to_token_stream().to_string();
            assert!(
                body.contains("extracts_last :: < Json < B > , _ , _ > (& __idem_guard)"),
                "{body}"
            );
        }
    }

    /// With `fields = [...]` the body must be a `FingerprintBody` anyway (its fields are
    /// read through it): the wrapper needs no `ExtractsLast` bound, nor its parameter.
    #[test]
    fn named_fields_need_no_last_param_bound() {
        let expanded = idempotent(
            quote!(scope = "s", fields = [amount]),
            quote!(
                async fn f(tx: Tx, Json(b): Json<B>) {}
            ),
        );
        let wrapper: ItemFn = syn::parse2(expanded).expect("a function");
        assert_eq!(wrapper.sig.generics.params.len(), 1);
        let bound = wrapper
            .sig
            .generics
            .where_clause
            .to_token_stream()
            .to_string();
        assert!(!bound.contains("ExtractsLast"), "{bound}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000),
        ))]

        /// Whatever a user writes, the macro answers with tokens (code or a compile
        /// error), never a panic, which rustc would show as an internal macro failure.
        #[test]
        fn never_panics(args in prop::collection::vec(fragment(), 0..14), body in prop::collection::vec(fragment(), 0..20)) {
            let Ok(args) = TokenStream::from_str(&args.join(" ")) else { return Ok(()) };
            let Ok(item) = TokenStream::from_str(&body.join(" ")) else { return Ok(()) };
            let _ = idempotent(args.clone(), item);
            let handler = TokenStream::from_str("async fn f(tx: Tx, Json(b): Json<B>) -> String { String::new() }").unwrap();
            let expanded = idempotent(args, handler);
            prop_assert!(!expanded.is_empty());
        }
    }
}

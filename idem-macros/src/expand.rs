//! The generated wrapper: an axum handler that extracts the key, fingerprints the
//! request and hands the user's function to the runtime as an inner `async fn` under
//! the handler's own name (so `return` and `?` behave, and errors name the handler).

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Attribute, ItemFn};

use crate::attr::{self, Args, Errors};
use crate::valid::{self, Handler};

pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
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
    let mut errors = Errors::default();
    let args = attr::parse(args, &mut errors);
    let handler = valid::handler(&func, &mut errors);
    if let Some(fields) = args.as_ref().and_then(|a| a.fields.as_ref()) {
        let has_body = handler.params.len() > usize::from(handler.tx.is_some());
        if !has_body {
            errors.at(
                fields.keyword.span(),
                "`fields` needs a body to read them from: add a `Json<T>` parameter as the handler's last parameter",
            );
        }
    }
    let tokens = match (errors.finish(), args) {
        (Ok(()), Some(args)) => wrapper(&func, &args, &handler),
        (Err(e), _) => fallback(item, e),
        (Ok(()), None) => fallback(
            item,
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

fn is_outer_attr(attr: &Attribute) -> bool {
    attr.path().is_ident("doc") || attr.path().is_ident("cfg")
}

/// The user's signature for the inner function, with `Tx` given its elided lifetime:
/// `tx: Tx` reads best, but an `async fn` may not hide a lifetime (E0726).
fn inner_signature(func: &ItemFn, handler: &Handler<'_>) -> syn::Signature {
    let mut sig = func.sig.clone();
    // Receivers are refused before expansion, so parameter and input indices agree.
    let Some(tx) = handler.tx else { return sig };
    let Some(syn::FnArg::Typed(param)) = sig.inputs.iter_mut().nth(tx) else {
        return sig;
    };
    if let syn::Type::Path(path) = &mut *param.ty {
        if let Some(last) = path.path.segments.last_mut() {
            if last.arguments.is_none() {
                let span = last.ident.span();
                last.arguments =
                    syn::PathArguments::AngleBracketed(syn::parse_quote_spanned!(span=> <'_>));
            }
        }
    }
    sig
}

fn wrapper(func: &ItemFn, args: &Args, handler: &Handler<'_>) -> TokenStream {
    let name = &func.sig.ident;
    let vis = &func.vis;
    // Docs and `cfg` describe the handler; every other attribute (lints, tracing ...)
    // belongs to the body, which is the inner function.
    let outer_attrs = func.attrs.iter().filter(|a| is_outer_attr(a));
    let cfg_attrs = func.attrs.iter().filter(|a| a.path().is_ident("cfg"));
    let inner_attrs = func.attrs.iter().filter(|a| !a.path().is_ident("doc"));
    let sig = inner_signature(func, handler);
    let block = &func.block;

    let scope = &args.scope;
    let ttl_secs = args.ttl_secs;

    let mut wrapper_params = Vec::new();
    let mut unwrap_params = Vec::new();
    let mut call_args = Vec::new();
    let mut last_arg = None;
    for (i, param) in handler.params.iter().enumerate() {
        if handler.tx == Some(i) {
            call_args.push(quote!(__idem_claim.tx()));
            continue;
        }
        let arg = format_ident!("__idem_arg{}", i);
        let ty = &param.ty;
        wrapper_params
            .push(quote_spanned!(ty.span()=> #arg: ::idem_runtime::__private::Extract<#ty>));
        unwrap_params.push(quote!(let ::idem_runtime::__private::Extract(#arg) = #arg;));
        call_args.push(quote!(#arg));
        last_arg = Some((arg, ty));
    }

    let (principal_param, principal) = match &args.principal {
        Some(path) => (
            quote_spanned!(path.span()=> __idem_principal: ::idem_runtime::__private::Extract<#path>,),
            quote_spanned!(path.span()=> ::idem_runtime::__private::principal_of(&__idem_principal.0)),
        ),
        None => (quote!(), quote!(::core::option::Option::None)),
    };

    let add_fields = match (&args.fields, &last_arg) {
        (Some(fields), Some((arg, ty))) => {
            let body = quote_spanned!(ty.span()=> ::idem_runtime::FingerprintBody::fingerprint_value(&#arg));
            let adds = fields.paths.iter().map(|path| {
                let name = path.name();
                let members = &path.members;
                let span = members
                    .iter()
                    .map(|m| m.span())
                    .reduce(|a, b| a.join(b).unwrap_or(a))
                    .unwrap_or_else(Span::call_site);
                // Each access carries the user's span: a typo is rustc's own error on the
                // user's token, and a field that is not `Serialize` is reported there too.
                quote_spanned!(span=> __idem_fields.field(#name, &__idem_body #(.#members)*);)
            });
            quote!({
                let __idem_body = #body;
                #(#adds)*
            })
        }
        (None, Some((arg, _))) => quote! {
            {
                #[allow(unused_imports)]
                use ::idem_runtime::__private::{ViaBody as _, ViaNoBody as _};
                (&#arg).__idem_body().add(&mut __idem_fields, &#arg);
            }
        },
        _ => quote!(),
    };

    quote! {
        #(#outer_attrs)*
        #[allow(clippy::too_many_arguments)]
        #vis async fn #name(
            __idem_guard: ::idem_runtime::__private::Guard,
            #principal_param
            #(#wrapper_params),*
        ) -> ::idem_runtime::__private::Response {
            #(#cfg_attrs)*
            #(#inner_attrs)*
            #sig #block

            static __IDEM_SPEC: ::idem_runtime::__private::Spec = ::idem_runtime::__private::Spec {
                scope: #scope,
                ttl_secs: #ttl_secs,
            };
            #(#unwrap_params)*
            let __idem_principal = #principal;
            #[allow(unused_mut)]
            let mut __idem_fields = __idem_guard.fingerprint(&__IDEM_SPEC);
            #add_fields
            #[allow(unused_mut)]
            let mut __idem_claim = match __idem_guard.claim(&__IDEM_SPEC, __idem_principal, __idem_fields).await {
                ::core::result::Result::Ok(claim) => claim,
                ::core::result::Result::Err(answer) => return answer,
            };
            let __idem_out = ::idem_runtime::__private::assert_send(#name(#(#call_args),*)).await;
            #[allow(unused_imports)]
            use ::idem_runtime::__private::{ResponseKind as _, ResultKind as _};
            let __idem_outcome = (&__idem_out).__idem_kind().outcome(__idem_out);
            __idem_claim.finish(__idem_outcome).await
        }
    }
}

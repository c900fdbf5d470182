//! What `#[idempotent]` adds to a `#[utoipa::path(...)]` below it: the key's parameter,
//! idem's problem responses and the `Idempotent-Replayed` header on success responses.
//! The path's own tokens are kept as written; only entries it lacks are added.

use proc_macro2::{Delimiter, Group, Literal, TokenStream, TokenTree};
use quote::quote;
use syn::{Attribute, Meta};

use crate::attr::{Args, KeySource};

/// `#[utoipa::path(...)]`, written with or without a leading `::`.
pub(crate) fn is_utoipa_path(attr: &Attribute) -> bool {
    path_is(attr, &[&["utoipa", "path"]])
}

/// `#[axum::debug_handler]`, `#[axum_macros::debug_handler]` or `#[debug_handler]`.
pub(crate) fn is_debug_handler(attr: &Attribute) -> bool {
    path_is(
        attr,
        &[
            &["debug_handler"],
            &["axum", "debug_handler"],
            &["axum_macros", "debug_handler"],
        ],
    )
}

/// Whether the attribute's path is one of `spellings`, segment by segment (a leading
/// `::` aside).
fn path_is(attr: &Attribute, spellings: &[&[&str]]) -> bool {
    let segments = &attr.path().segments;
    spellings.iter().any(|spelling| {
        segments.len() == spelling.len()
            && segments
                .iter()
                .zip(*spelling)
                .all(|(s, name)| s.ident == name)
    })
}

/// The problem responses idem answers on an idempotent endpoint, as `(status,
/// description, retry_after)`.
const PROBLEMS: &[(u16, &str, bool)] = &[
    (400, "The idempotency key is missing or malformed, or the request was refused (problem+json).", false),
    (409, "A request with this idempotency key is still running: retry after `Retry-After` (problem+json).", true),
    (413, "The request body is too large (problem+json).", false),
    (415, "The request body is not of the expected media type (problem+json).", false),
    (422, "The idempotency key was used for another payload or target, or the body does not deserialize (problem+json).", false),
    (503, "The database is unavailable or the transaction could not be serialized; nothing ran or committed: retry after `Retry-After` (problem+json).", true),
];

/// The path's attribute with idem's additions.
pub(crate) fn document(attr: &Attribute, args: &Args) -> syn::Result<Attribute> {
    let Meta::List(list) = &attr.meta else {
        return Err(syn::Error::new_spanned(
            attr,
            "`#[utoipa::path(...)]` takes arguments: `#[utoipa::path(post, path = \"/charges\", ...)]`",
        ));
    };
    let mut entries = split_top_level(list.tokens.clone());
    let mut have_params = false;
    let mut have_responses = false;
    for entry in &mut entries {
        match named_group(entry) {
            Some((name, group)) if name == "params" => {
                have_params = true;
                if let Some(param) = key_param(args) {
                    *entry = with_group(entry, append(&group, param));
                }
            }
            Some((name, group)) if name == "responses" => {
                have_responses = true;
                *entry = with_group(entry, responses(&group));
            }
            _ => {}
        }
    }
    if !have_params {
        if let Some(param) = key_param(args) {
            entries.push(quote!(params(#param)));
        }
    }
    if !have_responses {
        let group = Group::new(Delimiter::Parenthesis, TokenStream::new());
        let group = responses(&group);
        entries.push(quote!(responses #group));
    }
    let path = attr.path();
    let pound = attr.pound_token;
    Ok(syn::parse_quote_spanned! {pound.span=> #[#path(#(#entries),*)] })
}

/// The key's header parameter, if the key comes from a header.
fn key_param(args: &Args) -> Option<TokenStream> {
    let name = match args.key.as_ref().map(|(_, source)| source) {
        Some(KeySource::Field(_) | KeySource::Digest(_)) => return None,
        Some(KeySource::Header(name)) => name.value(),
        None => "Idempotency-Key".to_owned(),
    };
    let name = Literal::string(&name);
    let (ty, description) = if args.required() {
        (
            quote!(::std::string::String),
            "The idempotency key: a retry with the same key and payload gets the first response replayed.",
        )
    } else {
        (
            quote!(::core::option::Option<::std::string::String>),
            "The idempotency key, optional here: a request without one runs unrecorded (`Idempotent-Recorded: false`); a retry with the same key and payload gets the first response replayed.",
        )
    };
    // The bare spelling: 1 to 255 visible ASCII characters (an RFC 8941 quoted string is
    // accepted too, and is not described).
    Some(quote!((#name = #ty, Header, description = #description, pattern = "^[!-~]{1,255}$")))
}

/// The responses the path lists, each success one with `Idempotent-Replayed`, then
/// idem's problems the path does not list.
fn responses(group: &Group) -> Group {
    let mut entries = split_top_level(group.stream());
    let mut listed = Vec::new();
    for entry in &mut entries {
        let tokens: Vec<TokenTree> = entry.clone().into_iter().collect();
        let [TokenTree::Group(tuple)] = &tokens[..] else {
            continue;
        };
        if tuple.delimiter() != Delimiter::Parenthesis {
            continue;
        }
        let status = status_of(tuple.stream());
        if let Some(status) = status {
            listed.push(status);
        }
        if status.is_some_and(|s| s < 400) {
            let mut fields = split_top_level(tuple.stream());
            let replayed = quote!((
                "Idempotent-Replayed" = ::std::string::String,
                description =
                    "`true` when this is the replay of the first response to this idempotency key."
            ));
            let mut has_headers = false;
            for field in &mut fields {
                if let Some((name, headers)) = named_group(field) {
                    if name == "headers" {
                        has_headers = true;
                        *field = with_group(field, append(&headers, replayed.clone()));
                    }
                }
            }
            if !has_headers {
                fields.push(quote!(headers(#replayed)));
            }
            let mut tuple = Group::new(Delimiter::Parenthesis, quote!(#(#fields),*));
            tuple.set_span(tokens[0].span());
            *entry = quote!(#tuple);
        }
    }
    for &(status, description, retry_after) in PROBLEMS {
        if listed.contains(&status) {
            continue;
        }
        let status = Literal::u16_unsuffixed(status);
        let headers = if retry_after {
            quote!(, headers(("Retry-After" = ::std::string::String, description = "How many seconds to wait before retrying.")))
        } else {
            quote!()
        };
        entries.push(quote!((
            status = #status,
            description = #description,
            body = ::idem::Problem,
            content_type = "application/problem+json"
            #headers
        )));
    }
    let mut out = Group::new(Delimiter::Parenthesis, quote!(#(#entries),*));
    out.set_span(group.span());
    out
}

/// `status = 201` (or `status = "201"`) in a response tuple.
fn status_of(tuple: TokenStream) -> Option<u16> {
    let tokens: Vec<TokenTree> = tuple.into_iter().collect();
    tokens.windows(3).find_map(|w| match w {
        [TokenTree::Ident(name), TokenTree::Punct(eq), TokenTree::Literal(lit)]
            if name == "status" && eq.as_char() == '=' =>
        {
            lit.to_string().trim_matches('"').parse().ok()
        }
        _ => None,
    })
}

/// `name(...)` as an entry: its name and its group.
fn named_group(entry: &TokenStream) -> Option<(String, Group)> {
    let tokens: Vec<TokenTree> = entry.clone().into_iter().collect();
    match &tokens[..] {
        [TokenTree::Ident(name), TokenTree::Group(group)]
            if group.delimiter() == Delimiter::Parenthesis =>
        {
            Some((name.to_string(), group.clone()))
        }
        _ => None,
    }
}

/// `name(...)` with its group replaced.
fn with_group(entry: &TokenStream, group: Group) -> TokenStream {
    let name = entry.clone().into_iter().next();
    quote!(#name #group)
}

/// A group with one more comma-separated element.
fn append(group: &Group, element: TokenStream) -> Group {
    let mut elements = split_top_level(group.stream());
    elements.push(element);
    let mut out = Group::new(group.delimiter(), quote!(#(#elements),*));
    out.set_span(group.span());
    out
}

/// Splits arguments on their top-level commas; a comma between `<` and `>`
/// (`request_body = HashMap<String, i64>`) is no separator.
fn split_top_level(tokens: TokenStream) -> Vec<TokenStream> {
    let mut entries = Vec::new();
    let mut current = TokenStream::new();
    let mut angles = 0_usize;
    for token in tokens {
        if let TokenTree::Punct(punct) = &token {
            match punct.as_char() {
                '<' => angles += 1,
                '>' => angles = angles.saturating_sub(1),
                ',' if angles == 0 => {
                    entries.push(std::mem::take(&mut current));
                    continue;
                }
                _ => {}
            }
        }
        current.extend([token]);
    }
    if !current.is_empty() {
        entries.push(current);
    }
    entries
}

//! The attribute's arguments, parsed into typed values that keep their spans.

use proc_macro2::Span;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Expr, Ident, LitStr, Member, Token};

use crate::errors::Errors;

const OPTIONS: &str = "`scope`, `ttl`, `fields`, `key`, `principal`, `required` or `concurrency`";

/// The parsed `#[idempotent(...)]` arguments.
pub struct Args {
    pub scope: LitStr,
    pub ttl: Option<Ttl>,
    pub fields: Option<Fields>,
    pub principal: Option<syn::Type>,
    /// `required = false`: a request without a key runs unrecorded instead of 400.
    pub required: Option<syn::LitBool>,
    /// `key = ...`: where the key comes from, instead of the `Idempotency-Key` header.
    pub key: Option<KeySource>,
    /// `concurrency = wait("30s")`: the wait for a request in flight, in milliseconds.
    pub wait_ms: Option<u64>,
}

/// `key = event_id` (a body field) or `key = header("Webhook-Id")`.
pub enum KeySource {
    Field(FieldPath),
    Header(LitStr),
}

/// `ttl = "24h"`: the literal as written and what it means.
pub struct Ttl {
    pub lit: LitStr,
    pub secs: u64,
}

impl Args {
    /// Whether a key is required; it is unless `required = false`.
    pub fn required(&self) -> bool {
        self.required.as_ref().is_none_or(|flag| flag.value)
    }

    /// The ttl in seconds; one day when not given.
    pub fn ttl_secs(&self) -> u64 {
        self.ttl.as_ref().map_or(24 * 60 * 60, |ttl| ttl.secs)
    }
}

/// `fields = [a, b.c]`: where the option was written, and the field paths.
pub struct Fields {
    pub keyword: Ident,
    pub paths: Vec<FieldPath>,
}

/// A field of the body, possibly nested: `amount`, `customer.id`.
pub struct FieldPath {
    pub members: Vec<Ident>,
}

impl FieldPath {
    /// The name hashed with the value: `customer.id`.
    pub fn name(&self) -> String {
        self.members
            .iter()
            .map(Ident::to_string)
            .collect::<Vec<_>>()
            .join(".")
    }
}

/// One `name = value` pair, before its value is checked.
struct Arg {
    name: Ident,
    value: Value,
}

/// `principal` names a type; every other option takes an expression-like value.
enum Value {
    Expr(Expr),
    Type(syn::Type),
}

impl Value {
    fn span(&self) -> Span {
        match self {
            Self::Expr(e) => e.span(),
            Self::Type(t) => t.span(),
        }
    }
}

impl Parse for Arg {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let name: Ident = input.call(syn::ext::IdentExt::parse_any)?;
        if !input.peek(Token![=]) {
            return Err(syn::Error::new(
                name.span(),
                format!("expected `{name} = ...`; options are written `name = value`"),
            ));
        }
        input.parse::<Token![=]>()?;
        let value = if name == "principal" && !input.peek(syn::Lit) {
            Value::Type(input.parse()?)
        } else {
            Value::Expr(input.parse()?)
        };
        Ok(Self { name, value })
    }
}

/// Stores an option's value unless it was already given: the one place that says
/// "specified more than once".
fn set_once<T>(slot: &mut Option<T>, value: T, name: &Ident, errors: &Errors) {
    if slot.is_some() {
        errors.at(name.span(), format!("`{name}` is specified more than once"));
    } else {
        *slot = Some(value);
    }
}

/// Parses the arguments; `None` when they cannot make a wrapper (the errors say why).
pub fn parse(args: proc_macro2::TokenStream, errors: &Errors) -> Option<Args> {
    let parsed =
        match syn::parse::Parser::parse2(Punctuated::<Arg, Token![,]>::parse_terminated, args) {
            Ok(parsed) => parsed,
            Err(e) => {
                errors.push(e);
                return None;
            }
        };
    let mut scope = None;
    let mut ttl = None;
    let mut fields = None;
    let mut principal = None;
    let mut required = None;
    let mut key = None;
    let mut wait_ms = None;
    let mut scope_given = false;
    for arg in parsed {
        match arg.name.to_string().as_str() {
            "scope" => {
                scope_given = true;
                if let Some(v) = expr(&arg.value, "scope", errors).and_then(|e| parse_scope(e, errors)) {
                    set_once(&mut scope, v, &arg.name, errors);
                }
            }
            "ttl" => {
                if let Some(v) = expr(&arg.value, "ttl", errors).and_then(|e| parse_ttl(e, errors)) {
                    set_once(&mut ttl, v, &arg.name, errors);
                }
            }
            "fields" => {
                if let Some(paths) = expr(&arg.value, "fields", errors).and_then(|e| parse_fields(e, errors)) {
                    let value = Fields {
                        keyword: arg.name.clone(),
                        paths,
                    };
                    set_once(&mut fields, value, &arg.name, errors);
                }
            }
            "principal" => match &arg.value {
                Value::Type(ty) => set_once(&mut principal, ty.clone(), &arg.name, errors),
                other => errors.at(
                    other.span(),
                    "`principal` takes an extractor type that implements `idem_runtime::Principal`, such as `principal = Tenant`",
                ),
            },
            "required" => match expr(&arg.value, "required", errors) {
                Some(Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Bool(flag),
                    ..
                })) => set_once(&mut required, flag.clone(), &arg.name, errors),
                Some(other) => errors.at(
                    other.span(),
                    "`required` takes `true` (the default: a request without a key is refused) or `false` \
                     (it runs without being recorded, for a gradual rollout)",
                ),
                None => {}
            },
            "key" => {
                if let Some(v) = expr(&arg.value, "key", errors).and_then(|e| parse_key(e, errors)) {
                    set_once(&mut key, v, &arg.name, errors);
                }
            }
            "concurrency" => {
                if let Some(v) = expr(&arg.value, "concurrency", errors).and_then(|e| parse_concurrency(e, errors)) {
                    set_once(&mut wait_ms, v, &arg.name, errors);
                }
            }
            unknown => errors.at(
                arg.name.span(),
                format!("unknown option `{unknown}`; valid options are {OPTIONS}"),
            ),
        }
    }
    let Some(scope) = scope else {
        if !scope_given {
            // No one token is wrong: the attribute as a whole lacks the option.
            errors.at(
                Span::call_site(),
                "missing `scope = \"...\"`: the name that keys of this endpoint live under, such as `scope = \"charges\"`",
            );
        }
        return None;
    };
    Some(Args {
        scope,
        ttl,
        fields,
        principal,
        required,
        key,
        wait_ms: wait_ms.flatten(),
    })
}

/// `key = id`, `key = meta.event_id` or `key = header("Webhook-Id")`.
fn parse_key(value: &Expr, errors: &Errors) -> Option<KeySource> {
    if let Expr::Call(call) = value {
        if matches!(&*call.func, Expr::Path(p) if p.path.is_ident("header")) {
            if let [Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(name),
                ..
            })] = &call.args.iter().collect::<Vec<_>>()[..]
            {
                let text = name.value();
                let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
                if !text.is_empty() && text.bytes().all(token) {
                    return Some(KeySource::Header(LitStr::new(
                        &text.to_ascii_lowercase(),
                        name.span(),
                    )));
                }
                errors.at(name.span(), "not a valid HTTP header name");
                return None;
            }
        }
    }
    if let Some(path) = field_path(value) {
        return Some(KeySource::Field(path));
    }
    errors.at(
        value.span(),
        "`key` takes a body field, such as `key = id` or `key = meta.event_id`, or a header, such as `key = header(\"Webhook-Id\")`",
    );
    None
}

/// `concurrency = reject` (the default: 409 at once) or `concurrency = wait("30s")`.
/// `Some(None)` is an explicit `reject`.
fn parse_concurrency(value: &Expr, errors: &Errors) -> Option<Option<u64>> {
    const FORMS: &str = "`concurrency` takes `reject` (a duplicate of a request in flight gets 409 at once) or \
                         `wait(\"30s\")` (it waits up to that long for the first to finish, then replays it)";
    match value {
        Expr::Path(p) if p.path.is_ident("reject") => Some(None),
        Expr::Call(call) if matches!(&*call.func, Expr::Path(p) if p.path.is_ident("wait")) => {
            let Some(Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(lit),
                ..
            })) = call.args.first()
            else {
                errors.at(call.span(), FORMS);
                return None;
            };
            let ms = match duration(&lit.value(), true) {
                Some(ms) if ms > 0 && ms <= 3_600_000 => ms,
                _ => {
                    errors.at(
                        lit.span(),
                        "`wait` must look like \"500ms\", \"30s\" or \"2m\": more than zero and at most an hour",
                    );
                    return None;
                }
            };
            Some(Some(ms))
        }
        _ => {
            errors.at(value.span(), FORMS);
            None
        }
    }
}

/// `"90s"` and the like, in milliseconds; `ms` only where `allow_ms`.
fn duration(text: &str, allow_ms: bool) -> Option<u64> {
    let digits = text.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let unit: u64 = match &text[digits.len()..] {
        "ms" if allow_ms => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    if digits.starts_with('+') {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(unit)
}

fn expr<'a>(value: &'a Value, option: &str, errors: &Errors) -> Option<&'a Expr> {
    match value {
        Value::Expr(e) => Some(e),
        Value::Type(t) => {
            errors.at(t.span(), format!("`{option}` does not take a type"));
            None
        }
    }
}

fn string_literal<'a>(value: &'a Expr, option: &str, errors: &Errors) -> Option<&'a LitStr> {
    if let Expr::Lit(syn::ExprLit {
        lit: syn::Lit::Str(s),
        ..
    }) = value
    {
        return Some(s);
    }
    errors.at(value.span(), format!("`{option}` takes a string literal"));
    None
}

fn parse_scope(value: &Expr, errors: &Errors) -> Option<LitStr> {
    let lit = string_literal(value, "scope = \"...\"", errors)?;
    let scope = lit.value();
    let valid = !scope.is_empty()
        && scope.len() <= 64
        && scope
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':' | b'/'));
    if !valid {
        errors.at(
            lit.span(),
            "`scope` must be 1 to 64 characters of ASCII letters, digits, `_`, `-`, `.`, `:` or `/`, such as \"charges\"",
        );
        return None;
    }
    Some(lit.clone())
}

const TTL_FORMS: &str = "`ttl` must look like \"90s\", \"30m\", \"24h\" or \"7d\": a positive whole number and one unit of s, m, h or d";

fn parse_ttl(value: &Expr, errors: &Errors) -> Option<Ttl> {
    let lit = string_literal(value, "ttl = \"...\"", errors)?;
    let Some(ms) = duration(&lit.value(), false) else {
        errors.at(lit.span(), TTL_FORMS);
        return None;
    };
    if ms == 0 {
        errors.at(
            lit.span(),
            "`ttl` must be longer than zero: a stored response must be kept for some time",
        );
        return None;
    }
    // A century is more than any key needs and keeps `now() + ttl` inside PostgreSQL's range.
    if ms > 100 * 365 * 86_400_000 {
        errors.at(lit.span(), "`ttl` is too long: the limit is 100 years");
        return None;
    }
    Some(Ttl {
        lit: lit.clone(),
        secs: ms / 1_000,
    })
}

fn parse_fields(value: &Expr, errors: &Errors) -> Option<Vec<FieldPath>> {
    let Expr::Array(array) = value else {
        errors.at(
            value.span(),
            "`fields` takes a list of body fields, such as `fields = [amount, currency]`",
        );
        return None;
    };
    if array.elems.is_empty() {
        errors.at(
            array.span(),
            "`fields` is empty; name at least one body field, or leave `fields` out to fingerprint the whole body",
        );
        return None;
    }
    let mut paths: Vec<FieldPath> = Vec::new();
    let mut ok = true;
    for elem in &array.elems {
        match field_path(elem) {
            Some(path) => {
                let name = path.name();
                if paths.iter().any(|p| p.name() == name) {
                    errors.at(
                        elem.span(),
                        format!("field `{name}` is listed more than once"),
                    );
                    ok = false;
                } else {
                    paths.push(path);
                }
            }
            None => {
                errors.at(
                    elem.span(),
                    "expected a field of the body, such as `amount` or `customer.id`",
                );
                ok = false;
            }
        }
    }
    ok.then_some(paths)
}

/// `amount` or `customer.id`: an identifier, or named field accesses on one.
fn field_path(expr: &Expr) -> Option<FieldPath> {
    match expr {
        Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() => {
            let ident = p.path.get_ident()?;
            Some(FieldPath {
                members: vec![ident.clone()],
            })
        }
        Expr::Field(f) if f.attrs.is_empty() => {
            let Member::Named(member) = &f.member else {
                return None;
            };
            let mut path = field_path(&f.base)?;
            path.members.push(member.clone());
            Some(path)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use quote::quote;

    use super::*;

    fn parse_ok(args: proc_macro2::TokenStream) -> Args {
        let errors = Errors::new();
        let parsed = parse(args, &errors);
        if let Err(e) = errors.check() {
            panic!("unexpected error: {e}");
        }
        parsed.expect("arguments")
    }

    fn messages(args: proc_macro2::TokenStream) -> Vec<String> {
        let errors = Errors::new();
        let _ = parse(args, &errors);
        errors
            .check()
            .err()
            .map_or_else(Vec::new, |e| e.into_iter().map(|e| e.to_string()).collect())
    }

    #[test]
    fn ttl_forms() {
        for (ttl, secs) in [
            ("90s", 90),
            ("30m", 1800),
            ("24h", 86_400),
            ("7d", 604_800),
            ("1d", 86_400),
        ] {
            assert_eq!(
                parse_ok(quote!(scope = "s", ttl = #ttl)).ttl_secs(),
                secs,
                "{ttl}"
            );
        }
        assert_eq!(
            parse_ok(quote!(scope = "s")).ttl_secs(),
            86_400,
            "one day by default"
        );
        for bad in [
            "",
            "h",
            "24",
            "24 h",
            "2w",
            "-1h",
            "+1h",
            "1.5h",
            "0s",
            "0d",
            "99999999999999999999d",
            "36600000d",
        ] {
            assert_eq!(
                messages(quote!(scope = "s", ttl = #bad)).len(),
                1,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn fields_and_principal() {
        let args = parse_ok(quote!(
            scope = "orders",
            fields = [amount, customer.id],
            principal = auth::Tenant
        ));
        let names: Vec<String> = args
            .fields
            .as_ref()
            .unwrap()
            .paths
            .iter()
            .map(FieldPath::name)
            .collect();
        assert_eq!(names, ["amount", "customer.id"]);
        assert!(args.principal.is_some());
        assert!(args.required());
        assert!(!parse_ok(quote!(scope = "s", required = false)).required());
        assert_eq!(messages(quote!(scope = "s", required = "no")).len(), 1);
    }

    #[test]
    fn keys_and_concurrency() {
        let args = parse_ok(quote!(
            scope = "s",
            key = meta.event_id,
            concurrency = wait("30s")
        ));
        assert!(matches!(&args.key, Some(KeySource::Field(p)) if p.name() == "meta.event_id"));
        assert_eq!(args.wait_ms, Some(30_000));
        let args = parse_ok(quote!(
            scope = "s",
            key = header("Webhook-Id"),
            concurrency = reject
        ));
        assert!(matches!(&args.key, Some(KeySource::Header(h)) if h.value() == "webhook-id"));
        assert_eq!(args.wait_ms, None);
        assert_eq!(
            parse_ok(quote!(scope = "s", concurrency = wait("250ms"))).wait_ms,
            Some(250)
        );
        for bad in [
            quote!(key = header("bad header")),
            quote!(key = "id"),
            quote!(concurrency = wait("0s")),
            quote!(concurrency = wait("2h")),
            quote!(concurrency = forever),
        ] {
            assert_eq!(messages(quote!(scope = "s", #bad)).len(), 1, "{bad}");
        }
    }

    #[test]
    fn every_mistake_is_reported_at_once() {
        let all = messages(quote!(
            scope = "",
            ttl = "1 day",
            colour = "blue",
            fields = [],
            fields = [a]
        ));
        assert_eq!(all.len(), 4, "{all:#?}");
        assert!(all[0].contains("`scope` must be"));
        assert!(all[1].contains("`ttl` must look like"));
        assert!(all[2].contains("unknown option `colour`"));
        assert!(all[3].contains("`fields` is empty"));
    }

    #[test]
    fn repeated_options_come_from_one_place() {
        for option in [
            quote!(scope = "a"),
            quote!(ttl = "1h"),
            quote!(fields = [a]),
            quote!(principal = P),
        ] {
            let all = messages(quote!(scope = "s", #option, #option));
            assert!(
                all.iter()
                    .any(|m| m.ends_with("is specified more than once")),
                "{all:?}"
            );
        }
    }
}

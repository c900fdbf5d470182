//! The attribute's arguments, parsed into typed values that keep their spans.
//!
//! Parsing runs in two steps. [`Arg`]'s `Parse` reads the options' syntax, `name =
//! value`, recognising each name as a keyword of [`kw`]; then [`parse`] checks each value
//! and reports every mistake it finds to [`Errors`], so one build shows them all.

use proc_macro2::Span;
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream, Parser};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Expr, Ident, LitBool, LitStr, Member, Token, Type};

use crate::errors::Errors;

/// The options, and the words their values are made of.
pub(crate) mod kw {
    syn::custom_keyword!(scope);
    syn::custom_keyword!(ttl);
    syn::custom_keyword!(fields);
    syn::custom_keyword!(key);
    syn::custom_keyword!(principal);
    syn::custom_keyword!(required);
    syn::custom_keyword!(concurrency);
    syn::custom_keyword!(isolation);
    syn::custom_keyword!(statement_timeout);
    syn::custom_keyword!(spread);
    syn::custom_keyword!(completable);

    // Words of values: `key = header("...")`, `concurrency = reject` or `wait("...")`.
    syn::custom_keyword!(header);
    syn::custom_keyword!(digest);
    syn::custom_keyword!(body);
    syn::custom_keyword!(reject);
    syn::custom_keyword!(wait);
    syn::custom_keyword!(read_committed);
    syn::custom_keyword!(repeatable_read);
    syn::custom_keyword!(serializable);
}

const OPTIONS: &str = "`scope`, `ttl`, `fields`, `key`, `principal`, `spread`, `required`, \
                       `concurrency`, `isolation`, `statement_timeout` or `completable`";

/// The options' names, for "did you mean" on a misspelt one.
const NAMES: [&str; 11] = [
    "scope",
    "ttl",
    "fields",
    "key",
    "principal",
    "spread",
    "required",
    "concurrency",
    "isolation",
    "statement_timeout",
    "completable",
];

/// The option `name` most likely misspells: within two edits (one for names of up to
/// three letters), the closest first.
fn nearest(name: &str) -> Option<&'static str> {
    let name = name.to_ascii_lowercase();
    NAMES
        .iter()
        .map(|option| (edits(&name, option), *option))
        .filter(|&(edits, option)| edits <= if option.len() <= 3 { 1 } else { 2 })
        .min_by_key(|&(edits, _)| edits)
        .map(|(_, option)| option)
}

/// Levenshtein distance, with a swap of two neighbours counted as one edit (`tll`).
fn edits(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut rows = vec![vec![0; b.len() + 1]; a.len() + 1];
    for (i, row) in rows.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in rows[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (rows[i - 1][j] + 1)
                .min(rows[i][j - 1] + 1)
                .min(rows[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(rows[i - 2][j - 2] + 1);
            }
            rows[i][j] = best;
        }
    }
    rows[a.len()][b.len()]
}

/// The parsed `#[idempotent(...)]` arguments; each option keeps its keyword's token.
pub(crate) struct Args {
    pub scope: (kw::scope, LitStr),
    pub ttl: Option<(kw::ttl, DurationLit)>,
    pub fields: Option<(kw::fields, Vec<FieldPath>)>,
    /// `key = ...`: where the key comes from, instead of the `Idempotency-Key` header.
    pub key: Option<(kw::key, KeySource)>,
    pub principal: Option<(kw::principal, Type)>,
    /// `spread = key` or `spread = tenant_fn`: where a key without a principal is kept.
    pub spread: Option<(kw::spread, Spread)>,
    /// `required = false`: a request without a key runs unrecorded instead of 400.
    pub required: Option<(kw::required, LitBool)>,
    /// `concurrency = ...`: what a duplicate of a request in flight gets.
    pub concurrency: Option<(kw::concurrency, Concurrency)>,
    /// `isolation = serializable`: the transaction's isolation level.
    pub isolation: Option<(kw::isolation, Isolation)>,
    /// `statement_timeout = "5s"`: the bound on each statement of the handler.
    pub statement_timeout: Option<(kw::statement_timeout, DurationLit)>,
    /// `completable = true`: the request is stored with its first step, so that the
    /// service can complete it if its client goes away (`idem::complete`).
    pub completable: Option<(kw::completable, LitBool)>,
}

/// `spread = key` (a hash of the key) or `spread = path::to_fn` (a function from the
/// body to the tenant it concerns, `Option<String>`).
pub(crate) enum Spread {
    Key(kw::key),
    Tenant(syn::Path),
}

/// `isolation = read_committed` (the default), `repeatable_read` or `serializable`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isolation {
    ReadCommitted,
    RepeatableRead,
    Serializable,
}

/// `key = event_id` (a body field), `key = header("Webhook-Id")` or `key =
/// digest(body)`.
pub(crate) enum KeySource {
    Field(FieldPath),
    /// The header's name, lowercased.
    Header(LitStr),
    /// The SHA-256 of the whole body; the token is `digest`.
    Digest(kw::digest),
}

/// `concurrency = reject` (409 at once, the default) or `concurrency = wait("30s")`.
pub(crate) enum Concurrency {
    Reject,
    Wait(DurationLit),
}

/// `"24h"`: the literal as written and what it means.
pub(crate) struct DurationLit {
    pub lit: LitStr,
    pub millis: u64,
}

impl Args {
    /// Whether a key is required; it is unless `required = false`.
    pub(crate) fn required(&self) -> bool {
        self.required.as_ref().is_none_or(|(_, flag)| flag.value)
    }

    /// Whether the endpoint's requests are stored to be completed (`completable = true`).
    pub(crate) fn completable(&self) -> bool {
        self.completable
            .as_ref()
            .is_some_and(|(_, flag)| flag.value)
    }

    /// The ttl in seconds; one day when not given.
    pub(crate) fn ttl_secs(&self) -> u64 {
        self.ttl
            .as_ref()
            .map_or(24 * 60 * 60, |(_, ttl)| ttl.millis / 1_000)
    }

    /// `concurrency = wait(..)`'s wait, if that is the policy.
    pub(crate) fn wait(&self) -> Option<&DurationLit> {
        match &self.concurrency {
            Some((_, Concurrency::Wait(wait))) => Some(wait),
            Some((_, Concurrency::Reject)) | None => None,
        }
    }
}

/// A field of the body, possibly nested: `amount`, `customer.id`.
pub(crate) struct FieldPath {
    pub members: Vec<Ident>,
}

impl FieldPath {
    /// The name hashed with the value: `customer.id`.
    pub(crate) fn name(&self) -> String {
        self.members
            .iter()
            .map(Ident::to_string)
            .collect::<Vec<_>>()
            .join(".")
    }
}

/// One option as written, before its value is checked.
enum Arg {
    Scope(kw::scope, Expr),
    Ttl(kw::ttl, Expr),
    Fields(kw::fields, Expr),
    Key(kw::key, Expr),
    /// A type; or a literal, read only to be reported.
    Principal(kw::principal, Result<Type, Expr>),
    Required(kw::required, Expr),
    Concurrency(kw::concurrency, Expr),
    Isolation(kw::isolation, Expr),
    StatementTimeout(kw::statement_timeout, Expr),
    Spread(kw::spread, Expr),
    Completable(kw::completable, Expr),
    /// Not an option; its value is read only to go on to the next.
    Unknown(Ident),
}

impl Parse for Arg {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        if input.peek(kw::scope) {
            option(input).map(|(k, v)| Self::Scope(k, v))
        } else if input.peek(kw::ttl) {
            option(input).map(|(k, v)| Self::Ttl(k, v))
        } else if input.peek(kw::fields) {
            option(input).map(|(k, v)| Self::Fields(k, v))
        } else if input.peek(kw::key) {
            option(input).map(|(k, v)| Self::Key(k, v))
        } else if input.peek(kw::principal) {
            let keyword = input.parse()?;
            equals(input, &keyword)?;
            let value = if input.peek(syn::Lit) {
                Err(input.parse()?)
            } else {
                Ok(input.parse()?)
            };
            Ok(Self::Principal(keyword, value))
        } else if input.peek(kw::required) {
            option(input).map(|(k, v)| Self::Required(k, v))
        } else if input.peek(kw::concurrency) {
            option(input).map(|(k, v)| Self::Concurrency(k, v))
        } else if input.peek(kw::isolation) {
            option(input).map(|(k, v)| Self::Isolation(k, v))
        } else if input.peek(kw::statement_timeout) {
            option(input).map(|(k, v)| Self::StatementTimeout(k, v))
        } else if input.peek(kw::spread) {
            option(input).map(|(k, v)| Self::Spread(k, v))
        } else if input.peek(kw::completable) {
            option(input).map(|(k, v)| Self::Completable(k, v))
        } else {
            let name = input.call(Ident::parse_any)?;
            equals(input, &name)?;
            input.parse::<Expr>()?;
            Ok(Self::Unknown(name))
        }
    }
}

/// `keyword = value`, the value still unchecked.
fn option<K: Parse + ToTokens>(input: ParseStream<'_>) -> syn::Result<(K, Expr)> {
    let keyword = input.parse()?;
    equals(input, &keyword)?;
    Ok((keyword, input.parse()?))
}

/// The `=` after an option's name; an option written alone is an error on its name.
fn equals(input: ParseStream<'_>, name: &impl ToTokens) -> syn::Result<()> {
    if !input.peek(Token![=]) {
        let name = name.to_token_stream();
        return Err(syn::Error::new(
            name.span(),
            format!("expected `{name} = ...`; options are written `name = value`"),
        ));
    }
    input.parse::<Token![=]>().map(drop)
}

/// Stores an option with its keyword unless it was already given: the one place that
/// says "specified more than once". A value that failed its check (`None`, already
/// reported) is left out.
fn set_once<K: ToTokens, T>(
    slot: &mut Option<(K, T)>,
    keyword: K,
    value: Option<T>,
    errors: &Errors,
) {
    let Some(value) = value else { return };
    if slot.is_some() {
        let name = keyword.to_token_stream();
        errors.at(name.span(), format!("`{name}` is specified more than once"));
    } else {
        *slot = Some((keyword, value));
    }
}

/// Parses the arguments; `None` when they cannot make a wrapper (the errors say why).
pub(crate) fn parse(args: proc_macro2::TokenStream, errors: &Errors) -> Option<Args> {
    let parsed = match Punctuated::<Arg, Token![,]>::parse_terminated.parse2(args) {
        Ok(parsed) => parsed,
        Err(e) => {
            errors.push(e);
            return None;
        }
    };
    let mut scope = None;
    let mut ttl = None;
    let mut fields = None;
    let mut key = None;
    let mut principal = None;
    let mut required = None;
    let mut concurrency = None;
    let mut isolation = None;
    let mut statement_timeout = None;
    let mut spread = None;
    let mut completable = None;
    let mut scope_given = false;
    for arg in parsed {
        match arg {
            Arg::Scope(k, value) => {
                scope_given = true;
                set_once(&mut scope, k, parse_scope(&value, errors), errors);
            }
            Arg::Ttl(k, value) => set_once(&mut ttl, k, parse_ttl(&value, errors), errors),
            Arg::Fields(k, value) => {
                set_once(&mut fields, k, parse_fields(&value, errors), errors);
            }
            Arg::Key(k, value) => set_once(&mut key, k, parse_key(&value, errors), errors),
            Arg::Principal(k, Ok(ty)) => set_once(&mut principal, k, Some(ty), errors),
            Arg::Principal(_, Err(literal)) => errors.at(
                literal.span(),
                "`principal` takes an extractor type that implements `idem::extract::Principal`, such as `principal = Tenant`",
            ),
            Arg::Required(k, value) => {
                set_once(&mut required, k, parse_required(&value, errors), errors);
            }
            Arg::Concurrency(k, value) => {
                set_once(&mut concurrency, k, parse_concurrency(&value, errors), errors);
            }
            Arg::Isolation(k, value) => {
                set_once(&mut isolation, k, parse_isolation(&value, errors), errors);
            }
            Arg::StatementTimeout(k, value) => {
                let timeout = parse_statement_timeout(&value, errors);
                set_once(&mut statement_timeout, k, timeout, errors);
            }
            Arg::Spread(k, value) => set_once(&mut spread, k, parse_spread(&value, errors), errors),
            Arg::Completable(k, value) => {
                set_once(&mut completable, k, parse_completable(&value, errors), errors);
            }
            Arg::Unknown(name) => {
                let near = nearest(&name.to_string());
                // `scpoe = ".."` is the scope, misspelt: one error, not also "missing".
                scope_given |= near == Some("scope");
                errors.at(
                    name.span(),
                    match near {
                        Some(option) => format!(
                            "unknown option `{name}` (did you mean `{option}`?); valid options are {OPTIONS}"
                        ),
                        None => format!("unknown option `{name}`; valid options are {OPTIONS}"),
                    },
                );
            }
        }
    }
    if let (Some((keyword, _)), Some(_)) = (&spread, &principal) {
        errors.at(
            keyword.span,
            "`spread` places keys that have no principal, and `principal = ..` gives this endpoint's keys one: remove one of them",
        );
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
        key,
        principal,
        spread,
        required,
        concurrency,
        isolation,
        statement_timeout,
        completable,
    })
}

/// `spread = key`, or `spread = path` naming a function from the body to its tenant.
fn parse_spread(value: &Expr, errors: &Errors) -> Option<Spread> {
    if let Expr::Path(path) = value {
        if path.qself.is_none() && path.attrs.is_empty() {
            if path.path.is_ident("key") {
                let span = path.path.segments[0].ident.span();
                return Some(Spread::Key(kw::key(span)));
            }
            return Some(Spread::Tenant(path.path.clone()));
        }
    }
    errors.at(
        value.span(),
        "`spread` takes `key` (a hash of the key) or the path of a function from the body to the tenant it concerns, such as `spread = key` or `spread = account_of`",
    );
    None
}

/// `statement_timeout = "5s"`: more than zero, at most a day.
fn parse_statement_timeout(value: &Expr, errors: &Errors) -> Option<DurationLit> {
    let lit = string_literal(value, "statement_timeout = \"...\"", errors)?;
    match duration(&lit.value(), true) {
        Some(millis) if millis > 0 && millis <= 86_400_000 => Some(DurationLit {
            lit: lit.clone(),
            millis,
        }),
        _ => {
            errors.at(
                lit.span(),
                "`statement_timeout` must look like \"500ms\", \"5s\" or \"2m\": more than zero and at most a day",
            );
            None
        }
    }
}

/// `isolation = read_committed | repeatable_read | serializable`.
fn parse_isolation(value: &Expr, errors: &Errors) -> Option<Isolation> {
    if is::<kw::read_committed>(value) {
        Some(Isolation::ReadCommitted)
    } else if is::<kw::repeatable_read>(value) {
        Some(Isolation::RepeatableRead)
    } else if is::<kw::serializable>(value) {
        Some(Isolation::Serializable)
    } else {
        errors.at(
            value.span(),
            "`isolation` takes `read_committed` (the default), `repeatable_read` or `serializable`",
        );
        None
    }
}

/// Whether `value` is exactly the word `K`, such as `reject`.
fn is<K: Parse>(value: &Expr) -> bool {
    match value {
        Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() => {
            syn::parse2::<K>(p.path.to_token_stream()).is_ok()
        }
        _ => false,
    }
}

/// `required = true` or `required = false`.
fn parse_required(value: &Expr, errors: &Errors) -> Option<LitBool> {
    if let Expr::Lit(syn::ExprLit {
        lit: syn::Lit::Bool(flag),
        ..
    }) = value
    {
        return Some(flag.clone());
    }
    errors.at(
        value.span(),
        "`required` takes `true` (the default: a request without a key is refused) or `false` \
         (it runs without being recorded, for a gradual rollout)",
    );
    None
}

/// `completable = true` or `completable = false`.
fn parse_completable(value: &Expr, errors: &Errors) -> Option<LitBool> {
    if let Expr::Lit(syn::ExprLit {
        lit: syn::Lit::Bool(flag),
        ..
    }) = value
    {
        return Some(flag.clone());
    }
    errors.at(
        value.span(),
        "`completable` takes `true` (the request is stored with its first step, so that the \
         service completes it if its client goes away) or `false` (the default)",
    );
    None
}

/// `key = id`, `key = meta.event_id`, `key = header("Webhook-Id")` or `key =
/// digest(body)`.
fn parse_key(value: &Expr, errors: &Errors) -> Option<KeySource> {
    if let Expr::Call(call) = value {
        if is::<kw::header>(&call.func) {
            if let [Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(name),
                ..
            })] = &call.args.iter().collect::<Vec<_>>()[..]
            {
                let text = name.value();
                let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
                if !text.is_empty() && text.bytes().all(token) {
                    let lowercase = LitStr::new(&text.to_ascii_lowercase(), name.span());
                    return Some(KeySource::Header(lowercase));
                }
                errors.at(name.span(), "not a valid HTTP header name");
                return None;
            }
        }
    }
    if let Expr::Call(call) = value {
        if is::<kw::digest>(&call.func) {
            if let [arg] = &call.args.iter().collect::<Vec<_>>()[..] {
                if is::<kw::body>(arg) {
                    return Some(KeySource::Digest(kw::digest(call.func.span())));
                }
            }
            errors.at(
                call.span(),
                "`digest` takes the word `body`: `key = digest(body)` keys the request by the SHA-256 of its whole body",
            );
            return None;
        }
    }
    if let Some(path) = field_path(value) {
        return Some(KeySource::Field(path));
    }
    errors.at(
        value.span(),
        "`key` takes a body field, such as `key = id` or `key = meta.event_id`, a header, such as `key = header(\"Webhook-Id\")`, or the body's digest, `key = digest(body)`",
    );
    None
}

/// `concurrency = reject` (the default: 409 at once) or `concurrency = wait("30s")`.
fn parse_concurrency(value: &Expr, errors: &Errors) -> Option<Concurrency> {
    const FORMS: &str = "`concurrency` takes `reject` (a duplicate of a request in flight gets 409 at once) or \
                         `wait(\"30s\")` (it waits up to that long for the first to finish, then replays it)";
    if is::<kw::reject>(value) {
        return Some(Concurrency::Reject);
    }
    let Expr::Call(call) = value else {
        errors.at(value.span(), FORMS);
        return None;
    };
    if !is::<kw::wait>(&call.func) {
        errors.at(value.span(), FORMS);
        return None;
    }
    let Some(Expr::Lit(syn::ExprLit {
        lit: syn::Lit::Str(lit),
        ..
    })) = call.args.first()
    else {
        errors.at(call.span(), FORMS);
        return None;
    };
    match duration(&lit.value(), true) {
        Some(millis) if millis > 0 && millis <= 3_600_000 => Some(Concurrency::Wait(DurationLit {
            lit: lit.clone(),
            millis,
        })),
        _ => {
            errors.at(
                lit.span(),
                "`wait` must look like \"500ms\", \"30s\" or \"2m\": more than zero and at most an hour",
            );
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

fn parse_ttl(value: &Expr, errors: &Errors) -> Option<DurationLit> {
    if let Expr::Lit(syn::ExprLit {
        lit: syn::Lit::Int(number),
        ..
    }) = value
    {
        // A number of seconds, as other libraries take it: say how to write it here.
        let hint = number
            .base10_parse::<u64>()
            .ok()
            .filter(|&s| s > 0)
            .map_or_else(
                || "such as `ttl = \"24h\"`".to_owned(),
                |secs| format!("`ttl = \"{}\"` if {number} is in seconds", in_unit(secs)),
            );
        errors.at(
            number.span(),
            format!("`ttl` takes a string with its unit: {hint}; a whole number and one unit of s, m, h or d"),
        );
        return None;
    }
    let lit = string_literal(value, "ttl = \"...\"", errors)?;
    let Some(millis) = duration(&lit.value(), false) else {
        errors.at(lit.span(), TTL_FORMS);
        return None;
    };
    if millis == 0 {
        errors.at(
            lit.span(),
            "`ttl` must be longer than zero: a stored response must be kept for some time",
        );
        return None;
    }
    // A century is more than any key needs and keeps `now() + ttl` inside PostgreSQL's range.
    if millis > 100 * 365 * 86_400_000 {
        errors.at(lit.span(), "`ttl` is too long: the limit is 100 years");
        return None;
    }
    Some(DurationLit {
        lit: lit.clone(),
        millis,
    })
}

/// `secs` in the largest unit that writes it whole: 86400 is `1d`, 5400 `90m`.
fn in_unit(secs: u64) -> String {
    [(86_400, 'd'), (3_600, 'h'), (60, 'm')]
        .into_iter()
        .find(|(unit, _)| secs.is_multiple_of(*unit))
        .map_or_else(
            || format!("{secs}s"),
            |(unit, name)| format!("{}{name}", secs / unit),
        )
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

    #[test]
    fn a_misspelt_option_is_named_and_an_unrelated_one_is_not() {
        assert_eq!(nearest("tll"), Some("ttl"));
        assert_eq!(nearest("feilds"), Some("fields"));
        assert_eq!(nearest("Scope"), Some("scope"));
        assert_eq!(nearest("statement_timout"), Some("statement_timeout"));
        assert_eq!(nearest("isolaton"), Some("isolation"));
        assert_eq!(nearest("retries"), None);
        assert_eq!(nearest("id"), None);
        assert_eq!(edits("kitten", "sitting"), 3);
    }

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
    fn a_ttl_in_seconds_is_answered_with_its_string() {
        assert_eq!(
            messages(quote!(scope = "s", ttl = 86400)),
            [
                "`ttl` takes a string with its unit: `ttl = \"1d\"` if 86400 is in seconds; \
              a whole number and one unit of s, m, h or d"
            ]
        );
        assert_eq!(in_unit(5_400), "90m");
        assert_eq!(in_unit(7_200), "2h");
        assert_eq!(in_unit(90), "90s");
        assert_eq!(messages(quote!(scope = "s", ttl = 0)).len(), 1);
    }

    #[test]
    fn a_misspelt_scope_is_one_error() {
        let all = messages(quote!(scpoe = "charges"));
        assert_eq!(all.len(), 1, "{all:#?}");
        assert!(all[0].contains("did you mean `scope`?"), "{all:#?}");
        // An unrelated unknown option leaves the scope missing: two mistakes.
        assert_eq!(messages(quote!(retries = 3)).len(), 2);
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
            .1
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
        assert!(matches!(&args.key, Some((_, KeySource::Field(p))) if p.name() == "meta.event_id"));
        assert_eq!(args.wait().map(|w| w.millis), Some(30_000));
        let args = parse_ok(quote!(
            scope = "s",
            key = header("Webhook-Id"),
            concurrency = reject
        ));
        assert!(matches!(&args.key, Some((_, KeySource::Header(h))) if h.value() == "webhook-id"));
        assert!(matches!(args.concurrency, Some((_, Concurrency::Reject))));
        assert!(args.wait().is_none());
        let args = parse_ok(quote!(scope = "s", key = digest(body)));
        assert!(matches!(&args.key, Some((_, KeySource::Digest(_)))));
        // A field that happens to be called `body` is still a field.
        let args = parse_ok(quote!(scope = "s", key = body));
        assert!(matches!(&args.key, Some((_, KeySource::Field(p))) if p.name() == "body"));
        let args = parse_ok(quote!(scope = "s", concurrency = wait("250ms")));
        assert_eq!(args.wait().map(|w| w.millis), Some(250));
        for bad in [
            quote!(key = header("bad header")),
            quote!(key = "id"),
            quote!(concurrency = wait("0s")),
            quote!(concurrency = wait("2h")),
            quote!(concurrency = forever),
            quote!(concurrency = a::reject),
            quote!(concurrency = waits("1s")),
            quote!(key = headers("Id")),
            quote!(key = digest(id)),
            quote!(key = digest()),
            quote!(key = digest(body, id)),
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
            quote!(key = id),
            quote!(required = false),
            quote!(concurrency = reject),
        ] {
            let all = messages(quote!(scope = "s", #option, #option));
            assert!(
                all.iter()
                    .any(|m| m.ends_with("is specified more than once")),
                "{all:?}"
            );
        }
    }

    #[test]
    fn options_are_keywords_that_keep_their_tokens() {
        let args = parse_ok(quote!(scope = "s", ttl = "1h", required = false));
        assert_eq!(
            args.ttl.as_ref().map(|(_, ttl)| ttl.lit.value()),
            Some("1h".into())
        );
        assert!(args.required.is_some());
        // A near miss of a keyword is an unknown option, named with the valid ones.
        let all = messages(quote!(scope = "s", Scope = "t", r#ttl = "1h"));
        assert_eq!(all.len(), 2, "{all:#?}");
        assert!(
            all.iter().all(|m| m.contains("valid options are `scope`")),
            "{all:#?}"
        );
        // Written without a value: a syntax error on the option's name.
        assert_eq!(
            messages(quote!(scope = "s", ttl)),
            ["expected `ttl = ...`; options are written `name = value`"]
        );
        assert_eq!(
            messages(quote!(scope = "s", retries)),
            ["expected `retries = ...`; options are written `name = value`"]
        );
    }
}

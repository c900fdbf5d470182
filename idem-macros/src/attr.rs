//! The attribute's arguments, parsed into typed values that keep their spans.

use proc_macro2::Span;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Expr, Ident, LitStr, Member, Token};

const OPTIONS: &str = "`scope`, `ttl`, `fields` or `principal`";

/// The parsed `#[idempotent(...)]` arguments.
pub struct Args {
    pub scope: LitStr,
    pub ttl_secs: u64,
    pub fields: Option<Fields>,
    pub principal: Option<syn::Path>,
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
    value: Expr,
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
        Ok(Self {
            name,
            value: input.parse()?,
        })
    }
}

/// Collects every error of one attribute, so a user with three mistakes sees three
/// messages in one build.
#[derive(Default)]
pub struct Errors(Option<syn::Error>);

impl Errors {
    pub fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(errors) => errors.combine(error),
            None => self.0 = Some(error),
        }
    }

    pub fn at(&mut self, span: Span, message: impl std::fmt::Display) {
        self.push(syn::Error::new(span, message));
    }

    pub fn finish(self) -> Result<(), syn::Error> {
        self.0.map_or(Ok(()), Err)
    }
}

/// Stores an option's value unless it was already given: the one place that says
/// "specified more than once".
fn set_once<T>(slot: &mut Option<T>, value: T, name: &Ident, errors: &mut Errors) {
    if slot.is_some() {
        errors.at(name.span(), format!("`{name}` is specified more than once"));
    } else {
        *slot = Some(value);
    }
}

/// Parses the arguments. `attr_span` is where to report a missing `scope` when the
/// attribute has no arguments at all.
pub fn parse(args: proc_macro2::TokenStream, errors: &mut Errors) -> Option<Args> {
    let parsed = match syn::parse::Parser::parse2(
        Punctuated::<Arg, Token![,]>::parse_terminated,
        args.clone(),
    ) {
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
    for arg in parsed {
        match arg.name.to_string().as_str() {
            "scope" => {
                if let Some(v) = parse_scope(&arg.value, errors) {
                    set_once(&mut scope, v, &arg.name, errors);
                }
            }
            "ttl" => {
                if let Some(v) = parse_ttl(&arg.value, errors) {
                    set_once(&mut ttl, v, &arg.name, errors);
                }
            }
            "fields" => {
                if let Some(paths) = parse_fields(&arg.value, errors) {
                    let value = Fields {
                        keyword: arg.name.clone(),
                        paths,
                    };
                    set_once(&mut fields, value, &arg.name, errors);
                }
            }
            "principal" => match &arg.value {
                Expr::Path(p) if p.qself.is_none() => set_once(&mut principal, p.path.clone(), &arg.name, errors),
                other => errors.at(
                    other.span(),
                    "`principal` takes an extractor type that implements `idem_runtime::Principal`, such as `principal = Tenant`",
                ),
            },
            unknown => errors.at(
                arg.name.span(),
                format!("unknown option `{unknown}`; valid options are {OPTIONS}"),
            ),
        }
    }
    let Some(scope) = scope else {
        let span = if args.is_empty() {
            Span::call_site()
        } else {
            args.span()
        };
        errors.at(span, "missing `scope = \"...\"`: the name that keys of this endpoint live under, such as `scope = \"charges\"`");
        return None;
    };
    Some(Args {
        scope,
        ttl_secs: ttl.unwrap_or(24 * 60 * 60),
        fields,
        principal,
    })
}

fn string_literal<'a>(value: &'a Expr, option: &str, errors: &mut Errors) -> Option<&'a LitStr> {
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

fn parse_scope(value: &Expr, errors: &mut Errors) -> Option<LitStr> {
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

fn parse_ttl(value: &Expr, errors: &mut Errors) -> Option<u64> {
    let lit = string_literal(value, "ttl = \"...\"", errors)?;
    let text = lit.value();
    let digits = text.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let unit = &text[digits.len()..];
    let seconds_per_unit: u64 = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 60 * 60,
        "d" => 24 * 60 * 60,
        _ => {
            errors.at(lit.span(), TTL_FORMS);
            return None;
        }
    };
    let count: u64 = match digits.parse() {
        Ok(n) if !digits.starts_with('+') => n,
        _ => {
            errors.at(lit.span(), TTL_FORMS);
            return None;
        }
    };
    if count == 0 {
        errors.at(
            lit.span(),
            "`ttl` must be longer than zero: a stored response must be kept for some time",
        );
        return None;
    }
    // A century is more than any key needs and keeps `now() + ttl` inside PostgreSQL's range.
    match count.checked_mul(seconds_per_unit) {
        Some(secs) if secs <= 100 * 365 * 24 * 60 * 60 => Some(secs),
        _ => {
            errors.at(lit.span(), "`ttl` is too long: the limit is 100 years");
            None
        }
    }
}

fn parse_fields(value: &Expr, errors: &mut Errors) -> Option<Vec<FieldPath>> {
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

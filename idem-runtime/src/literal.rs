//! Request data written into a statement's text, for the statements idem sends by the
//! simple query protocol: several statements in one message, one round trip (BEGIN and
//! the claim, the key row and COMMIT), which bound parameters cannot ride.
//!
//! No input can change such a statement: a text is written as an escape string of its
//! characters' code points (`E'\U00000061'`), a byte string as hex digits
//! (`E'\\x61'::bytea`), so a quote, a backslash or any other character of a key, a
//! principal or a response body is data and never SQL; an escape string means the same
//! whatever the session's `standard_conforming_strings` is. Numbers are written by Rust's
//! own formatting: digits, a sign, a point. Every literal is a constant when the statement
//! is parsed: a distributed engine routes a statement by the constant in its distribution
//! column, as it does by a bound parameter (a function call there, even an immutable one,
//! makes Citus push the claim to a shard whole, where it fails).

use std::fmt::Write;

use crate::transaction::Prepared;

/// One value written into a statement.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Literal<'a> {
    /// `text`, as its UTF-8 bytes in hex.
    Text(&'a str),
    /// `bytea`, in hex.
    Bytes(&'a [u8]),
    /// `bigint`.
    Int(i64),
    /// `float8`; a value that is not finite is written as NULL (none is ever bound).
    Float(f64),
    /// `NULL`.
    Null,
}

impl Literal<'_> {
    /// Appends the literal to `sql`.
    pub(crate) fn write(&self, sql: &mut String) {
        match self {
            Self::Text(text) => {
                sql.push_str("E'");
                for c in text.chars() {
                    let _ = write!(sql, "\\U{:08x}", u32::from(c));
                }
                sql.push('\'');
            }
            Self::Bytes(bytes) => {
                sql.push_str("E'\\\\x");
                hex(sql, bytes);
                sql.push_str("'::bytea");
            }
            Self::Int(n) => {
                let _ = write!(sql, "CAST({n} AS bigint)");
            }
            Self::Float(x) if x.is_finite() => {
                // Display writes the shortest decimal that reads back as the same `f64`,
                // with no exponent: digits, a sign and a point.
                let _ = write!(sql, "CAST('{x}' AS float8)");
            }
            Self::Float(_) | Self::Null => sql.push_str("NULL"),
        }
    }
}

/// The hex digits of `bytes`.
fn hex(sql: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    sql.reserve(bytes.len() * 2 + 16);
    for b in bytes {
        sql.push(char::from(DIGITS[usize::from(b >> 4)]));
        sql.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
}

/// `sql` with each parameter `$n` (1-based) replaced by `values[n - 1]`. `sql` is one of
/// idem's own statements, whose text has no `$` but its parameters; a parameter with no
/// value is left as it is.
pub(crate) fn render(sql: &str, values: &[Literal<'_>]) -> String {
    let mut out = String::with_capacity(sql.len() + 64);
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let digits = rest[at + 1..]
            .bytes()
            .take_while(u8::is_ascii_digit)
            .count();
        let number: Option<usize> = rest[at + 1..at + 1 + digits].parse().ok();
        match number
            .and_then(|n| n.checked_sub(1))
            .and_then(|i| values.get(i))
        {
            Some(value) => value.write(&mut out),
            None => out.push_str(&rest[at..at + 1 + digits]),
        }
        rest = &rest[at + 1 + digits..];
    }
    out.push_str(rest);
    out
}

/// `EXECUTE` of the statement of `role` with `values` written in ([`execute`]), where
/// `prepared` holds it; `None` where the statement is to be written whole ([`render`]).
pub(crate) fn executed(
    prepared: Option<&Prepared>,
    role: &str,
    values: &[Literal<'_>],
) -> Option<String> {
    let name = prepared?.get(role)?;
    Some(execute(name, values))
}

/// `EXECUTE name(values...)`: a statement prepared with SQL `PREPARE`
/// ([`crate::transaction::Prepared`]), its parameters written in. `name` is one of
/// idem's own: letters, digits and `_`.
pub(crate) fn execute(name: &str, values: &[Literal<'_>]) -> String {
    let mut out = String::with_capacity(name.len() + 16 + values.len() * 24);
    out.push_str("EXECUTE ");
    out.push_str(name);
    out.push('(');
    for (i, value) in values.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        value.write(&mut out);
    }
    out.push(')');
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn lit(value: &Literal<'_>) -> String {
        let mut sql = String::new();
        value.write(&mut sql);
        sql
    }

    #[test]
    fn values_are_escapes_hex_and_numbers() {
        assert_eq!(lit(&Literal::Bytes(b"\x00'\\")), r"E'\\x00275c'::bytea");
        assert_eq!(
            lit(&Literal::Text("a'é")),
            r"E'\U00000061\U00000027\U000000e9'"
        );
        assert_eq!(lit(&Literal::Text("")), "E''");
        assert_eq!(lit(&Literal::Int(-42)), "CAST(-42 AS bigint)");
        assert_eq!(lit(&Literal::Float(0.1)), "CAST('0.1' AS float8)");
        assert_eq!(lit(&Literal::Float(f64::NAN)), "NULL");
        assert_eq!(
            render("SELECT $1, $2, $10, $3", &[Literal::Int(1), Literal::Null]),
            "SELECT CAST(1 AS bigint), NULL, $10, $3"
        );
        assert_eq!(
            execute("idem_0a_take", &[Literal::Text("k"), Literal::Int(7)]),
            r"EXECUTE idem_0a_take(E'\U0000006b', CAST(7 AS bigint))"
        );
    }

    proptest! {
        /// Whatever the input, a literal is its fixed words around escapes of code
        /// points, hex digits or number characters: no character of the input reaches
        /// the SQL as itself, and the escapes give the input back.
        #[test]
        fn no_input_changes_the_statement(text in any::<String>(), bytes in any::<Vec<u8>>(),
                                          n in any::<i64>(), x in any::<f64>()) {
            let escaped = lit(&Literal::Text(&text));
            let inner = escaped.strip_prefix("E'").and_then(|s| s.strip_suffix('\'')).unwrap();
            prop_assert_eq!(inner.len(), text.chars().count() * 10);
            let decoded: String = inner
                .as_bytes()
                .chunks(10)
                .map(|c| {
                    assert_eq!(&c[..2], br"\U");
                    let hex = std::str::from_utf8(&c[2..]).unwrap();
                    char::from_u32(u32::from_str_radix(hex, 16).unwrap()).unwrap()
                })
                .collect();
            prop_assert_eq!(decoded, text);

            let hexed = lit(&Literal::Bytes(&bytes));
            let inner = hexed.strip_prefix(r"E'\\x").and_then(|s| s.strip_suffix("'::bytea")).unwrap();
            prop_assert!(inner.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
            prop_assert_eq!(inner.len(), bytes.len() * 2);

            let int = lit(&Literal::Int(n));
            prop_assert_eq!(int, format!("CAST({n} AS bigint)"));

            let float = lit(&Literal::Float(x));
            prop_assert!(
                float == "NULL"
                    || float
                        .strip_prefix("CAST('")
                        .and_then(|s| s.strip_suffix("' AS float8)"))
                        .is_some_and(|s| s.bytes().all(|b| b.is_ascii_digit() || b == b'-' || b == b'.')),
                "{}", float
            );
        }

        /// A float reads back as itself.
        #[test]
        fn floats_round_trip(x in any::<f64>().prop_filter("finite", |x| x.is_finite())) {
            let text = x.to_string();
            prop_assert_eq!(text.parse::<f64>().unwrap(), x);
            prop_assert!(!text.contains('e'));
        }
    }
}

//! The literals of idem's one-message statements (`idem-runtime/src/literal.rs`) on
//! arbitrary text and bytes: the statement is exactly its fixed words around escapes of
//! code points and hex digits, whatever the input (no character of it reaches the SQL as
//! itself), and the escapes give the input back.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: (String, Vec<u8>)| {
    let (text, bytes) = data;
    let sql = idem::__private::literals(&text, &bytes);
    let rest = sql
        .strip_prefix("SELECT E'")
        .unwrap_or_else(|| panic!("unexpected start: {sql}"));
    let (escaped, rest) = rest
        .split_once(r"', E'\\x")
        .unwrap_or_else(|| panic!("unexpected middle: {sql}"));
    let hex = rest
        .strip_suffix("'::bytea")
        .unwrap_or_else(|| panic!("unexpected end: {sql}"));
    // Each character as \U and eight hex digits.
    assert_eq!(escaped.len() % 10, 0, "{sql}");
    let decoded: String = escaped
        .as_bytes()
        .chunks(10)
        .map(|c| {
            assert_eq!(&c[..2], br"\U", "{sql}");
            let digits = std::str::from_utf8(&c[2..]).unwrap();
            assert!(digits.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')), "{sql}");
            char::from_u32(u32::from_str_radix(digits, 16).unwrap()).unwrap()
        })
        .collect();
    assert_eq!(decoded, text);
    assert!(
        hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')),
        "not hex: {sql}"
    );
    let decoded: Vec<u8> = hex
        .as_bytes()
        .chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).unwrap(), 16).unwrap())
        .collect();
    assert_eq!(decoded, bytes);
});

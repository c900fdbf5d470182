//! `IdempotencyKey::parse` on arbitrary header bytes: it never panics; a key it accepts
//! is 1 to `MAX_KEY_LEN` characters of 0x20-0x7E (0x21-0x7E when sent bare); and a bare
//! key means the same key as its sf-string spelling.
#![no_main]

use idem::header::{IdempotencyKey, MAX_KEY_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(key) = IdempotencyKey::parse(data) else {
        return;
    };
    let text = key.as_str();
    assert!(
        (1..=MAX_KEY_LEN).contains(&text.len()),
        "accepted a key of {} characters: {data:?}",
        text.len()
    );
    assert!(
        text.bytes().all(|b| (0x20..=0x7e).contains(&b)),
        "accepted a key outside 0x20-0x7E: {data:?}"
    );
    if data.first() == Some(&b'"') {
        // An sf-string: the key is its content, unescaped, so quoting it again gives
        // back the same key.
        assert_eq!(IdempotencyKey::parse(&quote(text)).as_ref(), Ok(&key));
        return;
    }
    // A bare key is the input itself, visible ASCII only ...
    assert_eq!(text.as_bytes(), data, "a bare key was changed");
    assert!(!text.contains(' '), "accepted a bare key with a space");
    // ... and its sf-string spelling is the same key.
    let quoted = quote(text);
    assert_eq!(
        IdempotencyKey::parse(&quoted).as_ref(),
        Ok(&key),
        "{:?} and {:?} are different keys",
        String::from_utf8_lossy(data),
        String::from_utf8_lossy(&quoted)
    );
});

/// The RFC 8941 sf-string spelling of `key`: quoted, `\` and `"` escaped.
fn quote(key: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len() + 2);
    out.push(b'"');
    for b in key.bytes() {
        if b == b'\\' || b == b'"' {
            out.push(b'\\');
        }
        out.push(b);
    }
    out.push(b'"');
    out
}

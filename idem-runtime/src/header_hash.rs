//! The hash of a header name that `key = header(..)` and the webhook schemes agree on:
//! below both `probe` and `webhook`, which share it without importing each other.

/// FNV-1a of the lowercased header name: the `H` of
/// [`HeaderKey`](crate::probe::HeaderKey) and of `idem::webhook::SignsIdHeader`.
/// `#[idempotent(key = header(..))]` computes it in a const block.
pub const fn header_hash(name: &str) -> u64 {
    let bytes = name.as_bytes();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i].to_ascii_lowercase() as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    hash
}

//! The console's CSRF tokens: an HMAC-SHA256 of the operator's name under a key drawn at
//! random when the router is made. A page from another site cannot read a token (the
//! browser's same-origin rule), so it cannot post a form that acts; a token taken from
//! one operator's page is refused for another. A restart draws a new key: forms loaded
//! before it are refused once, and reloading the page mends them.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The key of one console.
pub(crate) struct Key([u8; 32]);

impl Key {
    /// A key from the operating system's random source.
    pub(crate) fn random() -> Self {
        let mut key = [0u8; 32];
        // Without a random source no token can be trusted: no form will verify.
        if getrandom::fill(&mut key).is_err() {
            tracing::error!(target: "idem::console", "idem console: no random source; its actions will refuse every form");
            return Self([0; 32]);
        }
        Self(key)
    }

    fn mac(&self, operator: &str) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(b"idem.console.csrf.v1\0");
        mac.update(operator.as_bytes());
        mac
    }

    /// The token of `operator`'s forms, in hex.
    pub(crate) fn token(&self, operator: &str) -> String {
        let tag = self.mac(operator).finalize().into_bytes();
        tag.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Whether `token` is `operator`'s, compared in constant time.
    pub(crate) fn verify(&self, operator: &str, token: &str) -> bool {
        if self.0 == [0; 32] || token.len() != 64 {
            return false;
        }
        let Some(tag) = (0..32)
            .map(|i| u8::from_str_radix(token.get(2 * i..2 * i + 2)?, 16).ok())
            .collect::<Option<Vec<u8>>>()
        else {
            return false;
        };
        self.mac(operator).verify_slice(&tag).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_its_operators_and_its_consoles() {
        let key = Key::random();
        let token = key.token("alice");
        assert!(key.verify("alice", &token));
        assert!(!key.verify("bob", &token));
        assert!(!key.verify("alice", ""));
        assert!(!key.verify("alice", &token[..62]));
        assert!(!key.verify("alice", &format!("{}zz", &token[..62])));
        assert!(!Key::random().verify("alice", &token));
    }
}

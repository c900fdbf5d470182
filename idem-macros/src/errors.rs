//! The errors of one expansion, collected so that a user with three mistakes sees three
//! messages in one build (serde_derive's `Ctxt`).

use std::cell::RefCell;
use std::fmt::Display;
use std::thread;

use proc_macro2::Span;

/// Collects the errors found while the attribute and the handler are checked. Checks
/// take `&Errors`; [`Errors::check`] consumes it and returns them combined.
///
/// Dropping it unchecked panics: an error pushed here can never be lost on the way to
/// the user.
pub(crate) struct Errors {
    /// `None` once checked.
    errors: RefCell<Option<Vec<syn::Error>>>,
}

impl Errors {
    pub(crate) fn new() -> Self {
        Self {
            errors: RefCell::new(Some(Vec::new())),
        }
    }

    /// An error on one of the user's tokens.
    pub(crate) fn at(&self, span: Span, message: impl Display) {
        self.push(syn::Error::new(span, message));
    }

    /// An error as syn made it, such as a parse error.
    pub(crate) fn push(&self, error: syn::Error) {
        self.errors
            .borrow_mut()
            .as_mut()
            // `check` takes `self`: nothing can push after it.
            .expect("`Errors` used after `check`")
            .push(error);
    }

    /// Every error so far, combined into one, in the order they were found.
    pub(crate) fn check(self) -> syn::Result<()> {
        let mut errors = self.errors.take().into_iter().flatten();
        let Some(mut combined) = errors.next() else {
            return Ok(());
        };
        for error in errors {
            combined.combine(error);
        }
        Err(combined)
    }
}

impl Drop for Errors {
    fn drop(&mut self) {
        if !thread::panicking() && self.errors.borrow().is_some() {
            panic!("idem-macros: `Errors` dropped without `check()`; its errors would be lost");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_combines_in_order() {
        let errors = Errors::new();
        errors.at(Span::call_site(), "first");
        errors.push(syn::Error::new(Span::call_site(), "second"));
        let messages: Vec<String> = errors
            .check()
            .unwrap_err()
            .into_iter()
            .map(|e| e.to_string())
            .collect();
        assert_eq!(messages, ["first", "second"]);
        assert!(Errors::new().check().is_ok());
    }

    #[test]
    #[should_panic(expected = "dropped without `check()`")]
    fn unchecked_errors_panic() {
        let errors = Errors::new();
        errors.at(Span::call_site(), "forgotten");
    }

    #[test]
    #[should_panic(expected = "dropped without `check()`")]
    fn unchecked_even_when_empty() {
        drop(Errors::new());
    }
}

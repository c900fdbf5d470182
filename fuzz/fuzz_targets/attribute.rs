//! `#[idempotent]`'s expansion on arbitrary token text: the input's first line is the
//! attribute's arguments, the rest the item. Text that is not a token stream is skipped
//! (rustc would never hand it to the macro). The expansion never panics, always returns
//! tokens, and for an item that is a function always returns Rust items that keep the
//! function's name: the wrapper, or the function itself with `compile_error!`.
//!
//! The macro crate's modules are compiled in here as they are in its `lib.rs`; they use
//! only syn, quote and proc-macro2, which work outside a proc-macro.
#![no_main]
#![allow(dead_code, unused_imports)]

#[path = "../../idem-macros/src/attr.rs"]
mod attr;
#[path = "../../idem-macros/src/errors.rs"]
mod errors;
#[path = "../../idem-macros/src/expand.rs"]
mod expand;
#[path = "../../idem-macros/src/openapi.rs"]
mod openapi;
#[path = "../../idem-macros/src/valid.rs"]
mod valid;

use std::str::FromStr;

use libfuzzer_sys::fuzz_target;
use proc_macro2::TokenStream;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (args, item) = text.split_once('\n').unwrap_or((text, ""));
    let (Ok(args), Ok(item)) = (TokenStream::from_str(args), TokenStream::from_str(item)) else {
        return;
    };
    let func = syn::parse2::<syn::ItemFn>(item.clone()).ok();
    let out = expand::idempotent(args, item);
    assert!(!out.is_empty(), "no tokens for {text:?}");
    if let Some(func) = func {
        let file = syn::parse2::<syn::File>(out.clone())
            .unwrap_or_else(|e| panic!("{e}: the expansion of {text:?} is not Rust items:\n{out}"));
        let name = &func.sig.ident;
        assert!(
            file.items
                .iter()
                .any(|item| matches!(item, syn::Item::Fn(f) if f.sig.ident == *name)),
            "the expansion of {text:?} lost the function `{name}`:\n{out}"
        );
    }
});

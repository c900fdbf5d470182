//! The README's Rust snippets, compiled. Every ```rust block of README.md appears,
//! whitespace aside, in a file of the guide's new service (marked
//! `<!-- compatibility: .. -->` in a chapter and built by `compatibility.rs` from
//! crates.io's newest releases) or among the guide's compiled snippets (`book.rs`).
//! `every_rust_block_of_the_readme_is_compiled` holds that: a snippet edited in the
//! README and not in the guide fails it.

mod docs;

use docs::{program, rust_blocks, squashed, PROGRAMS, README};

const BOOK_SNIPPETS: &str = include_str!("book.rs");

/// The README's dependency on idem, as the guide's `Cargo.toml` writes it, features aside.
const README_IDEM: &str = r#"idem = { package = "idem-axum", version = "0.1""#;

#[test]
fn every_rust_block_of_the_readme_is_compiled() {
    let blocks = rust_blocks(README);
    assert!(!blocks.is_empty(), "the README's blocks were not found");
    let programs: Vec<String> = PROGRAMS
        .iter()
        .filter(|file| file.ends_with(".rs"))
        .map(|file| squashed(program(file)))
        .collect();
    let snippets = squashed(BOOK_SNIPPETS);
    for (file, block) in blocks {
        assert!(
            file.is_none(),
            "the README's whole files moved to the guide; this one names {file:?}"
        );
        let text = squashed(block);
        assert!(
            snippets.contains(&text) || programs.iter().any(|p| p.contains(&text)),
            "this README block is compiled neither by book.rs nor as a file of the guide's new service:\n{block}"
        );
    }
}

#[test]
fn the_readme_depends_on_idem_as_the_guide_does() {
    assert!(
        README.contains(&format!("{README_IDEM} }}")),
        "the README does not show the dependency {README_IDEM} }}"
    );
    assert!(
        program("Cargo.toml").contains(README_IDEM),
        "the guide's Cargo.toml does not depend on idem as {README_IDEM}"
    );
}

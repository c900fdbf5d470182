//! The guide's chapters and the README, and the fenced blocks in them: what `book.rs`,
//! `readme.rs` and `compatibility.rs` check. A module of each of those test binaries, so
//! each uses a part of it.
#![allow(dead_code)]

use std::path::Path;

/// The README.
pub(crate) const README: &str = include_str!("../../../README.md");

/// The guide's chapters (`docs/book/src`), by file name, in the order of its summary.
/// `book.rs` fails when a chapter on disk is not listed here.
pub(crate) const CHAPTERS: [(&str, &str); 17] = [
    (
        "introduction.md",
        include_str!("../../../docs/book/src/introduction.md"),
    ),
    (
        "getting-started.md",
        include_str!("../../../docs/book/src/getting-started.md"),
    ),
    ("store.md", include_str!("../../../docs/book/src/store.md")),
    (
        "attribute.md",
        include_str!("../../../docs/book/src/attribute.md"),
    ),
    (
        "client.md",
        include_str!("../../../docs/book/src/client.md"),
    ),
    ("grpc.md", include_str!("../../../docs/book/src/grpc.md")),
    (
        "webhooks.md",
        include_str!("../../../docs/book/src/webhooks.md"),
    ),
    ("steps.md", include_str!("../../../docs/book/src/steps.md")),
    (
        "consumers.md",
        include_str!("../../../docs/book/src/consumers.md"),
    ),
    (
        "outbox.md",
        include_str!("../../../docs/book/src/outbox.md"),
    ),
    (
        "completion.md",
        include_str!("../../../docs/book/src/completion.md"),
    ),
    (
        "testing.md",
        include_str!("../../../docs/book/src/testing.md"),
    ),
    (
        "topologies.md",
        include_str!("../../../docs/book/src/topologies.md"),
    ),
    (
        "operating.md",
        include_str!("../../../docs/book/src/operating.md"),
    ),
    (
        "performance.md",
        include_str!("../../../docs/book/src/performance.md"),
    ),
    (
        "exactly-once.md",
        include_str!("../../../docs/book/src/exactly-once.md"),
    ),
    (
        "example.md",
        include_str!("../../../docs/book/src/example.md"),
    ),
];

/// The guide's summary, which lists its chapters.
pub(crate) const SUMMARY: &str = include_str!("../../../docs/book/src/SUMMARY.md");

/// The files of the guide's new service, each a block marked
/// `<!-- compatibility: FILE -->` in a chapter, that `compatibility.rs` writes and builds.
pub(crate) const PROGRAMS: [&str; 4] = [
    "Cargo.toml",
    "src/main.rs",
    "src/bin/events.rs",
    "src/bin/steps.rs",
];

/// The ```rust blocks of `text`, each with the file its `compatibility` marker names.
pub(crate) fn rust_blocks(text: &'static str) -> Vec<(Option<&'static str>, &'static str)> {
    let mut blocks = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("```rust\n") {
        let file = rest[..start]
            .trim_end()
            .rsplit('\n')
            .next()
            .and_then(|line| line.strip_prefix("<!-- compatibility: "))
            .and_then(|line| line.strip_suffix(" -->"));
        let body = &rest[start + "```rust\n".len()..];
        let end = body.find("\n```").expect("a closing ```");
        blocks.push((file, &body[..end]));
        rest = &body[end..];
    }
    blocks
}

/// The text without its whitespace: a snippet may sit indented in a function of a test.
pub(crate) fn squashed(text: &str) -> String {
    text.chars().filter(|c| !c.is_whitespace()).collect()
}

/// The fenced block right after the line `<!-- compatibility: {name} -->`, in whichever
/// chapter holds it (exactly one does), with its final newline.
pub(crate) fn program(name: &str) -> &'static str {
    let marker = format!("<!-- compatibility: {name} -->\n");
    let mut found = CHAPTERS
        .iter()
        .filter_map(|(chapter, text)| text.find(&marker).map(|at| (*chapter, *text, at)));
    let (chapter, text, at) = found
        .next()
        .unwrap_or_else(|| panic!("no chapter of the guide has {marker:?}"));
    assert!(found.next().is_none(), "two chapters have {marker:?}");
    let fenced = &text[at + marker.len()..];
    let body = fenced
        .find('\n')
        .filter(|_| fenced.starts_with("```"))
        .unwrap_or_else(|| panic!("{chapter}: a ``` block right after {marker:?}"))
        + 1;
    let end = fenced[body..]
        .find("\n```")
        .expect("the block's closing ```");
    &fenced[body..=body + end]
}

/// The Markdown files of `docs/book/src` on disk, the summary left out.
pub(crate) fn chapters_on_disk() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/book/src");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            entry
                .expect("a directory entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name.ends_with(".md") && name != "SUMMARY.md")
        .collect();
    names.sort();
    names
}

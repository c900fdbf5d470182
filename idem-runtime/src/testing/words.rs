//! The report's words for an answer and a pass.

pub(super) fn answer_words(status: u16, body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text: String = text.chars().take(200).collect();
    if text.is_empty() {
        status.to_string()
    } else {
        format!("{status} {text}")
    }
}

pub(super) fn replayed_words(replayed: bool) -> &'static str {
    if replayed {
        " (replayed)"
    } else {
        ""
    }
}

/// " (at its 2nd pass)" past the first.
pub(super) fn ordinal(pass: u32) -> String {
    match pass {
        1 => String::new(),
        2 => " (at its 2nd pass)".into(),
        3 => " (at its 3rd pass)".into(),
        n => format!(" (at its {n}th pass)"),
    }
}

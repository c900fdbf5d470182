//! The console's stylesheet and script, served from its own routes: its pages' policy
//! (`Content-Security-Policy`) then allows no inline style or script, so that a value a
//! page shows can never run as code, whatever it holds. Each is named by a hash of its
//! content (`/assets/console.<hash>.js`), so that a browser may keep it and never runs an
//! older one after an upgrade.

use std::sync::OnceLock;

use axum::extract::Path;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

const STYLE: &str = include_str!("console.css");
const SCRIPT: &str = include_str!("console.js");

/// The policy of every page: its own stylesheet, script and requests only, no frame, no
/// form posted elsewhere.
pub(crate) const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; \
     base-uri 'none'";

/// `name.<first 12 hex digits of the content's SHA-256>.ext`.
fn named(stem: &str, ext: &str, content: &str) -> String {
    let digest = Sha256::digest(content.as_bytes());
    let hash: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
    format!("{stem}.{hash}.{ext}")
}

/// The stylesheet's file name under `/assets/`.
pub(crate) fn style() -> &'static str {
    static NAME: OnceLock<String> = OnceLock::new();
    NAME.get_or_init(|| named("console", "css", STYLE))
}

/// The script's file name under `/assets/`.
pub(crate) fn script() -> &'static str {
    static NAME: OnceLock<String> = OnceLock::new();
    NAME.get_or_init(|| named("console", "js", SCRIPT))
}

/// `GET /assets/{file}`: the stylesheet or the script by their current names (kept by
/// the browser for a day: a new content has a new name); anything else is 404.
pub(crate) async fn serve(Path(file): Path<String>) -> Response {
    let (content, kind) = if file == style() {
        (STYLE, "text/css; charset=utf-8")
    } else if file == script() {
        (SCRIPT, "text/javascript; charset=utf-8")
    } else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let mut response = content.into_response();
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(kind));
    // `private`: it is served behind the service's authentication.
    headers.insert(
        CACHE_CONTROL,
        HeaderValue::from_static("private, max-age=86400, immutable"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_asset_is_named_by_its_content() {
        assert!(style().starts_with("console.") && style().ends_with(".css"));
        assert_eq!(style().len(), "console..css".len() + 12);
        assert_ne!(named("console", "js", "a"), named("console", "js", "b"));
        assert_eq!(named("console", "js", "a"), named("console", "js", "a"));
    }
}

//! Requests sent and their responses read whole.

/// A response read whole: status, headers and the exact body bytes.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The status.
    pub status: u16,
    /// The headers.
    pub headers: reqwest::header::HeaderMap,
    /// The body, byte for byte.
    pub body: Vec<u8>,
}

impl Answer {
    /// Reads a response.
    pub async fn read(response: reqwest::Response) -> Self {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.bytes().await.expect("read body").to_vec();
        Self {
            status,
            headers,
            body,
        }
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// A header as text, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Whether this is a replay.
    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// Asserts this status, with the body in the message when it is another.
    #[track_caller]
    pub fn assert_status(&self, status: u16) {
        assert_eq!(
            self.status,
            status,
            "body: {}",
            String::from_utf8_lossy(&self.body)
        );
    }

    /// Asserts a problem+json answer with this status and a `type` ending in `slug`.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, slug: &str) {
        self.assert_status(status);
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let json = self.json();
        let kind = json["type"].as_str().unwrap_or_default();
        assert!(
            kind.ends_with(slug),
            "problem type {kind:?} does not end in {slug:?}"
        );
        assert_eq!(json["status"], status);
        assert!(json["title"].is_string());
    }
}

/// Sends `request` and reads the answer whole. A connection closed without an answer (a
/// handler that panicked, a server that was killed) reads as status 0.
pub async fn send(request: reqwest::RequestBuilder) -> Answer {
    match request.send().await {
        Ok(response) => Answer::read(response).await,
        Err(_) => Answer {
            status: 0,
            headers: reqwest::header::HeaderMap::new(),
            body: Vec::new(),
        },
    }
}

/// Sends `POST url` with a JSON body, an optional `Idempotency-Key` and extra headers,
/// as [`send`] does.
pub async fn post(
    client: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> Answer {
    let mut request = client.post(url).json(body);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    send(request).await
}

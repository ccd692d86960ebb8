//! OpenAI's wire format: the request bodies this server reads, the errors it answers with.
//!
//! Requests are read leniently where OpenAI's clients send more than we use (unknown fields are
//! ignored, as OpenAI itself ignores them) and strictly where a value would change the answer
//! (`n` above 1, a `tool_choice` naming no declared tool, a `max_tokens` above the server's limit):
//! those are refused, never silently dropped.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value as Json};

/// An error as OpenAI writes it: `{"error": {"message", "type", "code", "param"}}` with an HTTP
/// status. `kind` is OpenAI's `type`, `code` the precise reason a client can branch on.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: &'static str,
    pub param: Option<&'static str>,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            code,
            param: None,
            message: message.into(),
        }
    }

    /// A request the server cannot answer as written (400).
    pub fn invalid(code: &'static str, param: Option<&'static str>, message: impl Into<String>) -> Self {
        ApiError {
            param,
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", code, message)
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            message,
        )
    }

    pub fn body(&self) -> Json {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "code": self.code,
            "param": self.param,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The body was left unread, so this connection cannot carry another request: say so,
            // or a keep-alive client sends its next request into a connection hyper then drops
            // ("Server disconnected without sending a response" from the openai client in CI).
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            // The queue drains at decode speed: a second is the right order of magnitude.
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        response
    }
}

/// `stop`: one string or a list of them.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// What both endpoints share: sampling, limits, streaming.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Common {
    /// Accepted and echoed: the server serves one model whatever the name (as llama-server).
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub max_tokens: Option<usize>,
    /// OpenAI's newer name for `max_tokens`.
    pub max_completion_tokens: Option<usize>,
    pub n: Option<usize>,
    /// vLLM's extension: the prompt's and the answer's token ids in the response, so that a
    /// client (our tests) can compare answers id for id.
    #[serde(default)]
    pub return_token_ids: bool,
    /// vLLM's extension: decode through end-of-turn ids up to `max_tokens` (load tests).
    #[serde(default)]
    pub ignore_eos: bool,
}

/// One message of `messages`. `content` is text, `null`, or a list of `{"type": "text", "text"}`
/// parts.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Json>,
    #[serde(default)]
    pub tool_calls: Option<Vec<Json>>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub tools: Option<Vec<Json>>,
    #[serde(default)]
    pub tool_choice: Option<Json>,
    #[serde(flatten)]
    pub common: Common,
}

/// `prompt`: a string, or a list holding one string (what OpenAI's client sends for a list).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<i64>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub common: Common,
}

/// Reads `body` as `T`, naming what is wrong the way a client can act on.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(ApiError::invalid(
            "invalid_json",
            None,
            "the request body is empty; send a JSON object",
        ));
    }
    serde_json::from_slice(body).map_err(|e| {
        let code = match e.classify() {
            serde_json::error::Category::Syntax
            | serde_json::error::Category::Eof
            | serde_json::error::Category::Io => "invalid_json",
            serde_json::error::Category::Data => "invalid_request",
        };
        ApiError::invalid(code, None, format!("the request body: {e}"))
    })
}

/// `tool_choice`: `"auto" | "none" | "required"` or `{"type": "function", "function": {"name"}}`.
pub fn tool_choice(value: Option<&Json>) -> Result<String, ApiError> {
    let bad = || {
        ApiError::invalid(
            "invalid_tool_choice",
            Some("tool_choice"),
            "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        )
    };
    match value {
        None | Some(Json::Null) => Ok("auto".into()),
        Some(Json::String(s)) if matches!(s.as_str(), "auto" | "none" | "required") => Ok(s.clone()),
        Some(Json::Object(o)) => o
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Json::as_str)
            .map(String::from)
            .ok_or_else(bad),
        Some(_) => Err(bad()),
    }
}

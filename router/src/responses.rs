//! Responses the router writes itself: JSON, and errors in the OpenAI shape
//! `{"error": {"message": ..., "type": ..., "code": <status>}}`.

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use serde::Serialize;
use serde_json::json;

/// Any error a response body may end with (the client then sees the connection cut).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every response the router sends: its own, or a worker's streamed through.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;

/// A body holding `bytes`.
pub fn full(bytes: impl Into<Bytes>) -> ResponseBody {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed_unsync()
}

/// A response with `status` and `content_type`, holding `body`.
pub fn text_response(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<ResponseBody> {
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// A JSON response with `status`.
pub fn json_response(status: StatusCode, value: &impl Serialize) -> Response<ResponseBody> {
    let body = serde_json::to_vec(value).expect("router responses serialize");
    text_response(status, "application/json", body)
}

/// An OpenAI-style error: `type` is the status's reason in snake case
/// (`service_unavailable`, `bad_gateway`, ...), `code` the status number.
pub fn error_response(status: StatusCode, message: impl Into<String>) -> Response<ResponseBody> {
    let kind = status.canonical_reason().unwrap_or("error").to_ascii_lowercase().replace(' ', "_");
    let body = json!({
        "error": { "message": message.into(), "type": kind, "code": status.as_u16() }
    });
    json_response(status, &body)
}

/// `error` and its chain of causes, joined by `: ` (hyper's own message is often only
/// "client error (Connect)", the cause says "Connection refused").
pub fn describe_error(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_have_the_openai_shape_with_a_snake_case_type() {
        let response = error_response(StatusCode::SERVICE_UNAVAILABLE, "no healthy worker");
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = body_bytes(response);
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            value,
            json!({ "error": {
                "message": "no healthy worker", "type": "service_unavailable", "code": 503
            }})
        );
    }

    /// The bytes of a response built from [`full`] (ready at once, no runtime needed).
    fn body_bytes(response: Response<ResponseBody>) -> Bytes {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(response.into_body().collect()).unwrap().to_bytes()
    }
}

//! The routing key of a request: the text whose prefix a worker's KV cache would reuse.
//!
//! | path                                   | key                                            |
//! |----------------------------------------|------------------------------------------------|
//! | `/v1/completions`                      | `prompt`                                       |
//! | `/v1/chat/completions`, `/v1/messages` | `system`, then each message's role and content |
//! | `/v1/responses`                        | `instructions`, then `input` likewise          |
//! | `/v1/embeddings`, `/pooling`           | `input`                                        |
//! | `/score`, `/v1/score`                  | `text_1`                                       |
//! | `/rerank`, `/v1/rerank`, `/v2/rerank`  | `query`                                        |
//!
//! A prompt is a string, a list of strings (the first counts), a list of token ids (their
//! decimal text joined by spaces) or a list of such lists (the first). Message content is a
//! string or a list of parts whose `text` fields are concatenated. An embedding, pooling,
//! score or rerank request without its field is keyed by its raw body. Other paths have no
//! key: they are routed by load alone.

use serde_json::Value;

/// The routing key of a JSON request body `body` sent to `path`, or `None` for a path that
/// is routed by load alone.
pub fn routing_key(path: &str, body: &Value, raw_body: &[u8]) -> Option<String> {
    match path {
        "/v1/completions" => body.get("prompt").and_then(prompt_text),
        "/v1/chat/completions" | "/v1/messages" => Some(conversation_text(
            body.get("system"),
            body.get("messages").and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]),
        )),
        "/v1/responses" => Some(responses_text(body)),
        "/v1/embeddings" | "/pooling" => field_or_raw_body(body, "input", raw_body),
        "/score" | "/v1/score" => field_or_raw_body(body, "text_1", raw_body),
        "/rerank" | "/v1/rerank" | "/v2/rerank" => field_or_raw_body(body, "query", raw_body),
        _ => None,
    }
}

/// The text of a prompt: a string, the first of a list of strings, token ids as decimal text
/// joined by spaces, or the first of a list of token-id lists.
fn prompt_text(prompt: &Value) -> Option<String> {
    match prompt {
        Value::String(text) => Some(text.clone()),
        Value::Array(items) => match items.first()? {
            Value::Number(_) => {
                Some(items.iter().map(|id| id.to_string()).collect::<Vec<String>>().join(" "))
            }
            first => prompt_text(first),
        },
        _ => None,
    }
}

/// `field` of `body` as a prompt, else the raw body as text.
fn field_or_raw_body(body: &Value, field: &str, raw_body: &[u8]) -> Option<String> {
    body.get(field)
        .and_then(prompt_text)
        .or_else(|| Some(String::from_utf8_lossy(raw_body).into_owned()))
}

/// The system prompt, then `role: content` of each message, one per line.
fn conversation_text(system: Option<&Value>, messages: &[Value]) -> String {
    let mut text = String::new();
    if let Some(system) = system {
        push_turn(&mut text, "system", &content_text(system));
    }
    for message in messages {
        match message {
            Value::String(content) => push_turn(&mut text, "user", content),
            _ => {
                let role = message.get("role").and_then(Value::as_str).unwrap_or("");
                let content = message.get("content").map(content_text).unwrap_or_default();
                push_turn(&mut text, role, &content);
            }
        }
    }
    text
}

/// The Responses API's `instructions`, then its `input`: a string, or items like messages.
fn responses_text(body: &Value) -> String {
    match body.get("input") {
        Some(Value::String(input)) => {
            let mut text = conversation_text(body.get("instructions"), &[]);
            push_turn(&mut text, "user", input);
            text
        }
        Some(Value::Array(items)) => conversation_text(body.get("instructions"), items),
        _ => conversation_text(body.get("instructions"), &[]),
    }
}

/// A message's content: a string, or the concatenated `text` of its parts.
fn content_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| match part {
                Value::String(text) => Some(text.as_str()),
                _ => part.get("text").and_then(Value::as_str),
            })
            .collect(),
        _ => String::new(),
    }
}

/// Appends one `role: content` line.
fn push_turn(text: &mut String, role: &str, content: &str) {
    text.push_str(role);
    text.push_str(": ");
    text.push_str(content);
    text.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The key of `body` sent to `path`.
    fn key(path: &str, body: Value) -> Option<String> {
        let raw_body = body.to_string();
        routing_key(path, &body, raw_body.as_bytes())
    }

    #[test]
    fn completion_prompts_are_keyed_by_their_text_or_their_first_entry() {
        let key_of = |prompt: Value| key("/v1/completions", json!({ "prompt": prompt }));
        assert_eq!(key_of(json!("Once upon")), Some("Once upon".into()));
        assert_eq!(key_of(json!(["first", "second"])), Some("first".into()));
        assert_eq!(key_of(json!([101, 7, 2023])), Some("101 7 2023".into()));
        assert_eq!(key_of(json!([[1, 2], [3]])), Some("1 2".into()));
        assert_eq!(key_of(json!([])), None);
        assert_eq!(key("/v1/completions", json!({ "model": "m" })), None);
    }

    #[test]
    fn chat_messages_are_keyed_by_role_and_content_in_order() {
        let body = json!({
            "messages": [
                { "role": "system", "content": "Be brief." },
                { "role": "user", "content": [
                    { "type": "text", "text": "Look at " },
                    { "type": "image_url", "image_url": { "url": "http://x" } },
                    { "type": "text", "text": "this." }
                ]}
            ]
        });
        assert_eq!(
            key("/v1/chat/completions", body),
            Some("system: Be brief.\nuser: Look at this.\n".into())
        );
    }

    #[test]
    fn anthropic_messages_put_the_system_field_first() {
        let body = json!({
            "system": [{ "type": "text", "text": "You are terse." }],
            "messages": [{ "role": "user", "content": "Hi" }]
        });
        assert_eq!(key("/v1/messages", body), Some("system: You are terse.\nuser: Hi\n".into()));
    }

    #[test]
    fn responses_put_the_instructions_before_the_input() {
        let text_input = json!({ "instructions": "Answer in French.", "input": "Hello" });
        assert_eq!(
            key("/v1/responses", text_input),
            Some("system: Answer in French.\nuser: Hello\n".into())
        );
        let item_input = json!({
            "input": [{ "role": "user", "content": [{ "type": "input_text", "text": "Hi" }] }]
        });
        assert_eq!(key("/v1/responses", item_input), Some("user: Hi\n".into()));
    }

    #[test]
    fn pooling_requests_use_their_text_field_or_else_the_raw_body() {
        assert_eq!(key("/v1/embeddings", json!({ "input": ["a", "b"] })), Some("a".into()));
        assert_eq!(key("/score", json!({ "text_1": "q", "text_2": ["d"] })), Some("q".into()));
        assert_eq!(
            key("/v2/rerank", json!({ "query": "q", "documents": ["d"] })),
            Some("q".into())
        );
        assert_eq!(key("/pooling", json!({ "other": 1 })), Some(r#"{"other":1}"#.into()));
    }

    #[test]
    fn other_paths_have_no_key() {
        assert_eq!(key("/tokenize", json!({ "prompt": "x" })), None);
        assert_eq!(key("/v1/models", json!({})), None);
    }
}

//! Strict JSON reading, in words a user can act on: what is wrong with a document
//! (empty, truncated, not JSON, the wrong shape). Pure: the shared directory's readers
//! (`store`) and the protocol core's journal parser both use it.

use serde::de::DeserializeOwned;

/// What is wrong with a JSON document, in words a user can act on: empty, truncated
/// (ends mid-record), not JSON at all, or JSON of the wrong shape (a missing or mistyped
/// field).
pub fn describe_json_error(bytes: &[u8], e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    if bytes.iter().all(|b| b.is_ascii_whitespace()) {
        return if bytes.is_empty() {
            "it is empty (0 bytes)".to_string()
        } else {
            format!("it holds only whitespace ({} bytes)", bytes.len())
        };
    }
    match e.classify() {
        Category::Eof => format!(
            "it is truncated: the JSON ends early at line {} column {} ({} bytes)",
            e.line(),
            e.column(),
            bytes.len()
        ),
        Category::Syntax => format!(
            "it is not valid JSON (line {} column {}: {})",
            e.line(),
            e.column(),
            strip_position(&e.to_string())
        ),
        Category::Data => format!(
            "it is JSON of the wrong shape: {}",
            strip_position(&e.to_string())
        ),
        Category::Io => e.to_string(),
    }
}

fn strip_position(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg.to_string(),
    }
}

/// Parse a state document: first as JSON (empty, truncated, garbage), then into `T`
/// (wrong shape), so each kind of damage is named as what it is.
pub fn parse_strict<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| describe_json_error(bytes, &e))?;
    serde_json::from_value(value).map_err(|e| {
        format!(
            "it is JSON of the wrong shape: {}",
            strip_position(&e.to_string())
        )
    })
}

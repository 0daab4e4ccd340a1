//! The filter's configuration: the JSON string of Envoy's `filter_config`, read once when Envoy
//! loads it.

use std::fmt;

use serde_json::{Map, Value};
use tower_bypass_marker::json::DEFAULT_MAX_BODY_BYTES;
use tower_bypass_marker::sans_io::RequestGuard;
use tower_bypass_marker::{BypassMarkerLayer, NonJsonBodies, Overflow};

use crate::log_limit::LogLimit;
use crate::metrics::Tally;

/// The keys a configuration may have: the naming flags of `bypass-marker ext-proc`.
const KEYS: [&str; 7] = [
    "preset",
    "opt-in",
    "router-owned",
    "never-forward",
    "sdk-safe",
    "non-json-bodies",
    "max-body",
];

/// A configuration Envoy loaded: the layer its streams filter with and the guard's limit.
#[derive(Debug, Clone)]
pub struct FilterConfig {
    layer: BypassMarkerLayer,
    guard: RequestGuard,
    refusal_lines: std::sync::Arc<LogLimit>,
}

/// Why a configuration was refused: the field, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    field: Option<String>,
    message: String,
}

impl ConfigError {
    fn field(field: &str, message: impl Into<String>) -> Self {
        Self {
            field: Some(field.to_owned()),
            message: message.into(),
        }
    }

    /// The key at fault, if the error is about one.
    pub fn key(&self) -> Option<&str> {
        self.field.as_deref()
    }

    /// What is wrong, without the key.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.field {
            Some(field) => write!(f, "filter_config field \"{field}\": {}", self.message),
            None => write!(f, "filter_config: {}", self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

impl FilterConfig {
    /// Reads `filter_config`: a JSON object with the keys of `bypass-marker ext-proc`'s naming
    /// flags, or an empty string (as `{}`: the Dynamo preset, a 32 MiB body limit). Unknown keys,
    /// wrong types, unknown presets and invalid names are errors that name the key.
    pub fn parse(text: &[u8]) -> Result<Self, ConfigError> {
        let object = if text.iter().all(u8::is_ascii_whitespace) {
            Map::new()
        } else {
            match serde_json::from_slice::<Value>(text) {
                Ok(Value::Object(object)) => object,
                Ok(_) => {
                    return Err(ConfigError {
                        field: None,
                        message: "must be a JSON object".to_owned(),
                    })
                }
                Err(err) => {
                    return Err(ConfigError {
                        field: None,
                        message: format!("not JSON: {err}"),
                    })
                }
            }
        };
        if let Some(key) = object.keys().find(|key| !KEYS.contains(&key.as_str())) {
            return Err(ConfigError::field(
                key,
                format!("unknown key; the keys are {}", KEYS.join(", ")),
            ));
        }
        let mut layer = match object.get("preset") {
            None => BypassMarkerLayer::dynamo(),
            Some(Value::String(preset)) if preset == "dynamo" => BypassMarkerLayer::dynamo(),
            Some(Value::String(preset)) if preset == "none" => BypassMarkerLayer::new(),
            Some(other) => {
                return Err(ConfigError::field(
                    "preset",
                    format!("unknown preset {other}; the presets are \"dynamo\" and \"none\""),
                ))
            }
        };
        for name in names(&object, "opt-in")? {
            layer = layer
                .try_opt_in(name)
                .map_err(|err| ConfigError::field("opt-in", err.to_string()))?;
        }
        for name in names(&object, "router-owned")? {
            layer = layer
                .try_router_owned(name)
                .map_err(|err| ConfigError::field("router-owned", err.to_string()))?;
        }
        for name in names(&object, "never-forward")? {
            layer = layer
                .try_never_forward(name)
                .map_err(|err| ConfigError::field("never-forward", err.to_string()))?;
        }
        let sdk_safe = match object.get("sdk-safe") {
            None => false,
            Some(Value::Bool(on)) => *on,
            Some(_) => return Err(ConfigError::field("sdk-safe", "must be true or false")),
        };
        let non_json = match object.get("non-json-bodies").map(Value::as_str) {
            None | Some(Some("forward")) => NonJsonBodies::Forward,
            Some(Some("judge")) => NonJsonBodies::Judge,
            Some(Some("refuse")) => NonJsonBodies::Refuse,
            Some(_) => {
                return Err(ConfigError::field(
                    "non-json-bodies",
                    "must be \"forward\", \"judge\" or \"refuse\"",
                ))
            }
        };
        let max_body = match object.get("max-body") {
            None => DEFAULT_MAX_BODY_BYTES,
            Some(value) => {
                let n = value.as_u64().ok_or_else(|| {
                    ConfigError::field("max-body", "must be a whole number of bytes")
                })?;
                usize::try_from(n).map_err(|_| {
                    ConfigError::field(
                        "max-body",
                        format!(
                            "{n} bytes is more than this build can address ({} bytes at most)",
                            usize::MAX
                        ),
                    )
                })?
            }
        };
        // Memory per stream is bounded by the layer's frame limit; past it the stream is reset
        // rather than the frame forwarded unfiltered.
        let layer = layer
            .sdk_safe(sdk_safe)
            .non_json_bodies(non_json)
            .on_overflow(Overflow::Error);
        Ok(Self::new(layer, max_body))
    }

    /// A configuration with this layer and request body limit, its frames counted in Envoy's
    /// stats ([`Tally`]).
    pub fn new(layer: BypassMarkerLayer, max_body: usize) -> Self {
        let layer = layer.observe(std::sync::Arc::new(Tally));
        Self {
            guard: layer.request_guard().max_body_bytes(max_body),
            layer,
            refusal_lines: std::sync::Arc::new(LogLimit::new(60)),
        }
    }

    /// The limit on the refusals' log lines, shared by the streams of this configuration: one
    /// line a minute.
    pub fn refusal_lines(&self) -> std::sync::Arc<LogLimit> {
        std::sync::Arc::clone(&self.refusal_lines)
    }

    /// The layer the streams filter responses with.
    pub fn layer(&self) -> &BypassMarkerLayer {
        &self.layer
    }

    /// The guard the streams judge requests with.
    pub fn guard(&self) -> &RequestGuard {
        &self.guard
    }
}

/// The names under `key`: an array of strings.
fn names<'a>(object: &'a Map<String, Value>, key: &str) -> Result<Vec<&'a str>, ConfigError> {
    match object.get(key) {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| {
                item.as_str()
                    .ok_or_else(|| ConfigError::field(key, "must be an array of strings"))
            })
            .collect(),
        Some(_) => Err(ConfigError::field(key, "must be an array of strings")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower_bypass_marker::sans_io::HeadDecision;

    #[test]
    fn empty_and_empty_object_are_the_dynamo_preset() {
        for text in ["", "  ", "{}"] {
            let config = FilterConfig::parse(text.as_bytes()).unwrap();
            let names: Vec<_> = config.layer().names().collect();
            let dynamo: Vec<_> = BypassMarkerLayer::dynamo()
                .names()
                .map(String::from)
                .collect();
            assert_eq!(names, dynamo, "{text:?}");
            assert_eq!(config.guard().max_body(), DEFAULT_MAX_BODY_BYTES);
        }
    }

    #[test]
    fn every_key_is_read() {
        let config = FilterConfig::parse(
            br#"{"preset":"none","opt-in":["a"],"router-owned":["b"],"never-forward":["c"],
                 "sdk-safe":true,"non-json-bodies":"refuse","max-body":1024}"#,
        )
        .unwrap();
        let mut text = http::HeaderMap::new();
        text.insert(http::header::CONTENT_TYPE, "text/plain".parse().unwrap());
        let read = config.guard().check_head(&text, false);
        assert!(matches!(read, HeadDecision::Read), "{read:?}");
        let default = FilterConfig::parse(b"{}").unwrap();
        let skip = default.guard().check_head(&text, false);
        assert!(matches!(skip, HeadDecision::Skip), "{skip:?}");
        let names: Vec<_> = config.layer().names().collect();
        for name in ["x-bypass-remote-prefill", "a", "b", "c"] {
            assert!(names.contains(&name), "{name} in {names:?}");
        }
        assert!(!names.contains(&"request_id"));
        assert_eq!(config.guard().max_body(), 1024);
    }

    #[test]
    fn bad_configurations_name_their_key() {
        for (text, key) in [
            (r#"{"presets":"dynamo"}"#, Some("presets")),
            (r#"{"preset":"vllm"}"#, Some("preset")),
            (r#"{"preset":1}"#, Some("preset")),
            (r#"{"opt-in":"request_id"}"#, Some("opt-in")),
            (r#"{"opt-in":[1]}"#, Some("opt-in")),
            (r#"{"router-owned":["bad:name"]}"#, Some("router-owned")),
            (r#"{"never-forward":[""]}"#, Some("never-forward")),
            (r#"{"sdk-safe":"yes"}"#, Some("sdk-safe")),
            (r#"{"non-json-bodies":"deny"}"#, Some("non-json-bodies")),
            (r#"{"non-json-bodies":true}"#, Some("non-json-bodies")),
            (r#"{"max-body":-1}"#, Some("max-body")),
            (r#"{"max-body":1.5}"#, Some("max-body")),
            (r#"["dynamo"]"#, None),
            (r#"{"preset":"#, None),
        ] {
            let err = FilterConfig::parse(text.as_bytes()).unwrap_err();
            assert_eq!(err.key(), key, "{text}: {err}");
            if let Some(key) = key {
                assert!(err.to_string().contains(key), "{err}");
            }
        }
    }
}

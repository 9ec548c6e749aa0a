//! Parsing of an OpenAI-style `/v1/models` answer as vLLM gives it: base models have
//! no `parent`, LoRA adapters name their base model in `parent`.

use std::collections::HashMap;

use serde::Deserialize;

use crate::fleet::ServedModels;

#[derive(Debug, thiserror::Error)]
#[error("invalid /v1/models answer: {0}")]
pub struct ModelsError(#[from] serde_json::Error);

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
    #[serde(default)]
    parent: Option<String>,
}

pub fn parse_models(body: &[u8]) -> Result<ServedModels, ModelsError> {
    let list: ModelList = serde_json::from_slice(body)?;
    let mut base = Vec::new();
    let mut adapters = HashMap::new();
    for entry in list.data {
        match entry.parent {
            Some(parent) if parent != entry.id => {
                adapters.insert(entry.id, parent);
            }
            _ => base.push(entry.id),
        }
    }
    base.sort();
    base.dedup();
    Ok(ServedModels { base, adapters })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_with_a_parent_are_adapters_of_it() {
        let body = br#"{"object":"list","data":[
            {"id":"meta-llama/Llama-3.1-8B","object":"model","root":"meta-llama/Llama-3.1-8B","parent":null},
            {"id":"sql-lora","object":"model","root":"/adapters/sql","parent":"meta-llama/Llama-3.1-8B"}]}"#;
        let models = parse_models(body).expect("valid");
        assert_eq!(models.base, vec!["meta-llama/Llama-3.1-8B".to_string()]);
        assert_eq!(
            models.adapters.get("sql-lora").map(String::as_str),
            Some("meta-llama/Llama-3.1-8B")
        );
        assert!(models.serves("sql-lora") && models.is_adapter("sql-lora"));
    }

    #[test]
    fn an_answer_without_data_is_an_error() {
        assert!(parse_models(br#"{"object":"list"}"#).is_err());
        assert!(parse_models(b"<html>").is_err());
    }
}

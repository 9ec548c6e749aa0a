//! Prompts tokenized on a pod's own `POST /tokenize`: vLLM applies the same template and
//! special-token rules as for the completion itself, so the tokens are right by
//! construction, for any model, without a tokenizer in kvroute. The price is one HTTP
//! round trip per request before it is placed (measured in `docs/kv-events.md`), bounded
//! by a timeout after which the request is placed on the approximate index alone. Pods
//! that speak HTTPS (`--pod-ca-bundle`) are asked over TLS, trusting the same CAs as
//! their scrapes.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use hyper::{Request, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::Deserialize;
use serde_json::value::RawValue;
use tokio_rustls::TlsConnector;

use kvroute_core::request::ApiKind;

use crate::scrape::{ApiKey, PodStream, open_pod_stream};

/// Why a prompt was not tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("HTTP: {0}")]
    Http(String),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("answered HTTP {0}")]
    Status(u16),
    #[error("unexpected answer: {0}")]
    Answer(String),
}

impl TokenizeError {
    /// A bounded label value for the tokenization counter.
    pub fn kind(&self) -> &'static str {
        match self {
            TokenizeError::Http(_) => "http",
            TokenizeError::Timeout(_) => "timeout",
            TokenizeError::Status(_) => "status",
            TokenizeError::Answer(_) => "answer",
        }
    }
}

/// The request fields that decide a prompt's tokens, borrowed from the body as raw JSON.
#[derive(Deserialize)]
struct PromptFields<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
    #[serde(borrow)]
    chat_template: Option<&'a RawValue>,
    #[serde(borrow)]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(borrow)]
    add_generation_prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    continue_final_message: Option<&'a RawValue>,
    #[serde(borrow)]
    documents: Option<&'a RawValue>,
    #[serde(borrow)]
    add_special_tokens: Option<&'a RawValue>,
}

/// The `/tokenize` body for an inference request's `body`, or `None` when its prompt is
/// not one text to tokenize (a batch, token ids, another API, a body that does not
/// parse: those are matched on the approximate index alone).
///
/// The fields are copied as the client sent them, so the pod renders exactly what it
/// would render for the request itself.
pub fn tokenize_body(api: ApiKind, body: &[u8]) -> Option<Vec<u8>> {
    let fields: PromptFields<'_> = serde_json::from_slice(body).ok()?;
    let model = fields.model?;
    let mut out = Vec::with_capacity(body.len().min(1 << 20) + 64);
    out.extend_from_slice(b"{\"model\":");
    out.extend_from_slice(model.get().as_bytes());
    match api {
        ApiKind::Completions => {
            let prompt = fields.prompt?;
            // One string: a batch or token ids are not one sequence's text.
            if !prompt.get().starts_with('"') {
                return None;
            }
            out.extend_from_slice(b",\"prompt\":");
            out.extend_from_slice(prompt.get().as_bytes());
            copy_fields(
                &mut out,
                &[("add_special_tokens", fields.add_special_tokens)],
            );
        }
        ApiKind::ChatCompletions => {
            let messages = fields.messages?;
            out.extend_from_slice(b",\"messages\":");
            out.extend_from_slice(messages.get().as_bytes());
            copy_fields(
                &mut out,
                &[
                    ("tools", fields.tools),
                    ("chat_template", fields.chat_template),
                    ("chat_template_kwargs", fields.chat_template_kwargs),
                    ("add_generation_prompt", fields.add_generation_prompt),
                    ("continue_final_message", fields.continue_final_message),
                    ("documents", fields.documents),
                    ("add_special_tokens", fields.add_special_tokens),
                ],
            );
        }
        ApiKind::Other => return None,
    }
    out.push(b'}');
    Some(out)
}

/// Appends each field the client set (not `null`) to the JSON object being written.
fn copy_fields(out: &mut Vec<u8>, fields: &[(&str, Option<&RawValue>)]) {
    for (name, value) in fields {
        if let Some(value) = value.filter(|v| v.get() != "null") {
            out.push(b',');
            out.extend_from_slice(format!("\"{name}\":").as_bytes());
            out.extend_from_slice(value.get().as_bytes());
        }
    }
}

/// vLLM's `/tokenize` answer (the fields kvroute reads).
#[derive(Deserialize)]
struct Tokenized {
    tokens: Vec<u32>,
}

/// Largest `/tokenize` answer read: 8 bytes a token for a million tokens.
const MAX_ANSWER_BYTES: usize = 8 << 20;

/// Tokenizes prompts on the pods, over pooled keep-alive connections.
#[derive(Debug, Clone)]
pub struct PodTokenizer {
    client: Client<PodConnector, Full<Bytes>>,
    /// `https` where the pods speak TLS, else `http`.
    scheme: &'static str,
    timeout: Duration,
    api_key: Option<ApiKey>,
}

impl PodTokenizer {
    /// `tls`: the pods speak HTTPS and are trusted by this connector (the scrapes' own,
    /// from `--pod-ca-bundle`); `None`: plain HTTP.
    pub fn new(timeout: Duration, api_key: Option<ApiKey>, tls: Option<TlsConnector>) -> Self {
        let scheme = if tls.is_some() { "https" } else { "http" };
        PodTokenizer {
            client: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .build(PodConnector { tls }),
            scheme,
            timeout,
            api_key,
        }
    }

    /// How long one tokenization may take.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The token ids `pod` gives the prompt of `body` (a [`tokenize_body`]).
    pub async fn tokenize(
        &self,
        pod: SocketAddr,
        body: Vec<u8>,
    ) -> Result<Vec<u32>, TokenizeError> {
        match tokio::time::timeout(self.timeout, self.ask(pod, body)).await {
            Ok(result) => result,
            Err(_) => Err(TokenizeError::Timeout(self.timeout)),
        }
    }

    async fn ask(&self, pod: SocketAddr, body: Vec<u8>) -> Result<Vec<u32>, TokenizeError> {
        let mut request = Request::post(format!("{}://{pod}/tokenize", self.scheme))
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| TokenizeError::Http(e.to_string()))?;
        if let Some(ApiKey(key)) = &self.api_key
            && let Ok(value) = HeaderValue::from_str(&format!("Bearer {key}"))
        {
            request.headers_mut().insert(AUTHORIZATION, value);
        }
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| TokenizeError::Http(e.to_string()))?;
        let status = response.status();
        if !status.is_success() {
            return Err(TokenizeError::Status(status.as_u16()));
        }
        let bytes = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| TokenizeError::Http(e.to_string()))?
            .to_bytes();
        let answer: Tokenized =
            serde_json::from_slice(&bytes).map_err(|e| TokenizeError::Answer(e.to_string()))?;
        Ok(answer.tokens)
    }
}

/// The tokenizer's connections, opened as the scrapes open theirs (TCP to the pod, TLS
/// over it where the pods speak HTTPS, the pod named by its IP): hyper's pooled client
/// takes any connector. The tokenization's timeout bounds the opening.
#[derive(Clone)]
struct PodConnector {
    tls: Option<TlsConnector>,
}

impl std::fmt::Debug for PodConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodConnector")
            .field("https", &self.tls.is_some())
            .finish()
    }
}

type ConnectError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<Uri> for PodConnector {
    type Response = TokioIo<Box<dyn PodStream>>;
    type Error = ConnectError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ConnectError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ConnectError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tls = self.tls.clone();
        // The URI is [`PodTokenizer::ask`]'s, made from the pod's address.
        let endpoint = uri
            .authority()
            .and_then(|a| a.as_str().parse::<SocketAddr>().ok());
        Box::pin(async move {
            let endpoint = endpoint.ok_or("a pod is asked by its IP address and port")?;
            Ok(TokioIo::new(open_pod_stream(endpoint, tls.as_ref()).await?))
        })
    }
}

impl Connection for Box<dyn PodStream> {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(api: ApiKind, json: &str) -> Option<String> {
        tokenize_body(api, json.as_bytes()).map(|b| String::from_utf8(b).expect("utf-8"))
    }

    #[test]
    fn a_completion_keeps_its_model_and_prompt_only() {
        let got = body(
            ApiKind::Completions,
            r#"{"model":"m","prompt":"Hello \"you\"","max_tokens":9,"stream":true}"#,
        );
        assert_eq!(
            got.as_deref(),
            Some(r#"{"model":"m","prompt":"Hello \"you\""}"#)
        );
    }

    #[test]
    fn a_chat_keeps_what_its_template_renders() {
        let got = body(
            ApiKind::ChatCompletions,
            r#"{"model":"m","temperature":0,"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}],"chat_template_kwargs":null,"add_generation_prompt":false}"#,
        );
        assert_eq!(
            got.as_deref(),
            Some(
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}],"add_generation_prompt":false}"#
            )
        );
    }

    #[test]
    fn the_clients_special_token_choice_is_forwarded() {
        let got = body(
            ApiKind::Completions,
            r#"{"model":"m","prompt":"x","add_special_tokens":false}"#,
        );
        assert_eq!(
            got.as_deref(),
            Some(r#"{"model":"m","prompt":"x","add_special_tokens":false}"#)
        );
    }

    #[test]
    fn prompts_that_are_not_one_text_are_not_tokenized() {
        assert_eq!(
            body(ApiKind::Completions, r#"{"model":"m","prompt":["a","b"]}"#),
            None
        );
        assert_eq!(
            body(ApiKind::Completions, r#"{"model":"m","prompt":[1,2,3]}"#),
            None
        );
        assert_eq!(body(ApiKind::Completions, r#"{"prompt":"no model"}"#), None);
        assert_eq!(body(ApiKind::ChatCompletions, r#"{"model":"m"}"#), None);
        assert_eq!(body(ApiKind::Other, r#"{"model":"m","input":"x"}"#), None);
        assert_eq!(body(ApiKind::Completions, "{not json"), None);
    }
}

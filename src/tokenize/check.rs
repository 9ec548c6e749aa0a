//! `kvroute tokenize`: a request body's prompt tokenized as kvroute tokenizes it with
//! `--tokenizer`, and, with `--pod`, compared with the tokens the engine itself makes of
//! it (its `POST /tokenize`). A tokenizer directory that disagrees with the engine makes
//! precise prefix routing miss without an error anywhere (the blocks' hashes differ), so
//! an operator checks the directory against a serving pod before rolling it out.

use std::io::Read;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use serde_json::{Value, json};

use kvroute_core::request::ApiKind;

use super::{LocalTokenizer, PodTokenizer, TokenizeError, Unsupported, tokenize_body};
use crate::scrape::ApiKey;

/// How many tokens on each side of the first difference are shown.
const CONTEXT_TOKENS: usize = 8;

/// `kvroute tokenize`'s arguments.
#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// The model's Hugging Face directory, as given to `kvroute serve --tokenizer`.
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// The request body (an OpenAI chat or completion request, JSON); `-` reads stdin.
    #[arg(default_value = "-", conflicts_with = "probes")]
    pub body: PathBuf,
    /// Instead of one body, a built-in set of requests of every shape kvroute renders
    /// (a system message, several turns, text parts, no generation prompt, a name, an
    /// assistant's reasoning, `enable_thinking` off, Unicode, tools, a tool call and its
    /// result, tool calls without tools, documents, a continued final message,
    /// completions with and without special tokens) for this model, each compared with
    /// the pod's tokens: one JSON line each, then a summary line.
    #[arg(long, value_name = "MODEL", requires = "pod")]
    pub probes: Option<String>,
    /// The API the body is for; by default `chat` when it has `messages`, else
    /// `completions`.
    #[arg(long, value_enum)]
    pub api: Option<Api>,
    /// A serving pod (`HOST:PORT` of vLLM's HTTP server) whose `/tokenize` the tokens
    /// are compared with; the command fails when they differ.
    #[arg(long)]
    pub pod: Option<String>,
    /// PEM CA bundle trusted for a pod that speaks HTTPS (as `serve --pod-ca-bundle`).
    #[arg(long)]
    pub pod_ca_bundle: Option<PathBuf>,
    /// Bearer token for the pod, when vLLM runs with --api-key.
    #[arg(long, env = "KVROUTE_POD_API_KEY", hide_env_values = true)]
    pub pod_api_key: Option<String>,
    /// Give up on the pod after this long.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Print the prompt text the template rendered, as well as its token ids.
    #[arg(long)]
    pub text: bool,
}

/// `--api`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Api {
    Chat,
    Completions,
}

/// What the command found: printed as JSON; `Ok(false)` when the pod disagreed.
pub async fn tokenize(args: TokenizeArgs) -> anyhow::Result<bool> {
    // Nothing is remembered between runs of one prompt: no cache.
    let tokenizer = LocalTokenizer::load(&args.tokenizer, 0)?;
    let pod = args
        .pod
        .as_deref()
        .map(|pod| Pod::new(&args, pod))
        .transpose()?;
    if let Some(model) = &args.probes {
        let (mut differing, mut refused) = (Vec::new(), Vec::new());
        let all = probes(model);
        for (name, body) in &all {
            let api = api_of(body)?;
            let body = serde_json::to_vec(body)?;
            let (mut report, agrees) =
                compare(&tokenizer, pod.as_ref(), args.text, api, &body).await?;
            if report["pod"].get("refused").is_some() {
                refused.push(*name);
            }
            report.insert("probe".into(), json!(name));
            println!("{}", serde_json::to_string(&report)?);
            if !agrees {
                differing.push(*name);
            }
        }
        println!(
            "{}",
            json!({ "probes": all.len(), "differing": differing, "pod_refused": refused })
        );
        return Ok(differing.is_empty());
    }
    let body = read_body(&args.body)?;
    let api = match args.api {
        Some(Api::Chat) => ApiKind::ChatCompletions,
        Some(Api::Completions) => ApiKind::Completions,
        None => infer_api(&body)?,
    };
    let (report, agrees) = compare(&tokenizer, pod.as_ref(), args.text, api, &body).await?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(agrees)
}

/// The requests `--probes` sends for `model`: each shape of request kvroute renders.
fn probes(model: &str) -> Vec<(&'static str, Value)> {
    let chat = |messages: Value| json!({ "model": model, "messages": messages });
    let user = |text: &str| json!({ "role": "user", "content": text });
    let tools = json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }}]);
    vec![
        (
            "one message",
            chat(json!([user("What does a KV cache hold?")])),
        ),
        (
            "system and user",
            chat(json!([
                {"role": "system", "content": "You are a careful assistant.\nAnswer in one line."},
                user("What does a KV cache hold?"),
            ])),
        ),
        (
            "several turns",
            chat(json!([
                {"role": "system", "content": "You are a careful assistant."},
                user("What does a KV cache hold?"),
                {"role": "assistant", "content": "The attention keys and values of the tokens seen so far."},
                user("  And why does it fill up?  \n"),
            ])),
        ),
        (
            "text parts",
            chat(json!([{"role": "user", "content": [
                {"type": "text", "text": "First part."},
                {"type": "text", "text": "Second part."},
            ]}])),
        ),
        ("no generation prompt", {
            let mut body = chat(json!([
                user("Hi"),
                {"role": "assistant", "content": "Hello!"},
            ]));
            body["add_generation_prompt"] = json!(false);
            body
        }),
        (
            "a name",
            chat(json!([{"role": "user", "name": "ann", "content": "Hi, I am Ann."}])),
        ),
        (
            "an assistant's reasoning",
            chat(json!([
                user("2 + 2?"),
                {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
                user("3 + 3?"),
            ])),
        ),
        ("thinking off", {
            let mut body = chat(json!([user("Hi")]));
            body["chat_template_kwargs"] = json!({"enable_thinking": false});
            body
        }),
        (
            "unicode and braces",
            chat(json!([user(
                "Ünïcödé, 日本語, {{ not a template }} {% neither %}"
            )])),
        ),
        ("tools", {
            let mut body = chat(json!([user("What is the weather in Paris?")]));
            body["tools"] = tools.clone();
            body
        }),
        ("a tool call and its result", {
            let mut body = chat(json!([
                user("What is the weather in Paris?"),
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call9abcd", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call9abcd", "content": "18 degrees, cloudy"},
            ]));
            body["tools"] = tools.clone();
            body
        }),
        (
            "tool calls without tools",
            chat(json!([
                user("What is the weather in Paris?"),
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call9abcd", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call9abcd", "content": "18 degrees"},
                {"role": "assistant", "content": "It is 18 degrees."},
                user("Thanks."),
            ])),
        ),
        ("documents", {
            let mut body = chat(json!([user("How often are pods scraped?")]));
            body["documents"] = json!([
                {"title": "Scrapes", "text": "Every pod is scraped every 50 ms."},
                {"title": "Routing", "text": "Envoy asks kvroute for each request."},
            ]);
            body
        }),
        ("a continued final message", {
            let mut body = chat(json!([
                user("Name a color."),
                {"role": "assistant", "content": "The color is "},
            ]));
            body["continue_final_message"] = json!(true);
            body["add_generation_prompt"] = json!(false);
            body
        }),
        (
            "completion",
            json!({ "model": model, "prompt": "The KV cache of every pod is scraped every 50 ms." }),
        ),
        (
            "completion without special tokens",
            json!({ "model": model, "prompt": "The KV cache of every pod.", "add_special_tokens": false }),
        ),
    ]
}

/// `body`'s prompt tokenized here and, with a `pod`, on it: the report (the rendered
/// text in it where `text`), and whether the two agree (true without a pod, or where
/// kvroute would ask one anyway).
async fn compare(
    tokenizer: &LocalTokenizer,
    pod: Option<&Pod>,
    text: bool,
    api: ApiKind,
    body: &[u8],
) -> anyhow::Result<(serde_json::Map<String, Value>, bool)> {
    let local = tokenizer
        .prompt_text(api, body)
        .and_then(|(text, special)| {
            let ids = tokenizer.encode_prompt(&text, special)?;
            Ok((text, special, ids))
        });
    let mut report = serde_json::Map::new();
    report.insert("api".into(), json!(api_name(api)));
    report.insert("local".into(), local_report(&local, text));
    let Some(pod) = pod else {
        return Ok((report, true));
    };
    let pod_ids = match pod.tokenize(api, body).await? {
        Ok(ids) => ids,
        Err(status) => {
            // The engine fails such a request whatever kvroute matched: nothing to
            // compare (kvroute refusing too, or rendering what is never served).
            report.insert("pod".into(), json!({ "refused": status }));
            return Ok((report, true));
        }
    };
    report.insert(
        "pod".into(),
        json!({ "tokens": pod_ids.len(), "ids": pod_ids }),
    );
    let agrees = match &local {
        Ok((_, _, ids)) => {
            let difference = first_difference(ids, &pod_ids);
            report.insert("agrees".into(), json!(difference.is_none()));
            if let Some(at) = difference {
                report.insert(
                    "first_difference".into(),
                    difference_report(tokenizer, ids, &pod_ids, at),
                );
            }
            difference.is_none()
        }
        // Nothing to compare: kvroute asks a pod for this request, so it cannot disagree.
        Err(_) => true,
    };
    Ok((report, agrees))
}

fn read_body(path: &PathBuf) -> anyhow::Result<Vec<u8>> {
    let mut body = Vec::new();
    if path.as_os_str() == "-" {
        std::io::stdin()
            .read_to_end(&mut body)
            .context("cannot read the request body from stdin")?;
    } else {
        body = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    }
    Ok(body)
}

/// [`api_of`] the request body `body`.
fn infer_api(body: &[u8]) -> anyhow::Result<ApiKind> {
    api_of(&serde_json::from_slice(body).context("the body is not JSON")?)
}

/// `chat` for a body with `messages`, `completions` for one with `prompt`.
fn api_of(value: &Value) -> anyhow::Result<ApiKind> {
    if value.get("messages").is_some() {
        Ok(ApiKind::ChatCompletions)
    } else if value.get("prompt").is_some() {
        Ok(ApiKind::Completions)
    } else {
        bail!("the body has neither `messages` nor `prompt`: name its API with --api")
    }
}

fn api_name(api: ApiKind) -> &'static str {
    match api {
        ApiKind::ChatCompletions => "chat",
        ApiKind::Completions => "completions",
        ApiKind::Other => "other",
    }
}

/// The local result: the tokens (and the text), or why kvroute leaves the prompt to a
/// pod's `/tokenize`.
fn local_report(local: &Result<(String, bool, Vec<u32>), Unsupported>, text: bool) -> Value {
    match local {
        Ok((rendered, add_special_tokens, ids)) => {
            let mut out = json!({
                "tokens": ids.len(),
                "add_special_tokens": add_special_tokens,
                "ids": ids,
            });
            if text {
                out["text"] = json!(rendered);
            }
            out
        }
        Err(unsupported) => json!({
            "asks_a_pod": unsupported.to_string(),
            "kind": unsupported.kind(),
        }),
    }
}

/// The pod `--pod` names, resolved and with its client (its CA bundle read) once for
/// every request the command compares.
struct Pod {
    name: String,
    address: SocketAddr,
    client: PodTokenizer,
}

impl Pod {
    fn new(args: &TokenizeArgs, pod: &str) -> anyhow::Result<Pod> {
        let tls = args
            .pod_ca_bundle
            .as_deref()
            .map(crate::scrape::tls_connector)
            .transpose()?;
        Ok(Pod {
            name: pod.to_owned(),
            address: resolve(pod)?,
            client: PodTokenizer::new(args.timeout, args.pod_api_key.clone().map(ApiKey), tls),
        })
    }

    /// The pod's tokens for the body, asked as the gateway asks (the same `/tokenize`
    /// body), or the status with which it refused the request (its template's own
    /// refusal: a role it does not support, roles out of order); an error where it
    /// could not be asked.
    async fn tokenize(&self, api: ApiKind, body: &[u8]) -> anyhow::Result<Result<Vec<u32>, u16>> {
        let request = tokenize_body(api, body).context(
            "the body's prompt is not one text to tokenize (a batch, token ids, or no `model`)",
        )?;
        match self.client.tokenize(self.address, request).await {
            Ok(ids) => Ok(Ok(ids)),
            Err(TokenizeError::Status(status)) if (400..500).contains(&status) => Ok(Err(status)),
            Err(error) => Err(error)
                .with_context(|| format!("the pod at {} did not tokenize the prompt", self.name)),
        }
    }
}

fn resolve(pod: &str) -> anyhow::Result<SocketAddr> {
    pod.to_socket_addrs()
        .with_context(|| format!("--pod {pod}: not HOST:PORT"))?
        .next()
        .with_context(|| format!("--pod {pod}: resolves to no address"))
}

/// Where two token sequences first differ (one ending early counts), if they do.
pub(crate) fn first_difference(local: &[u32], pod: &[u32]) -> Option<usize> {
    let common = local.iter().zip(pod).take_while(|(a, b)| a == b).count();
    (common < local.len().max(pod.len())).then_some(common)
}

/// Both sides' tokens around `at`, with their text.
pub(crate) fn difference_report(
    tokenizer: &LocalTokenizer,
    local: &[u32],
    pod: &[u32],
    at: usize,
) -> Value {
    let window = |ids: &[u32]| {
        let start = at.saturating_sub(CONTEXT_TOKENS).min(ids.len());
        let end = (at + CONTEXT_TOKENS).min(ids.len());
        let ids = &ids[start..end];
        json!({ "from": start, "ids": ids, "text": tokenizer.decode(ids) })
    };
    json!({ "at": at, "local": window(local), "pod": window(pod) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_difference_is_where_the_sequences_part_or_one_ends() {
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_difference(&[1, 2, 3], &[1, 9, 3]), Some(1));
        assert_eq!(first_difference(&[1, 2], &[1, 2, 3]), Some(2));
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2]), Some(2));
        assert_eq!(first_difference(&[], &[]), None);
    }

    #[test]
    fn the_api_follows_the_body_and_a_body_without_a_prompt_is_refused() {
        assert_eq!(
            infer_api(br#"{"messages": []}"#).expect("chat"),
            ApiKind::ChatCompletions
        );
        assert_eq!(
            infer_api(br#"{"prompt": "x"}"#).expect("completion"),
            ApiKind::Completions
        );
        let error = infer_api(br#"{"input": "x"}"#).expect_err("neither");
        assert!(error.to_string().contains("--api"), "{error}");
        assert!(infer_api(b"{").is_err());
    }
}

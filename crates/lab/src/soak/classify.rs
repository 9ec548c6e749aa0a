//! What became of one request, from what the client saw: completed, refused with an explicit
//! error, or lost. Pure: the client collects an [`Answer`], [`classify`] reads it, and
//! [`attribute`] excuses the streams a pod took with it when it was killed.

use serde::Serialize;
use serde_json::Value;

use crate::loadgen::client::{Payload, SseParser, classify as classify_payload};

/// How a request failed before any response head came back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NoHead {
    /// The connection could not be made.
    Connect,
    /// The connection broke (reset, closed) before a status.
    Reset,
    /// No status within the request timeout.
    Timeout,
}

/// How the body ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyEnd {
    /// The server ended it.
    Complete,
    /// The connection broke during the body.
    Broken(String),
    /// The request timeout passed during the body.
    Timeout,
    /// Longer than the client keeps; nothing we send should get such an answer.
    TooLarge,
}

/// What the client saw of one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// No response head.
    NoHead(NoHead),
    /// A status, and the body as far as it came.
    Response {
        status: u16,
        body: Vec<u8>,
        end: BodyEnd,
    },
}

/// Why a request counts as lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Lost {
    /// Connection refused or failed: no gateway answered.
    Connect,
    /// The connection broke before a status.
    Reset,
    /// No status within the timeout.
    Timeout,
    /// An error status whose body is not an OpenAI-style JSON error.
    NonJsonError,
    /// A 200 whose body broke off, timed out, or (streamed) ended without `[DONE]`.
    Truncated,
    /// A 200 whose body is not a completion: not JSON, no choices, an event that is not JSON.
    BadBody,
}

impl Lost {
    /// The name used in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Lost::Connect => "connect",
            Lost::Reset => "reset",
            Lost::Timeout => "timeout",
            Lost::NonJsonError => "non_json_error",
            Lost::Truncated => "truncated",
            Lost::BadBody => "bad_body",
        }
    }
}

/// What became of a request.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Outcome {
    /// 200 and a full completion (a JSON body with choices, or a stream ending in `[DONE]`).
    Completed,
    /// An explicit answer that the request failed: an error status with an OpenAI-style JSON
    /// error, or a 200 stream that carried an error event. `code` is the error's `code`
    /// (else its `type`).
    Refused { status: u16, code: String },
    /// A 200 stream cut while the pod serving it was being killed: expected, not lost.
    CutByPodKill,
    /// Anything else.
    Lost(Lost),
}

impl Outcome {
    /// The key counted in reports: `completed`, `error <status> <code>`, `cut_by_pod_kill`,
    /// `lost <reason>`.
    pub fn key(&self) -> String {
        match self {
            Outcome::Completed => "completed".into(),
            Outcome::Refused { status, code } => format!("error {status} {code}"),
            Outcome::CutByPodKill => "cut_by_pod_kill".into(),
            Outcome::Lost(reason) => format!("lost {}", reason.as_str()),
        }
    }

    /// Counted as lost.
    pub fn is_lost(&self) -> bool {
        matches!(self, Outcome::Lost(_))
    }
}

/// The `code` of an OpenAI-style error object (`{"error": {...}}`), else its `type`, else
/// `unspecified`; None when `v` is not such an object.
fn error_code(v: &Value) -> Option<String> {
    let error = v.get("error")?.as_object()?;
    let text = |key: &str| match error.get(key) {
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => None,
    };
    Some(
        text("code")
            .or_else(|| text("type"))
            .unwrap_or_else(|| "unspecified".into()),
    )
}

/// Reads what the client saw of a request that asked for a stream (`streamed`) or not.
pub fn classify(answer: &Answer, streamed: bool) -> Outcome {
    let (status, body, end) = match answer {
        Answer::NoHead(NoHead::Connect) => return Outcome::Lost(Lost::Connect),
        Answer::NoHead(NoHead::Reset) => return Outcome::Lost(Lost::Reset),
        Answer::NoHead(NoHead::Timeout) => return Outcome::Lost(Lost::Timeout),
        Answer::Response { status, body, end } => (*status, body, end),
    };
    if !(200..300).contains(&status) {
        // An error answer must arrive whole and say what went wrong in JSON.
        let parsed = match end {
            BodyEnd::Complete => serde_json::from_slice::<Value>(body).ok(),
            _ => None,
        };
        return match parsed.as_ref().and_then(error_code) {
            Some(code) => Outcome::Refused { status, code },
            None => Outcome::Lost(Lost::NonJsonError),
        };
    }
    if streamed {
        return classify_stream(status, body, end);
    }
    if *end != BodyEnd::Complete {
        return Outcome::Lost(Lost::Truncated);
    }
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return Outcome::Lost(Lost::BadBody);
    };
    if let Some(code) = error_code(&v) {
        return Outcome::Refused { status, code };
    }
    match v.get("choices").and_then(Value::as_array) {
        Some(choices) if !choices.is_empty() => Outcome::Completed,
        _ => Outcome::Lost(Lost::BadBody),
    }
}

/// A 200 stream: complete once `[DONE]` has come, whatever happens to the connection after.
fn classify_stream(status: u16, body: &[u8], end: &BodyEnd) -> Outcome {
    let mut parser = SseParser::default();
    for data in parser.push(body) {
        match classify_payload(&data) {
            Payload::Done => return Outcome::Completed,
            Payload::Chunk { .. } => {}
            Payload::Error(_) => {
                let code = serde_json::from_str::<Value>(&data)
                    .ok()
                    .as_ref()
                    .and_then(error_code)
                    .unwrap_or_else(|| "unspecified".into());
                return Outcome::Refused { status, code };
            }
            Payload::Invalid => return Outcome::Lost(Lost::BadBody),
        }
    }
    // No `[DONE]`: cut, whether the connection broke, timed out or closed early.
    let _ = end;
    Outcome::Lost(Lost::Truncated)
}

/// A pod killed by the soak (SIGKILL), `at_s` seconds after the run started.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PodKill {
    /// The pod's index (its `x-sim-pod`).
    pub pod: usize,
    /// When the SIGKILL was sent.
    pub at_s: f64,
}

/// Slack around a kill: the client notices a cut connection a little after the SIGKILL.
const KILL_SLACK_S: f64 = 1.0;

/// The final outcome: a 200 stream that was cut (or timed out) while it was being served by a
/// pod we killed, that is, the pod was killed after the answer began and before the client
/// saw it end, is `CutByPodKill`; every other outcome stands.
pub fn attribute(
    outcome: Outcome,
    answer: &Answer,
    pod: Option<usize>,
    began_s: f64,
    ended_s: f64,
    kills: &[PodKill],
) -> Outcome {
    let cut = matches!(
        (&outcome, answer),
        (
            Outcome::Lost(Lost::Truncated),
            Answer::Response { status: 200, .. }
        )
    );
    let Some(pod) = pod.filter(|_| cut) else {
        return outcome;
    };
    let killed_while_serving = kills.iter().any(|k| {
        k.pod == pod && k.at_s >= began_s - KILL_SLACK_S && k.at_s <= ended_s + KILL_SLACK_S
    });
    if killed_while_serving {
        Outcome::CutByPodKill
    } else {
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(status: u16, body: &str, end: BodyEnd) -> Answer {
        Answer::Response {
            status,
            body: body.as_bytes().to_vec(),
            end,
        }
    }

    const STREAM: &str = "data: {\"choices\":[{\"index\":0,\"text\":\" the\"}]}\n\n\
                          data: {\"choices\":[],\"usage\":{\"completion_tokens\":1}}\n\n\
                          data: [DONE]\n\n";

    #[test]
    fn a_stream_ending_in_done_and_a_json_completion_are_completed() {
        assert_eq!(
            classify(&response(200, STREAM, BodyEnd::Complete), true),
            Outcome::Completed
        );
        // Once [DONE] has come, a connection that breaks after it loses nothing.
        assert_eq!(
            classify(
                &response(200, STREAM, BodyEnd::Broken("reset".into())),
                true
            ),
            Outcome::Completed
        );
        let whole = r#"{"id":"cmpl-1","choices":[{"index":0,"text":" the end"}],"usage":{}}"#;
        assert_eq!(
            classify(&response(200, whole, BodyEnd::Complete), false),
            Outcome::Completed
        );
    }

    #[test]
    fn an_error_status_with_a_json_error_is_refused_with_its_code() {
        let picker = r#"{"error":{"message":"the endpoint picker is unavailable; retry","type":"service_unavailable","code":"picker_unavailable"}}"#;
        assert_eq!(
            classify(&response(503, picker, BodyEnd::Complete), true),
            Outcome::Refused {
                status: 503,
                code: "picker_unavailable".into()
            }
        );
        // vLLM's shape: a numeric code.
        let vllm =
            r#"{"error":{"message":"no","type":"NotFoundError","param":"model","code":404}}"#;
        assert_eq!(
            classify(&response(404, vllm, BodyEnd::Complete), false).key(),
            "error 404 404"
        );
        // No code: the type names it.
        let typed = r#"{"error":{"message":"x","type":"overloaded"}}"#;
        assert_eq!(
            classify(&response(429, typed, BodyEnd::Complete), false).key(),
            "error 429 overloaded"
        );
    }

    #[test]
    fn an_error_status_without_a_whole_json_error_is_lost() {
        for (body, end) in [
            (
                "upstream connect error or disconnect/reset before headers",
                BodyEnd::Complete,
            ),
            ("", BodyEnd::Complete),
            (r#"{"message":"not the OpenAI shape"}"#, BodyEnd::Complete),
            (r#"{"error":"a string, not an object"}"#, BodyEnd::Complete),
            (r#"{"error":{"code":"cut"#, BodyEnd::Broken("reset".into())),
            (r#"{"error":{"code":"x"}}"#, BodyEnd::Timeout),
        ] {
            assert_eq!(
                classify(&response(503, body, end.clone()), false),
                Outcome::Lost(Lost::NonJsonError),
                "{body:?} {end:?}"
            );
        }
    }

    #[test]
    fn a_200_that_does_not_finish_is_lost() {
        let cut = "data: {\"choices\":[{\"index\":0,\"text\":\" the\"}]}\n\n";
        for end in [
            BodyEnd::Broken("connection reset".into()),
            BodyEnd::Timeout,
            BodyEnd::Complete,
        ] {
            assert_eq!(
                classify(&response(200, cut, end.clone()), true),
                Outcome::Lost(Lost::Truncated),
                "{end:?}"
            );
        }
        assert_eq!(
            classify(
                &response(200, r#"{"choices":[{"te"#, BodyEnd::Broken("eof".into())),
                false
            ),
            Outcome::Lost(Lost::Truncated)
        );
        assert_eq!(
            classify(&response(200, "<html>", BodyEnd::Complete), false),
            Outcome::Lost(Lost::BadBody)
        );
        assert_eq!(
            classify(
                &response(200, r#"{"choices":[]}"#, BodyEnd::Complete),
                false
            ),
            Outcome::Lost(Lost::BadBody)
        );
        assert_eq!(
            classify(&response(200, "data: <html>\n\n", BodyEnd::Complete), true),
            Outcome::Lost(Lost::BadBody)
        );
    }

    #[test]
    fn no_response_head_is_lost_with_its_reason() {
        assert_eq!(
            classify(&Answer::NoHead(NoHead::Connect), true),
            Outcome::Lost(Lost::Connect)
        );
        assert_eq!(
            classify(&Answer::NoHead(NoHead::Reset), false),
            Outcome::Lost(Lost::Reset)
        );
        assert_eq!(
            classify(&Answer::NoHead(NoHead::Timeout), false).key(),
            "lost timeout"
        );
    }

    #[test]
    fn an_error_event_in_a_stream_is_an_explicit_refusal() {
        let body = "data: {\"choices\":[{\"index\":0,\"text\":\" a\"}]}\n\n\
                    data: {\"error\":{\"message\":\"engine died\",\"type\":\"InternalServerError\",\"code\":500}}\n\n";
        assert_eq!(
            classify(&response(200, body, BodyEnd::Complete), true).key(),
            "error 200 500"
        );
    }

    #[test]
    fn only_a_stream_cut_while_its_pod_was_killed_is_excused() {
        let cut = response(200, "data: {}\n\n", BodyEnd::Broken("reset".into()));
        let lost = classify(&cut, true);
        let kill = [PodKill { pod: 2, at_s: 10.0 }];
        // Served by pod 2 from 9.5 s, cut at 10.01 s: the kill did it.
        assert_eq!(
            attribute(lost.clone(), &cut, Some(2), 9.5, 10.01, &kill),
            Outcome::CutByPodKill
        );
        // Another pod, or long before or after the kill: lost.
        assert_eq!(
            attribute(lost.clone(), &cut, Some(1), 9.5, 10.01, &kill),
            lost
        );
        assert_eq!(
            attribute(lost.clone(), &cut, Some(2), 2.0, 3.0, &kill),
            lost
        );
        assert_eq!(
            attribute(lost.clone(), &cut, Some(2), 20.0, 21.0, &kill),
            lost
        );
        // No pod header: nothing to attribute it to.
        assert_eq!(attribute(lost.clone(), &cut, None, 9.5, 10.01, &kill), lost);
        // A refusal or a request that never got a head is never excused by a kill.
        let refused = response(503, r#"{"error":{"code":"x"}}"#, BodyEnd::Complete);
        let outcome = classify(&refused, true);
        assert_eq!(
            attribute(outcome.clone(), &refused, Some(2), 9.5, 10.01, &kill),
            outcome
        );
        let reset = Answer::NoHead(NoHead::Reset);
        assert_eq!(
            attribute(
                Outcome::Lost(Lost::Reset),
                &reset,
                Some(2),
                9.5,
                10.01,
                &kill
            ),
            Outcome::Lost(Lost::Reset)
        );
    }
}

//! What one dispatch pass learns from the requests that found no room: at overload every
//! finish starts a pass that retries up to [`super::MAX_MISSES_PER_PASS`] held requests,
//! and a pick reads every pod, so most of a pass's picks would repeat what the first miss
//! showed ([`Shadow`]).

use crate::fleet::PrefixMatches;
use crate::request::RouteRequest;
use crate::scheduler::{self, Outlook, SchedulerConfig, Shadow};

/// The [`Shadow`]s of one dispatch pass over one fleet, each with the model and the
/// configuration of the pick that cast it. Cleared when the pass places a request: a
/// placement can saturate the last pods the filters kept, after which they keep others
/// that may fit.
#[derive(Debug, Default)]
pub struct Shadows {
    cast: Vec<(String, SchedulerConfig, Shadow)>,
}

impl Shadows {
    /// The outlook of `request`, placed by `config` and matching `prefix`, where a shadow
    /// cast in this pass covers it (no pick needed: it lacks room).
    pub fn covering(
        &self,
        request: &RouteRequest<'_>,
        prefix: Option<&PrefixMatches>,
        config: &SchedulerConfig,
    ) -> Option<Outlook> {
        if self.cast.is_empty()
            || request.subset.is_some()
            || prefix.is_some_and(PrefixMatches::any)
        {
            return None;
        }
        let model = request.model()?;
        let tokens = scheduler::tokens_needed(request, config);
        self.cast
            .iter()
            .find(|(m, c, shadow)| m == model && c == config && shadow.covers(tokens))
            .map(|(_, _, shadow)| shadow.outlook(tokens))
    }

    /// Keeps the shadow `outlook` casts, if any, for `request` placed by `config`.
    pub fn cast(
        &mut self,
        request: &RouteRequest<'_>,
        config: &SchedulerConfig,
        outlook: &Outlook,
    ) {
        let (Some(shadow), Some(model)) = (outlook.shadow, request.model()) else {
            return;
        };
        self.cast.push((model.to_owned(), config.clone(), shadow));
    }

    /// A request was placed: what the shadows said may no longer hold.
    pub fn clear(&mut self) {
        self.cast.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::InferenceRequest;
    use crate::scheduler::Relaxed;

    fn inference(model: &str, prompt: u32) -> InferenceRequest {
        InferenceRequest {
            model: model.to_owned(),
            prompt_tokens: prompt,
            max_output_tokens: Some(100),
            stream: false,
            prompt_prefix: Vec::new(),
            prefix_context: 0,
        }
    }

    fn outlook(tokens: u64, largest_pool: u64) -> Outlook {
        Shadow {
            tokens,
            largest_pool,
            relaxed: Relaxed {
                saturation: true,
                kv_headroom: true,
            },
        }
        .outlook(tokens)
    }

    /// A shadow covers a request of its model and configuration, without a subset, from
    /// its tokens up to its largest pool; placing a request clears the pass's shadows.
    #[test]
    fn a_shadow_covers_larger_requests_of_its_model_and_configuration_until_a_placement() {
        let config = SchedulerConfig::default();
        let mut shadows = Shadows::default();
        // 1,000 prompt + 100 output tokens.
        let first = inference("m", 1_000);
        let first = RouteRequest {
            inference: Some(&first),
            subset: None,
        };
        shadows.cast(&first, &config, &outlook(1_100, 5_000));
        let covered = |shadows: &Shadows, model: &str, prompt: u32, config: &SchedulerConfig| {
            let inference = inference(model, prompt);
            let request = RouteRequest {
                inference: Some(&inference),
                subset: None,
            };
            shadows.covering(&request, None, config).is_some()
        };
        assert!(covered(&shadows, "m", 1_000, &config));
        assert!(covered(&shadows, "m", 4_900, &config));
        assert!(!covered(&shadows, "m", 999, &config), "smaller");
        assert!(
            !covered(&shadows, "m", 4_901, &config),
            "larger than any pool"
        );
        assert!(!covered(&shadows, "other", 2_000, &config), "another model");
        let leaving_room = SchedulerConfig {
            keep_free: 0.1,
            ..SchedulerConfig::default()
        };
        assert!(!covered(&shadows, "m", 2_000, &leaving_room));
        let inference = inference("m", 2_000);
        let subset = crate::request::EndpointSubset::parse(["10.0.0.1:8000"]);
        let hinted = RouteRequest {
            inference: Some(&inference),
            subset: Some(&subset),
        };
        assert!(
            shadows.covering(&hinted, None, &config).is_none(),
            "a subset hint"
        );
        shadows.clear();
        assert!(!covered(&shadows, "m", 2_000, &config));
    }
}

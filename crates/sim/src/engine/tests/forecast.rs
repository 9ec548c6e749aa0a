//! [`Engine::next_finish_bound`]: an engine woken only at its bounds and at its inputs
//! emits exactly what one stepped at every event emits, and no finish before a bound.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;

/// What happens to the engine from outside: a request added or one aborted.
#[derive(Debug, Clone)]
enum Input {
    Add(RequestSpec),
    /// Aborts the live request at this index (modulo the live count).
    Abort(usize),
}

/// A random engine (small pools that preempt, small budgets that chunk prefills, adapter
/// slots that load) and a random trace of inputs for it.
fn scenario(seed: u64) -> (EngineConfig, Vec<(SimTime, Input)>) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let cfg = EngineConfig {
        num_gpu_blocks: rng.random_range(24..400),
        block_size: 16,
        max_num_seqs: rng.random_range(2..32),
        // Some budgets so small that decoding sequences are left out of a step.
        max_num_batched_tokens: if rng.random_bool(0.3) {
            rng.random_range(4..40)
        } else {
            rng.random_range(64..2048)
        },
        max_loras: rng.random_range(0..3),
        max_cpu_loras: 2,
        lora_load: Duration::from_millis(rng.random_range(5..80)),
        jitter: 0.02,
        enable_prefix_caching: rng.random_bool(0.7),
        seed,
        histograms: false,
        token_events: true,
    };
    let mut t = Duration::ZERO;
    let inputs = (0..rng.random_range(5..60))
        .map(|i| {
            // Bursts, so that a batch can hold more sequences than a small budget.
            let gap = if rng.random_bool(0.5) { 2_000 } else { 400_000 };
            t += Duration::from_micros(rng.random_range(0..gap));
            let input = if i > 0 && rng.random_bool(0.1) {
                Input::Abort(rng.random_range(0..64))
            } else {
                let shared = rng.random_range(0..4u32);
                let mut prompt: Vec<u32> = (0..rng.random_range(0..200))
                    .map(|k| shared * 1000 + k)
                    .collect();
                prompt.extend((0..rng.random_range(1..500)).map(|_| rng.random_range(0..50_000)));
                Input::Add(RequestSpec {
                    prompt,
                    adapter: rng
                        .random_bool(0.5)
                        .then(|| format!("a{}", rng.random_range(0..4))),
                    max_output: rng.random_range(1..80),
                    finish_reason: FinishReason::Length,
                    output_seed: rng.random(),
                })
            };
            (t, input)
        })
        .collect();
    (cfg, inputs)
}

fn apply(engine: &mut Engine, at: SimTime, input: &Input, live: &mut Vec<RequestId>) {
    match input {
        Input::Add(spec) => live.push(engine.add_request(at, spec.clone())),
        Input::Abort(i) if !live.is_empty() => {
            let id = live.remove(i % live.len());
            engine.abort(at, id);
        }
        Input::Abort(_) => {}
    }
}

/// Steps the engine at every event, the inputs at their times; returns its events and
/// steps.
fn stepped(cfg: &EngineConfig, inputs: &[(SimTime, Input)]) -> (Vec<Event>, u64) {
    let mut e = Engine::new(cfg.clone(), h100());
    let mut live = Vec::new();
    for (at, input) in inputs {
        while let Some(t) = e.next_event_time().filter(|t| t <= at) {
            e.advance(t);
        }
        apply(&mut e, *at, input, &mut live);
    }
    while let Some(t) = e.next_event_time() {
        e.advance(t);
    }
    let mut out = Vec::new();
    e.take_events(&mut out);
    (out, e.stats().steps)
}

/// Wakes the engine only at its bounds and at the inputs, checking that each wake-up
/// emits no finish before its bound; returns the events and the wake-ups the bounds took.
fn lazy(cfg: &EngineConfig, inputs: &[(SimTime, Input)]) -> (Vec<Event>, usize) {
    lazy_reading(cfg, inputs, false)
}

/// The engine's next finish bound; `detached`, read by a reading taken out of the engine,
/// run (now and then on another thread) and settled back.
fn bound(e: &mut Engine, detached: bool, readings: &mut usize) -> Option<SimTime> {
    if !detached {
        return e.next_finish_bound();
    }
    match e.detach_forecast() {
        FinishBound::Known(decided) => decided,
        FinishBound::ToRead(mut reading) => {
            *readings += 1;
            let earliest = reading.earliest();
            if (*readings).is_multiple_of(7) {
                reading = std::thread::spawn(move || {
                    reading.run();
                    reading
                })
                .join()
                .expect("read ahead");
            } else {
                reading.run();
            }
            let bound = e.settle_forecast(reading);
            assert!(
                bound.is_none_or(|b| b >= earliest),
                "{bound:?} before {earliest:?}"
            );
            bound
        }
    }
}

/// [`lazy`], the bounds read by detached readings when `detached`.
fn lazy_reading(
    cfg: &EngineConfig,
    inputs: &[(SimTime, Input)],
    detached: bool,
) -> (Vec<Event>, usize) {
    let mut e = Engine::new(cfg.clone(), h100());
    let mut live = Vec::new();
    let mut out = Vec::new();
    let mut wakeups = 0;
    let mut readings = 0;
    let mut wake = |e: &mut Engine, out: &mut Vec<Event>, until: Option<SimTime>| {
        while let Some(bound) =
            bound(e, detached, &mut readings).filter(|b| until.is_none_or(|u| *b <= u))
        {
            let next = e.next_event_time().expect("a bound means work");
            assert!(
                bound >= next,
                "bound {bound:?} before the next event {next:?}"
            );
            e.advance(bound);
            wakeups += 1;
            let from = out.len();
            e.take_events(out);
            for ev in &out[from..] {
                if matches!(ev.kind, EventKind::Finished(_)) {
                    assert_eq!(ev.at, bound, "a finish before its bound");
                }
            }
        }
    };
    for (k, (at, input)) in inputs.iter().enumerate() {
        wake(&mut e, &mut out, Some(*at));
        apply(&mut e, *at, input, &mut live);
        let from = out.len();
        e.take_events(&mut out);
        // What adding or aborting at `at` caught up on finished nothing: the bound said so.
        for ev in &out[from..] {
            if let EventKind::Finished(s) = &ev.kind {
                assert_eq!(
                    (ev.at, s.completion_tokens),
                    (*at, 0),
                    "only a request refused on arrival finishes at an input"
                );
            }
        }
        // Now and then the engine is read before a bound is asked for (a scrape): what
        // was read ahead before the input must not be used.
        let next = inputs.get(k + 1).map_or(*at, |(next, _)| *next);
        if k % 3 == 1 && next > *at {
            e.advance(*at + (next - *at) / 2);
            e.take_events(&mut out);
        }
    }
    wake(&mut e, &mut out, None);
    // The engine idles: a step may still be in flight, whose end nothing can see.
    e.advance(Duration::MAX / 2);
    e.take_events(&mut out);
    (out, wakeups)
}

#[test]
fn an_engine_woken_at_its_finish_bounds_emits_what_stepping_it_emits() {
    let (mut events, mut wakeups, mut steps) = (0, 0, 0);
    for seed in 0..300 {
        let (cfg, inputs) = scenario(seed);
        let (want, stepped_steps) = stepped(&cfg, &inputs);
        let (got, woken) = lazy(&cfg, &inputs);
        assert_eq!(got, want, "seed {seed}");
        let (detached, detached_woken) = lazy_reading(&cfg, &inputs, true);
        assert_eq!(detached, want, "seed {seed}, read by detached readings");
        assert_eq!(detached_woken, woken);
        events += want.len();
        wakeups += woken;
        steps += stepped_steps;
    }
    assert!(events > 10_000, "{events} events");
    // The bounds skip steps even in these crowded engines (each step is otherwise a
    // wake-up).
    assert!(
        wakeups as u64 * 10 < steps * 8,
        "{wakeups} wake-ups for {steps} steps"
    );
}

#[test]
fn a_steady_decode_wakes_only_at_its_finishes() {
    let cfg = EngineConfig {
        histograms: false,
        ..EngineConfig::default()
    };
    let inputs: Vec<(SimTime, Input)> = [100, 250, 251, 400]
        .into_iter()
        .enumerate()
        .map(|(i, out)| {
            let prompt = prompt(i as u32 + 1, 300);
            (Duration::ZERO, Input::Add(spec(prompt, out)))
        })
        .collect();
    let (events, wakeups) = lazy(&cfg, &inputs);
    let (want, steps) = stepped(&cfg, &inputs);
    assert_eq!(events, want);
    assert!(steps > 400, "{steps} steps");
    // The first request starts a step at once and the other three wait for its end: one
    // wake-up admits them. Then one per finish: nothing else in a steady decode needs the
    // engine stepped.
    assert_eq!(wakeups, 1 + 4);
}

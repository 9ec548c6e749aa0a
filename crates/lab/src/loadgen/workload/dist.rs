//! Token-count distributions (`dist: fixed | uniform | lognormal | exponential`): their
//! serde shape, range checks and seeded sampling.

use rand::Rng;
use serde::Deserialize;

/// A distribution of token counts.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "dist", rename_all = "snake_case", deny_unknown_fields)]
pub enum Dist {
    /// Always `value`.
    Fixed {
        /// The count.
        value: u32,
    },
    /// Uniform over `min..=max`.
    Uniform {
        /// Smallest.
        min: u32,
        /// Largest.
        max: u32,
    },
    /// `median · e^(sigma·N(0,1))`, rounded, clamped to `min..=max`.
    Lognormal {
        /// Median before clamping.
        median: f64,
        /// Standard deviation of the logarithm.
        sigma: f64,
        /// Smallest.
        min: u32,
        /// Largest.
        max: u32,
    },
    /// Exponential with `mean`, rounded up, clamped to `min..=max`.
    Exponential {
        /// Mean before clamping.
        mean: f64,
        /// Smallest.
        min: u32,
        /// Largest.
        max: u32,
    },
}

impl Dist {
    /// Draws one count (at least 1).
    pub fn sample(&self, rng: &mut impl Rng) -> u32 {
        let v = match *self {
            Dist::Fixed { value } => value,
            Dist::Uniform { min, max } => rng.random_range(min..=max),
            Dist::Lognormal {
                median,
                sigma,
                min,
                max,
            } => clamp_round(median * (sigma * gaussian(rng)).exp(), min, max),
            Dist::Exponential { mean, min, max } => {
                let u: f64 = rng.random();
                clamp_round((-(1.0 - u).ln() * mean).ceil(), min, max)
            }
        };
        v.max(1)
    }

    /// The largest count it can draw.
    pub fn max(&self) -> u32 {
        match *self {
            Dist::Fixed { value } => value,
            Dist::Uniform { max, .. }
            | Dist::Lognormal { max, .. }
            | Dist::Exponential { max, .. } => max,
        }
    }

    pub(super) fn check(&self) -> Result<(), String> {
        let ok = match *self {
            Dist::Fixed { value } => value >= 1,
            Dist::Uniform { min, max } => min >= 1 && min <= max,
            Dist::Lognormal {
                median,
                sigma,
                min,
                max,
            } => median > 0.0 && median.is_finite() && sigma >= 0.0 && min >= 1 && min <= max,
            Dist::Exponential { mean, min, max } => {
                mean > 0.0 && mean.is_finite() && min >= 1 && min <= max
            }
        };
        if ok {
            Ok(())
        } else {
            Err(format!("invalid distribution {self:?}"))
        }
    }
}

fn clamp_round(v: f64, min: u32, max: u32) -> u32 {
    v.round().clamp(f64::from(min), f64::from(max)) as u32
}

/// A standard normal draw (Box-Muller).
fn gaussian(rng: &mut impl Rng) -> f64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

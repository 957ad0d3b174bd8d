//! Dynamic loss scaling with torch.cuda.amp.GradScaler's semantics and defaults: the loss is
//! multiplied by `scale` before backward; a step whose gradients hold an inf or NaN is skipped
//! and the scale multiplied by `backoff_factor`; after `growth_interval` consecutive clean
//! steps the scale is multiplied by `growth_factor`.

use crate::spec::{PrecisionSpec, Scaling};

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScaler {
    pub scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: u64,
    /// Clean steps since the last growth or backoff (GradScaler's `_growth_tracker`).
    pub clean_steps: u64,
}

impl Default for LossScaler {
    /// GradScaler's defaults: init_scale 2^16, growth 2 every 2000 clean steps, backoff 0.5.
    fn default() -> Self {
        LossScaler::new(65536.0, 2.0, 0.5, 2000)
    }
}

impl LossScaler {
    /// The scaler a job's `[precision]` asks for; None without loss scaling. A fixed scale
    /// never changes, but a step with inf/NaN gradients is still skipped.
    pub fn from_spec(p: &PrecisionSpec) -> Option<LossScaler> {
        match p.scaling() {
            Scaling::None => None,
            Scaling::Dynamic => Some(LossScaler::new(
                p.init_scale,
                p.growth_factor,
                p.backoff_factor,
                p.growth_interval,
            )),
            Scaling::Fixed(scale) => Some(LossScaler::new(scale, 1.0, 1.0, u64::MAX)),
        }
    }

    pub fn new(
        init_scale: f64,
        growth_factor: f64,
        backoff_factor: f64,
        growth_interval: u64,
    ) -> Self {
        LossScaler {
            // An f32, as GradScaler's `torch.full((), init_scale, dtype=torch.float32)`.
            scale: f64::from(init_scale as f32),
            growth_factor,
            backoff_factor,
            growth_interval,
            clean_steps: 0,
        }
    }

    /// What the trainer does with the gradients of a step, given whether any was non-finite.
    /// Returns true when the optimizer step may run (on gradients divided by the old scale).
    /// The scale is kept as an f32, as GradScaler's is (`_amp_update_scale`: each product
    /// in f64, rounded to f32), and does not grow past f32's range to inf.
    pub fn update(&mut self, found_inf: bool) -> bool {
        let as_f32 = |v: f64| f64::from(v as f32);
        if found_inf {
            self.scale = as_f32(self.scale * self.backoff_factor);
            self.clean_steps = 0;
            return false;
        }
        self.clean_steps += 1;
        if self.clean_steps == self.growth_interval {
            let grown = as_f32(self.scale * self.growth_factor);
            if grown.is_finite() {
                self.scale = grown;
            }
            self.clean_steps = 0;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_overflow_skips_the_step_and_halves_the_scale() {
        let mut s = LossScaler::default();
        assert!(s.update(false));
        assert!(!s.update(true));
        assert_eq!(s.scale, 32768.0);
        assert_eq!(s.clean_steps, 0);
    }

    #[test]
    fn the_scale_doubles_after_growth_interval_clean_steps() {
        let mut s = LossScaler::new(1024.0, 2.0, 0.5, 3);
        for _ in 0..2 {
            assert!(s.update(false));
        }
        assert_eq!(s.scale, 1024.0);
        assert!(s.update(false));
        assert_eq!(s.scale, 2048.0);
        // An overflow resets the count: three more clean steps are needed.
        s.update(true);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale, 1024.0);
        s.update(false);
        assert_eq!(s.scale, 2048.0);
    }

    /// GradScaler keeps its scale in an f32 and does not grow it to inf.
    #[test]
    fn the_scale_is_an_f32_that_stops_growing_at_its_limit() {
        // Each product in f64, rounded to f32 (`_amp_update_scale`).
        let f32_of = |v: f64| f64::from(v as f32);
        let mut s = LossScaler::new(0.1, 1.7, 0.3, 1);
        assert_eq!(s.scale, f32_of(0.1));
        s.update(false);
        let grown = f32_of(f32_of(0.1) * 1.7);
        assert_eq!(s.scale, grown);
        s.update(true);
        assert_eq!(s.scale, f32_of(grown * 0.3));
        assert_ne!(s.scale, grown * 0.3, "the f64 product is not an f32");
        let mut s = LossScaler::new(3e38, 1e30, 0.5, 1);
        assert!(s.update(false));
        assert_eq!(s.scale, f64::from(3e38f32), "not grown to inf");
        s.update(true);
        assert_eq!(s.scale, f64::from(1.5e38f32));
    }
}

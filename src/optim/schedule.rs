//! Learning rate as a function of the optimizer step, PyTorch's schedulers in closed form:
//! an optional linear warm-up (LinearLR), then StepLR, MultiStepLR, ExponentialLR or
//! CosineAnnealingLR counted from the end of the warm-up (as SequentialLR does).

use crate::spec::{ScheduleKind, ScheduleSpec};

#[derive(Debug, Clone)]
pub struct Schedule {
    base_lr: f64,
    spec: ScheduleSpec,
    /// Optimizer steps in the whole run (the cosine's length is this minus the warm-up).
    total_steps: usize,
}

impl Schedule {
    pub fn new(base_lr: f64, spec: &ScheduleSpec, total_steps: usize) -> Self {
        Schedule {
            base_lr,
            spec: spec.clone(),
            total_steps,
        }
    }

    /// The learning rate for optimizer step `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        let s = &self.spec;
        let warmup = s.warmup_steps;
        if step < warmup {
            let start = s.warmup_start_factor();
            return self.base_lr * (start + (1.0 - start) * step as f64 / warmup as f64);
        }
        let t = step - warmup;
        let gamma = s.gamma();
        let factor = match s.kind {
            ScheduleKind::Constant => 1.0,
            ScheduleKind::Step => gamma.powi((t / s.step_size.unwrap_or(1).max(1)) as i32),
            ScheduleKind::Multistep => {
                let passed = s
                    .milestones
                    .as_deref()
                    .unwrap_or(&[])
                    .iter()
                    .filter(|&&m| m <= t)
                    .count();
                gamma.powi(passed as i32)
            }
            ScheduleKind::Exponential => gamma.powi(t as i32),
            ScheduleKind::Cosine => {
                let min = s.min_lr();
                let length = self.total_steps.saturating_sub(warmup).max(1);
                let progress = t.min(length) as f64 / length as f64;
                let lr = min
                    + (self.base_lr - min) * (1.0 + (std::f64::consts::PI * progress).cos()) / 2.0;
                return lr;
            }
        };
        self.base_lr * factor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: ScheduleKind) -> ScheduleSpec {
        ScheduleSpec {
            kind,
            ..Default::default()
        }
    }

    #[test]
    fn step_and_multistep_decay_at_the_right_steps() {
        let s = Schedule::new(
            1.0,
            &ScheduleSpec {
                step_size: Some(3),
                gamma: Some(0.5),
                ..spec(ScheduleKind::Step)
            },
            10,
        );
        let lrs: Vec<f64> = (0..7).map(|t| s.lr(t)).collect();
        assert_eq!(lrs, [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25]);
        let m = ScheduleSpec {
            milestones: Some(vec![2, 4]),
            ..spec(ScheduleKind::Multistep)
        };
        let s = Schedule::new(1.0, &m, 10);
        let lrs: Vec<f64> = (0..6).map(|t| s.lr(t)).collect();
        assert!(
            (lrs[1] - 1.0).abs() < 1e-12
                && (lrs[2] - 0.1).abs() < 1e-12
                && (lrs[4] - 0.01).abs() < 1e-12
        );
    }

    #[test]
    fn cosine_follows_pytorch_closed_form_after_warmup() {
        let c = ScheduleSpec {
            min_lr: Some(0.1),
            warmup_steps: 4,
            ..spec(ScheduleKind::Cosine)
        };
        let s = Schedule::new(1.0, &c, 14);
        assert_eq!(s.lr(0), 0.0);
        assert!((s.lr(2) - 0.5).abs() < 1e-12);
        assert!((s.lr(4) - 1.0).abs() < 1e-12);
        assert!((s.lr(9) - 0.55).abs() < 1e-12); // halfway: (1 + 0.1) / 2
        assert!((s.lr(14) - 0.1).abs() < 1e-12);
        assert!((s.lr(100) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn exponential_multiplies_every_step() {
        let e = ScheduleSpec {
            gamma: Some(0.9),
            ..spec(ScheduleKind::Exponential)
        };
        let s = Schedule::new(2.0, &e, 10);
        assert!((s.lr(3) - 2.0 * 0.9f64.powi(3)).abs() < 1e-12);
    }
}

//! Learning-rate schedules against their closed forms (100 updates, 10% warm-up,
//! peak 1e-3), values worked out by hand from the formulas in the module docs.

use burn_onnx_train::train::config::{LrConfig, ScheduleKind};
use burn_onnx_train::train::schedule::LrSchedule;

fn sched(mode: ScheduleKind) -> LrSchedule {
    let c = LrConfig {
        initial_lr: 1e-3,
        warmup_ratio: 0.1,
        mode,
        poly_power: 2.0,
        end_lr: 1e-5,
    };
    LrSchedule::new(&c, 100)
}

fn close(a: f64, b: f64) {
    assert!((a - b).abs() < 1e-12, "{a} != {b}");
}

#[test]
fn warmup_is_linear_from_zero() {
    for mode in [
        ScheduleKind::Constant,
        ScheduleKind::Linear,
        ScheduleKind::Cosine,
        ScheduleKind::Poly,
    ] {
        let s = sched(mode);
        assert_eq!(s.warmup_steps(), 10);
        close(s.lr(0), 0.0);
        close(s.lr(5), 5e-4);
        close(s.lr(9), 9e-4);
        close(s.lr(10), 1e-3);
    }
}

#[test]
fn none_is_constant_without_warmup() {
    let s = sched(ScheduleKind::None);
    assert_eq!(s.warmup_steps(), 0);
    for t in [0, 1, 50, 99] {
        close(s.lr(t), 1e-3);
    }
}

#[test]
fn constant_after_warmup() {
    let s = sched(ScheduleKind::Constant);
    for t in [10, 50, 99] {
        close(s.lr(t), 1e-3);
    }
}

#[test]
fn linear_decays_to_zero() {
    let s = sched(ScheduleKind::Linear);
    close(s.lr(55), 1e-3 * 45.0 / 90.0);
    close(s.lr(99), 1e-3 * 1.0 / 90.0);
    close(s.lr(100), 0.0);
}

#[test]
fn cosine_halves_at_mid_decay() {
    let s = sched(ScheduleKind::Cosine);
    close(s.lr(55), 5e-4);
    close(
        s.lr(32),
        1e-3 * 0.5 * (1.0 + (std::f64::consts::PI * 22.0 / 90.0).cos()),
    );
    close(s.lr(100), 0.0);
}

#[test]
fn poly_reaches_end_lr() {
    let s = sched(ScheduleKind::Poly);
    close(s.lr(55), (1e-3 - 1e-5) * 0.25 + 1e-5);
    close(s.lr(100), 1e-5);
}

//! The step-time cost model behind `max_step_ms`: the engine reports each step's measured
//! time (`Scheduler::report_step_time`), the model fits
//!
//! ```text
//! ms ≈ a + b·tokens + d·rows + c_full·kkeys_full + c_sliding·kkeys_sliding
//! ```
//!
//! where `tokens` are the step's query tokens, `rows` its rows, and `kkeys_*` the keys its
//! query tokens attend to (thousands, summed over query tokens) in full-attention and in
//! sliding-window layers (a query at position `p` attends to `p + 1` keys, or to at most
//! `window` in a sliding layer). The fit is exponentially weighted least squares (recent
//! steps count most) with a ridge pull toward a conservative prior, non-negative
//! coefficients, and each new measurement winsorized to within a factor of the current
//! prediction once a few samples exist, so one step slowed by a busy machine moves the
//! model only a little. Everything is deterministic given the reported timings.

// Index loops over the 5x5 normal equations read as the algebra does.
#![allow(clippy::needless_range_loop)]

/// Number of features (the constant first).
pub const NF: usize = 5;

/// Feature index of the constant, the query tokens, the rows, the full / sliding keys.
const CONST: usize = 0;
const TOKENS: usize = 1;
const ROWS: usize = 2;
const KEYS_FULL: usize = 3;
const KEYS_SLIDING: usize = 4;

/// Conservative prior (ms): a slow CPU (a 1.5B model on one core prefills ~10 ms a token).
const PRIOR: [f64; NF] = [20.0, 10.0, 0.5, 4.0, 4.0];
/// Typical feature sizes: the ridge pull of the prior on each coefficient is `RIDGE`
/// pseudo-steps with that feature at this size (and the others 0). Small for the constant,
/// the tokens and the keys, so a few real steps outweigh it; large for the rows, whose
/// count barely varies between steps (it is nearly collinear with the constant and, in
/// decode steps, with the tokens): what the data cannot tell apart goes to the constant
/// and the per-row cost stays near its small prior.
const TYPICAL: [f64; NF] = [1.0, 16.0, 64.0, 16.0, 16.0];
/// Ridge weight, in pseudo-steps.
const RIDGE: f64 = 0.1;
/// Weight decay per reported step (an effective memory of ~30 steps).
const DECAY: f64 = 0.97;
/// Measurements are clamped to `[pred / WINSOR, pred * WINSOR]` once `WARM` samples exist.
const WINSOR: f64 = 3.0;
const WARM: u64 = 4;
/// Smallest cost of a query token (ms): keeps the token budget of a time budget finite.
const MIN_TOKEN_MS: f64 = 1e-4;

/// The shape of one step, as the cost model sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepShape {
    pub x: [f64; NF],
}

/// Attention geometry the cost of a row depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub has_full: bool,
    /// Sliding window, when the model has sliding layers.
    pub window: Option<usize>,
}

impl Geometry {
    /// Feature vector of one row of `q` query tokens from `start` cached tokens (no
    /// constant).
    #[inline]
    pub fn row(&self, start: usize, q: usize) -> [f64; NF] {
        let mut x = [0.0; NF];
        x[TOKENS] = q as f64;
        x[ROWS] = 1.0;
        if self.has_full {
            x[KEYS_FULL] = keys_full(start, q) / 1000.0;
        }
        if let Some(w) = self.window {
            x[KEYS_SLIDING] = keys_sliding(start, q, w) / 1000.0;
        }
        x
    }

    /// Feature vector of `n` one-token rows reading `reads` keys in all (the steady decode
    /// path knows only the sum; the steady path has full attention only).
    #[inline]
    pub fn decodes(&self, n: usize, reads: usize) -> [f64; NF] {
        let mut x = [0.0; NF];
        x[TOKENS] = n as f64;
        x[ROWS] = n as f64;
        let keys = reads as f64 / 1000.0;
        if self.has_full {
            x[KEYS_FULL] = keys;
        } else if self.window.is_some() {
            x[KEYS_SLIDING] = keys;
        }
        x
    }
}

/// Keys attended by `q` queries from `start`: `sum_{i=1..=q} (start + i)`.
#[inline]
fn keys_full(start: usize, q: usize) -> f64 {
    let (s, q) = (start as f64, q as f64);
    q * s + q * (q + 1.0) / 2.0
}

/// Keys attended by `q` queries from `start` in a window of `w`: `sum min(start + i, w)`.
#[inline]
fn keys_sliding(start: usize, q: usize, w: usize) -> f64 {
    let below = w.saturating_sub(start).min(q); // queries whose keys all fit the window
    keys_full(start, below) + ((q - below) * w) as f64
}

impl StepShape {
    /// The shape of an empty step (the constant only).
    pub fn empty() -> Self {
        let mut x = [0.0; NF];
        x[CONST] = 1.0;
        StepShape { x }
    }

    /// Add a row's features.
    #[inline]
    pub fn add(&mut self, row: &[f64; NF]) {
        for (a, b) in self.x.iter_mut().zip(row) {
            *a += b;
        }
    }

    pub fn tokens(&self) -> usize {
        self.x[TOKENS] as usize
    }
}

/// Fitted coefficients `[a, b, d, c_full, c_sliding]` (ms; `c_*` per thousand keys).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Coef(pub [f64; NF]);

impl Coef {
    /// Predicted time (ms) of a step (or of a row: a row's features have no constant).
    #[inline]
    pub fn predict(&self, x: &[f64; NF]) -> f64 {
        self.0.iter().zip(x).map(|(c, v)| c * v).sum()
    }

    /// The fixed cost of a step (ms).
    #[inline]
    pub fn step_ms(&self) -> f64 {
        self.0[CONST]
    }

    /// The most query tokens (at most `cap`) a row from `start` may take within `ms`
    /// (0 when not even one fits). The row's cost grows with its tokens: binary search.
    pub fn tokens_within(&self, geo: &Geometry, ms: f64, start: usize, cap: usize) -> usize {
        if ms.is_nan() || ms <= 0.0 || cap == 0 {
            return 0;
        }
        let fits = |q: usize| self.predict(&geo.row(start, q)) <= ms;
        if fits(cap) {
            return cap;
        }
        let (mut lo, mut hi) = (0usize, cap); // fits(lo) (or lo == 0), !fits(hi)
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }
}

/// The fitted cost model (see the module docs).
#[derive(Clone, Debug)]
pub struct CostModel {
    coef: Coef,
    /// Decayed sums `Σ w·x·xᵀ` and `Σ w·x·y`.
    xtx: [[f64; NF]; NF],
    xty: [f64; NF],
    samples: u64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            coef: Coef(PRIOR),
            xtx: [[0.0; NF]; NF],
            xty: [0.0; NF],
            samples: 0,
        }
    }
}

impl CostModel {
    /// Predicted time (ms) of a step.
    #[inline]
    pub fn predict(&self, x: &[f64; NF]) -> f64 {
        self.coef.predict(x)
    }

    /// The current coefficients.
    pub fn coef(&self) -> Coef {
        self.coef
    }

    /// Measurements taken so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Take one measured step (`ms`, finite and > 0) of shape `shape` and refit.
    pub fn observe(&mut self, shape: &StepShape, ms: f64) {
        debug_assert!(ms.is_finite() && ms > 0.0);
        let x = &shape.x;
        let mut y = ms;
        if self.samples >= WARM {
            let pred = self.predict(x).max(1e-6);
            y = y.clamp(pred / WINSOR, pred * WINSOR);
        }
        for i in 0..NF {
            self.xty[i] = DECAY * self.xty[i] + x[i] * y;
            for j in 0..NF {
                self.xtx[i][j] = DECAY * self.xtx[i][j] + x[i] * x[j];
            }
        }
        self.samples += 1;
        self.coef = Coef(self.solve());
    }

    /// Ridge solution with non-negative coefficients: a coefficient the unconstrained
    /// solution makes negative is fixed at 0 and the rest refitted (at most NF rounds).
    fn solve(&self) -> [f64; NF] {
        let mut free = [true; NF];
        loop {
            let mut a = [[0.0; NF]; NF];
            let mut rhs = [0.0; NF];
            for i in 0..NF {
                let lam = RIDGE * TYPICAL[i] * TYPICAL[i];
                rhs[i] = self.xty[i] + lam * PRIOR[i];
                for j in 0..NF {
                    a[i][j] = self.xtx[i][j];
                }
                a[i][i] += lam;
            }
            // Fixed coefficients are 0: their rows become the identity, their columns drop.
            for k in 0..NF {
                if !free[k] {
                    for i in 0..NF {
                        a[i][k] = 0.0;
                        a[k][i] = 0.0;
                    }
                    a[k][k] = 1.0;
                    rhs[k] = 0.0;
                }
            }
            let c = gauss(a, rhs);
            let worst = (0..NF)
                .filter(|&k| free[k] && c[k] < 0.0)
                .min_by(|&i, &j| c[i].total_cmp(&c[j]));
            match worst {
                Some(k) => free[k] = false,
                None => {
                    let mut c = c;
                    c[TOKENS] = c[TOKENS].max(MIN_TOKEN_MS);
                    return c;
                }
            }
        }
    }
}

/// Solve `a·x = b` (Gaussian elimination, partial pivoting; `a` is positive definite here).
fn gauss(mut a: [[f64; NF]; NF], mut b: [f64; NF]) -> [f64; NF] {
    for col in 0..NF {
        let piv = (col..NF)
            .max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))
            .expect("non-empty");
        a.swap(col, piv);
        b.swap(col, piv);
        let d = a[col][col];
        if d.abs() < 1e-300 {
            continue;
        }
        for r in col + 1..NF {
            let f = a[r][col] / d;
            if f != 0.0 {
                for k in col..NF {
                    a[r][k] -= f * a[col][k];
                }
                b[r] -= f * b[col];
            }
        }
    }
    let mut x = [0.0; NF];
    for i in (0..NF).rev() {
        let s: f64 = (i + 1..NF).map(|k| a[i][k] * x[k]).sum();
        x[i] = if a[i][i].abs() < 1e-300 {
            0.0
        } else {
            (b[i] - s) / a[i][i]
        };
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: Geometry = Geometry {
        has_full: true,
        window: None,
    };

    fn step(rows: &[(usize, usize)]) -> StepShape {
        let mut s = StepShape::empty();
        for &(start, q) in rows {
            s.add(&FULL.row(start, q));
        }
        s
    }

    /// A synthetic machine: 12 ms a step, 2.5 ms a token, 0.3 ms a row, 1.1 ms a
    /// thousand keys.
    fn truth(s: &StepShape) -> f64 {
        12.0 + 2.5 * s.x[TOKENS] + 0.3 * s.x[ROWS] + 1.1 * s.x[KEYS_FULL]
    }

    fn shapes() -> Vec<StepShape> {
        let mut v = Vec::new();
        for k in 0..60usize {
            let decodes: Vec<(usize, usize)> = (0..(k % 5)).map(|i| (100 + 37 * i, 1)).collect();
            let mut rows = decodes;
            if k % 3 != 0 {
                rows.push((((k * 131) % 4000), 16 + (k * 29) % 200));
            }
            v.push(step(&rows));
        }
        v
    }

    #[test]
    fn keys_closed_forms() {
        assert_eq!(keys_full(0, 3), 6.0);
        assert_eq!(keys_full(10, 1), 11.0);
        // window 4, start 2, 4 queries: min(3,4) + min(4,4) + 4 + 4
        assert_eq!(keys_sliding(2, 4, 4), 15.0);
        assert_eq!(keys_sliding(0, 3, 8), 6.0);
        assert_eq!(keys_sliding(100, 2, 8), 16.0);
    }

    #[test]
    fn fits_a_noiseless_machine() {
        let mut m = CostModel::default();
        for _ in 0..3 {
            for s in shapes() {
                m.observe(&s, truth(&s));
            }
        }
        for s in shapes() {
            let (p, t) = (m.predict(&s.x), truth(&s));
            assert!((p - t).abs() <= 0.05 * t, "pred {p} truth {t}");
        }
    }

    #[test]
    fn outliers_move_it_little() {
        let mut m = CostModel::default();
        for s in shapes() {
            m.observe(&s, truth(&s));
        }
        let probe = step(&[(2000, 128)]);
        let before = m.predict(&probe.x);
        // A step 50x slower than it should be (another process took the core).
        let s = step(&[(10, 1)]);
        m.observe(&s, 50.0 * truth(&s));
        let after = m.predict(&probe.x);
        assert!(
            (after - before).abs() < 0.25 * before,
            "{before} -> {after}"
        );
    }

    #[test]
    fn deterministic_and_non_negative() {
        let run = || {
            let mut m = CostModel::default();
            for (k, s) in shapes().iter().enumerate() {
                // A machine where rows are free and context is cheap, with noise.
                let noise = 1.0 + 0.2 * (((k * 7919) % 11) as f64 / 10.0 - 0.5);
                m.observe(s, (5.0 + 3.0 * s.x[TOKENS]) * noise);
            }
            m.coef().0
        };
        let (a, b) = (run(), run());
        assert_eq!(a, b);
        assert!(a.iter().all(|&c| c >= 0.0 && c.is_finite()), "{a:?}");
    }

    #[test]
    fn tokens_within_is_the_largest_fitting_row() {
        let m = CostModel::default().coef();
        for &(ms, start) in &[(0.0, 0), (5.0, 0), (100.0, 0), (100.0, 5000), (1e9, 0)] {
            let q = m.tokens_within(&FULL, ms, start, 2048);
            assert!(q <= 2048);
            if q > 0 {
                assert!(m.predict(&FULL.row(start, q)) <= ms);
            }
            if q < 2048 {
                assert!(m.predict(&FULL.row(start, q + 1)) > ms);
            }
        }
        assert!(
            m.tokens_within(&FULL, 100.0, 5000, 2048) < m.tokens_within(&FULL, 100.0, 0, 2048),
            "longer context, fewer tokens"
        );
    }
}

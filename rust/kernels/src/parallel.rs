//! Where a kernel's pieces run. By default each call starts scoped threads for its pieces
//! and joins them; a host can register a [`Pool`] of its own once (ferrobatch registers the
//! OpenMP runtime torch already runs, so that the kernels and torch's products share one
//! set of threads instead of two sets fighting over the same cores).

use std::ops::Range;
use std::sync::{Mutex, RwLock};

/// Runs the tasks of one call on a set of threads.
pub trait Pool: Sync {
    /// Calls `task(i)` exactly once for every `i` in `0..tasks`, on at most `threads`
    /// threads (the caller's among them), and returns when every call has returned. A task
    /// that panics does not stop the others; the panic reaches the caller afterwards.
    fn run(&self, threads: usize, tasks: usize, task: &(dyn Fn(usize) + Sync));

    /// The fewest elements a call of elementwise work should have before its rows are split
    /// between threads (below it, waking the threads costs more than the work).
    fn min_split(&self) -> usize;
}

/// Scoped threads started for each call (the pool when the host registers none).
pub struct ScopedThreads;

/// Starting a thread costs tens of microseconds on a 2-core VM: splitting rows over 2 fresh
/// threads never paid at decode sizes (measured on [64 .. 2048, 576] norms and
/// [64 .. 1024, 2 x 1536] silu_mul), so only calls of a million elements or more split.
pub const SCOPED_MIN_SPLIT: usize = 1 << 20;

impl Pool for ScopedThreads {
    fn run(&self, threads: usize, tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        let threads = threads.clamp(1, tasks.max(1));
        if threads == 1 {
            (0..tasks).for_each(task);
            return;
        }
        // thread t takes tasks t, t + threads, ...; the caller is thread 0
        std::thread::scope(|scope| {
            for t in 1..threads {
                scope.spawn(move || (t..tasks).step_by(threads).for_each(task));
            }
            (0..tasks).step_by(threads).for_each(task);
        });
    }

    fn min_split(&self) -> usize {
        SCOPED_MIN_SPLIT
    }
}

static POOL: RwLock<Option<&'static dyn Pool>> = RwLock::new(None);

/// Makes `pool` run every kernel's pieces from now on (None: back to [`ScopedThreads`]).
pub fn set_pool(pool: Option<&'static dyn Pool>) {
    *POOL.write().unwrap_or_else(|e| e.into_inner()) = pool;
}

/// The pool kernels run on now.
pub fn pool() -> &'static dyn Pool {
    POOL.read()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or(&ScopedThreads)
}

/// How many threads `threads` means for `rows` rows of `elems` elements in all: 1 below the
/// pool's [`Pool::min_split`].
pub(crate) fn plan_threads(threads: usize, rows: usize, elems: usize) -> usize {
    if threads <= 1 || elems < pool().min_split() {
        1
    } else {
        threads.min(rows)
    }
}

/// Row ranges of `rows` rows in `threads` near-equal consecutive pieces.
pub(crate) fn row_ranges(rows: usize, threads: usize) -> Vec<Range<usize>> {
    let per = rows.div_ceil(threads.max(1)).max(1);
    (0..rows)
        .step_by(per)
        .map(|s| s..(s + per).min(rows))
        .collect()
}

/// Runs `work(range, piece)` once for every piece, on the pool with one thread per piece
/// (a single piece runs on the caller's thread).
pub(crate) fn run_pieces<P: Send>(
    pieces: Vec<(Range<usize>, P)>,
    work: impl Fn(Range<usize>, P) + Sync,
) {
    if pieces.len() <= 1 {
        pieces.into_iter().for_each(|(range, p)| work(range, p));
        return;
    }
    // each task takes its own piece out of its slot: the pool only shares `&self`
    let slots: Vec<Mutex<Option<_>>> = pieces.into_iter().map(|p| Mutex::new(Some(p))).collect();
    pool().run(slots.len(), slots.len(), &|i| {
        let piece = slots[i].lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some((range, p)) = piece {
            work(range, p);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn row_ranges_cover_the_rows() {
        for rows in 0..40 {
            for threads in 1..6 {
                let r = row_ranges(rows, threads);
                assert!(r.len() <= threads);
                let covered: Vec<usize> = r.iter().flat_map(|x| x.clone()).collect();
                assert_eq!(covered, (0..rows).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn scoped_threads_run_every_task_once() {
        for threads in 1..5 {
            for tasks in 0..9 {
                let seen: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                ScopedThreads.run(threads, tasks, &|i| {
                    seen[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(seen.iter().all(|s| s.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn run_pieces_hands_each_piece_to_one_task() {
        let mut out = vec![0usize; 10];
        let (a, b) = out.split_at_mut(4);
        run_pieces(vec![(0..4, a), (4..10, b)], |range, piece| {
            for (x, i) in piece.iter_mut().zip(range) {
                *x = i + 1;
            }
        });
        assert_eq!(out, (1..=10).collect::<Vec<_>>());
    }
}

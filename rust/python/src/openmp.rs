//! `share_openmp(path)`: the CPU kernels' pieces run on the threads of the OpenMP runtime
//! that a library already loaded in this process runs on (torch's `libtorch_cpu`): its
//! `GOMP_parallel` is looked up through that library, so it is the runtime the library's
//! own parallel regions bind to, even when other packages bring copies of their own
//! (sentencepiece's wheel, for one, ships a second libgomp).
//!
//! Without it each kernel call starts and joins threads of its own, next to OpenMP's worker
//! threads, which wait (spinning, then asleep) for torch's next product: on 2 cores the two
//! sets take turns on the same cores, and the kernels' split buys nothing. On the shared
//! runtime a kernel's split is one more parallel region of the same team.
//!
//! Only `GOMP_parallel` is used: libgomp's entry point for `#pragma omp parallel`, which LLVM's
//! libomp and Intel's libiomp5 also export for code compiled by GCC.

use std::ffi::{c_uint, c_void};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use ferrobatch_kernels::Pool;
use libloading::os::unix::{Library, Symbol};
use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;

/// `GOMP_parallel(fn, data, num_threads, flags)`: runs `fn(data)` on a team of
/// `num_threads` threads (the caller's among them) and returns when all have returned.
type GompParallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);

/// The fewest elements an elementwise call needs before it splits: waking the team's other
/// thread (spinning, or on a futex) costs a few microseconds, near torch's grain size.
const OPENMP_MIN_SPLIT: usize = 1 << 15;

struct OpenMp {
    path: String,
    parallel: GompParallel,
    /// keeps the runtime loaded as long as `parallel` may be called
    _lib: Library,
}

/// One parallel region's work: the tasks are taken in turn by whichever thread is free.
struct Region<'a> {
    task: &'a (dyn Fn(usize) + Sync),
    tasks: usize,
    next: AtomicUsize,
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

extern "C" fn run_region(data: *mut c_void) {
    // SAFETY: `data` is the `&Region` `OpenMp::run` passed to GOMP_parallel, which calls this
    // only before it returns; `run` keeps the region alive (on its stack) until then, and
    // the region is only read through shared references (atomics and a mutex inside).
    let region = unsafe { &*(data as *const Region<'_>) };
    loop {
        let i = region.next.fetch_add(1, Ordering::Relaxed);
        if i >= region.tasks {
            return;
        }
        // a panic must not unwind into the C runtime: keep the first, hand it over later
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| (region.task)(i))) {
            region
                .panic
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(p);
        }
    }
}

impl Pool for OpenMp {
    fn run(&self, threads: usize, tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        let threads = threads.min(tasks);
        if threads <= 1 {
            (0..tasks).for_each(task);
            return;
        }
        let region = Region {
            task,
            tasks,
            next: AtomicUsize::new(0),
            panic: Mutex::new(None),
        };
        let data = &region as *const Region<'_> as *mut c_void;
        let team = c_uint::try_from(threads).unwrap_or(c_uint::MAX);
        // SAFETY: `parallel` is the runtime's GOMP_parallel (its C signature is
        // `GompParallel`), kept loaded by `_lib`. It calls `run_region(data)` on each team
        // thread and returns only after all of them returned (the region's closing
        // barrier), so `region` outlives every use; `run_region` never unwinds.
        unsafe { (self.parallel)(run_region, data, team, 0) };
        if let Some(p) = region.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
            resume_unwind(p);
        }
    }

    fn min_split(&self) -> usize {
        OPENMP_MIN_SPLIT
    }
}

static SHARED: OnceLock<OpenMp> = OnceLock::new();

fn open(path: &str) -> Result<OpenMp, String> {
    // RTLD_NOLOAD: only a library this process has already loaded (the very instance torch
    // runs, with its threads), never a second copy
    // SAFETY: with RTLD_NOLOAD nothing is loaded, so no initialiser runs; the handle only
    // adds a reference to a library already in the process.
    let lib = unsafe { Library::open(Some(path), libc::RTLD_NOW | libc::RTLD_NOLOAD) }
        .map_err(|e| format!("{path} is not a library loaded in this process: {e}"))?;
    // dlsym through a handle searches the library, then its dependencies in load order: the
    // definition the library's own calls bind to.
    // SAFETY: GOMP_parallel has the C signature `GompParallel` in every runtime that exports
    // it (libgomp's ABI, kept by libomp and libiomp5).
    let sym: Symbol<GompParallel> = unsafe { lib.get(b"GOMP_parallel\0") }
        .map_err(|e| format!("{path} runs on no OpenMP runtime (no GOMP_parallel): {e}"))?;
    let parallel = *sym;
    Ok(OpenMp {
        path: path.to_owned(),
        parallel,
        _lib: lib,
    })
}

/// Runs the CPU kernels' threads on the OpenMP runtime of the library at `path` (already
/// loaded in this process: torch's `libtorch_cpu`); `None` goes back to threads started per
/// call. The first library given stays for the process (a later, different path is an
/// error).
#[pyfunction]
#[pyo3(signature = (path))]
pub fn share_openmp(path: Option<&str>) -> PyResult<()> {
    let Some(path) = path else {
        ferrobatch_kernels::set_pool(None);
        return Ok(());
    };
    let shared = match SHARED.get() {
        Some(s) if s.path != path => {
            return Err(PyOSError::new_err(format!(
                "the kernels already share the OpenMP runtime {}; {path} is another",
                s.path
            )))
        }
        Some(s) => s,
        None => {
            let omp = open(path).map_err(PyOSError::new_err)?;
            SHARED.get_or_init(|| omp)
        }
    };
    ferrobatch_kernels::set_pool(Some(shared as &'static dyn Pool));
    Ok(())
}

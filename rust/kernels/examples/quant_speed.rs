//! Quick timing of the quantized products (one thread): weight GB/s at m = 1..8 and GOP/s
//! at m = 512. `cargo run --release -p ferrobatch-kernels --example quant_speed [type] [n]
//! [k] [m...]`; `benches/quant_linear.py` is the bench of record. Past 8 rows it times the
//! panel kernels and the many-rows kernels interleaved (medians of 5). The weights lie on
//! transparent huge pages, as the engine's (`HUGE=0`: 4 KiB pages).

/// Nanoseconds this thread has run on a CPU (the machine is shared: wall time counts the
/// other processes' turns too).
fn cpu_ns() -> u64 {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
    s.split_whitespace().next().unwrap().parse().unwrap()
}

use ferrobatch_kernels::linear::LinearArgs;
use ferrobatch_kernels::quant::{
    linear, pack, packed_len, Backend, QType, MANY_ROWS_ENV, MAX_ROWS,
};

unsafe extern "C" {
    /// libc's `madvise(2)`.
    fn madvise(addr: *mut u8, len: usize, advice: i32) -> i32;
}

/// `madvise(2)`'s advice for transparent huge pages (Linux), on and off.
const MADV_HUGEPAGE: i32 = 14;
const MADV_NOHUGEPAGE: i32 = 15;
const HUGE_PAGE: usize = 2 << 20;

/// `copies` copies of `packed`, one after the other from a 2 MiB boundary of one buffer,
/// advised to lie on transparent huge pages (as the engine's packed weights:
/// `ferrobatch.cpu.pages.weight_empty`) or, with `huge` false, on 4 KiB pages; the buffer
/// and the offset of the first copy in it.
fn weight_copies(packed: &[u8], copies: usize, huge: bool) -> (Vec<u8>, usize) {
    let total = copies * packed.len() + 2 * HUGE_PAGE;
    let mut buf: Vec<u8> = Vec::with_capacity(total);
    let base = buf.as_mut_ptr() as usize;
    let first = base.next_multiple_of(HUGE_PAGE) - base;
    // SAFETY: madvise only advises the kernel on how to back pages of this process's own
    // allocation (`first .. first + copies * len` lies inside `buf`'s capacity, untouched
    // so far); it reads and writes no memory and changes no value, whatever its result.
    unsafe {
        let advice = if huge { MADV_HUGEPAGE } else { MADV_NOHUGEPAGE };
        madvise(buf.as_mut_ptr().add(first), copies * packed.len(), advice);
    }
    buf.resize(total, 0);
    for c in 0..copies {
        let at = first + c * packed.len();
        buf[at..at + packed.len()].copy_from_slice(packed);
    }
    (buf, first)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let types: Vec<QType> = match args.first() {
        Some(t) if t != "all" => vec![QType::from_name(t).expect("type")],
        _ => QType::ALL.to_vec(),
    };
    let n: usize = args.get(1).map_or(1536, |s| s.parse().unwrap());
    let k: usize = args.get(2).map_or(1536, |s| s.parse().unwrap());
    let ms: Vec<usize> = if args.len() > 3 {
        args[3..].iter().map(|s| s.parse().unwrap()).collect()
    } else {
        vec![1, 4, 8, 512]
    };
    let backend = Backend::auto();
    // COLD=1: rotate through copies of the weights, 512 MiB in all (past the L3 cache)
    let cold = std::env::var("COLD").is_ok_and(|v| v == "1");
    if cold {
        // read bandwidth: sums of a 1 GiB array
        let big: Vec<u64> = (0..1u64 << 27).collect();
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let t = cpu_ns();
            let s: u64 = big.iter().fold(0u64, |a, &v| a.wrapping_add(v));
            std::hint::black_box(s);
            best = best.min((cpu_ns() - t) as f64 * 1e-9);
        }
        println!(
            "read bandwidth (1 GiB u64 sum): {:.1} GB/s",
            8.0 * big.len() as f64 / best / 1e9
        );
    }
    for qt in types {
        let nb = k / qt.block();
        let mut state = 0x1234_5678u64;
        let mut rows: Vec<u8> = (0..n * nb * qt.block_bytes())
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                (state >> 56) as u8
            })
            .collect();
        // sane fp16 factors (0.01) in every block
        let at: &[usize] = match qt {
            QType::Q8_0 | QType::Q4_0 | QType::Q5_0 | QType::IQ4_NL => &[0],
            QType::Q4_1 | QType::Q4_K | QType::Q5_K | QType::Q5_1 => &[0, 2],
            QType::Q6_K => &[208],
            QType::Q3_K => &[108],
            QType::Q2_K => &[80, 82],
            QType::IQ4_XS => &[0],
            QType::MXFP4 => &[],
        };
        for b in rows.chunks_exact_mut(qt.block_bytes()) {
            for &a in at {
                b[a..a + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
            }
            if qt == QType::MXFP4 {
                b[0] = 121; // (2^-7: weights of order 0.01)
            }
        }
        let mut packed = vec![0u8; packed_len(qt, n, k).unwrap()];
        pack(qt, &rows, n, k, &mut packed, 1).unwrap();
        let copies = if cold {
            (512 << 20) / packed.len() + 1
        } else {
            1
        };
        // HUGE=0: the weights on 4 KiB pages (the engine's: huge pages)
        let huge = std::env::var("HUGE").map_or(true, |v| v != "0");
        let (buf, first) = weight_copies(&packed, copies, huge);
        let all: Vec<&[u8]> = buf[first..]
            .chunks_exact(packed.len())
            .take(copies)
            .collect();
        for &m in &ms {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
                .collect();
            let mut out = vec![0f32; m * n];
            let args = LinearArgs {
                m,
                n,
                k,
                threads: 1,
            };
            // (schedstat moves at scheduler ticks: loops of 0.25 s or more)
            let t = std::time::Instant::now();
            linear(qt, &args, &x, all[0], &mut out, backend).unwrap();
            let once = t.elapsed().as_secs_f64();
            let reps = ((0.25 / once) as usize).max(3).max(copies);
            // m > MAX_ROWS: the panel kernels ("few", many-rows threshold set past m) and
            // the many-rows kernels ("many"), interleaved, median of 5
            let arms: &[(&str, Option<&str>)] = if m > MAX_ROWS {
                &[("few", Some("1000000000")), ("many", None)]
            } else {
                &[("", None)]
            };
            let mut times = vec![Vec::new(); arms.len()];
            for _ in 0..5 {
                for (arm, (_, env)) in arms.iter().enumerate() {
                    // SAFETY (of set_var / remove_var): this program runs no other thread
                    // while it changes the environment (linear's threads: 1).
                    unsafe {
                        match env {
                            Some(v) => std::env::set_var(MANY_ROWS_ENV, v),
                            None => std::env::remove_var(MANY_ROWS_ENV),
                        }
                    }
                    let t = cpu_ns();
                    for r in 0..reps {
                        linear(qt, &args, &x, all[r % copies], &mut out, backend).unwrap();
                    }
                    times[arm].push((cpu_ns() - t) as f64 * 1e-9 / reps as f64);
                }
            }
            for ((name, _), t) in arms.iter().zip(&mut times) {
                t.sort_by(f64::total_cmp);
                let med = t[t.len() / 2];
                println!(
                    "{:5} {}x{} m={:4} {:4} {:9.1} us  {:6.1} GB/s weights  {:7.1} GOP/s",
                    qt.name(),
                    n,
                    k,
                    m,
                    name,
                    med * 1e6,
                    packed.len() as f64 / med / 1e9,
                    2.0 * (m * n * k) as f64 / med / 1e9
                );
            }
        }
    }
}

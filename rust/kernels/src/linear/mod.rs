//! What every matrix product over a packed weight shares, `out [m, n] = x [m, k] @ W.T`
//! (`W` [n, k], row-major as `nn.Linear` keeps it, packed once):
//!
//! * [`LinearArgs`], a call's shapes and threads;
//! * [`Layout`], a packed weight format (its length, its rule on `k`, how it packs), and
//!   [`pack`], the checked packing every format's public `pack` is;
//! * [`Product`], a product's name in its errors, and [`Product::begin`], the checks every
//!   product makes before it runs (`k`, the slices' lengths, an empty call, the CPU);
//! * [`OutColumns`], the output shared between the tasks of one call, each writing only its
//!   own columns;
//! * the two packed layouts and their drivers: [`pair_blocks`] (bf16 pairs in 16 x 32
//!   blocks: [`crate::amx`], on AMX tiles or AVX-512 BF16) and [`panels`] (column blocks of
//!   16 in panels of 4, and the generic pass over them: [`crate::f32_linear`],
//!   [`crate::i16_linear`]).
//!
//! A kernel module depends on this one and on no other kernel module. A new weight format
//! (a GGUF block quantization, say) is one more kernel module: a [`Layout`] for its packed
//! form, a [`Product`] for its errors and, where its columns fit panels of 16, a
//! [`panels::PanelKernel`] whose `dot` is its k loop (the input, packed and sum types are
//! the kernel's own).

pub mod pair_blocks;
pub mod panels;

use crate::error::{Expected, KernelError};

/// The shapes of one product call.
#[derive(Clone, Copy, Debug)]
pub struct LinearArgs {
    /// rows of `x` and `out`
    pub m: usize,
    /// output columns (the weight's rows)
    pub n: usize,
    /// inputs (the weight's columns)
    pub k: usize,
    /// at most this many threads (column blocks are split between them)
    pub threads: usize,
}

pub(crate) fn round_up(v: usize, to: usize) -> usize {
    v.div_ceil(to) * to
}

/// A packed weight format.
pub(crate) trait Layout {
    /// The element of both the weight and its packed form (bf16 bits as `u16`, f32, i16).
    type Elem: Copy;

    /// Elements of the packed form of an `[n, k]` weight.
    fn packed_len(n: usize, k: usize) -> usize;

    /// `Ok` where the format takes `k` inputs (any, unless it packs inputs in groups).
    fn check_k(_k: usize) -> Result<(), KernelError> {
        Ok(())
    }

    /// Packs `weight` [n, k] into `out` (`packed_len(n, k)` elements; both lengths and `k`
    /// already checked).
    fn pack_into(weight: &[Self::Elem], n: usize, k: usize, out: &mut [Self::Elem]);
}

/// Packs `weight` [n, k] into `out` in the layout `L`, after checking `k` and both lengths
/// (an error names `k`, `weight` or `out`).
pub(crate) fn pack<L: Layout>(
    weight: &[L::Elem],
    n: usize,
    k: usize,
    out: &mut [L::Elem],
) -> Result<(), KernelError> {
    L::check_k(k)?;
    KernelError::check_len("weight", weight.len(), n * k, Expected::NotFormula("n * k"))?;
    KernelError::check_len("out", out.len(), L::packed_len(n, k), Expected::NotN)?;
    L::pack_into(weight, n, k, out);
    Ok(())
}

/// How a product's length errors spell the counts they wanted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Spelling {
    /// `x has 5 elements, not m * k = 6`, `packed has 5 elements, not 6 for n = 2, k = 3`
    /// (the bf16 products; a new product spells this way).
    Formulas,
    /// `x has 5 elements, not 6`: `f32_linear`'s and `i16_linear`'s messages, as Python
    /// has always seen them.
    Counts,
}

/// The lengths of one product call's slices (`bias`: None without one).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lengths {
    pub x: usize,
    pub packed: usize,
    pub out: usize,
    pub bias: Option<usize>,
}

/// How a product names itself in its errors.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Product {
    /// the kernel's name: the field of its "not available" error (`"amx"`, `"f32_linear"`)
    pub name: &'static str,
    /// what a CPU it does not run on lacks (`"no AVX-512F"`)
    pub cpu_lacks: &'static str,
    pub spelling: Spelling,
}

impl Product {
    /// The checks every product makes before it runs, in this order: `k` (the layout's
    /// rule), the lengths of `x` [m, k], the packed weight, `out` [m, n] and `bias` [n] (an
    /// error names the slice); then `Ok(false)` where there is nothing to compute (`m` or
    /// `n` is 0), an [`KernelError::Unavailable`] error where `available()` is false, else
    /// `Ok(true)`.
    pub(crate) fn begin<L: Layout>(
        &self,
        args: &LinearArgs,
        lens: Lengths,
        available: impl FnOnce() -> bool,
    ) -> Result<bool, KernelError> {
        let LinearArgs { m, n, k, .. } = *args;
        L::check_k(k)?;
        let (x, packed, out) = match self.spelling {
            Spelling::Formulas => (
                Expected::NotFormula("m * k"),
                Expected::NotPackedFor { n, k },
                Expected::NotFormula("m * n"),
            ),
            Spelling::Counts => (Expected::NotN, Expected::NotN, Expected::NotN),
        };
        KernelError::check_len("x", lens.x, m * k, x)?;
        KernelError::check_len("packed", lens.packed, L::packed_len(n, k), packed)?;
        KernelError::check_len("out", lens.out, m * n, out)?;
        if let Some(bias) = lens.bias {
            KernelError::check_len("bias", bias, n, Expected::NotFormula("n"))?;
        }
        if m == 0 || n == 0 {
            return Ok(false);
        }
        if !available() {
            return Err(KernelError::Unavailable {
                kernel: self.name,
                cpu_lacks: self.cpu_lacks,
            });
        }
        Ok(true)
    }
}

/// `out` [m, n] shared between the tasks of one product call, each of which writes only the
/// columns of its own column blocks.
pub(crate) struct OutColumns<T = f32> {
    ptr: *mut T,
    m: usize,
    n: usize,
}

// SAFETY: the pointer is only written through `OutColumns::write_cols` / `write_block` and,
// by the AMX tile stores, at the addresses `OutColumns::block` returns (blocks that lie
// inside `out`), always of the calling task's own column blocks; the tasks of one product
// call get disjoint column blocks, so no element is written by two threads, and the slice
// it came from is borrowed mutably by that call until every task has returned.
unsafe impl<T: Send> Sync for OutColumns<T> {}

impl<T: Copy> OutColumns<T> {
    /// `out` [m, n] (its length checked), written only through this until it is dropped:
    /// the caller keeps `out` borrowed while the tasks run.
    pub(crate) fn new(out: &mut [T], m: usize, n: usize) -> Self {
        assert_eq!(out.len(), m * n, "out must hold m * n elements");
        OutColumns {
            ptr: out.as_mut_ptr(),
            m,
            n,
        }
    }

    /// Output columns (the row stride).
    pub(crate) fn n(&self) -> usize {
        self.n
    }

    /// Writes `sums` (row `row`, columns `col0..col0 + sums.len()`), keeping to the columns
    /// below `n`; a row at or past `m` is dropped.
    pub(crate) fn write_cols(&self, row: usize, col0: usize, sums: &[T]) {
        let cols = self.n.saturating_sub(col0).min(sums.len());
        if row >= self.m || cols == 0 {
            return;
        }
        let at = row * self.n + col0;
        debug_assert!(at + cols <= self.m * self.n);
        // SAFETY: `at + cols <= m * n` (row < m, col0 + cols <= n), inside the slice behind
        // `ptr`; the columns belong to this task alone (see `Sync` above).
        let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), cols) };
        dst.copy_from_slice(&sums[..cols]);
    }

    /// Where the block of `rows` rows from `row0` and `cols` columns from `col0` starts in
    /// `out`, when all of it lies inside (else None: see `write_block`).
    pub(crate) fn block(
        &self,
        row0: usize,
        col0: usize,
        rows: usize,
        cols: usize,
    ) -> Option<*mut T> {
        (row0 + rows <= self.m && col0 + cols <= self.n)
            .then(|| self.ptr.wrapping_add(row0 * self.n + col0))
    }

    /// Writes `block` (`rows` rows of `width` values: rows `row0..`, columns `col0..`),
    /// keeping to the rows below `m` and the columns below `n`.
    pub(crate) fn write_block(
        &self,
        row0: usize,
        col0: usize,
        block: &[T],
        rows: usize,
        width: usize,
    ) {
        let rows = self.m.saturating_sub(row0).min(rows);
        let cols = self.n.saturating_sub(col0).min(width);
        if cols == 0 {
            return; // a padding block
        }
        for r in 0..rows {
            let src = &block[r * width..r * width + cols];
            let at = (row0 + r) * self.n + col0;
            debug_assert!(at + cols <= self.m * self.n);
            // SAFETY: `at + cols <= m * n` (row0 + r < m, col0 + cols <= n), inside the
            // slice behind `ptr`; the columns belong to this task alone (see `Sync` above).
            let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), cols) };
            dst.copy_from_slice(src);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layout of 2 elements per weight element, k even.
    struct Doubled;

    impl Layout for Doubled {
        type Elem = u8;
        fn packed_len(n: usize, k: usize) -> usize {
            2 * n * k
        }
        fn check_k(k: usize) -> Result<(), KernelError> {
            if k.is_multiple_of(2) {
                Ok(())
            } else {
                KernelError::invalid("k", format!("k must be even, not {k}"))
            }
        }
        fn pack_into(weight: &[u8], _: usize, _: usize, out: &mut [u8]) {
            for (o, w) in out.chunks_exact_mut(2).zip(weight) {
                o.fill(*w);
            }
        }
    }

    const ARGS: LinearArgs = LinearArgs {
        m: 2,
        n: 3,
        k: 4,
        threads: 1,
    };

    fn lengths() -> Lengths {
        Lengths {
            x: 8,
            packed: 24,
            out: 6,
            bias: Some(3),
        }
    }

    #[test]
    fn pack_checks_k_then_the_lengths() {
        let mut out = [0u8; 12];
        pack::<Doubled>(&[1, 2, 3, 4, 5, 6], 3, 2, &mut out).unwrap();
        assert_eq!(out, [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]);
        let field = |r: Result<(), KernelError>| r.unwrap_err().field();
        assert_eq!(field(pack::<Doubled>(&[0; 3], 3, 1, &mut out)), Some("k"));
        let e = pack::<Doubled>(&[0; 5], 3, 2, &mut out).unwrap_err();
        assert_eq!(e.to_string(), "weight has 5 elements, not n * k = 6");
        let e = pack::<Doubled>(&[0; 6], 3, 2, &mut out[1..]).unwrap_err();
        assert_eq!(e.to_string(), "out has 11 elements, not 12");
    }

    #[test]
    fn begin_checks_in_order_and_spells_as_asked() {
        let formulas = Product {
            name: "doubled",
            cpu_lacks: "no doubling",
            spelling: Spelling::Formulas,
        };
        let counts = Product {
            spelling: Spelling::Counts,
            ..formulas
        };
        assert_eq!(
            formulas.begin::<Doubled>(&ARGS, lengths(), || true),
            Ok(true)
        );
        let e = |p: &Product, lens, args: &LinearArgs| {
            p.begin::<Doubled>(args, lens, || true)
                .unwrap_err()
                .to_string()
        };
        let bad_x = Lengths { x: 7, ..lengths() };
        assert_eq!(
            e(&formulas, bad_x, &ARGS),
            "x has 7 elements, not m * k = 8"
        );
        assert_eq!(e(&counts, bad_x, &ARGS), "x has 7 elements, not 8");
        let bad_packed = Lengths {
            packed: 1,
            ..lengths()
        };
        assert_eq!(
            e(&formulas, bad_packed, &ARGS),
            "packed has 1 elements, not 24 for n = 3, k = 4"
        );
        assert_eq!(
            e(&counts, bad_packed, &ARGS),
            "packed has 1 elements, not 24"
        );
        let bad_out = Lengths {
            out: 5,
            ..lengths()
        };
        assert_eq!(
            e(&formulas, bad_out, &ARGS),
            "out has 5 elements, not m * n = 6"
        );
        let bad_bias = Lengths {
            bias: Some(2),
            ..lengths()
        };
        assert_eq!(
            e(&counts, bad_bias, &ARGS),
            "bias has 2 elements, not n = 3"
        );
        // k first, then x before packed
        let odd = LinearArgs { k: 3, ..ARGS };
        let all_bad = Lengths {
            x: 0,
            packed: 0,
            out: 0,
            bias: Some(0),
        };
        assert_eq!(e(&counts, all_bad, &odd), "k must be even, not 3");
        assert_eq!(e(&counts, all_bad, &ARGS), "x has 0 elements, not 8");
        // an empty call asks nothing of the CPU; a real one does
        let empty = LinearArgs { m: 0, ..ARGS };
        let empty_lens = Lengths {
            x: 0,
            out: 0,
            ..lengths()
        };
        let never = || -> bool { panic!("asked the CPU of an empty call") };
        assert_eq!(
            formulas.begin::<Doubled>(&empty, empty_lens, never),
            Ok(false)
        );
        let e = formulas
            .begin::<Doubled>(&ARGS, lengths(), || false)
            .unwrap_err();
        assert_eq!(e.field(), Some("doubled"));
        assert_eq!(
            e.to_string(),
            "doubled is not available: this CPU has no doubling"
        );
    }

    #[test]
    fn out_columns_keep_to_the_matrix() {
        let mut out = vec![0i32; 3 * 5];
        {
            let o = OutColumns::new(&mut out, 3, 5);
            o.write_cols(1, 3, &[7, 8, 9]); // column 5 dropped
            o.write_cols(3, 0, &[1]); // row 3 dropped
            assert!(o.block(0, 0, 3, 5).is_some());
            assert!(o.block(1, 1, 3, 4).is_none());
            o.write_block(2, 4, &[5, 6, 7, 8], 2, 2); // one row, one column inside
        }
        assert_eq!(out[8..10], [7, 8]);
        assert_eq!(out[14], 5);
        assert_eq!(out.iter().filter(|&&v| v != 0).count(), 3);
    }
}

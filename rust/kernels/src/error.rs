//! The crate's one error type: every kernel checks its arguments before it reads or writes
//! anything and answers a bad call with a [`KernelError`] saying what was wrong. The PyO3
//! layer raises it as `ferrobatch.errors.FieldError(str(error), error.field())`.

use std::fmt;

/// What is wrong with a kernel call. `field` names the argument at fault as the Python
/// bindings spell it; [`KernelError::Layout`] blames no single argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// `field` has `got` elements where the call's shapes need `want`; `expected` is how
    /// the message spells `want`.
    Length {
        field: &'static str,
        got: usize,
        want: usize,
        expected: Expected,
    },
    /// The element count of `field` (a product of the call's sizes) overflows `usize`.
    Overflow { field: &'static str },
    /// A value of `field` the kernel does not take; `message` (the whole message, which
    /// starts with the field's name) says which and why.
    Invalid {
        field: &'static str,
        message: String,
    },
    /// The kernel `kernel` does not run on this CPU, which has `cpu_lacks` (spelled
    /// "no AVX-512F", "neither ... nor ...").
    Unavailable {
        kernel: &'static str,
        cpu_lacks: &'static str,
    },
    /// The arguments do not fit together (a table, a count and a length that disagree),
    /// no one of them at fault.
    Layout(String),
}

/// How a [`KernelError::Length`] message spells the count it wanted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expected {
    /// `x has 5 elements, expected 6`
    ExpectedN,
    /// `x has 5 elements, not 6`
    NotN,
    /// `x has 5 elements, not m * k = 6`: the formula of the count
    NotFormula(&'static str),
    /// `packed has 5 elements, not 6 for n = 2, k = 3`: a packed weight's length
    NotPackedFor { n: usize, k: usize },
}

impl KernelError {
    /// `Err(Invalid { field, message })`.
    pub fn invalid<T>(field: &'static str, message: String) -> Result<T, KernelError> {
        Err(KernelError::Invalid { field, message })
    }

    /// `Ok` when `got == want`, else a [`KernelError::Length`] of `field`.
    pub fn check_len(
        field: &'static str,
        got: usize,
        want: usize,
        expected: Expected,
    ) -> Result<(), KernelError> {
        if got == want {
            Ok(())
        } else {
            Err(KernelError::Length {
                field,
                got,
                want,
                expected,
            })
        }
    }

    /// The argument at fault (the kernel's name for [`KernelError::Unavailable`]; none for
    /// [`KernelError::Layout`]).
    pub fn field(&self) -> Option<&'static str> {
        match self {
            KernelError::Length { field, .. }
            | KernelError::Overflow { field }
            | KernelError::Invalid { field, .. } => Some(field),
            KernelError::Unavailable { kernel, .. } => Some(kernel),
            KernelError::Layout(_) => None,
        }
    }

    /// The same message blamed on `field` (a part's error seen by a caller that knows which
    /// of its own arguments caused it).
    pub fn on(self, field: &'static str) -> KernelError {
        KernelError::Invalid {
            field,
            message: self.to_string(),
        }
    }
}

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KernelError::Length {
                field,
                got,
                want,
                expected,
            } => {
                write!(f, "{field} has {got} elements, ")?;
                match expected {
                    Expected::ExpectedN => write!(f, "expected {want}"),
                    Expected::NotN => write!(f, "not {want}"),
                    Expected::NotFormula(formula) => write!(f, "not {formula} = {want}"),
                    Expected::NotPackedFor { n, k } => write!(f, "not {want} for n = {n}, k = {k}"),
                }
            }
            KernelError::Overflow { field } => write!(f, "{field}: size overflows"),
            KernelError::Invalid { message, .. } | KernelError::Layout(message) => {
                f.write_str(message)
            }
            KernelError::Unavailable { kernel, cpu_lacks } => {
                write!(f, "{kernel} is not available: this CPU has {cpu_lacks}")
            }
        }
    }
}

impl std::error::Error for KernelError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_field_and_the_counts() {
        let len = |expected| KernelError::Length {
            field: "x",
            got: 5,
            want: 6,
            expected,
        };
        assert_eq!(
            len(Expected::ExpectedN).to_string(),
            "x has 5 elements, expected 6"
        );
        assert_eq!(len(Expected::NotN).to_string(), "x has 5 elements, not 6");
        assert_eq!(
            len(Expected::NotFormula("m * k")).to_string(),
            "x has 5 elements, not m * k = 6"
        );
        assert_eq!(
            len(Expected::NotPackedFor { n: 2, k: 3 }).to_string(),
            "x has 5 elements, not 6 for n = 2, k = 3"
        );
        assert_eq!(len(Expected::NotN).field(), Some("x"));
        let e = KernelError::Unavailable {
            kernel: "f32_linear",
            cpu_lacks: "no AVX-512F",
        };
        assert_eq!(
            e.to_string(),
            "f32_linear is not available: this CPU has no AVX-512F"
        );
        assert_eq!(e.field(), Some("f32_linear"));
        let e = KernelError::Layout("seqlens[0] = 0: every row needs at least one key".into());
        assert_eq!(e.field(), None);
        let on = e.clone().on("block_tables");
        assert_eq!(on.field(), Some("block_tables"));
        assert_eq!(on.to_string(), e.to_string());
        assert_eq!(
            KernelError::Overflow { field: "src" }.to_string(),
            "src: size overflows"
        );
    }
}

"""Speculative decoding: proposals (n-gram prompt lookup, a draft model), verification in
one forward, acceptance in the Rust core (ARCHITECTURE.md §3, speculative rows)."""

from ferrobatch.spec.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]

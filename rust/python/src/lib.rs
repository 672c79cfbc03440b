//! PyO3 layer

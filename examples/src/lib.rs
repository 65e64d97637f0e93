//! Examples live under `examples/`.

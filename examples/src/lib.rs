#![doc = include_str!("../../README.md")]
//!
//! (This crate holds the runnable examples; its docs are the repository
//! README, so every Rust example in the README compiles as a doctest.)

//! Tests that drive the running controller through its registers and raw queue memory.

mod harness;
mod admin_tests;
mod io_tests;
mod lifecycle_tests;
mod throughput;

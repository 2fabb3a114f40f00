//! Tests that drive the running controller through its registers and raw queue memory.

mod admin_tests;
mod configuration_tests;
mod copied_tests;
mod deallocate_tests;
mod durability_tests;
mod harness;
mod held_transfer_tests;
mod in_flight_tests;
mod io_tests;
mod lifecycle_tests;
mod shadow_tests;
mod stall_tests;
mod throughput;
mod timing_tests;

//! NVMe conformance suite (being written).

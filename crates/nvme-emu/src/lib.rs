//! Software NVMe controller (being written).

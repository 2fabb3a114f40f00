//! Object store: GPU-file / NVMe-file pools and the layer-wise KV API. Filled by the object-store issue.

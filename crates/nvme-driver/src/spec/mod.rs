//! NVMe specification types (NVM Express Base Specification 2.0 and NVM Command Set 1.0).
//!
//! Plain data, no unsafe: register layouts, the 64-byte submission entry, the 16-byte completion
//! entry, status codes, Identify data and data pointers (PRP and SGL). Field names follow the spec
//! (`cdw10`, `csts.rdy`) with a doc line each; section numbers refer to the Base Specification 2.0
//! unless marked "NVM".

pub mod command;
pub mod completion;
pub mod data_pointer;
pub mod identify;
pub mod registers;
pub mod status;

pub use command::{AdminOpcode, FeatureId, LogPageId, NvmOpcode, SubmissionEntry};
pub use completion::CompletionEntry;
pub use data_pointer::{SglDescriptor, SglDescriptorType};
pub use identify::{IdentifyController, IdentifyNamespace, LbaFormat};
pub use status::{NvmeStatus, StatusCodeType};

/// Size of one submission queue entry (§4.2): 2^6.
pub const SUBMISSION_ENTRY_BYTES: usize = 64;
/// Size of one completion queue entry (§4.6): 2^4.
pub const COMPLETION_ENTRY_BYTES: usize = 16;
/// Identify data structures are 4096 bytes (§5.17.2).
pub const IDENTIFY_BYTES: usize = 4096;

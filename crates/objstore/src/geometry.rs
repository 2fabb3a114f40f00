//! Model geometry: what one KV object (one layer's K or V of one engine block) weighs.

use std::fmt;

use crate::error::{ObjstoreError, Result};

/// The shape of a model's KV cache as the object store sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelGeometry {
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Bytes per element (2 for bf16/fp16, 1 for fp8).
    pub dtype_bytes: u32,
    /// Tokens per engine block (16–64 in vLLM/SGLang).
    pub block_tokens: u32,
}

impl fmt::Display for ModelGeometry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} layers x {} KV heads x dim {} x {} B, {} tokens/block",
            self.layers, self.kv_heads, self.head_dim, self.dtype_bytes, self.block_tokens
        )
    }
}

/// Largest value accepted for any one geometry field: keeps every product below in u64 range
/// with room to spare and rejects garbage read from a corrupt superblock.
const FIELD_MAX: u32 = 1 << 16;
/// Largest object accepted: one NVMe command's u32 byte count with a margin.
const OBJECT_BYTES_MAX: u64 = 1 << 30;

impl ModelGeometry {
    /// Llama-3/3.1-8B: 32 layers, 8 KV heads (GQA), head dim 128, bf16.
    pub fn llama3_8b(block_tokens: u32) -> Self {
        Self { layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2, block_tokens }
    }

    /// Qwen3-32B: 64 layers, 8 KV heads, head dim 128, bf16.
    pub fn qwen3_32b(block_tokens: u32) -> Self {
        Self { layers: 64, kv_heads: 8, head_dim: 128, dtype_bytes: 2, block_tokens }
    }

    /// Llama-3/3.1-70B: 80 layers, 8 KV heads, head dim 128, bf16.
    pub fn llama3_70b(block_tokens: u32) -> Self {
        Self { layers: 80, kv_heads: 8, head_dim: 128, dtype_bytes: 2, block_tokens }
    }

    /// A preset by name (`llama3-8b`, `qwen3-32b`, `llama3-70b`), for tools.
    pub fn preset(name: &str, block_tokens: u32) -> Option<Self> {
        match name {
            "llama3-8b" | "llama3.1-8b" => Some(Self::llama3_8b(block_tokens)),
            "qwen3-32b" => Some(Self::qwen3_32b(block_tokens)),
            "llama3-70b" | "llama3.1-70b" => Some(Self::llama3_70b(block_tokens)),
            _ => None,
        }
    }

    pub fn validate(&self) -> Result<()> {
        let fields = [
            ("layers", self.layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("dtype_bytes", self.dtype_bytes),
            ("block_tokens", self.block_tokens),
        ];
        for (name, value) in fields {
            if value == 0 || value > FIELD_MAX {
                return Err(ObjstoreError::InvalidGeometry { reason: format!("{name} = {value}, expected 1..={FIELD_MAX}") });
            }
        }
        // One object must fit one NVMe command's u32 byte count with a margin. Four fields of
        // up to 2^16 can multiply to 2^64: the product is checked, not wrapped.
        let object_bytes = self.checked_object_bytes().ok_or_else(|| ObjstoreError::InvalidGeometry {
            reason: format!(
                "an object of {} tokens x {} KV heads x dim {} x {} B overflows 64 bits",
                self.block_tokens, self.kv_heads, self.head_dim, self.dtype_bytes
            ),
        })?;
        if object_bytes > OBJECT_BYTES_MAX {
            return Err(ObjstoreError::InvalidGeometry { reason: format!("object of {object_bytes} bytes exceeds 1 GiB") });
        }
        Ok(())
    }

    /// Bytes of one object, `None` if the product overflows (only an unvalidated geometry can).
    pub fn checked_object_bytes(&self) -> Option<u64> {
        u64::from(self.block_tokens)
            .checked_mul(u64::from(self.kv_heads))?
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(u64::from(self.dtype_bytes))
    }

    /// Bytes of one object: one layer's K (or V) of one block. Exact for a geometry that passed
    /// [`ModelGeometry::validate`] (at most 1 GiB); an unvalidated one that overflows saturates
    /// at `u64::MAX` (never wraps to a small, plausible size).
    pub fn object_bytes(&self) -> u64 {
        self.checked_object_bytes().unwrap_or(u64::MAX)
    }

    /// Bytes of one GPU file: a block's 2 x L objects (at most 2^47 once validated; saturates
    /// like [`ModelGeometry::object_bytes`] otherwise).
    pub fn block_bytes(&self) -> u64 {
        self.object_bytes().saturating_mul(2 * u64::from(self.layers))
    }

    /// KV bytes per token across all layers (Llama-3.1-8B bf16: 128 KiB).
    pub fn token_bytes(&self) -> u64 {
        self.block_bytes() / u64::from(self.block_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_match_the_brief_bytes_per_token() {
        // Goal: the per-token figures of DESIGN-BRIEF §6 (128/256/320 KiB) fall out of the presets.
        assert_eq!(ModelGeometry::llama3_8b(16).token_bytes(), 128 << 10);
        assert_eq!(ModelGeometry::qwen3_32b(16).token_bytes(), 256 << 10);
        assert_eq!(ModelGeometry::llama3_70b(16).token_bytes(), 320 << 10);
        assert_eq!(ModelGeometry::llama3_8b(32).object_bytes(), 64 << 10);
        assert_eq!(ModelGeometry::preset("qwen3-32b", 16), Some(ModelGeometry::qwen3_32b(16)));
        assert_eq!(ModelGeometry::preset("gpt-9", 16), None);
    }

    #[test]
    fn zero_or_huge_fields_are_refused_by_name() {
        let bad = ModelGeometry { head_dim: 0, ..ModelGeometry::llama3_8b(16) };
        let message = bad.validate().unwrap_err().to_string();
        assert!(message.contains("head_dim = 0"), "{message}");
        let huge = ModelGeometry { layers: FIELD_MAX + 1, ..ModelGeometry::llama3_8b(16) };
        assert!(huge.validate().is_err());
    }

    #[test]
    fn extreme_fields_are_a_typed_error_not_an_overflow() {
        // Goal: every field at its accepted maximum multiplies to 2^64, which wrapped to an
        // object of 0 bytes (or panicked in a debug build); it is now refused by name.
        let extreme =
            ModelGeometry { layers: FIELD_MAX, kv_heads: FIELD_MAX, head_dim: FIELD_MAX, dtype_bytes: FIELD_MAX, block_tokens: FIELD_MAX };
        assert_eq!(extreme.checked_object_bytes(), None);
        let message = extreme.validate().unwrap_err().to_string();
        assert!(message.contains("overflows 64 bits"), "{message}");
        assert_eq!(extreme.object_bytes(), u64::MAX, "saturates, never wraps");
        assert_eq!(extreme.block_bytes(), u64::MAX);
        // Just under the 1 GiB cap is accepted; just over it is not.
        let big = ModelGeometry { layers: 1, kv_heads: 1 << 14, head_dim: 1 << 14, dtype_bytes: 4, block_tokens: 1 };
        assert!(big.validate().is_ok());
        let bigger = ModelGeometry { block_tokens: 2, ..big };
        assert!(bigger.validate().unwrap_err().to_string().contains("exceeds 1 GiB"));
    }
}

//! `ModelGeometry`: objstore's model geometry for Python.

use objstore::ModelGeometry as Geometry;
use pyo3::prelude::*;

use crate::errors::Failure;

/// The shape of a model's KV cache (module stub: `ModelGeometry`).
#[pyclass(frozen, eq, module = "tutti", name = "ModelGeometry")]
#[derive(Clone, PartialEq, Eq)]
pub struct ModelGeometry {
    pub(crate) inner: Geometry,
}

/// The geometry tuttid's Hello reply announces.
pub fn of_hello(shape: &tutti_daemon::protocol::PoolShape) -> Geometry {
    Geometry {
        layers: shape.layers,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        dtype_bytes: shape.dtype_bytes,
        block_tokens: shape.block_tokens,
    }
}

impl ModelGeometry {
    pub fn from_inner(inner: Geometry) -> ModelGeometry {
        ModelGeometry { inner }
    }
}

#[pymethods]
impl ModelGeometry {
    #[new]
    fn new(layers: u32, kv_heads: u32, head_dim: u32, dtype_bytes: u32, block_tokens: u32) -> PyResult<ModelGeometry> {
        let inner = Geometry { layers, kv_heads, head_dim, dtype_bytes, block_tokens };
        inner.validate().map_err(Failure::from)?;
        Ok(ModelGeometry { inner })
    }

    #[staticmethod]
    fn preset(name: &str, block_tokens: u32) -> PyResult<ModelGeometry> {
        let inner = Geometry::preset(name, block_tokens).ok_or_else(|| {
            Failure::new(
                crate::errors::ErrorClass::InvalidArgument,
                format!("no model preset {name:?}: llama3-8b, qwen3-32b or llama3-70b"),
            )
        })?;
        inner.validate().map_err(Failure::from)?;
        Ok(ModelGeometry { inner })
    }

    #[getter]
    fn layers(&self) -> u32 {
        self.inner.layers
    }

    #[getter]
    fn kv_heads(&self) -> u32 {
        self.inner.kv_heads
    }

    #[getter]
    fn head_dim(&self) -> u32 {
        self.inner.head_dim
    }

    #[getter]
    fn dtype_bytes(&self) -> u32 {
        self.inner.dtype_bytes
    }

    #[getter]
    fn block_tokens(&self) -> u32 {
        self.inner.block_tokens
    }

    #[getter]
    fn object_bytes(&self) -> u64 {
        self.inner.object_bytes()
    }

    #[getter]
    fn block_bytes(&self) -> u64 {
        self.inner.block_bytes()
    }

    fn __repr__(&self) -> String {
        let g = &self.inner;
        format!(
            "ModelGeometry(layers={}, kv_heads={}, head_dim={}, dtype_bytes={}, block_tokens={})",
            g.layers, g.kv_heads, g.head_dim, g.dtype_bytes, g.block_tokens
        )
    }
}

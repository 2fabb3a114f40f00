//! `ModelGeometry`: objstore's model geometry for Python.

use objstore::ModelGeometry as Geometry;
use pyo3::prelude::*;

use crate::errors::{ErrorClass, Failure};

/// The shape of a model's KV cache (module stub: `ModelGeometry`).
#[pyclass(frozen, eq, module = "tutti", name = "ModelGeometry")]
#[derive(Clone, PartialEq, Eq)]
pub struct ModelGeometry {
    pub(crate) inner: Geometry,
}

/// The geometry tuttid's Hello reply announces, checked as a geometry from Python is: it is
/// untrusted input (a zero dimension would divide by zero in the layout checks), and an invalid
/// one is DaemonError naming the values tuttid sent.
pub fn of_hello(shape: &tutti_daemon::protocol::PoolShape) -> Result<Geometry, Failure> {
    let geometry = Geometry {
        layers: shape.layers,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        dtype_bytes: shape.dtype_bytes,
        block_tokens: shape.block_tokens,
    };
    geometry.validate().map_err(|error| {
        Failure::new(
            ErrorClass::Daemon,
            format!(
                "tuttid announced an invalid model geometry (layers={}, kv_heads={}, head_dim={}, dtype_bytes={}, \
                 block_tokens={}): {}",
                shape.layers,
                shape.kv_heads,
                shape.head_dim,
                shape.dtype_bytes,
                shape.block_tokens,
                Failure::from(error).message
            ),
        )
    })?;
    Ok(geometry)
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
            Failure::new(ErrorClass::InvalidArgument, format!("no model preset {name:?}: llama3-8b, qwen3-32b or llama3-70b"))
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

#[cfg(test)]
mod tests {
    use tutti_daemon::protocol::PoolShape;

    use super::*;
    use crate::tensor::{check_layout, Device, LayoutKind, TensorDescription};

    #[test]
    fn an_invalid_geometry_from_tuttid_is_a_daemon_error_not_a_panic() {
        // Goal: tuttid's Hello geometry is untrusted: one with a zero dimension is DaemonError
        // naming the values tuttid sent (before, kv_heads = 0 reached the layout checks, whose
        // division by zero was a PanicException); a valid one is taken as sent. The layout
        // checks themselves refuse such a geometry too, instead of dividing by it (a run of raw
        // bytes is split into blocks of the geometry's size).
        let shape = PoolShape { layers: 4, kv_heads: 0, head_dim: 64, dtype_bytes: 2, block_tokens: 16, blocks_per_slot: 1 };
        let failure = of_hello(&shape).expect_err("kv_heads = 0");
        assert_eq!(failure.class, ErrorClass::Daemon);
        assert!(failure.message.contains("(layers=4, kv_heads=0, head_dim=64, dtype_bytes=2, block_tokens=16)"), "{}", failure.message);
        for zero in 0..5 {
            let mut fields = [4, 2, 64, 2, 16];
            fields[zero] = 0;
            let [layers, kv_heads, head_dim, dtype_bytes, block_tokens] = fields;
            let shape = PoolShape { layers, kv_heads, head_dim, dtype_bytes, block_tokens, blocks_per_slot: 1 };
            assert_eq!(of_hello(&shape).map_err(|failure| failure.class), Err(ErrorClass::Daemon), "field {zero} zero");
        }
        let valid = PoolShape { kv_heads: 2, ..shape };
        assert_eq!(of_hello(&valid).map(|geometry| geometry.kv_heads), Ok(2));

        let zero = Geometry { layers: 1, kv_heads: 0, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        let tensor = |name: &str, address: u64| TensorDescription {
            name: name.into(),
            address,
            device: Device::Cpu,
            itemsize: 1,
            raw_bytes: true,
            shape: vec![4096],
            strides_bytes: None,
            writable: true,
        };
        let refused = check_layout(LayoutKind::Separate, &[tensor("k", 0x10000), tensor("v", 0x20000)], &zero);
        assert!(refused.as_ref().is_err_and(|message| message.contains("is invalid")), "{refused:?}");
    }
}

//! What a registered tensor must be, checked without Python: its device, element size, the
//! density of one block's part, the block count and stride of each layout kind, overlaps. The
//! tensors come from DLPack, the buffer protocol or raw pointers (`memory.rs`); here they are
//! plain descriptions ([`TensorDescription`]) so that every rule is unit-tested.

use objstore::ModelGeometry;

/// The four layouts of objstore's `KvLayout`, as the Python API names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayoutKind {
    Separate,
    Fused,
    Paged,
    BlockMajor,
}

impl LayoutKind {
    pub fn parse(name: &str) -> Option<LayoutKind> {
        match name {
            "separate" => Some(LayoutKind::Separate),
            "fused" => Some(LayoutKind::Fused),
            "paged" => Some(LayoutKind::Paged),
            "block_major" => Some(LayoutKind::BlockMajor),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            LayoutKind::Separate => "separate",
            LayoutKind::Fused => "fused",
            LayoutKind::Paged => "paged",
            LayoutKind::BlockMajor => "block_major",
        }
    }

    /// Tensors a layout of this kind has for `layers` layers.
    pub fn tensor_count(self, layers: u32) -> usize {
        match self {
            LayoutKind::Separate => 2 * layers as usize,
            LayoutKind::Fused | LayoutKind::Paged => layers as usize,
            LayoutKind::BlockMajor => 1,
        }
    }

    /// Bytes of one block's dense part in each tensor.
    pub fn unit_bytes(self, geometry: &ModelGeometry) -> u64 {
        match self {
            LayoutKind::Separate | LayoutKind::Fused => geometry.object_bytes(),
            LayoutKind::Paged => 2 * geometry.object_bytes(),
            LayoutKind::BlockMajor => geometry.block_bytes(),
        }
    }
}

/// Where a tensor's memory is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// GPU memory of CUDA device `ordinal` (DLPack's kDLCUDA, or a RawMemory on "cuda:N"):
    /// reachable only through tuttid (`backend::device_memory`).
    Cuda(i32),
    /// Any other device, as DLPack or the caller named it (e.g. "opencl:0 (DLPack device type 4)").
    Other(String),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
            Device::Other(name) => write!(f, "{name}"),
        }
    }
}

/// The words of the refusal of a device tutti cannot register at all (register_kv raises it
/// as UnsupportedMemory).
pub const UNSUPPORTED_DEVICE: &str = "tutti registers CPU memory, and CUDA memory with a store attached to tuttid";

/// One tensor as its producer described it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDescription {
    /// How the error messages name it (e.g. `keys[3]`).
    pub name: String,
    /// Address of element [0, 0, ...].
    pub address: u64,
    pub device: Device,
    /// Bytes per element.
    pub itemsize: u64,
    /// Whether the elements are raw bytes (uint8 / int8 / the buffer protocol's "B"): then any
    /// geometry's dtype_bytes is accepted.
    pub raw_bytes: bool,
    pub shape: Vec<u64>,
    /// Per dimension, in bytes; `None`: C-contiguous.
    pub strides_bytes: Option<Vec<i64>>,
    pub writable: bool,
}

/// A tensor's place in a checked layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacedTensor {
    /// First byte of block 0's part.
    pub address: u64,
    /// Bytes from the first to one past the last byte the layout names in it.
    pub extent_bytes: u64,
}

/// A layout whose tensors passed every check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedLayout {
    pub kind: LayoutKind,
    pub num_blocks: u32,
    pub block_stride_bytes: u64,
    /// In the order the kind lists them (separate: keys then values).
    pub tensors: Vec<PlacedTensor>,
    /// Where every tensor is (one device per layout).
    pub device: Device,
}

impl CheckedLayout {
    /// The bytes from the lowest tensor's first byte to the highest one's end: the range a
    /// device-memory registration exports (one allocation must hold it).
    pub fn span(&self) -> Option<(u64, u64)> {
        let start = self.tensors.iter().map(|tensor| tensor.address).min()?;
        let end = self.tensors.iter().map(|tensor| tensor.address + tensor.extent_bytes).max()?;
        Some((start, end - start))
    }
}

/// The C-contiguous strides of `shape` with `itemsize`-byte elements.
fn contiguous_strides(shape: &[u64], itemsize: u64) -> Option<Vec<i64>> {
    let mut strides = vec![0i64; shape.len()];
    let mut step = itemsize;
    for (index, &size) in shape.iter().enumerate().rev() {
        strides[index] = i64::try_from(step).ok()?;
        step = step.checked_mul(size.max(1))?;
    }
    Some(strides)
}

/// If the dimensions cover one dense run of bytes in some order (a permuted view of a
/// contiguous tensor; dimensions of size 1 do not count), its length.
fn dense_bytes(shape: &[u64], strides: &[i64], itemsize: u64) -> Option<u64> {
    let mut dims: Vec<(u64, i64)> = shape.iter().copied().zip(strides.iter().copied()).filter(|&(size, _)| size != 1).collect();
    if dims.iter().any(|&(size, _)| size == 0) {
        return Some(0);
    }
    dims.sort_by_key(|&(_, stride)| stride);
    let mut expected = itemsize;
    for (size, stride) in dims {
        if u64::try_from(stride).ok()? != expected {
            return None;
        }
        expected = expected.checked_mul(size)?;
    }
    Some(expected)
}

/// Whether a block-major tensor's block (its dimensions past [num_blocks]) holds its objects
/// where objstore reads them: object (layer l, K or V) at (2 x l + kind) x object_bytes into the
/// block (`KvRegistration::address`), so per-layer I/O moves layer l's bytes. Dimensions of
/// size 1 do not count. A block of one dimension is a plain run (no layer order to disagree
/// with); else it must begin with [layers, 2] at strides (2 x object_bytes, object_bytes), or
/// with [2 x layers] at object_bytes. The density check has made the whole block one run, so
/// what follows those dimensions is one object's bytes, in any order. With 2 layers, a
/// [2, 2, ...] block is read as [layers, 2, ...]: nothing in a shape tells the two apart.
fn check_block_major_order(tensor: &TensorDescription, strides: &[i64], geometry: &ModelGeometry) -> Result<(), String> {
    let dims: Vec<(u64, i64)> = tensor.shape.iter().copied().zip(strides.iter().copied()).skip(1).filter(|&(size, _)| size != 1).collect();
    if dims.len() <= 1 {
        return Ok(());
    }
    // object_bytes is at most 1 GiB once the geometry validated: these fit.
    let object = geometry.object_bytes() as i64;
    let layers = u64::from(geometry.layers);
    let layers_then_kind = dims[0] == (layers, 2 * object) && dims[1] == (2, object);
    let flattened = dims[0] == (2 * layers, object);
    if layers_then_kind || flattened {
        return Ok(());
    }
    Err(format!(
        "{} (shape {:?}, strides {:?} B) orders its blocks otherwise than block_major is read: layer l's K at 2 x l x object_bytes \
         into a block and its V object_bytes ({object} B) after it, so a block holds its layers outermost, then K and V: expected \
         [num_blocks, layers, 2, ...] or [num_blocks, 2 x layers, ...] with those dimensions in memory order (not [num_blocks, 2, \
         layers, ...], nor a view that permutes them)",
        tensor.name, tensor.shape, strides
    ))
}

/// Checks one tensor against the part of `kind` it plays; returns (num_blocks, block stride,
/// placed tensor).
fn check_tensor(tensor: &TensorDescription, kind: LayoutKind, geometry: &ModelGeometry) -> Result<(u64, u64, PlacedTensor), String> {
    let name = &tensor.name;
    if let Device::Other(device) = &tensor.device {
        return Err(format!("{name} is on {device}: {UNSUPPORTED_DEVICE}"));
    }
    if !tensor.writable {
        return Err(format!("{name} is read-only: retrieves write into it (register a writable tensor)"));
    }
    if tensor.itemsize == 0 {
        return Err(format!("{name} has elements of 0 bytes"));
    }
    if tensor.itemsize != u64::from(geometry.dtype_bytes) && !tensor.raw_bytes {
        return Err(format!(
            "{name} has {}-byte elements, the model's KV dtype has {} (dtype_bytes): register a tensor of the KV dtype, or its bytes (uint8)",
            tensor.itemsize, geometry.dtype_bytes
        ));
    }
    let unit = kind.unit_bytes(geometry);
    let what = match kind {
        LayoutKind::Separate | LayoutKind::Fused => "one layer's K or V of one block (object_bytes)".to_string(),
        LayoutKind::Paged => "one layer's K and V of one block (2 x object_bytes)".to_string(),
        LayoutKind::BlockMajor => "all layers' K and V of one block (block_bytes)".to_string(),
    };
    let strides = match &tensor.strides_bytes {
        Some(strides) if strides.len() != tensor.shape.len() => {
            return Err(format!("{name}: {} strides for {} dimensions", strides.len(), tensor.shape.len()))
        }
        Some(strides) => strides.clone(),
        None => contiguous_strides(&tensor.shape, tensor.itemsize).ok_or_else(|| format!("{name}: its size overflows"))?,
    };
    if strides.iter().any(|&stride| stride < 0) {
        return Err(format!("{name} has a negative stride {strides:?}: register a view with positive strides"));
    }
    // Leading dimensions before the per-block part: [N] or, fused, [2, N].
    let outer: usize = if kind == LayoutKind::Fused { 2 } else { 1 };
    let total_bytes = |shape: &[u64]| shape.iter().try_fold(tensor.itemsize, |bytes, &size| bytes.checked_mul(size));
    let (blocks, block_stride, half_stride) = if tensor.shape.len() == 1 {
        // A flat run of bytes (a KvBuffer, a bytearray): contiguous, split into whole units.
        if strides[0] as u64 != tensor.itemsize && tensor.shape[0] > 1 {
            return Err(format!("{name} is a 1-D view with stride {} B: register a contiguous tensor", strides[0]));
        }
        let bytes = total_bytes(&tensor.shape).ok_or_else(|| format!("{name}: its size overflows"))?;
        let per_block = unit * outer as u64;
        if bytes == 0 || bytes % per_block != 0 {
            return Err(format!("{name} is {bytes} bytes, not a whole number of blocks of {per_block} bytes ({what})"));
        }
        let blocks = bytes / per_block;
        (blocks, unit, blocks * unit)
    } else {
        if tensor.shape.len() < outer + 1 {
            return Err(format!("{name} has shape {:?}: expected [{}num_blocks, ...]", tensor.shape, if outer == 2 { "2, " } else { "" }));
        }
        if outer == 2 && tensor.shape[0] != 2 {
            return Err(format!("{name} has shape {:?}: a fused layer tensor is [2, num_blocks, ...] (K then V)", tensor.shape));
        }
        let inner = dense_bytes(&tensor.shape[outer..], &strides[outer..], tensor.itemsize).ok_or_else(|| {
            format!(
                "{name} (shape {:?}, strides {:?} B) is not dense within a block: a block's part must be one run of bytes (make it contiguous)",
                tensor.shape, strides
            )
        })?;
        if inner != unit {
            return Err(format!(
                "{name} holds {inner} bytes per block (shape {:?} x {} B), expected {unit}: {what} of {}",
                tensor.shape, tensor.itemsize, geometry
            ));
        }
        if kind == LayoutKind::BlockMajor {
            check_block_major_order(tensor, &strides, geometry)?;
        }
        let blocks = tensor.shape[outer - 1];
        let block_stride = strides[outer - 1] as u64;
        if blocks > 1 && block_stride < unit {
            return Err(format!("{name}: its blocks are {block_stride} bytes apart, less than a block's {unit} bytes (they overlap)"));
        }
        let block_stride = if blocks == 1 { unit } else { block_stride };
        let half_stride = if outer == 2 { strides[0] as u64 } else { 0 };
        // Checked: both come from the tensor's strides (untrusted); a product past u64 is no
        // packed tensor (unchecked, it panicked in debug builds and wrapped in release).
        let packed = blocks.checked_mul(block_stride);
        if outer == 2 && packed != Some(half_stride) {
            let expected = packed.map_or_else(|| format!("{blocks} x {block_stride}, past 2^64"), |bytes| bytes.to_string());
            return Err(format!(
                "{name}: V starts {half_stride} bytes after K, expected num_blocks x block stride = {expected} (a [2, num_blocks, ...] tensor whose halves are packed)"
            ));
        }
        (blocks, block_stride, half_stride)
    };
    if blocks == 0 || blocks > u64::from(u32::MAX) {
        return Err(format!("{name} holds {blocks} blocks: expected 1..=2^32-1"));
    }
    let last = (blocks - 1).checked_mul(block_stride).and_then(|bytes| bytes.checked_add(unit));
    let extent = if outer == 2 { last.and_then(|bytes| bytes.checked_add(half_stride)) } else { last };
    let extent = extent.ok_or_else(|| format!("{name}: its extent overflows"))?;
    tensor.address.checked_add(extent).ok_or_else(|| format!("{name}: its memory runs past the end of the address space"))?;
    if tensor.address == 0 {
        return Err(format!("{name} has a null data pointer"));
    }
    Ok((blocks, block_stride, PlacedTensor { address: tensor.address, extent_bytes: extent }))
}

/// Checks `tensors` as a layout of `kind` for `geometry`: their count, each tensor, one block
/// count and one block stride across them, no two overlapping in memory.
pub fn check_layout(kind: LayoutKind, tensors: &[TensorDescription], geometry: &ModelGeometry) -> Result<CheckedLayout, String> {
    // Every geometry a store holds was validated (ModelGeometry's constructor, tuttid's Hello at
    // attach); checked again here because the sizes below divide by its dimensions.
    geometry.validate().map_err(|error| format!("the store's model geometry {geometry} is invalid: {error}"))?;
    let expected = kind.tensor_count(geometry.layers);
    if tensors.len() != expected {
        return Err(format!("a {} layout of {} layers has {expected} tensors, got {}", kind.name(), geometry.layers, tensors.len()));
    }
    let mut placed = Vec::with_capacity(tensors.len());
    let mut shared: Option<(u64, u64, &str)> = None;
    for tensor in tensors {
        let (blocks, stride, place) = check_tensor(tensor, kind, geometry)?;
        if let Some(first) = tensors.first().filter(|first| first.device != tensor.device) {
            return Err(format!(
                "{} is on {}, {} on {}: every tensor of a layout must be on one device",
                tensor.name, tensor.device, first.name, first.device
            ));
        }
        match shared {
            None => shared = Some((blocks, stride, &tensor.name)),
            Some((first_blocks, first_stride, first)) => {
                if blocks != first_blocks {
                    return Err(format!(
                        "{} holds {blocks} blocks, {first} holds {first_blocks}: every tensor needs the same count",
                        tensor.name
                    ));
                }
                if stride != first_stride {
                    return Err(format!(
                        "{} has blocks {stride} bytes apart, {first} {first_stride}: every tensor needs the same block stride",
                        tensor.name
                    ));
                }
            }
        }
        placed.push(place);
    }
    let mut order: Vec<usize> = (0..placed.len()).collect();
    order.sort_by_key(|&index| placed[index].address);
    for pair in order.windows(2) {
        let (a, b) = (&placed[pair[0]], &placed[pair[1]]);
        if a.address + a.extent_bytes > b.address {
            return Err(format!(
                "{} and {} overlap in memory: each tensor needs memory of its own",
                tensors[pair[0]].name, tensors[pair[1]].name
            ));
        }
    }
    let (num_blocks, block_stride_bytes, _) = shared.ok_or_else(|| "a layout without tensors".to_string())?;
    let device = tensors.first().map(|tensor| tensor.device.clone()).unwrap_or(Device::Cpu);
    Ok(CheckedLayout { kind, num_blocks: num_blocks as u32, block_stride_bytes, tensors: placed, device })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2 layers, 2 KV heads, dim 8, 2-byte elements, 4-token blocks: 128-byte objects.
    fn geometry() -> ModelGeometry {
        ModelGeometry { layers: 2, kv_heads: 2, head_dim: 8, dtype_bytes: 2, block_tokens: 4 }
    }

    fn tensor(name: &str, address: u64, shape: &[u64], strides: Option<Vec<i64>>) -> TensorDescription {
        TensorDescription {
            name: name.into(),
            address,
            device: Device::Cpu,
            itemsize: 2,
            raw_bytes: false,
            shape: shape.to_vec(),
            strides_bytes: strides,
            writable: true,
        }
    }

    #[test]
    fn each_kind_takes_its_shape_and_finds_blocks_and_stride() {
        // Goal: the shapes the engines use are accepted with the right N, stride and extent:
        // separate [N, tokens, heads, dim]; fused [2, N, ...]; paged [N, heads, tokens, 2*dim]
        // as a permuted view; block-major [N, layers, 2, ...]; 1-D byte runs.
        let g = geometry();
        let separate: Vec<_> = (0..4).map(|i| tensor(&format!("t{i}"), 0x10000 * (i + 1), &[6, 4, 2, 8], None)).collect();
        let checked = check_layout(LayoutKind::Separate, &separate, &g).unwrap();
        assert_eq!((checked.num_blocks, checked.block_stride_bytes), (6, 128));
        assert_eq!(checked.tensors[0].extent_bytes, 6 * 128);
        let fused: Vec<_> = (0..2).map(|i| tensor(&format!("l{i}"), 0x10000 * (i + 1), &[2, 6, 4, 2, 8], None)).collect();
        let checked = check_layout(LayoutKind::Fused, &fused, &g).unwrap();
        assert_eq!((checked.num_blocks, checked.block_stride_bytes, checked.tensors[1].extent_bytes), (6, 128, 12 * 128));
        // [N, heads, tokens, 2*dim] viewed over an [N, tokens, heads, 2*dim] allocation.
        let permuted = Some(vec![256, 32, 64, 2]);
        let paged: Vec<_> = (0..2).map(|i| tensor(&format!("p{i}"), 0x10000 * (i + 1), &[6, 2, 4, 16], permuted.clone())).collect();
        let checked = check_layout(LayoutKind::Paged, &paged, &g).unwrap();
        assert_eq!((checked.num_blocks, checked.block_stride_bytes), (6, 256));
        let major = [tensor("pool", 0x10000, &[6, 2, 2, 4, 2, 8], None)];
        assert_eq!(check_layout(LayoutKind::BlockMajor, &major, &g).unwrap().block_stride_bytes, 512);
        let bytes = TensorDescription { itemsize: 1, raw_bytes: true, ..tensor("bytes", 0x10000, &[6 * 512], None) };
        let checked = check_layout(LayoutKind::BlockMajor, &[bytes], &g).unwrap();
        assert_eq!((checked.num_blocks, checked.block_stride_bytes), (6, 512));
        // Blocks spaced further apart than their size (padding between blocks) are fine.
        let padded: Vec<_> = (0..2).map(|i| tensor(&format!("p{i}"), 0x10000 * (i + 1), &[6, 128], Some(vec![512, 2]))).collect();
        let checked = check_layout(LayoutKind::Paged, &padded, &g).unwrap();
        assert_eq!((checked.block_stride_bytes, checked.tensors[0].extent_bytes), (512, 5 * 512 + 256));
    }

    #[test]
    fn bad_tensors_are_refused_with_what_to_fix() {
        // Goal: every rule a tensor can break gives a sentence naming the tensor and the fix:
        // device, read-only, dtype, bytes per block (shape), density within a block, a wrong
        // tensor count, differing N or stride, overlap, a fused tensor whose halves are not
        // packed, a 1-D run that is not whole blocks, a negative stride.
        let g = geometry();
        let good = |i: u64| tensor(&format!("t{i}"), 0x10000 * (i + 1), &[6, 4, 2, 8], None);
        let layout = |changed: TensorDescription| {
            let mut tensors: Vec<_> = (0..4).map(good).collect();
            tensors[1] = changed;
            check_layout(LayoutKind::Separate, &tensors, &g).unwrap_err()
        };
        let cases = [
            (TensorDescription { device: Device::Other("opencl:0".into()), ..good(1) }, "is on opencl:0: tutti registers CPU memory"),
            (
                TensorDescription { device: Device::Cuda(0), ..good(1) },
                "t1 is on cuda:0, t0 on cpu: every tensor of a layout must be on one",
            ),
            (TensorDescription { writable: false, ..good(1) }, "is read-only"),
            (TensorDescription { itemsize: 4, ..good(1) }, "has 4-byte elements, the model's KV dtype has 2"),
            (tensor("t1", 0x20000, &[6, 4, 2, 9], None), "holds 144 bytes per block"),
            (tensor("t1", 0x20000, &[6, 4, 2, 8], Some(vec![256, 64, 32, 2])), "is not dense within a block"),
            (tensor("t1", 0x20000, &[5, 4, 2, 8], None), "holds 5 blocks, t0 holds 6"),
            (tensor("t1", 0x20000, &[6, 4, 2, 8], Some(vec![256, 32, 16, 2])), "blocks 256 bytes apart, t0 128"),
            (tensor("t1", 0x10000 + 64, &[6, 4, 2, 8], None), "t0 and t1 overlap in memory"),
            (tensor("t1", 0x20000, &[6, 4, 2, 8], Some(vec![-128, 32, 16, 2])), "negative stride"),
            (tensor("t1", 0x20000, &[6, 4, 2, 8], Some(vec![64, 32, 16, 2])), "less than a block's 128 bytes"),
        ];
        for (tensor, expected) in cases {
            let error = layout(tensor);
            assert!(error.contains(expected), "{error:?} lacks {expected:?}");
            assert!(error.starts_with("t1") || error.starts_with("t0"), "{error}");
        }
        let three: Vec<_> = (0..3).map(good).collect();
        assert!(check_layout(LayoutKind::Separate, &three, &g).unwrap_err().contains("has 4 tensors, got 3"));
        let unpacked =
            [tensor("l0", 0x10000, &[2, 6, 4, 2, 8], Some(vec![2048, 128, 32, 16, 2])), tensor("l1", 0x20000, &[2, 6, 4, 2, 8], None)];
        assert!(check_layout(LayoutKind::Fused, &unpacked, &g).unwrap_err().contains("V starts 2048 bytes after K, expected"));
        let ragged = TensorDescription { itemsize: 1, raw_bytes: true, ..tensor("bytes", 0x10000, &[6 * 512 + 1], None) };
        assert!(check_layout(LayoutKind::BlockMajor, &[ragged], &g).unwrap_err().contains("not a whole number of blocks of 512"));
        let null = tensor("pool", 0, &[6, 2, 2, 4, 2, 8], None);
        assert!(check_layout(LayoutKind::BlockMajor, &[null], &g).unwrap_err().contains("null data pointer"));
        // Raw bytes of any element size are accepted only as uint8-like (raw_bytes).
        let bytes = TensorDescription { itemsize: 1, raw_bytes: false, ..tensor("pool", 0x10000, &[6 * 512], None) };
        assert!(check_layout(LayoutKind::BlockMajor, &[bytes], &g).unwrap_err().contains("1-byte elements"));
    }

    #[test]
    fn block_major_blocks_hold_their_layers_outermost() {
        // Goal: a block-major block is accepted only in the order objstore reads it (layer l's
        // K at 2l x object_bytes, V after it): [N, layers, 2, ...], [N, 2 x layers, ...] and a
        // flat run pass; K/V outermost ([N, 2, layers, ...] in memory, here a view whose layer
        // dimension steps one object and K/V two) is refused naming the order expected.
        let g = geometry();
        let accepted = [
            tensor("pool", 0x10000, &[6, 2, 2, 4, 2, 8], None),
            tensor("pool", 0x10000, &[6, 4, 4, 2, 8], None),
            tensor("pool", 0x10000, &[6, 1, 2, 2, 4, 16], None),
            tensor("pool", 0x10000, &[6, 256], None),
        ];
        for major in accepted {
            assert_eq!(
                check_layout(LayoutKind::BlockMajor, std::slice::from_ref(&major), &g).map(|checked| checked.block_stride_bytes),
                Ok(512),
                "{major:?}"
            );
        }
        let kind_outermost = tensor("pool", 0x10000, &[6, 2, 2, 4, 2, 8], Some(vec![512, 128, 256, 32, 16, 2]));
        let error = check_layout(LayoutKind::BlockMajor, &[kind_outermost], &g).unwrap_err();
        assert!(error.contains("expected [num_blocks, layers, 2, ...] or [num_blocks, 2 x layers, ...]"), "{error}");
        // Per-layer tensors ([N, ...] of one layer) keep any dense order within a block.
        let permuted = [tensor("p0", 0x10000, &[6, 2, 4, 16], Some(vec![256, 32, 64, 2])), tensor("p1", 0x20000, &[6, 2, 4, 16], None)];
        assert!(check_layout(LayoutKind::Paged, &permuted, &g).is_ok());
    }

    #[test]
    fn cuda_tensors_pass_the_same_checks_and_give_their_span() {
        // Goal: a layout on one CUDA device is checked like a CPU one (shape, stride, overlap)
        // and says its device; its span runs from the lowest tensor to the end of the highest,
        // whatever the order the kind lists them in.
        let g = geometry();
        let cuda =
            |i: u64, address: u64| TensorDescription { device: Device::Cuda(1), ..tensor(&format!("p{i}"), address, &[6, 2, 4, 16], None) };
        let checked = check_layout(LayoutKind::Paged, &[cuda(0, 0x7000_2000), cuda(1, 0x7000_0000)], &g).unwrap();
        assert_eq!(checked.device, Device::Cuda(1));
        assert_eq!(checked.span(), Some((0x7000_0000, 0x2000 + 6 * 256)));
        let overlapping = [cuda(0, 0x7000_0000), cuda(1, 0x7000_0100)];
        assert!(check_layout(LayoutKind::Paged, &overlapping, &g).unwrap_err().contains("overlap in memory"));
    }

    #[test]
    fn a_fused_tensor_whose_halves_are_an_overflowing_stride_apart_is_refused() {
        // Goal: a crafted [2, 3, 128] uint8 fused tensor (DLPack or as_strided) whose block
        // stride is 6148914691236517206 and whose V half starts 2 bytes after K is refused with
        // the packed-halves sentence: 3 blocks x that stride is past u64, not 2. Before, the
        // product was unchecked: a panic in a debug build (a PanicException in Python), and in
        // release it wrapped to 2 and the bogus tensor was accepted.
        let g = ModelGeometry { layers: 1, ..geometry() };
        let crafted = TensorDescription {
            itemsize: 1,
            raw_bytes: true,
            ..tensor("l0", 0x10000, &[2, 3, 128], Some(vec![2, 6148914691236517206, 1]))
        };
        let error = check_layout(LayoutKind::Fused, &[crafted], &g).unwrap_err();
        assert!(error.contains("l0: V starts 2 bytes after K"), "{error}");
    }

    #[test]
    fn density_ignores_unit_dimensions_and_accepts_permutations() {
        // Goal: the per-block density check is order-free and skips dimensions of size 1.
        assert_eq!(dense_bytes(&[2, 1, 4], &[8, 1000, 2], 2), Some(16));
        assert_eq!(dense_bytes(&[4, 2], &[2, 8], 2), Some(16));
        assert_eq!(dense_bytes(&[4, 2], &[2, 10], 2), None);
        assert_eq!(dense_bytes(&[], &[], 2), Some(2));
        assert_eq!(contiguous_strides(&[3, 4, 5], 2), Some(vec![40, 10, 2]));
    }
}

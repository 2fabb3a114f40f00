//! KV-pool registration: where the engine's pre-allocated KV memory lives in device address space,
//! checked once so that nothing on the I/O path has to.

use nvme_driver::{DataPointerMode, Iova};

use crate::error::{KvKind, ObjstoreError, Result};
use crate::geometry::ModelGeometry;

/// NVMe SGL data blocks must be dword aligned; PRP entries name whole 4 KiB pages.
pub const SGL_ALIGN_BYTES: u64 = 4;
pub const PAGE_BYTES: u64 = 4096;

/// How the engine lays out its KV pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvLayout {
    /// K and V as separate per-layer tensors `[num_blocks, block_tokens, heads, dim]`:
    /// object (l, K, b) at `key_bases[l] + b * block_stride_bytes`.
    SeparateKv { key_bases: Vec<Iova>, value_bases: Vec<Iova>, block_stride_bytes: u64 },
    /// One tensor per layer `[2, num_blocks, block_tokens, heads, dim]` (vLLM's FlashAttention
    /// layout): K of block b at `layer_bases[l] + b * stride`, V at `+ num_blocks * stride`.
    FusedPerLayer { layer_bases: Vec<Iova>, block_stride_bytes: u64 },
    /// All layers of a block contiguous `[num_blocks, layers, 2, block_tokens, heads, dim]`:
    /// object (l, kv, b) at `base + b * block_stride_bytes + (2l + kv) * object_bytes`.
    BlockMajor { base: Iova, block_stride_bytes: u64 },
    /// One tensor per layer whose block b is one contiguous run of `2 * object_bytes` holding
    /// that layer's K and V in whatever arrangement the engine uses: vLLM 0.32's `[blocks,
    /// heads, slots, content]` view with K and V together in each slot's content, FlashInfer's
    /// `[num_blocks, 2, block_tokens, heads, dim]`. The store only moves bytes, so the run's
    /// first half is stored as object (l, K, b) and its second half as (l, V, b):
    /// `layer_bases[l] + b * block_stride_bytes`, V `object_bytes` further. A pool written in
    /// this layout reads back byte-exact in this layout (not in another, where the halves would
    /// mean K and V).
    PagedPerLayer { layer_bases: Vec<Iova>, block_stride_bytes: u64 },
}

/// A validated registration of the engine's KV pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvRegistration {
    geometry: ModelGeometry,
    num_blocks: u32,
    layout: KvLayout,
    mode: DataPointerMode,
}

/// One tensor's extent, for the overlap check and for gio_uring's registered memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extent {
    pub name: String,
    pub start: Iova,
    pub len_bytes: u64,
}

impl KvRegistration {
    /// Checks the layout against the geometry: one base per layer, strides that fit an object,
    /// alignment for `mode`, no two tensors overlapping, no address overflow.
    pub fn new(geometry: ModelGeometry, num_blocks: u32, layout: KvLayout, mode: DataPointerMode) -> Result<Self> {
        geometry.validate()?;
        if num_blocks == 0 {
            return Err(ObjstoreError::InvalidRegistration { reason: "num_blocks = 0, expected at least 1".into() });
        }
        let registration = Self { geometry, num_blocks, layout, mode };
        registration.check_shape()?;
        registration.check_alignment()?;
        let extents = registration.extents()?;
        check_overlap(&extents)?;
        Ok(registration)
    }

    fn check_shape(&self) -> Result<()> {
        let layers = self.geometry.layers as usize;
        let object = self.geometry.object_bytes();
        let bad = |reason: String| Err(ObjstoreError::InvalidRegistration { reason });
        match &self.layout {
            KvLayout::SeparateKv { key_bases, value_bases, block_stride_bytes } => {
                if key_bases.len() != layers || value_bases.len() != layers {
                    return bad(format!("{} K and {} V bases, expected {layers} each (one per layer)", key_bases.len(), value_bases.len()));
                }
                if *block_stride_bytes < object {
                    return bad(format!("block stride {block_stride_bytes} B is smaller than an object ({object} B)"));
                }
            }
            KvLayout::FusedPerLayer { layer_bases, block_stride_bytes } => {
                if layer_bases.len() != layers {
                    return bad(format!("{} layer bases, expected {layers}", layer_bases.len()));
                }
                if *block_stride_bytes < object {
                    return bad(format!("block stride {block_stride_bytes} B is smaller than an object ({object} B)"));
                }
            }
            KvLayout::BlockMajor { block_stride_bytes, .. } => {
                let block = self.geometry.block_bytes();
                if *block_stride_bytes < block {
                    return bad(format!("block stride {block_stride_bytes} B is smaller than a block's {block} B (all layers)"));
                }
            }
            KvLayout::PagedPerLayer { layer_bases, block_stride_bytes } => {
                if layer_bases.len() != layers {
                    return bad(format!("{} layer bases, expected {layers}", layer_bases.len()));
                }
                // `object` is at most 1 GiB once the geometry validated: no overflow.
                if *block_stride_bytes < 2 * object {
                    return bad(format!(
                        "block stride {block_stride_bytes} B is smaller than a layer's K and V of one block ({} B)",
                        2 * object
                    ));
                }
            }
        }
        Ok(())
    }

    fn check_alignment(&self) -> Result<()> {
        let (align, mode) = match self.mode {
            DataPointerMode::Sgl => (SGL_ALIGN_BYTES, "SGL"),
            DataPointerMode::Prp => (PAGE_BYTES, "PRP"),
        };
        let misaligned =
            |what: String, address: u64| Err(ObjstoreError::MisalignedRegistration { what, address, align_bytes: align, mode });
        let object = self.geometry.object_bytes();
        if !object.is_multiple_of(align) {
            return misaligned("object size".into(), object);
        }
        let stride = match &self.layout {
            KvLayout::SeparateKv { block_stride_bytes, .. }
            | KvLayout::FusedPerLayer { block_stride_bytes, .. }
            | KvLayout::BlockMajor { block_stride_bytes, .. }
            | KvLayout::PagedPerLayer { block_stride_bytes, .. } => *block_stride_bytes,
        };
        if stride % align != 0 {
            return misaligned("block stride".into(), stride);
        }
        for (name, base) in self.bases() {
            if base.0 % align != 0 {
                return misaligned(name, base.0);
            }
        }
        Ok(())
    }

    fn bases(&self) -> Vec<(String, Iova)> {
        match &self.layout {
            KvLayout::SeparateKv { key_bases, value_bases, .. } => {
                let keys = key_bases.iter().enumerate().map(|(l, b)| (format!("layer {l} K base"), *b));
                keys.chain(value_bases.iter().enumerate().map(|(l, b)| (format!("layer {l} V base"), *b))).collect()
            }
            KvLayout::FusedPerLayer { layer_bases, .. } | KvLayout::PagedPerLayer { layer_bases, .. } => {
                layer_bases.iter().enumerate().map(|(l, b)| (format!("layer {l} base"), *b)).collect()
            }
            KvLayout::BlockMajor { base, .. } => vec![("pool base".into(), *base)],
        }
    }

    /// The tensors' extents merged where one ends exactly where the next starts, as
    /// `(start, end)` device addresses, sorted: the ranges gio_uring checks commands against.
    pub fn merged_ranges(&self) -> Result<Vec<(u64, u64)>> {
        let mut ranges: Vec<(u64, u64)> = self.extents()?.iter().map(|e| (e.start.0, e.start.0 + e.len_bytes)).collect();
        ranges.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
        for (start, end) in ranges {
            match merged.last_mut() {
                Some(last) if last.1 == start => last.1 = end,
                _ => merged.push((start, end)),
            }
        }
        Ok(merged)
    }

    /// Whether one command may move a block's object at every layer with `stride` (gio_uring's
    /// strided IOCTX): only if, for every block and kind, the first layer's object through the
    /// last layer's lies inside one merged range. Equidistant layer bases in separate tensors
    /// (each tensor mapped on its own, with gaps between) do not qualify, whatever their spacing.
    pub fn stride_within_one_range(&self, stride: u64) -> Result<bool> {
        let ranges = self.merged_ranges()?;
        let last_layer = u64::from(self.geometry.layers.saturating_sub(1));
        let object = self.geometry.object_bytes();
        for kind in [KvKind::Key, KvKind::Value] {
            for block in 0..self.num_blocks {
                let Some(first) = self.address(0, kind, block) else { return Ok(false) };
                let Some(end) =
                    last_layer.checked_mul(stride).and_then(|span| first.0.checked_add(span)).and_then(|v| v.checked_add(object))
                else {
                    return Ok(false);
                };
                let index = ranges.partition_point(|range| range.0 <= first.0);
                if index == 0 || ranges[index - 1].1 < end {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// The tensors' extents in device address space (checked for overflow).
    pub fn extents(&self) -> Result<Vec<Extent>> {
        let n = u64::from(self.num_blocks);
        let object = self.geometry.object_bytes();
        let overflow = |name: &str| ObjstoreError::InvalidRegistration { reason: format!("{name} runs past the end of the address space") };
        let extent = |name: String, start: Iova, len: Option<u64>| -> Result<Extent> {
            let len_bytes = len.ok_or_else(|| overflow(&name))?;
            start.checked_end(len_bytes).ok_or_else(|| overflow(&name))?;
            Ok(Extent { name, start, len_bytes })
        };
        let tensor_len = |stride: u64, count: u64| stride.checked_mul(count - 1).and_then(|v| v.checked_add(object));
        match &self.layout {
            KvLayout::SeparateKv { key_bases, value_bases, block_stride_bytes } => {
                let mut out = Vec::with_capacity(2 * key_bases.len());
                for (l, base) in key_bases.iter().enumerate() {
                    out.push(extent(format!("layer {l} K tensor"), *base, tensor_len(*block_stride_bytes, n))?);
                }
                for (l, base) in value_bases.iter().enumerate() {
                    out.push(extent(format!("layer {l} V tensor"), *base, tensor_len(*block_stride_bytes, n))?);
                }
                Ok(out)
            }
            KvLayout::FusedPerLayer { layer_bases, block_stride_bytes } => layer_bases
                .iter()
                .enumerate()
                .map(|(l, base)| extent(format!("layer {l} KV tensor"), *base, tensor_len(*block_stride_bytes, 2 * n)))
                .collect(),
            KvLayout::BlockMajor { base, block_stride_bytes } => {
                let len = block_stride_bytes.checked_mul(n - 1).and_then(|v| v.checked_add(self.geometry.block_bytes()));
                Ok(vec![extent("block-major pool".into(), *base, len)?])
            }
            KvLayout::PagedPerLayer { layer_bases, block_stride_bytes } => {
                let len = block_stride_bytes.checked_mul(n - 1).and_then(|v| v.checked_add(2 * object));
                layer_bases.iter().enumerate().map(|(l, base)| extent(format!("layer {l} KV tensor"), *base, len)).collect()
            }
        }
    }

    pub fn geometry(&self) -> &ModelGeometry {
        &self.geometry
    }

    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn mode(&self) -> DataPointerMode {
        self.mode
    }

    pub fn check_block(&self, block: u32) -> Result<()> {
        if block >= self.num_blocks {
            return Err(ObjstoreError::BlockOutOfRange { block, num_blocks: self.num_blocks });
        }
        Ok(())
    }

    pub fn check_layer(&self, layer: u32) -> Result<()> {
        if layer >= self.geometry.layers {
            return Err(ObjstoreError::LayerOutOfRange { layer, layers: self.geometry.layers });
        }
        Ok(())
    }

    /// Device address of object (layer, kind, block). Inside the registration it cannot
    /// overflow (`new` checked every extent); the sums are checked all the same.
    pub fn object_address(&self, layer: u32, kind: KvKind, block: u32) -> Result<Iova> {
        self.check_layer(layer)?;
        self.check_block(block)?;
        self.address(layer, kind, block)
            .ok_or_else(|| ObjstoreError::AddressOverflow { what: format!("object (layer {layer}, {kind}, block {block})") })
    }

    /// Device address of object (layer, kind, block) with checked sums, for callers that
    /// checked the block themselves (the mapping table's per-block path): `None` for a layer the
    /// model does not have or an address past the last one (a block far outside the pool).
    pub(crate) fn address(&self, layer: u32, kind: KvKind, block: u32) -> Option<Iova> {
        let b = u64::from(block);
        let l = layer as usize;
        match &self.layout {
            KvLayout::SeparateKv { key_bases, value_bases, block_stride_bytes } => {
                let bases = if kind == KvKind::Key { key_bases } else { value_bases };
                bases.get(l)?.checked_add(b.checked_mul(*block_stride_bytes)?)
            }
            KvLayout::FusedPerLayer { layer_bases, block_stride_bytes } => {
                let slot = if kind == KvKind::Key { b } else { u64::from(self.num_blocks).checked_add(b)? };
                layer_bases.get(l)?.checked_add(slot.checked_mul(*block_stride_bytes)?)
            }
            KvLayout::BlockMajor { base, block_stride_bytes } => {
                if layer >= self.geometry.layers {
                    return None;
                }
                let index = 2 * u64::from(layer) + u64::from(kind == KvKind::Value);
                let offset = b.checked_mul(*block_stride_bytes)?.checked_add(index.checked_mul(self.geometry.object_bytes())?)?;
                base.checked_add(offset)
            }
            KvLayout::PagedPerLayer { layer_bases, block_stride_bytes } => {
                let half = if kind == KvKind::Key { 0 } else { self.geometry.object_bytes() };
                layer_bases.get(l)?.checked_add(b.checked_mul(*block_stride_bytes)?.checked_add(half)?)
            }
        }
    }

    /// If every object's address is `address(0, kind, block) + layer * stride` for one stride
    /// (true for block-major pools and for per-layer tensors carved from one allocation at equal
    /// spacing), that stride: the mapping table then collapses to base + strides.
    pub fn layer_stride_bytes(&self) -> Option<u64> {
        if self.geometry.layers == 1 {
            return Some(0);
        }
        let progression = |bases: &[Iova]| -> Option<u64> {
            let stride = bases[1].0.checked_sub(bases[0].0)?;
            bases.windows(2).all(|w| w[1].0.checked_sub(w[0].0) == Some(stride)).then_some(stride)
        };
        match &self.layout {
            KvLayout::SeparateKv { key_bases, value_bases, .. } => {
                let stride = progression(key_bases)?;
                (progression(value_bases)? == stride).then_some(stride)
            }
            KvLayout::FusedPerLayer { layer_bases, .. } | KvLayout::PagedPerLayer { layer_bases, .. } => progression(layer_bases),
            KvLayout::BlockMajor { .. } => Some(2 * self.geometry.object_bytes()),
        }
    }

    /// Whether V follows K directly for every (layer, block), so one command moves both: the
    /// block-major and paged-per-layer layouts promise it.
    pub fn key_value_adjacent(&self) -> bool {
        matches!(self.layout, KvLayout::BlockMajor { .. } | KvLayout::PagedPerLayer { .. })
    }
}

fn check_overlap(extents: &[Extent]) -> Result<()> {
    let mut sorted: Vec<&Extent> = extents.iter().collect();
    sorted.sort_by_key(|extent| extent.start);
    for pair in sorted.windows(2) {
        // `extents` checked every end; one that overflowed would overlap everything above it.
        if pair[0].start.checked_end(pair[0].len_bytes).is_none_or(|end| end > pair[1].start) {
            let describe = |e: &Extent| format!("{} [{:#x}, +{:#x})", e.name, e.start.0, e.len_bytes);
            return Err(ObjstoreError::OverlappingRegistration { first: describe(pair[0]), second: describe(pair[1]) });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> ModelGeometry {
        ModelGeometry { layers: 4, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 }
        // 4 KiB objects
    }

    fn separate(k0: u64, v0: u64, layer_stride: u64) -> KvLayout {
        KvLayout::SeparateKv {
            key_bases: (0..4).map(|l| Iova(k0 + l * layer_stride)).collect(),
            value_bases: (0..4).map(|l| Iova(v0 + l * layer_stride)).collect(),
            block_stride_bytes: 4096,
        }
    }

    #[test]
    fn addresses_follow_each_layout() {
        // Goal: the address formula of each layout, and the collapse detection.
        let sep = KvRegistration::new(geometry(), 8, separate(0x10_0000, 0x20_0000, 0x1_0000), DataPointerMode::Prp).unwrap();
        assert_eq!(sep.object_address(2, KvKind::Value, 3).unwrap(), Iova(0x20_0000 + 0x2_0000 + 3 * 4096));
        assert_eq!(sep.layer_stride_bytes(), Some(0x1_0000));
        assert!(!sep.key_value_adjacent());
        let fused = KvLayout::FusedPerLayer {
            layer_bases: vec![Iova(0x10_0000), Iova(0x50_0000), Iova(0x30_0000), Iova(0x70_0000)],
            block_stride_bytes: 4096,
        };
        let fused = KvRegistration::new(geometry(), 8, fused, DataPointerMode::Sgl).unwrap();
        assert_eq!(fused.object_address(1, KvKind::Value, 2).unwrap(), Iova(0x50_0000 + 10 * 4096));
        assert_eq!(fused.layer_stride_bytes(), None);
        let major = KvRegistration::new(
            geometry(),
            8,
            KvLayout::BlockMajor { base: Iova(0x100_0000), block_stride_bytes: 8 * 4096 },
            DataPointerMode::Sgl,
        )
        .unwrap();
        assert_eq!(major.object_address(3, KvKind::Value, 1).unwrap(), Iova(0x100_0000 + 8 * 4096 + 7 * 4096));
        assert_eq!(major.layer_stride_bytes(), Some(8192));
        assert!(major.key_value_adjacent());
    }

    #[test]
    fn paged_per_layer_stores_each_layer_block_as_its_two_halves() {
        // Goal: vLLM 0.32's layout (a layer's block is one run holding K and V together):
        // K is the run's first half, V its second, the block stride may exceed the run, the
        // layer stride is found when the layers are equally spaced, K and V are adjacent (one
        // command moves both), and a stride shorter than K + V or a base per layer missing is
        // refused, as are two layers' tensors that overlap.
        let object = 4096;
        let bases = |step: u64| (0..4).map(|l| Iova(0x100_0000 + l * step)).collect::<Vec<_>>();
        let layout = KvLayout::PagedPerLayer { layer_bases: bases(0x10_0000), block_stride_bytes: 3 * object };
        let paged = KvRegistration::new(geometry(), 8, layout, DataPointerMode::Sgl).unwrap();
        assert_eq!(paged.object_address(2, KvKind::Key, 5).unwrap(), Iova(0x100_0000 + 2 * 0x10_0000 + 5 * 3 * object));
        assert_eq!(paged.object_address(2, KvKind::Value, 5).unwrap(), Iova(0x100_0000 + 2 * 0x10_0000 + 5 * 3 * object + object));
        assert_eq!(paged.layer_stride_bytes(), Some(0x10_0000));
        assert!(paged.key_value_adjacent());
        let extents = paged.extents().unwrap();
        assert_eq!(extents.len(), 4);
        assert_eq!(extents[3].len_bytes, 7 * 3 * object + 2 * object, "the last block's run ends the tensor");
        let mut irregular = bases(0x10_0000);
        irregular.swap(1, 2);
        let layout = KvLayout::PagedPerLayer { layer_bases: irregular, block_stride_bytes: 2 * object };
        assert_eq!(KvRegistration::new(geometry(), 8, layout, DataPointerMode::Sgl).unwrap().layer_stride_bytes(), None);
        let short = KvLayout::PagedPerLayer { layer_bases: bases(0x10_0000), block_stride_bytes: 2 * object - 4 };
        let error = KvRegistration::new(geometry(), 8, short, DataPointerMode::Sgl).unwrap_err().to_string();
        assert!(error.contains("smaller than a layer's K and V of one block (8192 B)"), "{error}");
        let few = KvLayout::PagedPerLayer { layer_bases: bases(0x10_0000)[..3].to_vec(), block_stride_bytes: 2 * object };
        assert!(KvRegistration::new(geometry(), 8, few, DataPointerMode::Sgl).unwrap_err().to_string().contains("expected 4"));
        // 8 blocks of 8 KiB are 64 KiB: layers 32 KiB apart overlap.
        let overlapping = KvLayout::PagedPerLayer { layer_bases: bases(0x8000), block_stride_bytes: 2 * object };
        let error = KvRegistration::new(geometry(), 8, overlapping, DataPointerMode::Sgl).unwrap_err();
        assert!(matches!(error, ObjstoreError::OverlappingRegistration { .. }), "{error}");
        let misaligned = KvLayout::PagedPerLayer { layer_bases: bases(0x10_0200), block_stride_bytes: 2 * object };
        assert!(matches!(
            KvRegistration::new(geometry(), 8, misaligned, DataPointerMode::Prp),
            Err(ObjstoreError::MisalignedRegistration { align_bytes: 4096, .. })
        ));
        assert_eq!(paged.address(4, KvKind::Key, 0), None);
        // Equidistant layers in separate tensors with gaps between them (engine tensors each
        // mapped on their own): no command may span layers, whatever the spacing. Back to back
        // (one merged range), it may.
        assert!(!paged.stride_within_one_range(0x10_0000).unwrap(), "gaps between the layer tensors");
        let tensor_bytes = 7 * 3 * object + 2 * object;
        let packed = KvLayout::PagedPerLayer { layer_bases: bases(tensor_bytes), block_stride_bytes: 3 * object };
        let packed = KvRegistration::new(geometry(), 8, packed, DataPointerMode::Sgl).unwrap();
        assert_eq!(packed.merged_ranges().unwrap().len(), 1);
        assert!(packed.stride_within_one_range(tensor_bytes).unwrap());
    }

    #[test]
    fn bad_registrations_are_typed_errors_naming_the_culprit() {
        // Goal: overlap, misalignment, wrong base count, small stride, block/layer out of range.
        let overlap = KvRegistration::new(geometry(), 8, separate(0x10_0000, 0x10_4000, 0x1_0000), DataPointerMode::Sgl).unwrap_err();
        assert!(
            matches!(&overlap, ObjstoreError::OverlappingRegistration { first, second } if first.contains("layer 0 K") && second.contains("layer 0 V")),
            "{overlap}"
        );
        let misaligned = KvRegistration::new(geometry(), 8, separate(0x10_0002, 0x20_0000, 0x1_0000), DataPointerMode::Sgl).unwrap_err();
        assert!(
            matches!(&misaligned, ObjstoreError::MisalignedRegistration { what, align_bytes: 4, .. } if what == "layer 0 K base"),
            "{misaligned}"
        );
        let misaligned_prp =
            KvRegistration::new(geometry(), 8, separate(0x10_0200, 0x20_0000, 0x1_0000), DataPointerMode::Prp).unwrap_err();
        assert!(matches!(misaligned_prp, ObjstoreError::MisalignedRegistration { align_bytes: 4096, .. }));
        let few = KvLayout::FusedPerLayer { layer_bases: vec![Iova(0x10_0000)], block_stride_bytes: 4096 };
        assert!(KvRegistration::new(geometry(), 8, few, DataPointerMode::Sgl).unwrap_err().to_string().contains("expected 4"));
        let small = KvLayout::BlockMajor { base: Iova(0x10_0000), block_stride_bytes: 4096 };
        assert!(matches!(KvRegistration::new(geometry(), 8, small, DataPointerMode::Sgl), Err(ObjstoreError::InvalidRegistration { .. })));
        let wrap = KvLayout::BlockMajor { base: Iova(u64::MAX - 4096 * 4), block_stride_bytes: 8 * 4096 };
        assert!(KvRegistration::new(geometry(), 8, wrap, DataPointerMode::Sgl).is_err());
        let ok = KvRegistration::new(geometry(), 8, separate(0x10_0000, 0x20_0000, 0x1_0000), DataPointerMode::Sgl).unwrap();
        assert!(matches!(ok.object_address(0, KvKind::Key, 8), Err(ObjstoreError::BlockOutOfRange { block: 8, num_blocks: 8 })));
        assert!(matches!(ok.object_address(4, KvKind::Key, 0), Err(ObjstoreError::LayerOutOfRange { layer: 4, layers: 4 })));
        assert!(KvRegistration::new(geometry(), 0, separate(0x10_0000, 0x20_0000, 0x1_0000), DataPointerMode::Sgl).is_err());
    }

    #[test]
    fn addresses_outside_the_registration_are_none_not_a_panic_or_a_wrapped_address() {
        // Goal: the per-block address has no unchecked step: a layer the model lacks is `None`
        // (it indexed the base list, a panic, or for block-major pools gave an address in the
        // next block), and so is a block whose offset runs past the last address (it wrapped).
        let sep = KvRegistration::new(geometry(), 8, separate(0x10_0000, 0x20_0000, 0x1_0000), DataPointerMode::Sgl).unwrap();
        assert_eq!(sep.address(4, KvKind::Value, 0), None);
        assert_eq!(sep.address(3, KvKind::Value, 7), Some(Iova(0x20_0000 + 3 * 0x1_0000 + 7 * 4096)));
        let major = KvLayout::BlockMajor { base: Iova(0x100_0000), block_stride_bytes: 8 * 4096 };
        let major = KvRegistration::new(geometry(), 8, major, DataPointerMode::Sgl).unwrap();
        assert_eq!(major.address(4, KvKind::Key, 0), None);
        // One block at a 2^40-byte stride is a valid registration; block 2^32 - 1 lies 2^72 bytes on.
        let wide = KvLayout::SeparateKv {
            key_bases: (0..4).map(|l| Iova(0x10_0000 + l * 0x1_0000)).collect(),
            value_bases: (0..4).map(|l| Iova(0x20_0000 + l * 0x1_0000)).collect(),
            block_stride_bytes: 1 << 40,
        };
        let wide = KvRegistration::new(geometry(), 1, wide, DataPointerMode::Sgl).unwrap();
        assert_eq!(wide.address(0, KvKind::Key, u32::MAX), None);
        assert!(matches!(wide.object_address(0, KvKind::Key, u32::MAX), Err(ObjstoreError::BlockOutOfRange { .. })));
    }
}

//! Randomized tests of the segment manifest: the journal is a file anyone could have changed or a
//! crash could have cut, so arbitrary bytes must load as some list of sound segments, never a
//! panic; any sequence of appends and rewrites must replay to exactly what a model of the
//! journal says; and a journal cut at any byte must replay to the records written whole before
//! the cut (a torn tail loses registrations, never invents one).

use std::collections::HashMap;

use proptest::collection::vec;
use proptest::prelude::*;

use super::super::held::HeldSegments;
use super::*;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

/// Segments of the smallest size a node may use.
fn blocks() -> SegmentBlocks {
    SegmentBlocks::new(SegmentBlocks::MIN).unwrap()
}

fn space(which: u8) -> ModelSpace {
    ModelSpace::new([which + 1; FINGERPRINT_BYTES], u32::from(which % 2), 2).unwrap()
}

/// A segment's keys: S nonzero keys whose last (the segment key) is chosen from a few, so holds
/// and drops of the same segment meet.
fn segment_keys(last: u8, salt: u64) -> Vec<u64> {
    let mut keys: Vec<u64> = (1..u64::from(blocks().get())).map(|position| salt | position << 40).collect();
    keys.push(u64::from(last) + 1);
    keys
}

/// One call on an open manifest, or a restart that rewrites it with the live segments.
#[derive(Debug, Clone)]
enum Step {
    Held { space: u8, index: u32, last: u8, salt: u64 },
    Dropped { space: u8, last: u8 },
    Lease { lease_id: i64 },
    Flush,
    Restart,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0u8..3, any::<u32>(), 0u8..6, 1u64..1000).prop_map(|(space, index, last, salt)| Step::Held { space, index, last, salt }),
        2 => (0u8..3, 0u8..6).prop_map(|(space, last)| Step::Dropped { space, last }),
        1 => prop_oneof![Just(0i64), 1i64..=i64::MAX, any::<i64>()].prop_map(|lease_id| Step::Lease { lease_id }),
        1 => Just(Step::Flush),
        1 => Just(Step::Restart),
    ]
}

/// The journal's meaning, kept by hand: held segments in the order first recorded (a second
/// "held" of a live segment changes nothing), a drop removes one, the last lease counts.
#[derive(Debug, Default, Clone)]
struct Model {
    segments: Vec<ManifestSegment>,
    lease_id: i64,
}

impl Model {
    fn held(&mut self, space: ModelSpace, index: u32, keys: Vec<u64>) {
        let last = *keys.last().unwrap();
        if !self.segments.iter().any(|segment| segment.space == space && segment.keys.last() == Some(&last)) {
            self.segments.push(ManifestSegment { space, index, keys });
        }
    }

    fn dropped(&mut self, space: ModelSpace, last: u64) {
        self.segments.retain(|segment| !(segment.space == space && segment.keys.last() == Some(&last)));
    }
}

/// A record body: a space (valid or not) followed by what a held, dropped or lease record
/// carries (keys zero or not), or arbitrary bytes of any length.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let space_bytes = prop_oneof![
        (0u8..3).prop_map(|which| {
            let mut out = Vec::new();
            put_space(&mut out, &space(which));
            out
        }),
        vec(any::<u8>(), SPACE_BYTES),
    ];
    let key = prop_oneof![Just(0u64), any::<u64>()];
    let per_segment = usize::from(blocks().get());
    prop_oneof![
        (space_bytes.clone(), any::<u32>(), vec(key.clone(), per_segment)).prop_map(|(mut out, index, keys)| {
            out.extend_from_slice(&index.to_le_bytes());
            keys.iter().for_each(|key| out.extend_from_slice(&key.to_le_bytes()));
            out
        }),
        (space_bytes, key).prop_map(|(mut out, key)| {
            out.extend_from_slice(&key.to_le_bytes());
            out
        }),
        any::<i64>().prop_map(|lease| lease.to_le_bytes().to_vec()),
        vec(any::<u8>(), 0..200),
    ]
}

/// Appends what a held, dropped or lease step records, to the journal and to the model alike;
/// false for the other steps (nothing recorded).
fn record(manifest: &mut Manifest, model: &mut Model, step: &Step) -> bool {
    match *step {
        Step::Held { space: which, index, last, salt } => {
            let keys = segment_keys(last, salt);
            manifest.held(&space(which), index, &keys).unwrap();
            model.held(space(which), index, keys);
        }
        Step::Dropped { space: which, last } => {
            let key = u64::from(last) + 1;
            manifest.dropped(&space(which), SegmentKey::new(key).unwrap()).unwrap();
            model.dropped(space(which), key);
        }
        Step::Lease { lease_id } => {
            manifest.lease(lease_id).unwrap();
            model.lease_id = lease_id;
        }
        Step::Flush | Step::Restart => return false,
    }
    true
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn arbitrary_bytes_load_as_sound_segments_or_nothing(
        header_kind in 0u8..3,
        records in vec((prop_oneof![Just(TAG_HELD), Just(TAG_DROPPED), Just(TAG_LEASE), any::<u8>()], body(), any::<bool>()), 0..6),
        tail in vec(any::<u8>(), 0..64),
    ) {
        // Goal: whatever follows a header (records framed with a right or a wrong CRC, bodies of
        // any length, trailing garbage) loads without a panic, as segments of exactly S nonzero
        // keys in valid model spaces, with the bytes not trusted counted within the file; bytes
        // that do not begin with the magic are refused as not a manifest.
        let mut bytes = match header_kind {
            0 => header(VERSION, blocks()).to_vec(),
            1 => header(VERSION_WITHOUT_LEASE, blocks()).to_vec(),
            _ => Vec::new(),
        };
        for (tag, body, sealed) in &records {
            let mut record = Vec::new();
            frame(&mut record, *tag, |out| out.extend_from_slice(body));
            if !sealed {
                let last = record.len() - 1;
                record[last] ^= 0x5a;
            }
            bytes.extend_from_slice(&record);
        }
        bytes.extend_from_slice(&tail);
        let Ok(loaded) = parse(&bytes, blocks()) else {
            prop_assert!(header_kind == 2 && !bytes.starts_with(MAGIC), "a manifest refused as foreign");
            return Ok(());
        };
        prop_assert!(loaded.dropped_bytes as usize <= bytes.len());
        for segment in &loaded.segments {
            prop_assert_eq!(segment.keys.len(), usize::from(blocks().get()));
            prop_assert!(segment.keys.iter().all(|&key| key != 0), "{:?}", segment);
        }
        if header_kind == 2 && !bytes.is_empty() {
            prop_assert!(loaded.discarded.is_some() && loaded.segments.is_empty());
        }
    }

    #[test]
    fn appends_and_rewrites_replay_to_the_model(steps in vec(step(), 0..40)) {
        // Goal: after any sequence of held, dropped and lease records, flushes and restarts
        // (load, rebuild the held set, rewrite with the last lease), the file loads as exactly
        // the model's segments, in the model's order, and the model's lease.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("manifest");
        let mut model = Model::default();
        let mut manifest = Manifest::rewrite(&path, blocks(), 0, std::iter::empty()).unwrap();
        for step in &steps {
            match *step {
                Step::Flush => manifest.flush().unwrap(),
                Step::Restart => {
                    manifest.flush().unwrap();
                    drop(manifest);
                    let loaded = load(&path, blocks()).unwrap();
                    prop_assert_eq!((loaded.dropped_bytes, loaded.discarded.as_deref()), (0, None));
                    let mut held = HeldSegments::default();
                    for segment in &loaded.segments {
                        held.insert(segment.space, segment.index, &segment.keys);
                    }
                    manifest = Manifest::rewrite(&path, blocks(), loaded.lease_id, held.iter()).unwrap();
                    // The held set's own order is not the journal's: the model follows the
                    // rewrite's order, as the next start will read it.
                    let order: HashMap<(ModelSpace, u64), usize> = held
                        .iter()
                        .enumerate()
                        .map(|(position, segment)| ((segment.space, *segment.keys.last().unwrap()), position))
                        .collect();
                    model.segments.sort_by_key(|segment| order[&(segment.space, *segment.keys.last().unwrap())]);
                    prop_assert_eq!(manifest.records() as usize, model.segments.len() + usize::from(model.lease_id != 0));
                }
                Step::Held { .. } | Step::Dropped { .. } | Step::Lease { .. } => {
                    record(&mut manifest, &mut model, step);
                }
            }
        }
        manifest.flush().unwrap();
        let loaded = load(&path, blocks()).unwrap();
        prop_assert_eq!((loaded.dropped_bytes, loaded.discarded.as_deref()), (0, None));
        prop_assert_eq!(&loaded.segments, &model.segments);
        prop_assert_eq!(loaded.lease_id, model.lease_id);
    }

    #[test]
    fn a_journal_cut_anywhere_replays_the_records_written_whole_before_the_cut(
        steps in vec(step(), 1..24),
        cut in any::<proptest::sample::Index>(),
    ) {
        // Goal: a crash that keeps any prefix of the file's bytes loads as the model of the
        // records that end at or before the cut, with the bytes after them counted as dropped.
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("manifest");
        let mut manifest = Manifest::rewrite(&path, blocks(), 0, std::iter::empty()).unwrap();
        // (file length after the record, the model after it)
        let mut after = vec![(HEADER_BYTES, Model::default())];
        let mut model = Model::default();
        for step in &steps {
            if !record(&mut manifest, &mut model, step) {
                continue;
            }
            manifest.flush().unwrap();
            after.push((std::fs::metadata(&path).unwrap().len() as usize, model.clone()));
        }
        drop(manifest);
        let bytes = std::fs::read(&path).unwrap();
        let length = HEADER_BYTES + cut.index(bytes.len() - HEADER_BYTES + 1);
        let (whole_bytes, expected) = after.iter().rev().find(|(end, _)| *end <= length).unwrap();
        let loaded = parse(&bytes[..length], blocks()).unwrap();
        prop_assert_eq!(&loaded.segments, &expected.segments);
        prop_assert_eq!(loaded.lease_id, expected.lease_id);
        prop_assert_eq!(loaded.dropped_bytes as usize, length - whole_bytes);
    }
}

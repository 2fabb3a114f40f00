//! Building one command's data pointer: PRP vs SGL, 1 vs 32 segments (issue 2, benchmark b).
//!
//! What it should reach and why: a 4 KiB single-segment command touches only DPTR (no scratch
//! page), so it should cost tens of nanoseconds; 32 scattered 4 KiB segments write 32 PRP entries
//! (8 B each) or 32 SGL descriptors (16 B each) into the command's scratch page, so a few hundred
//! nanoseconds at most. Anything near a microsecond means the planner or the copies regressed.
use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use nvme_driver::datapath::{build_data_pointer, plan_command, Cursor, DataPointerMode, DataSegment, ScratchPage};
use nvme_driver::spec::SubmissionEntry;
use nvme_driver::{BlockCount, DmaAllocator, DmaPool, Iova, Lba, NamespaceId};

fn segments(count: usize) -> Vec<DataSegment> {
    // 4 KiB pieces 64 KiB apart: scattered like KV blocks in a paged pool.
    (0..count).map(|index| DataSegment::new(Iova(0x1_0000_0000 + index as u64 * 0x10000), 4096)).collect()
}

fn bench(c: &mut Criterion) {
    let pool = DmaPool::identity();
    let scratch = pool.allocate(4096).expect("scratch page");
    let mut group = c.benchmark_group("command_build");
    for mode in [DataPointerMode::Prp, DataPointerMode::Sgl] {
        for count in [1usize, 32] {
            let list = segments(count);
            group.throughput(Throughput::Elements(1));
            group.bench_function(format!("{}_{}x4KiB", mode.name(), count), |b| {
                b.iter(|| {
                    let plan = plan_command(black_box(&list), Cursor::default(), 1 << 21, 512, mode).expect("plan").expect("non-empty");
                    let blocks = BlockCount::new((plan.bytes / 512) as u32).expect("at most 2 MiB of 512 B blocks");
                    let mut entry = SubmissionEntry::read(NamespaceId(1), Lba(0), blocks);
                    build_data_pointer(&mut entry, &list, &plan, mode, ScratchPage::new(&scratch, 0).expect("scratch page"))
                        .expect("build");
                    black_box(entry)
                })
            });
        }
    }
    group.finish();
    println!("configuration: one command, 512 B LBAs, 4 KiB segments 64 KiB apart, scratch page in host memory");
}

criterion_group!(benches, bench);
criterion_main!(benches);

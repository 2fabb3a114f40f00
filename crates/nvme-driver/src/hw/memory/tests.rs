use super::*;

#[test]
fn allocate_is_zeroed_aligned_and_translatable() {
    let pool = DmaPool::identity();
    let region = pool.allocate(10_000).expect("allocate");
    assert_eq!(region.len(), 12_288);
    assert_eq!(region.iova().0 % 4096, 0);
    let mut bytes = vec![1u8; region.len()];
    region.read(0, &mut bytes).unwrap();
    assert!(bytes.iter().all(|&b| b == 0));
    region.write(100, b"hello").unwrap();
    let view = pool.translate(region.iova().checked_add(100).unwrap(), 5).expect("translate");
    let mut out = [0u8; 5];
    view.read(0, &mut out).unwrap();
    assert_eq!(&out, b"hello");
}

/// Maps nothing and fails every unmap, as an IOMMU that refused to tear a mapping down.
struct FailingUnmap;

impl IommuMapper for FailingUnmap {
    // SAFETY: maps nothing and reads nothing through `_host`, so no caller promise is relied on.
    unsafe fn map(&self, _host: *mut u8, _len: usize, _iova: Iova) -> Result<(), HwError> {
        Ok(())
    }
    fn unmap(&self, iova: Iova, len: usize) -> Result<(), HwError> {
        Err(HwError::Unmapped { iova, len })
    }
}

#[test]
fn host_memory_whose_unmap_failed_stays_mapped() {
    // Goal: when the IOMMU unmap fails, the device may still reach the pages, so the
    // region's own memory is leaked with its IOVA range, never munmapped.
    let pool = DmaPool::new(Arc::new(FailingUnmap), Iova(1 << 32), Iova(1 << 40), false);
    let region = pool.allocate(3 * PAGE_SIZE_BYTES).unwrap();
    let (ptr, len) = (region.inner.ptr, region.inner.len);
    drop(region);
    let mut resident = vec![0u8; len / PAGE_SIZE_BYTES];
    // SAFETY: mincore only reads the page tables for `ptr..ptr+len` (page aligned, one byte
    // of `resident` per page); it fails with ENOMEM, touching nothing, if they are unmapped.
    let status = unsafe { libc::mincore(ptr.as_ptr().cast(), len, resident.as_mut_ptr()) };
    assert_eq!(status, 0, "the pages were unmapped: {}", std::io::Error::last_os_error());
}

#[test]
fn allocated_memory_is_resident_before_anything_touches_it() {
    // Goal: DMA memory is populated at allocation (as VFIO's pinning makes it), so no first
    // touch inside the data path pays a page fault per page. Without MAP_POPULATE, none of
    // an untouched anonymous mapping's pages is resident.
    let memory = HostMemory::allocate(8 << 20, false).unwrap();
    let pages = memory.len() / PAGE_SIZE_BYTES;
    let mut resident = vec![0u8; pages];
    // SAFETY: `memory` is a live page-aligned mapping of `memory.len()` bytes, and
    // `resident` has one byte per page of it, as mincore(2) requires.
    let status = unsafe { libc::mincore(memory.ptr.as_ptr().cast(), memory.len(), resident.as_mut_ptr()) };
    assert_eq!(status, 0, "mincore: {}", std::io::Error::last_os_error());
    let missing = resident.iter().filter(|&&page| page & 1 == 0).count();
    assert_eq!(missing, 0, "{missing} of {pages} pages not resident");
}

#[test]
fn large_allocations_start_on_a_huge_page_and_ask_for_transparent_huge_pages() {
    // Goal: 4 KiB-page memory of 2 MiB or more starts on a 2 MiB boundary and its mapping is
    // eligible for transparent huge pages (so a 1 MiB transfer can be one physically
    // contiguous segment). Whether the kernel found free huge pages is its business and is
    // not asserted; eligibility is the mapping's own (smaps' THPeligible).
    let memory = HostMemory::allocate(5 << 20, false).unwrap();
    let start = memory.ptr.as_ptr() as usize;
    assert_eq!(start % HUGE_PAGE_SIZE_BYTES, 0, "start {start:#x}");
    assert_eq!(memory.len(), 5 << 20);
    let small = HostMemory::allocate(1 << 20, false).unwrap();
    assert_eq!(small.len(), 1 << 20, "below 2 MiB nothing is rounded up to a huge page");
    let Ok(enabled) = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled") else {
        eprintln!("no transparent huge pages in this kernel: eligibility not checked");
        return;
    };
    if enabled.contains("[never]") {
        eprintln!("transparent huge pages are off here: eligibility not checked");
        return;
    }
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    let mut eligible = None;
    for line in smaps.lines() {
        let bounds = line.split_whitespace().next().and_then(|first| first.split_once('-'));
        let bounds = bounds.and_then(|(from, to)| Some((usize::from_str_radix(from, 16).ok()?, usize::from_str_radix(to, 16).ok()?)));
        if let Some((from, to)) = bounds {
            inside = from <= start && start < to;
        } else if let (true, Some(value)) = (inside, line.strip_prefix("THPeligible:")) {
            eligible = Some(value.trim().to_string());
        }
    }
    assert_eq!(eligible.as_deref(), Some("1"), "the mapping at {start:#x} is not eligible for transparent huge pages");
}

#[test]
fn out_of_range_and_misaligned_are_errors() {
    let pool = DmaPool::identity();
    let region = pool.allocate(4096).unwrap();
    assert!(matches!(region.write(4090, &[0; 7]), Err(HwError::OutOfRange { .. })));
    assert!(matches!(region.load_u32(2, Ordering::Relaxed), Err(HwError::Misaligned { .. })));
    assert!(matches!(region.subregion(usize::MAX, 2), Err(HwError::OutOfRange { .. })));
    assert!(pool.translate(region.iova().checked_add(4000).unwrap(), 200).is_err());
    assert!(pool.translate(Iova(5), 1).is_err());
}

#[test]
fn a_streamed_entry_lands_whole_and_bad_offsets_are_refused() {
    // Goal: the non-temporal copy writes exactly the 64 bytes, in order, at the offset, and
    // nothing around them; an offset the instruction cannot take is an error, not a fault.
    let pool = DmaPool::identity();
    let region = pool.allocate(4096).unwrap();
    region.fill(0, 4096, 0xEE).unwrap();
    let entry: [u8; 64] = std::array::from_fn(|index| index as u8);
    region.write_entry_streaming(128, &entry).unwrap();
    crate::hw::fence_before_submission_doorbell();
    let mut back = [0u8; 192];
    region.read(64, &mut back).unwrap();
    assert!(back[..64].iter().all(|&byte| byte == 0xEE), "bytes before the entry changed");
    assert_eq!(back[64..128], entry, "the entry");
    assert!(back[128..].iter().all(|&byte| byte == 0xEE), "bytes after the entry changed");
    assert!(matches!(region.write_entry_streaming(8, &entry), Err(HwError::Misaligned { .. })));
    assert!(matches!(region.write_entry_streaming(4064, &entry), Err(HwError::OutOfRange { .. })));
}

#[test]
fn prefetch_meets_every_line_of_the_range_and_stays_inside_it() {
    // Goal: whatever the region's and the range's alignment, the prefetched offsets fall in
    // exactly the cache lines the range touches, each inside the range's end.
    for base in [4096usize, 4096 + 8, 4096 + 48] {
        for (offset, end) in [(0, 1), (0, 64), (32, 544), (16, 17), (60, 70), (64, 512), (5, 4000)] {
            let offsets: Vec<usize> = super::prefetch_offsets(base, offset, end).collect();
            assert!(offsets.iter().all(|&within| within < end), "base {base}, {offset}..{end}: {offsets:?}");
            let lines: Vec<usize> = offsets.iter().map(|within| (base + within) / 64).collect();
            let expected: Vec<usize> = ((base + offset) / 64..=(base + end - 1) / 64).collect();
            assert_eq!(lines, expected, "base {base}, {offset}..{end}");
        }
    }
}

#[test]
fn dropped_region_is_unmapped_and_reused() {
    let pool = DmaPool::identity();
    let first = pool.allocate(4096).unwrap();
    let iova = first.iova();
    drop(first);
    assert!(pool.translate(iova, 1).is_err(), "a freed region must not translate");
    let second = pool.allocate(4096).unwrap();
    assert_eq!(second.iova(), iova, "freed IOVA ranges are reused");
}

#[test]
fn a_translation_that_overruns_a_region_being_dropped_does_not_deadlock() {
    // Goal: a failed translate may hold the last strong reference to a region whose holder just
    // dropped it; releasing that region takes the table's write lock, so the translation must
    // have let go of the table's read lock first. Before, it was still held: the releasing
    // thread deadlocked on itself and every later allocation on the pool hung behind it.
    use std::sync::atomic::AtomicBool;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};
    let pool = DmaPool::identity();
    let latest = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (done, finished) = mpsc::channel::<&'static str>();
    let run_for = Duration::from_secs(2);
    let allocator = {
        let (pool, latest, stop, done) = (pool.clone(), Arc::clone(&latest), Arc::clone(&stop), done.clone());
        std::thread::spawn(move || {
            let started = Instant::now();
            while started.elapsed() < run_for {
                let region = pool.allocate(PAGE_SIZE_BYTES).unwrap();
                latest.store(region.iova().0, Ordering::Relaxed);
                drop(region);
            }
            stop.store(true, Ordering::Relaxed);
            let _ = done.send("allocator");
        })
    };
    let translator = {
        let (pool, latest, stop) = (pool.clone(), Arc::clone(&latest), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let iova = latest.load(Ordering::Relaxed);
                if iova != 0 {
                    // Twice the region's length: always refused, after the upgrade.
                    assert!(pool.translate(Iova(iova), 2 * PAGE_SIZE_BYTES).is_err());
                }
            }
            let _ = done.send("translator");
        })
    };
    for _ in 0..2 {
        let name = finished.recv_timeout(Duration::from_secs(10)).expect("a thread hung: the pool deadlocked");
        eprintln!("{name} finished");
    }
    allocator.join().unwrap();
    translator.join().unwrap();
}

#[test]
fn memory_reusing_a_range_being_released_translates_at_once() {
    // Goal: while a region's release is still under way, the range it gave back may already
    // hold a new region that starts below it (freed ranges merge, best fit); a translation of
    // that new region at the old region's start must find the new region, not the old one's
    // table entry. Before, the range went back to the allocator before the dead entry left the
    // table: the translation found the dead entry (the largest start at or below it), could not
    // upgrade it, and answered Unmapped for validly mapped memory.
    use std::sync::mpsc;
    use std::time::Duration;
    let page = PAGE_SIZE_BYTES as u64;
    let pool = DmaPool::identity();
    let a = pool.allocate(PAGE_SIZE_BYTES).unwrap();
    let b = pool.allocate(PAGE_SIZE_BYTES).unwrap();
    let c = pool.allocate(2 * PAGE_SIZE_BYTES).unwrap();
    let d = pool.allocate(PAGE_SIZE_BYTES).unwrap();
    let base = a.iova().0;
    let layout: Vec<u64> = [&a, &b, &c, &d].iter().map(|region| region.iova().0 - base).collect();
    assert_eq!(layout, [0, page, 2 * page, 4 * page]);
    let (b_iova, c_iova) = (b.iova(), c.iova());
    drop(b);
    // The release of `c` stops once its range is back in the allocator, until told to go on.
    let (reached_sender, reached) = mpsc::channel::<()>();
    let (go, go_receiver) = mpsc::channel::<()>();
    let (reached_sender, go_receiver) = (Mutex::new(reached_sender), Mutex::new(go_receiver));
    *pool.shared.after_give_back.lock().unwrap() = Some(Arc::new(move |iova: Iova| {
        if iova == c_iova {
            let _ = reached_sender.lock().unwrap().send(());
            // Bounded: a test that fails before telling it to go on still ends.
            let _ = go_receiver.lock().unwrap().recv_timeout(Duration::from_secs(10));
        }
    }));
    let dropper = std::thread::spawn(move || drop(c));
    reached.recv_timeout(Duration::from_secs(10)).expect("the release of c never gave its range back");
    // [b, d) is one free range of three pages now: the new region takes it all.
    let reused = pool.allocate(3 * PAGE_SIZE_BYTES);
    let translated = reused.as_ref().ok().map(|_| pool.translate(c_iova, PAGE_SIZE_BYTES));
    go.send(()).unwrap();
    dropper.join().unwrap();
    let reused = reused.expect("allocate 3 pages");
    assert_eq!(reused.iova(), b_iova, "best fit over the merged range [b, d)");
    let translated = translated.unwrap().expect("the new region, at c's old start, while c's release is under way");
    assert_eq!(translated.host_address(), reused.host_address() + PAGE_SIZE_BYTES);
    assert_eq!((translated.iova(), translated.len()), (c_iova, PAGE_SIZE_BYTES));
    drop((a, d));
}

#[test]
fn freed_iova_ranges_merge_so_windows_of_changing_sizes_keep_fitting() {
    // Goal: freed IOVA ranges merge with their neighbours and with the untouched space above
    // them, so a pool whose windows come and go in different sizes never runs out while most
    // of its space is free. Before, freed ranges were kept apart and reused first-fit: after
    // this loop the 16 MiB pool, with nothing in use, could not give 16 MiB.
    let pool = DmaPool::new(Arc::new(IdentityMapper), Iova(0), Iova(16 << 20), false);
    for round in 0..10 {
        let a = pool.allocate(4 << 20).unwrap_or_else(|error| panic!("round {round}, 4 MiB: {error}"));
        drop(a);
        let s = pool.allocate(4096).unwrap_or_else(|error| panic!("round {round}, 4 KiB: {error}"));
        let b = pool.allocate(6 << 20).unwrap_or_else(|error| panic!("round {round}, 6 MiB: {error}"));
        drop(b);
        drop(s);
    }
    let whole = pool.allocate(16 << 20).expect("with nothing in use, the whole space is one range again");
    assert_eq!(whole.iova(), Iova(0));
}

#[test]
fn the_smallest_free_range_that_fits_is_used_and_alignment_gaps_are_not_lost() {
    // Goal: reserve takes the best-fitting freed range (leaving large ranges whole for large
    // requests), and the gap a huge-page alignment skips stays free for smaller requests.
    let pool = DmaPool::new(Arc::new(IdentityMapper), Iova(0), Iova(64 << 20), false);
    let first = pool.allocate(4096).unwrap();
    assert_eq!(first.iova(), Iova(0));
    // 2 MiB aligned: skips 4 KiB..2 MiB, which must stay usable.
    let huge = pool.allocate(2 << 20).unwrap();
    assert_eq!(huge.iova(), Iova(2 << 20));
    let in_gap = pool.allocate(8192).unwrap();
    assert_eq!(in_gap.iova(), Iova(4096), "the alignment gap is reused");
    let small_hole = pool.allocate(4096).unwrap();
    let separator = pool.allocate(4096).unwrap();
    let _ = &separator;
    assert_eq!((small_hole.iova(), separator.iova()), (Iova(3 * 4096), Iova(4 * 4096)));
    let big_hole = pool.allocate(8 << 20).unwrap();
    let _after = pool.allocate(4096).unwrap();
    let (small_iova, big_iova) = (small_hole.iova(), big_hole.iova());
    drop((big_hole, small_hole));
    let next = pool.allocate(4096).unwrap();
    assert_eq!(next.iova(), small_iova, "best fit: the 4 KiB hole, not the 8 MiB one");
    let large = pool.allocate(6 << 20).unwrap();
    assert_eq!(large.iova(), big_iova, "the 8 MiB hole was kept whole");
}

proptest::proptest! {
    #[test]
    fn iova_reservations_never_overlap_and_all_space_comes_back(
        steps in proptest::collection::vec((0u8..4, 1u64..64, 0usize..64), 1..200),
    ) {
        // Goal: against a model (the list of live ranges), whatever mix of aligned
        // reservations, fixed reservations and releases, no two live ranges overlap, each lies
        // in the pool and is aligned as asked, and once all are released the free ranges have
        // merged back into untouched space (nothing fragmented is left behind).
        const PAGE: u64 = PAGE_SIZE_BYTES as u64;
        let (base, limit) = (1u64 << 20, (1u64 << 20) + 256 * PAGE);
        let shared = PoolShared::new(Arc::new(IdentityMapper), Iova(base), Iova(limit));
        let mut live: Vec<(u64, u64)> = Vec::new();
        for (kind, pages, pick) in steps {
            let len = pages * PAGE;
            match kind {
                0 | 1 => {
                    let align = if kind == 0 { PAGE } else { 16 * PAGE };
                    if let Ok(start) = shared.reserve(len, align) {
                        proptest::prop_assert!(start % align == 0 && start >= base && start + len <= limit);
                        live.push((start, len));
                    }
                }
                2 => {
                    let start = base + (pick as u64 * 4) * PAGE;
                    let taken = live.iter().any(|&(other, other_len)| start < other + other_len && other < start + len);
                    let result = shared.reserve_exact(start, len);
                    if start + len > limit {
                        proptest::prop_assert!(result.is_err());
                    } else if taken {
                        proptest::prop_assert!(matches!(result, Err(HwError::Overlap { .. })), "{result:?}");
                    } else {
                        // Free in the model: it must be granted (merging leaves no straddle).
                        proptest::prop_assert!(result.is_ok(), "{start:#x}+{len:#x}: {result:?}");
                        live.push((start, len));
                    }
                }
                _ => {
                    if !live.is_empty() {
                        let (start, len) = live.swap_remove(pick % live.len());
                        shared.unreserve(start, len);
                    }
                }
            }
            let mut sorted = live.clone();
            sorted.sort();
            for pair in sorted.windows(2) {
                proptest::prop_assert!(pair[0].0 + pair[0].1 <= pair[1].0, "overlap: {pair:?}");
            }
        }
        for (start, len) in live.drain(..) {
            shared.unreserve(start, len);
        }
        let state = shared.state.lock().unwrap();
        proptest::prop_assert_eq!(state.next, base);
        proptest::prop_assert!(state.free.is_empty(), "{:?}", state.free);
    }
}

#[test]
fn a_leak_counts_the_whole_allocation_once() {
    // Goal: leaking a window keeps its whole allocation (a 4 KiB subregion of a 12 KiB
    // allocation keeps the 12 KiB; of a 2 MiB scratch on a huge page, the 2 MiB), so the bytes
    // reported are the allocation's, counted once however many of its windows are leaked:
    // summing the results is what was kept. Before, each call reported its window's length.
    let pool = DmaPool::identity();
    let region = pool.allocate(3 * PAGE_SIZE_BYTES).unwrap();
    let first_page = region.subregion(0, PAGE_SIZE_BYTES).unwrap();
    let last_page = region.subregion(2 * PAGE_SIZE_BYTES, PAGE_SIZE_BYTES).unwrap();
    let iova = region.iova();
    let leaked = [first_page.leak(), last_page.leak(), region.leak()];
    assert_eq!(leaked, [3 * PAGE_SIZE_BYTES, 0, 0]);
    assert!(pool.translate(iova, 3 * PAGE_SIZE_BYTES).is_ok(), "the leaked allocation stays mapped");
}

#[test]
fn lengths_that_overflow_when_rounded_to_a_page_are_errors() {
    // Goal: a length whose page-rounded size does not fit in usize is refused with an error
    // by every allocator, never wrapped (release builds: a zero-length "success") and never a
    // panic (debug builds: an overflow in the rounding).
    struct Endless;
    impl CopiedMemory for Endless {
        fn len(&self) -> usize {
            usize::MAX
        }
        fn read(&self, _offset: usize, _destination: &mut [u8]) -> Result<(), HwError> {
            Ok(())
        }
        fn write(&self, _offset: usize, _source: &[u8]) -> Result<(), HwError> {
            Ok(())
        }
        fn describe(&self) -> String {
            "memory as long as usize::MAX".into()
        }
    }
    let pool = DmaPool::identity();
    for len in [usize::MAX, usize::MAX - PAGE_SIZE_BYTES + 2] {
        let allocated = pool.allocate(len);
        assert!(allocated.is_err(), "{len:#x}: {allocated:?}");
        let memory = HostMemory::allocate(len, true);
        assert!(memory.is_err(), "{len:#x}: {memory:?}");
    }
    let copied = pool.map_copied(Arc::new(Endless));
    assert!(matches!(copied, Err(HwError::IovaExhausted { .. })), "{copied:?}");
    let memory = SharedMemory::create("overflow-test", 4 * PAGE_SIZE_BYTES).unwrap();
    let window = super::super::DmaWindow::new(memory, Iova(1 << 40), AddressSpaceId(1)).unwrap();
    for len in [usize::MAX, usize::MAX - PAGE_SIZE_BYTES + 2] {
        let allocated = window.allocate(len);
        assert!(matches!(allocated, Err(HwError::IovaExhausted { .. })), "{len:#x}: {allocated:?}");
    }
}

#[test]
fn only_allocations_of_a_huge_page_or_more_try_huge_pages() {
    // Goal: a small allocation (a 1 KiB admin CQ, a 4 KiB scratch page, a shadow doorbell
    // page) never takes a whole 2 MiB page out of the reserved pool that KV buffers need.
    assert!(!tries_huge_pages(1, true));
    assert!(!tries_huge_pages(PAGE_SIZE_BYTES, true));
    assert!(!tries_huge_pages(HUGE_PAGE_SIZE_BYTES - 1, true));
    assert!(tries_huge_pages(HUGE_PAGE_SIZE_BYTES, true));
    assert!(tries_huge_pages(HUGE_PAGE_SIZE_BYTES + 1, true));
    assert!(!tries_huge_pages(HUGE_PAGE_SIZE_BYTES, false));
}

/// 2 MiB hugetlbfs pages a new mapping can take on this machine: free ones not already
/// reserved. `free_hugepages` counts pages promised to mappings that have not touched them yet
/// (`resv_hugepages`, e.g. fio's `--mem=shmhuge`); a `MAP_HUGETLB` mapping is refused unless
/// one more is free. Read from the 2 MiB pool's sysfs directory, which `mmap_flags` asks for
/// whatever the default huge page size.
fn available_huge_pages() -> u64 {
    let count = |name: &str| {
        std::fs::read_to_string(format!("/sys/kernel/mm/hugepages/hugepages-2048kB/{name}"))
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    count("free_hugepages").saturating_sub(count("resv_hugepages"))
}

#[test]
fn small_allocations_take_small_pages_where_huge_pages_are_reserved() {
    // Goal: with huge pages preferred and reserved, a 4 KiB allocation is 4 KiB of 4 KiB pages
    // (leaking it pins 4 KiB), and a 2 MiB one still takes a huge page. Without available huge
    // pages every allocation falls back to 4 KiB pages, so this cannot fail there: it says so,
    // and the rule itself is pinned by `only_allocations_of_a_huge_page_or_more_try_huge_pages`.
    let available = available_huge_pages();
    if available == 0 {
        eprintln!(
            "no available 2 MiB huge pages here (free minus reserved): small allocations could not take one, and the large one is not checked"
        );
    }
    let pool = DmaPool::new(Arc::new(IdentityMapper), Iova(1 << 32), Iova(1 << 40), true);
    assert_eq!(pool.allocate(PAGE_SIZE_BYTES).unwrap().leak(), PAGE_SIZE_BYTES);
    let small = HostMemory::allocate(1024, true).unwrap();
    assert_eq!((small.kind(), small.len()), (PageKind::Small4KiB, PAGE_SIZE_BYTES));
    if available > 0 {
        let large = HostMemory::allocate(HUGE_PAGE_SIZE_BYTES, true).unwrap();
        if large.kind() == PageKind::Small4KiB && available_huge_pages() == 0 {
            // Another process took the last page between the count and the mapping.
            eprintln!("the available huge pages were taken meanwhile: the large allocation is not checked");
            return;
        }
        assert_eq!((large.kind(), large.len()), (PageKind::Huge2MiB, HUGE_PAGE_SIZE_BYTES), "{available} huge pages were available");
    }
}

#[test]
fn huge_page_mappings_ask_for_2_mib_pages_whatever_the_default_size() {
    // Goal: a hugetlbfs mapping names its page size. Without a size in the flags the kernel
    // takes the default huge page size, which is 1 GiB on hosts booted with
    // `default_hugepagesz=1G`: a 2 MiB allocation then took a whole 1 GiB page, and Drop's
    // munmap of 2 MiB could not split it, so the page stayed mapped for good.
    let flags = mmap_flags(PageKind::Huge2MiB);
    assert_ne!(flags & libc::MAP_HUGETLB, 0);
    let log2_size = (flags >> libc::MAP_HUGE_SHIFT) & libc::MAP_HUGE_MASK;
    assert_eq!(1usize.checked_shl(log2_size as u32), Some(HUGE_PAGE_SIZE_BYTES), "flags {flags:#x}");
    let small = mmap_flags(PageKind::Small4KiB);
    assert_eq!(small & (libc::MAP_HUGETLB | (libc::MAP_HUGE_MASK << libc::MAP_HUGE_SHIFT)), 0, "flags {small:#x}");
}

#[test]
fn a_failed_unmap_of_host_memory_is_logged_and_the_memory_kept() {
    // Goal: host memory whose munmap fails stays mapped (a device may still write it, so it is
    // never handed back some other way), and that leak is said at error level, not ignored as
    // Drop did. A start that is not page-aligned is what makes munmap refuse here (EINVAL)
    // without touching any mapping.
    let unaligned = NonNull::new((PAGE_SIZE_BYTES + 1) as *mut u8).unwrap();
    let memory = HostMemory { ptr: unaligned, len: HUGE_PAGE_SIZE_BYTES, kind: PageKind::Huge2MiB };
    let ((), errors) = crate::hardening_tests::messages_during(tracing::Level::ERROR, || drop(memory));
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].contains("leaked"), "{errors:?}");
}

//! Range reads whose answers always fit [`RESPONSE_BYTES_MAX`].
//!
//! A sound entry is small (`layout::SEGMENT_ENTRY_BYTES_MAX`, `MEMBER_ENTRY_BYTES_MAX`), and
//! pages are sized so that sound entries fit one answer. But etcd stores whatever a writer puts
//! (values up to its `--max-request-bytes`, 1.5 MiB by default), so a few foreign entries can
//! make a page's answer longer than the client decodes: the scan then reads half as many at a
//! time, down to one, and an entry too large to read even alone is stepped over by its key
//! (a keys-only read) and counted, never decoded. The key that read finds is read once more
//! with its value: the big entry may have been deleted or replaced meanwhile, and a readable
//! entry found in its place is visited, not skipped. Only a key that is itself too large for an
//! answer (etcd configured for requests over 4 MiB) stops the scan, reported as `unreadable`.

use std::time::Instant;

use etcd_client::{GetOptions, KeyValue};

use crate::config::RESPONSE_BYTES_MAX;
use crate::connection::{is_too_large, Connection};
use crate::error::Result;

/// How a scan ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Scanned {
    /// Entries read, oversized ones included (at most the scan's bound).
    pub entries: u64,
    /// Entries too large to read even alone: stepped over, their values never read.
    pub oversized: u64,
    /// Entries of the range were left unread: the bound was reached with more left, or an
    /// unreadable key stopped the scan.
    pub more: bool,
    /// A key too large for any answer stopped the scan (counted in `oversized`).
    pub unreadable: bool,
}

#[cfg(test)]
thread_local! {
    /// Tests only: run before the keys-only read that steps over an entry too large to read.
    static BEFORE_KEY_ONLY: std::cell::RefCell<Option<Box<dyn FnMut()>>> = const { std::cell::RefCell::new(None) };
}

/// The first key after every key that starts with `prefix`: the end of its range.
pub(crate) fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    // The prefixes here end in '/', never 0xff: incrementing the last byte is the range end.
    debug_assert!(end.last().is_some_and(|&last| last < 0xff));
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

/// The first key after `key`, for the next page.
fn after(key: &[u8]) -> Vec<u8> {
    let mut next = key.to_vec();
    next.push(0);
    next
}

/// Reads the entries of `[start, end)` in key order, at most `entries_max` of them, at most
/// `page_max` per request, and hands each to `visit` (not the oversized ones). Every request
/// shares `deadline` (and each is bounded by the request timeout).
pub(crate) fn scan(
    connection: &Connection,
    operation: &'static str,
    deadline: Instant,
    range: (Vec<u8>, Vec<u8>),
    entries_max: u64,
    page_max: u64,
    mut visit: impl FnMut(&KeyValue),
) -> Result<Scanned> {
    let (mut start, end) = range;
    let page_max = page_max.max(1);
    let mut page = page_max;
    let mut scanned = Scanned::default();
    while scanned.entries < entries_max {
        let limit = page.min(entries_max - scanned.entries);
        let read = connection.call_kv_by(operation, deadline, |mut client| {
            let options = GetOptions::new().with_range(end.clone()).with_limit(limit as i64);
            let start = start.clone();
            async move { client.get(start, Some(options)).await }
        });
        let answer = match read {
            Ok(answer) => answer,
            Err(error) if is_too_large(&error) && limit > 1 => {
                page = limit / 2;
                continue;
            }
            Err(error) if is_too_large(&error) => {
                // One entry larger than an answer may be: step over it by its key alone.
                #[cfg(test)]
                BEFORE_KEY_ONLY.with(|hook| {
                    if let Some(hook) = hook.borrow_mut().as_mut() {
                        hook()
                    }
                });
                let key_only = connection.call_kv_by(operation, deadline, |mut client| {
                    let options = GetOptions::new().with_range(end.clone()).with_limit(1).with_keys_only();
                    let start = start.clone();
                    async move { client.get(start, Some(options)).await }
                });
                let answer = match key_only {
                    Ok(answer) => answer,
                    Err(error) if is_too_large(&error) => {
                        tracing::warn!(operation, "an etcd key longer than an answer may be stopped a scan");
                        scanned.oversized += 1;
                        scanned.more = true;
                        scanned.unreadable = true;
                        return Ok(scanned);
                    }
                    Err(error) => return Err(error),
                };
                let Some(entry) = answer.kvs().first() else {
                    // The range emptied since the read that was too large: nothing is left
                    // unread (not the previous page's `more`).
                    scanned.more = false;
                    return Ok(scanned);
                };
                let key = entry.key().to_vec();
                // The entry too large may have been deleted or replaced since: the key found
                // may hold a readable entry, read again with its value (that key alone) and
                // visited rather than skipped as oversized.
                let whole = connection.call_kv_by(operation, deadline, |mut client| {
                    let key = key.clone();
                    async move { client.get(key, Some(GetOptions::new().with_limit(1))).await }
                });
                match whole {
                    Ok(whole) => {
                        // Gone again by now: nothing to visit.
                        if let Some(entry) = whole.kvs().first() {
                            visit(entry);
                            scanned.entries += 1;
                        }
                    }
                    Err(error) if is_too_large(&error) => {
                        tracing::debug!(operation, "an etcd entry longer than an answer may be was skipped");
                        scanned.entries += 1;
                        scanned.oversized += 1;
                    }
                    Err(error) => return Err(error),
                }
                scanned.more = answer.more();
                if !scanned.more {
                    return Ok(scanned);
                }
                start = after(&key);
                continue;
            }
            Err(error) => return Err(error),
        };
        for entry in answer.kvs() {
            visit(entry);
        }
        scanned.entries += answer.kvs().len() as u64;
        scanned.more = answer.more();
        match answer.kvs().last() {
            Some(last) if scanned.more => start = after(last.key()),
            _ => return Ok(scanned),
        }
        // Past the big entries: back towards whole pages.
        page = page.saturating_mul(2).min(page_max);
    }
    Ok(scanned)
}

/// Entries of at most `entry_bytes_max` bytes each that one page of a scan may ask for, so
/// that sound entries never make its answer too long.
pub(crate) fn page_entries(entry_bytes_max: usize) -> u64 {
    ((RESPONSE_BYTES_MAX - crate::layout::ANSWER_OVERHEAD_BYTES) / entry_bytes_max) as u64
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::local_etcd::LocalEtcd;

    fn put(connection: &Connection, key: &'static str, value: Vec<u8>) {
        connection
            .call_kv("put", |mut kv| {
                let value = value.clone();
                async move { kv.put(key, value, None).await }
            })
            .unwrap();
    }

    /// One etcd member that takes values over 4 MiB (an answer's bound), which it does only with
    /// a larger --max-request-bytes, and a connection to it; None: no etcd binary here.
    fn start_etcd_taking_oversized_values() -> Option<(LocalEtcd, Connection)> {
        let etcd = LocalEtcd::start_or_skip_with_flags(1, &["--max-request-bytes", "6291456"])?;
        let connection = Connection::open(&etcd.endpoints(), Duration::from_secs(5)).unwrap();
        Some((etcd, connection))
    }

    /// Puts "scan/a", readable, then "scan/b", too large (4.5 MiB) to read even alone.
    fn put_a_readable_then_an_oversized_entry(connection: &Connection) {
        put(connection, "scan/a", vec![1]);
        put(connection, "scan/b", vec![0x5a; 4608 << 10]);
    }

    /// Before each keys-only read that steps over an oversized entry (until [`scan_the_prefix`]
    /// removes the hook): runs `then`, then deletes "scan/b" through a connection of its own, a
    /// change between the reads.
    fn delete_the_oversized_entry_before_the_keys_only_read(etcd: &LocalEtcd, mut then: impl FnMut() + 'static) {
        let deleter = Connection::open(&etcd.endpoints(), Duration::from_secs(5)).unwrap();
        BEFORE_KEY_ONLY.with(|hook| {
            *hook.borrow_mut() = Some(Box::new(move || {
                then();
                deleter.call_kv("delete", |mut kv| async move { kv.delete("scan/b", None).await }).unwrap();
            }))
        });
    }

    /// Scans "scan/" (at most 10 entries, `page_max` a page, 10 s in all) with the keys-only
    /// hook then removed: the keys visited and the answer.
    fn scan_the_prefix(connection: &Connection, page_max: u64) -> (Vec<Vec<u8>>, Result<Scanned>) {
        let mut visited = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        let range = (b"scan/".to_vec(), prefix_end("scan/"));
        let scanned = scan(connection, "test scan", deadline, range, 10, page_max, |entry| visited.push(entry.key().to_vec()));
        BEFORE_KEY_ONLY.with(|hook| hook.borrow_mut().take());
        (visited, scanned)
    }

    #[test]
    fn a_range_emptied_while_an_oversized_entry_is_stepped_over_has_no_more_entries() {
        // Goal: a page that said more entries follow, then an entry too large to read even
        // alone whose keys-only read finds the range emptied meanwhile: the scan ends with
        // `more` false (nothing was left unread), not the previous page's `more`, which made
        // members()/status() report a truncated listing. etcd takes values over 4 MiB (an
        // answer's bound) only with a larger --max-request-bytes.
        let Some((etcd, connection)) = start_etcd_taking_oversized_values() else { return };
        put_a_readable_then_an_oversized_entry(&connection);
        let stepped = std::rc::Rc::new(std::cell::Cell::new(0));
        let counted = stepped.clone();
        delete_the_oversized_entry_before_the_keys_only_read(&etcd, move || counted.set(counted.get() + 1));
        let (visited, scanned) = scan_the_prefix(&connection, 1);
        assert_eq!(stepped.get(), 1, "one keys-only read, after the deletion");
        assert_eq!(visited, vec![b"scan/a".to_vec()]);
        assert_eq!(scanned.unwrap(), Scanned { entries: 1, oversized: 0, more: false, unreadable: false });
    }

    #[test]
    fn a_readable_entry_found_by_the_keys_only_step_is_visited_not_skipped() {
        // Goal: an entry too large to read alone, deleted before the keys-only read that steps
        // over it: that read finds the next entry, a readable one, which was counted as
        // oversized and never visited (a member or holder missing from the answer). Now the key
        // found is read again with its value and visited when it fits.
        let Some((etcd, connection)) = start_etcd_taking_oversized_values() else { return };
        put_a_readable_then_an_oversized_entry(&connection);
        put(&connection, "scan/c", vec![3]);
        delete_the_oversized_entry_before_the_keys_only_read(&etcd, || {});
        let (visited, scanned) = scan_the_prefix(&connection, 1);
        assert_eq!(visited, vec![b"scan/a".to_vec(), b"scan/c".to_vec()], "the readable entry was skipped");
        assert_eq!(scanned.unwrap(), Scanned { entries: 2, oversized: 0, more: false, unreadable: false });
    }

    #[test]
    fn an_entry_too_large_to_read_alone_is_still_stepped_over_and_counted() {
        // Goal: without a change between the reads, the oversized entry is counted and never
        // visited, and the scan goes on past it.
        let Some((_etcd, connection)) = start_etcd_taking_oversized_values() else { return };
        put_a_readable_then_an_oversized_entry(&connection);
        put(&connection, "scan/c", vec![3]);
        let (visited, scanned) = scan_the_prefix(&connection, 4);
        assert_eq!(visited, vec![b"scan/a".to_vec(), b"scan/c".to_vec()]);
        assert_eq!(scanned.unwrap(), Scanned { entries: 3, oversized: 1, more: false, unreadable: false });
    }
}

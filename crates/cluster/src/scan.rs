//! Range reads whose answers always fit [`RESPONSE_BYTES_MAX`].
//!
//! A sound entry is small (`layout::SEGMENT_ENTRY_BYTES_MAX`, `MEMBER_ENTRY_BYTES_MAX`), and
//! pages are sized so that sound entries fit one answer. But etcd stores whatever a writer puts
//! (values up to its `--max-request-bytes`, 1.5 MiB by default), so a few foreign entries can
//! make a page's answer longer than the client decodes: the scan then reads half as many at a
//! time, down to one, and an entry too large to read even alone is stepped over by its key
//! (a keys-only read) and counted, never decoded. Only a key that is itself too large for an
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
                let Some(entry) = answer.kvs().first() else { return Ok(scanned) };
                tracing::debug!(operation, "an etcd entry longer than an answer may be was skipped");
                scanned.entries += 1;
                scanned.oversized += 1;
                scanned.more = answer.more();
                if !scanned.more {
                    return Ok(scanned);
                }
                start = after(entry.key());
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

//! Which byte ranges of an object to fetch, and in how many requests: pure arithmetic,
//! tested on its own.

use std::ops::Range;

/// Ranges closer than this are fetched as one (a request costs more than the bytes).
pub(crate) const MERGE_GAP: u64 = 1 << 20;

/// `ranges` sorted, with those that overlap, touch or lie within `gap` bytes of each
/// other merged into one; empty ranges dropped.
pub(crate) fn merged(mut ranges: Vec<Range<u64>>, gap: u64) -> Vec<Range<u64>> {
    ranges.retain(|r| r.start < r.end);
    ranges.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end.saturating_add(gap) => {
                last.end = last.end.max(r.end);
            }
            _ => out.push(r),
        }
    }
    out
}

/// `ranges` cut into requests of at most `part` bytes each (the last of each range
/// shorter), in order.
pub(crate) fn parts(ranges: &[Range<u64>], part: u64) -> Vec<Range<u64>> {
    let part = part.max(1);
    let mut out = Vec::new();
    for r in ranges {
        let mut at = r.start;
        while at < r.end {
            let end = r.end.min(at.saturating_add(part));
            out.push(at..end);
            at = end;
        }
    }
    out
}

/// `ranges` with the first `done` bytes taken away (bytes already fetched with the
/// header).
pub(crate) fn after(ranges: Vec<Range<u64>>, done: u64) -> Vec<Range<u64>> {
    ranges
        .into_iter()
        .filter(|r| r.end > done)
        .map(|r| r.start.max(done)..r.end)
        .collect()
}

/// The part size for an upload of `len` bytes: `wanted`, raised where needed so that the
/// upload fits S3's limit of 10,000 parts, and never below its 5 MiB minimum.
pub(crate) fn upload_part_bytes(len: u64, wanted: u64) -> u64 {
    const MIN: u64 = 5 << 20;
    const MAX_PARTS: u64 = 10_000;
    wanted.max(MIN).max(len.div_ceil(MAX_PARTS))
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one range is a case like any other here
mod tests {
    use super::*;

    #[test]
    fn neighbouring_ranges_are_fetched_as_one_and_distant_ones_apart() {
        let got = merged(vec![10..20, 0..5, 5..8, 100..200, 30..30], 1);
        assert_eq!(got, vec![0..8, 10..20, 100..200]);
        assert_eq!(merged(vec![0..10, 11..12], 1), vec![0..12]);
        assert_eq!(merged(vec![0..10, 12..13], 1), vec![0..10, 12..13]);
    }

    #[test]
    fn overlapping_and_nested_ranges_merge() {
        assert_eq!(merged(vec![0..100, 10..20, 50..150], 0), vec![0..150]);
    }

    #[test]
    fn ranges_are_cut_into_parts_of_at_most_the_part_size() {
        let got = parts(&[0..25, 40..45], 10);
        assert_eq!(got, vec![0..10, 10..20, 20..25, 40..45]);
        assert!(parts(&[], 10).is_empty());
        assert_eq!(parts(&[0..3], 0), vec![0..1, 1..2, 2..3]);
    }

    #[test]
    fn bytes_fetched_with_the_header_are_not_fetched_again() {
        assert_eq!(after(vec![0..10, 20..30], 25), vec![25..30]);
        assert_eq!(after(vec![0..10], 10), Vec::<Range<u64>>::new());
        assert_eq!(after(vec![5..10], 0), vec![5..10]);
    }

    #[test]
    fn upload_parts_respect_the_limits_of_s3() {
        assert_eq!(upload_part_bytes(1 << 30, 8 << 20), 8 << 20);
        assert_eq!(upload_part_bytes(1 << 20, 1 << 10), 5 << 20);
        let huge = 200u64 << 30;
        assert!(huge.div_ceil(upload_part_bytes(huge, 8 << 20)) <= 10_000);
    }
}

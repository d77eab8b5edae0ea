use super::*;

/// The distinct pages of the rows' contexts, ascending, by a sort: what `used_pages` answers.
fn sorted_pages(page_table: &[i32], pt_stride: u32, context_lens: &[i32]) -> Vec<u32> {
    let mut pages = Vec::new();
    for (r, &len) in context_lens.iter().enumerate() {
        let n = (len.max(0) as u32).div_ceil(PAGE_TOKENS).min(pt_stride) as usize;
        let start = r * pt_stride as usize;
        pages.extend(
            page_table[start..start + n]
                .iter()
                .filter(|&&p| p >= 0)
                .map(|&p| p as u32),
        );
    }
    pages.sort_unstable();
    pages.dedup();
    pages
}

/// Dense tables (the bitmap) and sparse ones (the sort), with shared prefixes, negative
/// entries, empty rows and entries past a row's context, against a plain sort.
#[test]
fn used_pages_are_the_distinct_pages_of_the_contexts_ascending() {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) % n
    };
    for case in 0..200 {
        let (rows, stride) = (1 + next(12) as usize, 1 + next(40) as u32);
        let spread = [64, 4096, 1 << 24][case % 3];
        let prefix: Vec<i32> = (0..stride).map(|_| next(spread) as i32).collect();
        let mut table = Vec::new();
        let mut lens = Vec::new();
        for _ in 0..rows {
            for (i, &shared) in prefix.iter().enumerate() {
                table.push(match next(8) {
                    0 => -1 - next(5) as i32,
                    1..=3 if i < 4 => shared,
                    _ => next(spread) as i32,
                });
            }
            // Some contexts longer than the row (its stride bounds the pages read).
            lens.push(next(stride as u64 * PAGE_TOKENS as u64 * 2 + 2) as i32 - 1);
        }
        assert_eq!(
            used_pages(&table, stride, &lens),
            sorted_pages(&table, stride, &lens),
            "case {case}: {rows} rows of stride {stride}, pages below {spread}"
        );
    }
    assert_eq!(used_pages(&[-1, -2], 2, &[128]), Vec::<u32>::new());
    let far = [i32::MAX, 0, i32::MAX];
    assert_eq!(used_pages(&far, 3, &[192]), vec![0, i32::MAX as u32]);
    assert_eq!(used_pages(&[], 0, &[]), Vec::<u32>::new());
}

#[test]
fn a_byte_range_is_empty_when_it_holds_no_byte() {
    let buf = BufferId(0);
    assert!(ByteRange::new(buf, Bytes(8), Bytes(0)).is_empty());
    assert!(!ByteRange::new(buf, Bytes(8), Bytes(1)).is_empty());
}

//! Sweeps over a trace's intervals (allocations live, requests in flight) in time order without
//! a list of every change: a million-event trace has hundreds of thousands of them. A stream
//! already in time order (allocations and arrivals, as the trace writes them) is read where it
//! lies; only one that is not is copied and sorted.

use crate::model::Allocation;

/// Instants in time order, each with what happened then.
pub type InTimeOrder<'a, T> = Box<dyn Iterator<Item = (u64, T)> + 'a>;

/// The instants of `items` in time order, each with its tag.
pub fn in_time_order<'a, T: 'a>(items: impl Iterator<Item = (u64, T)> + Clone + 'a) -> InTimeOrder<'a, T> {
    if items.clone().map(|(t, _)| t).is_sorted() {
        return Box::new(items);
    }
    let mut sorted: Vec<(u64, T)> = Vec::with_capacity(items.clone().count());
    sorted.extend(items);
    // Stable: what happened at one instant keeps its order (exports show each step).
    sorted.sort_by_key(|(t, _)| *t);
    Box::new(sorted.into_iter())
}

/// Streams each in time order, merged into one in time order (at one instant, the earlier
/// stream's first).
pub fn merged<'a, T: 'a>(streams: Vec<InTimeOrder<'a, T>>) -> impl Iterator<Item = (u64, T)> + 'a {
    let mut streams: Vec<_> = streams.into_iter().map(Iterator::peekable).collect();
    std::iter::from_fn(move || {
        let mut first: Option<(usize, u64)> = None;
        for (i, s) in streams.iter_mut().enumerate() {
            if let Some(&(t, _)) = s.peek() {
                if first.is_none_or(|(_, earliest)| t < earliest) {
                    first = Some((i, t));
                }
            }
        }
        streams[first?.0].next()
    })
}

/// Allocations' starts and ends in time order, the ends first at one instant (a peak is never
/// counted twice), each with its change to the live bytes and what the caller tags it with.
pub struct LiveChanges<'a, T> {
    starts: std::iter::Peekable<InTimeOrder<'a, (u64, T)>>,
    ends: std::iter::Peekable<InTimeOrder<'a, (u64, T)>>,
}

impl<'a, T: Copy + 'a> LiveChanges<'a, T> {
    pub fn of(allocations: impl Iterator<Item = (&'a Allocation, T)> + Clone + 'a) -> std::iter::Peekable<LiveChanges<'a, T>> {
        let starts = in_time_order(allocations.clone().map(|(a, tag)| (a.ts, (a.bytes, tag))));
        let ends = in_time_order(allocations.filter_map(|(a, tag)| Some((a.freed?.0, (a.bytes, tag)))));
        LiveChanges { starts: starts.peekable(), ends: ends.peekable() }.peekable()
    }
}

impl<T: Copy> Iterator for LiveChanges<'_, T> {
    /// (time, change in live bytes, tag)
    type Item = (u64, i128, T);
    fn next(&mut self) -> Option<Self::Item> {
        let start_first = match (self.starts.peek(), self.ends.peek()) {
            (Some(s), Some(e)) => s.0 < e.0,
            (start, _) => start.is_some(),
        };
        match start_first {
            true => self.starts.next().map(|(t, (bytes, tag))| (t, i128::from(bytes), tag)),
            false => self.ends.next().map(|(t, (bytes, tag))| (t, -i128::from(bytes), tag)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_out_of_order_is_sorted_and_one_in_order_read_as_it_is() {
        let shuffled = [(5u64, 'a'), (1, 'b'), (3, 'c'), (1, 'd')];
        let times: Vec<u64> = in_time_order(shuffled.iter().copied()).map(|(t, _)| t).collect();
        assert_eq!(times, [1, 1, 3, 5]);
        let ordered = [(1u64, 'a'), (2, 'b'), (2, 'c')];
        assert_eq!(in_time_order(ordered.iter().copied()).collect::<Vec<_>>(), ordered);
        let both: Vec<(u64, char)> = merged(vec![in_time_order(shuffled.into_iter()), in_time_order(ordered.into_iter())]).collect();
        assert_eq!(both, [(1, 'b'), (1, 'd'), (1, 'a'), (2, 'b'), (2, 'c'), (3, 'c'), (5, 'a')]);
    }
}

//! Lists kept in a narrow form when every item fits it (an IPv4 address in 4 bytes where
//! an `IpAddr` takes 17), read in the wide form: the choice of form and the iterator,
//! shared by `EndpointSet` and `SliceEndpoints`.

/// An item's narrow form, for the items whose wide form fits it.
pub trait Narrow: Copy {
    type Wide: Copy;
    fn narrow(wide: &Self::Wide) -> Option<Self>;
    fn widen(self) -> Self::Wide;
}

/// `wide` in the narrow form, when every item fits it.
pub fn narrowed<N: Narrow>(wide: &[N::Wide]) -> Option<Vec<N>> {
    wide.iter().map(N::narrow).collect()
}

/// The items of either form, widened, in order.
#[derive(Clone)]
pub enum Iter<'a, N: Narrow> {
    Narrow(std::slice::Iter<'a, N>),
    Wide(std::slice::Iter<'a, N::Wide>),
}

impl<N: Narrow> Iterator for Iter<'_, N> {
    type Item = N::Wide;

    fn next(&mut self) -> Option<N::Wide> {
        match self {
            Iter::Narrow(i) => i.next().map(|n| n.widen()),
            Iter::Wide(i) => i.next().copied(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match self {
            Iter::Narrow(i) => i.size_hint(),
            Iter::Wide(i) => i.size_hint(),
        }
    }
}

impl<N: Narrow> ExactSizeIterator for Iter<'_, N> {}

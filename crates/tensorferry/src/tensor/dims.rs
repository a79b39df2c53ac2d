//! A tensor's shape or strides without a heap allocation for up to four dimensions.
//!
//! Dictionaries of many small tensors make and clone a shape and strides per tensor
//! (loads, consolidation, moves); two `Vec`s cost two allocations each time. Four
//! dimensions cover scalars, vectors, matrices and convolution weights; more go to the
//! heap, once.

use std::ops::{Deref, DerefMut};

/// Dimensions held inline.
const INLINE: usize = 4;

/// A short list of dimensions (sizes or strides), inline when it has at most
/// [`INLINE`] of them.
#[derive(Clone)]
pub(crate) enum Dims<T: Copy + Default> {
    /// At most [`INLINE`] values: the first `len` of `items`.
    Inline { len: u8, items: [T; INLINE] },
    /// More.
    Heap(Box<[T]>),
}

impl<T: Copy + Default> Dims<T> {
    /// `values`, copied.
    pub(crate) fn from_slice(values: &[T]) -> Self {
        if values.len() <= INLINE {
            let mut items = [T::default(); INLINE];
            items[..values.len()].copy_from_slice(values);
            Dims::Inline {
                len: values.len() as u8,
                items,
            }
        } else {
            Dims::Heap(values.into())
        }
    }
}

impl<T: Copy + Default> From<Vec<T>> for Dims<T> {
    fn from(values: Vec<T>) -> Self {
        if values.len() <= INLINE {
            Dims::from_slice(&values)
        } else {
            Dims::Heap(values.into_boxed_slice())
        }
    }
}

impl<T: Copy + Default> Deref for Dims<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Dims::Inline { len, items } => &items[..usize::from(*len)],
            Dims::Heap(values) => values,
        }
    }
}

impl<T: Copy + Default> DerefMut for Dims<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Dims::Inline { len, items } => &mut items[..usize::from(*len)],
            Dims::Heap(values) => values,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_and_long_lists_read_back_as_given() {
        for n in 0..8usize {
            let values: Vec<usize> = (1..=n).collect();
            let mut dims = Dims::from(values.clone());
            assert_eq!(&*dims, &values[..]);
            assert_eq!(&*Dims::from_slice(&values), &values[..]);
            assert_eq!(matches!(dims, Dims::Inline { .. }), n <= INLINE);
            if n > 1 {
                dims.swap(0, 1);
                assert_eq!(dims[0], 2);
            }
        }
    }
}

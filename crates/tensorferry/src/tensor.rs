//! `Tensor`: shared storage + byte offset + dtype + shape + strides.
//!
//! Views share their storage (reference-counted); strided tensors are kept as they
//! are and made contiguous only when a consumer needs it.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::memory::AlignedBuffer;
use crate::storage::{ForeignMemory, Storage};

mod dims;
use dims::Dims;

/// A typed, shaped view of device or host memory.
///
/// ```
/// use tensorferry::{DType, Device, Tensor};
///
/// let m = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
/// assert_eq!((m.dtype(), m.shape(), m.device()), (DType::F32, &[2, 3][..], Device::Cpu));
/// let t = m.transpose(0, 1)?; // a view: no copy
/// assert!(!t.is_contiguous());
/// assert_eq!(t.to_vec::<f32>()?, [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
/// # Ok::<(), tensorferry::Error>(())
/// ```
#[derive(Clone)]
pub struct Tensor {
    storage: Arc<Storage>,
    offset: usize,
    dtype: DType,
    shape: Dims<usize>,
    /// Strides in elements, C order for contiguous tensors; may be negative.
    strides: Dims<isize>,
}

/// Rust types that are tensor elements.
pub trait Element: Copy + Send + Sync + 'static {
    /// The matching dtype.
    const DTYPE: DType;
    /// Appends the little-endian bytes of `self`.
    fn extend_le(self, out: &mut Vec<u8>);
    /// Reads one element from its little-endian bytes.
    fn from_le(bytes: &[u8]) -> Self;
}

macro_rules! element {
    ($($t:ty => $d:expr),* $(,)?) => {$(
        impl Element for $t {
            const DTYPE: DType = $d;
            fn extend_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn from_le(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("element width"))
            }
        }
    )*};
}

element!(
    u8 => DType::U8, i8 => DType::I8, u16 => DType::U16, i16 => DType::I16,
    u32 => DType::U32, i32 => DType::I32, u64 => DType::U64, i64 => DType::I64,
    f32 => DType::F32, f64 => DType::F64,
    half::f16 => DType::F16, half::bf16 => DType::BF16,
);

impl Element for bool {
    const DTYPE: DType = DType::Bool;
    fn extend_le(self, out: &mut Vec<u8>) {
        out.push(self as u8);
    }
    fn from_le(bytes: &[u8]) -> Self {
        bytes[0] != 0
    }
}

/// C-order (row-major) strides, in elements, of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<isize> {
    contiguous_dims(shape).to_vec()
}

/// [`contiguous_strides`] without a heap allocation for up to four dimensions.
fn contiguous_dims(shape: &[usize]) -> Dims<isize> {
    let mut strides: Dims<isize> = match shape.len() {
        n @ 0..=4 => Dims::from_slice(&[0; 4][..n]),
        n => vec![0; n].into(),
    };
    let mut acc = 1isize;
    for (s, &n) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(n.max(1) as isize);
    }
    strides
}

/// Where the elements of a layout lie around element 0, in bytes: `(below, above)` with
/// `below <= 0` the lowest byte touched and `above` one past the highest (0, 0 when empty),
/// or `None` when they overflow the address space. Foreign producers (NumPy, DLPack, the
/// CUDA Array Interface) may use negative strides, so element 0 need not be the lowest, and
/// their descriptions are not trusted: every step is checked. The one computation of a
/// layout's extent: a tensor's span in its storage ([`Tensor::from_storage`]) is this around its
/// offset.
pub fn byte_extent(shape: &[usize], strides: &[isize], size: usize) -> Option<(isize, isize)> {
    if shape.contains(&0) {
        return Some((0, 0));
    }
    let size = isize::try_from(size).ok()?;
    let (mut below, mut above) = (0isize, size);
    for (&n, &s) in shape.iter().zip(strides) {
        let reach = (isize::try_from(n).ok()? - 1)
            .checked_mul(s)?
            .checked_mul(size)?;
        if reach < 0 {
            below = below.checked_add(reach)?;
        } else {
            above = above.checked_add(reach)?;
        }
    }
    Some((below, above))
}

/// The number of elements of `shape`, or `None` on overflow.
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &n| acc.checked_mul(n))
}

/// The bytes of a contiguous `dtype` tensor of `shape`, or `None` on overflow.
pub fn checked_nbytes(dtype: DType, shape: &[usize]) -> Option<usize> {
    checked_numel(shape)?.checked_mul(dtype.size())
}

impl Tensor {
    /// A view of `storage`: `offset` bytes in, with `shape` and element `strides`.
    /// Fails when any element would fall outside the storage.
    pub fn from_storage(
        storage: Arc<Storage>,
        offset: usize,
        dtype: DType,
        shape: Vec<usize>,
        strides: Vec<isize>,
    ) -> Result<Self> {
        if strides.len() != shape.len() {
            return Err(Error::Layout {
                reason: format!("{} strides for {} dimensions", strides.len(), shape.len()),
            });
        }
        let numel = checked_numel(&shape).ok_or_else(|| Error::Layout {
            reason: format!("shape {shape:?} overflows"),
        })?;
        if numel > 0 {
            let (lo, hi) = byte_span(offset, dtype, &shape, &strides).ok_or_else(|| {
                Error::Layout {
                    reason: format!(
                        "shape {shape:?} with strides {strides:?} at offset {offset} leaves the storage"
                    ),
                }
            })?;
            if hi > storage.len() || lo > hi {
                return Err(Error::Layout {
                    reason: format!(
                        "elements span bytes {lo}..{hi} but the storage holds {} bytes",
                        storage.len()
                    ),
                });
            }
        }
        Ok(Tensor {
            storage,
            offset,
            dtype,
            shape: shape.into(),
            strides: strides.into(),
        })
    }

    /// A tensor viewing memory that a foreign producer (NumPy, DLPack, the CUDA Array
    /// Interface) describes: element 0 at `elem0` on `device`, with `dtype`, `shape` and
    /// element `strides` (negative ones too), kept alive by `owner`. A layout whose extent
    /// overflows the address space is an error, as is any other a storage cannot hold.
    ///
    /// # Safety
    /// The bytes the layout reaches around `elem0` are valid for reads on `device` (and for
    /// writes unless `read_only`), from any thread, for as long as `owner` lives, and nobody
    /// writes to them while tensorferry reads them, including while a slice of them that a
    /// tensor's byte accessors handed out is alive. `owner` is dropped exactly once, after
    /// the last use of the memory.
    ///
    /// ```
    /// use tensorferry::{DType, Device, Tensor};
    ///
    /// let data: Box<[f32]> = vec![1.0, 2.0, 3.0, 4.0].into_boxed_slice();
    /// let ptr = data.as_ptr() as *mut u8;
    /// // SAFETY: `data` owns the 16 initialised bytes at `ptr` (a boxed slice does not move
    /// // its heap memory), lives as long as the tensor, and nobody writes it.
    /// let t = unsafe {
    ///     Tensor::from_foreign(ptr, Device::Cpu, true, Box::new(data), DType::F32, vec![2, 2], vec![2, 1])
    /// }?;
    /// assert!(t.storage().is_read_only());
    /// assert_eq!(t.to_vec::<f32>()?, [1.0, 2.0, 3.0, 4.0]);
    /// # Ok::<(), tensorferry::Error>(())
    /// ```
    pub unsafe fn from_foreign(
        elem0: *mut u8,
        device: Device,
        read_only: bool,
        owner: Box<dyn Any + Send + Sync>,
        dtype: DType,
        shape: Vec<usize>,
        strides: Vec<isize>,
    ) -> Result<Self> {
        let extent = byte_extent(&shape, &strides, dtype.size()).and_then(|(below, above)| {
            Some((below, usize::try_from(above.checked_sub(below)?).ok()?))
        });
        let (below, span) = extent.ok_or_else(|| Error::Layout {
            reason: format!("shape {shape:?} with strides {strides:?} overflows the address space"),
        })?;
        let lowest = elem0.wrapping_offset(below);
        // SAFETY: `lowest..lowest + span` is the bytes the layout reaches around `elem0`
        // (`byte_extent`, checked), which the caller promises are valid; a shape and strides
        // of different lengths make a shorter span, and `from_storage` refuses that tensor
        // before any use.
        let memory = unsafe { ForeignMemory::new(lowest, span, device, read_only, owner) };
        let storage = Arc::new(Storage::foreign(memory));
        Tensor::from_storage(storage, (-below) as usize, dtype, shape, strides)
    }

    /// A C-contiguous view of `storage` at byte `offset` (the results of a packed copy):
    /// the cheap form of [`Tensor::from_storage`] for a layout known to be contiguous.
    pub fn contiguous_view(
        storage: Arc<Storage>,
        offset: usize,
        dtype: DType,
        shape: Vec<usize>,
    ) -> Result<Self> {
        Tensor::contiguous_in(storage, offset, dtype, shape.into())
    }

    /// A C-contiguous view of `storage` at byte `offset` with `like`'s dtype and shape (its
    /// shape copied as it is held: no allocation for four dimensions or fewer).
    pub(crate) fn contiguous_view_like(
        storage: Arc<Storage>,
        offset: usize,
        like: &Tensor,
    ) -> Result<Self> {
        Tensor::contiguous_in(storage, offset, like.dtype, like.shape.clone())
    }

    fn contiguous_in(
        storage: Arc<Storage>,
        offset: usize,
        dtype: DType,
        shape: Dims<usize>,
    ) -> Result<Self> {
        let nbytes = checked_nbytes(dtype, &shape);
        match nbytes.and_then(|n| n.checked_add(offset)) {
            Some(end) if end <= storage.len() || nbytes == Some(0) => {}
            _ => {
                return Err(Error::Layout {
                    reason: format!(
                        "{dtype} shape {:?} at offset {offset} leaves a storage of {} bytes",
                        &*shape,
                        storage.len()
                    ),
                })
            }
        }
        Ok(Tensor {
            storage,
            offset,
            dtype,
            strides: contiguous_dims(&shape),
            shape,
        })
    }

    /// A contiguous host tensor holding a copy of `bytes` (little-endian elements).
    pub fn from_bytes(dtype: DType, shape: Vec<usize>, bytes: &[u8]) -> Result<Self> {
        let expected = checked_nbytes(dtype, &shape).ok_or_else(|| Error::Layout {
            reason: format!("shape {shape:?} overflows"),
        })?;
        if expected != bytes.len() {
            return Err(Error::Layout {
                reason: format!(
                    "{dtype} tensor of shape {shape:?} needs {expected} bytes, got {}",
                    bytes.len()
                ),
            });
        }
        let storage = Arc::new(Storage::owned(AlignedBuffer::copy_from(bytes)?));
        Tensor::contiguous_view(storage, 0, dtype, shape)
    }

    /// A contiguous host tensor of the given elements and shape.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Self> {
        let mut bytes = Vec::with_capacity(std::mem::size_of_val(data));
        for &x in data {
            x.extend_le(&mut bytes);
        }
        Tensor::from_bytes(T::DTYPE, shape.to_vec(), &bytes)
    }

    /// A contiguous host tensor of zeros.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Result<Self> {
        let len = checked_nbytes(dtype, shape).ok_or_else(|| Error::Layout {
            reason: format!("shape {shape:?} overflows"),
        })?;
        let storage = Arc::new(Storage::owned(AlignedBuffer::zeroed(len)?));
        Tensor::contiguous_view(storage, 0, dtype, shape.to_vec())
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Strides in elements.
    pub fn strides(&self) -> &[isize] {
        &self.strides
    }

    /// Byte offset of element 0 into the storage.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The shared storage.
    pub fn storage(&self) -> &Arc<Storage> {
        &self.storage
    }

    /// Where the memory lives.
    pub fn device(&self) -> Device {
        self.storage.device()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of the elements (not of the storage).
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    /// True when the memory must not be written.
    pub fn is_read_only(&self) -> bool {
        self.storage.is_read_only()
    }

    /// The address of element 0. It does not wait: before reading through it, call
    /// [`Tensor::wait`] (also when [`Tensor::is_ready`] is true — a failed copy is ready
    /// too, and its memory holds no data).
    pub fn data_ptr(&self) -> *const u8 {
        self.storage.as_ptr().wrapping_add(self.offset)
    }

    /// The [lowest, one-past-highest) byte of its storage the tensor's elements touch
    /// (its layout was checked to lie in the storage when it was made).
    pub(crate) fn span_in_storage(&self) -> (usize, usize) {
        byte_span(self.offset, self.dtype, &self.shape, &self.strides)
            .expect("a tensor's extent lies in its storage")
    }

    /// True when `self` and `other` are one tensor: the same memory (device and address of
    /// element 0), dtype, shape and strides, whatever storage object holds them (two
    /// imports of one framework tensor are one tensor).
    pub fn is_same_view(&self, other: &Tensor) -> bool {
        self.data_ptr() == other.data_ptr()
            && self.device() == other.device()
            && self.dtype == other.dtype
            && self.shape() == other.shape()
            && self.strides() == other.strides()
    }

    /// True when the elements lie in C order with no gaps (dimensions of size 1 ignored).
    pub fn is_contiguous(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut expected = 1isize;
        for (&n, &s) in self.shape.iter().zip(self.strides.iter()).rev() {
            if n != 1 && s != expected {
                return false;
            }
            expected *= n as isize;
        }
        true
    }

    /// The bytes of a contiguous host tensor; `None` when strided, not on the host, or
    /// when the copy filling it failed ([`Tensor::try_contiguous_bytes`] tells that apart).
    /// Waits for a copy still filling it.
    pub fn contiguous_bytes(&self) -> Option<&[u8]> {
        self.try_contiguous_bytes().ok().flatten()
    }

    /// The bytes of a contiguous host tensor, after any copy still filling it; `Ok(None)`
    /// when strided or not on the host, the copy's failure as an error.
    pub fn try_contiguous_bytes(&self) -> Result<Option<&[u8]>> {
        if !self.is_contiguous() {
            return Ok(None);
        }
        let Some(bytes) = self.storage.try_host_bytes()? else {
            return Ok(None);
        };
        if self.numel() == 0 {
            return Ok(Some(&[]));
        }
        Ok(bytes.get(self.offset..self.offset + self.nbytes()))
    }

    /// Calls `f` on the bytes of the tensor in C order, as few runs as the layout allows.
    /// Waits for a copy still filling them, and fails with its error if it failed; fails
    /// with `DeviceUnavailable` when the tensor is not on the host.
    pub fn for_each_run(&self, f: impl FnMut(&[u8]) -> Result<()>) -> Result<()> {
        self.for_each_host_run(f)
    }

    /// [`Tensor::for_each_run`] with runs borrowed from the tensor itself, so a caller can
    /// keep them (to hand many to one vectored write).
    pub(crate) fn for_each_host_run<'s>(
        &'s self,
        mut f: impl FnMut(&'s [u8]) -> Result<()>,
    ) -> Result<()> {
        if let Some(bytes) = self.try_contiguous_bytes()? {
            return f(bytes);
        }
        let all = self.host_bytes_or_err()?;
        self.run_offsets(|at, len| f(&all[at..at + len]))
    }

    /// Calls `f(offset, len)` for each run of the tensor's bytes in C order: byte ranges
    /// of its storage, as few as the layout allows. Touches no memory, so it serves
    /// device tensors as well (copies are planned from these ranges).
    pub fn run_offsets(&self, mut f: impl FnMut(usize, usize) -> Result<()>) -> Result<()> {
        if self.numel() == 0 {
            return Ok(());
        }
        if self.is_contiguous() {
            return f(self.offset, self.nbytes());
        }
        let size = self.dtype.size();
        // Merge trailing dimensions that are contiguous into one run.
        let mut run_elems = 1usize;
        let mut outer = self.shape.len();
        while outer > 0 {
            let d = outer - 1;
            if self.shape[d] == 1 || self.strides[d] == run_elems as isize {
                run_elems *= self.shape[d];
                outer = d;
            } else {
                break;
            }
        }
        let run_bytes = run_elems * size;
        let outer_shape = &self.shape[..outer];
        let outer_strides = &self.strides[..outer];
        let mut index = vec![0usize; outer];
        loop {
            let elem: isize = index
                .iter()
                .zip(outer_strides)
                .map(|(&i, &s)| i as isize * s)
                .sum();
            f(
                (self.offset as isize + elem * size as isize) as usize,
                run_bytes,
            )?;
            // Advance the outer index in C order.
            let mut d = outer;
            loop {
                if d == 0 {
                    return Ok(());
                }
                d -= 1;
                index[d] += 1;
                if index[d] < outer_shape[d] {
                    break;
                }
                index[d] = 0;
            }
        }
    }

    /// Waits until the tensor's memory holds its data (a non-blocking move returns before
    /// its copies have run); the failure of that copy, if any, naming the device whose
    /// copy failed. Blocks for as long as the copy takes: a caller that must stay
    /// responsive (to Ctrl-C, say) uses [`Tensor::wait_timeout`] in slices.
    ///
    /// ```
    /// # use tensorferry::{Device, MoveOptions, Tensor};
    /// let t = Tensor::from_slice(&[1.0f32, 2.0], &[2])?;
    /// let options = MoveOptions { non_blocking: true, ..Default::default() };
    /// let moved = tensorferry::move_tensors(&[&t], Device::Emulated(0), options)?;
    /// moved[0].wait()?;
    /// assert!(moved[0].is_ready());
    /// # Ok::<(), tensorferry::Error>(())
    /// ```
    pub fn wait(&self) -> Result<()> {
        self.storage.wait()
    }

    /// Waits at most `timeout` for the copy filling the tensor's memory: `Ok(true)` when
    /// the data is there, `Ok(false)` when the copy is still running, the copy's failure
    /// (as [`Tensor::wait`] gives it) when it failed. A tensor no copy fills is ready at
    /// once.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tensorferry::{Device, MoveOptions, Tensor};
    /// let t = Tensor::from_slice(&[1u8, 2, 3], &[3])?;
    /// let options = MoveOptions { non_blocking: true, ..Default::default() };
    /// let moved = tensorferry::move_tensors(&[&t], Device::Emulated(0), options)?;
    /// while !moved[0].wait_timeout(Duration::from_millis(50))? {
    ///     // check for an interruption here
    /// }
    /// # Ok::<(), tensorferry::Error>(())
    /// ```
    pub fn wait_timeout(&self, timeout: std::time::Duration) -> Result<bool> {
        self.storage.wait_timeout(timeout)
    }

    /// True when no copy into the tensor's memory is still running — also when it has
    /// failed: [`Tensor::wait`] tells which.
    pub fn is_ready(&self) -> bool {
        self.storage.is_ready()
    }

    fn host_bytes_or_err(&self) -> Result<&[u8]> {
        self.storage
            .try_host_bytes()?
            .ok_or_else(|| Error::DeviceUnavailable {
                device: self.device().to_string(),
                reason:
                    "the tensor's memory is not on the host; move it with to(Device::Cpu) first"
                        .into(),
            })
    }

    /// A new contiguous, owned host copy that shares nothing with `self`.
    pub fn deep_copy(&self) -> Result<Tensor> {
        let mut buf = AlignedBuffer::zeroed(self.nbytes())?;
        let dst = buf.as_mut_slice();
        let mut at = 0;
        self.for_each_run(|run| {
            dst[at..at + run.len()].copy_from_slice(run);
            at += run.len();
            Ok(())
        })?;
        let shape = self.shape.to_vec();
        let strides = contiguous_strides(&shape);
        Tensor::from_storage(Arc::new(Storage::owned(buf)), 0, self.dtype, shape, strides)
    }

    /// `self` when contiguous, else a contiguous copy.
    pub fn to_contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            Ok(self.clone())
        } else {
            self.deep_copy()
        }
    }

    /// The elements in C order, converted from their bytes; `T` must match the dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::UnsupportedDType {
                key: String::new(),
                dtype: self.dtype.to_string(),
                reason: format!("asked for elements of {}", T::DTYPE),
            });
        }
        let size = self.dtype.size();
        let mut out = Vec::with_capacity(self.numel());
        self.for_each_run(|run| {
            out.extend(run.chunks_exact(size).map(T::from_le));
            Ok(())
        })?;
        Ok(out)
    }

    /// A view with dimensions `a` and `b` swapped (shares storage; usually strided).
    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor> {
        if a >= self.shape.len() || b >= self.shape.len() {
            return Err(Error::Layout {
                reason: format!(
                    "cannot swap dims {a} and {b} of a {}-d tensor",
                    self.shape.len()
                ),
            });
        }
        let mut t = self.clone();
        t.shape.swap(a, b);
        t.strides.swap(a, b);
        Ok(t)
    }

    /// A view of every `step`-th element along dimension `dim` (shares storage).
    pub fn step(&self, dim: usize, step: usize) -> Result<Tensor> {
        if dim >= self.shape.len() || step == 0 {
            return Err(Error::Layout {
                reason: format!(
                    "bad step {step} on dim {dim} of a {}-d tensor",
                    self.shape.len()
                ),
            });
        }
        let mut t = self.clone();
        t.shape[dim] = self.shape[dim].div_ceil(step);
        t.strides[dim] = self.strides[dim] * step as isize;
        Ok(t)
    }
}

/// The [lowest, one-past-highest) byte touched by a tensor whose element 0 lies at byte
/// `offset`, or `None` when the span overflows or starts before byte 0.
fn byte_span(
    offset: usize,
    dtype: DType,
    shape: &[usize],
    strides: &[isize],
) -> Option<(usize, usize)> {
    let (below, above) = byte_extent(shape, strides, dtype.size())?;
    let offset = isize::try_from(offset).ok()?;
    let lo = usize::try_from(offset.checked_add(below)?).ok()?;
    let hi = usize::try_from(offset.checked_add(above)?).ok()?;
    Some((lo, hi))
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor({}, shape={:?}, device={}{})",
            self.dtype,
            &*self.shape,
            self.device(),
            if self.is_contiguous() {
                ""
            } else {
                ", strided"
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_slice_keeps_values_and_is_contiguous() {
        let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
        assert!(t.is_contiguous());
        assert_eq!(t.nbytes(), 24);
        assert_eq!(
            t.to_vec::<f32>().unwrap(),
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        );
    }

    #[test]
    fn a_transposed_view_shares_storage_and_reads_in_c_order() {
        let t = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6], &[2, 3]).unwrap();
        let v = t.transpose(0, 1).unwrap();
        assert!(Arc::ptr_eq(t.storage(), v.storage()));
        assert!(!v.is_contiguous());
        assert_eq!(v.to_vec::<i64>().unwrap(), vec![1, 4, 2, 5, 3, 6]);
        let c = v.to_contiguous().unwrap();
        assert!(c.is_contiguous());
        assert_eq!(c.to_vec::<i64>().unwrap(), vec![1, 4, 2, 5, 3, 6]);
    }

    #[test]
    fn a_stepped_view_reads_every_other_element() {
        let t = Tensor::from_slice(&[0u8, 1, 2, 3, 4], &[5]).unwrap();
        assert_eq!(t.step(0, 2).unwrap().to_vec::<u8>().unwrap(), vec![0, 2, 4]);
    }

    #[test]
    fn deep_copy_shares_nothing() {
        let t = Tensor::from_slice(&[1u16, 2], &[2]).unwrap();
        let c = t.deep_copy().unwrap();
        assert!(!Arc::ptr_eq(t.storage(), c.storage()));
        assert_eq!(c.to_vec::<u16>().unwrap(), vec![1, 2]);
    }

    #[test]
    fn to_the_same_device_without_copy_shares_storage() {
        let t = Tensor::from_slice(&[1u16, 2], &[2]).unwrap();
        let same = t.to(Device::Cpu, false).unwrap();
        assert!(Arc::ptr_eq(t.storage(), same.storage()));
        let copied = t.to(Device::Cpu, true).unwrap();
        assert!(!Arc::ptr_eq(t.storage(), copied.storage()));
    }

    #[test]
    fn a_view_past_the_storage_is_rejected() {
        let t = Tensor::from_slice(&[1u8, 2, 3], &[3]).unwrap();
        let err = Tensor::from_storage(t.storage().clone(), 1, DType::U8, vec![3], vec![1]);
        assert!(matches!(err, Err(Error::Layout { .. })));
    }

    #[test]
    fn zero_dim_and_empty_tensors_are_fine() {
        let scalar = Tensor::from_slice(&[7i32], &[]).unwrap();
        assert_eq!(scalar.numel(), 1);
        assert_eq!(scalar.to_vec::<i32>().unwrap(), vec![7]);
        let empty = Tensor::zeros(DType::F32, &[0, 5]).unwrap();
        assert_eq!(empty.nbytes(), 0);
        assert_eq!(empty.to_vec::<f32>().unwrap(), Vec::<f32>::new());
    }

    #[test]
    fn wrong_byte_count_is_a_layout_error() {
        let err = Tensor::from_bytes(DType::F32, vec![2], &[0u8; 7]).unwrap_err();
        assert!(err.to_string().contains("needs 8 bytes"));
    }
}

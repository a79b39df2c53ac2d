//! DLPack import and export: the C structures of `dlpack.h` (v1.1) and the only
//! raw-pointer code for them. Python capsules are the binding crate's business.

use std::any::Any;
use std::ffi::c_void;

use crate::device::Device;
use crate::dtype::{DLDataType, DType};
use crate::error::{Error, Result};
use crate::tensor::{checked_numel, contiguous_strides, Tensor};
use crate::transfer::Readable;

/// `DLDevice`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDevice {
    /// `DLDeviceType` (1 = CPU, 2 = CUDA, 3 = CUDA pinned host, 13 = CUDA managed).
    pub device_type: i32,
    /// Device ordinal.
    pub device_id: i32,
}

/// `DLTensor`.
#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    /// Base address.
    pub data: *mut c_void,
    /// Where the memory lives.
    pub device: DLDevice,
    /// Number of dimensions.
    pub ndim: i32,
    /// Element type.
    pub dtype: DLDataType,
    /// `ndim` extents.
    pub shape: *mut i64,
    /// `ndim` strides in elements, or null for C order.
    pub strides: *mut i64,
    /// Bytes from `data` to element 0.
    pub byte_offset: u64,
}

/// `DLManagedTensor` (DLPack before 1.0).
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    /// The tensor.
    pub dl_tensor: DLTensor,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Called once by the consumer when done.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `DLPackVersion`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DLPackVersion {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

/// `DLManagedTensorVersioned` (DLPack 1.0+).
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensorVersioned {
    /// The producer's DLPack version.
    pub version: DLPackVersion,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Called once by the consumer when done.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    /// `DLPACK_FLAG_BITMASK_*`.
    pub flags: u64,
    /// The tensor.
    pub dl_tensor: DLTensor,
}

/// The memory must not be written.
pub const FLAG_READ_ONLY: u64 = 1;

const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_CUDA_HOST: i32 = 3;
const DL_CUDA_MANAGED: i32 = 13;
const DL_EXT_DEV: i32 = 12;

/// The DLPack version tensorferry speaks.
pub const VERSION: DLPackVersion = DLPackVersion { major: 1, minor: 1 };

/// The DLPack device of a tensorferry device.
pub fn dl_device(device: Device) -> DLDevice {
    match device {
        Device::Cpu => DLDevice {
            device_type: DL_CPU,
            device_id: 0,
        },
        Device::Cuda(i) => DLDevice {
            device_type: DL_CUDA,
            device_id: i as i32,
        },
        // No DLPack device type exists for it; consumers are refused before export.
        Device::Emulated(i) => DLDevice {
            device_type: DL_EXT_DEV,
            device_id: i as i32,
        },
    }
}

/// The tensorferry device of a DLPack device, or an error naming what is unsupported.
pub fn device_of(dl: DLDevice) -> Result<Device> {
    match dl.device_type {
        DL_CPU | DL_CUDA_HOST => Ok(Device::Cpu),
        DL_CUDA | DL_CUDA_MANAGED => Ok(Device::Cuda(dl.device_id.max(0) as usize)),
        other => Err(Error::DeviceUnavailable {
            device: format!("DLPack device type {other}"),
            reason: "tensorferry handles CPU and CUDA memory".into(),
        }),
    }
}

/// A producer's tensor that tensorferry now owns: dropping it calls the producer's deleter.
/// Made from a raw pointer with [`ManagedTensor::versioned`] or [`ManagedTensor::legacy`].
///
/// ```
/// use tensorferry::internal::dlpack::{export_versioned, import, ManagedTensor};
/// use tensorferry::internal::transfer::Readable;
/// use tensorferry::Tensor;
///
/// let t = Tensor::from_slice(&[1i32, 2, 3], &[3])?;
/// let p = export_versioned(Readable::wait(&t)?);
/// // SAFETY: `p` was just exported, is released by nobody else, and is handed over whole.
/// let managed = unsafe { ManagedTensor::versioned(p) };
/// // SAFETY: `managed` comes from a DLPack producer (ours) and has a valid descriptor.
/// let back = unsafe { import(managed, |m| Box::new(m)) }?;
/// assert_eq!(back.to_vec::<i32>()?, vec![1, 2, 3]);
/// # Ok::<(), tensorferry::Error>(())
/// ```
pub struct ManagedTensor(Managed);

/// The two forms of managed tensor; private, so only the `unsafe` constructors make one.
enum Managed {
    /// A DLPack 1.x tensor.
    Versioned(*mut DLManagedTensorVersioned),
    /// A pre-1.0 tensor.
    Legacy(*mut DLManagedTensor),
}

// SAFETY: a managed tensor is handed over whole to its consumer; DLPack lets the consumer
// release it from any thread. Producers whose deleter needs more (Python's GIL) are
// wrapped by the caller, which attaches to the interpreter before dropping.
unsafe impl Send for ManagedTensor {}
// SAFETY: shared references only read the descriptor, which nobody writes after export.
unsafe impl Sync for ManagedTensor {}

impl ManagedTensor {
    /// Takes ownership of a DLPack 1.x managed tensor (a `"dltensor_versioned"` capsule's).
    ///
    /// # Safety
    /// `p` must point to a managed tensor from a DLPack producer that has not been released,
    /// whose descriptor and memory stay valid until its deleter runs, and whose ownership
    /// passes to the value returned: nobody else may call its deleter, which dropping the
    /// value calls (exactly once, from any thread).
    pub unsafe fn versioned(p: *mut DLManagedTensorVersioned) -> ManagedTensor {
        ManagedTensor(Managed::Versioned(p))
    }

    /// Takes ownership of a pre-1.0 managed tensor (a `"dltensor"` capsule's).
    ///
    /// # Safety
    /// As for [`ManagedTensor::versioned`].
    pub unsafe fn legacy(p: *mut DLManagedTensor) -> ManagedTensor {
        ManagedTensor(Managed::Legacy(p))
    }

    /// The producer's DLPack version (`None` for a pre-1.0 tensor, which has none). The
    /// version and the deleter are the only fields whose place every major version keeps.
    fn version(&self) -> Option<DLPackVersion> {
        match self.0 {
            // SAFETY: as in `tensor`; `version` is the first field in every major version.
            Managed::Versioned(p) => Some(unsafe { (*p).version }),
            Managed::Legacy(_) => None,
        }
    }

    fn tensor(&self) -> &DLTensor {
        // SAFETY: the pointer was non-null and valid when the value was made (`import`'s
        // contract) and stays valid until the deleter runs in `drop`.
        unsafe {
            match self.0 {
                Managed::Versioned(p) => &(*p).dl_tensor,
                Managed::Legacy(p) => &(*p).dl_tensor,
            }
        }
    }

    fn read_only(&self) -> bool {
        match self.0 {
            // SAFETY: as in `tensor`.
            Managed::Versioned(p) => unsafe { (*p).flags & FLAG_READ_ONLY != 0 },
            Managed::Legacy(_) => false,
        }
    }
}

impl Drop for ManagedTensor {
    fn drop(&mut self) {
        // SAFETY: DLPack's contract: the consumer calls the deleter exactly once when done;
        // `self` is dropped once and nothing reads the memory afterwards (the storage that
        // owns this value is gone).
        unsafe {
            match self.0 {
                Managed::Versioned(p) => {
                    if let Some(d) = (*p).deleter {
                        d(p)
                    }
                }
                Managed::Legacy(p) => {
                    if let Some(d) = (*p).deleter {
                        d(p)
                    }
                }
            }
        }
    }
}

/// Imports a producer's tensor without copying. `wrap` receives the managed tensor and
/// returns the owner that keeps it alive (and releases it when dropped); use
/// `|m| Box::new(m)` unless releasing needs more (a lock, an interpreter).
///
/// On error the managed tensor is released through `wrap`'s owner as well. A DLPack 1.x
/// tensor of another major version than [`VERSION`]'s is refused before any field but its
/// version is read (its layout may differ), and released, as the specification requires
/// of a consumer; a newer minor version is accepted.
///
/// # Safety
/// `managed` must come from a DLPack producer, not yet released, with a valid descriptor.
pub unsafe fn import(
    managed: ManagedTensor,
    wrap: impl FnOnce(ManagedTensor) -> Box<dyn Any + Send + Sync>,
) -> Result<Tensor> {
    if let Some(version) = managed.version().filter(|v| v.major != VERSION.major) {
        drop(wrap(managed));
        return Err(Error::InvalidValue {
            key: String::new(),
            reason: format!(
                "a DLPack tensor of major version {}.{} (tensorferry reads {}.x): its layout \
                 is unknown; ask the producer for version {}.x (max_version)",
                version.major, version.minor, VERSION.major, VERSION.major
            ),
        });
    }
    let described = describe(managed.tensor());
    let read_only = managed.read_only();
    let owner = wrap(managed);
    let (device, dtype, shape, strides, elem0) = described?;
    // SAFETY: the producer guarantees the elements described are valid for as long as the
    // managed tensor lives, which `owner` ensures.
    unsafe { Tensor::from_foreign(elem0, device, read_only, owner, dtype, shape, strides) }
}

/// Device, dtype, shape, strides and the address of element 0 of a DLPack tensor.
type Described = (Device, DType, Vec<usize>, Vec<isize>, *mut u8);

/// What `t` describes ([`Described`]), checked.
fn describe(t: &DLTensor) -> Result<Described> {
    let device = device_of(t.device)?;
    let dtype = DType::from_dlpack(t.dtype).ok_or_else(|| Error::UnsupportedDType {
        key: String::new(),
        dtype: format!(
            "DLPack code {} bits {} lanes {}",
            t.dtype.code, t.dtype.bits, t.dtype.lanes
        ),
        reason: "tensorferry does not handle this element type".into(),
    })?;
    let ndim = usize::try_from(t.ndim).map_err(|_| Error::Layout {
        reason: format!("negative ndim {}", t.ndim),
    })?;
    let shape: Vec<usize> = if ndim == 0 {
        Vec::new()
    } else {
        // SAFETY: DLPack requires `shape` to point at `ndim` values.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
            .iter()
            .map(|&n| usize::try_from(n))
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| Error::Layout {
                reason: "negative extent in DLPack shape".into(),
            })?
    };
    let strides: Vec<isize> = if ndim == 0 || t.strides.is_null() {
        contiguous_strides(&shape)
    } else {
        // SAFETY: DLPack requires non-null `strides` to point at `ndim` values.
        unsafe { std::slice::from_raw_parts(t.strides, ndim) }
            .iter()
            .map(|&s| s as isize)
            .collect()
    };
    checked_numel(&shape).ok_or_else(|| Error::Layout {
        reason: format!("DLPack shape {shape:?} overflows"),
    })?;
    let elem0 = (t.data as *mut u8).wrapping_add(t.byte_offset as usize);
    Ok((device, dtype, shape, strides, elem0))
}

/// What an exported tensor keeps alive: the tensor (its storage) and the shape and
/// strides arrays the descriptor points at. The descriptor comes first so that its
/// address is the context's.
#[repr(C)]
struct ExportVersioned {
    managed: DLManagedTensorVersioned,
    _tensor: Tensor,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

#[repr(C)]
struct ExportLegacy {
    managed: DLManagedTensor,
    _tensor: Tensor,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

fn dl_tensor_of(t: &Tensor, shape: &mut [i64], strides: &mut [i64]) -> DLTensor {
    DLTensor {
        data: t.data_ptr() as *mut c_void,
        device: dl_device(t.device()),
        ndim: t.shape().len() as i32,
        dtype: t.dtype().dlpack(),
        shape: shape.as_mut_ptr(),
        strides: strides.as_mut_ptr(),
        byte_offset: 0,
    }
}

unsafe extern "C" fn delete_versioned(p: *mut DLManagedTensorVersioned) {
    // SAFETY: `p` is the first field of a boxed `ExportVersioned` made by `export_versioned`;
    // DLPack calls the deleter exactly once.
    drop(unsafe { Box::from_raw(p as *mut ExportVersioned) });
}

unsafe extern "C" fn delete_legacy(p: *mut DLManagedTensor) {
    // SAFETY: as in `delete_versioned`, for `ExportLegacy`.
    drop(unsafe { Box::from_raw(p as *mut ExportLegacy) });
}

fn shape_strides(t: &Tensor) -> (Vec<i64>, Vec<i64>) {
    (
        t.shape().iter().map(|&n| n as i64).collect(),
        t.strides().iter().map(|&s| s as i64).collect(),
    )
}

/// Exports a tensor as a DLPack 1.x managed tensor that keeps its storage alive until its
/// deleter is called. The caller hands the pointer to exactly one consumer: the one that
/// `ready` was made for (any consumer when the copy filling the memory was waited for; the
/// work on one CUDA stream when that stream was ordered after it).
pub fn export_versioned(ready: Readable<'_>) -> *mut DLManagedTensorVersioned {
    let t = ready.tensor();
    // The consumer may queue device work on the memory and release it before that work ran.
    t.storage().lend(ready.stream());
    let (shape, strides) = shape_strides(t);
    let mut b = Box::new(ExportVersioned {
        managed: DLManagedTensorVersioned {
            version: VERSION,
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_versioned),
            flags: if t.is_read_only() { FLAG_READ_ONLY } else { 0 },
            dl_tensor: dl_tensor_of(t, &mut [], &mut []),
        },
        _tensor: t.clone(),
        shape,
        strides,
    });
    let ctx = &mut *b as *mut ExportVersioned;
    b.managed.manager_ctx = ctx as *mut c_void;
    b.managed.dl_tensor = dl_tensor_of(t, &mut b.shape, &mut b.strides);
    Box::into_raw(b) as *mut DLManagedTensorVersioned
}

/// Exports a tensor as a pre-1.0 managed tensor (for consumers that do not ask for a
/// version), as [`export_versioned`] does. Read-only memory cannot be marked as such in
/// this form; callers decide whether to allow it.
pub fn export_legacy(ready: Readable<'_>) -> *mut DLManagedTensor {
    let t = ready.tensor();
    // As in `export_versioned`.
    t.storage().lend(ready.stream());
    let (shape, strides) = shape_strides(t);
    let mut b = Box::new(ExportLegacy {
        managed: DLManagedTensor {
            dl_tensor: dl_tensor_of(t, &mut [], &mut []),
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_legacy),
        },
        _tensor: t.clone(),
        shape,
        strides,
    });
    let ctx = &mut *b as *mut ExportLegacy;
    b.managed.manager_ctx = ctx as *mut c_void;
    b.managed.dl_tensor = dl_tensor_of(t, &mut b.shape, &mut b.strides);
    Box::into_raw(b) as *mut DLManagedTensor
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exported_tensor_imports_back_without_copying() {
        let t = Tensor::from_slice(&[1i32, 2, 3, 4, 5, 6], &[2, 3]).unwrap();
        let v = t.transpose(0, 1).unwrap();
        let p = export_versioned(Readable::wait(&v).unwrap());
        // SAFETY: `p` was just exported and is released by the imported tensor's owner.
        let back = unsafe { import(ManagedTensor::versioned(p), |m| Box::new(m)) }.unwrap();
        assert_eq!(back.shape(), &[3, 2]);
        assert_eq!(back.data_ptr(), t.data_ptr());
        assert_eq!(back.to_vec::<i32>().unwrap(), vec![1, 4, 2, 5, 3, 6]);
    }

    #[test]
    fn legacy_export_round_trips_and_read_only_is_flagged() {
        let t = Tensor::from_slice(&[1.5f64], &[]).unwrap();
        let p = export_legacy(Readable::wait(&t).unwrap());
        // SAFETY: as above.
        let back = unsafe { import(ManagedTensor::legacy(p), |m| Box::new(m)) }.unwrap();
        assert_eq!(back.to_vec::<f64>().unwrap(), vec![1.5]);
        assert!(!back.is_read_only());
    }

    #[test]
    fn strides_that_overflow_the_address_space_are_a_layout_error() {
        // A producer's description is not trusted: its extent is checked arithmetic, not a
        // wrapped address (this computation was unchecked once).
        let t = Tensor::from_slice(&[1u8; 4], &[2, 2]).unwrap();
        let p = export_versioned(Readable::wait(&t).unwrap());
        // SAFETY: `p` was just exported by this test, which owns its two strides; the
        // import below releases it.
        unsafe { *(*p).dl_tensor.strides = i64::MAX };
        // SAFETY: as above.
        let err = unsafe { import(ManagedTensor::versioned(p), |m| Box::new(m)) }.unwrap_err();
        assert!(matches!(err, Error::Layout { .. }), "{err}");
        assert!(
            err.to_string().contains("overflows the address space"),
            "{err}"
        );
    }

    #[test]
    fn the_source_outlives_its_last_handle_through_the_export() {
        let p = {
            let t = Tensor::from_slice(&[9u8; 3], &[3]).unwrap();
            export_versioned(Readable::wait(&t).unwrap())
        };
        // SAFETY: as above.
        let back = unsafe { import(ManagedTensor::versioned(p), |m| Box::new(m)) }.unwrap();
        assert_eq!(back.to_vec::<u8>().unwrap(), vec![9, 9, 9]);
    }

    /// A producer's deleter that counts its calls and frees the descriptor, for tests
    /// that hand `import` a hand-made managed tensor.
    unsafe extern "C" fn counting_deleter(p: *mut DLManagedTensorVersioned) {
        // SAFETY: `p` is the `Box` leaked by `hand_made`; this deleter runs once.
        let b = unsafe { Box::from_raw(p) };
        // SAFETY: `manager_ctx` is the counter leaked by `hand_made`, alive for the test.
        unsafe { &*(b.manager_ctx as *const std::sync::atomic::AtomicUsize) }
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    #[test]
    fn a_producer_major_version_we_do_not_know_is_refused_and_released() {
        static DELETED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let data = [7u8; 4];
        let mut shape = [4i64];
        let p = Box::into_raw(Box::new(DLManagedTensorVersioned {
            version: DLPackVersion {
                major: VERSION.major + 1,
                minor: 0,
            },
            manager_ctx: &DELETED as *const _ as *mut c_void,
            deleter: Some(counting_deleter),
            flags: 0,
            // What a 1.x consumer would read there; a 2.x layout may differ.
            dl_tensor: DLTensor {
                data: data.as_ptr() as *mut c_void,
                device: dl_device(Device::Cpu),
                ndim: 1,
                dtype: DType::U8.dlpack(),
                shape: shape.as_mut_ptr(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
        }));
        // SAFETY: `p` is a valid, unreleased managed tensor handed over whole.
        let err = unsafe { import(ManagedTensor::versioned(p), |m| Box::new(m)) }
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("DLPack") && err.contains("major version 2"),
            "{err}"
        );
        assert_eq!(
            DELETED.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "the spec has the consumer call the deleter of a tensor it refuses"
        );
    }

    #[test]
    fn a_newer_minor_version_of_our_major_is_accepted() {
        let t = Tensor::from_slice(&[1u16, 2], &[2]).unwrap();
        let p = export_versioned(Readable::wait(&t).unwrap());
        // SAFETY: `p` was just exported and nobody else holds it.
        unsafe { (*p).version.minor = VERSION.minor + 5 };
        // SAFETY: as above.
        let back = unsafe { import(ManagedTensor::versioned(p), |m| Box::new(m)) }.unwrap();
        assert_eq!(back.to_vec::<u16>().unwrap(), vec![1, 2]);
    }
}

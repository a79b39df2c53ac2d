//! Element types: every type of the safetensors format, and DLPack's description of each.
//!
//! Sub-byte floats are held packed, as PyTorch holds them: an element of
//! [`DType::F4x2`] is one byte holding two 4-bit values (`float4_e2m1fn_x2`), one of
//! [`DType::F6E2M3x4`]/[`DType::F6E3M2x4`] three bytes holding four 6-bit values. A
//! safetensors header counts values, not elements: its shape for such a tensor has a last
//! dimension [`DType::lanes`] times the tensor's ([`DType::file_shape`],
//! [`DType::tensor_shape`]), and its bytes are the same.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The element type of a tensor.
///
/// ```
/// use tensorferry::DType;
///
/// let bf16: DType = "bfloat16".parse()?;
/// assert_eq!((bf16, bf16.size()), (DType::BF16, 2));
/// assert_eq!(DType::F32.safetensors_code(), Some("F32"));
/// # Ok::<(), tensorferry::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// Boolean, one byte per element.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 16-bit integer.
    U16,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 64-bit integer.
    U64,
    /// Signed 64-bit integer.
    I64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
    /// Complex number of two `f32`.
    Complex64,
    /// Complex number of two `f64`.
    Complex128,
    /// 8-bit float, 4 exponent bits, 3 mantissa bits, finite only (OCP `e4m3fn`).
    F8E4M3,
    /// 8-bit float, 5 exponent bits, 2 mantissa bits.
    F8E5M2,
    /// 8-bit float, 8 exponent bits and no sign or mantissa: a power of two (OCP `e8m0fnu`,
    /// the scales of microscaling formats).
    F8E8M0,
    /// 8-bit float, 4 exponent bits, 3 mantissa bits, finite, no negative zero (`e4m3fnuz`).
    F8E4M3Fnuz,
    /// 8-bit float, 5 exponent bits, 2 mantissa bits, finite, no negative zero (`e5m2fnuz`).
    F8E5M2Fnuz,
    /// Two 4-bit floats (OCP `e2m1fn`) packed in one byte, the first in the low nibble
    /// (PyTorch's `float4_e2m1fn_x2`; safetensors' `F4`).
    F4x2,
    /// Four 6-bit floats (OCP `e2m3fn`) packed in three bytes (safetensors' `F6_E2M3`).
    F6E2M3x4,
    /// Four 6-bit floats (OCP `e3m2fn`) packed in three bytes (safetensors' `F6_E3M2`).
    F6E3M2x4,
}

/// A DLPack `DLDataType`: type code, bits per lane, lanes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDataType {
    /// `DLDataTypeCode`.
    pub code: u8,
    /// Bits per lane.
    pub bits: u8,
    /// Lanes (1 for scalars).
    pub lanes: u16,
}

// DLPack type codes (dlpack.h, v1.1).
const DL_INT: u8 = 0;
const DL_UINT: u8 = 1;
const DL_FLOAT: u8 = 2;
const DL_BFLOAT: u8 = 4;
const DL_COMPLEX: u8 = 5;
const DL_BOOL: u8 = 6;
const DL_FLOAT8_E4M3FN: u8 = 10;
const DL_FLOAT8_E4M3FNUZ: u8 = 11;
const DL_FLOAT8_E5M2: u8 = 12;
const DL_FLOAT8_E5M2FNUZ: u8 = 13;
const DL_FLOAT8_E8M0FNU: u8 = 14;
const DL_FLOAT6_E2M3FN: u8 = 15;
const DL_FLOAT6_E3M2FN: u8 = 16;
const DL_FLOAT4_E2M1FN: u8 = 17;

/// What each dtype is, in the order of [`DType::ALL`] (its declaration order): the name
/// users see, the safetensors code (`None`: the format cannot hold it), the DLPack type
/// code and bits per value, and bytes per element.
const FACTS: [(&str, Option<&str>, u8, u8, usize); 23] = [
    ("bool", Some("BOOL"), DL_BOOL, 8, 1),
    ("uint8", Some("U8"), DL_UINT, 8, 1),
    ("int8", Some("I8"), DL_INT, 8, 1),
    ("uint16", Some("U16"), DL_UINT, 16, 2),
    ("int16", Some("I16"), DL_INT, 16, 2),
    ("uint32", Some("U32"), DL_UINT, 32, 4),
    ("int32", Some("I32"), DL_INT, 32, 4),
    ("uint64", Some("U64"), DL_UINT, 64, 8),
    ("int64", Some("I64"), DL_INT, 64, 8),
    ("float16", Some("F16"), DL_FLOAT, 16, 2),
    ("bfloat16", Some("BF16"), DL_BFLOAT, 16, 2),
    ("float32", Some("F32"), DL_FLOAT, 32, 4),
    ("float64", Some("F64"), DL_FLOAT, 64, 8),
    ("complex64", Some("C64"), DL_COMPLEX, 64, 8),
    ("complex128", None, DL_COMPLEX, 128, 16),
    ("float8_e4m3fn", Some("F8_E4M3"), DL_FLOAT8_E4M3FN, 8, 1),
    ("float8_e5m2", Some("F8_E5M2"), DL_FLOAT8_E5M2, 8, 1),
    ("float8_e8m0fnu", Some("F8_E8M0"), DL_FLOAT8_E8M0FNU, 8, 1),
    (
        "float8_e4m3fnuz",
        Some("F8_E4M3FNUZ"),
        DL_FLOAT8_E4M3FNUZ,
        8,
        1,
    ),
    (
        "float8_e5m2fnuz",
        Some("F8_E5M2FNUZ"),
        DL_FLOAT8_E5M2FNUZ,
        8,
        1,
    ),
    ("float4_e2m1fn_x2", Some("F4"), DL_FLOAT4_E2M1FN, 4, 1),
    ("float6_e2m3fn_x4", Some("F6_E2M3"), DL_FLOAT6_E2M3FN, 6, 3),
    ("float6_e3m2fn_x4", Some("F6_E3M2"), DL_FLOAT6_E3M2FN, 6, 3),
];

impl DType {
    /// Every dtype, in a stable order.
    pub const ALL: [DType; 23] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::U16,
        DType::I16,
        DType::U32,
        DType::I32,
        DType::U64,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::Complex64,
        DType::Complex128,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::F8E8M0,
        DType::F8E4M3Fnuz,
        DType::F8E5M2Fnuz,
        DType::F4x2,
        DType::F6E2M3x4,
        DType::F6E3M2x4,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        FACTS[self as usize].4
    }

    /// The alignment an element needs: the largest power of two dividing its size.
    pub const fn alignment(self) -> usize {
        1 << self.size().trailing_zeros()
    }

    /// Values per element: 2 for [`DType::F4x2`], 4 for the packed 6-bit floats, else 1.
    pub const fn lanes(self) -> usize {
        match self {
            DType::F4x2 => 2,
            DType::F6E2M3x4 | DType::F6E3M2x4 => 4,
            _ => 1,
        }
    }

    /// The shape a safetensors header records for a tensor of this dtype and `shape`: the
    /// same, but for packed dtypes, whose last dimension counts [`DType::lanes`] values per
    /// element. `None` for a packed scalar, which has no dimension to count its values in.
    pub fn file_shape(self, shape: &[usize]) -> Option<Vec<usize>> {
        let mut out = shape.to_vec();
        if self.lanes() > 1 {
            let last = out.last_mut()?;
            *last = last.checked_mul(self.lanes())?;
        }
        Some(out)
    }

    /// The tensor shape of a header's `shape` of this dtype, [`DType::file_shape`]
    /// undone: `None` when a packed dtype's values do not fill whole elements along the
    /// last dimension (no last dimension, or one not a multiple of [`DType::lanes`]).
    pub fn tensor_shape(self, mut shape: Vec<usize>) -> Option<Vec<usize>> {
        let lanes = self.lanes();
        if lanes > 1 {
            let last = shape.last_mut()?;
            if *last % lanes != 0 {
                return None;
            }
            *last /= lanes;
        }
        Some(shape)
    }

    /// The name users see, as NumPy and PyTorch spell it ("float32", "bfloat16", …).
    pub const fn name(self) -> &'static str {
        FACTS[self as usize].0
    }

    /// The safetensors dtype code, or `None` when the format cannot hold this type.
    pub const fn safetensors_code(self) -> Option<&'static str> {
        FACTS[self as usize].1
    }

    /// The dtype of a safetensors code, or `None` for a code tensorferry does not know.
    pub fn from_safetensors_code(code: &str) -> Option<DType> {
        Some(match code {
            "BOOL" => DType::Bool,
            "U8" => DType::U8,
            "I8" => DType::I8,
            "U16" => DType::U16,
            "I16" => DType::I16,
            "U32" => DType::U32,
            "I32" => DType::I32,
            "U64" => DType::U64,
            "I64" => DType::I64,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "F32" => DType::F32,
            "F64" => DType::F64,
            "C64" => DType::Complex64,
            "F8_E4M3" => DType::F8E4M3,
            "F8_E5M2" => DType::F8E5M2,
            "F8_E8M0" => DType::F8E8M0,
            "F8_E4M3FNUZ" => DType::F8E4M3Fnuz,
            "F8_E5M2FNUZ" => DType::F8E5M2Fnuz,
            "F4" => DType::F4x2,
            "F6_E2M3" => DType::F6E2M3x4,
            "F6_E3M2" => DType::F6E3M2x4,
            _ => return None,
        })
    }

    /// The DLPack description of this dtype (packed floats as PyTorch describes its
    /// `float4_e2m1fn_x2`: bits of one value, lanes per element).
    pub const fn dlpack(self) -> DLDataType {
        let (_, _, code, bits, _) = FACTS[self as usize];
        DLDataType {
            code,
            bits,
            lanes: self.lanes() as u16,
        }
    }

    /// The dtype of a DLPack description, or `None` for one tensorferry does not handle
    /// (vector lanes of whole-byte types, opaque handles, sub-byte floats one per byte).
    pub fn from_dlpack(dl: DLDataType) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.dlpack() == dl)
    }

    /// True for types NumPy holds natively (everything but bfloat16 and the 8-, 6- and
    /// 4-bit floats).
    pub const fn is_numpy_native(self) -> bool {
        !self.is_ml_dtypes() && self.lanes() == 1
    }

    /// True for types NumPy holds with `ml_dtypes`, one value per element: bfloat16 and
    /// the 8-bit floats (its 4- and 6-bit floats take a byte per value, not packed).
    pub const fn is_ml_dtypes(self) -> bool {
        matches!(
            self,
            DType::BF16
                | DType::F8E4M3
                | DType::F8E5M2
                | DType::F8E8M0
                | DType::F8E4M3Fnuz
                | DType::F8E5M2Fnuz
        )
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;

    /// Parses a dtype name ("float32") or a safetensors code ("F32").
    fn from_str(s: &str) -> Result<Self> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .or_else(|| DType::from_safetensors_code(s))
            .ok_or_else(|| Error::InvalidValue {
                key: String::new(),
                reason: format!("unknown dtype {s:?}"),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_facts_are_in_the_order_of_all() {
        for (i, d) in DType::ALL.into_iter().enumerate() {
            assert_eq!(d as usize, i, "{d:?}");
        }
    }

    #[test]
    fn every_dtype_round_trips_through_its_name() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
    }

    #[test]
    fn every_dtype_round_trips_through_dlpack() {
        for d in DType::ALL {
            assert_eq!(DType::from_dlpack(d.dlpack()), Some(d));
            let dl = d.dlpack();
            assert_eq!(dl.bits as usize * dl.lanes as usize, d.size() * 8, "{d}");
        }
    }

    #[test]
    fn safetensors_codes_round_trip_and_complex128_has_none() {
        for d in DType::ALL {
            match d.safetensors_code() {
                Some(code) => assert_eq!(DType::from_safetensors_code(code), Some(d)),
                None => assert_eq!(d, DType::Complex128),
            }
        }
    }

    #[test]
    fn vector_lanes_are_not_a_dtype() {
        let mut dl = DType::F32.dlpack();
        dl.lanes = 4;
        assert_eq!(DType::from_dlpack(dl), None);
        // One 4-bit value per byte is not PyTorch's packed layout.
        let mut f4 = DType::F4x2.dlpack();
        f4.lanes = 1;
        assert_eq!(DType::from_dlpack(f4), None);
    }

    #[test]
    fn every_code_of_the_safetensors_format_is_a_dtype() {
        // The `Dtype` enum of safetensors 0.8 (safetensors/src/tensor.rs), all of it.
        for code in [
            "BOOL",
            "F4",
            "F6_E2M3",
            "F6_E3M2",
            "U8",
            "I8",
            "F8_E5M2",
            "F8_E4M3",
            "F8_E8M0",
            "F8_E4M3FNUZ",
            "F8_E5M2FNUZ",
            "I16",
            "U16",
            "F16",
            "BF16",
            "I32",
            "U32",
            "F32",
            "C64",
            "F64",
            "I64",
            "U64",
        ] {
            let d = DType::from_safetensors_code(code).unwrap_or_else(|| panic!("{code}"));
            assert_eq!(d.safetensors_code(), Some(code));
        }
    }

    #[test]
    fn packed_floats_count_values_along_the_last_dimension_of_a_file() {
        assert_eq!(DType::F4x2.file_shape(&[2, 3]), Some(vec![2, 6]));
        assert_eq!(DType::F4x2.tensor_shape(vec![2, 6]), Some(vec![2, 3]));
        assert_eq!(DType::F4x2.tensor_shape(vec![2, 3]), None);
        assert_eq!(DType::F4x2.tensor_shape(vec![]), None);
        assert_eq!(DType::F4x2.file_shape(&[]), None);
        assert_eq!(DType::F4x2.tensor_shape(vec![3, 0]), Some(vec![3, 0]));
        assert_eq!(DType::F6E2M3x4.file_shape(&[5]), Some(vec![20]));
        assert_eq!(DType::F6E3M2x4.tensor_shape(vec![2, 6]), None);
        assert_eq!(DType::F32.file_shape(&[]), Some(vec![]));
        assert_eq!(
            (DType::F6E2M3x4.alignment(), DType::F64.alignment()),
            (1, 8)
        );
    }
}

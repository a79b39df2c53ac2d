//! Element types: every type of DLPack and safetensors that users meet.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The element type of a tensor.
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
const DL_FLOAT8_E5M2: u8 = 12;

impl DType {
    /// Every dtype, in a stable order.
    pub const ALL: [DType; 17] = [
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
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 | DType::Complex64 => 8,
            DType::Complex128 => 16,
        }
    }

    /// The name users see, as NumPy and PyTorch spell it ("float32", "bfloat16", …).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::U16 => "uint16",
            DType::I16 => "int16",
            DType::U32 => "uint32",
            DType::I32 => "int32",
            DType::U64 => "uint64",
            DType::I64 => "int64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::Complex64 => "complex64",
            DType::Complex128 => "complex128",
            DType::F8E4M3 => "float8_e4m3fn",
            DType::F8E5M2 => "float8_e5m2",
        }
    }

    /// The safetensors dtype code, or `None` when the format cannot hold this type.
    pub const fn safetensors_code(self) -> Option<&'static str> {
        Some(match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::U16 => "U16",
            DType::I16 => "I16",
            DType::U32 => "U32",
            DType::I32 => "I32",
            DType::U64 => "U64",
            DType::I64 => "I64",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::Complex64 => "C64",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
            DType::Complex128 => return None,
        })
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
            _ => return None,
        })
    }

    /// The DLPack description of this dtype.
    pub const fn dlpack(self) -> DLDataType {
        let (code, bits) = match self {
            DType::Bool => (DL_BOOL, 8),
            DType::U8 => (DL_UINT, 8),
            DType::I8 => (DL_INT, 8),
            DType::U16 => (DL_UINT, 16),
            DType::I16 => (DL_INT, 16),
            DType::U32 => (DL_UINT, 32),
            DType::I32 => (DL_INT, 32),
            DType::U64 => (DL_UINT, 64),
            DType::I64 => (DL_INT, 64),
            DType::F16 => (DL_FLOAT, 16),
            DType::BF16 => (DL_BFLOAT, 16),
            DType::F32 => (DL_FLOAT, 32),
            DType::F64 => (DL_FLOAT, 64),
            DType::Complex64 => (DL_COMPLEX, 64),
            DType::Complex128 => (DL_COMPLEX, 128),
            DType::F8E4M3 => (DL_FLOAT8_E4M3FN, 8),
            DType::F8E5M2 => (DL_FLOAT8_E5M2, 8),
        };
        DLDataType {
            code,
            bits,
            lanes: 1,
        }
    }

    /// The dtype of a DLPack description, or `None` for one tensorferry does not handle
    /// (vector lanes, opaque handles, sub-byte floats).
    pub fn from_dlpack(dl: DLDataType) -> Option<DType> {
        if dl.lanes != 1 {
            return None;
        }
        DType::ALL.into_iter().find(|d| d.dlpack() == dl)
    }

    /// True for types NumPy holds natively (everything but bfloat16 and float8).
    pub const fn is_numpy_native(self) -> bool {
        !matches!(self, DType::BF16 | DType::F8E4M3 | DType::F8E5M2)
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
    fn every_dtype_round_trips_through_its_name() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
    }

    #[test]
    fn every_dtype_round_trips_through_dlpack() {
        for d in DType::ALL {
            assert_eq!(DType::from_dlpack(d.dlpack()), Some(d));
            assert_eq!(d.dlpack().bits as usize, d.size() * 8);
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
    }
}

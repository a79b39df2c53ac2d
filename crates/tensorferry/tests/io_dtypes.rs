//! Every dtype of the safetensors format: files written by the official `safetensors`
//! crate load, and save back byte for byte; the packed sub-byte floats follow the format's
//! size rules (F4: two values a byte, F6: four values in three bytes).

mod common;

use common::{load_dict, save_dict, save_err};

use tensorferry::{load, DType, LoadOptions, SaveOptions, Tensor, TensorDict};

/// Every dtype of the official crate (`safetensors::Dtype`, version 0.8), with its code.
const OFFICIAL: [(safetensors::Dtype, &str); 22] = {
    use safetensors::Dtype as D;
    [
        (D::BOOL, "BOOL"),
        (D::F4, "F4"),
        (D::F6_E2M3, "F6_E2M3"),
        (D::F6_E3M2, "F6_E3M2"),
        (D::U8, "U8"),
        (D::I8, "I8"),
        (D::F8_E5M2, "F8_E5M2"),
        (D::F8_E4M3, "F8_E4M3"),
        (D::F8_E8M0, "F8_E8M0"),
        (D::F8_E4M3FNUZ, "F8_E4M3FNUZ"),
        (D::F8_E5M2FNUZ, "F8_E5M2FNUZ"),
        (D::I16, "I16"),
        (D::U16, "U16"),
        (D::F16, "F16"),
        (D::BF16, "BF16"),
        (D::I32, "I32"),
        (D::U32, "U32"),
        (D::F32, "F32"),
        (D::C64, "C64"),
        (D::F64, "F64"),
        (D::I64, "I64"),
        (D::U64, "U64"),
    ]
};

/// Bytes of `n` values of `dtype`, as the official crate counts them.
fn bytes_of(dtype: safetensors::Dtype, values: usize) -> Vec<u8> {
    let n = values * dtype.bitsize() / 8;
    (0..n).map(|i| (i * 37 + 11) as u8).collect()
}

/// The file the official crate writes for one tensor of every dtype, `shape` each.
fn official_file(shape: &[usize]) -> Vec<u8> {
    let values: usize = shape.iter().product();
    let data: Vec<(String, Vec<u8>, safetensors::Dtype)> = OFFICIAL
        .iter()
        .map(|&(d, code)| (format!("t_{code}"), bytes_of(d, values), d))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(name, bytes, d)| {
            let view = safetensors::tensor::TensorView::new(*d, shape.to_vec(), bytes).unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

#[test]
fn every_official_dtype_loads_and_saves_back_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    // The last dimension is a multiple of four: whole elements for every packed dtype.
    for shape in [vec![8], vec![3, 4], vec![2, 0], vec![0]] {
        let original = official_file(&shape);
        let path = dir.path().join("official.safetensors");
        std::fs::write(&path, &original).unwrap();
        let (d, _) = load_dict(&path, LoadOptions::default());
        assert_eq!(d.len(), OFFICIAL.len());
        for (official, code) in OFFICIAL {
            let t = d.tensor(&[&format!("t_{code}")]).unwrap();
            assert_eq!(t.dtype().safetensors_code(), Some(code));
            assert_eq!(t.dtype().file_shape(t.shape()).unwrap(), shape, "{code}");
            assert_eq!(
                t.contiguous_bytes().unwrap(),
                &bytes_of(official, shape.iter().product())[..]
            );
        }
        let again = dir.path().join("again.safetensors");
        save_dict(&d, &again, &SaveOptions::default());
        // Byte for byte, header included: the official crate writes a flat dict in order
        // of falling alignment, as tensorferry does.
        let ours = std::fs::read(&again).unwrap();
        let theirs = safetensors::SafeTensors::deserialize(&ours).unwrap();
        let mine = safetensors::SafeTensors::deserialize(&original).unwrap();
        for (name, view) in mine.tensors() {
            let other = theirs.tensor(&name).unwrap();
            assert_eq!(
                (other.dtype(), other.shape(), other.data()),
                (view.dtype(), view.shape(), view.data()),
                "{name} {shape:?}"
            );
        }
        assert_eq!(
            data_section(&ours),
            data_section(&original),
            "{shape:?}: the data bytes"
        );
    }
}

/// The bytes after a file's header.
fn data_section(file: &[u8]) -> &[u8] {
    let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    &file[8 + n..]
}

#[test]
fn a_file_saved_and_saved_again_is_the_same_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = TensorDict::new();
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        if dtype.safetensors_code().is_none() {
            continue;
        }
        let shape = [2, 3];
        let n = 6 * dtype.size();
        let bytes: Vec<u8> = (0..n).map(|b| (b * 7 + i) as u8).collect();
        d.insert(
            dtype.name(),
            Tensor::from_bytes(dtype, shape.to_vec(), &bytes).unwrap(),
        );
    }
    let first = dir.path().join("a.safetensors");
    save_dict(&d, &first, &SaveOptions::default());
    let (back, _) = load_dict(&first, LoadOptions::default());
    let second = dir.path().join("b.safetensors");
    save_dict(&back, &second, &SaveOptions::default());
    assert_eq!(
        std::fs::read(&first).unwrap(),
        std::fs::read(&second).unwrap()
    );
    // The official crate reads every tensor, packed ones with values counted.
    let bytes = std::fs::read(&first).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("float4_e2m1fn_x2").unwrap().shape(), [2, 6]);
    assert_eq!(st.tensor("float6_e3m2fn_x4").unwrap().shape(), [2, 12]);
    assert_eq!(st.tensor("float6_e3m2fn_x4").unwrap().data().len(), 18);
}

#[test]
fn packed_values_that_do_not_fill_whole_elements_are_refused_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    // Valid for the official crate (6 values = 3 bytes), but not whole pairs on a row.
    let bytes = bytes_of(safetensors::Dtype::F4, 6);
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F4, vec![2, 3], &bytes).unwrap();
    let path = dir.path().join("odd.safetensors");
    safetensors::serialize_to_file([("w.odd", view)], None, &path).unwrap();
    let err = load(&path, LoadOptions::default()).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, tensorferry::Error::UnsupportedDType { .. }),
        "{err:?}"
    );
    assert!(
        text.contains("w.odd") && text.contains("[2, 3]") && text.contains("float4_e2m1fn_x2"),
        "{text}"
    );
}

#[test]
fn a_packed_scalar_cannot_be_saved() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = TensorDict::new();
    d.insert(
        "s",
        Tensor::from_bytes(DType::F4x2, vec![], &[0x21]).unwrap(),
    );
    let err = save_err(d, dir.path().join("s.safetensors"));
    assert!(
        matches!(&err, tensorferry::Error::UnsupportedDType { key, .. } if key == "s"),
        "{err:?}"
    );
}

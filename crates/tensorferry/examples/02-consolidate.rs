//! Pack every tensor of a dictionary into one 64-byte-aligned buffer (views into it):
//! one allocation and one transfer for the whole dictionary, strided tensors made
//! contiguous on the way. Run: cargo run -p tensorferry --example 02-consolidate

use tensorferry::{consolidate, Node, Tensor, TensorDict};

fn main() -> tensorferry::Result<()> {
    let mut d = TensorDict::new();
    let m = Tensor::from_slice(&[1i32, 2, 3, 4, 5, 6], &[2, 3])?;
    d.insert("transposed", m.transpose(0, 1)?);
    d.insert("ids", Tensor::from_slice(&[7i64, 8, 9], &[3])?);
    let packed = consolidate(&Node::from(d))?;
    for (path, t) in packed.tensors() {
        println!(
            "{path}: {t:?} at offset {} (aligned: {}), values {:?}",
            t.offset(),
            t.offset() % 64 == 0,
            t.to_contiguous()?.contiguous_bytes().map(<[u8]>::len)
        );
    }
    let t = packed.tensor(&["transposed"]).expect("present");
    assert_eq!(t.to_vec::<i32>()?, vec![1, 4, 2, 5, 3, 6]);
    Ok(())
}

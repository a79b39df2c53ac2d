"""Writes the hostile and broken safetensors files of tests/corpus/ (stdlib only).

Run from this folder: python3 make_corpus.py. Each file name says what is wrong with it;
files named valid_* are well formed.
"""
import json
import struct
from pathlib import Path

HERE = Path(__file__).parent / "corpus"


def file(header, data=b"", raw_header=None, length=None):
    body = raw_header if raw_header is not None else json.dumps(header).encode()
    n = len(body) if length is None else length
    return struct.pack("<Q", n) + body + data


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


CASES = {
    "empty_file": b"",
    "shorter_than_length": b"\x05\x00\x00",
    "header_past_end": file({}, length=1000),
    "header_over_100mb": struct.pack("<Q", 200_000_000) + b"{}",
    "header_length_u64_max": struct.pack("<Q", 2**64 - 1) + b"{}",
    "invalid_json": file(None, raw_header=b"{\"a\": [1, 2"),
    "not_an_object": file([1, 2, 3]),
    "invalid_utf8": file(None, raw_header=b"{\"\xff\xfe\": 1}"),
    "unknown_dtype": file({"a": entry("Q7", [1], 0, 1)}, b"\x00"),
    "shape_times_dtype_mismatch": file({"a": entry("F32", [3], 0, 8)}, b"\x00" * 8),
    "huge_shape_claim": file({"a": entry("F32", [2**40, 2**40], 0, 4)}, b"\x00" * 4),
    "shape_overflow": file({"a": entry("F64", [2**62, 16], 0, 8)}, b"\x00" * 8),
    "negative_dim": file({"a": entry("U8", [-1], 0, 1)}, b"\x00"),
    "offsets_out_of_range": file({"a": entry("U8", [1000], 0, 1000)}, b"\x00" * 10),
    "offsets_reversed": file({"a": entry("U8", [0], 4, 2)}, b"\x00" * 4),
    "overlapping_offsets": file({"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 2, 6)}, b"\x00" * 6),
    "gap_between_tensors": file({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 4, 6)}, b"\x00" * 6),
    "trailing_bytes": file({"a": entry("U8", [2], 0, 2)}, b"\x00" * 9),
    "duplicate_names": file(
        None, raw_header=b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}'
    ) + b"\x00\x00",
    "metadata_not_strings": file({"__metadata__": {"k": 1}}),
    "entry_missing_offsets": file({"a": {"dtype": "U8", "shape": [1]}}, b"\x00"),
    "tree_refers_to_missing_tensor": file(
        {"__metadata__": {"tensorferry": json.dumps({"format": 1, "tree": {"dict": [["x", {"tensor": "nope"}]]}})}}
    ),
    "tree_omits_a_tensor": file(
        {"__metadata__": {"tensorferry": json.dumps({"format": 1, "tree": {"dict": []}})}, "a": entry("U8", [1], 0, 1)},
        b"\x00",
    ),
    "tree_uses_a_tensor_twice": file(
        {
            "__metadata__": {
                "tensorferry": json.dumps(
                    {"format": 1, "tree": {"list": [{"tensor": "a"}, {"tensor": "a"}]}}
                )
            },
            "a": entry("U8", [1], 0, 1),
        },
        b"\x00",
    ),
    "tree_not_json": file({"__metadata__": {"tensorferry": "{oops"}}),
    "tree_unknown_node_kind": file(
        {"__metadata__": {"tensorferry": json.dumps({"format": 1, "tree": {"set": []}})}}
    ),
    "tree_future_format": file({"__metadata__": {"tensorferry": json.dumps({"format": 99, "tree": {"dict": []}})}}),
    "tree_deeply_nested": file(
        {"__metadata__": {"tensorferry": json.dumps({"format": 1, "tree": {"list": [{"list": []}]}})[:-4] + "]" * 5000}}
    ),
    "valid_flat": file({"a.b": entry("F32", [2], 0, 8), "c": entry("U8", [0], 8, 8)}, b"\x00" * 8),
    "valid_only_metadata": file({"__metadata__": {"k": "v"}}),
}

if __name__ == "__main__":
    HERE.mkdir(exist_ok=True)
    for name, data in CASES.items():
        (HERE / f"{name}.safetensors").write_bytes(data)
    print(f"wrote {len(CASES)} files to {HERE}")

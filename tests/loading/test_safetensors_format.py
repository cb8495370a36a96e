from __future__ import annotations

import struct

import pytest
import torch
from safetensors.torch import save_file

from ondeck.errors import LoadError
from ondeck.loading import TensorInfo, parse_header, read_header

from .helpers import header_bytes, write_raw, write_safetensors


def test_header_matches_what_safetensors_wrote(tmp_path):
    path = tmp_path / "w.safetensors"
    tensors = {"a": torch.zeros(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    save_file(tensors, str(path), metadata={"format": "pt"})

    header = read_header(path)

    assert header.metadata == {"format": "pt"}
    assert set(header.tensors) == {"a", "b"}
    a = header.tensors["a"]
    assert (a.dtype, a.shape, a.nbytes, a.path) == (torch.float32, (3, 4), 48, str(path))
    assert header.data_start + header.data_nbytes == path.stat().st_size
    raw = path.read_bytes()
    assert raw[a.start : a.end] == bytes(48)


def test_offsets_are_absolute(tmp_path):
    path = write_safetensors(tmp_path / "w.safetensors", {"x": torch.arange(3, dtype=torch.int8)})
    info = read_header(path).tensors["x"]
    assert isinstance(info, TensorInfo)
    assert path.read_bytes()[info.start : info.end] == bytes([0, 1, 2])


def test_zero_element_and_scalar_tensors_are_valid(tmp_path):
    tensors = {"empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5)}
    header = read_header(write_safetensors(tmp_path / "w.safetensors", tensors))
    assert header.tensors["empty"].nbytes == 0
    assert header.tensors["scalar"].shape == ()
    assert header.tensors["scalar"].nbytes == 4


def test_every_format_dtype_is_known_or_refused_clearly(tmp_path):
    for name in ("F4", "F6_E2M3"):
        entries = {"t": {"dtype": name, "shape": [2], "data_offsets": [0, 1]}}
        with pytest.raises(LoadError, match="not supported by torch"):
            read_header(write_raw(tmp_path / f"{name}.safetensors", entries, b"\0"))


@pytest.mark.parametrize(
    "entries, data, problem",
    [
        ({"t": {"dtype": "F12", "shape": [1], "data_offsets": [0, 4]}}, bytes(4), "unknown dtype"),
        ({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), "shape"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4), "needs 8"),
        ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, bytes(4), "end before"),
        ({"t": {"dtype": "F32", "shape": [1]}}, bytes(4), "data_offsets"),
        ({"t": [1, 2]}, b"", "not an object"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            bytes(12),
            "overlaps",
        ),
        ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8), "truncated"),
    ],
)
def test_bad_entries_are_refused_naming_file_and_tensor(tmp_path, entries, data, problem):
    path = write_raw(tmp_path / "bad.safetensors", entries, data)
    with pytest.raises(LoadError, match=problem) as caught:
        read_header(path, component="vae")
    message = str(caught.value)
    assert str(path) in message and "'vae'" in message
    assert caught.value.path == str(path)


def test_truncated_data_says_how_much_is_missing(tmp_path):
    path = write_safetensors(tmp_path / "w.safetensors", {"t": torch.zeros(1000)})
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(LoadError, match=r"header says 4.0 KB of data, file holds 3.0 KB"):
        read_header(path)


@pytest.mark.parametrize(
    "raw, problem",
    [
        (b"", "too short"),
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", 10**12) + b"{}", "not plausible"),
        (struct.pack("<Q", 100) + b"{}", "truncated"),
        (struct.pack("<Q", 4) + b"{]}x", "not valid JSON"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "not valid JSON"),
        (struct.pack("<Q", 2) + b"[]", "not an object"),
        (header_bytes({"__metadata__": {"a": 1}}), "__metadata__"),
    ],
)
def test_broken_headers_are_load_errors(tmp_path, raw, problem):
    with pytest.raises(LoadError, match=problem) as caught:
        parse_header(raw, len(raw), tmp_path / "x.safetensors")
    assert "x.safetensors" in str(caught.value)


def test_deeply_nested_json_is_a_load_error(tmp_path):
    text = b"[" * 100_000 + b"]" * 100_000
    raw = struct.pack("<Q", len(text)) + text
    with pytest.raises(LoadError):
        parse_header(raw, len(raw), tmp_path / "x.safetensors")


def test_unreadable_file_is_a_load_error(tmp_path):
    with pytest.raises(LoadError, match="cannot read"):
        read_header(tmp_path / "absent.safetensors")

"""Any bytes at all, given as a safetensors header, either parse or raise LoadError."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ondeck.errors import LoadError
from ondeck.loading import parse_header
from ondeck.loading.safetensors_format import DTYPES

SUPPORTED = sorted(name for name, dtype in DTYPES.items() if dtype is not None)
DTYPE_NAMES = sorted(DTYPES) + ["F12", "", "f32", "BOOL "]

counts = st.one_of(
    st.integers(0, 64), st.integers(-4, -1), st.integers(2**62, 2**70), st.just(True)
)
odd_values = st.one_of(
    st.none(), st.floats(allow_nan=True), st.text(max_size=4), st.lists(st.integers(), max_size=3)
)
FIELDS = ("dtype", "shape", "data_offsets")


@st.composite
def documents(draw) -> tuple[dict, int]:
    """A valid layout of a few tensors, then a few mutations; returns it and its data size."""
    document, offset = {}, 0
    for index in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(SUPPORTED))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        nbytes = DTYPES[dtype].itemsize
        for dim in shape:
            nbytes *= dim
        document[f"t{index}"] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    if draw(st.booleans()):
        document["__metadata__"] = draw(
            st.one_of(st.dictionaries(st.text(max_size=3), st.text(max_size=3)), odd_values)
        )
    for _ in range(draw(st.integers(0, 3))):
        names = sorted(key for key in document if key != "__metadata__")
        if not names:
            break
        entry = document[draw(st.sampled_from(names))]
        if not isinstance(entry, dict):
            continue
        field = draw(st.sampled_from(FIELDS))
        mutation = draw(st.integers(0, 4))
        if mutation == 0:
            entry.pop(field, None)
        elif mutation == 1:
            entry[field] = draw(odd_values)
        elif mutation == 2 and field == "dtype":
            entry[field] = draw(st.sampled_from(DTYPE_NAMES))
        elif mutation == 2 and field == "shape":
            entry[field] = draw(st.lists(counts, max_size=4))
        elif mutation == 2:
            entry[field] = draw(st.lists(counts, max_size=3))
        elif mutation == 3 and isinstance(entry.get("data_offsets"), list):
            entry["data_offsets"] = [v + draw(st.integers(-9, 9)) for v in entry["data_offsets"]]
        else:
            document[draw(st.text(max_size=3))] = draw(st.one_of(odd_values, st.just(entry)))
    return document, offset


@st.composite
def headers(draw) -> tuple[bytes, int]:
    """A header that is plausible often enough to reach every check, plus its file size."""
    if draw(st.integers(0, 9)) == 0:
        raw = draw(st.binary(max_size=128))
        return raw, len(raw) + draw(st.integers(0, 16))
    document, data_nbytes = draw(documents())
    text = json.dumps(document).encode() + b" " * draw(st.integers(0, 7))
    if draw(st.integers(0, 7)) == 0:
        position = draw(st.integers(0, len(text)))
        text = text[:position] + draw(st.binary(max_size=3)) + text[position:]
    length = len(text)
    if draw(st.integers(0, 7)) == 0:
        length = draw(st.one_of(st.integers(0, 2 * length + 8), st.integers(0, 2**64 - 1)))
    raw = struct.pack("<Q", length) + text
    if draw(st.integers(0, 9)) == 0:
        raw = raw[: draw(st.integers(0, len(raw)))]
    file_size = len(raw) + data_nbytes + draw(st.integers(-8, 8))
    return raw, max(0, file_size)


def check(raw: bytes, file_size: int) -> None:
    try:
        header = parse_header(raw, file_size, "fuzz.safetensors")
    except LoadError as error:
        assert "fuzz.safetensors" in str(error)
        return
    regions = sorted((t for t in header.tensors.values() if t.nbytes), key=lambda t: t.start)
    for tensor in header.tensors.values():
        assert header.data_start <= tensor.start <= tensor.end <= file_size
        assert tensor.nbytes == tensor.numel * tensor.dtype.itemsize
    for previous, current in zip(regions, regions[1:], strict=False):
        assert previous.end <= current.start


# Derandomized in the suite so a run is repeatable; the soak variant explores at random.
@settings(max_examples=400, deadline=None, database=None, derandomize=True)
@given(headers())
def test_any_header_parses_or_raises_load_error(case):
    check(*case)


@pytest.mark.soak
@settings(
    max_examples=1_000_000,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(headers())
def test_a_million_headers_parse_or_raise_load_error(case):
    check(*case)


def test_an_empty_tensor_placed_past_the_end_is_refused():
    # Found by the fuzzer: an empty tensor's offsets were not checked against the file.
    document = {
        "t0": {"dtype": "BF16", "shape": [0], "data_offsets": [7, 7]},
        "t1": {"dtype": "BF16", "shape": [], "data_offsets": [0, 2]},
    }
    text = json.dumps(document).encode()
    raw = struct.pack("<Q", len(text)) + text
    with pytest.raises(LoadError, match="truncated"):
        parse_header(raw, len(raw) + 2, "fuzz.safetensors")

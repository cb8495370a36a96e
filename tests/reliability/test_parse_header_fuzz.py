"""The safetensors header parser, fed mutations of real checkpoint headers.

Starting from the headers of the tiny Wan folder's weight files, each input flips
bytes, cuts the header short, lies in the length prefix or the file size, or edits the
JSON (wrong types, huge or negative numbers, overlapping or reversed offsets, unknown
dtypes, stray keys, deep nesting). ``parse_header`` must either return a header whose
tensors lie inside the file without overlapping, or raise ``LoadError`` naming the file
(and the component, when given). Any other exception is a bug.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import random
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ondeck.errors import LoadError
from ondeck.loading import parse_header
from ondeck.loading.safetensors_format import DTYPES

PATH = "/models/wan/transformer/diffusion_pytorch_model.safetensors"
DTYPE_NAMES = sorted(DTYPES) + ["F12", "", "f32", "F32 ", "I4", "BF16\x00"]
FIELDS = ("dtype", "shape", "data_offsets")
ODD_VALUES = (
    None,
    True,
    False,
    0,
    -1,
    2**31,
    2**64,
    2**64 + 1,
    10**40,
    1.5,
    float("nan"),
    float("inf"),
    "",
    "F32",
    "\ud800",
    [],
    {},
    [1],
    [1, 2, 3],
    [-1, 4],
    ["0", "4"],
    [None, None],
    [[1, 2]],
    {"a": 1},
)
ODD_COUNTS = (0, 1, 3, 7, 64, -1, -8, 2**31 - 1, 2**31, 2**63, 2**64 - 1, 2**64, 2**200, True, 1.0)
DEEP = (b"[" * 5000, b'{"a":' * 3000, b"1e999", b'"x"', b"[]", b"null", b"{}", b"-0")
KINDS = ("json", "json", "json", "json", "flip", "flip", "splice", "length", "cut", "as-is")


class Seed(tuple):
    """A real file's tensor entries in file order; shown by file name in reports."""

    name: str

    def __repr__(self) -> str:
        return f"Seed({self.name})"


@functools.cache
def seed_headers(folder: str) -> tuple[Seed, ...]:
    """The tensor entries of every weight file in the folder, in file order."""
    seeds = []
    for path in sorted(Path(folder).glob("*/*.safetensors")):
        raw = path.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        document = json.loads(raw[8 : 8 + length])
        document.pop("__metadata__", None)
        seed = Seed(sorted(document.items(), key=lambda item: item[1]["data_offsets"][0]))
        seed.name = f"{path.parent.name}/{path.name}"
        seeds.append(seed)
    return tuple(seeds)


def serialise(document: dict) -> bytes:
    text = json.dumps(document).encode()
    return struct.pack("<Q", len(text)) + text


def odd_value(rng: random.Random, depth: int = 0):
    """Any JSON value, now and then nested."""
    if depth < 2 and rng.random() < 0.2:
        if rng.random() < 0.5:
            return [odd_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(FIELDS + ("x",)): odd_value(rng, depth + 1)}
    return copy.deepcopy(rng.choice(ODD_VALUES + ODD_COUNTS))


def edit_document(document: dict, rng: random.Random) -> None:
    """One to four edits of the kind a corrupt or hostile header holds."""
    names = [key for key in document if key != "__metadata__"]
    for _ in range(rng.randint(1, 4)):
        name = rng.choice(names)
        entry = document.get(name)
        edit = rng.randrange(13)
        if not isinstance(entry, dict) or edit == 0:
            document[rng.choice([name, "", "\ud800", "t" * rng.randint(1, 3)])] = odd_value(rng)
        elif edit == 1:
            entry.pop(rng.choice(FIELDS), None)
        elif edit == 2:
            entry[rng.choice(FIELDS)] = odd_value(rng)
        elif edit == 3:
            entry["dtype"] = rng.choice(DTYPE_NAMES)
        elif edit == 4 and isinstance(entry.get("shape"), list):
            shape = entry["shape"]
            if shape and rng.random() < 0.5:
                shape[rng.randrange(len(shape))] = rng.choice(ODD_COUNTS)
            else:
                shape.insert(rng.randint(0, len(shape)), rng.choice(ODD_COUNTS))
        elif edit == 5 and isinstance(entry.get("data_offsets"), list) and entry["data_offsets"]:
            offsets = entry["data_offsets"]
            offsets[rng.randrange(len(offsets))] = rng.choice(ODD_COUNTS)
        elif edit == 6 and isinstance(entry.get("data_offsets"), list):
            shift = rng.randint(-64, 64)
            entry["data_offsets"] = [
                v + shift if isinstance(v, int) else v for v in entry["data_offsets"]
            ]
        elif edit == 7 and isinstance(entry.get("data_offsets"), list):
            entry["data_offsets"] = entry["data_offsets"][::-1]
        elif edit == 8:
            other = document.get(rng.choice(names))
            if isinstance(other, dict):  # overlap another tensor, or coincide with it
                entry["data_offsets"] = copy.deepcopy(other.get("data_offsets"))
        elif edit == 9:
            document["__metadata__"] = rng.choice([odd_value(rng), {"format": "pt"}, {"a": 1}])
        elif edit == 10:
            entry["shape"] = [rng.choice(ODD_COUNTS) for _ in range(rng.randint(0, 4))]
        elif edit == 11:  # an empty tensor, anywhere: inside, at the end, past the end
            shape = entry.get("shape") if isinstance(entry.get("shape"), list) else []
            entry["shape"] = [0, *shape][: rng.randint(1, 3)]
            at = rng.choice([0, rng.randint(0, 2**20), 2**64 - 1, rng.randint(0, 4096)])
            entry["data_offsets"] = [at, at]
        else:
            entry[rng.choice(["x", "dtype ", "offsets"])] = odd_value(rng)


@st.composite
def header_cases(draw, seeds) -> tuple[bytes, int, str | None]:
    """A real header (or a run of its tensors, rebased) with one kind of damage.

    Hypothesis picks the file, the kind of damage and a seed; the details come from a
    seeded generator, which keeps an input to a few draws (a million of them fit in a
    soak) and still reproduces exactly from the reported example.
    """
    seed = draw(st.sampled_from(seeds))
    kind = draw(st.sampled_from(KINDS))
    rng = draw(st.randoms(use_true_random=True))
    entries_in_order = tuple(seed)
    if rng.random() < 0.6:  # a few consecutive tensors: small, quick, and just as real
        count = rng.randint(1, 6)
        start = rng.randint(0, len(entries_in_order) - count)
        entries_in_order = entries_in_order[start : start + count]
    base = entries_in_order[0][1]["data_offsets"][0]
    document = {
        name: {
            "dtype": entry["dtype"],
            "shape": list(entry["shape"]),
            "data_offsets": [offset - base for offset in entry["data_offsets"]],
        }
        for name, entry in entries_in_order
    }
    data_nbytes = entries_in_order[-1][1]["data_offsets"][1] - base
    if rng.random() < 0.5:
        document["__metadata__"] = {"format": "pt"}
    if kind == "json":
        if rng.random() < 0.05:
            text = rng.choice(DEEP)
        else:
            edit_document(document, rng)
            text = json.dumps(document).encode()
        text += b" " * rng.randint(0, 7)
        raw = struct.pack("<Q", len(text)) + text
    else:
        raw = serialise(document)
    length = len(raw) - 8
    file_size = len(raw) + data_nbytes
    if kind == "flip":
        buffer = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            buffer[rng.randrange(len(buffer))] = rng.randrange(256)
        raw = bytes(buffer)
    elif kind == "splice":
        at = rng.randint(8, len(raw))
        if rng.random() < 0.5:
            raw = raw[:at] + rng.randbytes(rng.randint(1, 8)) + raw[at:]
        else:
            raw = raw[:at] + raw[at + rng.randint(1, 8) :]
    elif kind == "length":
        lie = rng.choice(
            [rng.randint(0, 2 * length + 16), length + rng.randint(-8, 8), rng.getrandbits(64)]
        )
        raw = struct.pack("<Q", max(0, lie)) + raw[8:]
    elif kind == "cut":
        raw = raw[: rng.randint(0, len(raw))]
    if rng.random() < 0.25:  # the file size lies too
        file_size = rng.choice(
            [rng.randint(0, len(raw) + data_nbytes + 64), file_size + rng.randint(-64, 64)]
        )
    component = rng.choice([None, "transformer"])
    return raw, max(0, file_size), component


def check(raw: bytes, file_size: int, component: str | None) -> None:
    try:
        header = parse_header(raw, file_size, PATH, component=component)
    except LoadError as error:
        assert PATH in str(error)
        if component is not None:
            assert f"component '{component}'" in str(error)
            assert error.component == component
        return
    assert header.data_start == 8 + struct.unpack("<Q", raw[:8])[0]
    regions = sorted((t for t in header.tensors.values() if t.nbytes), key=lambda t: t.start)
    for tensor in header.tensors.values():
        assert header.data_start <= tensor.start <= tensor.end <= file_size
        assert tensor.nbytes == math.prod(tensor.shape) * tensor.dtype.itemsize
    for previous, current in zip(regions, regions[1:], strict=False):
        assert previous.end <= current.start
    assert all(isinstance(v, str) for v in header.metadata.values())


def fuzz(tiny_template, data) -> None:
    seeds = seed_headers(str(tiny_template))
    check(*data.draw(header_cases(seeds)))


@settings(
    max_examples=300,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_mutated_real_headers_parse_or_raise_load_error(tiny_template, data):
    fuzz(tiny_template, data)


def test_the_unmutated_seed_headers_parse(tiny_template):
    for entries_in_order in seed_headers(str(tiny_template)):
        raw = serialise(dict(entries_in_order))
        data_nbytes = entries_in_order[-1][1]["data_offsets"][1]
        assert len(parse_header(raw, len(raw) + data_nbytes, PATH)) > 10


SOAK_EXAMPLES = 1_000_000


@pytest.mark.soak
@settings(
    max_examples=SOAK_EXAMPLES,
    deadline=None,
    database=None,
    phases=[Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data())
def test_a_million_mutated_headers_parse_or_raise_load_error(tiny_template, data):
    fuzz(tiny_template, data)

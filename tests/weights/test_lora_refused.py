"""LoRA files ondeck refuses, through ``--lora`` and ``loras=``, with one line that names
the file: a pickle checkpoint, and a LoRA no layer of which belongs to the pipeline."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from cli.helpers import FAST, run
from safetensors.torch import load_file, save_file

from ondeck.errors import LoadError

from .conftest import load

pytest.importorskip("peft")


def _ondeck_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("ondeck:")]


@pytest.fixture
def lora_for_another_model(tmp_path):
    """A LoRA of another pipeline's text encoder: no key of it names a layer the Wan
    pipeline loads LoRAs into, and diffusers takes nothing from it."""
    path = tmp_path / "sdxl_te_style.safetensors"
    save_file(
        {
            "text_encoder.zzz.lora_down.weight": torch.zeros(4, 8),
            "text_encoder.zzz.lora_up.weight": torch.zeros(8, 4),
        },
        str(path),
    )
    return path


def test_a_lora_with_no_layer_of_the_pipeline_is_refused_naming_the_file(
    capsys, base, lora_for_another_model, tmp_path
):
    out = tmp_path / "out"
    code, _, err = run(
        capsys, "generate", base, "--lora", lora_for_another_model, "--output", out, *FAST
    )
    assert code == 1, err
    (line,) = _ondeck_lines(err)
    assert str(lora_for_another_model) in line and "no layer of it" in line, line
    assert "Adapter name" not in line
    assert not (out / "report.json").exists()
    with pytest.raises(LoadError, match=r"sdxl_te_style\.safetensors: no layer of it"):
        load(base, "release", loras=[lora_for_another_model])


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".ckpt"])
def test_a_pickle_lora_is_refused_before_it_is_unpickled(
    capsys, base, lora_files, tmp_path, suffix, monkeypatch
):
    """As a pickle transformer file is: unpickling can run code."""
    lora = tmp_path / f"style{suffix}"
    torch.save(load_file(str(lora_files["diffusers"])), lora)
    unpickled = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: unpickled.append(a) or real_load(*a, **k))
    out = tmp_path / "out"
    code, _, err = run(capsys, "generate", base, "--lora", lora, "--output", out, *FAST)
    assert code == 1, "the pickle LoRA was taken and the run went on"
    (line,) = _ondeck_lines(err)
    assert lora.name in line and "pickle" in line
    assert not (out / "report.json").exists()
    with pytest.raises(LoadError, match=rf"style\{suffix}: a LoRA is a \.safetensors file"):
        load(base, "release", loras=[lora])
    assert not unpickled


def test_a_kohya_named_lora_of_no_known_layout_says_its_keys_are_not_one(base, tmp_path):
    """``lora_unet_`` names diffusers takes for musubi-tuner's Wan layout, without the
    ``blocks_N`` it indexes: its conversion fails with a bare IndexError, which the
    refusal explains."""
    path = tmp_path / "other_kohya.safetensors"
    save_file(
        {
            "lora_unet_double_layers_0_attn.lora_down.weight": torch.zeros(4, 8),
            "lora_unet_double_layers_0_attn.lora_up.weight": torch.zeros(8, 4),
        },
        str(path),
    )
    with pytest.raises(
        LoadError, match=r"other_kohya\.safetensors: .*IndexError.*not a LoRA layout"
    ):
        load(base, "release", loras=[path])


def test_a_lora_whose_name_has_dots_loads(base, lora_files, tmp_path, capsys):
    """Downloaded LoRAs are named ``Wan2.1_style_v1.0.safetensors``: the adapter name
    ondeck makes from the file's name holds no '.', which peft refuses in a module's name."""
    import numpy as np

    from .conftest import frames, reference_frames

    dotted = tmp_path / "Wan2.1_T2V_style.v1.0.safetensors"
    dotted.write_bytes(lora_files["diffusers"].read_bytes())
    pipe = load(base, "release", loras=[(dotted, 0.7)])
    assert np.array_equal(frames(pipe), reference_frames(base, loras=[(dotted, 0.7)]))
    code, _, err = run(
        capsys, "generate", base, "--lora", f"{dotted}:0.7", "--output", tmp_path / "o", *FAST
    )
    assert code == 0, err


@pytest.mark.parametrize(
    ("loras", "message"),
    [
        (lambda f: [(f, "abc")], r"lora_diffusers\.safetensors: its scale must be a finite number"),
        (lambda f: [(f, float("nan"))], r"its scale must be a finite number, got nan"),
        (lambda f: [(f, float("inf"))], r"its scale must be a finite number, got inf"),
        (lambda f: [(f, True)], r"its scale must be a finite number, got True"),
        (lambda f: str(f), r"not one path: write loras=\["),
        (lambda f: [(f, 1.0, 2.0)], r"neither a file nor a \(file, scale\) pair"),
        (lambda f: [3], r"neither a file nor a \(file, scale\) pair"),
    ],
)
def test_loras_given_in_python_are_checked_before_anything_is_built(
    base, lora_files, loras, message, monkeypatch
):
    """As ``--lora`` checks its scales: a scale that is not a finite number, one path for
    the list, an entry of another shape: a ValueError naming what is wrong, before the
    pipeline is built."""
    import ondeck.integrations.diffusers.loading as loading

    built = []
    monkeypatch.setattr(loading, "_built", lambda *a, **k: built.append(a))
    with pytest.raises(ValueError, match=message):
        load(base, "release", loras=loras(lora_files["diffusers"]))
    assert not built


def test_a_lora_scale_after_an_equals_sign_is_shown_the_colon(capsys, lora_files, base, tmp_path):
    file = lora_files["diffusers"]
    code, _, err = run(
        capsys, "generate", base, "--lora", f"{file}=0.8", "--output", tmp_path / "o", *FAST
    )
    assert code == 2
    assert f"a scale follows a ':' ({file}:0.8)" in err


def test_loras_given_as_a_mapping_take_their_scales(base, lora_files):
    """``loras={file: scale}`` is the pairs it maps, not its files at scale 1."""
    from ondeck.integrations.diffusers.loading import checked_loras

    file = lora_files["diffusers"]
    assert checked_loras({file: 0.3}) == checked_loras([(file, 0.3)]) == [(file, 0.3)]
    with pytest.raises(ValueError, match="its scale must be a finite number"):
        checked_loras({file: "strong"})


def test_one_lora_given_twice_is_refused_not_applied_twice(base, lora_files, capsys, tmp_path):
    from ondeck.integrations.diffusers.loading import checked_loras

    file = lora_files["diffusers"]
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(file.read_bytes())
    assert len(checked_loras([copy, file])) == 2  # two files of the same bytes: two LoRAs
    link = tmp_path / "link.safetensors"
    link.symlink_to(file)  # the same file by another name
    with pytest.raises(ValueError, match=rf"{link} is given twice \(as {file} too\); give"):
        checked_loras([file, (link, 0.5)])
    hard = tmp_path / "hard.safetensors"
    os.link(file, hard)  # the same file again, no link to follow
    with pytest.raises(ValueError, match=rf"{hard} is given twice \(as {file} too\)"):
        checked_loras([file, hard])
    code, _, err = run(
        capsys, "generate", base, "--lora", file, "--lora", f"{file}:0.5",
        "--output", tmp_path / "o", *FAST,
    )  # fmt: skip
    assert code == 2 and "argument --lora: LoRA " in err and "is given twice" in err
    assert not (tmp_path / "o").exists()


def test_a_lora_added_to_a_resident_transformer_is_counted_and_kept_in_the_budget(
    base, weights, tmp_path
):
    """A LoRA loaded between calls into a transformer the budget keeps resident: the
    plans count its layers at once (as a pipeline given it before loading does), and
    where they would take the pipeline over its budget the transformer is freed first;
    its next load holds the LoRA, within the budget, and gives diffusers' frames."""
    import numpy as np

    import ondeck

    from .conftest import frames, lora_state, reference_frames

    lora = tmp_path / "wide.safetensors"
    layers = lora_state(weights, rank=16)
    state = {
        f"transformer.{layer}.lora_{ab}.weight": tensor
        for layer, pair in layers.items()
        for ab, tensor in zip("AB", pair, strict=True)
    }
    save_file(state, str(lora))
    with_lora = load(base, "release")
    with_lora.load_lora_weights(str(lora), adapter_name="a")
    counted = with_lora.ondeck.plan().component_bytes["transformer"]

    roomy = load(base, "budget", budget="1GiB")
    frames(roomy)
    everything = roomy.ondeck.tracker.resident_bytes
    roomy.load_lora_weights(str(lora), adapter_name="a")
    assert ondeck.is_loaded(roomy.transformer), "room for it: kept"
    assert roomy.ondeck.plan().component_bytes["transformer"] == counted
    assert roomy.ondeck.tracker.resident["transformer"] == counted

    budget = int(everything * 1.2)  # everything stays, with room for activations
    assert roomy.ondeck.tracker.resident_bytes > budget, "the LoRA overruns it"
    tight = load(base, "budget", budget=budget)
    frames(tight)
    assert ondeck.is_loaded(tight.transformer)
    tight.load_lora_weights(str(lora), adapter_name="a")
    assert not ondeck.is_loaded(tight.transformer), "freed before the LoRA went on it"
    assert tight.ondeck.tracker.resident_bytes <= budget
    expected = reference_frames(base, loras=[(lora, 1.0)])
    assert np.array_equal(frames(tight), expected)
    assert tight.ondeck.tracker.peak_resident_bytes <= budget


def test_a_lora_for_wider_layers_is_one_error_line_not_the_librarys_log(
    capfd, base, weights, tmp_path
):
    """diffusers logs every mismatched tensor before it raises: a hundred lines ahead of
    the error. Those are held while the LoRA loads and dropped when it fails; the one
    error names the file and the mismatch."""
    from .conftest import lora_state

    wider = {
        f"transformer.{layer}.lora_{ab}.weight": torch.cat([tensor, tensor], dim=1 - index)
        for layer, pair in lora_state(weights).items()
        for index, (ab, tensor) in enumerate(zip("AB", pair, strict=True))
    }
    path = tmp_path / "wider.safetensors"
    save_file(wider, str(path))
    records: list[logging.LogRecord] = []
    collector = logging.Handler()
    collector.emit = records.append  # what reaches a handler of diffusers' logger
    logging.getLogger("diffusers").addHandler(collector)
    try:
        code, _, err = run(
            capfd, "generate", base, "--lora", path, "--output", tmp_path / "o", *FAST
        )
    finally:
        logging.getLogger("diffusers").removeHandler(collector)
    assert not [r for r in records if "unsuccessful" in r.getMessage()], "the log came out"
    assert code == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("ondeck: error:"), lines[:3]
    assert "wider.safetensors" in lines[0] and "size mismatch" in lines[0]
    assert len(lines) <= 2, lines


def test_held_logs_come_out_where_the_block_ends_well_and_not_where_it_raises():
    from ondeck.errors import held_logs

    records: list[str] = []
    collector = logging.Handler()
    collector.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("ondeck-test-library")
    logger.addHandler(collector)
    try:
        with held_logs("ondeck-test-library"):
            logger.warning("kept")
            assert records == [], "held meanwhile"
        assert records == ["kept"]
        with pytest.raises(ValueError), held_logs("ondeck-test-library"):
            logger.error("dropped")
            raise ValueError
        assert records == ["kept"]
        logger.warning("after")
        assert records == ["kept", "after"], "the handler is as it was"
    finally:
        logger.removeHandler(collector)


def test_a_truncated_lora_is_said_to_be_one(base, lora_files, tmp_path):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(lora_files["diffusers"].read_bytes()[:-100])
    with pytest.raises(LoadError, match=r"LoRA .*cut\.safetensors.*\(truncated download\?\)"):
        load(base, "release", loras=[cut])


def test_a_lora_named_sft_is_read_as_safetensors(base, lora_files, tmp_path):
    import numpy as np

    from .conftest import frames, reference_frames

    copy = tmp_path / "style.sft"
    copy.write_bytes(lora_files["diffusers"].read_bytes())
    expected = reference_frames(base, loras=[(lora_files["diffusers"], 0.5)])
    assert np.array_equal(frames(load(base, "release", loras=[(copy, 0.5)])), expected)

"""Activation profiles: measured once, known to later processes and to plans."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest

from ondeck.profiles import ActivationProfiles

SHAPE = {"height": 480, "width": 832, "frames": 33}


def test_recorded_peaks_survive_a_new_process_newest_first(tmp_path):
    path = tmp_path / "profiles.json"
    ActivationProfiles(path).record("wan", SHAPE, "Decode", 9 * 2**30)
    ActivationProfiles(path).record("wan", SHAPE, "Decode", 8 * 2**30)
    stages, note = ActivationProfiles(path).lookup("wan", SHAPE)
    # A stored value can go down: a peak measured once too high must not stay forever.
    assert stages == {"Decode": 8 * 2**30}
    assert note == "activations: measured at this shape"


def test_what_the_allocator_showed_only_grows_and_survives_a_new_process(tmp_path):
    path = tmp_path / "profiles.json"
    first, second = ActivationProfiles(path), ActivationProfiles(path)
    first.record("wan", SHAPE, "Denoise", 1000)
    for _ in range(2):  # two runs that kept retrying
        first.record_allocator("wan", SHAPE, "Denoise", retried=True, limit=False)
    # Another process, which read the file before, adds a limit and fewer runs.
    second.record_allocator("wan", SHAPE, "Denoise", retried=True, limit=True)
    second.record_allocator("wan", SHAPE, "Decode", retried=False, limit=False)  # not stored
    evidence = ActivationProfiles(path).allocator_evidence("wan", SHAPE)
    assert evidence.retried_runs == {"Denoise": 2} and evidence.limit == {"Denoise"}
    third = ActivationProfiles(path)  # a process after both: one run more
    third.record_allocator("wan", SHAPE, "Denoise", retried=True, limit=False)
    assert ActivationProfiles(path).allocator_evidence("wan", SHAPE).retried_runs["Denoise"] == 3
    assert evidence.beside({"Denoise": 1, "Encode": 3}) == {"Denoise": 2, "Encode": 3}
    # Only at that exact shape; the peaks beside it are kept as they were.
    assert not ActivationProfiles(path).allocator_evidence("wan", {**SHAPE, "frames": 66}).limit
    assert ActivationProfiles(path).lookup("wan", SHAPE)[0] == {"Denoise": 1000}
    document = json.loads(path.read_text())
    entry = document["models"]["wan"]["frames=33,height=480,width=832"]
    entry["allocator"] = {"Denoise": {"retried_runs": "many", "limit": True}, "Decode": [1]}
    path.write_text(json.dumps(document))
    # Damaged evidence is dropped with the warning damaged entries give, the peaks kept.
    with pytest.warns(UserWarning, match="ignored 2 damaged"):
        reread = ActivationProfiles(path)
    assert reread.allocator_evidence("wan", SHAPE).limit == frozenset()
    assert reread.lookup("wan", SHAPE)[0] == {"Denoise": 1000}


def test_the_turns_a_call_showed_survive_a_new_process_newest_first(tmp_path):
    path = tmp_path / "profiles.json"
    turns = [("Encode", ("Encode",)), ("Again", ("Again", "Encode")), ("Denoise", ("Denoise",))]
    first, second = ActivationProfiles(path), ActivationProfiles(path)
    first.record("wan", SHAPE, "Denoise", 1000)
    first.record_turns("wan", SHAPE, turns)
    assert ActivationProfiles(path).stored_turns("wan", SHAPE) == turns
    assert ActivationProfiles(path).stored_turns("wan", {**SHAPE, "frames": 66}) is None
    # Another process, which read the file before, writes a peak: the turns stay.
    second.record("wan", SHAPE, "Encode", 2000)
    assert ActivationProfiles(path).stored_turns("wan", SHAPE) == turns
    newer = [("Encode", ("Encode",)), ("Denoise", ("Denoise",)), ("Again", ("Again",))]
    second.record_turns("wan", SHAPE, newer)
    assert ActivationProfiles(path).stored_turns("wan", SHAPE) == newer
    assert ActivationProfiles(path).lookup("wan", SHAPE)[0] == {"Denoise": 1000, "Encode": 2000}
    # Damaged turns are dropped with the warning damaged entries give, the peaks kept.
    document = json.loads(path.read_text())
    entry = document["models"]["wan"]["frames=33,height=480,width=832"]
    entry["turns"] = [["Encode", ["Encode"]], ["Encode", ["Encode"]]]  # a name twice
    path.write_text(json.dumps(document))
    with pytest.warns(UserWarning, match="ignored 1 damaged"):
        reread = ActivationProfiles(path)
    assert reread.stored_turns("wan", SHAPE) is None
    assert reread.lookup("wan", SHAPE)[0] == {"Denoise": 1000, "Encode": 2000}


def test_other_shapes_are_extrapolated_and_say_so(tmp_path):
    profiles = ActivationProfiles(tmp_path / "profiles.json")
    profiles.record("wan", SHAPE, "Decode", 1000)
    stages, note = profiles.lookup("wan", {**SHAPE, "frames": 66})
    assert stages == {"Decode": 2000}
    assert "extrapolated" in note


def test_unknown_model_says_activations_are_unknown(tmp_path):
    stages, note = ActivationProfiles(tmp_path / "p.json").lookup("other", SHAPE)
    assert stages == {} and "unknown" in note


def test_damaged_profile_file_is_ignored(tmp_path):
    path = tmp_path / "profiles.json"
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="ignored"):
        assert ActivationProfiles(path).lookup("wan", SHAPE)[0] == {}


def _document(models) -> str:
    return json.dumps({"format": "ondeck-activation-profiles", "version": 2, "models": models})


def _entry(stages) -> dict:
    return {"frames=33,height=480,width=832": {"shape": SHAPE, "stages": stages}}


@pytest.mark.parametrize(
    "content",
    [
        b"[]",
        b"null",
        b"\xff\xfe not utf-8",
        b'{"wan": {"frames=33,height=480,width=832": {"shape": {}, "stages": {}}}}',  # v1
        _document({"wan": _entry({"Decode": "lots"})}).encode(),
        _document({"wan": _entry({"Decode": -5})}).encode(),
        _document({"wan": _entry({"Decode": 10**30})}).encode(),
        _document({"wan": _entry({"Decode": True})}).encode(),
        _document({"wan": "nonsense"}).encode(),
        _document({"wan": _entry({"Decode": 1.5})}).encode(),
        b'{"format": "ondeck-activation-profiles", "version": 2, "models": {"wan": {"frames=33,height=480,width=832": {"shape": {"height": 480, "width": 832, "frames": 33}, "stages": {"Decode": NaN}}}}}',
    ],
    ids=[
        "list",
        "null",
        "not-utf8",
        "old-format",
        "string",
        "negative",
        "huge",
        "bool",
        "model-not-object",
        "float",
        "nan",
    ],
)
def test_a_bad_profile_file_is_ignored_with_one_warning(tmp_path, content):
    path = tmp_path / "profiles.json"
    path.write_bytes(content)
    with pytest.warns(UserWarning, match=str(path)) as caught:
        profiles = ActivationProfiles(path)
        stages, _ = profiles.lookup("wan", SHAPE)
        profiles.lookup("wan", {**SHAPE, "frames": 17})  # nothing spreads by extrapolation
    assert stages == {}
    assert len([w for w in caught if "activation profiles" in str(w.message)]) == 1
    # The next write heals the file.
    profiles.record("wan", SHAPE, "Decode", 1000)
    assert ActivationProfiles(path).lookup("wan", SHAPE)[0] == {"Decode": 1000}


def test_good_entries_beside_bad_ones_are_kept(tmp_path):
    path = tmp_path / "profiles.json"
    path.write_text(_document({"wan": _entry({"Decode": 1000, "Denoise": -1})}))
    with pytest.warns(UserWarning, match="1 damaged"):
        stages, _ = ActivationProfiles(path).lookup("wan", SHAPE)
    assert stages == {"Decode": 1000}


def test_values_that_are_not_finite_are_dropped_and_the_good_ones_kept(tmp_path):
    # NaN and Infinity are not JSON; they cost their entries, not the whole file.
    path = tmp_path / "profiles.json"
    text = _document({"wan": _entry({"Decode": 1000, "Denoise": 1, "EncodePrompt": 2})})
    path.write_text(text.replace(": 1,", ": NaN,").replace(": 2}", ": -Infinity}"))
    assert "NaN" in path.read_text() and "-Infinity" in path.read_text()
    with pytest.warns(UserWarning, match="ignored 2 damaged or implausible entries"):
        stages, _ = ActivationProfiles(path).lookup("wan", SHAPE)
    assert stages == {"Decode": 1000}


def test_implausible_measurements_are_not_stored(tmp_path):
    path = tmp_path / "profiles.json"
    profiles = ActivationProfiles(path)
    profiles.record("wan", SHAPE, "Decode", -1)
    profiles.record("wan", SHAPE, "Decode", 10**30)
    assert not path.exists()


def _record_many(path: str, stage: str) -> None:
    for value in range(1, 21):
        ActivationProfiles(path).record("wan", {**SHAPE, "frames": value}, stage, value)


def test_concurrent_writers_keep_each_others_entries(tmp_path):
    path = str(tmp_path / "profiles.json")
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_record_many, args=(path, f"S{i}")) for i in range(3)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(120)
        assert writer.exitcode == 0
    profiles = ActivationProfiles(path)
    for value in range(1, 21):
        stages, _ = profiles.lookup("wan", {**SHAPE, "frames": value})
        assert stages == {"S0": value, "S1": value, "S2": value}
    leftovers = [
        name for name in os.listdir(tmp_path) if name not in ("profiles.json", "profiles.json.lock")
    ]
    assert leftovers == []


def test_clear_deletes_the_file(tmp_path):
    path = tmp_path / "profiles.json"
    profiles = ActivationProfiles(path)
    profiles.record("wan", SHAPE, "Decode", 1000)
    assert profiles.clear() and not path.exists()
    assert ActivationProfiles(path).lookup("wan", SHAPE)[0] == {}


# -- profiles as a pipeline uses them ------------------------------------------------

ONE = 1 << 20


def _profiled_pipeline(monkeypatch, tmp_path, stage_forward=None, **options):
    import torch

    import ondeck

    from .helpers import CountingLoader, ProfiledThreeStages, use_profiles

    store = use_profiles(monkeypatch, tmp_path / "profiles.json")

    class Profiled(ProfiledThreeStages):
        def create_stages(self):
            stages = super().create_stages()
            if stage_forward is not None:
                stages[0] = stage_forward(self.components["encoder"])
            return stages

    components = {
        name: ondeck.LazyModule(
            name, CountingLoader(32), spec=ondeck.ComponentSpec(cls=torch.nn.Linear, nbytes=ONE)
        )
        for name in ("encoder", "denoiser", "decoder")
    }
    pipe = Profiled(components, **options)
    _measure_on_any_device(monkeypatch, pipe)
    return pipe, store


def _measure_on_any_device(monkeypatch, pipe, activation_bytes: int = 1000) -> None:
    """The CPU has no device peak to measure: hand the pipeline what a CUDA run would."""
    import dataclasses

    measured = pipe._stage_measured

    def with_activations(index, record):
        measured(index, dataclasses.replace(record, activation_bytes=activation_bytes))

    monkeypatch.setattr(pipe, "_stage_measured", with_activations)


def test_a_stage_that_runs_out_of_memory_records_nothing(monkeypatch, tmp_path):
    import torch

    from .helpers import Apply

    class OutOfMemory(Apply):
        def __init__(self, component):
            super().__init__(component, "Encode")

        def forward(self, state):
            self.component(state["x"])
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    pipe, store = _profiled_pipeline(
        monkeypatch, tmp_path, OutOfMemory, policy="budget", budget=8 * ONE
    )
    _measure_on_any_device(monkeypatch, pipe, activation_bytes=7 * ONE)  # all it grabbed
    before = device_lines(pipe.plan())
    with pytest.raises(torch.OutOfMemoryError):
        pipe({"x": torch.ones(2, 32)})
    assert not (tmp_path / "profiles.json").exists()
    # A new process plans exactly as before the failure.
    fresh = ActivationProfiles(tmp_path / "profiles.json")
    assert fresh.lookup("three", {"width": 32})[0] == {}
    monkeypatch.setattr("ondeck.profiles._default", fresh)
    pipe, _ = _profiled_pipeline(monkeypatch, tmp_path, policy="budget", budget=8 * ONE)
    assert device_lines(pipe.plan()) == before


def test_a_stored_peak_that_would_refuse_the_run_is_measured_again(monkeypatch, tmp_path):
    import torch

    pipe, store = _profiled_pipeline(monkeypatch, tmp_path, policy="budget", budget=8 * ONE)
    # As a failed run of an older version could have left: more than the whole budget.
    store.record("three", {"width": 32}, "Encode", 64 * ONE)
    with pytest.warns(UserWarning, match="set aside in this run"):
        pipe({"x": torch.ones(2, 32)})
    stages, _ = store.lookup("three", {"width": 32})
    assert stages == {"Encode": 1000, "Denoise": 1000, "Decode": 1000}


def device_lines(plan) -> list[str]:
    """The plan's text but its host lines, which read the process's changing RSS."""
    return [line for line in str(plan).splitlines() if not line.startswith("host:")]

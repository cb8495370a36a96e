"""Activation profiles: measured once, known to later processes and to plans."""

from __future__ import annotations

from ondeck.profiles import ActivationProfiles

SHAPE = {"height": 480, "width": 832, "frames": 33}


def test_recorded_peaks_survive_a_new_process(tmp_path):
    path = tmp_path / "profiles.json"
    ActivationProfiles(path).record("wan", SHAPE, "Decode", 9 * 2**30)
    ActivationProfiles(path).record("wan", SHAPE, "Decode", 8 * 2**30)
    stages, note = ActivationProfiles(path).lookup("wan", SHAPE)
    assert stages == {"Decode": 9 * 2**30}
    assert note == "activations: measured at this shape"


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
    assert ActivationProfiles(path).lookup("wan", SHAPE)[0] == {}

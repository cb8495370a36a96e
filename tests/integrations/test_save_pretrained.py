"""``pipe.save_pretrained`` on the diffusers path: the folder it writes is diffusers' own,
and it loads one component at a time, leaving loaded only what was loaded before."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

import ondeck.diffusers

from .breadth_pipelines import ALL_FAMILIES
from .tiny_pipelines import run


class Resident:
    """The most component bytes resident together while it watches."""

    def __init__(self, runtime):
        self.runtime, self.most = runtime, 0

    def before_load(self, proxy):
        pass

    def after_load(self, proxy, nbytes, seconds):
        self.most = max(self.most, self.runtime.tracker.resident_bytes)

    def after_release(self, proxy, nbytes):
        pass


def _tensors(folder):
    return {
        f"{path.parent.name}/{key}": tensor
        for path in sorted(folder.glob("*/*.safetensors"))
        for key, tensor in load_file(path).items()
    }


def test_a_save_writes_the_weights_it_read_one_component_at_a_time(folders, tmp_path):
    family = ALL_FAMILIES["sd3"]
    pipe = ondeck.diffusers.from_pretrained(folders["sd3"], policy="release")
    pipe.set_progress_bar_config(disable=True)
    run(pipe, family)
    watch = Resident(pipe.ondeck)
    for proxy in pipe.ondeck.deferred.values():
        proxy.add_observer(watch)

    pipe.save_pretrained(tmp_path / "saved")

    assert not pipe.ondeck.tracker.resident
    assert 0 < watch.most <= max(pipe.ondeck.component_bytes().values())
    written, read = _tensors(tmp_path / "saved"), _tensors(folders["sd3"])
    assert written.keys() == read.keys() and len(written) > 20
    assert all(torch.equal(written[key], read[key]) for key in read)
    assert (tmp_path / "saved" / "model_index.json").is_file()


def test_what_was_loaded_before_a_save_stays_loaded(folders, tmp_path):
    pipe = ondeck.diffusers.from_pretrained(folders["sd3"], policy="release")
    pipe.vae.encoder  # a submodule: the VAE loads
    assert set(pipe.ondeck.tracker.resident) == {"vae"}

    pipe.save_pretrained(tmp_path / "saved")

    assert set(pipe.ondeck.tracker.resident) == {"vae"}


def test_a_load_from_another_thread_during_a_save_releases_nothing_the_save_holds(
    folders, tmp_path, monkeypatch
):
    """Only the save's own loads release the save's earlier ones: a load made meanwhile
    on another thread (the next call's encoders loading ahead) leaves the component being
    written loaded."""
    import threading

    import diffusers.models.modeling_utils as modeling

    from ondeck.lazy import is_loaded

    pipe = ondeck.diffusers.from_pretrained(folders["sd3"], policy="release")
    real, seen = modeling.safetensors.torch.save_file, {}

    def save_file(tensors, *args, **kwargs):
        if not seen:
            saving = {name for name, p in pipe.ondeck.deferred.items() if is_loaded(p)}
            loading = threading.Thread(target=lambda: pipe.text_encoder.text_model)
            loading.start()
            loading.join()
            loaded = {name for name, p in pipe.ondeck.deferred.items() if is_loaded(p)}
            seen.update(saving=saving, loaded=loaded)
        return real(tensors, *args, **kwargs)

    monkeypatch.setattr(modeling.safetensors.torch, "save_file", save_file)
    pipe.save_pretrained(tmp_path / "saved")

    assert seen["saving"] and "text_encoder" not in seen["saving"], seen
    assert seen["loaded"] == seen["saving"] | {"text_encoder"}, seen

"""The residency manager over real tiny pipelines, without HTTP: which components go
when the queue is empty, what loads ahead beside a running job, and the plan."""

from __future__ import annotations

import pytest

from ondeck.memory import format_bytes
from ondeck.serve.server import ServeConfig, Server

WAN = 132736 + 101152 + 283212  # text encoder, transformer, VAE
SD3 = 1608380
KIB = 1024


def served(models, budget: int, names=("wan", "wan2", "sd3")) -> Server:
    return Server(
        ServeConfig(models={n: str(models[n]) for n in names}, device="cpu", budget_bytes=budget),
        say=lambda *_: None,
    )


def run(server: Server, name: str, upcoming=(), progress=None, prompt="a fox") -> None:
    server.manager.prepare(name, list(upcoming))
    size = {"height": 32, "width": 32}
    if server.models[name].kind == "video":
        size["num_frames"] = 5
    server.models[name].pipeline.generate(
        prompt, num_inference_steps=2, seed=0, progress=progress, **size
    )
    server.manager.finished(name)


@pytest.fixture(scope="module")
def under_1800k(models):
    return served(models, 1800 * KIB)


def test_with_an_empty_queue_the_least_recently_used_model_goes_first(under_1800k):
    server = under_1800k
    run(server, "wan")
    run(server, "wan2")
    assert server.manager.resident_bytes() == 2 * WAN
    evicted = server.manager.prepare("sd3", [])
    assert [(e.model, e.component) for e in evicted] == [
        ("wan", "vae"),
        ("wan", "transformer"),
        ("wan", "text_encoder"),
        ("wan2", "vae"),
    ]
    assert all("no waiting job" in e.reason for e in evicted)
    assert server.manager.resident_bytes(excluding="sd3") + SD3 <= server.budget_bytes
    # The image model's own policy plans within what the others left.
    assert server.models["sd3"].policy.budget_bytes == server.budget_bytes - (WAN - 283212)


def test_the_next_jobs_first_components_load_while_the_current_one_decodes(models):
    server = served(models, 1900 * KIB, names=("wan", "sd3"))
    started: list[list[str]] = []

    class LastStep:
        steps = 0

        def update(self, n: int = 1) -> None:
            self.steps += n
            if self.steps == 2:
                started.append(server.manager.prefetch_ahead("sd3", "wan"))

    run(server, "sd3", progress=LastStep())
    server.manager.wait_for_prefetch()
    # The image model (1.53 MiB) and its decode's reserve leave about 265 KiB: the video
    # model's text encoder and transformer fit beside the decode, its VAE does not.
    assert started == [["text_encoder", "transformer"]]
    assert set(server.manager.resident()["wan"]) == {"text_encoder", "transformer"}
    assert server.manager.resident_bytes() <= server.budget_bytes
    assert server.manager.prefetched[-1]["beside"] == "sd3"


def test_nothing_loads_ahead_when_it_would_not_fit(models):
    server = served(models, 1700 * KIB, names=("wan", "sd3"))
    started: list[list[str]] = []

    class LastStep:
        def update(self, n: int = 1) -> None:
            started.append(server.manager.prefetch_ahead("sd3", "wan"))

    run(server, "sd3", progress=LastStep())
    server.manager.wait_for_prefetch()
    assert started[-1] == []
    assert server.manager.resident()["wan"] == {}


def loaded_by_last_run(server: Server, name: str) -> int:
    report = server.models[name].pipeline.report()
    return sum(
        event["nbytes"]
        for event in report["events"]
        if event["run"] == report["runs"] and event["kind"] == "load"
    )


@pytest.mark.parametrize("kib", [1400, 1600, 1800, 2000])
def test_each_switch_loads_what_the_plan_for_the_set_says(models, kib):
    """Jobs of a video and an image model alternate, each with a new prompt (a cached
    one needs no text encoder). Once each model has run twice (its activations measured,
    its negative prompt's encodings kept, so its encoders' calls a run are what they
    stay), every switch loads the bytes the set's plan predicted for it, exactly."""
    server = served(models, kib * KIB, names=("wan", "sd3"))
    for take in ("first", "second"):
        run(server, "wan", prompt=f"{take}: a heron")
        run(server, "sd3", prompt=f"{take}: a heron")
    for turn, name in enumerate(["wan", "sd3", "wan", "sd3"]):
        previous = "sd3" if name == "wan" else "wan"
        predicted = server.manager.plan().switch_bytes[(previous, name)]
        # A new prompt in words: the tiny CLIP tokenizer knows letters, not digits, and
        # would give "take 1" and "take 3" the same tokens (and the same encodings).
        run(server, name, prompt=f"take {('one', 'two', 'three', 'four')[turn]}: a fox")
        assert loaded_by_last_run(server, name) == predicted, (previous, name)
        assert server.manager.resident_bytes() <= server.budget_bytes


def test_the_plan_for_a_set_says_what_stays_and_what_a_switch_loads(models):
    tight = served(models, 1800 * KIB).manager.plan()
    assert not tight.all_resident
    assert 0 < tight.switch_bytes[("wan", "sd3")] <= SD3
    assert tight.switch_bytes[("wan", "wan2")] == 0  # two video models fit together
    assert "a switch loads" in str(tight)
    # At 1400 KiB the video model's kept set cannot stay beside the image model's job:
    # the switch back loads all of it.
    narrow = served(models, 1400 * KIB, names=("wan", "sd3")).manager.plan()
    assert narrow.switch_bytes[("sd3", "wan")] == WAN
    roomy = served(models, 8 * 2**20).manager.plan()
    assert roomy.all_resident and set(roomy.switch_bytes.values()) == {0}
    assert "every model stays resident" in str(roomy)


def test_serve_plan_prints_the_plan_for_the_set_and_exits(models, capsys):
    from ondeck.cli import main

    code = main(
        ["serve", "--model", f"wan={models['wan']}", "--model", f"sd3={models['sd3']}"]
        + ["--device", "cpu", "--budget", "1800KiB", "--plan"]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "one budget of 1.76 MiB for 2 models" in printed
    assert switch_lines(models, 1800 * KIB)[0] in printed


def test_serve_freezes_what_it_built_before_it_listens(models, monkeypatch, capsys):
    """The server owns its process and its models live as long as it: what is alive once
    they are built is kept out of the garbage collector's later passes, which otherwise
    rescan it during some job."""
    import gc

    import uvicorn

    from ondeck.cli import main

    frozen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: frozen.append(gc.get_freeze_count()))
    gc.unfreeze()
    try:
        code = main(
            ["serve", "--model", f"wan={models['wan']}", "--device", "cpu", "--budget", "1800KiB"]
        )
    finally:
        gc.unfreeze()  # this test process's objects go back to the collector
    assert code == 0, capsys.readouterr().err
    assert len(frozen) == 1 and frozen[0] > 10_000


def switch_lines(models, budget: int) -> list[str]:
    """The plan's switch lines as a server of the two models states them."""
    plan = served(models, budget, names=("wan", "sd3")).manager.plan()
    return [line for line in str(plan).splitlines() if "->" in line]


def test_ondeck_plan_of_several_models_answers_for_the_set(models, capsys):
    from ondeck.cli import main

    code = main(
        ["plan", str(models["wan"]), str(models["sd3"]), "--device", "cpu", "--budget", "1800KiB"]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "one budget of 1.76 MiB for 2 models" in printed
    assert all(line in printed for line in switch_lines(models, 1800 * KIB))


def test_a_model_of_the_set_that_does_not_fit_names_its_stage(models, capsys):
    from ondeck.cli import main

    budget = ["--device", "cpu", "--budget", "1MiB"]
    assert main(["plan", str(models["wan"]), str(models["sd3"]), *budget]) == 1  # one left out
    printed = capsys.readouterr().out
    plan = served(models, 1024 * KIB, names=("wan", "sd3")).manager.plan()
    refused = [name for name, model in plan.models.items() if not model.fits]
    assert refused, "the budget leaves one out"
    for name in refused:
        stage, over = plan.models[name].overflow
        assert f"  {name}: its stage '{stage}' needs {format_bytes(over)} more" in printed


def test_model_root_serves_each_model_folder_by_its_name(models, tmp_path):
    from ondeck.serve.server import models_from_root

    for name in ("wan", "sd3"):
        (tmp_path / name).symlink_to(models[name], target_is_directory=True)
    (tmp_path / "notes").mkdir()  # no model_index.json: not a model
    assert models_from_root(tmp_path) == {
        "sd3": str(tmp_path / "sd3"),
        "wan": str(tmp_path / "wan"),
    }


def test_a_wrong_serve_argument_is_one_line_and_status_2(capsys):
    from ondeck.cli import main

    assert main(["serve", "--model", "no-equals-sign"]) == 2
    error = capsys.readouterr().err
    assert "expected NAME=FOLDER_OR_REPO_ID" in error and len(error.strip().splitlines()) == 1


def test_a_model_evicted_for_another_comes_back_from_an_elastic_cache(models, monkeypatch):
    """``--host-cache auto``: each model fits alone, so its own plan keeps it on the
    device, yet the server evicts it for the other; its next job loads it from the
    cache, not the files."""
    from ondeck.lazy import loader_of
    from ondeck.loading import HostCache

    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    config = ServeConfig(
        models={n: str(models[n]) for n in ("wan", "wan2")},
        device="cpu",
        budget_bytes=WAN + 100 * KIB,
        host_cache_bytes="auto",
    )
    server = Server(config, say=lambda *_: None)
    assert server.host_cache.elastic
    for name, prompt in (("wan", "a fox"), ("wan2", "a fox"), ("wan", "a cat")):
        run(server, name, prompt=prompt)  # a new prompt: its text encoder loads again

    evicted = {e.component for e in server.manager.evictions if e.model == "wan"}
    assert evicted
    pipeline = server.models["wan"].pipeline
    sources = {name: loader_of(pipeline.deferred[name]).last_source for name in evicted}
    assert set(sources.values()) == {"host cache"}, sources

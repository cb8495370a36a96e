"""A decode ondeck tiles to fit is diffusers' own tiled decode at the tiles ondeck chose:
the frame size asked for, tiles really smaller than the frame, the output diffusers'
tiled decode gives with the same settings; and a decode no tiles can fit is refused
before anything loads. The pipelines' VAEs compress 8x per side, as real ones do."""

from __future__ import annotations

import pytest
import torch

import ondeck.diffusers
from ondeck.errors import BudgetError
from ondeck.integrations.diffusers import DiffusersRuntime
from ondeck.tiles import smallest_tiles

MIB = 2**20


def _flux_with_an_8x_vae(path):
    from integrations.tiny_pipelines import _image_vae, build_flux

    build_flux(path, vae=_image_vae(latent_channels=1, levels=4))
    return path


@pytest.fixture(scope="module")
def flux8(tmp_path_factory):
    return _flux_with_an_8x_vae(tmp_path_factory.mktemp("flux8") / "flux")


@pytest.fixture(scope="module")
def cogvideox(tmp_path_factory):
    from integrations.tiny_pipelines import build_cogvideox

    path = tmp_path_factory.mktemp("cog") / "cogvideox"
    build_cogvideox(path)  # its VAE has four levels: 8x per side
    return path


CALL = dict(prompt="a fox", num_inference_steps=2, output_type="np", max_sequence_length=16)


def load(folder):
    pipe = ondeck.diffusers.from_pretrained(folder, device="cpu", policy="release", progress=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def room_for(monkeypatch, pipe, arguments, ratio):
    """The room the decode is told of: its whole-frame need over ``ratio``."""
    need = pipe.ondeck.decoders["vae"].expected_need(arguments)
    monkeypatch.setattr(DiffusersRuntime, "activation_room", lambda self: int(need / ratio))


def test_a_tiled_autoencoderkl_decode_returns_the_frame_size_asked_for(flux8, monkeypatch):
    """Flux (AutoencoderKL, 8x per side) at 64x96 with a decode needing 5% more than its
    room: the image comes back 64x96. The VAE steps int(side * 0.75) latent pixels and
    keeps side - int(side * 0.25) pixels of each tile; ondeck's square tiles have a side
    of a multiple of 4 latent pixels, where the two agree (a side of 9 gave 70x102)."""
    pipe = load(flux8)
    arguments = dict(CALL, height=64, width=96)
    room_for(monkeypatch, pipe, arguments, 1.05)
    images = pipe(**arguments, generator=torch.Generator().manual_seed(0)).images
    assert pipe.ondeck.decoders["vae"].last_tiles is not None, "the decode tiled"
    assert images.shape == (1, 64, 96, 3)


def test_a_tiled_autoencoderkl_decode_decodes_in_pieces_smaller_than_the_frame(flux8, monkeypatch):
    """A square 64x64 image whose decode needs 20% more than its room decodes in tiles
    smaller than the frame: a square tile as large as the frame's longer side would
    make the VAE decode whole frames, the memory the tiles were chosen to avoid."""
    from diffusers.models.autoencoders.vae import Decoder

    largest = []
    forward = Decoder.forward

    def watched(self, sample, *args, **kwargs):
        largest.append(tuple(sample.shape[-2:]))
        return forward(self, sample, *args, **kwargs)

    monkeypatch.setattr(Decoder, "forward", watched)
    pipe = load(flux8)
    arguments = dict(CALL, height=64, width=64)
    room_for(monkeypatch, pipe, arguments, 1.2)
    pipe(**arguments, generator=torch.Generator().manual_seed(0))
    tiles = pipe.ondeck.decoders["vae"].last_tiles
    assert tiles is not None and tiles.count > 1, "ondeck planned tiles"
    assert max(h * w for h, w in largest) < 8 * 8, (
        f"ondeck planned {tiles}, the decoder ran on latents of {max(largest)}: whole frames"
    )


@pytest.mark.parametrize(
    ("height", "width", "ratio"),
    [(240, 240, 1.05), (64, 96, 1.4), (64, 96, 4.25)],
)
def test_a_tiled_cogvideox_decode_returns_the_frame_size_asked_for(
    cogvideox, monkeypatch, height, width, ratio
):
    """CogVideoX's VAE takes overlap factors and reads its strides back through ``int()``
    (and a factor of 0 as its default): ondeck gives it a quarter's overlap on sides of a
    multiple of 4 latent pixels, where that round trip is exact, and a side left whole a
    tile whose kept three quarters cover it. The frame comes back at its size (it came
    back 256 wide for 240, 70 high for 64, or failed inside diffusers)."""
    pipe = load(cogvideox)
    arguments = {"height": height, "width": width, "num_frames": 1}
    room_for(monkeypatch, pipe, arguments, ratio)
    latents = torch.randn(
        1, 4, 1, height // 8, width // 8, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        frames = pipe.vae.decode(latents).sample
    assert pipe.ondeck.decoders["vae"].last_tiles is not None, "the decode tiled"
    assert tuple(frames.shape) == (1, 3, 1, height, width)


def test_a_decode_whose_finest_tiles_cannot_fit_is_refused_before_anything_loads(
    flux8, monkeypatch
):
    """A decode that needs 20x the room its turn has (set as measured, as
    test_fitting_decode.py does): even the finest tiles the VAE decodes in need more
    than that room, so the plan overflows and the call is refused with a BudgetError
    before anything loads (the plan used to count the decode at 85% of its room whatever
    the need, and the call failed in the decode after denoising). The device is
    simulated: the VAE's decode runs out of memory when its tile's share of the need is
    more than the room."""
    pipe = ondeck.diffusers.from_pretrained(
        flux8, device="cpu", policy="budget", budget="64MiB", prefetch=False, progress=False
    )
    pipe.set_progress_bar_config(disable=True)
    runtime = pipe.ondeck
    decoder = runtime.decoders["vae"]
    elements = 64 * 64
    room = 64 * MIB - runtime.component_bytes()["vae"]
    decoder.bytes_per_element = 20 * room / elements  # whole frames: 20x the room
    need = int(decoder.bytes_per_element * elements)
    finest = smallest_tiles(64, 64, scale=8)
    assert need * finest.area > room, "not even the finest tiles fit"

    def simulated_device(vae):
        decode = vae.decode

        def deciding(z, *args, **kwargs):
            share = 1.0
            if getattr(vae, "use_tiling", False):
                side = vae.tile_latent_min_size
                share = (
                    min(side, z.shape[-2]) * min(side, z.shape[-1]) / (z.shape[-2] * z.shape[-1])
                )
            if share * need > runtime.activation_room():
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return decode(z, *args, **kwargs)

        vae.decode = deciding
        return vae

    runtime.add_transform("vae", simulated_device)
    with pytest.raises(BudgetError, match="vae"):
        pipe(**CALL, height=64, width=64, generator=torch.Generator().manual_seed(0))
    loads = [event.name for event in runtime.tracker.events if event.kind == "load"]
    assert loads == [], "refused before anything loaded"


def test_the_tiled_decode_is_diffusers_own_at_the_same_tile_settings(flux8, monkeypatch):
    """The image ondeck decodes in tiles equals the one the same VAE, loaded by plain
    diffusers, decodes with enable_tiling() at the tile settings ondeck used."""
    from diffusers import AutoencoderKL

    pipe = load(flux8)
    arguments = dict(CALL, height=64, width=96)
    room_for(monkeypatch, pipe, arguments, 1.3)
    latents = torch.randn(1, 1, 8, 12, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = pipe.vae.decode(latents).sample
    tiles = pipe.ondeck.decoders["vae"].last_tiles
    assert tiles is not None and tiles.count > 1
    plain = AutoencoderKL.from_pretrained(flux8 / "vae").eval()
    plain.tile_sample_min_size = tiles.height
    plain.tile_latent_min_size = tiles.height // 8
    plain.tile_overlap_factor = 0.25
    plain.enable_tiling()
    with torch.no_grad():
        theirs = plain.decode(latents).sample
    assert ours.shape == theirs.shape == (1, 3, 64, 96)
    torch.testing.assert_close(ours, theirs)
    assert not pipe.vae.materialize().use_tiling, "the VAE's own settings are put back"

"""What a pipeline makes and takes, as the command line needs to know: a video (at
which frame rate) or images, and whether it takes or needs an input image. Read from
the pipeline's class, call signature and configs; nothing loads."""

from __future__ import annotations

import inspect
import math
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .options import UsageError

# Used when neither the pipeline nor its configs say: what Wan's pipelines export at.
FALLBACK_FPS = 16.0
# An input image is decoded whole before the pipeline resizes it: 64 Mpixels (192 MiB
# of RGB) is far past any model's input and bounds what a small file can unpack to.
MAX_INPUT_PIXELS = 1 << 26
# Pipelines that cannot run without an input image even where their ``image`` argument
# defaults to None (the default is there only for the argument order).
_NEEDS_IMAGE = re.compile(r"ImageToVideo|Image2Video|I2V|Img2Img|Inpaint|ControlNet|Edit")


@dataclass(frozen=True)
class Media:
    """What ``generate`` writes, and takes, for one pipeline."""

    pipeline_class: str
    video: bool
    fps: float
    fps_from: str
    takes_image: bool
    needs_image: bool
    takes_count: bool  # num_images_per_prompt
    default_frames: int | None = None  # the call's own default frame count
    frames_argument: str | None = None  # the call's name for it (num_frames, video_length)
    image_argument: str | None = None  # the call's name for the input image
    # The call's own defaults, where its signature gives a number; None where the call
    # computes its own (an image pipeline's size from its sample size and VAE scale).
    default_height: int | None = None
    default_width: int | None = None
    default_steps: int | None = None
    # The call caps the output's area and sets its size from it (Flux Kontext's
    # ``max_area``, a megapixel by default, which overrides a size asked for).
    takes_max_area: bool = False
    # The call's ``true_cfg_scale`` default (Flux's 1.0: a negative prompt unused), None
    # where it takes none; and whether the transformer embeds guidance (False: a Flux
    # built without it, as FLUX.1 [schnell], ignores ``guidance_scale``), None unknown.
    true_cfg_default: float | None = None
    guidance_embedded: bool | None = None
    # A second input the call needs that no flag gives (an inpainting pipeline's
    # ``mask_image``, a ControlNet img2img pipeline's ``control_image``).
    other_input: str | None = None

    def image_arguments(self, image: Any) -> dict[str, Any]:
        """The call's argument for the input ``image`` (none where there is none)."""
        return {} if image is None else {self.image_argument or "image": image}


def media_of(path: Path) -> Media:
    """For the model folder at ``path``, from its model_index.json and configs alone
    (before anything is built): ondeck's Wan stages are documented by diffusers'
    WanPipeline, any other folder by its pipeline class."""
    from ..arguments import frame_count_argument, input_image_argument
    from ..errors import LoadError
    from ..loading import ModelFolder
    from ..pipelines.wan import is_wan_folder

    folder = ModelFolder.open(path)
    index = folder.model_index
    name = "WanPipeline" if is_wan_folder(index) else index.get("_class_name")
    if name is None:
        raise LoadError(
            f"{path}: its model_index.json has no _class_name (the pipeline class to run)",
            path=path,
        )
    cls = _diffusers_class(str(name))
    if cls is None:
        raise LoadError(
            f"{path}: its model_index.json names {name!r}, which is not a diffusers pipeline "
            f"in diffusers {_diffusers_version()}",
            path=path,
        )
    parameters = _parameters(cls)
    configs = [index] + [_config_of(folder, part) for part in ("transformer", "unet")]
    frames_argument = frame_count_argument(parameters)
    video = frames_argument is not None
    fps, source = model_fps(cls, parameters, configs) if video else (0.0, "")
    image_argument = input_image_argument(parameters) if name != "WanPipeline" else None
    takes_image = image_argument is not None
    needs = takes_image and (
        parameters[image_argument].default is inspect.Parameter.empty
        or bool(_NEEDS_IMAGE.search(name))
    )
    count = "num_images_per_prompt" in parameters
    return Media(
        name, video, fps, source, takes_image, needs, count,
        _whole_default(parameters, frames_argument), frames_argument, image_argument,
        _whole_default(parameters, "height"), _whole_default(parameters, "width"),
        _whole_default(parameters, "num_inference_steps"), "max_area" in parameters,
        _number_default(parameters, "true_cfg_scale"), _guidance_embedded(configs[1]),
        _other_input(name, parameters, image_argument),
    )  # fmt: skip


def _other_input(name: str, parameters: dict, image_argument: str | None) -> str | None:
    """The input besides ``--image``'s that the call cannot do without."""
    if "mask_image" in parameters and re.search(r"Inpaint|Fill", name):
        return "mask_image"
    if image_argument == "image" and "control_image" in parameters:
        return "control_image"
    return None


def _number_default(parameters: dict, name: str) -> float | None:
    default = getattr(parameters.get(name), "default", None)
    return float(default) if _is_rate(default) or default == 0 else None


def _guidance_embedded(config: Any) -> bool | None:
    value = _get(config, "guidance_embeds")
    return value if isinstance(value, bool) else None


def _whole_default(parameters: dict, name: str | None) -> int | None:
    default = getattr(parameters.get(name or ""), "default", None)
    return default if isinstance(default, int) and not isinstance(default, bool) else None


def _diffusers_version() -> str:
    try:
        import diffusers

        return diffusers.__version__
    except ImportError:
        return "(not installed)"


def _config_of(folder: Any, part: str) -> dict | None:
    from ..errors import LoadError

    if part not in folder.component_names:
        return None
    try:
        return folder.config_dict(part)
    except LoadError:
        return None  # building the pipeline reports it


def model_fps(cls: type | None, parameters: dict, configs: list[Any]) -> tuple[float, str]:
    """The frame rate the model makes, and where it was read: the call's own frame-rate
    argument (the rate LTX conditions on), a config field, else the rate the pipeline's
    documented example exports at."""
    for name in ("frame_rate", "fps"):
        default = getattr(parameters.get(name), "default", None)
        if _is_rate(default):
            return float(default), f"{cls.__name__}'s {name} argument"
    for config in configs:
        for name in ("fps", "frame_rate", "sample_fps"):
            value = _get(config, name)
            if _is_rate(value):
                return float(value), f"the config's {name}"
    documented = _documented_fps(cls)
    if documented is not None:
        return documented, f"{cls.__name__}'s documented example (export_to_video fps=)"
    return FALLBACK_FPS, "ondeck's default (the pipeline documents no frame rate)"


def _documented_fps(cls: type | None) -> float | None:
    module = sys.modules.get(cls.__module__) if cls is not None else None
    text = getattr(module, "EXAMPLE_DOC_STRING", None) or (
        cls.__call__.__doc__ or "" if cls else ""
    )
    found = re.search(r"export_to_video\([^)]*?fps\s*=\s*(\d+(?:\.\d+)?)", text or "", re.S)
    return float(found.group(1)) if found else None


def _is_rate(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= 1000
    )


def _get(config: Any, name: str) -> Any:
    if config is None:
        return None
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def _parameters(cls: type) -> dict:
    try:
        return dict(inspect.signature(cls.__call__).parameters)
    except (TypeError, ValueError):
        return {}


def _diffusers_class(name: str) -> type | None:
    try:
        import diffusers

        return getattr(diffusers, name, None)
    except ImportError:
        return None


def check_media_flags(args: Any, media: Media, *, image_needed: bool = True) -> None:
    """Flags that do not fit what the pipeline makes or takes: one line each, exit 2.
    ``image_needed``: a pipeline that needs an input image and has none is refused too
    (``ondeck plan`` plans the call without one; it has no ``--fps`` either)."""
    name = media.pipeline_class
    if media.video:
        if args.images is not None:
            raise UsageError(f"argument --images: {name} makes a video, not images")
    else:
        fps = getattr(args, "fps", None)
        for flag, value in (("--fps", fps), ("--frames", args.frames)):
            if value is not None:
                raise UsageError(f"argument {flag}: {name} makes images, not a video")
        if args.images is not None and args.images > 1 and not media.takes_count:
            raise UsageError(f"argument --images: {name} makes one image per prompt")
    check_input_image(args.image, media, needed=image_needed)
    true_cfg = getattr(args, "true_cfg", None)
    if true_cfg is not None and media.true_cfg_default is None:
        raise UsageError(f"argument --true-cfg: {name} has no true_cfg_scale")
    _warn_of_unused(args, media, true_cfg)


def check_input_image(image: str | None, media: Media, *, needed: bool = True) -> None:
    """``--image`` (``image``, its path) fits the pipeline: refused where it takes none,
    and, where ``needed``, missing where it cannot run without one, or where it needs an
    input no flag gives. One line each, exit 2; the image is read by
    ``read_input_image``."""
    name = media.pipeline_class
    if image is not None and not media.takes_image:
        raise UsageError(f"argument --image: {name} takes no input image")
    if image is None and media.needs_image and needed:
        raise UsageError(f"{name} needs an input image: give it with --image PATH")
    if media.other_input is not None and needed:
        raise UsageError(
            f"{name} needs a {media.other_input} besides its image, which the command line "
            "cannot give; call the pipeline from Python (ondeck.diffusers.from_pretrained)"
        )


def _warn_of_unused(args: Any, media: Media, true_cfg: float | None) -> None:
    """A flag the pipeline would ignore, said in one line rather than left to change
    nothing unnoticed."""
    name = media.pipeline_class
    cfg = true_cfg if true_cfg is not None else media.true_cfg_default
    if args.negative_prompt and cfg is not None and cfg <= 1:
        warnings.warn(
            f"{name} uses a negative prompt only with true classifier-free guidance "
            "(true_cfg_scale above 1; try --true-cfg 4): --negative-prompt changes nothing",
            stacklevel=3,
        )
    if getattr(args, "guidance", None) is not None and media.guidance_embedded is False:
        warnings.warn(
            f"{name}: this transformer has no guidance embedding (guidance_embeds is false, "
            "as in FLUX.1 [schnell]): --guidance changes nothing",
            stacklevel=3,
        )


class ImageRangeError(ValueError):
    """An image of numbers whose range cannot be told (a float image past 0..255)."""


def upright_rgb(image: Any) -> Any:
    """A PIL image upright, as its camera's orientation tag says (a phone's portrait
    photo is stored sideways), as diffusers' own ``load_image`` turns it, in 8-bit RGB.
    A 16-bit image (a depth map, say) is scaled from 0..65535, and a float one from 0..1
    (or taken as 0..255 where its values are), where a plain conversion would clip every
    value above 255 to white, or every value below 1 to black."""
    import numpy as np
    from PIL import Image, ImageOps

    image = ImageOps.exif_transpose(image)
    if image.mode in ("I", "F") or image.mode.startswith("I;16"):
        values = np.asarray(image, dtype=np.float64)
        top = float(values.max()) if values.size else 0.0
        if image.mode == "F":
            if values.size and (float(values.min()) < 0 or top > 255 or not np.isfinite(top)):
                raise ImageRangeError(
                    f"its values run from {float(values.min()):g} to {top:g}; a float "
                    "image is read as 0..1 or 0..255"
                )
            scale = 255.0 if top <= 1.0 else 1.0
        else:
            scale = 255.0 / 65535.0 if top > 255 or image.mode.startswith("I;16") else 1.0
        eight = np.clip(np.rint(values * scale), 0, 255).astype(np.uint8)
        image = Image.fromarray(eight)  # 8-bit grey
    return image.convert("RGB")


def read_input_image(path_text: str) -> Any:
    """The ``--image`` file as an RGB PIL image, or one line saying why not."""
    from PIL import Image

    path = Path(path_text).expanduser()  # `--image=~/cat.png`: the shell leaves ~ alone
    if not path.is_file():
        raise UsageError(f"argument --image: {path_text} is not a file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                width, height = image.size
                if width * height > MAX_INPUT_PIXELS:
                    raise UsageError(
                        f"argument --image: {path} is {width}x{height}, more than "
                        f"{MAX_INPUT_PIXELS // 2**20} Mpixels"
                    )
                return upright_rgb(image)
    except UsageError:
        raise
    except ImageRangeError as error:
        raise UsageError(f"argument --image: {path}: {error}") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, Warning) as error:
        raise UsageError(
            f"argument --image: cannot read {path} as an image ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'no detail'})"
        ) from None

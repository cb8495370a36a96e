"""The request bodies, as OpenAI's images and videos APIs shape them, plus ondeck's own
optional fields (steps, seed, frames, negative_prompt, guidance_scale)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..arguments import MAX_SEED

SIZE = re.compile(r"^([0-9]{1,5})x([0-9]{1,5})$")  # ASCII digits: \d takes any script's


def parse_size(size: str) -> tuple[int, int]:
    """``WIDTHxHEIGHT`` as OpenAI writes it; returns (width, height)."""
    match = SIZE.match(size.strip())
    if not match:
        raise ValueError(f"size must be WIDTHxHEIGHT, e.g. 832x480, got {size!r}")
    return int(match.group(1)), int(match.group(2))


def not_boolean(value: Any) -> Any:
    """A number field's value, refused where it is a boolean: pydantic takes true as 1,
    and a client that sends it means something else."""
    if isinstance(value, bool):
        raise ValueError(f"must be a number, not {str(value).lower()}")
    return value


class _Request(BaseModel):
    # Fields OpenAI defines that ondeck does not use (quality, style, user) are accepted
    # and ignored, so a client written for OpenAI works unchanged.
    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str = Field(min_length=1)
    size: str | None = None
    # One side alone (ondeck's own fields; ``size`` gives both): the other is the model's.
    height: int | None = Field(default=None, ge=1)
    width: int | None = Field(default=None, ge=1)
    steps: int | None = Field(default=None, ge=1)
    num_inference_steps: int | None = Field(default=None, ge=1)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    negative_prompt: str = ""
    guidance_scale: float | None = Field(default=None, ge=0, le=100, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        # OpenAI's clients send null for a field the caller left unset: its default.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator(
        "height", "width", "steps", "num_inference_steps", "seed", "guidance_scale",
        "n", "frames",  # an image request's, a video request's
        mode="before", check_fields=False,
    )  # fmt: skip
    @classmethod
    def _number(cls, value: Any) -> Any:
        return not_boolean(value)

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None:
            parse_size(value)
        return value

    @property
    def step_count(self) -> int | None:
        return self.steps if self.steps is not None else self.num_inference_steps


class ImageRequest(_Request):
    n: int = Field(default=1, ge=1)
    response_format: str = "b64_json"
    output_format: str = "png"

    @model_validator(mode="before")
    @classmethod
    def _no_video_fields(cls, data: Any) -> Any:
        # ondeck's own video fields, not OpenAI's unused ones: refused, not ignored, as
        # `ondeck generate --frames` is for an image model.
        if isinstance(data, dict):
            for field in ("frames", "seconds", "input_reference"):
                if data.get(field) is not None:
                    raise ValueError(f"{field} is a video request's field, not an image's")
        return data

    @field_validator("response_format")
    @classmethod
    def _format(cls, value: str) -> str:
        if value != "b64_json":
            raise ValueError("response_format must be b64_json (ondeck serves no image URLs)")
        return value

    @field_validator("output_format")
    @classmethod
    def _output_format(cls, value: str) -> str:
        if value != "png":
            raise ValueError("output_format must be png (ondeck writes its images as PNG)")
        return value


class VideoRequest(_Request):
    seconds: str | None = None
    frames: int | None = Field(default=None, ge=1)
    input_reference: Any = None

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds(cls, value: Any) -> Any:
        return str(value) if isinstance(not_boolean(value), (int, float)) else value

"""The resolution rule: the image sizes a compiled pipeline accepts, one place for the UI's limits
and the exported shape range (`Options.resolution` makes it from the options)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resolution:
    """Image sizes a compiled pipeline accepts.

    Each side is a multiple of `step` pixels in [min_side, max_side]; the transformer sees
    tokens = (height / step) * (width / step) image tokens. For FLUX `step` = 16: the VAE
    downsamples by 8 (`pipe.vae_scale_factor`) and the latents are packed 2x2.
    """

    min_side: int
    max_side: int
    step: int = 16

    def __post_init__(self) -> None:
        if not (0 < self.min_side <= self.max_side) or self.min_side % self.step or self.max_side % self.step:
            raise ValueError(
                f"side range {self.min_side}..{self.max_side} px: both ends must be multiples of "
                f"{self.step} with 0 < min <= max"
            )

    def tokens(self, height: int, width: int) -> int:
        """Image tokens of a `height` x `width` image (pixels)."""
        return (height // self.step) * (width // self.step)

    @property
    def token_range(self) -> tuple[int, int]:
        """(smallest, largest) image-token count over every allowed size."""
        return self.tokens(self.min_side, self.min_side), self.tokens(self.max_side, self.max_side)

    @property
    def sides(self) -> str:
        """The sides allowed, as a refusal says them: "a multiple of 16 from 512 to 1536 px"."""
        return f"a multiple of {self.step} from {self.min_side} to {self.max_side} px"

    def describe(self) -> str:
        lo, hi = self.token_range
        return (
            f"sides {self.min_side}..{self.max_side} px in steps of {self.step} "
            f"({lo}..{hi} image tokens = (H/{self.step})*(W/{self.step}))"
        )

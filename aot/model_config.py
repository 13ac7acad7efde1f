"""What the engine reads of a model's configs: the VAE's pixel step and latent channels, the
transformer's attention head dim (each family names them its own way)."""

from __future__ import annotations

from typing import Any

import torch


def vae_scale_factor(vae_config: dict[str, Any]) -> int:
    """The VAE's spatial downsampling, as the pipelines compute `vae_scale_factor` from its config:
    2 ** (resolution levels - 1) for `AutoencoderKL`-style VAEs (8 for FLUX's), 2 ** len(temperal_downsample)
    for Qwen-Image's and Wan's."""
    if "temperal_downsample" in vae_config:
        return 2 ** len(vae_config["temperal_downsample"])
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


def latent_channels(vae_config: dict[str, Any]) -> int:
    """The VAE's latent channels: its config's `z_dim` (Qwen-Image's and Wan's VAEs), else `latent_channels`.

    Raises:
        KeyError: the config has neither field.
    """
    return vae_config[_latent_field(vae_config)]


def with_latent_channels(vae_config: dict[str, Any], channels: int) -> dict[str, Any]:
    """A copy of `vae_config` for a VAE of `channels` latent channels: the field `latent_channels`
    reads set to it, and the lists of one value per channel (Qwen-Image's `latents_mean`,
    `latents_std`) repeated or cut to `channels`."""
    config = {**vae_config, _latent_field(vae_config): channels}
    for stat in ("latents_mean", "latents_std"):
        if isinstance(config.get(stat), list):
            config[stat] = (config[stat] * channels)[:channels]
    return config


def _latent_field(vae_config: dict[str, Any]) -> str:
    """The VAE config's field of its latent channels."""
    return "z_dim" if "z_dim" in vae_config else "latent_channels"


def attention_head_dim(transformer: torch.nn.Module) -> int:
    """The transformer's attention head dim: its config's `attention_head_dim` (FLUX, Qwen-Image), else
    the first attention module's query width over its head count (Z-Image's config names `dim`, `n_heads`).

    Raises:
        ValueError: neither is there.
    """
    if "attention_head_dim" in transformer.config:
        return transformer.config.attention_head_dim
    for module in transformer.modules():
        if hasattr(module, "to_q") and hasattr(module, "heads"):
            return module.to_q.out_features // module.heads
    raise ValueError(f"{type(transformer).__name__}: no attention_head_dim in its config and no attention module")

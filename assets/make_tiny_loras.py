"""Build `assets/tiny-flux-loras/`: two seeded rank-4 LoRAs for the tiny FLUX pipeline, for offline tests.

    a.safetensors   the attention projections and MLPs of both block classes (inside the compiled blocks)
    b.safetensors   the attention projections, plus `x_embedder` and `proj_out` (outside them, run eagerly)

Both are written as diffusers writes LoRAs (`FluxPipeline.save_lora_weights`, peft keys), with
lora_alpha = 8 = 2 r in their metadata, so a reader that ignores alpha scales them wrong. Their B
factors are random, not zero (peft's initialisation), so each changes the images.

    python assets/make_tiny_loras.py            # rewrites assets/tiny-flux-loras/ (seeded: same weights)
"""

import argparse
from pathlib import Path

import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

ROOT = Path(__file__).parent
OUT = ROOT / "tiny-flux-loras"
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
TARGETS = {
    "a": ATTENTION + ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp"],
    "b": ATTENTION + ["x_embedder", "proj_out"],
}
RANK, ALPHA = 4, 8


def build(out: Path) -> None:
    """Write one LoRA per entry of `TARGETS` into `out` as `<name>.safetensors`."""
    transformer = FluxTransformer2DModel.from_pretrained(ROOT / "tiny-flux", subfolder="transformer")
    for seed, (name, targets) in enumerate(TARGETS.items()):
        torch.manual_seed(seed)
        config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, init_lora_weights="gaussian")
        transformer.add_adapter(config, adapter_name=name)
        for key, param in transformer.named_parameters():
            if f"lora_B.{name}." in key:
                torch.nn.init.normal_(param, std=0.1)
        FluxPipeline.save_lora_weights(
            out,
            transformer_lora_layers=get_peft_model_state_dict(transformer, adapter_name=name),
            transformer_lora_adapter_metadata=config.to_dict(),
            weight_name=f"{name}.safetensors",
        )
        transformer.delete_adapters(name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT, help="output folder (default: %(default)s)")
    build(parser.parse_args().out)

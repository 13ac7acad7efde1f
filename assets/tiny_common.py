"""What the `make_tiny_*.py` scripts share: a Qwen tokenizer built offline, and the command line.

The Qwen2/Qwen3 tokenizer here is a byte-level BPE with no merges: its vocabulary is the 256 byte symbols
plus the special tokens the pipelines' prompt templates use, so any text gets ids below the text
encoder's vocabulary size and nothing is downloaded. Its chat template renders messages as Qwen3's does
(`<|im_start|>role\\ncontent<|im_end|>`), including the empty think block that `enable_thinking=False`
adds after the generation prompt.
"""

import argparse
from pathlib import Path

from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2TokenizerFast

QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
]
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)


def qwen_tokenizer(model_max_length: int = 1024) -> Qwen2TokenizerFast:
    """A byte-level Qwen2 tokenizer: one id per byte, then the special tokens; pads with <|endoftext|>."""
    vocab = {symbol: i for i, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    tokenizer = Qwen2TokenizerFast(vocab=vocab, merges=[], model_max_length=model_max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:]})
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def main(doc: str, build, out: Path) -> None:
    """`python assets/make_tiny_<family>.py [--out DIR]`: build the seeded pipeline and save it."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=out, help="output folder (default: %(default)s)")
    build().save_pretrained(parser.parse_args().out)

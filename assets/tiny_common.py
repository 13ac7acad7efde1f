"""What the `make_tiny_*.py` scripts share: Qwen and Mistral tokenizers built offline, and the command line.

The Qwen2/Qwen3 tokenizer here is a byte-level BPE built offline: the 256 byte symbols, the special tokens
the pipelines' prompt templates use, and merges trained (deterministically) on Qwen-Image's two system
prompts, so that those tokenize to whole words as with the real 151k vocabulary: the pipelines drop the
first 34 (Qwen-Image) or 64 (Qwen-Image-Edit) tokens of the template, and here too that cut falls exactly
at the start of the user's text. Any other text falls back to bytes, with ids below the text encoder's
vocabulary size. Its chat template renders messages as Qwen3's does (`<|im_start|>role\\ncontent<|im_end|>`),
including the empty think block that `enable_thinking=False` adds after the generation prompt.

The Mistral tokenizer (FLUX.2's, inside a PixtralProcessor) is built the same way, with Mistral's control
tokens and merges trained on FLUX.2's system message, and a chat template in Mistral Small 3.1's format
(`<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]`, `[IMG]` where a message has an image).
"""

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, trainers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast, Qwen2TokenizerFast

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


# The system prompts of diffusers' QwenImagePipeline and QwenImageEditPipeline: the merges' training text.
QWEN_IMAGE_SYSTEM_PROMPTS = [
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n",
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n",
]


def qwen_tokenizer(model_max_length: int = 1024) -> Qwen2TokenizerFast:
    """A byte-level Qwen2 tokenizer (bytes, special tokens, whole-word merges); pads with <|endoftext|>."""
    vocab = {symbol: i for i, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    tokenizer = Qwen2TokenizerFast(vocab=vocab, merges=[], model_max_length=model_max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:]})
    tokenizer = tokenizer.train_new_from_iterator(QWEN_IMAGE_SYSTEM_PROMPTS, vocab_size=1000)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


MISTRAL_SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
]
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST]' }}{% endif %}"
    "{% for part in parts %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}{{ '[IMG]' }}{% endif %}"
    "{% endfor %}"
    "{% if message['role'] == 'system' %}{{ '[/SYSTEM_PROMPT]' }}"
    "{% elif message['role'] == 'user' %}{{ '[/INST]' }}{% else %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def mistral_tokenizer(corpus: list[str], model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """A byte-level BPE with Mistral's control tokens (ids 0-10) and merges trained on `corpus`."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=MISTRAL_SPECIALS, initial_alphabet=ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer


def main(doc: str, build, out: Path) -> None:
    """`python assets/make_tiny_<family>.py [--out DIR]`: build the seeded pipeline and save it."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=out, help="output folder (default: %(default)s)")
    build().save_pretrained(parser.parse_args().out)

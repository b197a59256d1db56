"""A tiny Qwen3-VL with random weights, built offline and deterministically.

For machines with no weights (tests, CI, a user's first try): the real architecture, the
real processor and chat template, a byte-level BPE tokenizer trained on generated text, and
random weights from a fixed seed. Its answers are noise; the pipeline around it is real.
Builds in a few seconds and is about 1.5 MB.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
VOCAB_SIZE = 1024
MARKER = "vlbatch-tiny-model.json"  # written last: a folder without it is incomplete

# Qwen3-VL's conversation format: system/user/assistant turns, images as
# <|vision_start|><|image_pad|><|vision_end|>, which the processor expands per image.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in part -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


def _training_text() -> list[str]:
    words = ("invoice page table total amount date name number markdown convert this "
             "describe summarise document text line column row header footer the a of and "
             "to in is for on with as by at from json key value answer question image").split()
    lines = []
    for i in range(2000):  # deterministic: no randomness, only arithmetic
        picked = [words[(i * 7 + j * 13) % len(words)] for j in range(12)]
        lines.append(" ".join(picked) + f" {i} {i * 31 % 997}.{i % 100:02d} | # * - {{}} [] ()")
    return lines


def _build_tokenizer(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - 16, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_training_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None,
                                   additional_special_tokens=SPECIAL_TOKENS[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def build_tiny_model(out: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny random Qwen3-VL model folder to `out` (reused when already complete)."""
    out = Path(out)
    if (out / MARKER).exists():
        return out
    import torch
    from transformers import (Qwen2VLImageProcessor, Qwen3VLConfig,
                              Qwen3VLForConditionalGeneration, Qwen3VLProcessor)
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    try:
        ids = _build_tokenizer(work)
        config = Qwen3VLConfig(
            text_config=dict(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, max_position_embeddings=32768,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                              "mrope_section": [8, 4, 4],
                                              "mrope_interleaved": True},
                             bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                             pad_token_id=ids["<|endoftext|>"], dtype="float32"),
            vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                               patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                               out_hidden_size=128, num_position_embeddings=256,
                               deepstack_visual_indexes=[0]),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True,
        )
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config).to(torch.float32)
        model.save_pretrained(work)
        from transformers import AutoTokenizer

        processor = Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessor(
                patch_size=16, merge_size=2, temporal_patch_size=2,
                size={"shortest_edge": 64 * 32 * 32, "longest_edge": 1280 * 32 * 32},
                image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]),
            tokenizer=AutoTokenizer.from_pretrained(work),
            video_processor=Qwen3VLVideoProcessor(patch_size=16, merge_size=2,
                                                  temporal_patch_size=2),
            chat_template=CHAT_TEMPLATE,
        )
        processor.save_pretrained(work)
        (work / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"]],
             "pad_token_id": ids["<|endoftext|>"], "do_sample": False}))
        (work / MARKER).write_text(json.dumps({"seed": seed, "note": "random weights"}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(work, out)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return out

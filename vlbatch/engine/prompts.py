"""Prompts built with the model's own processor and chat template, and their token counts.

Qwen3-VL spends one image token per 32x32 pixels of the (already resized) page; the text
tokens are those of the chat prompt less its one <|image_pad|> placeholder, which the
processor expands. This matches the prompt length vLLM reports (tested).
"""

from __future__ import annotations

from functools import lru_cache

from vlbatch.pipeline.imaging import IMAGE_FACTOR


class PromptBuilder:
    def __init__(self, model_path: str, trust_remote_code: bool = False):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_path,
                                                       trust_remote_code=trust_remote_code)
        self.tokenizer = self.processor.tokenizer
        image_processor = self.processor.image_processor
        self.image_factor = (getattr(image_processor, "patch_size", 16)
                             * getattr(image_processor, "merge_size", 2)) or IMAGE_FACTOR
        self.chat_prompt = lru_cache(maxsize=4096)(self._chat_prompt)
        self.text_tokens = lru_cache(maxsize=4096)(self._text_tokens)

    def _chat_prompt(self, text: str) -> str:
        """One user turn: the page image, then the task's text; the assistant answers."""
        messages = [{"role": "user", "content": [{"type": "image"},
                                                  {"type": "text", "text": text}]}]
        return self.processor.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)

    def _text_tokens(self, text: str) -> int:
        ids = self.tokenizer(self.chat_prompt(text), add_special_tokens=False)["input_ids"]
        return len(ids) - 1  # the one <|image_pad|> becomes the image tokens

    def prompt_tokens(self, text: str, width: int, height: int) -> int:
        """Prompt tokens for a page already fitted to the model's size."""
        return self.text_tokens(text) + (width // self.image_factor) * (height // self.image_factor)

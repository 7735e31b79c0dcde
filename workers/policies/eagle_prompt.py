"""GR00T N1.5's prompt, built as Eagle 2.5's processor builds it in LeRobot 0.4.x's GR00T steps.

One user turn holds the images, then the task written as ``str([task])`` (N1.5 feeds the language
as a one-element list, so the model reads its repr: ``['pick up the cube']``; the text is not
lower-cased or cleaned; an empty task reads ``Perform the task.``). The processor's chat template
renders it (a system turn, the generation prompt); each ``<image-k>`` placeholder then becomes
``<image k><img>``, one ``<IMG_CONTEXT>`` per vision feature, ``</img>``. The batch is padded on
the left with the tokenizer's pad token; the mask marks the real tokens.

The template is the processor's (``chat_template.json``), not the tokenizer's: Eagle's
``tokenizer_config.json`` carries Qwen3's text-only template, which the processor never uses.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

IMAGE_TOKEN = "<IMG_CONTEXT>"
"""Eagle's image placeholder token; the backbone writes projected patches over its embeddings."""
IMAGE_START, IMAGE_END = "<img>", "</img>"
PROMPT_TOKENS = (IMAGE_TOKEN, "<|im_start|>", "<|im_end|>", IMAGE_START, IMAGE_END)
"""Tokens the prompt must keep whole; a tokenizer without them (the tiny configs') gains them, in
this order (``<IMG_CONTEXT>`` first keeps the id earlier tiny checkpoints used)."""
DEFAULT_TASK = "Perform the task."
TEMPLATE_FILE = "chat_template.json"
PROMPT_CACHE = 4096
"""Distinct (instruction, camera count) prompts kept tokenized; the cache starts over when full."""

N15_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}<image {{ image_count.value }}>{% endif %}"
    "<image-{{ image_count.value }}>{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}<video {{ video_count.value }}>{% endif %}"
    "<video-{{ video_count.value }}>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The N1.5 Eagle processor's chat template (its ``chat_template.json``), for folders without one."""

_PLACEHOLDER = re.compile(r"<image-(\d+)>")


def read_chat_template(folder: str) -> str | None:
    """The processor template a folder holds: ``chat_template.json`` (Eagle's layout) or a bare
    ``chat_template.jinja``; None without either."""
    path = os.path.join(folder, TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)["chat_template"]
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path) as f:
            return f.read()
    return None


def write_chat_template(folder: str, template: str) -> None:
    with open(os.path.join(folder, TEMPLATE_FILE), "w") as f:
        json.dump({"chat_template": template}, f, indent=2)


class EaglePrompt:
    """Instructions and a camera count -> left-padded ``(ids, mask)`` ``[B, L]`` as N1.5 builds them."""

    def __init__(self, tokenizer: Any, template: str | None, tokens_per_image: int) -> None:
        missing = [t for t in PROMPT_TOKENS if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
        if missing:
            tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
        self.tokenizer = tokenizer
        self.template = template or N15_CHAT_TEMPLATE
        self.tokens_per_image = tokens_per_image
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        self._ids: dict[tuple[str, int], list[int]] = {}

    def text(self, instruction: str, images: int) -> str:
        """One sample's prompt text, image placeholders expanded."""
        content = [{"type": "image"}] * images + [{"type": "text", "text": str([instruction or DEFAULT_TASK])}]
        chat = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], chat_template=self.template,
                                                  tokenize=False, add_generation_prompt=True)
        span = IMAGE_START + IMAGE_TOKEN * self.tokens_per_image + IMAGE_END
        return _PLACEHOLDER.sub(lambda m: f"<image {m.group(1)}>{span}", chat)

    def ids(self, instruction: str, images: int) -> list[int]:
        """One sample's token ids, rendered and tokenized once per (instruction, cameras): an env
        batch repeats a few tasks, and the chat template costs about 1 ms a call."""
        key = (instruction, images)
        ids = self._ids.get(key)
        if ids is None:
            if len(self._ids) >= PROMPT_CACHE:
                self._ids.clear()
            ids = self._ids[key] = self.tokenizer(self.text(instruction, images))["input_ids"]
        return ids

    def __call__(self, instructions: list[str], images: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.ids(i, images) for i in instructions]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for n, row in enumerate(rows):  # padded on the left, as the processor pads
            ids[n, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[n, width - len(row):] = 1
        return ids, mask

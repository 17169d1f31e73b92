"""What the shipped text2img DDM understands is declared by its checkpoint and written down
once for people: docs/text2img.md's vocabulary is its tokenizer's, which is the captions'
(the tokenizer is trained on them), and its example prompt is the caption generator's."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ddm.data.colored_mnist import EXAMPLE_PROMPT
from ddm.training.text2img.tokenizer import BOS, EOS, PAD, UNK

REPOSITORY = Path(__file__).resolve().parents[2]
ENCODER = REPOSITORY / "checkpoints" / "text2img" / "text_encoder"


def test_the_docs_list_exactly_the_shipped_tokenizers_words():
    vocabulary = json.loads((ENCODER / "tokenizer.json").read_text())["model"]["vocab"]
    words = set(vocabulary) - {PAD, UNK, BOS, EOS}
    listed = re.search(r"```vocabulary\n(.*?)```", (REPOSITORY / "docs" / "text2img.md")
                       .read_text(), re.S)
    assert listed is not None, "docs/text2img.md has no vocabulary block"
    assert sorted(listed.group(1).split()) == sorted(words)
    assert len(words) == 40


def test_the_shipped_encoder_declares_the_caption_generators_example():
    declared = json.loads((ENCODER / "config.json").read_text())["_ddm"]["example_prompt"]
    assert declared == EXAMPLE_PROMPT

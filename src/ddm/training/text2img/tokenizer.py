"""A word-level tokenizer built offline from the captions with `tokenizers`.

CLIP's own BPE vocabulary is 49k tokens learned from the web; our captions use a few dozen
words, so a word-level vocabulary trained on them is exact and tiny. It is saved as a
``PreTrainedTokenizerFast`` directory (tokenizer.json + tokenizer_config.json) that
``AutoTokenizer.from_pretrained`` loads; like CLIP's it lower-cases, wraps a prompt in
``<|startoftext|>`` ... ``<|endoftext|>``, truncates to ``model_max_length`` keeping the end
token, and pads to it. Unknown words map to ``<|unk|>``.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

PAD, UNK, BOS, EOS = "<|pad|>", "<|unk|>", "<|startoftext|>", "<|endoftext|>"
#: Tokens per prompt, start and end included (CLIP's is 77; our longest caption needs 12).
MAX_LENGTH = 32


def build_tokenizer(captions: Iterable[str], max_length: int = MAX_LENGTH) -> Any:
    """Train the word-level vocabulary on ``captions``; returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(captions, trainers.WordLevelTrainer(special_tokens=[PAD, UNK, BOS,
                                                                                EOS]))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(t, tok.token_to_id(t)) for t in (BOS, EOS)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, unk_token=UNK, model_max_length=max_length)


def special_ids(tokenizer: Any) -> dict[str, int]:
    """The ids a CLIP text config needs: ``bos``, ``eos``, ``pad``."""
    return {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id,
            "pad": tokenizer.pad_token_id}


def tokenize(tokenizer: Any, prompts: list[str]) -> np.ndarray:
    """Prompts -> ``(B, model_max_length)`` int64 ids, padded and truncated as CLIP's are."""
    return np.asarray(tokenizer(list(prompts), padding="max_length", truncation=True,
                                max_length=tokenizer.model_max_length)["input_ids"],
                      dtype=np.int64)

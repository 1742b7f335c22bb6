"""Byte-level BPE tokenizers built with `tokenizers`, saved so `AutoTokenizer` loads them."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def _empty_byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer learned from `texts` (deterministic for the same input)."""
    tok = _empty_byte_level()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def byte_tokenizer() -> Tokenizer:
    """The 256 byte symbols plus the end-of-text token: every string encodes, nothing to train."""
    return train_bpe([], vocab_size=257)


def save_tokenizer(tok: Tokenizer, folder: Path, model_max_length: int) -> None:
    """Write tokenizer.json and its config so `AutoTokenizer.from_pretrained(folder)` works."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        unk_token=None,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(folder))

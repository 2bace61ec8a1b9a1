"""Byte-level BPE tokenizer for the demo models, trained on the training split only.

Byte-level BPE (GPT-2 style) never produces unknown tokens, so any prompt a user types is
encodable. Digits are split one per token by default: the GSM workload is arithmetic, and a
model sees each number digit by digit the same way every time (as Llama and Qwen tokenizers do).
``<|endoftext|>`` is the only special token; it is the EOS token, the document separator in
packed training sequences and the padding token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from specfit.training.common import check_trainer_config, write_json
from specfit.data.corpus import load_corpus
from specfit.data.gsm import (
    TRAIN_TEMPLATES, GenerationReport, format_problem, generate_problems,
)

EOS_TOKEN = "<|endoftext|>"


@dataclass
class TrainTokenizerConfig:
    """Settings of :func:`train_tokenizer`."""

    out_dir: str = "runs/demo-tokenizer"
    data_dir: str | None = None  # default: <repo>/../shared/data
    vocab_size: int = 4096
    min_frequency: int = 2
    gsm_per_template: int = 140  # GSM problems generated per training template
    seed: int = 0
    individual_digits: bool = True
    max_token_length: int | None = 16  # longest merged token in characters (None: unlimited)

    def __post_init__(self) -> None:
        check_trainer_config(self)


def training_documents(data_dir: str | os.PathLike[str] | None, gsm_per_template: int,
                       seed: int = 0, report: GenerationReport | None = None
                       ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The training split as documents: (corpus train docs, GSM train problems as text).

    Both the tokenizer and the target trainer use this, so they see the same text.
    GSM problems come only from :data:`~specfit.data.gsm.TRAIN_TEMPLATES`.
    """
    corpus = load_corpus(data_dir).train
    problems = generate_problems(data_dir, TRAIN_TEMPLATES, gsm_per_template, seed, report=report)
    gsm = [(f"gsm/{p.template_id:04d}", format_problem(p)) for p in problems]
    return corpus, gsm


def build_tokenizer_object(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2,
                           individual_digits: bool = True, max_token_length: int | None = 16):
    """Train a raw ``tokenizers.Tokenizer`` (byte-level BPE) on an iterator of texts."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if individual_digits:
        # one digit a token; a leading space stays on the first digit (" 12" -> " 1", "2")
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r" ?[0-9]"), behavior="isolated"), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        max_token_length=max_token_length,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap_tokenizer(tok, model_max_length: int = 2048):
    """A ``PreTrainedTokenizerFast`` around a raw tokenizer, with EOS/pad/BOS set to ``<|endoftext|>``."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, bos_token=EOS_TOKEN,
        unk_token=None, model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )


def _chunks(docs: Iterable[tuple[str, str]], size: int = 1 << 16) -> Iterator[str]:
    """Feed long documents to the trainer in pieces (split at line ends) to bound memory."""
    for _, text in docs:
        start = 0
        while start < len(text):
            end = text.rfind("\n", start, start + size) + 1 if start + size < len(text) else len(text)
            if end <= start:
                end = min(len(text), start + size)
            yield text[start:end]
            start = end


def train_tokenizer(cfg: TrainTokenizerConfig) -> Path:
    """Train the BPE tokenizer on the training split and save it with ``save_pretrained``.

    Returns the output directory; ``AutoTokenizer.from_pretrained(out_dir)`` loads it offline.
    A ``specfit_tokenizer.json`` beside it records the config and the GSM generation report.
    """
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = GenerationReport()
    corpus, gsm = training_documents(cfg.data_dir, cfg.gsm_per_template, cfg.seed, report)
    tok = build_tokenizer_object(_chunks(corpus + gsm), cfg.vocab_size, cfg.min_frequency,
                                 cfg.individual_digits, cfg.max_token_length)
    hf = wrap_tokenizer(tok)
    hf.save_pretrained(str(out))
    write_json(out / "specfit_tokenizer.json", {
        "config": cfg.__dict__,
        "vocab_size": len(hf),
        "train_documents": len(corpus),
        "gsm_problems": len(gsm),
        "gsm_skipped_templates": report.skipped,
    })
    return out

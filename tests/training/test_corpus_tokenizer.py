"""Corpus cleaning and split; tokenizer round trip and loading with AutoTokenizer."""

from __future__ import annotations

import pytest

from specfit.data.paths import DataDirError, resolve_data_dir
from specfit.training.common import warmup_cosine_lr
from specfit.data.corpus import (
    HELDOUT_DOCUMENTS, clean_kjv, load_corpus, strip_gutenberg,
)


def _data_dir():
    try:
        return resolve_data_dir(None, "corpus/shakespeare", "corpus/kjv")
    except DataDirError as exc:
        pytest.skip(f"shared data absent: {exc}")


def test_strip_gutenberg_markers():
    raw = ("The Project Gutenberg EBook of X\r\nlicence blah\r\n*** START OF THIS PROJECT GUTENBERG "
           "EBOOK X ***\r\n\r\nHAMLET\r\n\r\n\r\n\r\nTo be.  \r\n*** END OF THIS PROJECT GUTENBERG "
           "EBOOK X ***\r\nmore licence\r\n")
    assert strip_gutenberg(raw) == "HAMLET\n\nTo be.\n"


def test_clean_kjv_drops_verse_numbers_and_splits_runs():
    raw = "1:1 In the beginning.\n1:2 And the earth; 1:3 And God said.\nJonah\n2:1 Then.\n"
    assert clean_kjv(raw, "Genesis") == (
        "The Book of Genesis\n\nIn the beginning.\nAnd the earth;\nAnd God said.\n\nThen.\n")


def test_load_corpus_split():
    data_dir = _data_dir()
    split = load_corpus(data_dir)
    names_train = {n for n, _ in split.train}
    names_held = {n for n, _ in split.heldout}
    assert names_held == set(HELDOUT_DOCUMENTS)
    assert names_train.isdisjoint(names_held)
    assert len(split.train) + len(split.heldout) == 42 + 66
    text = dict(split.train)["kjv/01-genesis"]
    assert "1:1" not in text and "In the beginning God created" in text


def test_missing_data_dir_is_a_clear_error(tmp_path):
    with pytest.raises(DataDirError, match="nope"):
        load_corpus(tmp_path / "nope")


def test_lr_schedule():
    kw = dict(total_steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert warmup_cosine_lr(0, **kw) == pytest.approx(0.1)
    assert warmup_cosine_lr(9, **kw) == pytest.approx(1.0)
    assert warmup_cosine_lr(100, **kw) == pytest.approx(0.1)
    assert warmup_cosine_lr(55, **kw) == pytest.approx(0.55)


def test_tokenizer_round_trip_and_autotokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer

    from specfit.training.tokenizer import EOS_TOKEN, build_tokenizer_object, wrap_tokenizer

    texts = ["To be, or not to be: that is the question.\n",
             "Question: Ann has 12 apples and buys 30 more.\nAnswer: 12 + 30 = <<12+30=42>>42\n#### 42\n",
             "And God said, Let there be light: and there was light.\n"] * 20
    tok = wrap_tokenizer(build_tokenizer_object(texts, vocab_size=400, min_frequency=1))
    tok.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.eos_token == EOS_TOKEN and loaded.eos_token_id == loaded.pad_token_id
    for s in texts[:3] + ["Ünïcödé never seen 🙂 9876", f"a{EOS_TOKEN}b"]:
        ids = loaded(s, add_special_tokens=False)["input_ids"]
        assert loaded.decode(ids) == s
    ids = loaded(f"x{EOS_TOKEN}y", add_special_tokens=False)["input_ids"]
    assert loaded.eos_token_id in ids  # the separator is one special token
    pieces = loaded.convert_ids_to_tokens(loaded(" 1234", add_special_tokens=False)["input_ids"])
    assert pieces == ["Ġ1", "2", "3", "4"]  # one digit a token


def test_train_tokenizer_on_shared_data(tmp_path):
    data_dir = _data_dir()
    pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer

    from specfit.training.tokenizer import TrainTokenizerConfig, train_tokenizer

    out = train_tokenizer(TrainTokenizerConfig(out_dir=str(tmp_path / "tok"), data_dir=str(data_dir),
                                               vocab_size=512, gsm_per_template=1))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == 512
    s = "Thou art more lovely and more temperate.\n#### 42"
    assert tok.decode(tok(s)["input_ids"]) == s

"""The EAGLE-3 drafter: grows a draft tree level by level with a beam of ``top_k`` nodes.

Level 1 holds the root's ``top_k`` most likely children. Each further level expands the beam (the
``top_k`` nodes of the previous level with the highest path log-probability) by ``top_k`` children
each; every child is a candidate, and the best ``top_k`` form the next beam. Which candidates are
verified is the selector's decision (EAGLE keeps the ``total_tokens`` with the highest path
probability). The head's KV cache holds the committed pairs; tree pairs are dropped after drafting.
The head's entropy at the root and at every expanded node goes into the tree
(:meth:`DraftTree.set_entropy`): acceptance estimators use it, and the tree keeps only top-k. So
does its acceptance probe's logit, where the head directory has one (:mod:`.probe`,
:meth:`DraftTree.set_accept_logit`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

from specfit.interfaces import (
    ROOT,
    ConfigError,
    DrafterBase,
    DrafterConfig,
    DraftTree,
    ModelError,
    integer,
    note_once,
    optional_integer,
)
from specfit.plugins.drafters.eagle3.checkpoint import check_head_fits, head_config_for, load_head, random_head
from specfit.plugins.drafters.eagle3.head import Eagle3Head
from specfit.plugins.drafters.eagle3.probe import PROBE_FILE, AcceptanceProbe, entropies, load_probe


def head_feature_layers(cfg: Any, n: int) -> tuple[int, ...]:
    """HF hidden-state indices a head fuses on an ``n``-layer target: the last one alone
    (use_aux_hidden_state: false), the configured ids (shifted by their convention's offset), or
    EAGLE's default three."""
    if not cfg.use_aux_hidden_state:
        return (n,)
    if cfg.aux_layer_ids:
        layers = [i + cfg.aux_layer_offset for i in cfg.aux_layer_ids]
        if max(layers) > n or min(layers) < 0:
            raise ModelError(f"EAGLE-3 head eagle_aux_hidden_state_layer_ids {cfg.aux_layer_ids} do not fit a {n}-layer target")
        return tuple(layers)
    return tuple(default_feature_layers(n))


def default_feature_layers(n: int) -> list[int]:
    """EAGLE-3's three HF hidden-state indices for a head that names none: low, middle, high."""
    return [2, n // 2, n - 3] if n >= 4 else [min(2, n), n // 2 or 1, max(n - 3, 1)]


@dataclass
class Eagle3DrafterConfig(DrafterConfig):
    name: str = "eagle3"
    # head directory (public EAGLE-3 layout); null: the model's own head (model.draft_head, filled in
    # by specfit.build), else a random head (seeded); "random" forces a random head
    path: str | None = None
    top_k: int = 10
    depth: int = 7
    total_tokens: int = 60
    seed: int = 0
    # positions the head attends to (the latest ones): null, the window its checkpoint says it was
    # trained on (config.json attention_window; specfit's trainer writes its seq_len) or, without
    # one, all; 0, all; N, the latest N. A head used past its training window drafts worse
    attention_window: int | None = None
    # use the head's acceptance probe (acceptance_probe.safetensors beside its weights, written by
    # specfit fit-probe) where it has one: its logit at each expanded node goes into the tree
    acceptance_probe: bool = True
    # SGLang's names, accepted as aliases: --speculative-eagle-topk / -num-steps / -num-draft-tokens
    # (SGLang's num_draft_tokens counts the root: total_tokens = num_draft_tokens - 1)
    eagle_topk: int | None = None
    num_steps: int | None = None
    num_draft_tokens: int | None = None
    # vLLM's names: num_speculative_tokens (the depth of an EAGLE chain), and speculative_config as a
    # JSON string ('{"method": "eagle3", "model": DIR, "num_speculative_tokens": 5}'); see aliases.py
    num_speculative_tokens: int | None = None
    speculative_config: Any = None  # a JSON string, or a mapping (Hydra: {num_speculative_tokens: 5})

    def __post_init__(self) -> None:
        """Ranges the schema cannot express, and the aliases resolved into path / top_k / depth /
        total_tokens (so results record the values used); ``top_k`` against the draft vocabulary is
        checked in ``bind``."""
        from specfit.plugins.drafters.eagle3.aliases import resolve_all

        optional_integer("drafter.eagle_topk", self.eagle_topk, minimum=1)
        optional_integer("drafter.num_steps", self.num_steps, minimum=1)
        optional_integer("drafter.num_draft_tokens", self.num_draft_tokens, minimum=2)  # the root and a draft token
        optional_integer("drafter.num_speculative_tokens", self.num_speculative_tokens, minimum=1)
        resolve_all(self)
        check_tree_shape(self.top_k, self.depth, self.total_tokens)
        integer("drafter.seed", self.seed)
        optional_integer("drafter.attention_window", self.attention_window, minimum=0)


CATCH_UP_CHUNK = 512
"""Committed positions the head takes in one causal step when drafting starts (a prompt, or the
cycles a gate skipped). Attention scores are [heads, queries, keys] wherever a mask is given: a
32k-token prompt in one step would hold 32k x 32k of them per head; a chunk holds 512 x keys (x
the window's keys, where the head has one). Same result: each chunk attends to the cache so far."""


# Upper bounds of the draft tree. Published EAGLE-3 setups stay far below them (top_k <= 10, depth <= 8,
# 60-64 draft tokens); past them a tree costs more to draft than any acceptance repays, and a slip
# such as depth=100000 would draft to the end of the context on every cycle.
TREE_LIMITS = {"top_k": 64, "depth": 64, "total_tokens": 1024}


def check_tree_shape(top_k: int, depth: int, total_tokens: int) -> None:
    """``drafter.top_k`` / ``depth`` / ``total_tokens``: integers in [1, TREE_LIMITS], one line naming the key."""
    for key, value in (("top_k", top_k), ("depth", depth), ("total_tokens", total_tokens)):
        integer(f"drafter.{key}", value, minimum=1)
        if value > TREE_LIMITS[key]:
            raise ConfigError(f"drafter.{key}={value} exceeds {TREE_LIMITS[key]}, the largest draft tree specfit "
                              "builds (published EAGLE-3 setups use top_k <= 10, depth <= 8, total_tokens <= 64)")


def _alias(cfg: Eagle3DrafterConfig, field: str, alias: str, offset: int = 0) -> int:
    value, other = getattr(cfg, field), getattr(cfg, alias)
    default = getattr(Eagle3DrafterConfig, field)
    if other is None:
        return value
    if value != default and value != other + offset:
        raise ConfigError(f"drafter.{field}={value} and its alias drafter.{alias}={other} disagree")
    return other + offset


class Eagle3Drafter(DrafterBase):
    name = "eagle3"
    Config = Eagle3DrafterConfig

    def __init__(self, path: str | None = None, top_k: int = 10, depth: int = 7, total_tokens: int = 60,
                 seed: int = 0, head: Eagle3Head | None = None, attention_window: int | None = None,
                 acceptance_probe: bool | AcceptanceProbe = True) -> None:
        """``acceptance_probe``: True, the one in the head's directory if it has one; False, none;
        or a probe."""
        check_tree_shape(top_k, depth, total_tokens)
        optional_integer("drafter.attention_window", attention_window, minimum=0)
        self.path, self.top_k, self.depth, self.total_tokens, self.seed = path, top_k, depth, total_tokens, seed
        self.attention_window = attention_window
        self.unasked_random_head = False  # a random head stands in for one the user left out (see bind)
        from_dir = path if path and path != "random" else None
        self.head = head if head is not None else (load_head(path) if from_dir else None)
        if isinstance(acceptance_probe, AcceptanceProbe):
            self.probe: AcceptanceProbe | None = acceptance_probe
        elif acceptance_probe is True and from_dir and self.head is not None:
            self.probe = load_probe(from_dir, self.head.cfg.hidden_size)
        else:
            self.probe = None
        # the head's directory holds a probe this drafter does not use: another setup for what is
        # stored per setup (specfit.calibrate.fingerprint.setup_fingerprint), as its estimates differ
        self.probe_left_unused = (self.probe is None and from_dir is not None
                                  and (Path(from_dir).expanduser() / PROBE_FILE).is_file())

    @classmethod
    def from_config(cls, cfg: Eagle3DrafterConfig) -> Eagle3Drafter:
        return cls(path=cfg.path, top_k=_alias(cfg, "top_k", "eagle_topk"), depth=_alias(cfg, "depth", "num_steps"),
                   total_tokens=_alias(cfg, "total_tokens", "num_draft_tokens", offset=-1), seed=cfg.seed,
                   attention_window=cfg.attention_window, acceptance_probe=cfg.acceptance_probe)

    # ------------------------------------------------------------------ binding

    def bind(self, target: Any) -> None:
        model = target.model
        if self.head is None:  # no path (specfit.build sets it to model.draft_head when the model has one)
            self.head = random_head(head_config_for(model), seed=self.seed)
            self.unasked_random_head = self.path is None  # said when it first drafts (path=random asks for it)
        cfg, tc = self.head.cfg, model.config
        check_head_fits(self.head, tc)  # names the head and the mismatch
        if self.top_k > cfg.draft_vocab_size:  # a beam wider than the vocabulary it ranks
            raise ConfigError(f"drafter.top_k={self.top_k} exceeds the EAGLE-3 head's draft vocabulary "
                              f"({cfg.draft_vocab_size} tokens)")
        if cfg.vocab_size != tc.vocab_size:
            raise ModelError(f"EAGLE-3 head vocab_size {cfg.vocab_size} differs from the target's {tc.vocab_size}")
        if cfg.target_hidden_size != tc.hidden_size:
            raise ModelError(f"EAGLE-3 head expects target hidden size {cfg.target_hidden_size}, the target has {tc.hidden_size}")
        self.device, self.dtype = target.device, model.dtype
        self.head.to(device=self.device, dtype=self.dtype)
        if self.probe is not None:
            if self.probe.hidden_size != cfg.hidden_size:
                raise ModelError(f"the acceptance probe takes states of {self.probe.hidden_size} values, the EAGLE-3 "
                                 f"head's hidden_size is {cfg.hidden_size}")
        if self.head.embed_tokens is None:
            self.head.set_target_embedding(model.get_input_embeddings())
        if self.head.lm_head is None:  # a head saved without lm_head: the target's rows of its draft vocabulary
            self.head.set_target_lm_head(model.get_output_embeddings())
        self._layers = head_feature_layers(cfg, tc.num_hidden_layers)
        window = cfg.attention_window if self.attention_window is None else self.attention_window
        context = getattr(tc, "max_position_embeddings", None) or 1 << 31
        # 0, none in the checkpoint, or longer than any context the target takes: every position
        self.window = window if window and window < context else None

    def feature_layers(self) -> Sequence[int]:
        return self._layers

    # ------------------------------------------------------------------ sequence state

    def start(self, prompt_ids: Sequence[int], features: torch.Tensor | None, next_token: int) -> None:
        if self.unasked_random_head:  # at the first decode, not at bind: a build that fails says its error alone
            self.unasked_random_head = False
            note_once("drafter=eagle3 has no head (drafter.path is null and the model has no draft_head), so a "
                      "random head drafts and few drafts will be accepted; set drafter.path to an EAGLE-3 head "
                      "directory, or drafter.path=random to choose this")
        self.kv = self.head.new_cache(self.dtype, self.device)
        self.pending_features: list[torch.Tensor] = []  # one chunk per commit, joined when drafting starts
        self.pending_tokens: list[int] = []
        self._pending(prompt_ids, features, next_token)

    def commit(self, tokens: Sequence[int], features: torch.Tensor | None, next_token: int) -> None:
        self._pending(tokens, features, next_token)

    def _pending(self, tokens: Sequence[int], features: torch.Tensor | None, next_token: int) -> None:
        """Pairs (features at t, token t+1) the head has not seen yet; processed when drafting starts.

        Appended, not replaced: a cycle that did not draft (the selector skipped speculation) leaves
        its pairs for the next one. Kept as chunks, joined once when drafting starts: a gate that
        skips drafting for hundreds of cycles must not copy the growing backlog every cycle."""
        if features is None or features.shape[0] != len(tokens):
            raise RuntimeError("EAGLE-3 needs the target's features for every kept position")
        self.pending_features.append(features)
        self.pending_tokens.extend(tokens[1:])
        self.pending_tokens.append(next_token)

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def draft(self, tree: DraftTree) -> Iterator[range]:
        head, kv, k = self.head, self.kv, self.top_k
        committed = kv.length
        try:
            tokens = torch.tensor(self.pending_tokens, device=self.device)
            positions = torch.arange(committed, committed + len(tokens), device=self.device)
            chunks = self.pending_features
            features = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
            for lo in range(0, len(tokens), CATCH_UP_CHUNK):  # a long prompt a chunk at a time
                part = slice(lo, lo + CATCH_UP_CHUNK)
                hidden = head(head.project(features[part].to(self.dtype)), tokens[part], positions[part], kv,
                              window=self.window, last_only=True)  # the root's output is all drafting reads
            committed = kv.length
            self.pending_tokens, self.pending_features = [], []
            root_hidden = hidden[-1]

            logp = F.log_softmax(head.logits(root_hidden[None]).float(), dim=-1)[0]
            top = torch.topk(logp, min(k, logp.numel()))
            root_entropy = entropies(logp)
            tree.set_entropy([ROOT], [float(root_entropy)])
            if self.probe is not None:
                tops = _top2(top.values, logp)[None]
                tree.set_accept_logit([ROOT], self.probe(root_hidden[None], tops, root_entropy[None]))
            level = tree.add_level([ROOT] * len(top.indices), head.to_target_ids(top.indices).tolist(), top.values.tolist())
            beam = list(level)
            parent_hidden = {v: root_hidden for v in beam}
            slot: dict[int, int] = {}
            yield level

            for d in range(2, self.depth + 1):
                base = kv.length
                position = committed - 1 + (d - 1)  # of this level's inputs (the previous level's nodes)
                mask = torch.zeros(len(beam), base + len(beam), dtype=torch.bool)
                # the committed positions within the window (the tree's own are at most depth back)
                mask[:, 0 if self.window is None else max(position - self.window + 1, 0):committed] = True
                for i, v in enumerate(beam):
                    for a in tree.path_to(v)[:-1]:
                        mask[i, slot[a]] = True
                    mask[i, base + i] = True
                    slot[v] = base + i
                out = head(
                    torch.stack([parent_hidden[v] for v in beam]),
                    torch.tensor([tree.tokens[v] for v in beam], device=self.device),
                    torch.full((len(beam),), position, device=self.device),
                    kv,
                    mask.to(self.device),
                )
                logp = F.log_softmax(head.logits(out).float(), dim=-1)
                top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)  # [beam, k]
                kids = top.indices.shape[1]
                level_entropy = entropies(logp)
                tree.set_entropy(beam, level_entropy.tolist())
                if self.probe is not None:
                    tree.set_accept_logit(beam, self.probe(out, _top2(top.values, logp), level_entropy))
                level = tree.add_level(
                    [v for v in beam for _ in range(kids)],
                    head.to_target_ids(top.indices).flatten().tolist(),
                    top.values.flatten().tolist(),
                )
                scores = torch.tensor([tree.path_log_probs[v] for v in level])
                best = torch.topk(scores, min(k, len(level))).indices.tolist()
                beam = [level[i] for i in best]
                parent_hidden = {level[i]: out[i // kids] for i in best}
                yield level
        finally:
            kv.crop(committed)


def _top2(top_values: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """The top-2 log-probabilities the probe reads: those of the beam's top-k, or with top_k=1 its own."""
    return top_values if top_values.shape[-1] > 1 else torch.topk(logp, min(2, logp.shape[-1]), dim=-1).values

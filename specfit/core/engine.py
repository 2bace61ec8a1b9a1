"""The decode loop: draft a tree level by level, select a subtree, verify it, accept, commit.

Autoregressive decoding is the same loop with a drafter that proposes nothing: each cycle then
verifies only the root and commits the target's next token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch
from torch import nn

from specfit.core import guard
from specfit.core.acceptance import Acceptance, accept
from specfit.core.copy_engines import CopyEngine, LinkSettings, make_copy_engine
from specfit.core.offload import OffloadRuntime
from specfit.core.sampling import Sampler, SamplingParams
from specfit.core.stats import CycleRecord, RunStats, prediction_overlap
from specfit.core.target import Target
from specfit.core.tree import DraftTree, verify_block
from specfit.errors import ConfigError
from specfit.registry import check_plugin_instance
from specfit.validation import check_engine_args, device_arg, token_ids
from specfit.interfaces import Selection, SelectionContext


@dataclass
class CycleTrace:
    """Everything one cycle saw, for observers (trace recording, analysis); built only when observed."""

    tree: DraftTree
    block: Any  # the VerifyBlock that was verified
    argmax: list[int]  # the target's greedy token after each block position
    routing: Any  # np.ndarray int [len(block), layers, top_k], experts each verified token used
    accepted: list[int]  # accepted block positions
    bonus: int
    level_seconds: list[float]  # time since the cycle started, at the end of each draft level
    record: CycleRecord


class CycleObserver(Protocol):
    def on_prefill(self, prompt_ids: list[int], routing: Any, first_token: int) -> None: ...

    def on_cycle(self, trace: CycleTrace) -> None: ...


@dataclass
class GenerationOutput:
    token_ids: list[int]  # generated tokens (the prompt excluded)
    text: str | None  # decoded text, when the model has a tokenizer
    stats: dict[str, Any]  # the results.jsonl keys
    prompt_ids: list[int] = field(default_factory=list)
    cycles: list[CycleRecord] = field(default_factory=list)
    # "stop": a stop token ended it; "length": max_new_tokens or the context limit did (as vLLM reports it)
    finish_reason: str = "length"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Engine:
    """An offloaded MoE target plus its drafter, selector, cost model, predictor and expert cache.

    Building an Engine replaces the model's experts modules with offloaded ones (the model is
    modified in place) and moves the rest of the model to ``device``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        cache: Any = None,
        copy: str | CopyEngine = "torch",
        link: LinkSettings | None = None,
        drafter: Any = None,
        selector: Any = None,
        cost_model: Any = None,
        predictor: Any = None,
        tokenizer: Any = None,
        device: str | torch.device | None = None,
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 64,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        draft_head: str | None = None,
        info: dict[str, Any] | None = None,
        max_model_len: int | None = None,
    ) -> None:
        from specfit.registry import get_plugins

        builtin = get_plugins()
        check_engine_args(model, max_new_tokens, sampling)
        self.device = device_arg(device) if device is not None else default_device()
        self.copy_engine = copy if not isinstance(copy, str) else make_copy_engine(copy, self.device, link)
        cache = cache if cache is not None else builtin["cache"].get("lru").cls()
        self.runtime = OffloadRuntime(model, cache, self.copy_engine, self.device)
        model.to(self.device).eval()
        self.model = model
        self.spec = self.runtime.spec
        self.target = Target(model, self.runtime)
        self.target.draft_head = draft_head  # the model's own EAGLE-3 head, for drafters without one
        self.tokenizer = tokenizer
        self.drafter = drafter if drafter is not None else builtin["drafter"].get("none").cls()
        self.selector = selector if selector is not None else builtin["selector"].get("eagle3").cls()
        self.cost_model = cost_model
        self.predictor = predictor
        for kind, part in (("drafter", self.drafter), ("selector", self.selector), ("cost_model", cost_model),
                           ("predictor", predictor), ("cache", self.runtime.policy)):
            if part is not None:
                check_plugin_instance(kind, part)
        for needed in getattr(self.selector, "requires", ()):  # e.g. cost-aware selectors: cost_model, predictor
            if getattr(self, needed) is None:
                raise ConfigError(f"selector={self.selector.name} needs a {needed}: set {needed}=..."
                                  f" (e.g. {'cost_model=union' if needed == 'cost_model' else 'predictor=history'})")
        # Plug-ins are called through specfit.core.guard: their errors and bad values name them.
        guard.call("drafter", self.drafter, "bind", self.target)
        self.target.feature_layers = guard.feature_layers(self.drafter, getattr(model.config, "num_hidden_layers", None))
        for limit in ("depth", "total_tokens"):  # read every cycle: sizes of what the selector may choose
            guard.check_count("drafter", self.drafter, "bind", getattr(self.drafter, limit), f"drafter.{limit}")
        self._vocab = int(model.config.vocab_size)  # draft tokens must be target token ids
        guard.call("selector", self.selector, "bind", self.spec)
        if cost_model is not None:
            guard.call("cost_model", cost_model, "bind", self.spec)
        if predictor is not None:
            guard.call("predictor", predictor, "bind", self.target)
        self.observers: list[CycleObserver] = []
        # Commit at most this many accepted draft tokens per cycle (None: all). Trace recording
        # sets 0 to visit every position of the greedy output; greedy decoding only.
        self.accept_limit: int | None = None
        self.sampling = sampling or SamplingParams()
        self.max_new_tokens = max_new_tokens
        # prompt + output never exceed this (None: the model states no limit)
        self.max_model_len = context_limit(model.config, max_model_len)
        self.stop_token_ids = set(token_ids("stop_token_ids", stop_token_ids, model.config.vocab_size))
        if not ignore_eos:
            self.stop_token_ids |= _eos_ids(model, tokenizer)
        self.info = {
            "drafter": self.drafter.name,
            "selector": self.selector.name,
            "cache": self.runtime.policy.name,
            "cache_slots_per_layer": self.runtime.slots_per_layer,
            "copy_engine": self.copy_engine.describe(),
            "h2d_emulated": bool(self.copy_engine.emulated),
            **(info or {}),
        }

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int | None = None,
        sampling: SamplingParams | None = None,
    ) -> GenerationOutput:
        """Decode from ``prompt`` (text needs a tokenizer; token ids always work)."""
        ids = self.check_prompt(prompt)
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        check_engine_args(self.model, limit, sampling)
        sampler = Sampler(sampling or self.sampling)
        stats = RunStats(prompt_tokens=len(ids), info=dict(self.info))
        out: list[int] = []
        with torch.inference_mode():
            start = _now(self.device)
            prefill = self.target.prefill(ids)
            out.append(sampler.token(prefill.logits[-1], 0))
            guard.call("drafter", self.drafter, "start", ids, prefill.features, out[-1])
            if self.predictor is not None:
                guard.call("predictor", self.predictor, "observe", ids, prefill.routing)  # the prompt's routing: a free warm start
            for observer in self.observers:
                observer.on_prefill(ids, prefill.routing, out[-1])
            stats.prefill_seconds = _now(self.device) - start
            decode_start = self.runtime.stats.copy()
            while out[-1] not in self.stop_token_ids:
                context_room = self._context_room(len(ids) + len(out))
                room = limit - len(out) if context_room is None else min(limit - len(out), context_room)
                if room <= 0:
                    break
                sampler.position = len(out)  # the output index of the first token this cycle decides
                record, tokens = self._cycle(out[-1], sampler, context_room)
                tokens = self._truncate(tokens, room)
                record.committed = len(tokens)
                out.extend(tokens)
                stats.cycles.append(record)
            stats.total_seconds = _now(self.device) - start
            stats.cache = self.runtime.stats.since(decode_start)
        stats.output_tokens = len(out)
        stats.finish_reason = "stop" if out[-1] in self.stop_token_ids else "length"
        text = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationOutput(out, text, stats.summary(), prompt_ids=ids, cycles=stats.cycles,
                                finish_reason=stats.finish_reason)

    def check_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids, or a ConfigError when it is not usable (bad ids, no tokenizer for text,
        longer than the context limit). Commands call it on every prompt before decoding any."""
        ids = self._encode(prompt)
        self._check_prompt_fits(len(ids))
        return ids

    def _check_prompt_fits(self, prompt_tokens: int) -> None:
        """A prompt must leave room for at least one new token within the context limit."""
        limit = self.max_model_len
        if limit is not None and prompt_tokens >= limit:
            native = _native_context(self.model.config)
            source = "the model's max_position_embeddings" if limit == native else f"model.max_model_len={limit}"
            raise ConfigError(f"the prompt has {prompt_tokens} tokens, but the context limit is {limit} ({source}): "
                              f"no room for a new token; shorten the prompt")

    def _context_room(self, sequence_tokens: int) -> int | None:
        """Tokens that may still be committed after ``sequence_tokens`` (prompt + output); None: no limit.

        The newest token sits at position ``sequence_tokens - 1`` and is the root of the next draft
        tree, so a draft node of depth d would sit at ``sequence_tokens - 1 + d``: depths up to
        this room keep every verified token inside the context."""
        return None if self.max_model_len is None else self.max_model_len - sequence_tokens

    # ------------------------------------------------------------------ one cycle

    def _cycle(self, root: int, sampler: Sampler, room: int | None = None) -> tuple[CycleRecord, list[int]]:
        """One draft-select-verify cycle; ``room``: the deepest draft level the context has room for."""
        t0 = _now(self.device)
        tree = DraftTree(root_token=root)
        selection = Selection(nodes=[])
        select_seconds = 0.0
        level_seconds: list[float] = []
        levels = guard.drafted_levels(self.drafter, tree, self._vocab) if should_draft(self.selector) else iter(())
        for level in levels:
            if self.predictor is not None:
                guard.call("predictor", self.predictor, "predict", tree, level)
                guard.check_predicted_experts(self.predictor, tree, level, self.spec.num_layers, self.spec.top_k,
                                              self.spec.num_experts)
            t_sel = _now(self.device)
            level_seconds.append(t_sel - t0 - select_seconds)
            ctx = SelectionContext(
                resident=self.runtime.resident(),
                draft_seconds=t_sel - t0,  # everything this cycle has spent so far
                max_depth=self.drafter.depth if room is None else min(self.drafter.depth, room),
                max_nodes=self.drafter.total_tokens,
                cost_model=self.cost_model,
            )
            selection = guard.check_selection(self.selector, tree, guard.call("selector", self.selector, "select", tree, ctx))
            select_seconds += _now(self.device) - t_sel
            if selection.stop or (room is not None and tree.depth >= room):  # never draft past the context
                break
        if hasattr(levels, "close"):
            levels.close()  # the drafter tidies up (drops its tree KV) now, not when garbage-collected
        t_verify = _now(self.device)
        draft_seconds = t_verify - t0 - select_seconds

        block = verify_block(tree, selection.nodes)  # checked by guard.check_selection
        before = self.runtime.stats.copy()
        prefix = self.target.kv_len
        result = self.target.verify(block)
        acc = accept(block, result.logits, sampler)
        if self.accept_limit is not None and len(acc.path) > self.accept_limit:
            if not sampler.params.greedy:
                raise ConfigError("accept_limit (trace recording) needs greedy decoding")
            path = acc.path[: self.accept_limit]
            acc = Acceptance(path, int(torch.argmax(result.logits[path[-1] if path else 0])))
        kept = [0] + acc.path
        self.target.keep(prefix, kept)
        verify_seconds = _now(self.device) - t_verify
        during = self.runtime.stats.since(before)

        kept_tokens = [block.tokens[p] for p in kept]
        features = result.features[kept] if result.features is not None else None
        guard.call("drafter", self.drafter, "commit", kept_tokens, features, acc.bonus)
        if sampler.params.greedy:
            tree.greedy_next = acc.bonus
        guard.call("selector", self.selector, "observe", tree, selection.nodes, [block.nodes[p - 1] for p in acc.path])
        if self.predictor is not None:
            guard.call("predictor", self.predictor, "observe", kept_tokens, result.routing[kept])
        quality = prediction_overlap(tree, block, result.routing)
        record = CycleRecord(
            drafted=len(tree),
            levels=tree.depth,
            verified=len(block) - 1,
            accepted=len(acc.path),
            committed=len(acc.path) + 1,
            draft_seconds=draft_seconds,
            select_seconds=select_seconds,
            verify_seconds=verify_seconds,
            h2d_seconds=during.h2d_seconds,
            total_seconds=_now(self.device) - t0,
            misses=during.misses,
            hits=during.hits,
            union=[int(u) for u in during.union_sum],
            predicted=dict(selection.predicted),
            prediction=quality,
        )
        if self.cost_model is not None:
            guard.call("cost_model", self.cost_model, "observe", record)
        report_time(self.selector, record.levels > 0, record.committed, record.total_seconds)
        if self.observers:
            trace = CycleTrace(tree, block, result.logits.argmax(dim=-1).tolist(), result.routing, acc.path, acc.bonus,
                               level_seconds, record)
            for observer in self.observers:
                observer.on_cycle(trace)
        return record, kept_tokens[1:] + [acc.bonus]

    def _truncate(self, tokens: list[int], room: int) -> list[int]:
        tokens = tokens[:room]
        for i, t in enumerate(tokens):
            if t in self.stop_token_ids:
                return tokens[: i + 1]
        return tokens

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("this model has no tokenizer: give the prompt as token ids (prompt_ids=[...])")
            ids = self.tokenizer(prompt)["input_ids"]  # the tokenizer's own defaults (BOS where it adds one)
        else:
            ids = token_ids("prompt", prompt)  # ints only: no floats, bools, strings or nested lists
        if not ids:
            raise ConfigError("the prompt is empty")
        return token_ids("prompt", ids, self.model.config.vocab_size)


def context_limit(config: Any, override: int | None = None) -> int | None:
    """The most tokens (prompt + output) the target holds: ``max_position_embeddings`` of its config,
    or a smaller ``override`` (``model.max_model_len``, as in vLLM); None when neither is known."""
    native = _native_context(config)
    if override is None:
        return native
    if isinstance(override, bool) or not isinstance(override, int) or override < 2:
        raise ConfigError(f"model.max_model_len={override!r} must be an integer >= 2 (a prompt token and a new one)")
    if native is not None and override > native:
        raise ConfigError(f"model.max_model_len={override} exceeds the model's context limit {native} "
                          f"(max_position_embeddings, with its RoPE scaling)")
    return override


def _native_context(config: Any) -> int | None:
    """``max_position_embeddings``, extended by a RoPE scaling factor as vLLM derives it (YaRN:
    ``original_max_position_embeddings x factor``; linear and dynamic: ``max_position_embeddings x factor``)."""
    native = getattr(config, "max_position_embeddings", None)
    if not isinstance(native, int) or isinstance(native, bool) or native <= 0:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict) or not isinstance(rope.get("factor"), (int, float)):
        return native
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", "su", "longrope", "llama3"):
        return native
    base = rope.get("original_max_position_embeddings", native) if kind == "yarn" else native
    return int(base * rope["factor"])


def should_draft(selector: Any) -> bool:
    """Selectors may skip drafting for a cycle (``should_draft``, optional): the root alone is verified."""
    if getattr(selector, "should_draft", None) is None:
        return True
    answer = guard.call("selector", selector, "should_draft")
    return guard.check_flag("selector", selector, "should_draft", answer, "the answer")


def report_time(selector: Any, drafted: bool, committed: int, seconds: float) -> None:
    """Selectors may learn from each finished cycle's time (``observe_time``, optional)."""
    if getattr(selector, "observe_time", None) is not None:
        guard.call("selector", selector, "observe_time", drafted, committed, seconds)


def _eos_ids(model: nn.Module, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids |= set(eos) if isinstance(eos, (list, tuple, set)) else {int(eos)}
    return ids


def _now(device: torch.device) -> float:
    """Wall clock, after the device has finished its queued work (so timings are real)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()

"""The decode loop: prefill, then cycles (draft a tree level by level, select a subtree, verify it,
accept, commit) until a stop token, ``max_new_tokens`` or the context limit.

The cycle itself is :class:`specfit.decode.cycle.Cycle`, shared with trace replay; here it runs
against the target through :class:`specfit.decode.live.LiveVerifier`. Autoregressive decoding is the same loop with a
drafter that proposes nothing: each cycle then verifies only the root and commits the target's
next token.
"""

from __future__ import annotations

from dataclasses import dataclass
import itertools
import time
from typing import Any, Iterator, Protocol, Sequence

import torch
from torch import nn

from specfit.decode.args import check_engine_args, check_plain_engine_args
from specfit.decode.cycle import Cycle, CycleObserver, bind_estimator_target, target_prob
from specfit.decode.limits import context_limit, encode_prompt, eos_ids, native_context
from specfit.decode.live import LiveVerifier, device_now
from specfit.decode.restore import dense_placement, forward_hooks, restore_dense_placement, restore_forward_hooks
from specfit.decode.sampling import Sampler, SamplingParams
from specfit.decode.output import GenerationOutput, IncrementalDetokenizer, StreamEvent, memory_info
from specfit.errors import ConfigError
from specfit.interfaces import CostModel, Drafter, ExpertCache, ExpertPredictor, Prefetcher, Selector, guard
from specfit.interfaces.contracts import check_parts
from specfit.messages import note_once
from specfit.model.numerics import apply_numerics, check_numerics, numerics_info
from specfit.model.target import Target
from specfit.offload.copy.base import CopyEngine, waits_measured
from specfit.offload.copy.factory import make_copy_engine
from specfit.offload.prefetch import LiveSink
from specfit.offload.runtime import OffloadRuntime
from specfit.offload.store import HostExpertStore
from specfit.types.context import TokenContext
from specfit.types.link_profiles import LinkSettings
from specfit.types.stats import CycleRecord, RunStats
from specfit.validation import device_arg, integer, is_collection, token_ids


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_given_parts(**parts: Any) -> None:
    """The parts an :class:`EngineCore` is given: a drafter, a selector and a cache at least, each
    fulfilling its kind's contract, and what the selector requires."""
    missing = [kind for kind in ("drafter", "selector", "cache") if parts[kind] is None]
    if missing:
        raise ConfigError(f"EngineCore needs a {', '.join(missing)}: give one, or use specfit.Engine, "
                          "which fills the registered defaults")
    check_parts(parts)


@dataclass
class _OpenDecode:
    """The decode a stream runs, so that starting another can cancel it."""

    events: Iterator[StreamEvent] | None = None


class DecodeListener(Protocol):
    """Told of the engine's progress; never changes a part or the output."""

    def cycle_ended(self, record: CycleRecord) -> None:
        """A cycle committed its tokens (``record``: what it measured)."""

    def decode_ended(self) -> None:
        """A decode ended (called outside its timed span)."""


class EngineCore:
    """An offloaded MoE target plus its drafter, selector, cost model, predictor and expert cache.

    Building one replaces the model's experts modules with offloaded ones (the model is modified
    in place) and moves the rest of the model to ``device``. Every part is given: the engine names
    no plug-in. :class:`specfit.Engine` (:mod:`specfit.api`) is this class with the registered
    defaults filled in for a drafter, selector or cache left out.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        cache: ExpertCache | None = None,
        copy: str | CopyEngine = "torch",
        link: LinkSettings | None = None,
        drafter: Drafter | None = None,
        selector: Selector | None = None,
        cost_model: CostModel | None = None,
        predictor: ExpertPredictor | None = None,
        tokenizer: Any = None,
        device: str | torch.device | None = None,
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 64,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        info: dict[str, Any] | None = None,
        max_model_len: int | None = None,
        expert_store: HostExpertStore | None = None,
        expert_compute: str = "auto",
        numerics: str = "exact",
        prefetcher: Prefetcher | None = None,
    ) -> None:
        check_engine_args(model, max_new_tokens, sampling)
        check_numerics(numerics)
        check_given_parts(drafter=drafter, selector=selector, cost_model=cost_model, predictor=predictor,
                          cache=cache, prefetch=prefetcher)
        # every plain argument before the runtime takes the model's experts (it changes the model in place)
        self.device = device_arg(device) if device is not None else default_device()
        check_plain_engine_args(self.device, copy, link, tokenizer, ignore_eos)
        if link is not None and copy != "emulated":  # as the config's note says: set for the runs it applies to
            given = repr(copy) if isinstance(copy, str) else f"{type(copy).__name__}(...) (an engine built already)"
            note_once(f"link= sets the emulated link, which only copy='emulated' builds and charges; "
                      f"copy={given} does not read it")
        self.copy_engine = copy if not isinstance(copy, str) else make_copy_engine(copy, self.device, link)
        stop_ids = set(token_ids("stop_token_ids", stop_token_ids, model.config.vocab_size))
        self.max_model_len = context_limit(model.config, max_model_len)  # prompt + output never exceed it (None: no limit)
        hooks, tensors = forward_hooks(model), dense_placement(model)
        self.runtime = OffloadRuntime(model, cache, self.copy_engine, self.device, store=expert_store,
                                      compute=expert_compute)
        try:
            self._bind(model, tokenizer, drafter, selector, cost_model, predictor, prefetcher, numerics)
        except BaseException as exc:  # hand the model on: the next Engine over it takes the experts from this store
            self.runtime.orphan()  # first: it cannot fail, and a restore below might
            try:
                restore_forward_hooks(hooks)
                restore_dense_placement(model, tensors)  # as loaded: numerics and device are the next Engine's
            except Exception as restore_error:  # the build's own error is the one to report
                exc.add_note(f"specfit: restoring the model after this failure also failed: {restore_error!r:.200}")
            raise
        self.sampling = sampling or SamplingParams()
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = stop_ids if ignore_eos else stop_ids | eos_ids(model, tokenizer)
        self.info = {**self._describe(model, numerics), **(info or {})}

    def _bind(self, model: nn.Module, tokenizer: Any, drafter: Drafter, selector: Selector,
              cost_model: CostModel | None, predictor: ExpertPredictor | None, prefetcher: Prefetcher | None,
              numerics: str) -> None:
        """The model on its device and every plug-in bound to it (the runtime is installed)."""
        apply_numerics(model, numerics)  # the experts are the runtime's now: only dense weights are upcast
        model.to(self.device).eval()
        self.model = model
        self.spec = self.runtime.spec
        self.target = Target(model, self.runtime)
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.selector = selector
        self.cost_model = cost_model
        self.predictor = predictor
        # Plug-ins are called through specfit.interfaces.guard: their errors and bad values name them.
        guard.call("drafter", self.drafter, "bind", self.target)
        self.target.feature_layers = guard.feature_layers(self.drafter, getattr(model.config, "num_hidden_layers", None))
        # read every cycle: sizes of what the selector may choose
        guard.check_count("drafter", self.drafter, "bind", self.drafter.depth, "drafter.depth")
        guard.check_count("drafter", self.drafter, "bind", self.drafter.total_tokens, "drafter.total_tokens")
        self.target.check_drafter(self.drafter.name, self.drafter.depth)  # e.g. no tree over a recurrent state
        self._vocab = int(model.config.vocab_size)  # draft tokens must be target token ids
        guard.call("selector", self.selector, "bind", self.spec)
        if cost_model is not None:
            guard.call("cost_model", cost_model, "bind", self.spec)
        if predictor is not None:
            guard.call("predictor", predictor, "bind", self.target)
        bind_estimator_target(self.selector, self.target)
        self.prefetcher = prefetcher
        self.prefetch_sink: LiveSink | None = None
        if prefetcher is not None:  # bound with a live sink: its copies go to the runtime, checked
            self.prefetch_sink = LiveSink(prefetcher, self.runtime, cost_model)
            self.prefetch_sink.call("bind", self.target, self.prefetch_sink)
        # copies overlap other work and their stall is measured on the host (a prefetcher over the
        # emulated link, or a CUDA engine with a measuring timing): cycles' times then hold the
        # stall, not the issued copies
        self.copies_overlap = prefetcher is not None and prefetcher.name != "none" and waits_measured(self.copy_engine)
        self.listeners: list[DecodeListener] = []
        self._open: _OpenDecode | None = None  # the stream being decoded, if one is
        self.stall_measured = waits_measured(self.copy_engine)  # its waits are the host's

    def _describe(self, model: nn.Module, numerics: str) -> dict[str, Any]:
        """The engine's parts and settings, for every run's results."""
        return {
            "drafter": self.drafter.name,
            "selector": self.selector.name,
            "cache": self.runtime.policy.name,
            "prefetch": self.prefetcher.name if self.prefetcher is not None else "none",
            "cache_slots_per_layer": self.runtime.slots_per_layer,
            "copy_engine": self.copy_engine.describe(),
            "h2d_emulated": bool(self.copy_engine.emulated),
            "h2d_stall_measured": self.stall_measured,  # the stall is the host's wait (see verify_compute_seconds)
            "expert_compute": self.runtime.compute.name,
            **numerics_info(numerics, self.spec, model),
            **memory_info(self.runtime, model),
        }

    # ------------------------------------------------------------------ public API

    def add_listener(self, listener: DecodeListener) -> None:
        """Call ``listener`` after every cycle and at the end of every decode (outside its timed
        span): e.g. the keeper that saves what a selector learned for the next engine of its setup."""
        self.listeners.append(listener)

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int | None = None,
        sampling: SamplingParams | None = None,
        *,
        selector: Selector | None = None,
        predict: bool = True,
        observers: Sequence[CycleObserver] = (),
        accept_limit: int | None = None,
    ) -> GenerationOutput:
        """Decode from ``prompt`` (text needs a tokenizer; token ids always work): one prompt; a
        list of prompts is refused (decode each in turn).

        Trace recording and calibration decode with their own settings, passed here rather than
        set on the engine: ``selector`` replaces the engine's for this call (already bound to
        ``engine.spec``), ``predict=False`` runs without the predictor, ``observers`` see every
        cycle, and ``accept_limit`` commits at most that many draft tokens per cycle (greedy only).
        """
        for event in self.stream(prompt, max_new_tokens, sampling, selector=selector, predict=predict,
                                 observers=observers, accept_limit=accept_limit):
            pass
        return event.output

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int | None = None,
        sampling: SamplingParams | None = None,
        *,
        selector: Selector | None = None,
        predict: bool = True,
        observers: Sequence[CycleObserver] = (),
        accept_limit: int | None = None,
    ) -> Iterator[StreamEvent]:
        """:meth:`generate`, yielding as tokens are committed: the first token after the prefill,
        then each cycle's tokens (several at once where a cycle accepted a draft) and the text they
        add; the last event holds ``finish_reason`` and ``output``, what ``generate`` returns.

        The arguments are checked now, before anything is decoded. Closing the iterator early (or
        dropping it) cancels the decode at that cycle boundary: copies in flight are settled and
        the engine is ready for the next prompt, as after a finished one. One decode runs at a
        time: starting another cancels one still open."""
        ids = self.check_prompt(prompt)
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        self._check_generate_args(limit, sampling, observers, accept_limit)
        if self._open is not None:
            self._open.events.close()  # an earlier stream left open: cancelled here, not interleaved
        cycle = self._cycle(selector, predict, observers, accept_limit)
        self._open = decode = _OpenDecode()
        decode.events = self._events(ids, limit, cycle, Sampler(sampling or self.sampling), decode)
        return decode.events

    def _events(self, ids: list[int], limit: int, cycle: Cycle, sampler: Sampler,
                decode: _OpenDecode) -> Iterator[StreamEvent]:
        """The decode itself (see :meth:`stream`); the caller's time between events (host clock:
        no device sync for it) is left out of the decode's measured seconds."""
        stats = RunStats(prompt_tokens=len(ids), info=dict(self.info))
        counted = self._prefetch_counters()
        text = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        away = 0.0  # seconds the caller held the stream between events
        try:
            with torch.inference_mode():
                self.runtime.settle_copies()  # a decode an error cut short left some: counted before this one
                start = device_now(self.device)
                out, decode_start = self._prefill(ids, cycle, sampler, stats, start)
            for tokens in itertools.chain([list(out)], self._decode(ids, out, limit, cycle, sampler, stats)):
                paused = time.perf_counter()  # the prefill's first token, then each cycle's
                yield StreamEvent(tokens, text.add(out) if text else None)
                away += time.perf_counter() - paused
            with torch.inference_mode():
                stats.total_seconds = device_now(self.device) - start - away
                self.runtime.settle_copies()  # copies never waited for: their own time, not their enqueue time
                stats.cache = self.runtime.stats.since(decode_start)
        except GeneratorExit:  # closed early: cancelled at this cycle boundary, nothing left in flight
            with torch.inference_mode():
                self.runtime.settle_copies()
            self._decode_ended()
            raise
        finally:
            if self._open is decode:
                self._open = None
        self._decode_ended()
        stats.output_tokens = len(out)
        stats.finish_reason = "stop" if out[-1] in self.stop_token_ids else "length"
        stats.prefetch_counters = {k: v - counted.get(k, 0) for k, v in self._prefetch_counters().items()}
        full = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer is not None else None
        output = GenerationOutput(out, full, stats.summary(), prompt_ids=ids, cycles=stats.cycles,
                                  finish_reason=stats.finish_reason)
        yield StreamEvent([], text.rest(out) if text else None, stats.finish_reason, output)

    def _decode_ended(self) -> None:
        """Outside the decode's timed span: e.g. what the selector learned is saved between decodes."""
        for listener in self.listeners:
            listener.decode_ended()

    def _check_generate_args(self, limit: int, sampling: SamplingParams | None, observers: Sequence[CycleObserver],
                             accept_limit: int | None) -> None:
        check_engine_args(self.model, limit, sampling)
        if accept_limit is not None:
            integer("accept_limit", accept_limit, minimum=0)
            if not (sampling or self.sampling).greedy:
                raise ConfigError("accept_limit (trace recording) needs greedy decoding (sampling.temperature=0)")
        if not is_collection(observers) or not all(isinstance(o, CycleObserver) for o in observers):
            raise ConfigError(f"observers={observers!r:.60} must be a list of objects with on_prefill and on_cycle")

    def _cycle(self, selector: Selector | None, predict: bool, observers: Sequence[CycleObserver],
               accept_limit: int | None) -> Cycle:
        """The cycle this decode runs, with the engine's parts or the call's own selector."""
        predictor = self.predictor if predict else None
        selector = self.selector if selector is None else selector
        if selector is not self.selector or predictor is not self.predictor:  # checked as the engine's own are
            check_parts({"selector": selector, "cost_model": self.cost_model, "predictor": predictor})
        verifier = LiveVerifier(self.target, self.runtime, self.drafter, self.device, vocab=self._vocab,
                                copies_overlap=self.copies_overlap, stall_measured=self.stall_measured)
        return Cycle(verifier, self.spec, selector, predictor, self.cost_model, accept_limit,
                     tuple(observers), self.stop_token_ids, self.prefetcher, self.prefetch_sink)

    def _prefill(self, ids: list[int], cycle: Cycle, sampler: Sampler, stats: RunStats,
                 start: float) -> tuple[list[int], Any]:
        """The prompt's pass and the first token, which every part that keeps a sequence starts
        from; returns the output so far and the runtime's counts when decoding starts."""
        before_prefill = self.runtime.stats.copy()
        prefill = self.target.prefill(ids)
        first = sampler.token(prefill.logits[-1], 0)
        cycle.root_prob = target_prob(prefill.logits[-1], first, sampler)  # the first root's, for estimators
        cycle.context = TokenContext([*ids, first])
        guard.call("drafter", self.drafter, "start", ids, prefill.features, first)
        if cycle.predictor is not None:
            guard.call("predictor", cycle.predictor, "observe", ids, prefill.routing)  # the prompt's routing: a free warm start
        for observer in cycle.observers:
            observer.on_prefill(ids, prefill.routing, first)
        stats.prefill_seconds = device_now(self.device) - start
        self.runtime.settle_copies(landed_only=True)  # the prefill's unwaited copies count in it
        decode_start = self.runtime.stats.copy()
        stats.prefill_cache = decode_start.since(before_prefill)
        return [first], decode_start

    def _decode(self, ids: list[int], out: list[int], limit: int, cycle: Cycle, sampler: Sampler,
                stats: RunStats) -> Iterator[list[int]]:
        """Cycles until a stop token, ``limit`` new tokens or the context limit; ``out`` grows by
        each cycle's tokens, ``stats`` by its record; yields each cycle's tokens."""
        while out[-1] not in self.stop_token_ids:
            context_room = self._context_room(len(ids) + len(out))
            room = limit - len(out) if context_room is None else min(limit - len(out), context_room)
            if room <= 0:
                break
            sampler.position = len(out)  # the output index of the first token this cycle decides
            with torch.inference_mode():
                record, tokens = cycle.run(out[-1], sampler, self.drafter.depth, self.drafter.total_tokens,
                                           room=context_room, max_commit=room)
            out.extend(tokens)
            stats.cycles.append(record)
            for listener in self.listeners:
                listener.cycle_ended(record)
            yield list(tokens)

    def _prefetch_counters(self) -> dict[str, int]:
        """The prefetcher's ``counters()`` (none without one), checked."""
        return {} if self.prefetch_sink is None else self.prefetch_sink.counters()

    def check_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids, or a ConfigError when it is not usable (bad ids, no tokenizer for text,
        longer than the context limit). Commands call it on every prompt before decoding any."""
        ids = encode_prompt(prompt, self.tokenizer, self.model.config.vocab_size)
        self._check_prompt_fits(len(ids))
        return ids

    def _check_prompt_fits(self, prompt_tokens: int) -> None:
        """A prompt must leave room for at least one new token within the context limit."""
        limit = self.max_model_len
        if limit is not None and prompt_tokens >= limit:
            raise ConfigError(f"the prompt has {prompt_tokens} tokens, but the context limit is "
                              f"{self.context_source()}: no room for a new token; shorten the prompt")

    def context_source(self) -> str:
        """The context limit and where it comes from, e.g. ``8 (model.max_model_len=8)``."""
        limit = self.max_model_len
        native = native_context(self.model.config)
        source = "the model's max_position_embeddings" if limit == native else f"model.max_model_len={limit}"
        return f"{limit} ({source})"

    def _context_room(self, sequence_tokens: int) -> int | None:
        """Tokens that may still be committed after ``sequence_tokens`` (prompt + output); None: no limit.

        The newest token sits at position ``sequence_tokens - 1`` and is the root of the next draft
        tree, so a draft node of depth d would sit at ``sequence_tokens - 1 + d``: depths up to
        this room keep every verified token inside the context."""
        return None if self.max_model_len is None else self.max_model_len - sequence_tokens

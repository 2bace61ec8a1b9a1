"""The trace format: what a recording keeps of every position of the greedy output, on disk.

A trace is a directory::

    meta.json          format name and version, the model's MoESpec numbers, the drafter's limits,
                       stop tokens, the resolved config, the calibrated cost constants (if any),
                       and one entry per sequence (prompt) naming its file
    seq-00000.npz      one sequence: flat arrays with offsets, no pickles

Per sequence (N positions; M drafted nodes and V verified nodes over all positions; L MoE layers,
top-k K):

    prompt [P] int32, output [O] int32        the prompt and the greedy output (O = N + 1)
    prefill_routing [P, L, K]                 experts each prompt token was routed to
    node_offsets [N+1] int64                  position i owns nodes node_offsets[i]:node_offsets[i+1]
    node_token, node_parent, node_depth [M]   the whole drafted tree, in creation (level) order, so
    node_log_prob [M] float64                 local indices are the live tree's node indices; parent
                                              is a local index (-1: the root); log q in float64 so
                                              path sums replay bit-exactly
    verified_offsets [N+1] int64              position i owns verified rows verified_offsets[i]:...
    verified_node [V] int32                   the local node index of each verified row (ascending)
    verified_argmax [V] int32                 the target's greedy token after the node
    verified_routing [V, L, K]                the node's routed experts (a node's routing depends only
                                              on its ancestors, so any subtree holding it agrees)
    root_argmax [N] int32, root_routing [N, L, K]   the same for each position's root (output[i])
    level_offsets [N+1] int64                 position i owns levels level_offsets[i]:level_offsets[i+1]
    level_seconds [sum levels] float64        time since the cycle started at the end of each level
    node_entropy [M] float32                  the draft head's entropy at each node it expanded (NaN:
    root_entropy [N] float32                  not expanded, or not told), and at each root
    root_prob [N] float64                     the target's probability of each root token where it
                                              produced it (NaN: not told); all go back into the
                                              replayed trees for acceptance estimators
    node_accept_logit [M] float32             the drafter's acceptance logit at each node it expanded
    root_accept_logit [N] float32             and at each root (its acceptance probe; NaN: none)

Format version 1 had no ``node_entropy``, ``root_entropy`` and ``root_prob``, version 2 no
``*_accept_logit``: such traces still load (the arrays read as NaN; for version 1
:attr:`Trace.notes` says so, while a version-2 trace reads as one recorded by a head without an
acceptance probe), and replay exactly what they recorded.

The verified nodes are the recording's candidate union (see :mod:`specfit.trace.record`); the other
drafted nodes are kept so that selectors and predictors see the very tree they saw live.
Expert ids are stored as uint8 when the model has at most 256 experts (int16 / int32 otherwise).

Every file is written atomically (temporary file + rename, :mod:`specfit.files`), each sequence as
soon as it is recorded, and ``meta.json`` last. While a recording runs the folder holds
``partial.json`` (the recording's config and model numbers) instead: a folder without ``meta.json``
is an incomplete trace, which :func:`load_trace` refuses and ``specfit record ... resume=true``
continues from its last complete sequence (:class:`TraceWriter`). Sequence file names in
``meta.json`` must be plain names inside the folder; anything else is refused.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Generator

import numpy as np

from specfit.errors import ConfigError
from specfit.files import check_writable, missing_directory, remove_stale_temporaries, write_atomic
from specfit.interfaces.exchange import ACCEPTED_KEY  # noqa: F401 - defined with SelectionContext; replay imports it here

FORMAT = "specfit-trace"
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # older versions lack the arrays of ADDED_IN (read as NaN)
META_FILE = "meta.json"
PARTIAL_FILE = "partial.json"  # present while a recording runs (or was interrupted); meta.json replaces it


_ARRAYS = ("prompt", "output", "prefill_routing", "node_offsets", "node_token", "node_parent", "node_depth",
           "node_log_prob", "verified_offsets", "verified_node", "verified_argmax", "verified_routing", "root_argmax",
           "root_routing", "level_offsets", "level_seconds", "node_entropy", "root_entropy", "root_prob",
           "node_accept_logit", "root_accept_logit")
# version -> the arrays it added (absent from older traces; read as NaN)
ADDED_IN = {2: ("node_entropy", "root_entropy", "root_prob"), 3: ("node_accept_logit", "root_accept_logit")}


class TraceError(ConfigError):
    """A trace directory is missing, incomplete, corrupt, or written by another format version."""


def expert_dtype(num_experts: int) -> np.dtype:
    """The smallest integer type that holds every expert id (routing is most of a trace's bytes)."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32767:
        return np.dtype(np.int16)
    return np.dtype(np.int32)


@dataclass
class TracePosition:
    """One position of the greedy output: the drafted tree after its root and what the target said
    about its verified nodes (array views into the sequence)."""

    root: int  # the root token (the last committed token)
    tokens: np.ndarray  # [n] int32, every drafted node, in level order
    parents: np.ndarray  # [n] int32, local index of the parent, -1 for the root
    depths: np.ndarray  # [n] int16, 1-based
    log_probs: np.ndarray  # [n] float64
    verified: np.ndarray  # [v] int32, local indices of the verified nodes (ascending)
    argmax: np.ndarray  # [v] int32, the target's greedy token after each verified node
    routing: np.ndarray  # [v, layers, top_k]
    root_argmax: int
    root_routing: np.ndarray  # [layers, top_k]
    level_seconds: np.ndarray  # [levels] float64
    entropy: np.ndarray  # [n] float32, the head's entropy at each expanded node (NaN: unknown)
    root_entropy: float  # NaN: unknown
    root_prob: float  # the target's probability of the root token; NaN: unknown
    accept_logit: np.ndarray  # [n] float32, the drafter's acceptance logit at each expanded node (NaN: unknown)
    root_accept_logit: float  # NaN: unknown

    @property
    def levels(self) -> int:
        return len(self.level_seconds)

    def __len__(self) -> int:
        return len(self.tokens)

    def level(self, d: int) -> range:
        """Local indices of the nodes of level ``d`` (1-based), a contiguous range."""
        lo, hi = np.searchsorted(self.depths, [d, d + 1])
        return range(int(lo), int(hi))

    def rows(self, nodes: Any) -> np.ndarray:
        """Verified-row index of each node, -1 for a node that was drafted but not verified."""
        nodes = np.asarray(nodes, dtype=np.int64)
        if not len(self.verified):
            return np.full(len(nodes), -1, dtype=np.int64)
        rows = np.minimum(np.searchsorted(self.verified, nodes), len(self.verified) - 1)
        return np.where(self.verified[rows] == nodes, rows, -1)

    def draft(self, tree: Any) -> Generator[range, None, None]:
        """Grow ``tree`` (a :class:`specfit.types.tree.DraftTree` of this root) level by level as the
        drafter did: the root's entropy and acceptance logit before level 1, each level's with the
        next level, and the root probability (None where the recording did not have them)."""
        tree.root_prob = self.known_root_prob
        tree.root_entropy = self.root_entropy
        tree.root_accept_logit = self.root_accept_logit
        for d in range(1, self.levels + 1):
            if d > 1:
                above = self.level(d - 1)
                for values, record in ((self.entropy, tree.set_entropy), (self.accept_logit, tree.set_accept_logit)):
                    values = values[above.start:above.stop]
                    if not np.all(np.isnan(values)):
                        record(list(above), values)
            part = self.level(d)
            yield tree.add_level(self.parents[part].tolist(), self.tokens[part].tolist(), self.log_probs[part].tolist())

    @property
    def known_root_prob(self) -> float | None:
        """The root probability, None where the recording did not have it."""
        return None if math.isnan(self.root_prob) else self.root_prob

    def accepted_path(self) -> list[int]:
        """Nodes the target accepts if every verified node is verified: from the root, the first
        verified child (in creation order) whose token is the argmax after its parent, as greedy
        decoding walks a verified block."""
        path: list[int] = []
        parent, want = -1, self.root_argmax
        verified = self.verified
        while True:
            kids = verified[self.parents[verified] == parent]
            nxt = next((int(v) for v in kids if self.tokens[v] == want), None)
            if nxt is None:
                return path
            path.append(nxt)
            parent, want = nxt, int(self.argmax[self.rows([nxt])[0]])


@dataclass
class TraceSequence:
    """One prompt's recording: flat arrays with per-position offsets (see the module doc)."""

    prompt: np.ndarray
    output: np.ndarray
    prefill_routing: np.ndarray
    node_offsets: np.ndarray
    node_token: np.ndarray
    node_parent: np.ndarray
    node_depth: np.ndarray
    node_log_prob: np.ndarray
    verified_offsets: np.ndarray
    verified_node: np.ndarray
    verified_argmax: np.ndarray
    verified_routing: np.ndarray
    root_argmax: np.ndarray
    root_routing: np.ndarray
    level_offsets: np.ndarray
    level_seconds: np.ndarray
    node_entropy: np.ndarray
    root_entropy: np.ndarray
    root_prob: np.ndarray
    node_accept_logit: np.ndarray
    root_accept_logit: np.ndarray

    def __len__(self) -> int:
        """Positions with a recorded tree (every output token but the last is a root)."""
        return len(self.root_argmax)

    def position(self, i: int) -> TracePosition:
        a, b = int(self.node_offsets[i]), int(self.node_offsets[i + 1])
        va, vb = int(self.verified_offsets[i]), int(self.verified_offsets[i + 1])
        la, lb = int(self.level_offsets[i]), int(self.level_offsets[i + 1])
        return TracePosition(
            root=int(self.output[i]),
            tokens=self.node_token[a:b],
            parents=self.node_parent[a:b],
            depths=self.node_depth[a:b],
            log_probs=self.node_log_prob[a:b],
            verified=self.verified_node[va:vb],
            argmax=self.verified_argmax[va:vb],
            routing=self.verified_routing[va:vb],
            root_argmax=int(self.root_argmax[i]),
            root_routing=self.root_routing[i],
            level_seconds=self.level_seconds[la:lb],
            entropy=self.node_entropy[a:b],
            root_entropy=float(self.root_entropy[i]),
            root_prob=float(self.root_prob[i]),
            accept_logit=self.node_accept_logit[a:b],
            root_accept_logit=float(self.root_accept_logit[i]),
        )

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in _ARRAYS}

    def check(self, where: str, layers: int, top_k: int, num_experts: int | None = None) -> None:
        """Raise :class:`TraceError` unless the arrays fit together (catches truncated or mixed files)."""

        def bad(why: str) -> TraceError:
            return TraceError(f"{where}: corrupt trace sequence ({why}); re-record it with `specfit record`")

        n = len(self.root_argmax)
        if len(self.output) != n + 1:
            raise bad(f"{len(self.output)} output tokens for {n} positions (expected {n + 1})")
        for offsets, items in (("node_offsets", len(self.node_token)), ("verified_offsets", len(self.verified_node)),
                               ("level_offsets", len(self.level_seconds))):
            arr = getattr(self, offsets)
            if arr.shape != (n + 1,):
                raise bad(f"{offsets} has shape {arr.shape}, expected ({n + 1},)")
            if arr[0] != 0 or arr[-1] != items or np.any(np.diff(arr) < 0):
                raise bad(f"{offsets} do not cover their {items} entries")
        m, v = len(self.node_token), len(self.verified_node)
        for name, length in (("node_parent", m), ("node_depth", m), ("node_log_prob", m), ("verified_argmax", v),
                             ("node_entropy", m), ("root_entropy", n), ("root_prob", n), ("node_accept_logit", m),
                             ("root_accept_logit", n)):
            if getattr(self, name).shape != (length,):
                raise bad(f"{name} has {len(getattr(self, name))} entries, expected {length}")
        for name, rows in (("verified_routing", v), ("root_routing", n), ("prefill_routing", len(self.prompt))):
            if getattr(self, name).shape != (rows, layers, top_k):
                raise bad(f"{name} has shape {getattr(self, name).shape}, expected ({rows}, {layers}, {top_k})")
        if n and np.any(self.root_argmax != self.output[1:]):
            raise bad("the argmax after a root is not the next output token")
        sizes = np.diff(self.node_offsets)
        if v and np.any(self.verified_node >= np.repeat(sizes, np.diff(self.verified_offsets))):
            raise bad("a verified node index lies outside its tree")
        if m:  # each node hangs from the root (depth 1) or from an earlier node one level up, in its own tree
            local = np.arange(m) - np.repeat(self.node_offsets[:-1], sizes)
            parent, depth = self.node_parent.astype(np.int64), self.node_depth.astype(np.int64)
            inside = (parent >= 0) & (parent < local)
            above = np.where(inside, np.repeat(self.node_offsets[:-1], sizes) + np.where(inside, parent, 0), 0)
            fits = np.where(parent == -1, depth == 1, inside & (depth[above] == depth - 1))
            if not fits.all():
                i = int(np.argmin(fits))
                raise bad(f"node {int(local[i])} of its tree has parent {int(parent[i])} at depth {int(depth[i])}: "
                          "not the root or an earlier node one level up")
            if not np.all(np.isfinite(self.node_log_prob) & (self.node_log_prob <= 1e-6)):
                raise bad("a node's log-probability is not a finite number <= 0")
        if num_experts is not None:
            for name in ("verified_routing", "root_routing", "prefill_routing"):
                routing = getattr(self, name)
                if routing.size and (int(routing.min()) < 0 or int(routing.max()) >= num_experts):
                    wrong = int(routing.min()) if int(routing.min()) < 0 else int(routing.max())
                    raise bad(f"{name} names expert {wrong}, outside the model's 0..{num_experts - 1}")


@dataclass
class TraceMeta:
    """Everything about a trace besides its arrays (stored as meta.json)."""

    spec: dict[str, Any]  # the MoESpec numbers (dtype as its name)
    drafter: dict[str, Any]  # name, depth, total_tokens: the limits selectors saw (ctx.max_depth/max_nodes)
    stop_token_ids: list[int] = field(default_factory=list)
    max_new_tokens: int = 0
    config: dict[str, Any] | None = None  # the recording's resolved config
    constants: dict[str, Any] | None = None  # calibrated CostConstants, when a cost model was configured
    calibration: dict[str, Any] | None = None  # the calibration's report (held-out cycle-time error), if known
    info: dict[str, Any] = field(default_factory=dict)  # engine description (cache, copy engine, ...)
    sequences: list[dict[str, Any]] = field(default_factory=list)  # file, positions, tokens per sequence
    created: str = ""
    specfit_version: str = ""
    format: str = FORMAT
    version: int = VERSION

    def moe_spec(self):  # noqa: ANN201 - a MoESpec (torch imported lazily)
        import torch

        from specfit.types.moe import MoESpec

        s = dict(self.spec)
        s["dtype"] = getattr(torch, str(s["dtype"]).removeprefix("torch."))
        s["module_names"] = tuple(s["module_names"])
        s["decoder_layers"] = tuple(s["decoder_layers"])
        return MoESpec(**s)


def spec_to_json(spec: Any) -> dict[str, Any]:
    return {
        "num_layers": spec.num_layers,
        "num_experts": spec.num_experts,
        "top_k": spec.top_k,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "dtype": str(spec.dtype).removeprefix("torch."),
        "module_names": list(spec.module_names),
        "decoder_layers": list(spec.decoder_layers),
    }


@dataclass
class Trace:
    """A recorded trace: meta plus one :class:`TraceSequence` per prompt, in recording order."""

    meta: TraceMeta
    sequences: list[TraceSequence]

    @property
    def positions(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def notes(self) -> list[str]:
        """What this trace cannot give a replay (said once, by the commands that read it)."""
        notes = []
        if self.meta.version < 2:
            notes.append(f"trace format {self.meta.version} carries no draft-head entropies or target root "
                         f"probabilities: the learned acceptance estimator falls back to its approximations "
                         f"(re-record with `specfit record` for them)")
        if self.sequences and not any(len(seq.node_token) for seq in self.sequences):
            notes.append(f"the trace holds no drafted nodes (drafter={self.meta.drafter.get('name')}): every "
                         "selector verifies the root alone and equals the oracle; record with a drafter to compare them")
        return notes

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the trace directory; refuses to mix with an existing trace unless ``overwrite``."""
        writer = TraceWriter(path)
        writer.start(self.meta.config, self.meta.spec, overwrite=overwrite)
        for i, seq in enumerate(self.sequences):
            writer.add(i, seq)
        return writer.finish(self)


def _sequence_file(i: int) -> str:
    return f"seq-{i:05d}.npz"


class TraceWriter:
    """Writes a trace directory while it is recorded: each sequence as soon as it is complete, meta last.

    ``start`` clears the folder (``meta.json`` first, so a half-replaced trace never loads) and
    writes ``partial.json``; ``add`` writes one sequence file; ``finish`` writes ``meta.json`` and
    removes ``partial.json``. ``resume`` reads back the sequences an interrupted recording of the
    same config completed.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()

    def start(self, config: dict[str, Any] | None, spec: dict[str, Any], overwrite: bool = False) -> None:
        path = check_destination(self.path, overwrite=overwrite, resume=False)
        path.mkdir(parents=True, exist_ok=True)
        (path / META_FILE).unlink(missing_ok=True)
        for old in path.glob("seq-*.npz"):
            old.unlink()
        remove_stale_temporaries(path)
        partial = {"format": FORMAT, "version": VERSION, "spec": spec, "config": config}
        write_atomic(path / PARTIAL_FILE, json.dumps(partial, indent=1, default=_jsonable) + "\n")

    def resume(self, config: dict[str, Any] | None, spec: dict[str, Any],
               ignore: tuple[str, ...] = ()) -> list[TraceSequence]:
        """The complete sequences of an interrupted recording of this config (none if there is none)."""
        path = self.path
        partial_path = path / PARTIAL_FILE
        if not partial_path.is_file():
            if path.is_dir() and any(path.glob("seq-*.npz")):
                raise TraceError(f"trace.path={path} holds sequence files but no {PARTIAL_FILE}, so their "
                                 f"recording cannot be told: set trace.overwrite=true to record afresh")
            self.start(config, spec)
            return []
        try:
            partial = json.loads(partial_path.read_text(encoding="utf-8"))
            saved_spec, saved_config = partial["spec"], partial["config"]
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceError(f"{partial_path}: corrupt ({type(exc).__name__}); set trace.overwrite=true "
                             f"to record afresh") from exc
        if partial.get("version") != VERSION:
            raise TraceError(f"trace.path={path}: the interrupted recording there is of trace format "
                             f"{partial.get('version')}, this specfit writes format {VERSION}: set "
                             f"trace.overwrite=true to record afresh")
        differs = config_difference(saved_config, config, ignore)
        if _plain(saved_spec) != _plain(spec) or differs:
            raise TraceError(f"trace.path={path}: the interrupted recording there used another config "
                             f"({differs or 'model'} differs): resume with the same settings, or set "
                             f"trace.overwrite=true to record afresh")
        remove_stale_temporaries(path)
        layers, top_k = int(spec["num_layers"]), int(spec["top_k"])
        done: list[TraceSequence] = []
        while (path / _sequence_file(len(done))).is_file():
            done.append(_read_sequence(path / _sequence_file(len(done)), layers, top_k))
        return done

    def add(self, i: int, seq: TraceSequence) -> None:
        write_atomic(self.path / _sequence_file(i), lambda f: np.savez(f, **seq.arrays()))

    def finish(self, trace: Trace) -> Path:
        from specfit.version import __version__

        meta = trace.meta
        meta.sequences = [{"file": _sequence_file(i), "positions": len(seq), "prompt_tokens": int(len(seq.prompt)),
                           "output_tokens": int(len(seq.output)), "nodes": int(len(seq.node_token))}
                          for i, seq in enumerate(trace.sequences)]
        meta.created = meta.created or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        meta.specfit_version = meta.specfit_version or __version__
        write_atomic(self.path / META_FILE, json.dumps(asdict(meta), indent=1, default=_jsonable) + "\n")
        (self.path / PARTIAL_FILE).unlink(missing_ok=True)
        return self.path


def _plain(value: Any) -> Any:
    """``value`` as JSON would give it back (so a config compares equal to its stored copy)."""
    return json.loads(json.dumps(value, default=_jsonable))


def config_difference(saved: Any, config: Any, ignore: tuple[str, ...] = ()) -> str | None:
    """The first dotted key at which a trace's stored config and ``config`` differ (as JSON would
    store them; keys in ``ignore`` skipped), or None: a resumed recording must use the same one."""
    return _first_difference(_plain(saved), _plain(config), ignore)


def _first_difference(a: Any, b: Any, ignore: tuple[str, ...] = (), prefix: str = "") -> str | None:
    """The first dotted key at which two configs differ (keys in ``ignore`` skipped), or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            name = f"{prefix}{key}"
            if name in ignore:
                continue
            found = _first_difference(a.get(key), b.get(key), ignore, name + ".")
            if found:
                return found
        return None
    return None if a == b else prefix.rstrip(".") or "config"


def check_destination(path: str | Path, overwrite: bool = False, resume: bool = False) -> Path:
    """The directory a trace may be written to (checked before recording, so a mistake costs nothing).

    An incomplete trace (no ``meta.json``) may be continued with ``resume``; a complete one is only
    replaced with ``overwrite``.
    """
    path = check_writable(path, "trace.path", directory=True)
    if path.is_dir() and any(path.iterdir()):
        complete = (path / META_FILE).is_file()
        partial = not complete and ((path / PARTIAL_FILE).is_file() or any(path.glob("seq-*.npz")))
        if not complete and not partial:
            raise TraceError(f"trace.path={path} is a non-empty directory that holds no trace: choose another path")
        if complete and not overwrite and not resume:
            raise TraceError(f"trace.path={path} already holds a trace (set trace.overwrite=true to replace it)")
        if partial and not overwrite and not resume:
            raise TraceError(f"trace.path={path} holds an incomplete recording: continue it with resume=true, "
                             f"or set trace.overwrite=true to replace it")
    return path


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def load_trace(path: str | Path, key: str = "trace.path") -> Trace:
    """Read a trace directory, checking its format version and the consistency of every file.
    ``key``: the setting that named it, for the messages (``held_out`` for fit-acceptance's)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise TraceError(f"{key}={path}: {missing_directory(path)} (a trace is a directory; record one with `specfit record`)")
    meta_path = path / META_FILE
    if not meta_path.is_file():
        if (path / PARTIAL_FILE).is_file() or any(path.glob("seq-*.npz")):
            raise TraceError(f"{path}: incomplete trace: its recording did not finish (no {META_FILE}); continue it "
                             f"with `specfit record ... resume=true trace.path={path}`")
        raise TraceError(f"{path}: no {META_FILE}, so not a specfit trace")
    try:
        data = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(f"{meta_path}: corrupt ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise TraceError(f"{meta_path}: not a specfit trace (format {found!r})")
    if data.get("version") not in READABLE_VERSIONS:
        raise TraceError(f"{path}: trace format version {data.get('version')}, this specfit reads version {VERSION}: "
                         f"re-record it with `specfit record`")
    try:
        meta = TraceMeta(**{k: v for k, v in data.items() if k in TraceMeta.__dataclass_fields__})
        layers, top_k = int(meta.spec["num_layers"]), int(meta.spec["top_k"])
        experts = int(meta.spec["num_experts"]) if "num_experts" in meta.spec else None
        files = [entry["file"] for entry in meta.sequences]
    except (TypeError, KeyError, ValueError) as exc:
        raise TraceError(f"{meta_path}: corrupt ({type(exc).__name__}: {exc})") from exc
    root = path.resolve()
    sequences = []
    for name in files:
        if not isinstance(name, str) or "\0" in name or name in ("", ".", "..") or Path(name).name != name \
                or not (path / name).resolve().is_relative_to(root):
            raise TraceError(f"{meta_path}: sequence file {name!r} lies outside the trace folder; refused")
        file = path / name
        if not file.is_file():
            raise TraceError(f"{path}: {name} is missing (the trace is incomplete)")
        sequences.append(_read_sequence(file, layers, top_k, version=int(meta.version), num_experts=experts))
    return Trace(meta, sequences)


def _read_sequence(file: Path, layers: int, top_k: int, version: int = VERSION,
                   num_experts: int | None = None) -> TraceSequence:
    """One sequence file of format ``version``; the arrays later versions added read as NaN."""
    absent = {k for v, names in ADDED_IN.items() if v > version for k in names}
    expected = tuple(k for k in _ARRAYS if k not in absent)
    try:
        with np.load(file, allow_pickle=False) as npz:
            missing = [k for k in expected if k not in npz.files]
            if missing:
                raise TraceError(f"{file}: corrupt trace sequence (no {', '.join(missing)})")
            arrays = {k: npz[k] for k in expected}
    except TraceError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        if "pickle" in str(exc):  # numpy's words for "not an .npz archive" mention a loader flag
            raise TraceError(f"{file}: corrupt (not an .npz archive of arrays)") from exc
        raise TraceError(f"{file}: corrupt ({type(exc).__name__}: {exc})") from exc
    positions, nodes = len(arrays["root_argmax"]), len(arrays["node_token"])
    for name in absent:
        arrays[name] = np.full(nodes if name.startswith("node_") else positions, np.nan,
                               dtype=np.float64 if name == "root_prob" else np.float32)
    seq = TraceSequence(**arrays)
    seq.check(str(file), layers, top_k, num_experts)
    return seq

"""The trace format: what is recorded per position, the round trip to disk, and clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import tiny_model
from drafters import ScriptedDrafter

from specfit import Engine
from specfit.decode.sampling import SamplingParams
from specfit.types.tree import DraftTree
from specfit.errors import ConfigError
from specfit.interfaces import SelectionContext
from specfit.plugins.caches.lru import LRUCache
from specfit.trace import Trace, TraceError, load_trace
from specfit.trace.format import VERSION
from specfit.trace.record import CandidateUnionSelector, record

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]
N = 16


@pytest.fixture(scope="module")
def reference() -> list[int]:
    with torch.no_grad():
        out = tiny_model().generate(torch.tensor([PROMPT]), max_new_tokens=N, min_new_tokens=N, do_sample=False)
    return out[0].tolist()


@pytest.fixture(scope="module")
def trace(reference) -> Trace:
    drafter = ScriptedDrafter(reference, vocab=256, branching=3, depth=3, total_tokens=6, miss=0.1)
    engine = Engine(tiny_model(), cache=LRUCache(capacity=4), drafter=drafter, device="cpu")
    return record(engine, [PROMPT], max_new_tokens=N, config={"note": "test"})


def test_every_position_of_the_greedy_output_has_its_tree(trace, reference):
    seq = trace.sequences[0]
    assert seq.output.tolist() == reference[len(PROMPT):]
    assert len(seq) == N - 1 and seq.prompt.tolist() == PROMPT
    spec = trace.meta.spec
    assert seq.prefill_routing.shape == (len(PROMPT), spec["num_layers"], spec["top_k"])
    assert seq.verified_routing.dtype == np.uint8  # 16 experts
    for i in range(len(seq)):
        pos = seq.position(i)
        assert pos.root == reference[len(PROMPT) + i] and pos.root_argmax == reference[len(PROMPT) + i + 1]
        assert pos.levels == 3 and [len(pos.level(d)) for d in (1, 2, 3)] == [3, 9, 27]  # the whole drafted tree
        assert np.all(np.diff(pos.level_seconds) >= 0)
        for v in range(len(pos)):  # parents one level up
            p = pos.parents[v]
            assert (p == -1 and pos.depths[v] == 1) or (0 <= p < v and pos.depths[p] == pos.depths[v] - 1)
        verified = set(pos.verified.tolist())  # the candidate union: ancestor-closed, at least the final top 6
        assert len(verified) >= 6 and all(pos.parents[v] == -1 or pos.parents[v] in verified for v in verified)
        assert list(pos.rows(pos.verified)) == list(range(len(verified)))
        assert all(pos.rows([v])[0] == -1 for v in range(len(pos)) if v not in verified)
        # the argmax after an accepted node is the next output token: the trace is consistent
        path = pos.accepted_path()
        for j, v in enumerate(path):
            assert pos.tokens[v] == reference[len(PROMPT) + i + 1 + j]
    assert any(seq.position(i).accepted_path() for i in range(len(seq)))  # the scripted drafter is accepted


def test_candidate_union_keeps_nodes_that_later_levels_push_out():
    tree = DraftTree(root_token=1)
    ctx = SelectionContext(resident=np.zeros((1, 1), bool), draft_seconds=0.0, max_depth=2, max_nodes=2)
    selector = CandidateUnionSelector()
    tree.add_level([-1, -1, -1], [10, 11, 12], [-0.1, -2.0, -3.0])
    assert selector.select(tree, ctx).nodes == [0, 1]
    tree.add_level([0, 0], [20, 21], [-0.2, -0.3])  # path log-probs -0.3, -0.4 beat node 1's -2.0
    selection = selector.select(tree, ctx)
    assert selection.nodes == [0, 1, 3] and not selection.stop
    assert tree.top_by_path_prob(2) == [0, 3]
    tree.add_level([3, 4], [30, 31], [-5.0, -0.01])  # the chain 0 -> 3 -> 5 adds node 5 (path -5.3)
    assert selector.select(tree, ctx).nodes == [0, 1, 3, 5]
    assert tree.top_by_path_prob(2) == [0, 3]


def test_round_trip_is_exact(trace, tmp_path):
    path = trace.save(tmp_path / "t")
    loaded = load_trace(path)
    assert loaded.meta.spec == trace.meta.spec and loaded.meta.config == {"note": "test"}
    assert loaded.meta.drafter == {"name": "scripted", "depth": 3, "total_tokens": 6}
    assert loaded.meta.version == VERSION and loaded.meta.sequences[0]["positions"] == N - 1
    for name, array in trace.sequences[0].arrays().items():
        got = loaded.sequences[0].arrays()[name]
        assert got.dtype == array.dtype and np.array_equal(got, array, equal_nan=array.dtype.kind == "f"), name
    assert loaded.meta.moe_spec().num_experts == 16


def test_save_refuses_to_overwrite_unless_asked(trace, tmp_path):
    path = trace.save(tmp_path / "t")
    with pytest.raises(TraceError, match="trace.overwrite=true"):
        trace.save(path)
    trace.save(path, overwrite=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(TraceError, match="holds no trace"):
        trace.save(tmp_path / "other", overwrite=True)


def test_load_errors_are_clear(trace, tmp_path):
    with pytest.raises(TraceError, match="no such directory"):
        load_trace(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no meta.json"):
        load_trace(tmp_path / "empty")
    path = trace.save(tmp_path / "t")
    meta = json.loads((path / "meta.json").read_text())

    (path / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(TraceError, match="version 99.*re-record"):
        load_trace(path)
    (path / "meta.json").write_text("{not json")
    with pytest.raises(TraceError, match="corrupt"):
        load_trace(path)
    (path / "meta.json").write_text(json.dumps(meta))

    data = (path / "seq-00000.npz").read_bytes()
    (path / "seq-00000.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="seq-00000.npz: corrupt"):
        load_trace(path)
    (path / "seq-00000.npz").write_bytes(b"garbage\n")  # not an archive: said so, not numpy's loader flags
    with pytest.raises(TraceError, match=r"seq-00000.npz: corrupt \(not an .npz archive of arrays\)$"):
        load_trace(path)
    (path / "seq-00000.npz").unlink()
    with pytest.raises(TraceError, match="seq-00000.npz is missing"):
        load_trace(path)

    arrays = trace.sequences[0].arrays()
    np.savez(path / "seq-00000.npz", **{**arrays, "verified_argmax": arrays["verified_argmax"][:-1]})
    with pytest.raises(TraceError, match="corrupt trace sequence"):
        load_trace(path)
    np.savez(path / "seq-00000.npz", **{k: v for k, v in arrays.items() if k != "level_seconds"})
    with pytest.raises(TraceError, match="no level_seconds"):
        load_trace(path)
    # values a replay would have failed on inside the tree, a cache or an estimator, blamed on them
    experts = trace.meta.spec["num_experts"]
    for name, value, message in (
        ("node_parent", lambda a: np.full_like(a, 99), "has parent 99 at depth 1: not the root or an earlier node"),
        ("node_log_prob", lambda a: np.full_like(a, np.nan), "log-probability is not a finite number <= 0"),
        ("verified_routing", lambda a: np.full_like(a, experts), f"verified_routing names expert {experts}, outside"),
        ("root_routing", lambda a: np.full(a.shape, -1, dtype=np.int16), "root_routing names expert -1, outside"),
    ):
        np.savez(path / "seq-00000.npz", **{**arrays, name: value(arrays[name])})
        with pytest.raises(TraceError, match=f"seq-00000.npz: corrupt trace sequence .*{message}"):
            load_trace(path)
    assert issubclass(TraceError, ConfigError)  # the CLI prints it as one line


def test_recording_needs_greedy_decoding(reference):
    engine = Engine(tiny_model(), drafter=ScriptedDrafter(reference, vocab=256), device="cpu",
                    sampling=SamplingParams(temperature=1.0))
    with pytest.raises(ConfigError, match="greedy"):
        record(engine, [PROMPT], max_new_tokens=4)

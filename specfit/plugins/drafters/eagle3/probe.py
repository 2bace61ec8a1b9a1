"""The head's own estimate that its top-1 guess at a node is the target's next token.

Draft probabilities are a poor guide to acceptance (docs/results.md): the head is sure and wrong
in some places, unsure and right in others. Its hidden state knows more. A logistic model on the
state and on three summaries of the distribution it produces (log top-1 probability, entropy,
margin to the second) separates the nodes the target accepts better than the summaries alone
(SpecDec++ trains such an acceptance head for the same reason). ``specfit fit-probe`` fits it on
the target's own text after the head is trained, and writes ``acceptance_probe.safetensors``
beside the head's weights.

The drafter records the probe's logit at the root and at every node it expands
(:meth:`DraftTree.set_accept_logit`); the ``learned`` acceptance estimator weighs it like its
other features. A head directory without the file drafts exactly as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specfit.interfaces import ModelError

PROBE_FILE = "acceptance_probe.safetensors"
SUMMARIES = ("log_top1", "entropy", "margin")  # appended to the hidden state, in this order


def probe_inputs(hidden: torch.Tensor, top_logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """float32 [n, hidden + 3]: the head's output states and the summaries of their distributions,
    from what the drafter computes anyway: the top log-probabilities ``top_logp`` [n, >= 1]
    (descending; one column: a wide margin) and the entropies [n]."""
    first = top_logp[:, 0]
    second = top_logp[:, 1] if top_logp.shape[1] > 1 else torch.full_like(first, -30.0)
    return torch.cat([hidden.float(), torch.stack([first, entropy, first - second], 1).float()], 1)


def entropies(logp: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each row of log-probabilities (a token of probability 0 adds 0: its -inf
    is clamped to a finite floor, so 0 x floor = 0, while a NaN stays NaN; 3x faster than
    ``special.entr``, which takes the log again)."""
    return -(logp.exp() * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(-1)


def summarise(logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-2 log-probabilities, entropy) of rows of log-probabilities, for :func:`probe_inputs`."""
    return torch.topk(logp, min(2, logp.shape[-1]), dim=-1).values, entropies(logp)


class AcceptanceProbe(nn.Module):
    """logit P(top-1 accepted | node accepted) = w . (x - mean) / scale + b, x = :func:`probe_inputs`."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        width = hidden_size + len(SUMMARIES)
        self.hidden_size = hidden_size
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("scale", torch.ones(width))
        self.register_buffer("weight", torch.zeros(width))
        self.register_buffer("bias", torch.zeros(1))
        self.metrics: dict[str, object] = {}  # how it was fit and how well (saved with it)

    def forward(self, hidden: torch.Tensor, top_logp: torch.Tensor, entropy: torch.Tensor) -> np.ndarray:
        """float32 [n], on the host: the logit for each of ``hidden`` [n, H] (see
        :func:`probe_inputs`). The product is numpy on weights with the standardisation folded in:
        the tree takes the logits as an array anyway, and on ten rows torch's ops cost twice this."""
        w, b = self._raw_weights()
        x = probe_inputs(hidden.detach(), top_logp.detach(), entropy.detach()).cpu().numpy()  # one transfer
        return (x @ w + b).astype(np.float32)

    def _raw_weights(self) -> tuple[np.ndarray, float]:
        """(w / scale, b - mean . w / scale): the weights on raw inputs. Cached until a buffer is
        replaced or changed in place (their version counters say so)."""
        key = tuple((id(t), t._version) for t in (self.mean, self.scale, self.weight, self.bias))
        if getattr(self, "_raw_key", None) != key:
            w = (self.weight / self.scale).double().cpu()
            self._raw = (w.float().numpy(), float(self.bias.double().cpu() - self.mean.double().cpu() @ w))
            self._raw_key = key
        return self._raw

    def score(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [n]: the logits of inputs already built by :func:`probe_inputs`."""
        x = x.to(device=self.weight.device, dtype=self.weight.dtype)
        return ((x - self.mean) / self.scale) @ self.weight + self.bias


def head_digest(head_dir: str | Path) -> str | None:
    """The digest of the head's own weight files (the probe's left out) that a probe is stamped with."""
    from specfit.interfaces import head_weights_digest

    return head_weights_digest(str(head_dir), skip=(PROBE_FILE,))


def save_probe(probe: AcceptanceProbe, head_dir: str | Path) -> Path:
    """Write ``head_dir/acceptance_probe.safetensors``: the fit's metrics in its metadata, and the
    digest of the head's weights it was fit on (:func:`load_probe` refuses it beside others)."""
    from safetensors.torch import save_file

    path = Path(head_dir) / PROBE_FILE
    state = {k: v.detach().float().contiguous().cpu() for k, v in probe.state_dict().items()}
    metadata = {"metrics": json.dumps(probe.metrics), "head_digest": head_digest(head_dir) or ""}
    save_file(state, str(path), metadata=metadata)
    return path


def restamp_probe(head_dir: str | Path) -> None:
    """Stamp the probe in ``head_dir`` with its head's present weights: for a copy of the head
    re-encoded (export's bfloat16), which is the head the probe was fit on."""
    path = Path(head_dir) / PROBE_FILE
    if path.is_file():
        save_probe(_read_probe(path, None)[0], head_dir)


def load_probe(head_dir: str | Path, hidden_size: int) -> AcceptanceProbe | None:
    """The probe saved beside a head, or None; a file that does not fit the head, or was fit on
    other weights (its stamp, where it has one), is named."""
    head_dir = Path(head_dir).expanduser()
    path = head_dir / PROBE_FILE
    if not path.is_file():
        return None
    probe, stamp = _read_probe(path, hidden_size)
    now = head_digest(head_dir)
    if stamp and now and stamp != now:
        raise ModelError(f"{path}: was fit on other weights than {head_dir}'s (head digest {stamp}, now {now}); "
                         f"refit it with specfit fit-probe or remove it")
    return probe


def _read_probe(path: Path, hidden_size: int | None) -> tuple[AcceptanceProbe, str]:
    """The probe in ``path``, checked against ``hidden_size`` (None: the file's own), and the head
    digest it is stamped with ("" where none)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata() or {}
            metrics = json.loads(metadata.get("metrics", "{}"))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelError(f"{path}: not a readable acceptance probe ({exc}); refit it with specfit fit-probe "
                         f"or remove it") from None
    if hidden_size is None:
        hidden_size = max(0, len(state.get("weight", ())) - len(SUMMARIES))
    probe = AcceptanceProbe(hidden_size)
    expected = {k: tuple(v.shape) for k, v in probe.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    if found != expected:
        raise ModelError(f"{path}: tensors {found} do not fit this head (expected {expected}: hidden_size "
                         f"{hidden_size} + {len(SUMMARIES)}); refit it with specfit fit-probe or remove it")
    if not all(bool(torch.isfinite(v).all()) for v in state.values()) or not bool((state["scale"] > 0).all()):
        raise ModelError(f"{path}: holds non-finite values or a scale <= 0; refit it with specfit fit-probe")
    probe.load_state_dict(state)
    probe.metrics = metrics if isinstance(metrics, dict) else {}
    return probe, str(metadata.get("head_digest", ""))


def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float, iterations: int = 200) -> AcceptanceProbe:
    """The probe fit by L-BFGS on inputs ``x`` [n, H + 3] (:func:`probe_inputs`) and labels ``y`` [n]
    (1: the top-1 was the target's token), with an L2 penalty ``l2`` on the standardised weights."""
    probe = AcceptanceProbe(x.shape[1] - len(SUMMARIES))
    x, y = x.float(), y.float()  # float32: [n, H + 3] at a large head's H is gigabytes already
    mean, scale = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mean) / scale
    w = torch.zeros(x.shape[1] + 1, dtype=torch.float32, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=iterations, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(z @ w[:-1] + w[-1], y) + l2 * (w[:-1] ** 2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.no_grad():
        probe.mean.copy_(mean), probe.scale.copy_(scale)
        probe.weight.copy_(w[:-1]), probe.bias.copy_(w[-1:])
    return probe

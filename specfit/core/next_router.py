"""A fitted next-layer router: layer l+1's router logits predicted from layer l's expert input.

Applying layer l+1's router to layer l's (normalised) expert input, as mixtral-offloading does,
gives a full layer of lead time but misses many picks: the residual stream moves between the two
layers. A small linear map, fitted on the target's own passes, closes most of that gap. Its
features are the two routers' logits on layer l's input, ``[x G_{l+1}^T, x G_l^T, 1]`` (2E + 1
numbers: it fits from a few hundred tokens and costs two small matmuls a layer), and it is fitted
by ridge regression towards the raw router (``W0 = [I; 0; 0]``: with no data it *is* the raw
router) onto the logits layer l+1's router then computes on its own input.

Measured offline on the demo target (fitted online on 16 held-out passages or questions of another
seed, scored on 8 others, teacher-forced; top-4 recall of layer l+1's picks, layers 1-5):

- raw router on layer l's input: prose 0.26 / 0.81 / 0.80 / 0.83 / 0.84, GSM 0.21 / 0.75 / 0.77 /
  0.80 / 0.77 (layer 1 reads the embedding layer's state, which its router was not trained on);
- fitted, after 150 tokens: prose 0.68-0.84, GSM 0.70-0.83; after 600: prose 0.71-0.86, GSM
  0.73-0.83; with all 192 hidden dims as features instead, 0.76-0.87, but only after thousands;
- for reference, layer l+1's own router on its input before attention (``source=own``, whose
  copies have only that attention to travel in): prose 0.81-0.88, GSM 0.77-0.87.

The ridge strength (``ridge``, relative to the features' mean square) moved these by at most 0.03
between 1e-4 and 1e-1. Every pass that goes through the runtime is a training sample (prefill, AR
steps, verification passes alike): the runtime's layer listener gives each layer's expert input,
so the fit needs no data, file or training step of its own. Samples are buffered and folded into
each layer's normal equations in batches; a layer refits whenever its samples have doubled.
"""

from __future__ import annotations

import torch

from specfit.core.router_probe import Router


class NextLayerRouter:
    """Predicts layer l+1's router logits from layer l's expert input, for l = 0..L-2; learns online.

    Call :meth:`observe` with every MoE layer's expert input of a pass, in layer order; it returns
    the predicted logits of the next layer (None for the last layer). A pass that skips a layer
    (an error mid-pass) pairs nothing across the gap.
    """

    def __init__(self, routers: list[Router], ridge: float = 1e-2, first_fit: int = 32, batch: int = 256) -> None:
        self.layers = len(routers)
        weights = [r.weight.detach().float() for r in routers]
        e = self.experts = weights[0].shape[0]
        biases = [r.bias.detach().float() if r.bias is not None else None for r in routers]
        # both routers' logits in one matmul: layer l+1's (the prediction's inputs), then layer l's
        # (also the training target of the pair before)
        self.project = [torch.cat([weights[l + 1], weights[l]]).T.contiguous() for l in range(self.layers - 1)]
        self.offset = [None if biases[l] is None else torch.cat([biases[l + 1], biases[l]])
                       for l in range(self.layers - 1)]
        self.last, self.last_bias = weights[-1].T.contiguous(), biases[-1]
        device = weights[0].device
        d = 2 * e + 1
        self.prior = torch.zeros(d, e, dtype=torch.float64, device=device)
        self.prior[:e] = torch.eye(e, dtype=torch.float64, device=device)
        pairs = self.layers - 1
        self.weight = [self.prior[:-1].float() for _ in range(pairs)]  # [2E, E] and the bias row [E]
        self.bias = [self.prior[-1].float() for _ in range(pairs)]
        self.gram = [torch.zeros(d, d, dtype=torch.float64, device=device) for _ in range(pairs)]
        self.cross = [torch.zeros(d, e, dtype=torch.float64, device=device) for _ in range(pairs)]
        self.samples = [0] * pairs
        self.fitted_at = [0] * pairs
        self.ridge, self.first_fit, self.batch = ridge, first_fit, batch
        # buffered samples: each layer's logits [rows, 2E] of the passes not yet folded in; the
        # last layer's own logits [rows, E]
        self._rows = 0
        self._buffer = [torch.empty(batch, 2 * e, device=device) for _ in range(pairs)]
        self._last_buffer = torch.empty(batch, e, device=device)
        self._logits: list[torch.Tensor | None] = [None] * self.layers
        self._expect = 0  # the layer the next call should be

    def observe(self, layer: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """Layer ``layer``'s expert input ``hidden`` [tokens, H]: learn from it, and predict layer
        ``layer + 1``'s router logits [tokens, E] (None after the last layer)."""
        x = hidden.reshape(-1, hidden.shape[-1]).float()
        if layer != self._expect:  # a pass that did not reach every layer: start again at its layer 0
            self._logits = [None] * self.layers
        self._expect = (layer + 1) % self.layers
        if layer + 1 == self.layers:
            last = x @ self.last if self.last_bias is None else torch.addmm(self.last_bias, x, self.last)
            self._logits[layer] = last
            self._end_pass()
            return None
        project, offset = self.project[layer], self.offset[layer]
        logits = x @ project if offset is None else torch.addmm(offset, x, project)
        self._logits[layer] = logits
        return torch.addmm(self.bias[layer], logits, self.weight[layer])

    def _end_pass(self) -> None:
        """A complete pass: buffer its samples (every layer's logits), folding the buffer in when full."""
        logits, self._logits = self._logits, [None] * self.layers
        if any(t is None for t in logits):
            return
        rows = logits[0].shape[0]
        if rows >= self.first_fit:  # a long pass (a prefill, a big tree): straight into the normal equations
            self._fold(logits[:-1], logits[-1])
            return
        if self._rows + rows > self.batch:
            self._flush()
        at, self._rows = self._rows, self._rows + rows
        for buffer, t in zip(self._buffer, logits):
            buffer[at:at + rows].copy_(t)
        self._last_buffer[at:at + rows].copy_(logits[-1])
        if not self.fitted_at[0] and self._rows >= self.first_fit:  # the first fit comes early
            self._flush()

    def _flush(self) -> None:
        if self._rows:
            n, self._rows = self._rows, 0
            self._fold([b[:n] for b in self._buffer], self._last_buffer[:n])

    def _fold(self, logits: list[torch.Tensor], last: torch.Tensor) -> None:
        """Pairs (layer l's logits -> layer l+1's own logits) into each layer's normal equations."""
        e = self.experts
        for index, source in enumerate(logits):
            target = logits[index + 1][:, e:] if index + 1 < len(logits) else last
            # one batch's sums in float32 (at most a pass or a buffer of rows), accumulated in float64
            f = torch.cat([source, torch.ones_like(source[:, :1])], dim=1)
            self.gram[index] += (f.T @ f).double()
            self.cross[index] += (f.T @ target).double()
            self.samples[index] += f.shape[0]
            if self.samples[index] >= self.first_fit and self.samples[index] >= 2 * self.fitted_at[index]:
                self.fit(index)

    def fit(self, index: int) -> None:
        """Ridge towards the raw router: (F^T F + lam I) W = F^T Y + lam W0, lam relative to F's scale.
        No host sync: the solve stays on the device."""
        gram = self.gram[index]
        lam = self.ridge * torch.diagonal(gram).mean()
        eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
        coef = torch.linalg.solve(gram + lam * eye, self.cross[index] + lam * self.prior).float()
        self.weight[index], self.bias[index] = coef[:-1].contiguous(), coef[-1].contiguous()
        self.fitted_at[index] = self.samples[index]

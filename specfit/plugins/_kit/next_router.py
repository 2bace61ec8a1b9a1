"""A fitted next-layer router: layer l+1's router logits predicted from layer l's expert input.

Applying layer l+1's router to layer l's (normalised) expert input, as mixtral-offloading does,
gives a full layer of lead time but misses many picks: the residual stream moves between the two
layers. A small linear map, fitted on the target's own passes, closes most of that gap. Its
features are the two routers' logits on layer l's input, ``[x G_{l+1}^T, x G_l^T, 1]`` (2E + 1
numbers: it fits from a few hundred tokens), and it is fitted by ridge regression towards the raw
router (``W0 = [I; 0; 0]``: with no data it *is* the raw router) onto the logits layer l+1's router
then computes on its own input. Each fit is folded into one ``[H, E]`` matrix, so a decode step's
prediction is one matmul of layer l's input, like the raw router's (a long pass, which computes
the features to learn from anyway, applies the small map to them).

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
so the fit needs no data, file or training step of its own. A pass of at least ``first_fit``
tokens (a prefill, a big tree) goes into the normal equations pair by pair as its layers arrive;
shorter passes (AR steps, small trees) are buffered as raw expert inputs, one copy a layer, and
their features are computed and folded in ``batch`` rows at a time: a decode step's hook is that
copy and the prediction's matmul. Measured in the look-ahead's hook (demo target, AR, one process,
alternating runs of the code before and after, 2026-12-07): 81-92 -> 55-66 us a layer. A pair
refits whenever its samples have doubled (at most every ``max_interval`` samples), one pair per
pass, so no pass pays for all of them; nothing here waits for the device.

What it predicts is the router's raw logits, whose top-k is the pick of a softmax router (Qwen3,
Mixtral, OLMoE, gpt-oss). A router that ranks by something else (DeepSeek-V3's sigmoid scores
with a correction bias and group-limited choice) is predicted only approximately.
"""

from __future__ import annotations

import torch

from specfit.plugins._kit.router_probe import Router


class NextLayerRouter:
    """Predicts layer l+1's router logits from layer l's expert input, for l = 0..L-2; learns online.

    Call :meth:`observe` with every MoE layer's expert input of a pass, in layer order; it returns
    the predicted logits of the next layer (None for the last layer). A pass that skips a layer
    (an error mid-pass) pairs nothing across the gap. Needs at least two MoE layers.
    """

    def __init__(self, routers: list[Router], ridge: float = 1e-2, first_fit: int = 32, batch: int = 64,
                 max_interval: int = 4096) -> None:
        if len(routers) < 2:
            raise ValueError("a next-layer router needs at least two MoE layers")
        if not 1 <= first_fit <= batch:
            raise ValueError(f"first_fit={first_fit} must be in 1..batch={batch}")
        self.layers = len(routers)
        device = routers[0].weight.device
        # fp32 on a CPU (its bf16 matmul is ~3x slower); the routers' own dtype on a GPU (memory)
        dtype = torch.float32 if device.type == "cpu" else routers[0].weight.dtype
        weights = [r.weight.detach().to(dtype) for r in routers]
        e = self.experts = weights[0].shape[0]
        if all(r.bias is None for r in routers):
            biases: list[torch.Tensor | None] = [None] * len(routers)
        else:  # a router without a bias among biased ones adds zeros
            biases = [r.bias.detach().to(dtype) if r.bias is not None else torch.zeros(r.weight.shape[0], dtype=dtype,
                      device=device) for r in routers]
        # both routers' logits in one matmul: layer l+1's (the prediction's inputs), then layer l's
        # (also the training target of the pair before)
        self.project = [torch.cat([weights[l + 1], weights[l]]).T.contiguous() for l in range(self.layers - 1)]
        self.offset = [None if biases[l + 1] is None else torch.cat([biases[l + 1], biases[l]])
                       for l in range(self.layers - 1)]
        self.last, self.last_bias = weights[-1].T.contiguous(), biases[-1]
        self.dtype = dtype
        d = 2 * e + 1
        self.prior = torch.zeros(d, e, dtype=torch.float64, device=device)
        self.prior[:e] = torch.eye(e, dtype=torch.float64, device=device)
        pairs = self.layers - 1
        self.weight = [self.prior[:-1].float() for _ in range(pairs)]  # [2E, E] and the bias row [E]
        self.bias = [self.prior[-1].float() for _ in range(pairs)]
        # the fit folded into the projection: a prediction is one matmul of layer l's input
        self.fused: list[torch.Tensor] = [None] * pairs  # type: ignore[list-item]  # [H, E]
        self.fused_bias: list[torch.Tensor] = [None] * pairs  # type: ignore[list-item]  # [E]
        for index in range(pairs):
            self._fuse(index)
        self.gram = [torch.zeros(d, d, dtype=torch.float64, device=device) for _ in range(pairs)]
        self.cross = [torch.zeros(d, e, dtype=torch.float64, device=device) for _ in range(pairs)]
        self.samples = [0] * pairs
        self.fitted_at = [0] * pairs
        self.ridge, self.first_fit, self.batch, self.max_interval = ridge, first_fit, batch, max_interval
        # short passes' expert inputs, every layer's, buffered as they come (one copy a layer); their
        # features and targets are computed ``batch`` rows at a time when they are folded in
        self._rows = 0  # rows of complete passes in the buffer
        self._hidden = torch.empty(self.layers, batch, weights[0].shape[1], dtype=dtype, device=device)
        self._previous: torch.Tensor | None = None  # a long pass's features of the layer before
        self._expect = 0  # the layer the next call should be
        self._at = 0  # this pass's first buffer row; -1: a long pass, folded directly
        self._pass_rows, self._complete = 0, False  # this pass's tokens; every layer so far in order
        self._due: list[int] = []  # pairs whose samples doubled since their fit, refitted one a pass

    def observe(self, layer: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """Layer ``layer``'s expert input ``hidden`` [tokens, H]: learn from it, and predict layer
        ``layer + 1``'s router logits [tokens, E] (None after the last layer), in ``self.dtype``
        (float32 on a CPU, the routers' dtype elsewhere). A short pass costs one copy into the
        buffer and one matmul a layer."""
        x = hidden.reshape(-1, hidden.shape[-1]).to(self.dtype)
        if layer != self._expect or (layer and x.shape[0] != self._pass_rows):
            # a pass that did not reach every layer (or another one begun where it stopped): start
            # again at this layer, pairing nothing across the gap
            self._previous, self._complete = None, False
        if layer == 0:
            self._begin_pass(x.shape[0])
        features = None
        if self._complete:  # a pass cut short, or begun mid-way, teaches nothing
            if self._at < 0:
                features = self._learn_now(layer, x)
            else:
                self._hidden[layer, self._at:self._at + x.shape[0]] = x
        self._expect = (layer + 1) % self.layers
        if layer + 1 == self.layers:
            self._end_pass()
            return None
        if features is not None:  # a long pass computed them to learn: the small map on them is cheaper
            return torch.addmm(self.bias[layer], features.float(), self.weight[layer]).to(self.dtype)
        return torch.addmm(self.fused_bias[layer], x, self.fused[layer])

    def _logits(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Layer ``layer``'s features for its pair (the two routers' logits; None for the last
        layer) and its own router logits, the target of the pair before."""
        if layer + 1 == self.layers:
            return None, x @ self.last if self.last_bias is None else torch.addmm(self.last_bias, x, self.last)
        project, offset = self.project[layer], self.offset[layer]
        logits = x @ project if offset is None else torch.addmm(offset, x, project)
        return logits, logits[:, self.experts:]

    def _learn_now(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """A long pass: each pair goes into the normal equations as its second layer arrives;
        returns the layer's features (None for the last layer)."""
        features, own = self._logits(layer, x)
        if self._previous is not None and layer > 0:
            self._fold(layer - 1, self._previous, own)
        self._previous = features
        return features

    def _begin_pass(self, rows: int) -> None:
        self._complete, self._pass_rows, self._previous = True, rows, None
        if rows >= self.first_fit:  # a long pass: each pair straight into the normal equations
            self._at = -1
            return
        if self._rows + rows > self.batch:
            self._flush()
        self._at = self._rows

    def _end_pass(self) -> None:
        """The last layer: a short pass's rows are now complete; refit one pair that is due."""
        if self._at >= 0 and self._complete:
            self._rows = self._at + self._pass_rows
        if not self.fitted_at[0] and self._rows >= self.first_fit:  # the first fit comes early
            self._flush()
        if self._due:
            self.fit(self._due.pop(0))

    def _flush(self) -> None:
        n, self._rows = self._rows, 0
        if n:
            logits = [self._logits(layer, self._hidden[layer, :n]) for layer in range(self.layers)]
            for index in range(self.layers - 1):
                self._fold(index, logits[index][0], logits[index + 1][1])

    def _fold(self, index: int, source: torch.Tensor, target: torch.Tensor) -> None:
        """Samples (layer l's logits -> layer l+1's own logits) into pair l's normal equations.
        Non-finite values (a NaN in the model) are zeroed, so one cannot spoil every later fit."""
        # one batch's sums in float32 (a pass or a buffer of rows), accumulated in float64
        f = torch.nan_to_num(torch.cat([source, torch.ones_like(source[:, :1])], dim=1).float(),
                             nan=0.0, posinf=0.0, neginf=0.0)
        y = torch.nan_to_num(target.float(), nan=0.0, posinf=0.0, neginf=0.0)
        self.gram[index] += (f.T @ f).double()
        self.cross[index] += (f.T @ y).double()
        self.samples[index] += f.shape[0]
        n, fitted = self.samples[index], self.fitted_at[index]
        if n >= self.first_fit and n - fitted >= min(max(fitted, 1), self.max_interval) and index not in self._due:
            self._due.append(index)

    def fit(self, index: int) -> None:
        """Ridge towards the raw router: (F^T F + lam I) W = F^T Y + lam W0, lam relative to F's
        scale. ``solve_ex`` does not check for errors, so nothing waits for a device; a fit that
        is not finite keeps the weights before it."""
        gram = self.gram[index]
        lam = self.ridge * torch.diagonal(gram).mean()
        eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
        coef = torch.linalg.solve_ex(gram + lam * eye, self.cross[index] + lam * self.prior)[0].float()
        old = torch.cat([self.weight[index], self.bias[index][None]])
        coef = torch.where(torch.isfinite(coef), coef, old)
        self.weight[index], self.bias[index] = coef[:-1].contiguous(), coef[-1].contiguous()
        self.fitted_at[index] = self.samples[index]
        self._fuse(index)

    def _fuse(self, index: int) -> None:
        """Fold pair ``index``'s fit into its projection: ``(x P + o) W + b = x (P W) + (o W + b)``."""
        weight, offset = self.weight[index], self.offset[index]
        bias = self.bias[index] if offset is None else self.bias[index] + offset.float() @ weight
        self.fused[index] = (self.project[index].float() @ weight).to(self.dtype)
        self.fused_bias[index] = bias.to(self.dtype)

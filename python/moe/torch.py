"""moe.torch - one MoE layer held by the moe service, as a torch.nn.Module.

    import moe, moe.torch, torch
    c = moe.Client("tcp://127.0.0.1:7000")
    c.model_create("m", layers=2, d_model=512, d_ff=1024, n_experts=8, top_k=2)
    net = torch.nn.Sequential(torch.nn.Linear(64, 512), moe.torch.RemoteMoE(c, "m", 0),
                              torch.nn.Linear(512, 64))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)   # the local layers only
    loss = net(x).square().mean()
    loss.backward()         # RemoteMoE's backward runs the service's backward
    opt.step()              # updates the local layers
    c.step("m", lr=1e-3)    # updates the remote experts and router (AdamW in the service)

The service holds the expert and router weights and applies the optimizer
itself: RemoteMoE has no torch parameters, a torch optimizer never sees the
remote weights, and they change only through ``client.step(model, ...)``
(or ``RemoteMoE.step``), which applies AdamW to every layer of the model and
zeroes the service's gradients. Gradients of several backwards (micro-
batches, several RemoteMoE layers of the same model) accumulate in the
service until that step.

Router losses: the service adds the gradient of ``aux_loss_coef * aux +
z_loss_coef * z`` (the model's coefficients) to its backward on its own.
Do not add them to your loss; ``RemoteMoE.aux_loss`` and ``.z_loss`` hold
the last forward's values (Python floats) for logging.
"""
from typing import Any, Dict, Optional, Tuple

import torch

from .client import Client


class _RemoteMoEFunction(torch.autograd.Function):
    """y = MoE(x) in the service; backward sends dy and returns dx."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor, module: "RemoteMoE"):
        shape = x.shape
        x2 = x.detach().reshape(-1, shape[-1])
        y, handle, stats = module.client.forward_train(module.model, module.layer, x2,
                                                       return_stats=True)
        module._record(stats)
        ctx.client = module.client
        ctx.handle = handle
        ctx.shape = shape
        ctx.used = False
        return y.reshape(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None]:
        if ctx.used:
            raise RuntimeError("RemoteMoE: the service's backward of one forward runs once "
                               "(retain_graph=True and a second backward are not supported)")
        ctx.used = True
        dy2 = dy.reshape(-1, ctx.shape[-1]).contiguous()
        # always sent, even when x needs no gradient: the service accumulates
        # the weight gradients in this backward
        dx = ctx.client.backward(ctx.handle, dy2)
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return dx.reshape(ctx.shape), None, None


class RemoteMoE(torch.nn.Module):
    """Layer `layer` of model `model` on the service, as a module.

    forward(x): x (..., d_model), float32 / float16 / bfloat16, CPU or CUDA;
    returns y of the same shape, dtype and device. With autograd recording
    (torch.is_grad_enabled()) and either the module in training mode or x
    requiring grad, it runs a training forward and its backward calls the
    service's backward (dx back to torch, the expert and router gradients
    kept in the service); otherwise an inference forward.

    The remote weights are updated by ``client.step(model, ...)`` (or
    ``self.step(...)``), not by a torch optimizer: this module has no
    parameters. ``last_stats`` is the last forward's stats dict
    (tokens_per_expert, dropped, imbalance, aux_loss, z_loss, phase times);
    ``aux_loss`` and ``z_loss`` its router losses (floats, for logging: their
    gradients are already in the service's backward).
    """

    def __init__(self, client: Client, model: str, layer: int = 0):
        """client: an open moe.Client; model: a model created on the service
        (model_create); layer: which of its layers. Checks that both exist
        (moe.NotFoundError) and reads the model's config."""
        super().__init__()
        self.client = client
        self.model = model
        self.layer = int(layer)
        info = client.model_info(model)
        self.config: Dict[str, Any] = dict(info.get("config", {}))
        layers = int(self.config.get("layers", 0))
        if not 0 <= self.layer < layers:
            raise IndexError("model %r has %d layers, not layer %d" % (model, layers, layer))
        self.d_model = int(self.config.get("d_model", 0))
        self.last_stats: Dict[str, Any] = {}
        self.aux_loss = 0.0
        self.z_loss = 0.0

    def _record(self, stats: Dict[str, Any]) -> None:
        self.last_stats = stats
        self.aux_loss = float(stats.get("aux_loss", 0.0))
        self.z_loss = float(stats.get("z_loss", 0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.d_model:
            raise ValueError("RemoteMoE %s layer %d: x has last dimension %d, d_model is %d" %
                             (self.model, self.layer, x.shape[-1], self.d_model))
        if torch.is_grad_enabled() and (self.training or x.requires_grad):
            # an input that requires grad, so that backward runs (and the
            # service gets dy for its weight gradients) even when x needs none
            anchor = torch.empty(0, requires_grad=True)
            return _RemoteMoEFunction.apply(x, anchor, self)
        shape = x.shape
        y, stats = self.client.forward(self.model, self.layer, x.detach().reshape(-1, shape[-1]))
        self._record(stats)
        return y.reshape(shape)

    def step(self, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
             eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
             expect_step: Optional[int] = None) -> Tuple[int, float]:
        """client.step for this module's model (every layer of it): AdamW in
        the service on the gradients accumulated since the last step.
        Returns (step count, gradient norm)."""
        return self.client.step(self.model, lr=lr, betas=betas, eps=eps,
                                weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                                expect_step=expect_step)

    def extra_repr(self) -> str:
        c = self.config
        return "model=%r, layer=%d, d_model=%d, d_ff=%s, n_experts=%s, top_k=%s" % (
            self.model, self.layer, self.d_model, c.get("d_ff"), c.get("n_experts"),
            c.get("top_k"))

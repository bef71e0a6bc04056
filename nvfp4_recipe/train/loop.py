"""One training run: build the model, apply a recipe, train with AdamW, evaluate on held-out files.

Steps run in one of three modes (``config.MODES``): ``eager``, the plain loop; ``graph``, the whole
step (forward, backward, gradient clipping, AdamW) captured once in a CUDA graph and replayed, which
removes the host's launch cost of the many small kernels (NVFP4 quantization passes in particular);
``compile``, each repeated block compiled by torch.compile (``blocks.repeated_blocks``, as
torchtitan compiles per block), which also works under DDP. ``eager`` and ``graph`` compute the same
bits: both use AdamW with ``capturable=True`` and the learning rate as a device tensor set before
every step. ``compile`` runs the same NVFP4 kernels on inputs that Inductor's fused bf16 arithmetic
may round differently, so its losses match eager's to rounding.
"""

import math
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from ..blocks import repeated_blocks
from ..inspect import QuantStats
from ..layer import NVFP4Module
from .config import TrainConfig
from .data import Batches
from .model import TinyLM, count_params
from .parallel import DataParallel
from .recipes import apply_recipe, quantized_fraction


@dataclass
class RunResult:
    """What one recipe's run produced. Losses are mean cross-entropy in nats per byte."""

    recipe: str
    status: str                     # "ok" or why the run stopped early
    steps: int                      # optimizer steps done
    params: int
    quantized: str                  # e.g. "8/9 linears in NVFP4" (and the experts layers)
    train_loss: float               # mean over the last tenth of the steps
    val_loss: float                 # on the validation windows after the last step
    tokens_per_s: float             # training steps only, after the first few (JIT warm-up)
    mode: str                       # the step mode: "eager", "graph" or "compile"
    peak_memory_bytes: Optional[int]  # CUDA peak allocated; None on CPU
    wall_s: float
    seed: int = 0                   # TrainConfig.seed of the run (init, data order, SR streams)
    train_curve: List[float] = field(default_factory=list)             # loss of every step
    val_curve: List[List[float]] = field(default_factory=list)  # [step, val loss], from step 0
    quant_stats: List[dict] = field(default_factory=list)  # inspect.QuantStats.history

    def as_dict(self) -> dict:
        return asdict(self)


def lr_lambda(cfg: TrainConfig):
    """Learning-rate multiplier of step s: linear warm-up, then cosine decay to min_lr_ratio."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """AdamW (betas 0.9, 0.95) with weight decay on matrices only, and a function ``set_lr(step)``
    applying the warm-up/cosine schedule. On CUDA the optimizer is capturable (its state and the
    learning rate are device tensors), so that a CUDA graph can hold the step; the same optimizer
    runs the eager mode, so the two modes compute the same bits."""
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    capturable = device.type == "cuda"
    lr = torch.tensor(cfg.lr, device=device) if capturable else cfg.lr
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), capturable=capturable)
    schedule = lr_lambda(cfg)

    def set_lr(step: int) -> None:
        for group in opt.param_groups:
            if capturable:
                group["lr"].fill_(cfg.lr * schedule(step))
            else:
                group["lr"] = cfg.lr * schedule(step)
    return opt, set_lr


def autocast_context(device: torch.device, dtype: Optional[torch.dtype], cache_enabled: bool = True):
    """torch.autocast to ``dtype`` on ``device``, or no autocast when ``dtype`` is None."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache_enabled)


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats, fp32 scalar) of int64 inputs/targets (B, T)."""
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model, batches: Batches, cfg: TrainConfig, device, dtype) -> float:
    """Mean cross-entropy in nats over the fixed validation windows (about cfg.eval_tokens tokens)."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), 0
    with autocast_context(device, dtype):
        for x, y in batches.val_batches(cfg.eval_tokens, device):
            total += lm_loss(model, x, y) * y.numel()
            count += y.numel()
    model.train(was_training)
    return (total / count).item()


def build_model(cfg: TrainConfig, recipe: str, device: torch.device) -> torch.nn.Module:
    """The model for ``recipe``: initialized from ``cfg.seed`` on the CPU (the same weights on every
    device and for every recipe), moved to ``device``, then ``quantize_``-d as the recipe says."""
    torch.manual_seed(cfg.seed)
    model = TinyLM(cfg.model_config()).to(device)
    return apply_recipe(model, recipe, cfg.seed, cfg.backend)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_function(model, opt, cfg: TrainConfig, dtype, x: torch.Tensor, y: torch.Tensor,
                  ) -> Callable[[], torch.Tensor]:
    """The training step on the batch held in ``x``, ``y`` (int64 (B, T), refilled before each call):
    forward, cross-entropy, backward, gradient clipping, AdamW; returns the loss (fp32 scalar)."""
    def step() -> torch.Tensor:
        # autocast's weight cache would outlive a CUDA graph capture: off (it changes no value)
        with autocast_context(x.device, dtype, cache_enabled=False):
            loss = lm_loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def captured(step: Callable[[], torch.Tensor], stats: Optional[QuantStats]):
    """``step`` captured in a CUDA graph (after the steps that ran on a side stream, as capture
    requires): returns (replay, the loss tensor each replay writes, and the recorded step
    :meth:`QuantStats.graphed` captured beside it in the same memory pool, or None without
    ``stats``, before a recorded step compiled the recording's kernels, or for a model it cannot
    capture: recorded steps then run eagerly)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    record = None
    if stats is not None and stats.history and stats.graphable():  # after an eager recorded step
        record = stats.graphed(step, pool=graph.pool())
    return graph.replay, loss, record


def train_run(recipe: str, cfg: TrainConfig, batches: Batches, device: torch.device,
              dtype: Optional[torch.dtype], progress: bool = True,
              parallel: Optional[DataParallel] = None,
              on_trained: Optional[Callable[[torch.nn.Module], None]] = None) -> RunResult:
    """Train one recipe for ``cfg.steps`` steps and evaluate it.

    Args:
        recipe: a name in :data:`recipes.RECIPES`.
        batches: the data; its generator is re-seeded here so that every recipe sees the same order.
        device: where to train.
        dtype: autocast dtype (torch.bfloat16) or None for the default dtype (float32).
        progress: show a tqdm bar on stderr.
        parallel: data parallelism over torchrun's processes (:mod:`.parallel`): the model in DDP,
            each rank its share of every batch; rank 0 evaluates (the others' val losses are NaN)
            and tokens/s counts the tokens of all ranks.
        on_trained: called with the trained model (not the DDP wrapper) after a run that ended
            "ok" (``--export``).
    Returns:
        :class:`RunResult`; a non-finite training loss stops the run early with status saying so.
        The step mode (``cfg.step_mode``) changes the speed; "eager" and "graph" give the same
        numbers, "compile" the same to rounding.
    Raises:
        KeyboardInterrupt: passed on, after closing the progress bar.
        ValueError: ``cfg.mode`` is "graph" on a device without CUDA graphs.
    """
    from tqdm.auto import tqdm

    start = time.perf_counter()
    mode = cfg.step_mode(device, parallel is not None)
    batches.generator.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(cfg, recipe, device)
    if mode == "compile":
        for _, block in repeated_blocks(model):
            block.compile()
    if parallel is not None:
        model = parallel.wrap(model)
    evaluated = model.module if parallel is not None else model  # no DDP hooks in evaluation

    def validate() -> float:
        if parallel is not None and not parallel.is_main:
            return float("nan")
        return evaluate(evaluated, batches, cfg, device, dtype)

    def next_batch():
        x, y = batches.train_batch(device)
        return (x, y) if parallel is None else (parallel.shard(x), parallel.shard(y))

    quantized = any(isinstance(m, NVFP4Module) for m in evaluated.modules())
    stats = QuantStats(evaluated, cfg.quant_stats_every) if cfg.quant_stats_every and quantized else None
    opt, set_lr = make_optimizer(model, cfg)
    x, y = next_batch()  # the step's input buffers, refilled before every step
    step_fn = step_function(model, opt, cfg, dtype, x, y)
    run_step, graph_loss, record_step = step_fn, None, None
    capture_at = min(3, cfg.steps - 1) if mode == "graph" else -1  # eager steps before the capture
    side = torch.cuda.Stream(device) if mode == "graph" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))
    warm = min(10, cfg.steps // 5)  # steps left out of the throughput (JIT compilation, warm-up)
    losses, val_curve, status = [], [], "ok"
    t_warm = 0.0  # start of the timed steps, moved later by the time spent evaluating
    interactive = sys.stderr.isatty()
    bar = tqdm(total=cfg.steps, desc=f"{recipe:>16}", unit="step", disable=not progress,
               mininterval=0.5 if interactive else 15, file=sys.stderr, dynamic_ncols=True)
    try:
        val_curve.append([0, validate()])
        for step in range(cfg.steps):
            if step == capture_at:
                torch.cuda.current_stream(device).wait_stream(side)
                run_step, graph_loss, record_step = captured(step_fn, stats)
            if step == warm:
                _sync(device)
                t_warm = time.perf_counter()
            with torch.cuda.stream(side) if step < capture_at else nullcontext():
                if step > 0:
                    nx, ny = next_batch()
                    x.copy_(nx)
                    y.copy_(ny)
                set_lr(step)
                recorded = stats is not None and stats.due(step)
                if recorded and record_step is not None:
                    loss = record_step(step)  # the step's graph with the recording captured beside it
                elif recorded:  # eagerly (its hooks record the operands): the same bits
                    with stats.step(step):
                        loss = step_fn()
                else:
                    loss = run_step()
                    if graph_loss is not None:
                        loss = graph_loss  # the graph writes its loss in place
                losses.append(loss.clone() if parallel is None else parallel.mean(loss))
                if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps or step % 10 == 0:
                    last = losses[-1].item()
                    if not math.isfinite(last):
                        status = f"non-finite training loss at step {step}"
                        break
                    postfix = {"loss": f"{last:.3f}"}
                    if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                        _sync(device)
                        t_eval = time.perf_counter()
                        val_curve.append([step + 1, validate()])
                        t_warm += time.perf_counter() - t_eval  # keep evaluation out of the throughput
                        postfix["val"] = f"{val_curve[-1][1]:.3f}"
                    bar.set_postfix(postfix, refresh=False)
            bar.update(1)
        _sync(device)
    finally:
        bar.close()
    if on_trained is not None and status == "ok":
        on_trained(evaluated)
    curve = torch.stack(losses).float().cpu().tolist() if losses else []
    steps_done = len(curve)
    timed_steps = steps_done - warm
    elapsed = time.perf_counter() - t_warm if steps_done > warm else float("nan")
    tail = curve[-max(1, steps_done // 10):]
    return RunResult(
        recipe=recipe, status=status, steps=steps_done, params=count_params(model),
        quantized=quantized_fraction(model),
        train_loss=sum(tail) / len(tail) if tail else float("nan"),
        val_loss=val_curve[-1][1] if status == "ok" and val_curve else float("nan"),
        tokens_per_s=(timed_steps * cfg.batch_size * cfg.seq_len / elapsed if timed_steps > 0
                      else float("nan")), mode=mode,
        peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        wall_s=time.perf_counter() - start, seed=cfg.seed, train_curve=curve, val_curve=val_curve,
        quant_stats=stats.history if stats is not None else [])

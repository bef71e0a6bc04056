"""What ``nvfp4-recipe train`` is configured by, without torch (so that ``--help`` and ``--version``
do not import it): the command's name and exit statuses, the model's shape, the run's settings and
the recipes the job compares.

The recipes: the high-precision baseline and NVFP4 variants. Every NVFP4 recipe keeps the embedding
(not an nn.Linear) and the output projection ``lm_head`` in high precision, as NVFP4 pretraining
recipes do (and, in MoE models, the routers: ``quantize_``'s default); the variants each change one
field of the default ``NVFP4Recipe`` (an ablation).
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Sequence

if TYPE_CHECKING:
    import torch

PROG = "nvfp4-recipe"
EXIT_USAGE, EXIT_INTERRUPTED = 2, 130
EXIT_EXPORT_FAILED = 1  # every run finished, an --export of one failed (said on stderr)
VOCAB = 256  # bytes
MOE_EXPERTS, MOE_TOP_K = 8, 2  # of --moe
SEED_LIMIT = 2**31  # NVFP4Recipe.seed's range is [0, 2**31)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of :class:`TinyLM`. ``d_model``, ``d_ff`` and ``seq_len`` must be multiples of 16 and
    ``d_model`` a multiple of ``n_heads``. ``n_experts`` > 0 makes every feed-forward layer a
    mixture of that many SwiGLU experts of hidden size ``d_ff``, ``top_k`` of them per token."""

    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    seq_len: int
    vocab: int = VOCAB
    n_experts: int = 0
    top_k: int = 2

    def validate(self) -> None:
        """Raises ValueError naming the field (as its command-line option) when a shape is invalid."""
        for name in ("d_model", "d_ff", "seq_len"):
            value = getattr(self, name)
            if value <= 0 or value % 16:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive multiple of 16 "
                                 f"(NVFP4 blocks are 16 wide), got {value}")
        if self.n_layers < 1 or self.n_heads < 1:
            raise ValueError(f"--n-layers and --n-heads must be >= 1, got {self.n_layers} and {self.n_heads}")
        if self.d_model % self.n_heads:
            raise ValueError(f"--d-model ({self.d_model}) must be a multiple of --n-heads ({self.n_heads})")
        if self.n_experts < 0 or (self.n_experts and not 1 <= self.top_k <= self.n_experts):
            raise ValueError(f"--experts must be >= 0 and --top-k in [1, --experts], got "
                             f"{self.n_experts} and {self.top_k}")


@dataclass
class TrainConfig:
    """Everything a run depends on besides the data and the recipe (units in the field comments).

    The defaults are the ``cpu`` preset of ``nvfp4-recipe train``.
    """

    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 512
    seq_len: int = 128
    batch_size: int = 16          # sequences per step; tokens per step = batch_size * seq_len
    steps: int = 250
    lr: float = 3e-3              # peak AdamW learning rate
    min_lr_ratio: float = 0.1     # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 25        # linear warm-up
    weight_decay: float = 0.1     # on matrices (dim >= 2) only
    grad_clip: float = 1.0        # max global gradient norm
    eval_every: int = 50          # steps between validation passes (and one at step 0 and the end)
    eval_tokens: int = 16384      # validation tokens per pass
    seed: int = 0
    backend: str = "auto"         # NVFP4Recipe.backend
    mode: str = "auto"            # "eager", "graph" (CUDA only), "compile" or "auto" (step_mode)
    n_experts: int = 0            # > 0: MoE feed-forward layers of this many experts (--moe)
    top_k: int = 2                # experts per token
    quant_stats_every: int = 0    # > 0: inspect.QuantStats of the NVFP4 operands every this many steps

    def model_config(self) -> ModelConfig:
        return ModelConfig(self.d_model, self.n_layers, self.n_heads, self.d_ff, self.seq_len,
                           n_experts=self.n_experts, top_k=self.top_k)

    def validate(self) -> None:
        """Raises ValueError, naming the command-line option, for an invalid value."""
        self.model_config().validate()
        for name in ("batch_size", "steps", "eval_every", "eval_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.quant_stats_every < 0:
            raise ValueError(f"--quant-stats-every must be >= 0 (0: off), got {self.quant_stats_every}")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if not 0 < self.lr < math.inf:  # also rejects NaN, which fails every comparison
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        if not (0 <= self.min_lr_ratio <= 1 and 0 <= self.weight_decay < math.inf
                and 0 < self.grad_clip < math.inf):
            raise ValueError(f"need 0 <= min_lr_ratio <= 1, a finite weight_decay >= 0 and a finite "
                             f"grad_clip > 0, got {self.min_lr_ratio}, {self.weight_decay}, {self.grad_clip}")
        if self.mode not in ("auto", *MODES):
            raise ValueError(f"--mode must be 'auto' or one of {MODES}, got {self.mode!r}")

    def step_mode(self, device: "torch.device", data_parallel: bool = False) -> str:
        """The mode steps run in on ``device``. "auto": "graph" on CUDA in one process (dense and
        MoE: the routing's group sizes stay on the device), "compile" on CUDA under torchrun (DDP's
        gradient all-reduce is driven by host-side hooks, which a captured graph would not replay;
        compiled blocks keep the hooks and cut the host's launches), "eager" elsewhere.

        Raises:
            ValueError: "graph" on a device other than CUDA or with data parallelism.
        """
        if self.mode == "auto":
            if device.type != "cuda":
                return "eager"
            return "compile" if data_parallel else "graph"
        if self.mode == "graph" and device.type != "cuda":
            raise ValueError(f"--mode graph needs a CUDA device (CUDA graphs), got {device}")
        if self.mode == "graph" and data_parallel:
            raise ValueError("--mode graph runs one process; under torchrun use --mode compile, eager or auto")
        return self.mode


MODES = ("eager", "graph", "compile")


BASELINE = "bf16"
PAIRED_REFERENCE = "nvfp4"  # the recipe the others' gaps are compared with, seed by seed
KEEP_HIGH_PRECISION = ("lm_head",)
TAIL = 0.15  # the share of the last blocks nvfp4-tail keeps in high precision (torchtitan's advice)

# name -> NVFP4Recipe fields changed from the default (None: the high-precision baseline).
RECIPES: Dict[str, Optional[dict]] = {
    BASELINE: None,
    "nvfp4": {},
    "nvfp4-no-rht": {"rht": False},
    "nvfp4-no-sr": {"stochastic_rounding": False},
    "nvfp4-1d-weights": {"weight_2d": False},
    "nvfp4-per-token": {"scaling": "per_token"},
    "nvfp4-amax-est": {"amax_estimation": (2.0, 1.0)},
    "nvfp4-4over6": {"four_over_six": "activations"},
    "nvfp4-4over6-all": {"four_over_six": "all"},
    "nvfp4-tail": {"keep_last_blocks": TAIL},
    "nvfp4-fwd-only": {"backward_override": "high_precision"},
    "nvfp4-bwd-only": {"forward_override": "high_precision"},
    "nvfp4-fwd-only-1d-weights": {"backward_override": "high_precision", "weight_2d": False},
    "nvfp4-fwd-only-4over6": {"backward_override": "high_precision", "four_over_six": "activations"},
    "nvfp4-4over6-tail": {"four_over_six": "activations", "keep_last_blocks": TAIL},
    "nvfp4-quartet2": {"four_over_six": "activations", "four_over_six_error": "mse",
                       "weight_2d": False, "rht": False, "stochastic_rounding": False,
                       "backward_estimator": "ms_eden", "backend": "reference"},
}

DESCRIPTIONS = {
    BASELINE: "the baseline: no quantize_, every linear in the --precision dtype (bf16 autocast)",
    "nvfp4": "the default NVFP4 recipe: 2D weights, RHT on wgrad, SR on gradients, per-tensor scales",
    "nvfp4-no-rht": "nvfp4 without the random Hadamard transform (rht=False)",
    "nvfp4-no-sr": "nvfp4 with round-to-nearest gradients (stochastic_rounding=False)",
    "nvfp4-1d-weights": "nvfp4 with 1x16 weight blocks (weight_2d=False)",
    "nvfp4-per-token": "nvfp4 with per-token outer scales (scaling='per_token')",
    "nvfp4-amax-est": "nvfp4 with the post-RHT amax estimated (amax_estimation=(2.0, 1.0))",
    "nvfp4-4over6": "nvfp4 with 4/6 block scaling of the weights and activations "
                    "(four_over_six='activations', MAE, E4M3 bound 256)",
    "nvfp4-4over6-all": "nvfp4 with 4/6 on every operand, the SR gradients too (four_over_six='all')",
    "nvfp4-tail": f"nvfp4 with the last {TAIL:.0%} of the transformer blocks (rounded up) in high "
                  f"precision (keep_last_blocks={TAIL})",
    "nvfp4-fwd-only": "NVFP4 in fprop only: dgrad and wgrad in bf16 from the unquantized X and W "
                      "(backward_override='high_precision')",
    "nvfp4-bwd-only": "NVFP4 in dgrad and wgrad only: fprop in bf16 from the unquantized X and W "
                      "(forward_override='high_precision')",
    "nvfp4-fwd-only-1d-weights": "nvfp4-fwd-only with 1x16 weight blocks (weight_2d=False)",
    "nvfp4-fwd-only-4over6": "nvfp4-fwd-only with 4/6 block scaling of the weights and activations "
                             "(four_over_six='activations')",
    "nvfp4-4over6-tail": "nvfp4-4over6 and nvfp4-tail together",
    "nvfp4-quartet2": "Quartet II (arXiv 2601.22813): fprop with 4/6 (MSE, E4M3 bound 256) on 1x16 "
                      "weights and activations; dgrad and wgrad with MS-EDEN: dY and the forward's "
                      "NVFP4 W and X quantized again under a random 128-point Hadamard rotation, "
                      "values rounded to nearest, EDEN-corrected block scales rounded "
                      "stochastically (backward_estimator='ms_eden'); on the reference backend "
                      "unless --backend names another (which refuses it)",
}


def check_recipes(names: Sequence[str]) -> None:
    """Raises ValueError for an unknown or repeated recipe name, listing the valid ones."""
    for name in names:
        if name not in RECIPES:
            raise ValueError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a recipe is listed twice in {list(names)}")


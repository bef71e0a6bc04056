"""Named sizes of ``nvfp4-recipe train``: a TrainConfig plus data options; CLI options override them.

- ``cpu`` (default): finishes bf16 + nvfp4 within about 5 minutes on a 2-core CPU, where NVFP4 runs the
  exact (slow) reference implementation; it still learns far below ln 256 = 5.55 nats.
- ``gpu``: a ~40M-parameter model for a few thousand steps on one GPU; point ``--data`` at a big tree
  (site-packages) for more tokens.
- ``tiny``: seconds; for tests and smoke runs.
"""

from dataclasses import replace

from .config import TrainConfig

# Data options of a preset: max_mb caps the bytes read (a seeded subset of the files).
PRESETS = {
    "cpu": (TrainConfig(), {"max_mb": None}),
    "gpu": (TrainConfig(d_model=512, n_layers=12, n_heads=8, d_ff=2048, seq_len=512, batch_size=64,
                        steps=2000, lr=1e-3, warmup_steps=100, eval_every=250, eval_tokens=262144),
            {"max_mb": 512}),
    "tiny": (TrainConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=64, batch_size=8,
                         steps=60, lr=1e-2, warmup_steps=5, eval_every=30, eval_tokens=4096),
             {"max_mb": 2}),
}


def preset_config(name: str, **overrides) -> TrainConfig:
    """The TrainConfig of preset ``name`` with the given fields replaced (None values ignored).

    Raises:
        KeyError: unknown preset (argparse restricts the choices before this).
    """
    return replace(PRESETS[name][0], **{k: v for k, v in overrides.items() if v is not None})

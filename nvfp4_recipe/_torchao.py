"""torchao, imported without its import-time log lines (a library import prints nothing).

Every module of the package that imports torchao imports this one first, so that whichever of them
comes first, torchao is imported here, once.
"""

import logging


class _DropRecord(logging.Filter):
    """Drops the log records whose message contains ``text``."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _import_torchao_quietly() -> None:
    """Import torchao as torchao imports itself, without its import-time log lines.

    torchao decides by itself whether to load its compiled extensions (its torch-version check,
    or the user's TORCHAO_FORCE_SKIP_LOADING_SO_FILES), so a process that also uses torchao's
    float8 or MX kernels keeps them. Where an extension does not load (a CPU build of torch, a
    CUDA version it was not built for), torchao logs that; and registering its enums with torch's
    pytree logs a torch deprecation warning. Those records are dropped, during this import only.
    """
    drops = {"torchao": _DropRecord("Failed to load "),
             "torch.utils._pytree": _DropRecord("is an Enum subclass and is now natively supported")}
    for name, drop in drops.items():
        logging.getLogger(name).addFilter(drop)
    try:
        import torchao  # noqa: F401
    finally:
        for name, drop in drops.items():
            logging.getLogger(name).removeFilter(drop)


_import_torchao_quietly()

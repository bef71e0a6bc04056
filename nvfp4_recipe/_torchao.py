"""torchao, imported without its import-time log lines (a library import prints nothing).

Every module of the package that imports torchao imports this one first, so that whichever of them
comes first, torchao is imported here, once.
"""

import logging
import os


class _DropRecord(logging.Filter):
    """Drops the log records whose message contains ``text``."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _import_torchao_quietly() -> None:
    """Import torchao without its import-time log lines.

    We use torchao's Python layers only (AOBaseConfig, TorchAOBaseTensor, the quantize_ handler
    registry); its compiled extensions are built for other torch versions, so we skip loading them
    (TORCHAO_FORCE_SKIP_LOADING_SO_FILES, set for this import only unless the user set it). torchao
    then logs that it skipped them, and registering its enums with torch's pytree logs a torch
    deprecation warning; those two records are dropped, during this import only.
    """
    env = "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"
    drops = {"torchao": _DropRecord("Skipping import of cpp extensions due to " + env),
             "torch.utils._pytree": _DropRecord("is an Enum subclass and is now natively supported")}
    set_env = env not in os.environ
    if set_env:
        os.environ[env] = "1"
    for name, drop in drops.items():
        logging.getLogger(name).addFilter(drop)
    try:
        import torchao  # noqa: F401
    finally:
        for name, drop in drops.items():
            logging.getLogger(name).removeFilter(drop)
        if set_env:
            del os.environ[env]


_import_torchao_quietly()

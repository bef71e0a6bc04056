"""``python -m nvfp4_recipe`` runs the ``nvfp4-recipe`` command."""

import sys

from .cli import main

if __name__ == "__main__":  # not in a spawned worker (train --workers)
    sys.exit(main())

"""``python -m nvfp4_recipe`` runs the ``nvfp4-recipe`` command."""

import sys

from .cli import main

sys.exit(main())

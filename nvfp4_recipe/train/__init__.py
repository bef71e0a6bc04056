"""The main job: train the same small byte-level transformer under several recipes and compare.

Modules: ``config`` (the settings and the recipe table, without torch), ``data`` (the corpus of
Python sources), ``model`` (TinyLM), ``recipes`` (bf16 and the NVFP4 variants applied to a model),
``loop`` (one run), ``presets`` (sizes), ``report`` (table, JSON, plot), ``job`` (the command's run).
The command line is ``nvfp4_recipe.cli``.
"""

"""Other projects' published training recipes, ported to the scripts in algos/: one module per source project,
each exporting a dict of presets per script (e.g. `flowfactory.GRPO`), which the script merges into its PRESETS.
What each ports and what was not carried over: docs/recipes.md."""

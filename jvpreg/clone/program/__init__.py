"""Floor 3 of the engine: captured clone mode.

``capture`` records a module's clone forward once as a plain aten program and replays it while the guards hold;
``passes`` rewrites that program to fewer ops with the same values; ``replay`` is the function that runs it;
``guards`` owns everything re-checked before a replay, built on ``side_effects`` (attributes, globals, generators)
and ``value_reads``, ``value_shapes`` and ``value_guard`` (tensor values Python read, shapes that depend on values);
``checkpointed_regions`` and ``sharded_units`` capture checkpointed regions and FSDP2 units.
Imports the floors below (core, eager, rules).
"""

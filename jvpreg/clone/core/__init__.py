"""Floor 0 of the engine: what every other floor stands on.

``tensor`` (the clone batch: K blocks of one logical tensor), ``session`` (the state of a running clone forward: its
dispatcher, its routes, what it holds), ``errors`` (every error and warning the engine raises), ``registry`` (the
table from torch functions to handlers, and argument binding by the op's signature), ``device_paths`` (the host's
code path or an accelerator's), ``held_objects`` (objects with fields of their own that a model holds). Nothing here
imports another floor.
"""

"""Floor 0 of the engine: what every other floor stands on.

``tensor`` (the clone batch: K blocks of one logical tensor), ``errors`` (every error and warning the engine
raises), ``registry`` (the table from torch functions to handlers, and argument binding by the op's signature),
``device_paths`` (the host's code path or an accelerator's). Nothing here imports another floor.
"""

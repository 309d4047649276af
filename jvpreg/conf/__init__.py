"""jvpreg's Hydra configs (``pkg://jvpreg.conf``), packaged with the wheel so ``jvpreg-train`` finds them.

Importing this package registers the OmegaConf resolvers the configs use (Hydra imports it when it
loads the configs, so ``hydra.compose`` and the entry points both see them):

* ``${jvpreg.coalesce:a,b,...}``: the first argument that is not null (e.g. the data configs'
  ``image_size: ${jvpreg.coalesce:${data.resize},8}``: the resized size, else the native one).
"""
from omegaconf import OmegaConf


def _coalesce(*values):
    for v in values:
        if v is not None:
            return v
    return None


if not OmegaConf.has_resolver("jvpreg.coalesce"):
    OmegaConf.register_new_resolver("jvpreg.coalesce", _coalesce)
